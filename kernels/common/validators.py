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


def check_q_cache(q, cache, dtypes: tuple, tokens: str, width: str, width_word: str) -> tuple[int, int, int]:
    """The MLA kernels' q [heads, tokens, width] and cache [rows, width]: 3-D and 2-D tensors of one dtype among
    `dtypes` on one device, every size >= 1, the cache's rows as wide as q's heads. `tokens`, `width` and
    `width_word` are how the caller's docs name them ("n", "D", "head dim"). Returns (heads, tokens, width)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [heads, {tokens}, {width}] tensor, got {getattr(q, 'shape', type(q))}")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2:
        raise ValueError(f"cache must be a [rows, {width}] tensor, got {getattr(cache, 'shape', type(cache))}")
    heads, t, w = q.shape
    if heads < 1 or t < 1 or w < 1:
        raise ValueError(f"q must have heads, {tokens}, {width} >= 1, got {tuple(q.shape)}")
    if cache.shape[1] != w:
        raise ValueError(f"cache rows must have q's {width_word} {width} = {w}, got {tuple(cache.shape)}")
    if q.dtype not in dtypes or cache.dtype != q.dtype:
        raise ValueError(f"q and cache must share a dtype among {dtypes}, got {q.dtype} and {cache.dtype}")
    if q.device != cache.device:
        raise ValueError(f"q and cache must be on one device, got {q.device} and {cache.device}")
    return heads, t, w


def check_out(out, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A caller's `out` buffer: a tensor of `shape` and `dtype` on `device`, unit stride along its last dim (the
    kernels store rows); None -> a fresh one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (not isinstance(out, torch.Tensor) or out.shape != shape or out.dtype != dtype or out.device != device
            or out.stride(-1) != 1):
        raise ValueError(f"out must be a [{', '.join(map(str, shape))}] {dtype} tensor on {device} with unit stride "
                         f"along its last dim, got {getattr(out, 'shape', type(out))}")
    return out


def check_matrix(name: str, t, dtypes: tuple, dtype_names: str, shape_words: str = "2-D",
                 wrong_kind: type[Exception] = ValueError) -> None:
    """`t` a 2-D tensor with a dtype among `dtypes` (named `dtype_names` in the error); a non-tensor or another
    dtype raises `wrong_kind` (TypeError where a family's API has always said so), a wrong rank a ValueError."""
    if not isinstance(t, torch.Tensor):
        raise wrong_kind(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise wrong_kind(f"{name} must be {dtype_names}, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be {shape_words}, got shape {tuple(t.shape)}")
