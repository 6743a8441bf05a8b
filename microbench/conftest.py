"""Benchmarks run through the suite's engine; pytest-benchmark stores device samples (engine/pytest_plugin.py).
Each module's component releases its cached weights when the module ends, so the next one has the GPU's memory."""
import importlib

import pytest

from verifybench.harness.engine.pytest_plugin import (device_benchmark, pytest_benchmark_update_machine_info,  # noqa: F401
                                                      pytest_sessionstart, pytest_terminal_summary)


@pytest.fixture(scope="module", autouse=True)
def _release_component(request):
    yield
    name = getattr(request.module, "COMPONENT", None)
    if name:
        importlib.import_module(f"verifybench.harness.components.{name}").release()
