"""What the engine itself shows: the copy-bandwidth ceiling (cold/hot/graph) and the sync-distortion exhibit.

Run: pytest --benchmark-only microbench/bench_harness.py  (CPU without CUDA: perf_counter, tiny shapes).
"""
import pytest

from harness import ceiling, sync_exhibit
from harness.timing import cuda_available

L2_RESIDENT_BYTES = 8 << 20  # fits the 50-60 MB L2 of an H100/H200: hot and cold differ here
COPY_CASES = [ceiling.copy_case(mode=m) for m in ("hot", "graph")] + (
    [ceiling.copy_case(L2_RESIDENT_BYTES, mode=m) for m in ("cold", "hot", "graph")] if cuda_available() else []
)


@pytest.mark.parametrize("spec", COPY_CASES, ids=lambda s: s.name)
def test_copy_bandwidth(device_benchmark, spec):
    case = device_benchmark(spec)
    assert case.derived["gbps"] > 0


@pytest.mark.parametrize("spec", sync_exhibit.cases(), ids=lambda s: s.name)
def test_sync_distortion(device_benchmark, spec):
    device_benchmark(spec)
