"""Compiled grammars, built once per constraint and kept in a bounded LRU.

The key is the constraint's canonical JSON (sorted keys, its ``param`` left out: it only names the
field errors blame). The bounds are MAX_ENTRIES grammars and MAX_BYTES of their memory
(``CompiledGrammar.memory_size_bytes``); one grammar larger than MAX_GRAMMAR_BYTES is refused.
The xgrammar compiler and the vocabulary it compiles against are built on the first constrained
request. Thread-safe: the serving layer compiles on its own threads (serving/worker/async_engine.py)
while the engine thread runs steps.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable

from pagoda.node_agent.engine.guided import compile as compile_mod
from pagoda.node_agent.engine.guided.state import GrammarState
from pagoda.node_agent.engine.guided.vocab import tokenizer_info
from pagoda.node_agent.models.tokenizer import Tokenizer
from pagoda.node_agent.params import RequestError, SamplingParams, check_guided, guided_param

MAX_ENTRIES = 512
MAX_BYTES = 512 << 20
MAX_GRAMMAR_BYTES = 64 << 20
# the serving layer stops waiting for a compile after this long and refuses the request (the compile
# itself runs to its end on its thread; its grammar is cached for a retry)
COMPILE_TIMEOUT_S = 10.0


def spec_key(spec: dict) -> str:
    """The cache key of a constraint: its canonical JSON without ``param``."""
    return json.dumps({k: v for k, v in spec.items() if k != "param"}, sort_keys=True, separators=(",", ":"))


class GrammarCache:
    """Compiles constraints against one engine's vocabulary and keeps the grammars (LRU)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_ids: Iterable[int],
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, tuple(stop_ids)
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.timeout_s = COMPILE_TIMEOUT_S
        self._lock = threading.Lock()
        self._compiler = None
        self._grammars: OrderedDict[str, tuple[object, int]] = OrderedDict()  # key -> (grammar, bytes)
        self.bytes = 0
        self.hits = self.compiles = 0

    def __len__(self) -> int:
        return len(self._grammars)

    def compile(self, spec: dict):
        """The CompiledGrammar of ``spec`` (from the cache, or compiled now on the caller's thread);
        RequestError (naming the constraint's param) for a malformed spec or one xgrammar refuses."""
        check_guided(spec)
        key = spec_key(spec)
        with self._lock:
            entry = self._grammars.get(key)
            if entry is not None:
                self._grammars.move_to_end(key)
                self.hits += 1
                return entry[0]
            compiler = self._compiler_locked()
            self.compiles += 1
        grammar = compile_mod.compile_spec(compiler, spec)
        size = int(grammar.memory_size_bytes)
        if size > MAX_GRAMMAR_BYTES:
            raise RequestError(
                f"the {spec['type']} constraint compiles to {size >> 20} MiB; at most "
                f"{MAX_GRAMMAR_BYTES >> 20} MiB are accepted",
                guided_param(spec),
            )
        self._put(key, grammar, size)
        return grammar

    def state_for(self, params: SamplingParams, compiled=None) -> GrammarState | None:
        """A new matcher for a request of ``params`` (None when unconstrained); ``compiled`` is its
        grammar when the caller compiled it already (off the engine thread), else it is compiled now."""
        if params.guided is None:
            return None
        return GrammarState.of(params, compiled if compiled is not None else self.compile(params.guided))

    def _put(self, key: str, grammar, size: int) -> None:
        with self._lock:
            if key in self._grammars:  # compiled twice at once: keep the first
                return
            self._grammars[key] = (grammar, size)
            self.bytes += size
            while len(self._grammars) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, old_size) = self._grammars.popitem(last=False)  # the least recently used
                self.bytes -= old_size

    def _compiler_locked(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
            threads = max(1, min(4, (os.cpu_count() or 2) // 2))
            # xgrammar's own cache is off: this one holds the grammars, under its bounds
            self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        return self._compiler
