"""pytest-benchmark over the cycle component's cases (harness/components/cycle.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "cycle"
CASES = bench_cases(COMPONENT)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_cycle(device_benchmark, spec):
    device_benchmark(spec)
