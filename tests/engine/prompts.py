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
