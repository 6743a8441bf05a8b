"""pytest-benchmark over the allreduce component's cases (harness/components/allreduce.py), device-timed: a 1-rank
group; under a multi-rank launch the module skips (torchrun -m verifybench.harness.multigpu.allreduce measures that)."""
import os

import pytest

from verifybench.harness.components import bench_cases

COMPONENT = "allreduce"
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    pytest.skip("multi-rank launch: the 1-rank cases need their own group", allow_module_level=True)
CASES = bench_cases(COMPONENT)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_allreduce_one_rank(device_benchmark, spec):
    device_benchmark(spec)
