"""The step-time model the time-budgeted scheduler plans with: seconds a step takes as a function of
what it runs, fitted online from the steps the engine has timed.

Each phase (and its weight/KV format, which fixes the kernels it runs) has its own linear model:

- decode: ``t = a + b * batch + c * pages`` (pages: the context pages the batch's attention reads);
- prefill: ``t = a + b * tokens + c * pages`` (tokens: the chunk's new tokens; pages: the context
  pages the chunks' attention reads, earlier chunks and cached prefix included).

The coefficients are an exponentially weighted least-squares fit (older steps count less, so the
model follows the device as load and kernels warm up), constrained to be non-negative so that more
work never predicts less time. A phase has no prediction (None) until it has seen a step: the first
steps seed the model, later ones refine it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

FEATURES = {"decode": ("batch", "pages"), "prefill": ("tokens", "pages")}
# features are divided by these before the fit, so that the ridge term weighs them alike
_SCALE = {"batch": 16.0, "tokens": 256.0, "pages": 64.0}
DECAY = 0.97  # the weight of a step falls by this factor for every later step of its phase
RIDGE = 1e-6  # keeps the normal equations solvable before the steps vary


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gaussian elimination with partial pivoting; a is small and regularised)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-18:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if abs(m[r][r]) < 1e-18:
            continue
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class LinearFit:
    """Exponentially weighted least squares ``y ~ coef . x`` with non-negative coefficients."""

    def __init__(self, size: int, decay: float = DECAY, ridge: float = RIDGE) -> None:
        self.size, self.decay, self.ridge = size, decay, ridge
        self.xtx = [[0.0] * size for _ in range(size)]
        self.xty = [0.0] * size
        self.count = 0
        self.coef = [0.0] * size

    def observe(self, x: Seq[float], y: float) -> None:
        """Add one observation (older ones decay) and refit."""
        d = self.decay
        for i in range(self.size):
            self.xty[i] = d * self.xty[i] + x[i] * y
            for j in range(self.size):
                self.xtx[i][j] = d * self.xtx[i][j] + x[i] * x[j]
        self.count += 1
        self.coef = self._fit()

    def _fit(self) -> list[float]:
        """Least squares with the coefficients that come out negative pinned to 0 (an active set)."""
        free = list(range(self.size))
        coef = [0.0] * self.size
        while free:
            a = [[self.xtx[i][j] + (self.ridge if i == j else 0.0) for j in free] for i in free]
            sol = _solve(a, [self.xty[i] for i in free])
            worst = min(range(len(free)), key=lambda k: sol[k])
            if sol[worst] >= 0:
                for k, i in enumerate(free):
                    coef[i] = sol[k]
                return coef
            free.pop(worst)
        return coef

    def predict(self, x: Seq[float]) -> float:
        return sum(c * v for c, v in zip(self.coef, x, strict=True))


class StepCostModel:
    """Predicted seconds of a decode or prefill step, one fit per phase and format (``formats``:
    phase -> its weight/KV format label, e.g. ``{"prefill": "fp8/bf16", "decode": "int4/int8"}``)."""

    def __init__(self, formats: dict[str, str] | None = None, decay: float = DECAY) -> None:
        self.formats = dict(formats or {})
        self.fits = {phase: LinearFit(1 + len(names), decay) for phase, names in FEATURES.items()}

    def key(self, phase: str) -> str:
        """The label of a phase's fit: the phase and its formats."""
        fmt = self.formats.get(phase)
        return f"{phase}:{fmt}" if fmt else phase

    @staticmethod
    def features(phase: str, work: dict[str, float]) -> list[float]:
        """The fit's input for a step's ``work`` (FEATURES[phase] -> amount), scaled."""
        return [1.0] + [work.get(n, 0.0) / _SCALE[n] for n in FEATURES[phase]]

    def seeded(self, phase: str) -> bool:
        return self.fits[phase].count > 0

    def predict(self, phase: str, work: dict[str, float]) -> float | None:
        """Seconds a ``phase`` step doing ``work`` should take; None before any step of it was seen."""
        fit = self.fits[phase]
        return fit.predict(self.features(phase, work)) if fit.count else None

    def observe(self, phase: str, work: dict[str, float], seconds: float) -> None:
        """Refine the phase's fit with one timed step."""
        if seconds > 0:
            self.fits[phase].observe(self.features(phase, work), seconds)

    def coefficients(self) -> dict[str, dict[str, float]]:
        """Each fit's coefficients in seconds per unit of work (for logs and state)."""
        out = {}
        for phase, names in FEATURES.items():
            coef = self.fits[phase].coef
            row = {"step": coef[0]}
            row.update({n: coef[i + 1] / _SCALE[n] for i, n in enumerate(names)})
            out[self.key(phase)] = row
        return out
