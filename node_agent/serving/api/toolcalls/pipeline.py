"""One generation's output parser: reasoning first, then the tool-call parser on the content."""

from __future__ import annotations

from pagoda.node_agent.serving.api.toolcalls.base import (
    Event,
    Parsed,
    ReasoningDelta,
    TextDelta,
    ToolParser,
    assemble,
)
from pagoda.node_agent.serving.api.toolcalls.reasoning import ReasoningParser


class OutputParser:
    """Streams a generation through an optional reasoning parser and an optional tool parser:
    reasoning text comes out as ReasoningDelta (a call inside the think block stays reasoning), the
    content after it goes through the tool parser. Either may be None."""

    def __init__(self, tools: ToolParser | None = None, reasoning: ReasoningParser | None = None) -> None:
        self.tools, self.reasoning = tools, reasoning

    @property
    def invalid(self) -> int:
        """Calls the tool parser dropped so far."""
        return self.tools.invalid if self.tools else 0

    def feed(self, text: str) -> list[Event]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [TextDelta(text)])

    def finish(self) -> list[Event]:
        out = self._route(self.reasoning.finish() if self.reasoning else [])
        return out + (self.tools.finish() if self.tools else [])

    def parse(self, text: str) -> Parsed:
        """A whole generation at once (feed and finish), assembled."""
        events = self.feed(text) + self.finish()
        return assemble(events, self.invalid)

    def _route(self, events: list[ReasoningDelta | TextDelta]) -> list[Event]:
        out: list[Event] = []
        for ev in events:
            if isinstance(ev, TextDelta) and self.tools is not None:
                out += self.tools.feed(ev.text)
            elif ev.text:
                out.append(ev)
        return out
