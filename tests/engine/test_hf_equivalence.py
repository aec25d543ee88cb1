"""The engine's greedy output equals Hugging Face transformers token for token (float32, same GGUF)."""

from __future__ import annotations

import pytest
import torch

from pagoda.node_agent.params import SamplingParams

from .prompts import CHAT_PROMPTS, PLAIN_PROMPTS

NEW_TOKENS = 32


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2)
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_batched_greedy_matches_transformers(engine, hf_reference):
    model, _ = hf_reference
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    rids = [engine.add_request(p, params, chat=True) for p in CHAT_PROMPTS]
    rids += [engine.add_request(p, params) for p in PLAIN_PROMPTS]
    final = engine.run_until_done()
    assert len(rids) == 8
    for rid in rids:
        out = final[rid]
        want = hf_greedy(model, out.prompt_token_ids, NEW_TOKENS)
        got = out.token_ids
        # transformers stops at EOS too; compare the full generated sequence
        assert got == want[: len(got)] and (len(got) == NEW_TOKENS or got[-1] == 2), (
            f"prompt ids {out.prompt_token_ids[-8:]}: engine {got} != transformers {want}"
        )
    assert sum(len(final[r].token_ids) for r in rids) >= 8 * 16


def test_prompt_tokens_match_transformers_chat_template(engine, hf_reference):
    _, tok = hf_reference
    msgs = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(want, list):
        want = want["input_ids"]
    assert engine.tokenize(CHAT_PROMPTS[0], chat=True) == list(want)
    assert engine.tokenize(PLAIN_PROMPTS[0]) == tok.encode(PLAIN_PROMPTS[0])


def test_paris(engine):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    rid = engine.add_request("What is the capital of France?", params, chat=True)
    out = engine.run_until_done()[rid]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
