"""MLA attention of a speculative verify step over the latent KV cache with a tree mask: a plain-torch reference and
two Triton kernels, the engine-style serial "extend" and our split-KV "split_kv".

Semantics (absorbed MLA, one tensor-parallel rank): cache [rows, DK] holds one latent row per token (DK = kv_lora +
rope, 576 = 512 + 64 for Kimi-K2.5), shared by all heads; q [heads, T, DK], T = B * D, request-major. Request b's keys
are the cache rows [start_b, start_b + L_b) (its prefix), then [start_b + L_b, start_b + L_b + D) (its tree tokens'
own rows). Its token i sees the whole prefix and tree key j iff mask[b, i, j] (j is i or an ancestor):
    o[h, b*D + i] = softmax(scale * q[h, b*D + i] . keys^T over the visible keys) @ keys[:, :kv_lora]
in q's dtype, fp32 accumulation. mask: bool [B, D, D] (or flat, build_tree's "qlen_only"), or one little-endian word
per query, bit j = column j, [B * D] or [B, D] ("qlen_only_bitpacking": uint8 / int16 / int32; int64 for D <= 64).
A query that sees no key (L_b = 0 and an empty mask row) gets NaN, as a softmax over nothing does.

"extend" (kernels_extend.py) is what SGLang's Triton backend runs for verify (its prefill kernel): one head per
program, a serial loop over the whole prefix, then one over the D tree keys with the mask. "split_kv"
(kernels_split_kv.py, mla_decode's verify form): a request's heads x D rows form one query matrix, BLOCK_M rows per
program; its L_b + D keys are cut on the device into splits of whole key tiles (so one captured graph serves any L_b),
and a combine kernel merges the splits each request used. This module checks the inputs, completes the config and
picks the variant; the kernels' files hold their grids and launches.
"""
from __future__ import annotations

import math

import torch
import triton

from verifybench.kernels.common import compiler, empty
from verifybench.kernels.mla_verify import kernels_extend as extend
from verifybench.kernels.mla_verify import kernels_split_kv as split_kv
from verifybench.kernels.common import pdl as _pdl
from verifybench.kernels.common.validators import check_out, check_q_cache
from verifybench.kernels.common.devices import DEFAULT_SMS, SMEM_LIMIT_BYTES, sm_count  # noqa: F401 (for callers)

VARIANTS = ("split_kv", "extend")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
WORD_BITS = {torch.uint8: 8, torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}  # bit-packed masks
MAX_TREE = 64  # tree tokens per request
LOG2E = 1.4426950408889634
PROGRAMS_PER_SM = 2  # split_kv programs the default split count aims at per SM
MAX_SPLITS = 256  # the combine holds all splits of a row at once

# split_kv: the fastest of scripts/split_kv_sweep.py's 32 tile x minimum-keys configs over 1k-32k context at D = 3
# and 6 on an H100 (2026-12-07, docs/FINDINGS.md §12): 16 rows x 32 keys, 4 warps, 3 stages (168 registers, no spill;
# 2 stages took 255 and spilled) and splits of >= 16 keys (whole 32-key tiles: at 1k, 33 splits of 32 keys instead of
# 9 of 128). extend: what SGLang picks for a 576-wide head on sm_86/89/120 (ENGINE_EXTEND_CONFIGS). Every default
# fits sm_120's 101,376 bytes of shared memory per block (split_kv's: 94,208).
DEFAULT_CONFIGS = {
    "split_kv": {"num_splits": None, "min_split_keys": 16, "block_rows": 16, "block_keys": 32, "num_warps": 4,
                 "num_stages": 3},
    "extend": {"block_rows": 32, "block_keys": 32, "num_warps": 8, "num_stages": 1},
}
TILE_KEYS = ("block_rows", "block_keys", "num_warps", "num_stages")  # what a compiled kernel depends on
CONFIG_SPACE = {  # tile configs a tuner may choose from (split_kv's split count is swept beside them: SPLIT_CHOICES)
    "split_kv": [dict(zip(TILE_KEYS, t)) for t in ((16, 16, 4, 2), (16, 32, 4, 2), (16, 32, 4, 3), (16, 64, 4, 2),
                                                   (32, 32, 8, 2), (32, 64, 8, 2), (64, 16, 8, 2), (64, 32, 8, 2))],
    "extend": [dict(zip(TILE_KEYS, t)) for t in ((16, 32, 4, 1), (16, 32, 4, 2), (16, 64, 4, 1), (16, 64, 8, 1),
                                                 (32, 32, 8, 1), (32, 64, 8, 1), (64, 32, 8, 1))],
}  # over sm_120's limit (bf16, 576): split_kv 32x64 and 64x32 (114,688 B), extend 32x64 and 64x32 (106-111 KB)
SPLIT_CHOICES = (None, 8, 16, 32, 64, 128)
# SGLang's extend tiles for Lq = 576 per compute capability, as ENGINE_EXTEND_SOURCE's launcher picks them (its
# _get_block_sizes_for_extend_attention; one stage): timing "extend" with the GPU's entry mirrors the engine. sm_90's
# 32 x 64 needs 106,496 bytes here: not on sm_120. tests/engines/test_engines.py holds the table against the
# installed SGLang.
ENGINE_EXTEND_SOURCE = "sglang 0.5.10.post1"
ENGINE_EXTEND_CONFIGS = {cc: dict(zip(TILE_KEYS, t)) for cc, t in (
    (80, (32, 64, 8, 1)), (86, (32, 32, 8, 1)), (89, (32, 32, 8, 1)), (90, (32, 64, 8, 1)), (100, (32, 64, 8, 1)),
    (120, (32, 32, 8, 1)))}


# ---------------------------------------------------------------------------------------------------- checks

def _check(q, cache, starts, prefix_lens, mask, kv_lora, scale):
    """Host-side input checks (no device sync); returns (B, D, mask_is_words, scale)."""
    heads, t, dk = check_q_cache(q, cache, DTYPES, "T", "DK", "width")
    for name, x in (("starts", starts), ("prefix_lens", prefix_lens)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in INDEX_DTYPES or x.numel() < 1:
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor of B >= 1 entries (one per request), got "
                             f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    b = starts.numel()
    if prefix_lens.numel() != b:
        raise ValueError(f"starts and prefix_lens must have one entry per request, got {b} and {prefix_lens.numel()}")
    if t % b:
        raise ValueError(f"q's T = {t} tokens must be B * D for B = {b} requests (len(starts))")
    d = t // b
    if d > MAX_TREE:
        raise ValueError(f"D = T / B = {d} tree tokens per request; at most {MAX_TREE}")
    if not isinstance(mask, torch.Tensor) or mask.device != q.device:
        raise ValueError(f"mask must be a tensor on q's device {q.device}, got {getattr(mask, 'device', type(mask))}")
    words = mask.dtype != torch.bool
    if not words and mask.shape not in ((b, d, d), (b * d * d,)):
        raise ValueError(f"a bool mask must be [B, D, D] = [{b}, {d}, {d}] (or flat), got {tuple(mask.shape)}")
    if words:
        if mask.dtype not in WORD_BITS:
            raise ValueError(f"mask must be bool or bit-packed words of {sorted(map(str, WORD_BITS))}, got "
                             f"{mask.dtype}")
        if mask.shape not in ((b * d,), (b, d)):
            raise ValueError(f"a bit-packed mask must be [B * D] = [{b * d}] or [B, D] (one word per query), got "
                             f"{tuple(mask.shape)}")
        if d > WORD_BITS[mask.dtype]:
            raise ValueError(f"a {mask.dtype} word holds {WORD_BITS[mask.dtype]} columns, but D = {d}")
    if not mask.is_contiguous():
        raise ValueError("mask must be contiguous")
    if isinstance(kv_lora, bool) or not isinstance(kv_lora, int) or not 1 <= kv_lora <= dk:
        raise ValueError(f"kv_lora must be an int in 1..DK = {dk}, got {kv_lora!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive Python float (MLA: (qk_nope + qk_rope) ** -0.5), got "
                         f"{scale!r}")
    if starts.device.type == "cpu":  # values readable without a device sync
        _check_rows(starts.tolist(), prefix_lens.tolist(), d, cache.shape[0])
    return b, d, words, float(scale)


def _check_rows(starts, lens, d, rows):
    for i, (s, length) in enumerate(zip(starts, lens)):
        if length < 0 or s < 0 or s + length + d > rows:
            raise ValueError(f"request {i}: start {s}, prefix_len {length} need start >= 0, prefix_len >= 0 and "
                             f"start + prefix_len + D <= {rows} (the cache's rows)")


def _bool_mask(mask, b, d):
    if mask.dtype == torch.bool:
        return mask.view(b, d, d)
    cols = torch.arange(d, device=mask.device)
    return ((mask.reshape(b, d, 1).long() >> cols) & 1).bool()


def mla_verify_reference(q, cache, starts, prefix_lens, mask, kv_lora, scale):
    """fp32 torch reference, one request at a time: o [heads, T, kv_lora] in q's dtype (module docstring)."""
    b, d, _, scale = _check(q, cache, starts, prefix_lens, mask, kv_lora, scale)
    seen = _bool_mask(mask, b, d)
    out = torch.empty(q.shape[0], q.shape[1], kv_lora, dtype=torch.float32, device=q.device)
    _check_rows(starts.tolist(), prefix_lens.tolist(), d, cache.shape[0])  # the reference may sync
    for i, (start, length) in enumerate(zip(starts.tolist(), prefix_lens.tolist())):
        keys = cache[start:start + length + d].float()
        vis = torch.cat([torch.ones(d, length, dtype=torch.bool, device=q.device), seen[i]], 1)
        scores = (q[:, i * d:(i + 1) * d].float() @ keys.T) * scale
        p = torch.softmax(scores.masked_fill(~vis, float("-inf")), dim=-1)
        out[:, i * d:(i + 1) * d] = p @ keys[:, :kv_lora]
    return out.to(q.dtype)


def bytes_moved(heads: int, t: int, l_total: int, d: int, kv_lora: int, rope: int, itemsize: int) -> int:
    """Bytes an ideal kernel moves: every request's L_b + D key rows read once (l_total = sum of L_b, plus T = B * D
    tree rows), the queries read and the outputs written; mask and partials left out."""
    return ((l_total + t) * (kv_lora + rope) + heads * t * (2 * kv_lora + rope)) * itemsize


# ---------------------------------------------------------------------------------------------------- configs

def check_config(variant: str, config: dict | None = None) -> dict:
    """DEFAULT_CONFIGS[variant] completed by `config`, or a ValueError naming the bad key."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    cfg = dict(DEFAULT_CONFIGS[variant])
    for k, v in config.items():
        if k not in cfg:
            raise ValueError(f"unknown {variant} config key {k!r}; known: {sorted(cfg)}")
        cfg[k] = v
    bad = lambda k: isinstance(cfg[k], bool) or not isinstance(cfg[k], int)  # noqa: E731
    for k in ("block_rows", "block_keys"):
        if bad(k) or cfg[k] < 16 or cfg[k] & (cfg[k] - 1):
            raise ValueError(f"{k} must be a power of two >= 16 (tl.dot's minimum), got {cfg[k]!r}")
    if bad("num_warps") or cfg["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {cfg['num_warps']!r}")
    if bad("num_stages") or not 1 <= cfg["num_stages"] <= 8:
        raise ValueError(f"num_stages must be an int in 1..8, got {cfg['num_stages']!r}")
    if variant == "split_kv":
        ns = cfg["num_splits"]
        if ns is not None and (bad("num_splits") or not 1 <= ns <= MAX_SPLITS):
            raise ValueError(f"num_splits must be an int in 1..{MAX_SPLITS} (or None: fill the GPU), got {ns!r}")
        if bad("min_split_keys") or cfg["min_split_keys"] < 1:
            raise ValueError(f"min_split_keys must be an int >= 1, got {cfg['min_split_keys']!r}")
    return cfg


def default_num_splits(batch: int, rows_per_request: int, block_rows: int, sms: int = DEFAULT_SMS) -> int:
    """Splits per request so that split_kv runs about PROGRAMS_PER_SM programs per SM at long contexts (shorter
    requests use fewer: each used split keeps >= min_split_keys keys; the rest exit at once)."""
    programs = batch * triton.cdiv(rows_per_request, block_rows)
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, programs), MAX_SPLITS))


# ---------------------------------------------------------------------------------------------------- wrapper

def _launches(variant, cfg, heads, b, d, dk, kv_lora, words, num_splits):
    """[(kernel, grid, constexprs, launch options)] of one call; shared by mla_verify and shared_memory_bytes."""
    consts = dict(D=d, DK=dk, DV=kv_lora, BLOCK_DV=max(16, triton.next_power_of_2(kv_lora)),
                  BLOCK_DR=max(16, triton.next_power_of_2(dk - kv_lora)) if dk > kv_lora else 0,
                  BLOCK_M=cfg["block_rows"], BLOCK_N=cfg["block_keys"], MASK_WORDS=words)
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if variant == "extend":
        return extend.launches(heads, b, consts, opts)
    return split_kv.launches(heads, b, num_splits, consts, opts)


def _plan(q, cache, starts, prefix_lens, mask, kv_lora, scale, variant, config):
    """(config, scale, splits launched, launch plan) of a call, its inputs checked: the one home of its grids."""
    b, d, words, scale = _check(q, cache, starts, prefix_lens, mask, kv_lora, scale)
    cfg = check_config(variant, config)
    heads, _, dk = q.shape
    if q.stride(2) != 1 or cache.stride(1) != 1:
        raise ValueError(f"q and cache need unit stride along DK, got strides {q.stride()} and {cache.stride()}")
    num_splits = 1
    if variant == "split_kv":
        num_splits = cfg["num_splits"] or default_num_splits(b, heads * d, cfg["block_rows"], sm_count(q.device))
    return cfg, scale, num_splits, _launches(variant, cfg, heads, b, d, dk, kv_lora, words, num_splits)


def launch_grids(q, cache, starts, prefix_lens, mask, kv_lora, scale, variant="split_kv", config=None, *,
                 pdl=None) -> list[empty.Launch]:
    """The launches mla_verify makes with these arguments (grids, warps, PDL), for their empty stand-ins
    (kernels/common/empty.py): the split kernel over every launched split (a request's unused ones exit at once),
    then the combine where there are several."""
    plan = _plan(q, cache, starts, prefix_lens, mask, kv_lora, scale, variant, config)[3]
    return empty.of_plan(plan, _pdl.resolve(pdl, q.device))


def mla_verify(q, cache, starts, prefix_lens, mask, kv_lora, scale, variant="split_kv", config=None, *, out=None,
               pdl=None):
    """Verify attention of B requests x D tree tokens (module docstring); same result as mla_verify_reference.

    q [heads, T, DK], cache [rows, DK] (unit stride along DK), starts / prefix_lens int32/int64 [B] on q's device,
    mask bool [B, D, D] or bit-packed words, kv_lora, scale (a Python float). variant: "split_kv" or "extend".
    config: overrides of DEFAULT_CONFIGS[variant] (check_config). out: optional [heads, T, kv_lora] tensor of q's
    dtype with unit last stride. pdl (None: pdl.enabled): launch with programmatic dependent launch; every
    kernel waits before reading anything.
    CUDA-graph capturable: shapes, kv_lora, scale, variant and config are host values fixed per graph; starts,
    prefix_lens, mask, q and cache are read on the device, so a replay takes new values in the same tensors (split_kv
    re-cuts each request's keys per replay). Checked on the host: shapes, dtypes, devices, strides, D vs the mask;
    row ranges (start_b, L_b >= 0, start_b + L_b + D <= rows) only when starts / prefix_lens are CPU tensors (the
    interpreter). Not checked on a GPU (it would need a sync): those ranges, and that every query sees some key
    (mask[b, i, i] set, the tree's rule); a violation reads outside the cache or gives NaN rows."""
    cfg, scale, num_splits, plan = _plan(q, cache, starts, prefix_lens, mask, kv_lora, scale, variant, config)
    out = check_out(out, (q.shape[0], q.shape[1], kv_lora), q.dtype, q.device)
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    on = _pdl.resolve(pdl, q.device)
    if variant == "extend":
        return extend.launch(plan, q, cache, starts, prefix_lens, mask, out, scale * LOG2E, on)
    return split_kv.launch(plan, q, cache, starts, prefix_lens, mask, out, num_splits, cfg["min_split_keys"],
                           scale * LOG2E, on)


# ---------------------------------------------------------------------------------------------------- shared memory

_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def shared_memory_bytes(cases, *, heads: int = 8, d: int = 4, kv_lora: int = 512, rope: int = 64,
                        dtype: str = "bfloat16", mask_words: bool = False, num_splits: int = 32) -> list[dict]:
    """Per (variant, config or None, cc) in `cases`: {kernel name: shared memory per block, bytes} of the kernels the
    variant launches with that config (completed from DEFAULT_CONFIGS) at these shapes, compiled for sm_<cc> without
    a GPU (compare with SMEM_LIMIT_BYTES[cc]), through compiler.compiled_shared (its cache serves repeats).
    Pointers and 16-multiple ints get the divisibility hints a launch gives."""
    from triton.runtime.jit import JITFunction

    cases = [(v, c, int(cc)) for v, c, cc in cases]
    shape = [heads, d, kv_lora, rope, dtype, mask_words, num_splits]
    if not isinstance(split_kv._split_kernel, JITFunction):  # the interpreter's kernels cannot be compiled
        return compiler.uninterpreted(__name__, "_shared_of_cases", cases, *shape)
    return _shared_of_cases(cases, *shape)


def _shared_of_cases(cases, heads, d, kv_lora, rope, dtype, mask_words, num_splits) -> list[dict]:
    return [{fn.__name__: compiler.compiled_shared(fn, types, consts, opts, cc)
             for fn, types, consts, opts in compiles(variant, config, heads=heads, d=d, kv_lora=kv_lora, rope=rope,
                                                     dtype=dtype, mask_words=mask_words, num_splits=num_splits)}
            for variant, config, cc in cases]


def compiles(variant: str, config: dict | None, *, heads: int = 8, d: int = 3, kv_lora: int = 512, rope: int = 64,
             dtype: str = "bfloat16", mask_words: bool = False, num_splits: int = 32) -> list[tuple]:
    """[(kernel, argument types, constexprs, options)] of one call of `variant` at these shapes (one request: T = D),
    as a launch compiles them: pointers and 16-multiple ints with the divisibility hints a launch gives."""
    dk, t = kv_lora + rope, d
    ty = _TRITON_TYPES[getattr(torch, dtype)]
    cfg = check_config(variant, config)
    min_keys = cfg.get("min_split_keys", DEFAULT_CONFIGS["split_kv"]["min_split_keys"])  # extend has none
    ints = dict(T=t, num_splits=num_splits, min_split_keys=min_keys, stride_qh=t * dk,
                stride_qt=dk, stride_c=dk, stride_oh=t * kv_lora, stride_ot=kv_lora, tree_keys=d)
    types = dict(q=ty, cache=ty, out=ty, rows="i64", starts="i32", lens="i32", mask="i32" if mask_words else "u8",
                 part_o="fp32", part_lse="fp32")
    types = {k: f"*{v}" for k, v in types.items()}
    types |= {k: "16:i32" if v % 16 == 0 else "i32" for k, v in ints.items()}
    types["scale_log2"] = types["kv_scale"] = "fp32"
    return [(fn, types, dict(consts, PDL=False), opts)
            for fn, _, consts, opts in _launches(variant, cfg, heads, 1, d, dk, kv_lora, mask_words,
                                                 num_splits if variant == "split_kv" else 1)]


def compiled_resources(variant: str, config: dict | None, cc: int, *, heads: int = 8, d: int = 3,
                       kv_lora: int = 512, rope: int = 64, dtype: str = "bfloat16",
                       mask_words: bool = False) -> dict[str, dict]:
    """{kernel name: {'registers', 'stack_bytes', 'shared_bytes', 'loops'}} of `variant` with `config` compiled in
    full for sm_<cc> without a GPU (compiler.compiled_resources): whether ptxas gave the kernel the registers its
    tiles need, and what each loop's iteration spills, which decide its speed more than anything the timing of
    another GPU shows."""
    from triton.runtime.jit import JITFunction

    args = [variant, config, int(cc), heads, d, kv_lora, rope, dtype, mask_words]
    if not isinstance(extend._extend_kernel, JITFunction):  # the interpreter's kernels cannot be compiled
        return compiler.uninterpreted(__name__, "_resources", *args)
    return _resources(*args)


def _resources(variant, config, cc, heads, d, kv_lora, rope, dtype, mask_words) -> dict[str, dict]:
    return {fn.__name__: compiler.compiled_resources(fn, types, consts, opts, cc)
            for fn, types, consts, opts in compiles(variant, config, heads=heads, d=d, kv_lora=kv_lora, rope=rope,
                                                    dtype=dtype, mask_words=mask_words)}
