"""Logprobs: of the distribution actually sampled from, gathered in the batch, prompt logprobs equal to
a full transformers forward (chunked prefill and the prefix cache included), entries in step with
the text returned (stop strings)."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.node_agent.engine.logprobs import gather, token_pieces
from pagoda.node_agent.engine.sampling import processed_logprobs, sample
from pagoda.node_agent.engine.sequence import Sequence
from pagoda.node_agent.params import RequestError, SamplingParams, params_from_json, params_to_json

PROMPT = "The capital of France is"


def run(engine, prompt, params, chat=False):
    outs = []
    rid = engine.add_request(prompt, params, chat=chat)
    final = engine.run_until_done(on_output=lambda o: outs.append(o) if o.request_id == rid else None)[rid]
    return final, outs


def entries_of(outs):
    return [e for o in outs for e in (o.logprobs or [])]


def hf_logprobs(hf_reference, ids: list[int]) -> torch.Tensor:
    model, _ = hf_reference
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


# ---------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_out_of_range_logprobs_name_their_field(field, value):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field


def test_logprobs_travel_on_the_internal_plane():
    p = SamplingParams(max_tokens=3, logprobs=5, prompt_logprobs=0)
    back = params_from_json(params_to_json(p))
    assert (back.logprobs, back.prompt_logprobs) == (5, 0)
    with pytest.raises(RequestError) as e:
        params_from_json({"logprobs": 30})
    assert e.value.param == "logprobs"


# ---------------------------------------------------------------------------- the batched ops


def reference_processed(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """An independent reading of temperature -> top-k -> top-p, renormalized, as log-probabilities."""
    probs = torch.softmax(logits.double() / t, dim=-1)
    if k:
        kth = torch.sort(probs, descending=True).values[k - 1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    total = 0.0
    for i in order.tolist():
        keep[i] = True
        total += float(probs[i])
        if total >= p * float(probs.sum()) - 1e-12:
            break
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return torch.log(probs / probs.sum())


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.5, 25, 0.9)])
def test_processed_logprobs_are_the_distribution_drawn_from(t, k, p):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)] * 3
    got = processed_logprobs(logits, params)
    for r in range(3):
        want = reference_processed(logits[r], t, k, p)
        kept = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got[r]), kept)
        assert torch.allclose(got[r][kept].double(), want[kept], atol=1e-5)
        assert math.isclose(float(got[r].exp().sum()), 1.0, rel_tol=1e-5)


def test_gather_lists_the_top_n_sorted_and_never_a_cut_token():
    lp = torch.log_softmax(torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 5.0, 1.0, 2.0]]), dim=-1)
    lp[1, 0] = float("-inf")  # cut away
    entries, extra = gather(lp, torch.tensor([2, 1]), [2, 4], extra=torch.tensor([7, 9]))
    assert extra == [7, 9]
    assert [t for t, _ in entries[0].top] == [0, 2] and entries[0].token_id == 2
    assert entries[0].logprob == pytest.approx(float(lp[0, 2]))
    assert [t for t, _ in entries[1].top] == [1, 3, 2]  # 4 asked, the -inf token left out
    assert all(a >= b for (_, a), (_, b) in zip(entries[1].top, entries[1].top[1:], strict=False))


def test_sample_returns_tokens_and_logprobs_beside_them():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    seqs = [
        Sequence("a", [1], SamplingParams(temperature=0.0, logprobs=3)),
        Sequence("b", [1], SamplingParams(temperature=0.0)),
        Sequence("c", [1], SamplingParams(temperature=0.8, top_k=5, seed=1, logprobs=20)),
    ]
    out = sample(logits, seqs)
    assert out.tokens[:2] == logits[:2].argmax(dim=-1).tolist()
    assert out.logprobs[1] is None
    a, c = out.logprobs[0], out.logprobs[2]
    assert a.token_id == out.tokens[0] and a.top[0] == (a.token_id, a.logprob) and len(a.top) == 3
    assert a.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[out.tokens[0]]), abs=1e-6)
    assert c.token_id == out.tokens[2] and len(c.top) == 5  # only the top-k 5 can be drawn
    assert c.token_id in [t for t, _ in c.top]


def test_token_pieces_put_a_split_character_on_the_token_completing_it(builtin_tokenizer):
    ids = builtin_tokenizer.encode("naïve café 東京 🙂!")
    pieces = token_pieces(builtin_tokenizer.decode, ids)
    assert "".join(pieces) == builtin_tokenizer.decode(ids)
    assert len(pieces) == len(ids)


# ---------------------------------------------------------------------------- through the engine


def test_greedy_logprobs_are_the_argmax_and_match_transformers(engine, hf_reference):
    final, outs = run(engine, PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logprobs=5))
    entries = entries_of(outs)
    assert len(entries) == len(final.token_ids) == 6
    ref = hf_logprobs(hf_reference, final.prompt_token_ids + final.token_ids)
    n = len(final.prompt_token_ids)
    for k, (tok, e) in enumerate(zip(final.token_ids, entries, strict=True)):
        row = ref[n - 1 + k]
        assert int(row.argmax()) == tok
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]  # the greedy token is the top one
        assert e["logprob"] == pytest.approx(float(row[tok]), abs=2e-3)
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        want = torch.topk(row, 5).values.tolist()
        assert tops == pytest.approx(want, abs=2e-3)
        assert e["bytes"] == list(e["token"].encode())
    assert "".join(e["token"] for e in entries) == final.text


def test_sampled_logprobs_are_of_the_processed_distribution(engine):
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=20, top_p=0.9, seed=11, logprobs=20)
    final, outs = run(engine, PROMPT, params)
    entries = entries_of(outs)
    logits = engine.score(final.prompt_token_ids + final.token_ids, phase="decode")
    n = len(final.prompt_token_ids)
    for k, (tok, e) in enumerate(zip(final.token_ids, entries, strict=True)):
        want = reference_processed(logits[n - 1 + k], 0.7, 20, 0.9)
        assert e["logprob"] == pytest.approx(float(want[tok]), abs=5e-3)
        kept = int(torch.isfinite(want).sum())
        assert len(e["top_logprobs"]) == min(20, kept)  # tokens cut away are never listed
        assert sum(math.exp(t["logprob"]) for t in e["top_logprobs"]) <= 1.0 + 1e-4


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_match_a_full_forward_also_chunked(make_engine, hf_reference, chunk):
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    eng = make_engine(kv_memory=32 << 20, max_model_len=256, **kw)
    prompt = (
        "In 1969, the first humans landed on the Moon. The mission was called Apollo 11, and its crew "
        "were Neil Armstrong, Buzz Aldrin and Michael Collins, who stayed in orbit."
    )
    final, outs = run(eng, prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))
    first = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    ids = final.prompt_token_ids
    assert chunk is None or len(ids) > 2 * chunk
    assert len(first) == len(ids) and first[0] is None
    ref = hf_logprobs(hf_reference, ids)
    for j in range(1, len(ids)):
        e = first[j]
        assert e["logprob"] == pytest.approx(float(ref[j - 1, ids[j]]), abs=2e-3)
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(
            torch.topk(ref[j - 1], 3).values.tolist(), abs=2e-3
        )
    assert outs[0].prompt_text.endswith("".join(e["token"] for e in first[1:]))
    eng.decode_pool.check_idle()


def test_a_request_scoring_its_prompt_skips_the_prefix_cache(make_engine):
    eng = make_engine(kv_memory=32 << 20, max_model_len=256)
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    plain, _ = run(eng, prompt, SamplingParams(max_tokens=2, temperature=0.0))
    again, _ = run(eng, prompt, SamplingParams(max_tokens=2, temperature=0.0))
    assert again.num_cached_tokens > 0  # the prompt's pages are cached
    a, outs_a = run(eng, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    assert a.num_cached_tokens == 0 and a.token_ids == plain.token_ids
    assert sum(e is not None for e in outs_a[0].prompt_logprobs) == len(a.prompt_token_ids) - 1


def test_entries_follow_the_text_a_stop_string_leaves(engine):
    full, _ = run(
        engine, "What is the capital of France?", SamplingParams(max_tokens=10, temperature=0.0), True
    )
    assert "France" in full.text
    params = SamplingParams(max_tokens=10, temperature=0.0, stop=["France"], logprobs=1)
    cut, outs = run(engine, "What is the capital of France?", params, chat=True)
    entries = entries_of(outs)
    assert cut.text == full.text[: full.text.index("France")]
    joined = "".join(e["token"] for e in entries)
    # the tokens whose text starts before the cut: the last may reach into the stop string
    assert joined.startswith(cut.text) and len(joined) - len(cut.text) < len(entries[-1]["token"]) + 1
    assert "".join(e["token"] for e in entries[:-1]) == cut.text[: len(joined) - len(entries[-1]["token"])]
    sent = ""
    for o in outs:  # while streaming, no entry runs ahead of the text sent
        sent += o.delta
        so_far = "".join(e["token"] for x in outs[: outs.index(o) + 1] for e in x.logprobs or [])
        assert o.finished or sent.startswith(so_far)
