"""Argument checks the kernels' public functions share, run before any launch: a bad value is a ValueError that
names the argument, never a Triton error or a silent wrong result."""
from __future__ import annotations

import operator

import torch


def check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    """`value` as a Python int in [lo, hi]; floats, bools and tensors are refused."""
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo}, {'inf' if hi is None else hi}], got {value}")
    return value
