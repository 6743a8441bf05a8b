"""pytest-benchmark over the moe_int4 component's cases (harness/components/moe_int4.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "moe_int4"
CASES = bench_cases(COMPONENT, presets=("kimi-k2.5", "deepseek-v3"))


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_moe_int4(device_benchmark, spec):
    device_benchmark(spec)
