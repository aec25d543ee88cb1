"""Reasoning separation: the think block split at every boundary, a block the prompt opened, no
block at all, Kimi-K2's implicit end at its tool section, and tool calls after the reasoning."""

from __future__ import annotations

import pytest

from pagoda.node_agent.serving.api.toolcalls import (
    REASONING_PARSERS,
    OutputParser,
    ReasoningParser,
    assemble,
    coalesce,
    get_parser,
    reasoning_parser_for,
)
from tests.serving.toolcalls.cases import TOOLS, normalized


def _split_all_ways(make, text):
    """The coalesced events of ``text`` streamed whole, and check every 2-way split and 1-char pieces
    give the same."""

    def run(pieces):
        parser = make()
        events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
        return normalized(events)

    want = run([text])
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]]) == want, f"split at {cut}"
    assert run(list(text)) == want
    return want


@pytest.mark.parametrize(
    ("text", "in_reasoning", "reasoning", "content"),
    [
        ("<think>Let me think.</think>\n\nThe answer.", False, "Let me think.", "The answer."),
        ("\n<think>\nstep 1\nstep 2\n</think>The answer.", False, "\nstep 1\nstep 2\n", "The answer."),
        ("Pondering...</think>  Answer", True, "Pondering...", "Answer"),
        ("Just an answer, <think> here is content.", False, "", "Just an answer, <think> here is content."),
        ("  <thi", False, "", "  <thi"),
        ("<think>never closed </thin", False, "never closed </thin", ""),
        ("still thinking", True, "still thinking", ""),
        ("<think></think>", False, "", ""),
        ("", False, "", ""),
    ],
)
def test_the_think_block_is_reasoning_at_every_split(text, in_reasoning, reasoning, content):
    events = _split_all_ways(lambda: ReasoningParser(in_reasoning=in_reasoning), text)
    parsed = assemble(events)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)


def test_custom_markers():
    parser = ReasoningParser("<|think|>", "<|/think|>")
    parsed = assemble(parser.feed("<|think|>a<|/think|>b") + parser.finish())
    assert (parsed.reasoning, parsed.content) == ("a", "b")


@pytest.mark.parametrize(
    ("tail", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
        ("<｜Assistant｜></think>", False),
        ("<think>a</think>then<think>", True),
    ],
)
def test_the_prompt_tail_says_whether_the_block_is_already_open(tail, opened):
    parser = reasoning_parser_for("think", tail)
    parsed = assemble(parser.feed("xyz</think>done") + parser.finish())
    assert (parsed.reasoning, parsed.content) == (("xyz", "done") if opened else ("", "xyz</think>done"))


def test_reasoning_parser_names():
    assert reasoning_parser_for(None, "<think>") is None
    assert set(REASONING_PARSERS) >= {"think", "kimi_k2", "deepseek_r1", "qwen3", "glm45"}
    for name in REASONING_PARSERS:
        assert isinstance(reasoning_parser_for(name, ""), ReasoningParser)
    with pytest.raises(ValueError, match="think"):
        reasoning_parser_for("nonesuch", "")


HERMES_AFTER_THINKING = (
    '<think>I should call get_weather. <tool_call>{"name": "get_time"}</tool_call> is only a thought.</think>\n\n'
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Quito"}}\n</tool_call>'
)
KIMI_IMPLICIT_END = (
    "<think>I need the time.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
)


@pytest.mark.parametrize(
    ("tool_parser", "reasoning", "text", "want_reasoning", "want_content", "calls"),
    [
        (
            "hermes",
            "think",
            HERMES_AFTER_THINKING,
            'I should call get_weather. <tool_call>{"name": "get_time"}</tool_call> is only a thought.',
            "Checking.\n",
            [("get_weather", '{"city": "Quito"}', False)],
        ),
        ("kimi_k2", "kimi_k2", KIMI_IMPLICIT_END, "I need the time.", "", [("get_time", "{}", True)]),
        ("kimi_k2", "think", KIMI_IMPLICIT_END, KIMI_IMPLICIT_END.removeprefix("<think>"), "", []),
    ],
)
def test_tool_calls_after_reasoning(tool_parser, reasoning, text, want_reasoning, want_content, calls):
    def make():
        return OutputParser(get_parser(tool_parser)(TOOLS), reasoning_parser_for(reasoning, ""))

    events = _split_all_ways(make, text)
    parsed = assemble(events, make().parse(text).invalid)
    assert (parsed.reasoning, parsed.content) == (want_reasoning, want_content)
    assert [(c.name, c.arguments, c.id.startswith("functions.")) for c in parsed.tool_calls] == calls
    assert parsed.invalid == 0


def test_output_parser_without_either_part_passes_text_through():
    parser = OutputParser()
    assert coalesce(parser.feed("a<think>b") + parser.finish()) == coalesce(
        OutputParser(None, None).feed("a<think>b")
    )
    assert OutputParser().parse("<think>x</think>y").content == "<think>x</think>y"
