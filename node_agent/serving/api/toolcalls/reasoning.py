"""Reasoning separation: the text of a think block (``<think>...</think>``) as reasoning, the rest
as content. The block opens at the start of the output, or is already open when the rendered prompt
opened it (templates that end the generation prompt with ``<think>``)."""

from __future__ import annotations

from pagoda.node_agent.serving.api.toolcalls.base import (
    ReasoningDelta,
    TextDelta,
    find_first,
    held_prefix,
)

START, REASONING, CONTENT = "start", "reasoning", "content"
KIMI_SECTION = "<|tool_calls_section_begin|>"

# name -> (start, end, markers that end the block implicitly and begin the content)
REASONING_FORMATS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "think": ("<think>", "</think>", ()),
    "kimi_k2": ("<think>", "</think>", (KIMI_SECTION,)),  # K2-Thinking may call a tool without </think>
}
ALIASES = {"deepseek_r1": "think", "qwen3": "think", "glm45": "think"}
REASONING_PARSERS = tuple(REASONING_FORMATS) + tuple(ALIASES)


class ReasoningParser:
    """Splits a generation into ReasoningDelta and TextDelta as it streams (any split of the text).
    Whitespace between the block's end and the content is dropped."""

    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        in_reasoning: bool = False,
        *,
        implicit_end: tuple[str, ...] = (),
    ) -> None:
        self.start, self.end, self.implicit_end = start, end, implicit_end
        self._state = REASONING if in_reasoning else START
        self._buf = ""
        self._skip_space = False

    @property
    def in_reasoning(self) -> bool:
        """Inside the think block now (e.g. because the prompt opened it)."""
        return self._state == REASONING

    def feed(self, text: str) -> list[ReasoningDelta | TextDelta]:
        self._buf += text
        out: list[ReasoningDelta | TextDelta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[ReasoningDelta | TextDelta]:
        out: list[ReasoningDelta | TextDelta] = []
        while self._step(out, final=True):
            pass
        return out

    def _step(self, out: list[ReasoningDelta | TextDelta], final: bool) -> bool:
        if self._state == START:
            head = self._buf.lstrip()
            if head.startswith(self.start):
                self._buf, self._state = head[len(self.start) :], REASONING
                return True
            if not final and self.start.startswith(head):
                return False  # still possibly the start marker (or only whitespace so far)
            self._state = CONTENT
            return True
        if self._state == REASONING:
            markers = (self.end, *self.implicit_end)
            hit = find_first(self._buf, markers)
            if hit is None:
                keep = 0 if final else held_prefix(self._buf, markers)
                cut = len(self._buf) - keep
                if cut:
                    out.append(ReasoningDelta(self._buf[:cut]))
                self._buf = self._buf[cut:]
                return False
            pos, marker = hit
            if pos:
                out.append(ReasoningDelta(self._buf[:pos]))
            ended = marker == self.end
            self._buf = self._buf[pos + len(marker) :] if ended else self._buf[pos:]
            self._state, self._skip_space = CONTENT, ended
            return True
        if self._skip_space:
            self._buf = self._buf.lstrip()
            self._skip_space = not self._buf
        if self._buf:
            out.append(TextDelta(self._buf))
        self._buf = ""
        return False


def reasoning_parser_for(name: str | None, prompt_text_tail: str) -> ReasoningParser | None:
    """The reasoning parser ``name`` (None: reasoning is not separated), already inside the block
    when ``prompt_text_tail`` (the end of the rendered prompt) opened it and did not close it."""
    if name is None:
        return None
    key = ALIASES.get(name, name)
    if key not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    start, end, implicit = REASONING_FORMATS[key]
    opened = prompt_text_tail.rfind(start) > prompt_text_tail.rfind(end)
    return ReasoningParser(start, end, opened, implicit_end=implicit)
