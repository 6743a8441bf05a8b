"""Least-squares line y = a + b*x with confidence intervals (scipy.stats.linregress + Student t)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from verifybench.harness.measure.timing.stats import CONFIDENCE


@dataclass(frozen=True)
class LinearFit:
    """a (intercept) and b (slope) with the half-widths of their CONFIDENCE intervals; r2 of the fit."""

    a: float
    b: float
    a_halfwidth: float
    b_halfwidth: float
    r2: float
    n_points: int

    def predict(self, x: float) -> float:
        return self.a + self.b * x

    def as_dict(self) -> dict:
        return asdict(self)


def linear_fit(x, y) -> LinearFit:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < 3 or np.unique(x).size < 2:
        raise ValueError("a line with a confidence interval needs >= 3 points at >= 2 distinct x")
    from scipy import stats  # ~0.8 s to import: only a fit needs it

    r = stats.linregress(x, y)
    t = stats.t.ppf(0.5 + CONFIDENCE / 2, x.size - 2)
    return LinearFit(a=float(r.intercept), b=float(r.slope), a_halfwidth=float(t * r.intercept_stderr),
                     b_halfwidth=float(t * r.stderr), r2=float(r.rvalue**2), n_points=int(x.size))
