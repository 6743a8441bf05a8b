"""Which GPU a device is and what it holds, read in this one place: its name (the config tables' key), SM count,
compute capability, shared memory per block and total memory, with stand-ins where no CUDA device reports them."""
from __future__ import annotations

import functools

import torch

# Shared memory per block (opt-in maximum) by compute capability, for a device torch cannot ask and for compiling
# without a GPU
SMEM_LIMIT_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
DEFAULT_SMS = 132  # an H100/H200: the SM count used where no CUDA device reports one (the interpreter)


def _cuda_index(device) -> int | None:
    """The CUDA index of `device` ('cuda' is the current device), or None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def _props(index: int) -> dict:
    """The one read of a CUDA device's properties."""
    p = torch.cuda.get_device_properties(index)
    cc = 10 * p.major + p.minor
    smem = getattr(p, "shared_memory_per_block_optin", 0) or SMEM_LIMIT_BYTES.get(cc, min(SMEM_LIMIT_BYTES.values()))
    return {"name": p.name, "sms": p.multi_processor_count, "cc": cc, "smem": smem, "memory": p.total_memory,
            "l2": getattr(p, "L2_cache_size", None)}


def properties(device) -> dict | None:
    """name, sms, cc (compute capability as 90), smem (shared memory per block, bytes), memory (bytes), l2 (bytes
    or None) of a CUDA device; None off CUDA."""
    index = _cuda_index(device)
    return None if index is None else _props(index)


@functools.lru_cache(maxsize=None)
def _name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_name(device) -> str:
    """The table key of `device`: its CUDA name ('NVIDIA H200'), or 'cpu'."""
    return _name(torch.device(device))


def sm_count(device) -> int:
    """SMs of a CUDA device; DEFAULT_SMS elsewhere (the interpreter)."""
    p = properties(device)
    return DEFAULT_SMS if p is None else p["sms"]


def capability(device) -> int | None:
    """Compute capability of a CUDA device as 90 (sm_90); None off CUDA."""
    p = properties(device)
    return None if p is None else p["cc"]


def total_memory_bytes(device) -> int | None:
    """A CUDA device's whole memory in bytes; None off CUDA."""
    p = properties(device)
    return None if p is None else p["memory"]


def device_limits(device) -> tuple[int, int] | None:
    """(compute capability as 90, shared memory per block in bytes) of a CUDA device; None off CUDA (the
    interpreter has no shared memory to fit)."""
    p = properties(device)
    return None if p is None else (p["cc"], p["smem"])
