"""The offline Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Iterator

from pagoda.node_agent.engine.config import EngineConfig
from pagoda.node_agent.engine.llm_engine import LLMEngine, RequestOutput
from pagoda.node_agent.params import SamplingParams


class LLM:
    """Batch generation over the engine; every prompt runs concurrently with continuous batching."""

    def __init__(
        self, model: str = "builtin://smollm2-135m", config: EngineConfig | None = None, **kw
    ) -> None:
        config = config or EngineConfig(model=model, **kw)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self, prompts: str | list, params: SamplingParams | None = None, chat: bool = False
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.engine.add_request(p, params or SamplingParams(), chat=chat) for p in prompts]
        final = self.engine.run_until_done()
        return [final[i] for i in ids]

    def stream(
        self, prompt: str | list, params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[RequestOutput]:
        """Yield outputs of one request as tokens arrive (other queued requests progress too)."""
        rid = self.engine.add_request(prompt, params or SamplingParams(), chat=chat)
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
