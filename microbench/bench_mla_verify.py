"""pytest-benchmark over the mla_verify component's cases (harness/components/mla_verify.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases, mla_verify

COMPONENT = "mla_verify"
CASES = bench_cases(COMPONENT, keep=mla_verify.runs_here)  # on CPU the kernels need the interpreter
# no case runs here: one skipped item that says why, not pytest's "got empty parameter set"
PARAMS = CASES or [pytest.param(None, id="no-case-runs-here", marks=pytest.mark.skip(
    reason="mla_verify's Triton kernels need a GPU, or TRITON_INTERPRET=1 exported before pytest on CPU"))]


@pytest.mark.parametrize("spec", PARAMS, ids=lambda s: s.name)
def test_mla_verify(device_benchmark, spec):
    device_benchmark(spec)
