import numpy as np
import pytest

from verifybench.harness.analysis.fit import linear_fit


def test_exact_line_is_recovered_with_zero_width():
    f = linear_fit([1, 2, 4, 8], [3.0, 4.0, 6.0, 10.0])
    assert (f.a, f.b) == pytest.approx((2.0, 1.0))
    assert f.a_halfwidth == pytest.approx(0, abs=1e-9) and f.r2 == pytest.approx(1.0)
    assert f.predict(100) == pytest.approx(102.0)


def test_interval_covers_the_true_slope_about_95_percent():
    rng = np.random.default_rng(0)
    x = np.arange(1, 13, dtype=float)
    hits = 0
    for _ in range(400):
        f = linear_fit(x, 2.0 + 0.5 * x + rng.normal(0, 0.3, x.size))
        hits += abs(f.b - 0.5) <= f.b_halfwidth
    assert 0.91 <= hits / 400 <= 0.99


def test_too_few_points_raise():
    with pytest.raises(ValueError):
        linear_fit([1, 1, 1], [1, 2, 3])
