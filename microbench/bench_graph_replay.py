"""pytest-benchmark over the graph_replay component's cases (harness/components/graph_replay.py), device-timed."""
import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "graph_replay"
CASES = bench_cases(COMPONENT)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_graph_replay(device_benchmark, spec):
    device_benchmark(spec)
