"""Launch configs of MLA decode attention: the untuned defaults, the per-GPU tables (mla_decode_configs.json with the
user's from `verifybench tune` over it), the shared-memory fit of a tile per GPU, and selection per call shape.

select_config reads the table keyed by GPU name, "heads,n,D,kv_lora" and a context bucket (the largest tuned length
<= length); the untuned default (DEFAULT_CONFIG, default_num_splits) elsewhere, and where the entry exceeds the GPU's
shared memory.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import triton

from verifybench.kernels.common import interpret
from verifybench.kernels.common import compiler, config_tables, devices
from verifybench.kernels.mla_decode import kernels
from verifybench.kernels.common.devices import device_name
from verifybench.kernels.mla_decode.kernels import MAX_SPLITS

# triton.jit picks the interpreter at decoration time: compiling for a target needs a process without it
_INTERPRET = interpret.active()

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
CONFIG_PATH = Path(__file__).with_name("mla_decode_configs.json")
CONFIG_KEYS = ("num_splits", *DEFAULT_CONFIG)  # what select_config returns and `config` may hold
TABLE_EXTRAS = ("us", "default_us", "torch_us")  # timings the tuner stores beside a config


def default_num_splits(length: int, rows: int, block_rows: int, sms: int = devices.DEFAULT_SMS) -> int:
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
    cached_config.cache_clear()
    return config_tables.save(table, path)


def shape_key(heads: int, n: int, d: int = 576, kv_lora: int = 512) -> str:
    return f"{heads},{n},{d},{kv_lora}"


def default_config(n: int, heads: int, length: int, device="cpu", dtype: torch.dtype = torch.bfloat16, d: int = 576,
                   kv_lora: int = 512) -> dict:
    """The untuned choice: DEFAULT_CONFIG tiles (fp32: the first of FP32_CONFIGS that fits the GPU's shared memory;
    a ValueError naming the bytes when none does), default_num_splits."""
    tile = DEFAULT_CONFIG
    if dtype == torch.float32:
        limits = devices.device_limits(device)
        sized = [(c, fits(c, *limits, "float32", heads=heads, n=n, d=d, kv_lora=kv_lora)) for c in FP32_CONFIGS] \
            if limits is not None else [(FP32_CONFIGS[0], (True, 0))]
        fitting = [c for c, (ok, _) in sized if ok]
        if not fitting:
            raise ValueError(f"MLA decode in fp32 at D={d}, kv_lora={kv_lora} needs {sized[-1][1][1]} B of shared "
                             f"memory per block at least; this GPU allows {limits[1]} B: use bf16 or fp16")
        tile = fitting[0]
    return {"num_splits": default_num_splits(length, heads * n, tile["block_rows"], devices.sm_count(device)),
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
            _SHARED[key] = compiler.uninterpreted(__name__, "compiled_shared_bytes", tile, int(cc), dtype,
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
        split_kernel = kernels._split_kernel
        _SHARED[key] = max(compiler.compiled_shared(split_kernel, types, {**consts, "SINGLE": one, "PDL": on},
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
    limits = devices.device_limits(device)
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
def cached_config(n, heads, length, d, kv_lora, dtype, device, state) -> dict:
    """select_config from the tables, cached per config_tables.state(): eager calls pay one dict lookup."""
    return select_config(n, heads, length, device, d=d, kv_lora=kv_lora, dtype=dtype)
