"""A short built-in text whose K/V activations calibrate the static FP8 KV scales at load."""

CALIBRATION_TEXT = (
    "The lighthouse stood at the edge of the harbour for two hundred years. Every night its keeper "
    "climbed 117 steps, trimmed the wick and wound the clockwork that turned the lens. Ships counted "
    "its flashes: three short, one long.\n\n"
    "def moving_average(values, window):\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n\n"
    "User: What is the boiling point of water at sea level?\n"
    "Assistant: Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level.\n"
    "Q: 17 * 23 = ? A: 391. Les feuilles tombent en automne; die Blätter fallen im Herbst.\n"
    "Key facts: Paris is the capital of France; the Pacific is the largest ocean; DNA has four bases."
)

# The distinct inputs a dense decoder layer's linears read, in call order, and the weights reading
# each (q/k/v share one input, gate/up another, whether or not the engine runs them fused).
LAYER_INPUTS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


class _Recorder:
    """Stands in for a PhaseLinear's per-phase weight: notes each new input, then runs the weight."""

    def __init__(self, inner, sink: list) -> None:
        self.inner, self.sink = inner, sink

    def apply(self, x):
        if not self.sink or self.sink[-1] is not x:
            self.sink.append(x)
        return self.inner.apply(x)


def linear_input_grams(engine, text: str = CALIBRATION_TEXT) -> tuple[dict, int]:
    """Gram matrices ``X^T X`` (float32 ``[K, K]``) of the inputs of every dense decoder layer's
    linear weights while ``engine`` scores ``text``, by HF weight name; also the token count.

    For dense Llama-family layers (four distinct linear inputs per layer); anything else raises."""

    ids = engine.tokenizer.encode(text)[: engine.decode_pool.capacity_tokens]
    sinks: list[list] = []
    saved: list[tuple[object, dict]] = []
    try:
        for layer in engine.model.layers:
            sink: list = []
            sinks.append(sink)
            for lin in layer.linears():
                saved.append((lin, dict(lin.by_phase)))
                lin.by_phase = {p: _Recorder(w, sink) for p, w in lin.by_phase.items()}
        engine.score(ids, phase="decode")
    finally:
        for lin, by_phase in saved:
            lin.by_phase = by_phase
    grams: dict = {}
    for i, sink in enumerate(sinks):
        if len(sink) != len(LAYER_INPUTS):
            raise ValueError(
                f"layer {i}: {len(sink)} distinct linear inputs, expected {len(LAYER_INPUTS)} (calibration "
                "covers dense Llama-family layers only)"
            )
        for x, names in zip(sink, LAYER_INPUTS, strict=True):
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            gram = x2.t() @ x2
            for n in names:
                grams[f"model.layers.{i}.{n}.weight"] = gram
    return grams, len(ids)
