"""DeepSeek-V3 and V3.1: calls inside ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>``, each
``<｜tool▁call▁begin｜>`` ... ``<｜tool▁call▁end｜>``. V3 (and R1) write ``function<｜tool▁sep｜>NAME``
then the arguments in a fenced json block; V3.1 writes ``NAME<｜tool▁sep｜>{json}``."""

from __future__ import annotations

from pagoda.node_agent.serving.api.toolcalls.base import loads
from pagoda.node_agent.serving.api.toolcalls.markers import MarkedCallParser

SEP = "<｜tool▁sep｜>"
SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")


def _unfence(text: str) -> str:
    """The JSON inside an optional ```json ... ``` fence."""
    text = text.strip()
    if text.startswith("```"):
        text = text[3:].removeprefix("json")
        text = text.rstrip().removesuffix("```")
    return text


class DeepSeekV3Parser(MarkedCallParser):
    name = "deepseek_v3"
    structural_format = "deepseek_r1"
    section = SECTION
    call = CALL

    def parse_body(self, body: str) -> tuple[object, object, str | None] | None:
        kind, sep, rest = body.partition(SEP)
        name, newline, arguments = rest.partition("\n")
        if not sep or not newline or kind.strip() != "function":
            return None
        return name.strip(), loads(_unfence(arguments)), None


class DeepSeekV31Parser(MarkedCallParser):
    name = "deepseek_v31"
    structural_format = "deepseek_v3_1"
    section = SECTION
    call = CALL

    def parse_body(self, body: str) -> tuple[object, object, str | None] | None:
        name, sep, arguments = body.partition(SEP)
        if not sep:
            return None
        return name.strip(), loads(arguments), None
