"""The streaming machine shared by the families whose calls sit between fixed markers (Kimi-K2,
GLM, DeepSeek, Hermes): a family names its markers and parses one call's body."""

from __future__ import annotations

from typing import ClassVar

from pagoda.node_agent.serving.api.toolcalls.base import (
    Event,
    TextDelta,
    ToolParser,
    find_first,
    held_prefix,
)

TEXT, SECTION, CALL = "text", "section", "call"


class MarkedCallParser(ToolParser):
    """Text, then calls ``call[0] body call[1]``, optionally grouped in ``section[0] ... section[1]``.

    Lenient where models are: a call marker without its section opens one; a call left open is
    closed by the next call marker, the section's end, or the end of the generation (and kept when
    its body parses). Whitespace between the calls of a section is dropped; other stray text there
    is content."""

    call: ClassVar[tuple[str, str]]
    section: ClassVar[tuple[str, str] | None] = None

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._buf = ""
        self._state = TEXT
        self._searched = 0  # how far _buf was already searched for the current state's markers
        self._after_call: str | None = None  # whitespace held since the last call (None: no call yet)

    def parse_body(self, body: str) -> tuple[object, object, str | None] | None:
        """``(name, arguments, id or None)`` of one call's body, or None when it does not parse."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        rest, self._buf, self._searched = self._buf, "", 0
        if self._state == TEXT:
            self._text(rest, out)
        elif self._state == SECTION:
            out += [TextDelta(rest)] if rest.strip() else []
        else:
            out += self._close_call(rest, closed=False)
        self._state = TEXT
        return out

    def _markers(self) -> tuple[str, ...]:
        if self._state == TEXT:
            return (self.section[0], self.call[0]) if self.section else (self.call[0],)
        if self._state == SECTION:
            return (self.call[0], self.section[1]) if self.section else (self.call[0],)
        return (self.call[1], self.call[0], self.section[1]) if self.section else self.call

    def _step(self, out: list[Event]) -> bool:
        """Consume what the buffer decides; False when it needs more text."""
        markers = self._markers()
        start = max(0, self._searched - max(len(m) for m in markers) + 1)
        hit = find_first(self._buf, markers, start)
        if hit is None:
            self._searched = len(self._buf)
            if self._state == TEXT:  # release all but a possible marker start
                keep = held_prefix(self._buf, markers)
                cut = len(self._buf) - keep
                if cut:
                    self._text(self._buf[:cut], out)
                    self._buf = self._buf[cut:]
                    self._searched = len(self._buf)
            return False
        pos, marker = hit
        before, self._buf, self._searched = self._buf[:pos], self._buf[pos + len(marker) :], 0
        if self._state == TEXT:
            self._text(before, out)
            self._after_call = None if self._after_call is None else ""  # a call follows: drop it
        elif self._state == SECTION:
            out += [TextDelta(before)] if before.strip() else []
        else:
            out += self._close_call(before, closed=marker == self.call[1])
            self._after_call = ""
        self._state = self._next_state(marker)
        return True

    def _text(self, text: str, out: list[Event]) -> None:
        """Content, except whitespace right after a call: held until text follows it."""
        if self._after_call is not None:
            if not text.strip():
                self._after_call += text
                return
            text, self._after_call = self._after_call + text, None
        if text:
            out.append(TextDelta(text))

    def _next_state(self, marker: str) -> str:
        if marker == self.call[0]:
            return CALL
        if self.section and marker == self.section[0]:
            return SECTION
        if self.section and marker == self.call[1]:
            return SECTION
        return TEXT  # a section's end, or a call's end outside sections

    def _close_call(self, body: str, closed: bool) -> list[Event]:
        raw = self.call[0] + body + (self.call[1] if closed else "")
        parsed = self.parse_body(body)
        if parsed is None:
            return self._reject(raw)
        name, arguments, call_id = parsed
        return self._call(name, arguments, raw, call_id)
