"""Varied prompts (chat and plain) shared by the engine tests."""

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a child in two sentences.",
    "List three uses of copper.",
]
PLAIN_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans landed on",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def greedy_ids(engine, new_tokens: int) -> list[list[int]]:
    """Greedy token ids of the chat prompts (templated) then the plain ones, in one batch."""
    from pagoda.node_agent.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    rids = [engine.add_request(p, params, chat=True) for p in CHAT_PROMPTS]
    rids += [engine.add_request(p, params) for p in PLAIN_PROMPTS]
    final = engine.run_until_done()
    return [final[r].token_ids for r in rids]
