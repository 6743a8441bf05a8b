"""Programmatic dependent launch (PDL, sm_90+) for the verify forward's chain of Triton kernels.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is still running. It
must load only data no earlier kernel writes (its weights) before `gdc_wait()`, which returns once the previous
kernel has completed and its writes are visible; it writes nothing before that wait. Every program of a PDL-launched
kernel calls `gdc_wait()` (a kernel that skipped it could finish before its predecessor, breaking the stream order
the kernel after it relies on). After the wait it calls `gdc_launch_dependents()`, so at most two kernels overlap:
the next one's launch and weight loads hide behind this one's work. In a CUDA graph the launches become
programmatic edges; a kernel launched without the attribute (cuBLAS, torch, NCCL) waits as usual.

enabled(device): PDL on for CUDA tensors of sm_90+, off in the interpreter (no inline asm) and when the environment
sets VERIFYBENCH_PDL=0; `forced(on)` overrides it for a block (side-by-side timing of one process).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from verifybench.kernels.common import devices, interpret, settings

ENV = settings.PDL
_FORCED: list[bool] = []


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return devices.capability(torch.device("cuda", index)) >= 90


def capable(device) -> bool:
    """Whether PDL can run on `device`: CUDA, sm_90 or newer, not the interpreter (it has no inline asm)."""
    device = torch.device(device)
    if device.type != "cuda" or interpret.active():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def enabled(device) -> bool:
    """Whether kernels on `device` launch with PDL by default (see the module doc)."""
    if _FORCED:
        return _FORCED[-1] and capable(device)
    value = settings.read(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1" and capable(device)


def resolve(pdl: bool | None, device) -> bool:
    """A kernel wrapper's `pdl` argument: None -> enabled(device); True -> on where capable (the interpreter and
    pre-sm_90 GPUs run without it: same results); False -> off; anything else is a ValueError."""
    if pdl is None:
        return enabled(device)
    if not isinstance(pdl, bool):
        raise ValueError(f"pdl must be None, True or False, got {pdl!r}")
    return pdl and capable(device)


def launch_kwargs(on: bool) -> dict:
    """The Triton launch keyword for a PDL launch (nothing when off)."""
    return {"launch_pdl": True} if on else {}


@contextlib.contextmanager
def forced(on: bool):
    """PDL on or off for every launch in the block, whatever the environment says (capability still applies)."""
    _FORCED.append(bool(on))
    try:
        yield
    finally:
        _FORCED.pop()
