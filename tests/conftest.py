"""Tests run on CPU-only machines: Triton kernels then run in the interpreter (set before triton is imported).
Slow subprocess fixtures start at collection (tests/early_jobs.py) and the tests that read them run last."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import early_jobs  # noqa: E402
from verifybench.harness.engine.pytest_plugin import pytest_terminal_summary  # noqa: E402,F401 (the defaults notice)

# tests whose bounds are timed: they wait until the early jobs have ended, so no extra load moves them
QUIET_FILES = ("test_rank_faults.py",)


@pytest.hookimpl(trylast=True)  # after -k and -m deselected: a run nobody reads is not started
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # the tiny run (one process, about a minute of CPU) goes beside the tests of one process before its readers
    readers = [item for item in items if "run_dir" in getattr(item, "fixturenames", ())]
    if readers:
        late = {id(item) for item in readers}
        items[:] = [item for item in items if id(item) not in late] + readers
        if not config.option.collectonly:
            early_jobs.start("run")


@pytest.fixture(autouse=True)
def _quiet_host(request):
    if request.node.path.name in QUIET_FILES:
        early_jobs.wait_all()


def pytest_sessionfinish(session):
    early_jobs.stop_all()
