"""Llama 3.x JSON calls: the reply is a bare object ``{"name": ..., "parameters": {...}}`` (optionally
after ``<|python_tag|>``), or several separated by ``;``. A reply that does not start with ``{`` is
plain content; an object without a ``name`` is content too (an answer in JSON, not a call)."""

from __future__ import annotations

import re

from pagoda.node_agent.serving.api.toolcalls.base import Event, TextDelta, ToolParser, loads
from pagoda.node_agent.serving.api.toolcalls.hermes import call_object

PYTHON_TAG = "<|python_tag|>"
START, CALLS, TEXT = "start", "calls", "text"
_LOOKS_LIKE_CALL = re.compile(r'\s*\{\s*"name"\s*:')
_SEPARATORS = re.compile(r"[\s;]*")


class _ObjectEnd:
    """Finds where a JSON object's closing brace is, scanning text as it grows (strings aware)."""

    def __init__(self) -> None:
        self.pos, self.depth, self.in_string, self.escaped = 0, 0, False, False

    def scan(self, text: str) -> int | None:
        """The index just past the object that ``text`` starts with, or None if it is not closed yet."""
        while self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self.pos
        return None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    structural_format = "llama"

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__(tools)
        self._buf = ""
        self._state = START
        self._sep = ""  # separators seen since the last object (content again if text follows)
        self._end = _ObjectEnd()

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self._state == CALLS and self._buf.strip():
            out += self._object(self._buf)  # an object never closed
        elif self._state != CALLS and self._buf:
            out.append(TextDelta(self._buf))
        self._buf = ""
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        if self._state == START:
            head = self._buf.lstrip()
            if not final and (not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG)):
                return False
            if head.startswith(PYTHON_TAG):
                self._buf, self._state = head[len(PYTHON_TAG) :], CALLS
            else:
                self._state = CALLS if head.startswith("{") else TEXT
            return True
        if self._state == TEXT:
            out += [TextDelta(self._buf)] if self._buf else []
            self._buf = ""
            return False
        cut = _SEPARATORS.match(self._buf).end()
        self._sep, rest = self._sep + self._buf[:cut], self._buf[cut:]
        self._buf = rest
        if not rest:
            return False
        if not rest.startswith("{"):
            self._buf, self._sep, self._state = self._sep + rest, "", TEXT
            return True
        end = self._end.scan(rest)
        if end is None:
            return False
        self._buf, self._end = rest[end:], _ObjectEnd()
        out += self._object(rest[:end])
        return True

    def _object(self, raw: str) -> list[Event]:
        """A call when ``raw`` is one, else content (counted invalid when it looked like a call)."""
        sep, self._sep = self._sep, ""
        parsed = call_object(loads(raw), ("parameters", "arguments"))
        if parsed is not None:
            events = self._call(*parsed, raw=sep + raw)
        elif _LOOKS_LIKE_CALL.match(raw):
            events = self._reject(sep + raw)
        else:
            events = [TextDelta(sep + raw)]
        return events
