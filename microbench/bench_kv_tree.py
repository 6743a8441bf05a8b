"""pytest-benchmark over the kv_tree component's cases (harness/components/kv_tree.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "kv_tree"
# B at powers of two: the other batch sizes of `verifybench kv_tree` (build_tree, verify) lie between them and
# are over a third of its cases
CASES = bench_cases(COMPONENT, keep=lambda s: s.params["batch"] in (1, 2, 4, 8))


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_kv_tree(device_benchmark, spec):
    device_benchmark(spec)
