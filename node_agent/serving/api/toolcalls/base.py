"""The tool-call parser contract: parsed calls, the streaming events, the parser base class (each
family subclass registers itself by name) and the helpers every family shares."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    """One call as OpenAI returns it: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass
class Parsed:
    """A whole generation, parsed: the content text, the calls, and how many calls were dropped."""

    content: str
    tool_calls: list[ToolCall]
    invalid: int = 0
    reasoning: str = ""


@dataclass
class TextDelta:
    """Content text (outside any call)."""

    text: str


@dataclass
class CallStart:
    """A new call: its index among this generation's calls, its id and its function's name."""

    index: int
    id: str
    name: str


@dataclass
class ArgsDelta:
    """A piece of call ``index``'s arguments JSON text."""

    index: int
    text: str


@dataclass
class ReasoningDelta:
    """Reasoning text (inside the think block)."""

    text: str


Event = TextDelta | CallStart | ArgsDelta | ReasoningDelta

REGISTRY: dict[str, type[ToolParser]] = {}


def new_call_id() -> str:
    """A fresh OpenAI-style call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def function_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """``{function name: parameters schema}`` of a request's OpenAI tool dicts."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def loads(text: str) -> Any:
    """``json.loads`` that answers None for text that is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could still grow into one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The earliest ``(position, marker)`` of any of ``markers`` in ``text`` from ``start``."""
    best: tuple[int, str] | None = None
    for marker in markers:
        pos = text.find(marker, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, marker)
    return best


class ToolParser:
    """Incremental parser of one generation in one family's tool-call format.

    ``feed`` takes text as it is generated (split anywhere, even inside a marker) and returns the
    events it can already decide; ``finish`` flushes the rest. Content is released as soon as it
    cannot be the start of a marker. A call reaches the caller only when its function is one of the
    request's tools and its arguments are a JSON object; otherwise its raw text is content and
    ``invalid`` counts it."""

    name: ClassVar[str]
    structural_format: ClassVar[str | None] = None  # xgrammar's get_model_structural_tag key

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            REGISTRY[cls.name] = cls

    def __init__(self, tools: list[dict] | None) -> None:
        self.functions = function_schemas(tools)
        self.invalid = 0
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _call(self, name: object, arguments: object, raw: str, call_id: str | None = None) -> list[Event]:
        """The events of one parsed call: start and arguments when the function is offered and the
        arguments are an object, else ``raw`` as content (counted invalid)."""
        if not isinstance(name, str) or name not in self.functions or not isinstance(arguments, dict):
            return self._reject(raw)
        index = self._calls
        self._calls += 1
        text = json.dumps(arguments, ensure_ascii=False)
        return [CallStart(index, call_id or new_call_id(), name), ArgsDelta(index, text)]

    def _reject(self, raw: str) -> list[Event]:
        self.invalid += 1
        return [TextDelta(raw)] if raw else []


@dataclass
class _Assembly:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, ToolCall] = field(default_factory=dict)


def assemble(events: list[Event], invalid: int = 0) -> Parsed:
    """One ``Parsed`` from a stream of events (what a client assembling the deltas ends with)."""
    acc = _Assembly()
    for ev in events:
        if isinstance(ev, TextDelta):
            acc.content.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            acc.reasoning.append(ev.text)
        elif isinstance(ev, CallStart):
            acc.calls[ev.index] = ToolCall(ev.id, ev.name, "")
        elif isinstance(ev, ArgsDelta):
            acc.calls[ev.index].arguments += ev.text
    calls = [acc.calls[i] for i in sorted(acc.calls)]
    return Parsed("".join(acc.content), calls, invalid, "".join(acc.reasoning))


def coalesce(events: list[Event]) -> list[Event]:
    """``events`` with adjacent text (or reasoning, or same-call argument) pieces joined and empty
    ones dropped: two streams of the same output coalesce to the same list however split."""
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, TextDelta | ReasoningDelta | ArgsDelta) and not ev.text:
            continue
        last = out[-1] if out else None
        if isinstance(ev, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + ev.text)
        elif isinstance(ev, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + ev.text)
        elif isinstance(ev, ArgsDelta) and isinstance(last, ArgsDelta) and last.index == ev.index:
            out[-1] = ArgsDelta(ev.index, last.text + ev.text)
        else:
            out.append(ev)
    return out
