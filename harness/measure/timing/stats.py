"""Summary statistics of timing samples and the confidence interval of their median.

The median CI is distribution-free (order statistics, scipy.stats.quantile_test), so it needs no normality.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Summary:
    """Robust summary of samples in microseconds; ci_* bound the median at CONFIDENCE."""

    n: int
    median_us: float
    q1_us: float
    q3_us: float
    min_us: float
    max_us: float
    mean_us: float
    stdev_us: float
    ci_low_us: float
    ci_high_us: float

    @property
    def rel_ci_halfwidth(self) -> float:
        """Half the width of the median's CI over the median (inf when the CI is unbounded)."""
        if not (math.isfinite(self.ci_low_us) and math.isfinite(self.ci_high_us)) or self.median_us <= 0:
            return math.inf
        return (self.ci_high_us - self.ci_low_us) / 2 / self.median_us

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Summary":
        return cls(**{k: float(d[k]) if k != "n" else int(d[k]) for k in cls.__dataclass_fields__})


def median_ci(samples_us, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Order-statistic CI of the median; (-inf, inf) where too few samples bound it."""
    x = np.asarray(samples_us, dtype=float)
    if x.size < 2:
        return -math.inf, math.inf
    from scipy import stats  # ~0.8 s to import: ranks and short commands that never ask start without it

    ci = stats.quantile_test(x, q=float(np.median(x)), p=0.5).confidence_interval(confidence)
    return float(ci.low), float(ci.high)


def summarize(samples_us) -> Summary:
    x = np.asarray(samples_us, dtype=float)
    if x.size == 0:
        raise ValueError("cannot summarize zero samples")
    if not np.all(np.isfinite(x)):
        raise ValueError("samples contain NaN or inf")
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    lo, hi = median_ci(x)
    return Summary(
        n=int(x.size),
        median_us=float(med),
        q1_us=float(q1),
        q3_us=float(q3),
        min_us=float(x.min()),
        max_us=float(x.max()),
        mean_us=float(x.mean()),
        stdev_us=float(x.std(ddof=1)) if x.size > 1 else 0.0,
        ci_low_us=lo,
        ci_high_us=hi,
    )


def should_stop(samples_us, *, min_samples: int, rel_ci_target: float) -> bool:
    """nvbench's rule: at least min_samples, then stop once the median's relative CI half-width is on target."""
    if len(samples_us) < min_samples:
        return False
    return summarize(samples_us).rel_ci_halfwidth <= rel_ci_target
