"""Which GPU a device is, as the kernels' config tables and shared-memory fits ask: its name (the tables' key) and
its limits (compute capability, shared memory per block), with the limits of architectures that are not here."""
from __future__ import annotations

import functools

import torch

# Shared memory per block (opt-in maximum) by compute capability, for a device torch cannot ask and for compiling
# without a GPU
SMEM_LIMIT_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


@functools.lru_cache(maxsize=None)
def _name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_name(device) -> str:
    """The table key of `device`: its CUDA name ('NVIDIA H200'), or 'cpu'."""
    return _name(torch.device(device))


@functools.lru_cache(maxsize=None)
def _limits(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return cc, smem or SMEM_LIMIT_BYTES.get(cc, min(SMEM_LIMIT_BYTES.values()))


def device_limits(device) -> tuple[int, int] | None:
    """(compute capability as 90, shared memory per block in bytes) of a CUDA device; None off CUDA (the
    interpreter has no shared memory to fit)."""
    return _limits(torch.device(device))
