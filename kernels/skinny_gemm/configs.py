"""Launch configs of the skinny GEMM: the untuned defaults, the per-GPU tables (skinny_gemm_configs.json with the
user's from `verifybench tune` over it), the tuner's tiles, the shared-memory fit of a tile per GPU, and selection.
"""
from __future__ import annotations

from pathlib import Path

import torch

from verifybench.kernels.common import interpret
from verifybench.kernels.common import compiler, config_tables, devices
from verifybench.kernels.skinny_gemm import kernels
from verifybench.kernels.common.devices import DEFAULT_SMS, device_name, sm_count  # noqa: F401 (sm_count: callers')
from verifybench.kernels.skinny_gemm.kernels import DOT_BLOCK_M, auto_split_k

CONFIG_PATH = Path(__file__).with_name("skinny_gemm_configs.json")
FMA_MAX_TOKENS = 8  # the fma kernel unrolls one accumulator per token, 8 at most
KINDS = ("dot", "fma", "torch")  # "torch": F.linear (cuBLAS), chosen where the tune measured it faster
REDUCES = ("serial", "kernel")
# Used when the GPU or shape is not in the table (SPLIT_K None: from the shape), the kinds and tiles the H200 table
# picks most: for one or two tokens the fma kernel wherever a row holds more than one of its 1024-element steps
# (15 of the 16 such shape-and-n entries there); else the dot kernel, 32 x 256 tiles over rows of LONG_K elements
# or more (the most frequent winner there) and 64 x 128 over shorter ones. Each fits 101,376 B of shared memory on
# every supported architecture (tests compile them).
DEFAULT_DOT = {"kind": "dot", "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": None, "reduce": "serial", "num_warps": 4,
               "num_stages": 4}
DEFAULT_DOT_LONG_K = {**DEFAULT_DOT, "BLOCK_N": 32, "BLOCK_K": 256}
DEFAULT_FMA = {"kind": "fma", "BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": None, "reduce": "serial", "num_warps": 4,
               "num_stages": 1}
DEFAULT_FMA_MAX_TOKENS = 2
LONG_K = 4096
# triton.jit picks the interpreter at decoration time: compiling for a target needs a process without it
_INTERPRET = interpret.active()


# ---------------------------------------------------------------------------------------------------- configs

def _pow2(v) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


def default_config(n: int, N: int, K: int, sms: int = DEFAULT_SMS, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The untuned choice for n tokens and w [N, K]: DEFAULT_FMA, DEFAULT_DOT_LONG_K or DEFAULT_DOT (see there);
    fp32 the dot kernel with 64-element steps; SPLIT_K from auto_split_k."""
    if dtype == torch.float32:
        cfg = {**DEFAULT_DOT, "BLOCK_K": 64}
    elif n <= DEFAULT_FMA_MAX_TOKENS and K > DEFAULT_FMA["BLOCK_K"]:
        cfg = dict(DEFAULT_FMA)
    else:
        cfg = dict(DEFAULT_DOT_LONG_K if K >= LONG_K else DEFAULT_DOT)
    cfg["SPLIT_K"] = auto_split_k(N, K, cfg["BLOCK_N"], cfg["BLOCK_K"], sms)
    return cfg


def default_configs() -> list[dict]:
    """One config of each tile default_config can return (the 2-byte ones, then fp32's)."""
    return [default_config(1, 4096, LONG_K), default_config(4, 4096, LONG_K), default_config(4, 4096, LONG_K // 4),
            default_config(1, 4096, LONG_K, dtype=torch.float32)]


def check_config(cfg: dict, n: int) -> dict:
    """A complete config (missing keys from DEFAULT_DOT) or a ValueError naming the bad key."""
    if not isinstance(cfg, dict):
        raise ValueError(f"config must be a dict, got {type(cfg).__name__}")
    unknown = set(cfg) - set(DEFAULT_DOT) - set(TABLE_EXTRAS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_DOT)}")
    c = {**DEFAULT_DOT, **cfg}
    if c["kind"] not in KINDS:
        raise ValueError(f"config kind must be one of {KINDS}, got {c['kind']!r}")
    if c["kind"] == "torch":
        return c
    if c["reduce"] not in REDUCES:
        raise ValueError(f"config reduce must be one of {REDUCES}, got {c['reduce']!r}")
    low = 16 if c["kind"] == "dot" else 1  # tl.dot needs >= 16
    if not (_pow2(c["BLOCK_N"]) and low <= c["BLOCK_N"] <= 256):
        raise ValueError(f"BLOCK_N must be a power of two in {low}..256 for kind {c['kind']!r}, got {c['BLOCK_N']}")
    if not (_pow2(c["BLOCK_K"]) and 16 <= c["BLOCK_K"] <= 8192):
        raise ValueError(f"BLOCK_K must be a power of two in 16..8192, got {c['BLOCK_K']}")
    if c["SPLIT_K"] is not None and not (isinstance(c["SPLIT_K"], int) and c["SPLIT_K"] >= 1):
        raise ValueError(f"SPLIT_K must be an int >= 1 (or None: from the shape), got {c['SPLIT_K']!r}")
    if c["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {c['num_warps']!r}")
    if not (isinstance(c["num_stages"], int) and 1 <= c["num_stages"] <= 8):
        raise ValueError(f"num_stages must be an int in 1..8, got {c['num_stages']!r}")
    if c["kind"] == "fma" and n > FMA_MAX_TOKENS:
        raise ValueError(f"kind 'fma' handles n <= {FMA_MAX_TOKENS} tokens, got n={n}; use kind 'dot'")
    return c


# Tiles the tuner sweeps. Dot: (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_N >= 64 with 4 warps runs wgmma on
# sm_90, below it mma.sync; shared memory = stages x (BLOCK_N + 16) x BLOCK_K x 2 B (a stage more with PDL on sm_90,
# the peeled first step), so these span 1-3 CTAs per SM and 64-144 KB of w in flight per SM; the 6-8 stage tiles go
# deeper for a latency-bound CTA; BLOCK_N = 16 gives the 2112-row projection one column block per SM without
# split-K. A tile over a GPU's shared memory is skipped there (fits).
TUNE_DOT_TILES = [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (32, 256, 4, 4), (64, 128, 8, 5),
                  (64, 128, 4, 6), (64, 128, 4, 8), (32, 256, 4, 8), (16, 256, 4, 4), (16, 512, 4, 4),
                  (16, 256, 2, 6)]
# Fma: (BLOCK_N, BLOCK_K, num_warps) per token bucket: BLOCK_K = 8 x 32 x warps x U, so each thread streams U
# 16-byte slices of BLOCK_N rows per step; registers grow with the tokens (x and accumulators are per token).
TUNE_FMA_TILES = {1: [(4, 1024, 4), (8, 1024, 4)], 2: [(4, 1024, 4), (8, 1024, 4)], 4: [(4, 1024, 4), (2, 2048, 8)],
                  8: [(2, 1024, 4), (2, 2048, 8)]}
TABLE_EXTRAS = ("us", "cublas_us", "default_us")  # timings the tuner stores beside a config
_SELECTED: dict[tuple, dict] = {}  # select_config results from the tables (host cost of eager calls)


def dot_config(tile, split=None, reduce="serial") -> dict:
    bn, bk, nw, ns = tile
    return {"kind": "dot", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "reduce": reduce, "num_warps": nw,
            "num_stages": ns}


def fma_config(tile, split=None) -> dict:
    bn, bk, nw = tile
    return {"kind": "fma", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "reduce": "serial", "num_warps": nw,
            "num_stages": 1}


def load_configs(path: Path | str = CONFIG_PATH) -> dict:
    """The tuning table {gpu name: {"shapes": {"N,K": {n bucket: config}}, "tuned_on": {...}}} at `path`; read
    once. Selection reads config_tables.merged(CONFIG_PATH): the user's table over this one."""
    return config_tables.load(path)


def save_configs(table: dict, path: Path | str) -> Path:
    _SELECTED.clear()
    return config_tables.save(table, path)


def shape_key(N: int, K: int) -> str:
    return f"{N},{K}"


# ---------------------------------------------------------------------------------------------------- shared memory

_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_SHARED: dict[tuple, int] = {}


def _itemsize(dtype: str) -> int:
    return torch.finfo(getattr(torch, dtype)).bits // 8


def shared_bytes_bound(config: dict, dtype: str = "bfloat16") -> int:
    """An upper bound of compiled_shared_bytes on every architecture, without compiling (tests hold it to that):
    a stage more than num_stages, and the x tile twice (the fused activation loads gate and up)."""
    c = check_config(config, 1)
    if c["kind"] == "torch":
        return 0
    if c["kind"] == "fma":  # no tiles in shared memory: the per-token reductions' scratch only
        return 8 * 4 * c["BLOCK_N"] * max(32, c["BLOCK_K"] // 8)
    return (c["num_stages"] + 1) * (c["BLOCK_N"] + 2 * DOT_BLOCK_M) * c["BLOCK_K"] * _itemsize(dtype)


def compiled_shared_bytes(config: dict, cc: int, dtype: str = "bfloat16") -> int:
    """Shared memory per block (bytes) the config needs on sm_<cc>, compiled without a GPU: the larger of the fused
    activation on and off, with PDL on sm_90+ (as launched by default; a PDL launch holds the peeled first tile
    too, so without PDL needs no more). fma at 2 tokens: its per-token reductions reuse one scratch. Cached per
    tile; under the interpreter one subprocess without it compiles."""
    c = check_config(config, 1)
    if c["kind"] == "torch":
        return 0
    tile = {k: c[k] for k in ("kind", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    key = (*tile.values(), int(cc), dtype)
    if key not in _SHARED:
        if _INTERPRET:
            _SHARED[key] = compiler.uninterpreted(__name__, "compiled_shared_bytes", tile, int(cc), dtype)
            return _SHARED[key]
        ty = _TRITON_TYPES[dtype]
        types = {"x_ptr": f"*{ty}", "w_ptr": f"*{ty}", "y_ptr": f"*{ty}", "add_ptr": f"*{ty}", "p_ptr": "*fp32",
                 "cnt_ptr": "*i32", "M": "i32", "n_split": "i32", **{k: "16:i32" for k in (
                     "N", "K", "stride_xm", "stride_ym", "stride_am", "k_per_split")}}
        dot = c["kind"] == "dot"
        consts = dict(BLOCK_M=DOT_BLOCK_M if dot else 2, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                      SPLIT=True, SERIAL=True, EVEN_K=True, ADD=True,
                      **({"IEEE": dtype == "float32"} if dot else {"VEC": 16 // _itemsize(dtype)}))
        opts = {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}
        _SHARED[key] = max(compiler.compiled_shared(kernels._dot_kernel if dot else kernels._fma_kernel, types,
                                                         {**consts, "ACT": act, "PDL": cc >= 90}, opts, int(cc))
                           for act in (False, True))
    return _SHARED[key]


def fits(config: dict, cc: int, limit: int, dtype: str = "bfloat16") -> tuple[bool, int]:
    """(whether the config fits `limit` bytes of shared memory per block on sm_<cc>, the bytes it needs or its
    bound); compiles only when the bound does not fit."""
    bound = shared_bytes_bound(config, dtype)
    if bound <= limit:
        return True, bound
    need = compiled_shared_bytes(config, cc, dtype)
    return need <= limit, need


def selectable_configs() -> list[dict]:
    """Every config selection or the tuner can pick on some GPU: the defaults (bf16 and fp32 tiles), the tuner's
    tiles and every entry of the shipped table; kind "torch" (cuBLAS) left out, one per tile."""
    out = default_configs()
    out += [dot_config(t) for t in TUNE_DOT_TILES]
    out += [fma_config(t) for tiles in TUNE_FMA_TILES.values() for t in tiles]
    for gpu in load_configs().values():
        for buckets in gpu.get("shapes", {}).values():
            out += [{k: v for k, v in c.items() if k not in TABLE_EXTRAS} for c in buckets.values()]
    seen, unique = set(), []
    for c in out:
        c = check_config(c, 1)
        key = tuple(c[k] for k in ("kind", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
        if c["kind"] != "torch" and key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


# ---------------------------------------------------------------------------------------------------- selection

def select(n: int, N: int, K: int, device, table: dict | None = None,
           dtype: torch.dtype = torch.bfloat16) -> tuple[dict, str]:
    """(config, config_source) for n tokens and w [N, K] on this GPU. The entry of the GPU's name and the shape in
    `table` (default: the shipped table with the user's over it, config_tables.merged), at the smallest tuned n
    bucket >= n (buckets are powers of two, so an fma config runs with the BLOCK_M it was tuned with; the largest
    bucket above every bucket): source "tuned". default_config, source "default", when the GPU or shape is
    missing, the bucket's config cannot serve n (an fma config above 8 tokens), or x is fp32 (the table holds
    2-byte tunings); source "default (tuned entry needs N B ...)" when the entry does not fit the GPU's shared
    memory per block. Selections from the merged tables are recorded for config_tables.defaults_notice."""
    merged = table is None
    table = config_tables.merged(CONFIG_PATH) if merged else table
    gpu = table.get(device_name(device), {})
    buckets = gpu.get("shapes", {}).get(shape_key(N, K))
    cfg, source = None, "default"
    if buckets and dtype != torch.float32:
        keys = sorted(int(b) for b in buckets)
        b = min([k for k in keys if k >= n], default=keys[-1])
        try:
            cfg = check_config({k: v for k, v in buckets[str(b)].items() if k in DEFAULT_DOT}, n)
        except ValueError:
            cfg = None
        limits = devices.device_limits(device)
        if cfg is not None and limits is not None:
            ok, need = fits(cfg, *limits, str(dtype).split(".")[1])
            if not ok:
                cfg, source = None, config_tables.fit_source(need, limits[1])
        if cfg is not None:
            source = "tuned"
    if cfg is None:
        cfg = default_config(n, N, K, sm_count(device), dtype)
    if merged:
        config_tables.record("skinny_gemm", device, f"n={n}", source, bool(gpu))
    return cfg, source


def select_config(n: int, N: int, K: int, device, table: dict | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config of select() (see there)."""
    return select(n, N, K, device, table, dtype)[0]


def cached_config(n: int, N: int, K: int, device, dtype: torch.dtype) -> dict:
    """select_config from the tables, cached per config_tables.state(): eager calls pay one dict lookup."""
    key = (n, N, K, device, dtype, config_tables.state())
    return _SELECTED.get(key) or _SELECTED.setdefault(key, select_config(n, N, K, device, dtype=dtype))
