"""pytest-benchmark over the verify component's cases (harness/components/verify.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "verify"
CASES = bench_cases(COMPONENT, keep=lambda s: s.params["variant"] == "full")


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_verify_forward(device_benchmark, spec):
    device_benchmark(spec)
