import math

import numpy as np
import pytest

from verifybench.harness.measure.timing.stats import median_ci, should_stop, summarize


def test_summary_matches_numpy_on_known_samples():
    x = [5.0, 1.0, 3.0, 2.0, 4.0]
    s = summarize(x)
    assert (s.n, s.median_us, s.min_us, s.max_us, s.mean_us) == (5, 3.0, 1.0, 5.0, 3.0)
    assert (s.q1_us, s.q3_us) == (2.0, 4.0)
    assert s.stdev_us == pytest.approx(np.std(x, ddof=1))


def test_median_ci_brackets_median_and_narrows_with_more_samples():
    rng = np.random.default_rng(0)
    small, large = rng.normal(100, 5, 20), rng.normal(100, 5, 2000)
    lo_s, hi_s = median_ci(small)
    lo_l, hi_l = median_ci(large)
    assert lo_s <= np.median(small) <= hi_s
    assert lo_l <= np.median(large) <= hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 3


def test_median_ci_covers_true_median_about_95_percent():
    rng = np.random.default_rng(1)
    hits = sum(lo <= 0.0 <= hi for lo, hi in (median_ci(rng.standard_cauchy(31)) for _ in range(400)))
    assert 0.90 <= hits / 400 <= 0.995


def test_median_ci_is_unbounded_for_too_few_samples():
    assert median_ci([1.0]) == (-math.inf, math.inf)
    assert summarize([1.0, 1.0, 1.0]).rel_ci_halfwidth == math.inf  # 3 samples cannot bound the median at 95%


def test_summarize_rejects_empty_and_nan():
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        summarize([1.0, float("nan")])


def test_stopping_rule_needs_min_samples_then_a_tight_ci():
    tight = list(np.random.default_rng(2).normal(100, 0.1, 50))
    assert not should_stop(tight[:9], min_samples=10, rel_ci_target=0.01)
    assert should_stop(tight, min_samples=10, rel_ci_target=0.01)
    noisy = list(np.random.default_rng(3).normal(100, 30, 50))
    assert not should_stop(noisy, min_samples=10, rel_ci_target=0.01)
