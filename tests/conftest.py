"""Tests run on CPU-only machines: Triton kernels then run in the interpreter (set before triton is imported).
Slow subprocess fixtures start at collection (tests/early_jobs.py) and the tests that read them run last."""
import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The released engine packages .ci/run fetches (nothing installs them for a user): the engine adapters' tests and the
# components' engine rows import them from there, whichever test files run
CI_ENGINES = Path(__file__).resolve().parent.parent / ".ci" / "engines"
# what SGLang's MoE kernel modules import beyond what the extend and decode kernels need (its serving stack's
# imports: transformers, openai, pyzmq, ...); .ci/run fetches it apart from the engines
CI_ENGINES_EXTRA = CI_ENGINES.parent / "engines-extra"
if CI_ENGINES.is_dir() and str(CI_ENGINES) not in sys.path:
    sys.path.append(str(CI_ENGINES))
    if CI_ENGINES_EXTRA.is_dir():
        sys.path.append(str(CI_ENGINES_EXTRA))
    if importlib.util.find_spec("torchvision") is None:
        sys.path.append(str(Path(__file__).parent / "engine_stubs"))  # see engine_stubs/torchvision/__init__.py
    if importlib.util.find_spec("sgl_kernel") is None:  # see engine_stubs/no_sgl_kernel/sgl_kernel/__init__.py
        sys.path.append(str(Path(__file__).parent / "engine_stubs" / "no_sgl_kernel"))
# A shell starts a background job (`cmd &` in a script) with SIGINT ignored, and every child inherits that: the tests
# that stop a child with SIGINT, as Ctrl-C would, need the children to get it at its default
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# pytest puts this file's folder on sys.path before importing it (no __init__.py, the default "prepend" mode):
# the test files in the rooms' folders below import the helpers here by name, as this file does
import early_jobs  # noqa: E402
# the defaults notice
from verifybench.harness.measure.timing.pytest_plugin import pytest_terminal_summary  # noqa: E402,F401


@pytest.hookimpl(trylast=True)  # after -k and -m deselected: a run nobody reads is not started
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    items.sort(key=early_jobs.place)  # stable: the order within each group is kept
    if config.option.collectonly:
        return
    if any("run_dir" in getattr(item, "fixturenames", ()) for item in items):
        early_jobs.start("run")
    for item in items:
        for name, fn in early_jobs.job_fixtures(item).items():
            early_jobs.submit(name, fn)
        for name, fn in early_jobs.job_fixtures(item, "TIMED_JOBS").items():
            early_jobs.register_timed(name, fn)
    early_jobs.queue_timed()  # behind the early jobs


def pytest_sessionfinish(session):
    early_jobs.stop_all()
