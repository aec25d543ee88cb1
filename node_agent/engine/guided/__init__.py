"""Constrained decoding (structured outputs, forced tool calls) with the xgrammar grammar engine.

``SamplingParams.guided`` names a constraint (params.py checks its shape); ``cache.py`` compiles it
once per spec against the engine's vocabulary (``vocab.py``) and keeps a bounded LRU of compiled
grammars; each constrained Sequence holds a matcher (``state.py``); ``masking.py`` fills one
bitmask for the batch and applies it to the logits before a token is picked.

xgrammar imports torch and transformers and takes seconds to import: nothing here imports it until
the first constrained request.
"""
