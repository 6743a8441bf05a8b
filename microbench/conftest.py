"""Benchmarks run through the suite's engine; pytest-benchmark stores device samples (measure/timing/pytest_plugin.py).
Each module leaves the memory as it found it: its cases are spent, its component's caches released, and the bytes
still alive afterwards are checked against those alive before it (LEAK_TOLERANCE_BYTES)."""
import gc
import importlib

import pytest
import torch

from verifybench.harness.measure.timing import memory
from verifybench.harness.measure.timing.pytest_plugin import (device_benchmark, pytest_benchmark_update_machine_info,  # noqa: F401
                                                      pytest_configure, pytest_sessionstart, pytest_terminal_summary)

LEAK_TOLERANCE_BYTES = 8 << 20  # allocator rounding and the L2 flush buffer, not a layer's weights


@pytest.fixture(scope="module", autouse=True)
def _leave_memory_as_found(request):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    before = memory.live_bytes(device)
    yield
    for spec in getattr(request.module, "CASES", ()):
        spec.spend()
    name = getattr(request.module, "COMPONENT", None)
    if name:
        importlib.import_module(f"verifybench.harness.components.{name}").release()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    left = memory.live_bytes(device) - before
    if left > LEAK_TOLERANCE_BYTES:
        pytest.fail(f"{request.module.__name__} left {memory.gib(left)} ({left} B) of {device} memory alive after "
                    f"its component released its caches (tolerance {LEAK_TOLERANCE_BYTES} B)", pytrace=False)
