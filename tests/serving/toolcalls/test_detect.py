"""Which parsers a model gets: its chat template's markers first, its model_type when the template
takes tools in no known format, the generic mode when the template takes no tools."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.node_agent.serving.api.toolcalls import PARSERS, detect_reasoning_parser, detect_tool_parser

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS_NO_MARKERS = (
    "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)


@pytest.mark.parametrize("name", sorted(set(PARSERS) - {"generic"}))
def test_each_family_template_is_detected(name):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    assert detect_tool_parser(None, template) == name
    assert detect_tool_parser("llama", template) == name  # the template outranks the model type


@pytest.mark.parametrize(
    ("template", "model_type", "want"),
    [
        (
            '{% if tools %}{{ "<tool_call>" + tc.name }}{% for k, v in args %}<arg_key>{{ k }}</arg_key><arg_value>',
            "glm4_moe",
            "glm47",
        ),
        (
            "{% if tools %}<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{% endif %}",
            None,
            "glm45",
        ),
        (
            "{% if tools %}<｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>{{ args }}{% endif %}",
            "deepseek_v3",
            "deepseek_v31",
        ),
        ("{% if tools %}{{'<|python_tag|>'}}{% endif %}", None, "llama3_json"),
        (
            "{% if tools %}<tool_call>\n<function={{ name }}>\n<parameter=k>{% endif %}",
            "qwen3_moe",
            "generic",
        ),
        (TOOLS_NO_MARKERS, "qwen3", "hermes"),
        (TOOLS_NO_MARKERS, "kimi_k2", "kimi_k2"),
        (TOOLS_NO_MARKERS, "glm4_moe", "glm45"),
        (TOOLS_NO_MARKERS, "mistral", "generic"),
        (TOOLS_NO_MARKERS, None, "generic"),
        (SMOLLM2, "llama", "generic"),
        (SMOLLM2, "kimi_k2", "generic"),
        (None, "qwen3", "generic"),
        ("", None, "generic"),
        ("{{ toolset }} <tool_call>", None, "generic"),  # no `tools` variable: no tool support
    ],
)
def test_detect_tool_parser(template, model_type, want):
    assert detect_tool_parser(model_type, template) == want


@pytest.mark.parametrize(
    ("template", "model_type", "want"),
    [
        ("{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}", "qwen3", "think"),
        ((TEMPLATES / "kimi_k2.jinja").read_text(), "kimi_k2", "kimi_k2"),
        ("{{ '<think>' }}", "kimi_k2", "kimi_k2"),
        ((TEMPLATES / "deepseek_v31.jinja").read_text(), "deepseek_v3", "think"),
        (SMOLLM2, "llama", None),
        ((TEMPLATES / "llama3_json.jinja").read_text(), "llama", None),
        (None, "qwen3", None),
    ],
)
def test_detect_reasoning_parser(template, model_type, want):
    assert detect_reasoning_parser(model_type, template) == want
