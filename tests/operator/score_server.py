"""A small in-test engine for the quality gate: an HTTP server answering ``POST /internal/score``
per the contract (pagoda/quality_probe.py), with the internal proof checked.

Its "model" is a fixed family of distributions over a small vocabulary: at position p the logits
are a parabola centred on token (3p mod V); ``shift`` moves the centre (a drifted pair: top-1 and KL
far off), ``noise`` perturbs every logit a little (an honest lossy format: KL tiny). ``mode``
"hang" holds every request for a while and then answers 503 (a pool that never scores).
"""

from __future__ import annotations

import hmac
import json
import math
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pagoda.internal_proof import HEADER, derive, request_mac
from pagoda.quality_probe import SCORE_PATH, ProbeError, ScoredText, ScoreRequest, ScoreResponse

VOCAB = 64
TEXT_TOKENS = 24
GREEDY_TOKENS = 8


def _logprobs(p: int, shift: float, noise: float) -> list[float]:
    centre = (3 * p) % VOCAB + shift
    logits = [-((i - centre) ** 2) / 6.0 + noise * math.sin(1.7 * i + p) for i in range(VOCAB)]
    top = max(logits)
    z = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - z for x in logits]


def answer(req: ScoreRequest, shift: float = 0.0, noise: float = 0.0) -> ScoreResponse:
    """The engine's answer: token ids (a raw text tokenizes to a fixed sequence), the top-k at each
    position, the targets' logprobs when asked, and greedy continuations."""
    texts = []
    for entry in req.texts:
        ids = entry.get("token_ids") or [(7 * i + len(entry["text"])) % VOCAB for i in range(TEXT_TOKENS)]
        top, targets = [], []
        for p in range(len(ids) - 1):
            lps = _logprobs(p, shift, noise)
            order = sorted(range(VOCAB), key=lambda i, lps=lps: -lps[i])[: req.top_k]
            top.append([(i, lps[i]) for i in order])
            if "targets" in entry:
                targets.append([lps[i] for i in entry["targets"][p]])
        texts.append(ScoredText(list(ids), top, targets if "targets" in entry else None))
    drift = int(round(shift))
    greedy = [
        [
            (5 * j + k + (drift if k >= 2 else 0)) % VOCAB
            for k in range(min(GREEDY_TOKENS, req.max_new_tokens))
        ]
        for j in range(len(req.prompts))
    ]
    return ScoreResponse({"decodeWeights": "int4"}, texts, greedy)


class ScoreServer:
    """One engine pod's score endpoint on 127.0.0.1; ``token()`` gives the internal token to check
    proofs with (read when a request comes, as the operator may create the Secret late)."""

    def __init__(
        self, token: Callable[[], str], shift: float = 0.0, noise: float = 0.0, mode: str = "answer"
    ) -> None:
        self.token, self.shift, self.noise, self.mode = token, shift, noise, mode
        self.requests: list[dict[str, Any]] = []
        self.refused: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (the http.server name)
                outer.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ScoreServer:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _proof_ok(self, h: BaseHTTPRequestHandler) -> bool:
        parts = (h.headers.get(HEADER) or "").split(" ")
        if len(parts) != 4 or parts[0] != "v1" or abs(time.time() - int(parts[1] or 0)) > 300:
            return False
        want = request_mac(derive(self.token(), "request"), "POST", h.path, parts[1], parts[2])
        return hmac.compare_digest(parts[3], want)

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        if h.path != SCORE_PATH:
            return self._send(h, 404, {"error": "not found"})
        if not self._proof_ok(h):
            self.refused.append(h.headers.get(HEADER) or "")
            return self._send(h, 403, {"error": "internal auth"})
        if self.mode == "hang":
            time.sleep(1.5)
            return self._send(h, 503, {"error": "busy"})
        try:
            req = ScoreRequest.parse(json.loads(raw), VOCAB)
        except (ProbeError, ValueError) as err:
            return self._send(h, 400, {"error": str(err)})
        self.requests.append(json.loads(raw))
        self._send(h, 200, answer(req, self.shift, self.noise).to_json())
