"""pytest-benchmark over the mla_verify component's cases (harness/components/mla_verify.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases, mla_verify

COMPONENT = "mla_verify"
CASES = bench_cases(COMPONENT, keep=mla_verify.runs_here)  # on CPU the kernels need the interpreter


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_mla_verify(device_benchmark, spec):
    device_benchmark(spec)
