"""pytest-benchmark over the baseline component's cases (harness/components/baseline.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "baseline"
CASES = bench_cases(COMPONENT)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_baseline(device_benchmark, spec):
    device_benchmark(spec)
