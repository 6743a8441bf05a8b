"""MLA decode attention over the latent KV cache (the verify forward's `attn_core`): a torch reference
and a Triton flash-decoding kernel.

Semantics (weight-absorbed MLA at decode/verify sizes, as engines run it): q [heads, n, D] (D = kv_lora + rope
dims, 576 = 512 + 64 for Kimi/DeepSeek), cache [rows, D] holds one latent vector per token, shared by all heads.
With keys = cache[:length]:
    o[h, i] = softmax(scale * q[h, i] . keys^T) @ keys[:, :kv_lora]      -> [heads, n, kv_lora] in q's dtype
Every query attends all `length` keys (no causal mask: the verify forward writes its n tokens' slots first and
lets each of them see all of them, as the torch path of harness/model/forward.py does). `scale` defaults to D ** -0.5;
the MLA forward uses (qk_nope + qk_rope) ** -0.5 (192 ** -0.5 for Kimi), so that caller must pass it.

Why a kernel: the torch path (two matmuls + softmax) launches ~6 kernels per layer, materializes fp32 scores and
may copy the strided keys[:, :kv_lora] slice; ~30 us per layer where the cache bytes need ~1 us. The Triton
flash-decoding kernels (kernels.py) split the context across programs and combine the splits.
No host syncs and no data-dependent host logic (`length` is a Python int, fixed per captured graph), so a call is
CUDA-graph capturable; the scratch comes from torch's caching allocator (the graph's pool when capturing).
Launch configs: configs.py (the per-GPU tables, the defaults, the shared-memory fit).
"""
from __future__ import annotations

import math
import operator

import torch

from verifybench.kernels.common import config_tables, empty
from verifybench.kernels.mla_decode import kernels
from verifybench.kernels.mla_decode.kernels import launches, split_keys  # noqa: F401 (the grid rule, for callers)
from verifybench.kernels.common import pdl as _pdl
from verifybench.kernels.common.validators import check_out, check_q_cache
from verifybench.kernels.common.devices import sm_count
from verifybench.kernels.mla_decode.configs import cached_config, check_config, default_config, default_num_splits

LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q, cache, length, kv_lora, scale):
    """Shared input checks; returns (length, scale) as Python numbers."""
    heads, n, d = check_q_cache(q, cache, DTYPES, "n", "D", "head dim")
    if isinstance(length, (bool, torch.Tensor)):  # a tensor would need a device sync (and break graph capture)
        raise ValueError(f"length must be a Python int (fixed per captured graph), got {type(length)}")
    try:
        length = operator.index(length)
    except TypeError:
        raise ValueError(f"length must be a Python int (fixed per captured graph), got {type(length)}") from None
    if not 1 <= length <= cache.shape[0]:
        raise ValueError(f"length must be in 1..{cache.shape[0]} (the cache's rows), got {length}")
    if isinstance(kv_lora, bool) or not isinstance(kv_lora, int) or not 1 <= kv_lora <= d:
        raise ValueError(f"kv_lora must be an int in 1..D = {d}, got {kv_lora!r}")
    scale = d ** -0.5 if scale is None else scale
    if isinstance(scale, (bool, torch.Tensor)) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python float, got {scale!r}")
    return length, float(scale)


def mla_decode_reference(q, cache, length, kv_lora=512, scale=None):
    """fp32 torch reference: o [heads, n, kv_lora] in q's dtype (see the module docstring; scale defaults to
    D ** -0.5, the MLA forward passes (qk_nope + qk_rope) ** -0.5)."""
    length, scale = _check(q, cache, length, kv_lora, scale)
    keys = cache[:length].float()
    p = torch.softmax((q.float() @ keys.T) * scale, dim=-1)
    return (p @ keys[:, :kv_lora]).to(q.dtype)


def mla_decode(q, cache, length, kv_lora=512, scale=None, num_splits=None, *, out=None, config=None, pdl=None):
    """Triton flash-decoding MLA attention; same result as mla_decode_reference (scale defaults to D ** -0.5, the MLA
    forward passes (qk_nope + qk_rope) ** -0.5). q [heads, n, D] and cache [rows >= length, D] need unit stride
    along D (other strides are free). num_splits: context splits (it is lowered so that no split is empty).
    out: optional [heads, n, kv_lora] tensor of q's dtype to write. config: overrides of the DEFAULT_CONFIG
    of configs.py (block_rows, block_keys: powers of two >= 16; num_warps, num_stages; num_splits, which the
    argument overrides). Neither num_splits nor config given: select_config (the tuned table for this GPU, else the
    defaults); num_splits alone: default_config's tile; config without num_splits: default_num_splits for its
    block_rows. pdl (None: pdl.enabled): both launches with programmatic dependent launch
    (kernels/common/pdl.py); each waits before reading anything."""
    length, scale, num_splits, plan = _plan(q, cache, length, kv_lora, scale, num_splits, config)
    out = check_out(out, (q.shape[0], q.shape[1], kv_lora), q.dtype, q.device)
    return kernels.launch(plan, q, cache, out, length, num_splits, scale * LOG2E, _pdl.resolve(pdl, q.device))


def _plan(q, cache, length, kv_lora, scale, num_splits, config):
    """(length, scale, splits asked, launch plan) of a call, its inputs checked and its config picked (mla_decode's
    docstring): the one home of its grids."""
    length, scale = _check(q, cache, length, kv_lora, scale)
    heads, n, d = q.shape
    if q.stride(2) != 1 or cache.stride(1) != 1:
        raise ValueError(f"q and cache need unit stride along D, got strides {q.stride()} and {cache.stride()}")
    if config is None and num_splits is None:
        cfg = cached_config(n, heads, length, d, kv_lora, q.dtype, q.device, config_tables.state())
    elif config is None:  # a split count alone: the default tile of q's dtype (fp32 needs smaller tiles)
        cfg = default_config(n, heads, length, q.device, q.dtype, d, kv_lora)
    else:
        cfg = check_config(config)
    if num_splits is None:
        num_splits = cfg["num_splits"]
    if num_splits is None:
        num_splits = default_num_splits(length, heads * n, cfg["block_rows"], sm_count(q.device))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    return length, scale, num_splits, kernels.launches(heads, n, d, kv_lora, length, num_splits, cfg)


def launch_grids(q, cache, length, kv_lora=512, scale=None, num_splits=None, *, config=None,
                 pdl=None) -> list[empty.Launch]:
    """The launches mla_decode makes with these arguments (grids, warps, PDL), for their empty stand-ins
    (kernels/common/empty.py): stage 1 over (row blocks, splits run), then stage 2 where there are several."""
    plan = _plan(q, cache, length, kv_lora, scale, num_splits, config)[3]
    return empty.of_plan(plan, _pdl.resolve(pdl, q.device))
