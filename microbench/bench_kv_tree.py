"""pytest-benchmark over the kv_tree component's cases (harness/components/kv_tree.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "kv_tree"
CASES = bench_cases(COMPONENT)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_kv_tree(device_benchmark, spec):
    device_benchmark(spec)
