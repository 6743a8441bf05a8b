"""pytest-benchmark over the mla_decode component's cases (harness/components/mla_decode.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "mla_decode"
CASES = bench_cases(COMPONENT)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_mla_decode(device_benchmark, spec):
    device_benchmark(spec)
