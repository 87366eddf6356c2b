"""An engine's measured prefill: time to first token as a fixed cost plus a cost per token
computed and per token taken from a cache, fitted to requests a real engine served.

The FLOPs model (:func:`~kvstrata.sim.economics.recompute_seconds`) counts the prefill's matrix
products only, which is what an H100-class GPU at a known MFU spends its time on. A small engine
on a CPU spends most of it elsewhere (attention, the Python scheduler, tokenising, HTTP
streaming), so there the FLOPs model is 5–10× below what a client measures. :class:`PrefillFit`
is the alternative for "this engine on this machine": fitted by least squares to
``(computed tokens, cached tokens, TTFT)`` of requests the engine served, e.g. by the serving
benchmark's no-connector contender (``bench/bench_serving.py``), and given to ``kvstrata
simulate --prefill-fit FIXED_MS,US_PER_TOKEN[,US_PER_CACHED_TOKEN]``. The load of the cached
chunks from their tiers is added by the caller as before (:func:`~kvstrata.sim.economics.
load_seconds`), so the fit's ``per_cached`` is what a cached token costs the engine besides
its bytes (its attention and bookkeeping).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """TTFT ≈ ``fixed`` + ``per_token`` × tokens computed + ``per_cached`` × tokens cached
    (seconds)."""

    fixed: float
    per_token: float
    per_cached: float = 0.0

    def seconds(self, computed: int, cached: int = 0) -> float:
        return self.fixed + self.per_token * computed + self.per_cached * cached

    @property
    def rate(self) -> float:
        """Tokens computed per second (the effective prefill rate)."""
        return 1.0 / self.per_token if self.per_token > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"{self.fixed * 1e3:.1f} ms + {self.per_token * 1e6:.0f} µs/token computed "
            f"({self.rate:,.0f} tokens/s) + {self.per_cached * 1e6:.0f} µs/token cached"
        )


def parse_fit(text: str) -> PrefillFit:
    """``FIXED_MS,US_PER_TOKEN[,US_PER_CACHED_TOKEN]`` (the CLI's ``--prefill-fit``)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (2, 3):
        raise ValueError(f"--prefill-fit {text!r}: want FIXED_MS,US_PER_TOKEN[,US_PER_CACHED]")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--prefill-fit {text!r}: the figures must be numbers") from None
    if any(v < 0 for v in values):
        raise ValueError(f"--prefill-fit {text!r}: the figures cannot be negative")
    cached = values[2] if len(values) == 3 else 0.0
    return PrefillFit(values[0] / 1e3, values[1] / 1e6, cached / 1e6)


def fit(samples: Sequence[tuple[int, int, float]]) -> PrefillFit:
    """Least squares over ``(computed, cached, ttft seconds)``. With too little spread in the
    cached tokens (all 0, or all in proportion) it fits ``fixed + per_token`` only; negative
    coefficients (noise on a few samples) are clamped to 0 and the rest refitted."""
    if len(samples) < 2:
        raise ValueError("a prefill fit needs at least two requests")
    for columns in ((0, 1, 2), (0, 1)):
        coef = _solve(samples, columns)
        if coef is not None and all(c >= 0 for c in coef[1:]):
            full = dict(zip(columns, coef, strict=True))
            if full[0] < 0:  # a negative fixed cost: refit through the origin's neighbour
                full[0] = 0.0
            return PrefillFit(full[0], full.get(1, 0.0), full.get(2, 0.0))
    mean = sum(s[2] for s in samples) / len(samples)
    return PrefillFit(mean, 0.0, 0.0)


def _solve(
    samples: Sequence[tuple[int, int, float]], columns: tuple[int, ...]
) -> list[float] | None:
    """Normal equations for ttft ~ columns of (1, computed, cached); None when singular."""

    def row(s: tuple[int, int, float]) -> list[float]:
        full = (1.0, float(s[0]), float(s[1]))
        return [full[c] for c in columns]

    n = len(columns)
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for s in samples:
        x = row(s)
        for i in range(n):
            b[i] += x[i] * s[2]
            for j in range(n):
                a[i][j] += x[i] * x[j]
    # Gauss–Jordan with partial pivoting
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        scale = max(abs(a[r][col]) for r in range(n)) or 1.0
        if abs(a[pivot][col]) < 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col] / a[col][col]
                for c in range(col, n):
                    a[r][c] -= f * a[col][c]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]
