"""MLA decode attention over the latent KV cache (the verify forward's `attn_core`): a torch reference
and a Triton flash-decoding kernel.

Semantics (weight-absorbed MLA at decode/verify sizes, as engines run it): q [heads, n, D] (D = kv_lora + rope
dims, 576 = 512 + 64 for Kimi/DeepSeek), cache [rows, D] holds one latent vector per token, shared by all heads.
With keys = cache[:length]:
    o[h, i] = softmax(scale * q[h, i] . keys^T) @ keys[:, :kv_lora]      -> [heads, n, kv_lora] in q's dtype
Every query attends all `length` keys (no causal mask: the verify forward writes its n tokens' slots first and
lets each of them see all of them, as the torch path in verify_forward.py does). `scale` defaults to D ** -0.5;
the MLA forward uses (qk_nope + qk_rope) ** -0.5 (192 ** -0.5 for Kimi), so that caller must pass it.

Why a kernel: the torch path (two matmuls + softmax) launches ~6 kernels per layer, materializes fp32 scores and
may copy the strided keys[:, :kv_lora] slice; ~30 us per layer where the cache bytes need ~1 us. Here:
Stage 1, grid (row blocks, splits): the heads x n query rows are one [heads * n, D] matrix (every head reads the
  same cache), BLOCK_M of them per program; each program streams its split of the keys in BLOCK_N-key tiles read
  once for all its rows (the tile serves both dots: scores from all D columns, values from the first kv_lora),
  online softmax in fp32 (exp2 domain), and writes its normalized partial o [splits, rows, kv_lora] fp32 and
  log2-sum-exp [splits, rows]. Row blocks of one split are adjacent in the grid, so with several row blocks the
  cache is read from DRAM about once and the repeats hit L2.
Stage 2, grid (rows, kv_lora chunks): combines the splits by log-sum-exp weights and writes o in q's dtype.
With one split, stage 1 writes o itself (one launch).
No host syncs and no data-dependent host logic (`length` is a Python int, fixed per captured graph), so a call is
CUDA-graph capturable; the scratch comes from torch's caching allocator (the graph's pool when capturing).

Launch configs: select_config reads a per-GPU table (mla_decode_configs.json, with the user's from `verifybench tune`
over it) keyed by GPU name, "heads,n,D,kv_lora" and a context bucket (the largest tuned length <= length); the
untuned default (DEFAULT_CONFIG, default_num_splits) elsewhere, and where the entry exceeds the GPU's shared memory.
"""
from __future__ import annotations

import functools
import math
import operator
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from verifybench.kernels import config_tables
from verifybench.kernels import pdl as _pdl
from verifybench.kernels.config_tables import device_name

# triton.jit picks the interpreter at decoration time: compiling for a target needs a process without it
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Used without a table entry: the tile the H200 table picks at 4096 keys for n = 1..7 (16 query rows x 64 keys, 4
# warps, 2 stages; 94,208 B of shared memory compiled for every supported architecture, under sm_120's 101,376 B),
# each split one 64-key tile or more (the table's 65 splits of 4096 keys): fewer keys per split and the partial
# outputs (2 KiB per row per split) outweigh the keys. Larger block_rows (32 or 64, 8 warps) read the cache fewer
# times per split.
DEFAULT_CONFIG = {"block_rows": 16, "block_keys": 64, "num_warps": 4, "num_stages": 2}
# fp32 (the references' precision): tiles of twice the bytes per key, the first of these that fits the GPU (at
# 576/512 the first needs 176,128 B and none fits 101,376 B: there fp32 is refused)
FP32_CONFIGS = ({**DEFAULT_CONFIG, "block_keys": 32}, {**DEFAULT_CONFIG, "block_keys": 16},
                {**DEFAULT_CONFIG, "block_keys": 16, "num_stages": 1})
MIN_SPLIT_KEYS = 64
PROGRAMS_PER_SM = 2  # stage-1 programs the default split count aims at per SM
MAX_SPLITS = 256
DEFAULT_SMS = 132  # an H100/H200; used off CUDA (the interpreter)
COMBINE_SPLITS = MAX_SPLITS  # splits stage 2 reads per step: all of them, so its loops run once (two L2 round trips)
COMBINE_COLS = 128  # kv_lora columns per stage-2 program, at most
COMBINE_TILE = 8192  # fp32 partial values a stage-2 program holds at once (64 registers per thread at 4 warps)
LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CONFIG_PATH = Path(__file__).with_name("mla_decode_configs.json")
CONFIG_KEYS = ("num_splits", *DEFAULT_CONFIG)  # what select_config returns and `config` may hold
TABLE_EXTRAS = ("us", "default_us", "torch_us")  # timings the tuner stores beside a config


def _check(q, cache, length, kv_lora, scale):
    """Shared input checks; returns (length, scale) as Python numbers."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [heads, n, D] tensor, got {getattr(q, 'shape', type(q))}")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2:
        raise ValueError(f"cache must be a [rows, D] tensor, got {getattr(cache, 'shape', type(cache))}")
    heads, n, d = q.shape
    if heads < 1 or n < 1 or d < 1:
        raise ValueError(f"q must have heads, n, D >= 1, got {tuple(q.shape)}")
    if cache.shape[1] != d:
        raise ValueError(f"cache rows must have q's head dim D = {d}, got {tuple(cache.shape)}")
    if q.dtype not in DTYPES or cache.dtype != q.dtype:
        raise ValueError(f"q and cache must share a dtype among {DTYPES}, got {q.dtype} and {cache.dtype}")
    if q.device != cache.device:
        raise ValueError(f"q and cache must be on one device, got {q.device} and {cache.device}")
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


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(length: int, rows: int, block_rows: int, sms: int = DEFAULT_SMS) -> int:
    """Splits of the context so that stage 1 has about PROGRAMS_PER_SM programs per SM, each split keeping at least
    MIN_SPLIT_KEYS keys (fewer and the partial outputs cost more traffic than the keys they cover)."""
    row_blocks = triton.cdiv(rows, block_rows)
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, row_blocks), triton.cdiv(length, MIN_SPLIT_KEYS),
                      MAX_SPLITS))


# ---------------------------------------------------------------------------------------------------- configs

def check_config(config: dict) -> dict:
    """DEFAULT_CONFIG completed by `config` (which may also hold "num_splits"; None or absent: from the shape), or a
    ValueError naming the bad key."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    cfg = {"num_splits": None, **DEFAULT_CONFIG}
    for k, v in config.items():
        if k not in cfg:
            raise ValueError(f"unknown config key {k!r}; known: {sorted(cfg)}")
        cfg[k] = v
    for k in ("block_rows", "block_keys"):
        if isinstance(cfg[k], bool) or not isinstance(cfg[k], int) or cfg[k] < 16 or cfg[k] & (cfg[k] - 1):
            raise ValueError(f"{k} must be a power of two >= 16 (tl.dot's minimum), got {cfg[k]!r}")
    if isinstance(cfg["num_warps"], bool) or not isinstance(cfg["num_warps"], int) or \
            cfg["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {cfg['num_warps']!r}")
    if isinstance(cfg["num_stages"], bool) or not isinstance(cfg["num_stages"], int) or \
            not 1 <= cfg["num_stages"] <= 8:
        raise ValueError(f"num_stages must be an int in 1..8, got {cfg['num_stages']!r}")
    ns = cfg["num_splits"]
    if ns is not None and (isinstance(ns, bool) or not isinstance(ns, int) or ns < 1):
        raise ValueError(f"num_splits must be an int >= 1 (or None: from the shape), got {ns!r}")
    return cfg


# Tiles the tuner sweeps, (block_rows, block_keys, num_warps, num_stages), at split counts TUNE_SPLITS: bigger key
# tiles or a deeper pipeline put more cache bytes in flight per SM; 32/64 rows read the cache once for more rows.
# Every (n, tile) is one compile (ROWS and NQ are constexpr), so the list stays short. A tile over a GPU's shared
# memory is skipped there (fits): 32 x 64 needs ~112 KB on sm_120.
TUNE_TILES = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3), (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2)]
TUNE_SPLITS = (16, 32, 64, 128, 256)


def tile_config(tile, num_splits: int | None = None) -> dict:
    br, bk, nw, ns = tile
    return {"num_splits": num_splits, "block_rows": br, "block_keys": bk, "num_warps": nw, "num_stages": ns}


def load_configs(path: Path | str = CONFIG_PATH) -> dict:
    """The tuning table {gpu name: {"shapes": {"heads,n,D,kv_lora": {length bucket: config}}, "tuned_on": {...}}}
    at `path`; read once ({} when the file is absent). Selection reads config_tables.merged(CONFIG_PATH)."""
    return config_tables.load(path)


def save_configs(table: dict, path: Path | str) -> Path:
    _selected.cache_clear()
    return config_tables.save(table, path)


def shape_key(heads: int, n: int, d: int = 576, kv_lora: int = 512) -> str:
    return f"{heads},{n},{d},{kv_lora}"


def default_config(n: int, heads: int, length: int, device="cpu", dtype: torch.dtype = torch.bfloat16, d: int = 576,
                   kv_lora: int = 512) -> dict:
    """The untuned choice: DEFAULT_CONFIG tiles (fp32: the first of FP32_CONFIGS that fits the GPU's shared memory;
    a ValueError naming the bytes when none does), default_num_splits."""
    tile = DEFAULT_CONFIG
    if dtype == torch.float32:
        limits = config_tables.device_limits(device)
        sized = [(c, fits(c, *limits, "float32", heads=heads, n=n, d=d, kv_lora=kv_lora)) for c in FP32_CONFIGS] \
            if limits is not None else [(FP32_CONFIGS[0], (True, 0))]
        fitting = [c for c, (ok, _) in sized if ok]
        if not fitting:
            raise ValueError(f"MLA decode in fp32 at D={d}, kv_lora={kv_lora} needs {sized[-1][1][1]} B of shared "
                             f"memory per block at least; this GPU allows {limits[1]} B: use bf16 or fp16")
        tile = fitting[0]
    return {"num_splits": default_num_splits(length, heads * n, tile["block_rows"], _sm_count(torch.device(device))),
            **tile}


# ---------------------------------------------------------------------------------------------------- shared memory

_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_SHARED: dict[tuple, int] = {}


def shared_bytes_bound(config: dict, d: int = 576, kv_lora: int = 512, dtype: str = "bfloat16") -> int:
    """An upper bound of compiled_shared_bytes on every architecture, without compiling (tests hold it to that):
    num_stages key tiles and twice the query rows, all columns padded as the kernel pads them, and fp32 scores
    twice."""
    c = check_config(config)
    item = torch.finfo(getattr(torch, dtype)).bits // 8
    cols = triton.next_power_of_2(kv_lora) + (triton.next_power_of_2(d - kv_lora) if d > kv_lora else 0)
    rows, keys = c["block_rows"], c["block_keys"]
    return (c["num_stages"] * keys + 2 * rows) * cols * item + 8 * rows * keys


def compiled_shared_bytes(config: dict, cc: int, dtype: str = "bfloat16", heads: int = 8, n: int = 8, d: int = 576,
                          kv_lora: int = 512) -> int:
    """Shared memory per block (bytes) of the config's stage-1 kernel at these shapes on sm_<cc>, compiled without
    a GPU: the larger of one split and several, with PDL on sm_90+ (as launched by default; it adds no tile).
    The combine kernel's tiles do not depend on the config. Cached; under the interpreter one subprocess without
    it compiles."""
    c = check_config(config)
    tile = {k: c[k] for k in DEFAULT_CONFIG}
    key = (*tile.values(), int(cc), dtype, heads, n, d, kv_lora)
    if key not in _SHARED:
        if _INTERPRET:
            _SHARED[key] = config_tables.uninterpreted(__name__, "compiled_shared_bytes", tile, int(cc), dtype,
                                                       heads, n, d, kv_lora)
            return _SHARED[key]
        ty = _TRITON_TYPES[dtype]
        types = {"q": f"*{ty}", "cache": f"*{ty}", "out": f"*{ty}", "part_o": "*fp32", "part_lse": "*fp32",
                 "length": "i32", "split_keys": "16:i32", "stride_qh": "16:i32", "stride_qn": "16:i32",
                 "stride_c": "16:i32", "stride_oh": "16:i32", "stride_on": "16:i32", "scale_log2": "fp32"}
        consts = dict(ROWS=heads * n, NQ=n, D=d, DV=kv_lora, BLOCK_M=c["block_rows"], BLOCK_N=c["block_keys"],
                      BLOCK_DV=max(16, triton.next_power_of_2(kv_lora)),
                      BLOCK_DR=max(16, triton.next_power_of_2(d - kv_lora)) if d > kv_lora else 0)
        opts = {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}
        _SHARED[key] = max(config_tables.compiled_shared(_split_kernel, types, {**consts, "SINGLE": one, "PDL": on},
                                                         opts, int(cc))
                           for one in (False, True) for on in (cc >= 90,))
    return _SHARED[key]


def fits(config: dict, cc: int, limit: int, dtype: str = "bfloat16", **shape) -> tuple[bool, int]:
    """(whether the config fits `limit` bytes of shared memory per block on sm_<cc>, the bytes it needs or its
    bound); compiles only when the bound does not fit."""
    bound = shared_bytes_bound(config, shape.get("d", 576), shape.get("kv_lora", 512), dtype)
    if bound <= limit:
        return True, bound
    need = compiled_shared_bytes(config, cc, dtype, **shape)
    return need <= limit, need


def selectable_configs() -> list[dict]:
    """Every tile selection or the tuner can pick on some GPU: the default, the tuner's tiles and every entry of
    the shipped table, one per tile (num_splits does not change a compiled kernel)."""
    out = [dict(DEFAULT_CONFIG)] + [tile_config(t) for t in TUNE_TILES]
    for gpu in load_configs().values():
        for buckets in gpu.get("shapes", {}).values():
            out += [{k: v for k, v in c.items() if k in DEFAULT_CONFIG} for c in buckets.values()]
    unique = []
    for c in out:
        c = {k: check_config(c)[k] for k in DEFAULT_CONFIG}
        if c not in unique:
            unique.append(c)
    return unique


# ---------------------------------------------------------------------------------------------------- selection

def select(n: int, heads: int, length: int, device, table: dict | None = None, *, d: int = 576, kv_lora: int = 512,
           dtype: torch.dtype = torch.bfloat16) -> tuple[dict, str]:
    """(config, config_source): {"num_splits", "block_rows", "block_keys", "num_warps", "num_stages"} for n query
    tokens of `heads` heads over `length` keys. The entry of this GPU's name and "heads,n,D,kv_lora" in `table`
    (default: the shipped table with the user's over it, config_tables.merged) at the largest tuned length bucket
    <= length (a split count tuned at 4096 keys still fills the SMs at 8000; below every bucket the default's
    key-count rule is safer): source "tuned". default_config, source "default", when the GPU, shape or bucket is
    missing or q is fp32 (the table holds 2-byte tunings); source "default (tuned entry needs N B ...)" when the
    entry does not fit the GPU's shared memory per block. Host-side, no device work, so it may run while a CUDA
    graph is captured. A malformed table entry raises a ValueError naming it. Selections from the merged tables are
    recorded for config_tables.defaults_notice."""
    merged = table is None
    if merged:
        table = config_tables.merged(CONFIG_PATH)
    if not isinstance(table, dict):
        raise ValueError(f"MLA decode config table must be a dict, got {type(table).__name__}")
    name = device_name(device)
    key = shape_key(heads, n, d, kv_lora)
    gpu = table.get(name, {})
    if not isinstance(gpu, dict) or not isinstance(gpu.get("shapes", {}), dict):
        raise ValueError(f"MLA decode config table: entry {name!r} must be {{\"shapes\": {{...}}, ...}}, "
                         f"got {str(gpu)[:200]}")
    cfg, source = _lookup(gpu.get("shapes", {}).get(key), length, dtype, f"MLA decode config table: {name!r} shape "
                          f"{key!r}"), "default"
    limits = config_tables.device_limits(device)
    if cfg is not None and limits is not None:
        ok, need = fits(cfg, *limits, str(dtype).split(".")[1], heads=heads, n=n, d=d, kv_lora=kv_lora)
        if not ok:
            cfg, source = None, config_tables.fit_source(need, limits[1])
    if cfg is None:
        cfg = default_config(n, heads, length, device, dtype, d, kv_lora)
    elif source == "default":
        source = "tuned"
    if merged:
        config_tables.record("mla_decode", device, f"n={n}", source, bool(gpu))
    return cfg, source


def _lookup(buckets, length: int, dtype: torch.dtype, where: str) -> dict | None:
    """The table's config at the largest length bucket <= length; None without one (or for fp32)."""
    if buckets is None or dtype == torch.float32:
        return None
    try:
        if not isinstance(buckets, dict):
            raise ValueError(f"must map length buckets to configs, got {type(buckets).__name__}")
        lengths = {int(b): b for b in buckets}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad length buckets: {e}") from None
    fit = [b for b in sorted(lengths) if b <= length]
    if not fit:
        return None
    entry = buckets[lengths[fit[-1]]]
    try:
        if not isinstance(entry, dict):
            raise ValueError(f"config must be a dict, got {type(entry).__name__}")
        cfg = check_config({k: v for k, v in entry.items() if k not in TABLE_EXTRAS})
        if cfg["num_splits"] is None:
            raise ValueError("num_splits missing")
    except ValueError as e:
        raise ValueError(f"{where} bucket {fit[-1]}: {e}") from None
    return cfg


def select_config(n: int, heads: int, length: int, device, table: dict | None = None, *, d: int = 576,
                  kv_lora: int = 512, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config of select() (see there)."""
    return select(n, heads, length, device, table, d=d, kv_lora=kv_lora, dtype=dtype)[0]


@functools.lru_cache(maxsize=4096)
def _selected(n, heads, length, d, kv_lora, dtype, device, state) -> dict:
    """select_config from the tables, cached per config_tables.state(): eager calls pay one dict lookup."""
    return select_config(n, heads, length, device, d=d, kv_lora=kv_lora, dtype=dtype)


# ---------------------------------------------------------------------------------------------------- kernels

@triton.jit
def _split_kernel(q, cache, part_o, part_lse, out, length, split_keys, stride_qh, stride_qn, stride_c, stride_oh,
                  stride_on, scale_log2, ROWS: tl.constexpr, NQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
                  SINGLE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # q and the verify tokens' cache rows come from the kernels just before
        gdc_wait()
        gdc_launch_dependents()
    rb = tl.program_id(0)
    sp = tl.program_id(1)
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)  # query row = head * NQ + token; rows past ROWS are zero padding
    row_ok = r < ROWS
    q_row = (r // NQ).to(tl.int64) * stride_qh + (r % NQ) * stride_qn
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    q_lat = tl.load(q + q_row[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    if BLOCK_DR > 0:  # the rope columns DV..D-1 only enter the scores
        dr = DV + tl.arange(0, BLOCK_DR)
        dr_ok = dr < D
        q_rope = tl.load(q + q_row[:, None] + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    lo = sp * split_keys
    hi = tl.minimum(lo + split_keys, length)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of the scores, log2 units
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)
        key_ok = key < hi
        rows_at = cache + key.to(tl.int64)[:, None] * stride_c
        k_lat = tl.load(rows_at + dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(k_lat))
        if BLOCK_DR > 0:
            k_rope = tl.load(rows_at + dr[None, :], mask=key_ok[:, None] & dr_ok[None, :], other=0.0)
            s += tl.dot(q_rope, tl.trans(k_rope))
        # every tile holds at least one valid key (start < hi), so each row's max is finite
        s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
        m = m_new
    has = l > 0  # false only for an empty split, which the host never launches
    o = acc / tl.where(has, l, 1.0)[:, None]
    if SINGLE:
        o_row = (r // NQ).to(tl.int64) * stride_oh + (r % NQ) * stride_on
        tl.store(out + o_row[:, None] + dv[None, :], o.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
    else:
        part = sp * ROWS + r
        tl.store(part_o + part[:, None].to(tl.int64) * DV + dv[None, :], o, mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(part_lse + part, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf")), mask=row_ok)


@triton.jit
def _combine_kernel(part_o, part_lse, out, num_splits, stride_oh, stride_on, ROWS: tl.constexpr, NQ: tl.constexpr,
                    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < DV
    s = tl.arange(0, BLOCK_S)
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        top = tl.maximum(top, tl.load(part_lse + (s0 + s) * ROWS + r, mask=s0 + s < num_splits,
                                      other=float("-inf")))
    top_all = tl.max(top, axis=0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ok = s0 + s < num_splits
        w = tl.exp2(tl.load(part_lse + (s0 + s) * ROWS + r, mask=ok, other=float("-inf")) - top_all)
        part = ((s0 + s) * ROWS + r).to(tl.int64)
        o = tl.load(part_o + part[:, None] * DV + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        total += w
    o_row = (r // NQ).to(tl.int64) * stride_oh + (r % NQ) * stride_on
    tl.store(out + o_row + c, (acc / tl.sum(total, axis=0)).to(out.dtype.element_ty), mask=c_ok)


def mla_decode(q, cache, length, kv_lora=512, scale=None, num_splits=None, *, out=None, config=None, pdl=None):
    """Triton flash-decoding MLA attention; same result as mla_decode_reference (scale defaults to D ** -0.5, the MLA
    forward passes (qk_nope + qk_rope) ** -0.5). q [heads, n, D] and cache [rows >= length, D] need unit stride
    along D (other strides are free). num_splits: context splits (it is lowered so that no split is empty).
    out: optional [heads, n, kv_lora] tensor of q's dtype to write. config: overrides of DEFAULT_CONFIG
    (block_rows, block_keys: powers of two >= 16; num_warps, num_stages; num_splits, which the argument
    overrides). Neither num_splits nor config given: select_config (the tuned table for this GPU, else the
    defaults); num_splits alone: default_config's tile; config without num_splits: default_num_splits for its
    block_rows. pdl (None: kernels.pdl.enabled): both launches with programmatic dependent launch
    (kernels/pdl.py); each waits before reading anything."""
    length, scale = _check(q, cache, length, kv_lora, scale)
    heads, n, d = q.shape
    if q.stride(2) != 1 or cache.stride(1) != 1:
        raise ValueError(f"q and cache need unit stride along D, got strides {q.stride()} and {cache.stride()}")
    if config is None and num_splits is None:
        cfg = _selected(n, heads, length, d, kv_lora, q.dtype, q.device, config_tables.state())
    elif config is None:  # a split count alone: the default tile of q's dtype (fp32 needs smaller tiles)
        cfg = default_config(n, heads, length, q.device, q.dtype, d, kv_lora)
    else:
        cfg = check_config(config)
    rows = heads * n
    if num_splits is None:
        num_splits = cfg["num_splits"]
    if num_splits is None:
        num_splits = default_num_splits(length, rows, cfg["block_rows"], _sm_count(q.device))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if out is None:
        out = torch.empty(heads, n, kv_lora, dtype=q.dtype, device=q.device)
    elif (not isinstance(out, torch.Tensor) or out.shape != (heads, n, kv_lora) or out.dtype != q.dtype
          or out.device != q.device or out.stride(2) != 1):
        raise ValueError(f"out must be a [{heads}, {n}, {kv_lora}] {q.dtype} tensor on {q.device} with unit stride "
                         f"along its last dim, got {getattr(out, 'shape', type(out))}")
    bn = cfg["block_keys"]
    split_keys = triton.cdiv(triton.cdiv(length, num_splits), bn) * bn  # whole key tiles per split
    splits = triton.cdiv(length, split_keys)  # no empty split
    block_dv = max(16, triton.next_power_of_2(kv_lora))
    block_dr = max(16, triton.next_power_of_2(d - kv_lora)) if d > kv_lora else 0
    single = splits == 1
    if single:
        part_o = part_lse = out  # unused pointers
    else:
        part_o = torch.empty(splits, rows, kv_lora, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, rows, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(rows, cfg["block_rows"]), splits)
    on = _pdl.resolve(pdl, q.device)
    _split_kernel[grid](q, cache, part_o, part_lse, out, length, split_keys, q.stride(0), q.stride(1),
                        cache.stride(0), out.stride(0), out.stride(1), scale * LOG2E, ROWS=rows, NQ=n, D=d,
                        DV=kv_lora, BLOCK_M=cfg["block_rows"], BLOCK_N=bn, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
                        SINGLE=single, PDL=on, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                        **_pdl.launch_kwargs(on))
    if not single:
        block_s = min(COMBINE_SPLITS, triton.next_power_of_2(splits))
        block_c = min(COMBINE_COLS, triton.next_power_of_2(kv_lora), max(16, COMBINE_TILE // block_s))
        _combine_kernel[(rows, triton.cdiv(kv_lora, block_c))](
            part_o, part_lse, out, splits, out.stride(0), out.stride(1), ROWS=rows, NQ=n, DV=kv_lora,
            BLOCK_S=block_s, BLOCK_C=block_c, PDL=on, num_warps=4,
            **_pdl.launch_kwargs(on))
    return out
