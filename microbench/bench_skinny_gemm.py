"""pytest-benchmark over the skinny_gemm component's cases (harness/components/skinny_gemm.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "skinny_gemm"
CASES = bench_cases(COMPONENT)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_skinny_gemm(device_benchmark, spec):
    device_benchmark(spec)
