"""Tests run on CPU-only machines: Triton kernels then run in the interpreter (set before triton is imported)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from verifybench.harness.engine.pytest_plugin import pytest_terminal_summary  # noqa: E402,F401 (the defaults notice)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
