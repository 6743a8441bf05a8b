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

prefetch_rows_l2 (device side, for PDL kernels only): before its wait a kernel may also start its other weight rows
towards L2, so DRAM streams them while the kernel before it still runs (a latency-bound kernel leaves DRAM idle).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

# Thread t < $4 issues one cp.async.bulk.prefetch.L2 (sm_90) of bytes [$1 + t * $2, + $3): start rounded down and
# size to 16-byte multiples (the instruction's rule; a prefetch only hints, the bytes left out at the ends cost
# nothing). No registers hold the data and nothing is returned ($0 is a dummy).
_PREFETCH_ROWS = tl.constexpr(
    "{.reg .pred p; .reg .b64 a, e, t64; .reg .u32 t, n; mov.u32 t, %tid.x; cvt.u64.u32 t64, t; "
    "mad.lo.s64 e, t64, $2, $1; and.b64 a, e, -16; add.s64 e, e, $3; and.b64 e, e, -16; sub.s64 e, e, a; "
    "cvt.u32.u64 n, e; setp.lt.u32 p, t, $4; setp.ne.and.u32 p, n, 0, p; "
    "@p cp.async.bulk.prefetch.L2.global [a], n; mov.u32 $0, 0;}")


@triton.jit
def prefetch_rows_l2(base, row_stride_bytes, nbytes, rows):
    """Start `rows` rows of `nbytes` bytes each, `row_stride_bytes` apart from `base`, towards L2: one bulk
    prefetch per row, thread t issuing row t (rows past the block's thread count are left out). A hint for data no
    kernel before this one writes, issued before gdc_wait(); sm_90+ only (the interpreter has no inline asm)."""
    stride = tl.zeros([], dtype=tl.int64) + row_stride_bytes
    size = tl.maximum(tl.zeros([], dtype=tl.int64) + nbytes, 0)
    count = tl.zeros([], dtype=tl.int32) + rows
    tl.inline_asm_elementwise(_PREFETCH_ROWS, "=r,l,l,l,r", [base, stride, size, count], dtype=tl.int32,
                              is_pure=False, pack=1)

ENV = "VERIFYBENCH_PDL"
_FORCED: list[bool] = []


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def capable(device) -> bool:
    """Whether PDL can run on `device`: CUDA, sm_90 or newer, not the interpreter (it has no inline asm)."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def enabled(device) -> bool:
    """Whether kernels on `device` launch with PDL by default (see the module doc)."""
    if _FORCED:
        return _FORCED[-1] and capable(device)
    value = os.environ.get(ENV, "1")
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
