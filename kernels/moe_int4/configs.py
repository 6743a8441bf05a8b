"""Launch configs of the fused W4A16 MoE: the untuned defaults per token range, the per-GPU tables
(moe_int4_configs.json, the user's from `verifybench tune` over it), the shared-memory fit per GPU, the tuner's spaces.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

from verifybench.kernels.common import compiler, config_tables, devices
from verifybench.kernels.moe_int4 import kernels
from verifybench.kernels.common.devices import device_name
from verifybench.kernels.moe_int4.reference import MoeShape
from verifybench.kernels.moe_int4.kernels import check_config, interpreting

CONFIG_PATH = Path(__file__).with_name("moe_int4_configs.json")
# Used on a GPU without a table entry: the winning family (half2 dequant, split kernels; no pdl, which needs sm_90+)
# with the H200 table's blocking in three token ranges (DEFAULT_BLOCKING, keyed by each range's first n): one token
# takes that entry's narrow tiles (2 gate_up rows, one down row per iteration); 2..6 the n = 2 entry's (gate_up 4 rows
# with prefetch, down 8 rows x 4, which wins n = 2..5 and is within 1% at 6); 7 and more the n = 8 entry's. Every
# one fits every supported GPU's shared memory (tests compile them).
DEFAULT_CONFIG = {"dequant": "half2", "pdl": False,
                  "gate_up": {"BLOCK_N": 4, "num_warps": 1, "num_stages": 1, "SPLIT_K": 1, "PREFETCH": 1,
                              "BLOCK_W": 128},
                  "down": {"BLOCK_N": 8, "ROW_ITERS": 4, "num_stages": 1}}
DEFAULT_BLOCKING = {
    1: {"gate_up": {**DEFAULT_CONFIG["gate_up"], "BLOCK_N": 2}, "down": {**DEFAULT_CONFIG["down"], "ROW_ITERS": 1}},
    2: {"gate_up": DEFAULT_CONFIG["gate_up"], "down": DEFAULT_CONFIG["down"]},
    7: {"gate_up": {**DEFAULT_CONFIG["gate_up"], "BLOCK_N": 8, "PREFETCH": 0},
        "down": {**DEFAULT_CONFIG["down"], "ROW_ITERS": 8}},
}
TUNED_KEYS = ("gate_up", "down", "kernel", "pdl", "dequant")  # what a table entry sets; the rest is its record
# The shapes compiled_shared_bytes compiles at: one Kimi-K2.5 TP8 rank (H 7168, I 256, 384 experts, top-8, g32)
K25_TP8 = MoeShape(tokens=8, hidden=7168, inter=256, experts=384, topk=8, group_size=32)


# ---------------------------------------------------------------------------------------------------- configs

def default_config(device, m: int = 2) -> dict:
    """The config for m tokens on a GPU without a table entry: DEFAULT_CONFIG with the DEFAULT_BLOCKING of m's
    range; in the interpreter (no inline PTX) the same blocking with the "denormal" dequant."""
    first = max([k for k in DEFAULT_BLOCKING if k <= m], default=min(DEFAULT_BLOCKING))
    cfg = {**DEFAULT_CONFIG, **copy.deepcopy(DEFAULT_BLOCKING[first])}
    if torch.device(device).type == "cuda" and not interpreting():
        return cfg
    return {**cfg, "dequant": "denormal"}


def load_configs(path: Path | str = CONFIG_PATH) -> dict:
    """The tuning table {gpu name: {"dequant", "by_n": {n: {"gate_up", "down", "dequant", "pdl", ...}}}} at `path`;
    read once. Selection reads config_tables.merged(CONFIG_PATH): the user's table over this one."""
    return config_tables.load(path)


def save_configs(table: dict, path: Path | str = CONFIG_PATH) -> Path:
    _SELECTED.clear()
    return config_tables.save(table, path)


def _entry_config(entry: dict, tuned: dict, default: dict) -> dict:
    """A table entry at one n completed from `default`: the entry's dequant, then what the n sets."""
    return {**default, **{k: v for k, v in entry.items() if k == "dequant"},
            **{k: v for k, v in tuned.items() if k in TUNED_KEYS}}


def misfit(config: dict, device, shape: MoeShape = K25_TP8) -> tuple[int, int] | None:
    """(bytes needed, bytes allowed) when `config`'s kernels do not fit the shared memory per block of `device`;
    None when they do, and always off CUDA (the interpreter has no shared memory to fit)."""
    limits = None if interpreting() else devices.device_limits(device)
    if limits is None:
        return None
    need = compiled_shared_bytes(config, limits[0], shape)
    return None if need <= limits[1] else (need, limits[1])


def select(m: int, device, table: dict | None = None) -> tuple[dict, str]:
    """(config, config_source) for m tokens on this GPU. The entry of the GPU's name in `table` (default: the
    shipped table with the user's over it, config_tables.merged) at the largest tuned n <= m (the smallest above,
    for m below every key): source "tuned"; default_config, source "default", when the GPU is not in the table;
    source "default (tuned entry needs N B ...)" when the entry's kernels do not fit the GPU's shared memory per
    block. Selections from the merged tables are recorded for config_tables.defaults_notice."""
    merged = table is None
    table = config_tables.merged(CONFIG_PATH) if merged else table
    entry = table.get(device_name(device)) or {}
    cfg, source = default_config(device, m), "default"
    if entry.get("by_n"):
        keys = sorted(int(k) for k in entry["by_n"])
        n = max([k for k in keys if k <= m], default=keys[0])
        tuned = _entry_config(entry, entry["by_n"][str(n)], cfg)
        too_big = misfit(tuned, device)
        if too_big:
            source = config_tables.fit_source(*too_big)
        else:
            cfg, source = tuned, "tuned"
    if merged:
        config_tables.record("moe_int4", device, f"n={m}", source, bool(entry))
    return cfg, source


_SELECTED: dict[tuple, dict] = {}  # select_config from the tables (host cost of eager calls)


def select_config(m: int, device, table: dict | None = None) -> dict:
    """The config of select() (see there); from the tables, cached per config_tables.state()."""
    if table is not None:
        return select(m, device, table)[0]
    key = (m, str(device), config_tables.state())
    if key not in _SELECTED:
        _SELECTED[key] = select(m, device)[0]
    return dict(_SELECTED[key])


# ---------------------------------------------------------------------------------------------------- shared memory

def compiled_shared_bytes(config: dict, cc: int, shape: MoeShape = K25_TP8) -> int:
    """Shared memory per block, bytes, of the larger of the two kernels that `config` (completed from
    DEFAULT_CONFIG) launches at `shape` with bf16 activations, compiled for sm_<cc> without a GPU (compare with
    SMEM_LIMIT_BYTES[cc]). "pdl" compiles in for sm_90+ only (check_config refuses it below). A few seconds per
    kernel the first time; repeats come from a cache per kernel and from Triton's. Under the interpreter (whose
    kernels, and triton's own jit helpers, cannot be compiled) a subprocess without it compiles."""
    if not isinstance(kernels._gate_up_split_kernel, JITFunction):
        return compiler.uninterpreted(__name__, "_shared_bytes_json", config, int(cc), dataclasses.asdict(shape))
    cfg = {**DEFAULT_CONFIG, **config}
    check_config(cfg, shape, torch.device("cpu"))
    pdl = bool(cfg.get("pdl")) and cc >= 90
    return max(_kernel_shared(fn.__name__, tuple(sorted(consts.items())), tuple(sorted(opts.items())), int(cc))
               for fn, _, consts, opts in kernels.launches(cfg, shape, pdl, pdl))


def _shared_bytes_json(config: dict, cc: int, shape: dict) -> int:
    return compiled_shared_bytes(config, cc, MoeShape(**shape))


# The run-time arguments as a bf16 launch passes them; "16:" marks the ints a launch specializes as multiples of 16
# at the shapes compiled (H and E), the others (token and pair counts) are not specialized.
_ARG_TYPES = {"x_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i16", "ids_ptr": "*i32",
              "p_ptr": "*fp32", "tw_ptr": "*fp32", "num_pairs": "i32", "M": "i32", "num_experts": "16:i32",
              "hidden": "16:i32", "stride_xm": "16:i32", "stride_om": "16:i32"}


@functools.lru_cache(maxsize=None)
def _kernel_shared(name: str, consts: tuple, opts: tuple, cc: int) -> int:
    return compiler.compiled_shared(getattr(kernels, name), _ARG_TYPES, dict(consts), dict(opts), cc)


def selectable_configs(table: dict | None = None) -> list[dict]:
    """Every config a GPU can be given, deduplicated: each entry of the shipped table (as select_config completes
    it), the default, and every config the tuner's spaces can end on (any gate_up with any down, pdl or not)."""
    table = load_configs() if table is None else table
    out = [{**DEFAULT_CONFIG, **blocking} for blocking in DEFAULT_BLOCKING.values()]
    out += [_entry_config(entry, tuned, DEFAULT_CONFIG) for entry in table.values()
            for tuned in entry.get("by_n", {}).values()]
    out += [{**base, "gate_up": gu, "down": dn, "pdl": pdl} for base, gate_up, down in TUNE_SPACES.values()
            for gu in gate_up for dn in down for pdl in (False, True)]
    unique = {json.dumps(cfg, sort_keys=True): cfg for cfg in out}
    return list(unique.values())


# ---------------------------------------------------------------------------------------------------- tuning space

# The tuner's spaces (harness/tune/moe_int4.py): a starting config and the gate_up and down candidates its
# coordinate descent sweeps. "split-denormal" is the one the interpreter can run (the tuner's CPU dry run).
# gate_up (rows, SPLIT_K, PREFETCH), one warp over 128 words of a row. All compile without spills for sm_90 with
# triton 3.6 at K2.5 shapes (2.8-4.2 SASS instr/weight; K14: 7.3, half its chunk masked); SPLIT_K 7 is one 128-word
# chunk per program, 2/4/8/14 leave part of the last chunk masked; 64-word chunks (a warp over 2 rows) cost ~2x the
# instructions, BLOCK_N 16 at K1 and BLOCK_N 8 at K2 with prefetch spill.
DENORMAL_GATE_UP = [{"BLOCK_N": bn, "num_warps": 1, "num_stages": 1, "SPLIT_K": sk, "PREFETCH": pf, "BLOCK_W": 128}
                    for bn, sk, pf in ((4, 1, 1), (8, 1, 1), (8, 1, 0), (2, 1, 1), (8, 2, 0), (8, 4, 0), (2, 7, 0),
                                       (4, 7, 0), (8, 7, 0), (16, 7, 0), (8, 8, 0), (8, 14, 0))]
# half2: ~25% fewer SASS instructions per weight and far fewer registers (BN 8 without prefetch: 94 instead of 247),
# so larger and unprefetched blockings fit (sm_90, triton 3.6: no spills in this list; BN 8 and BN 16 with prefetch
# spill)
HALF2_GATE_UP = [{"BLOCK_N": bn, "num_warps": 1, "num_stages": 1, "SPLIT_K": sk, "PREFETCH": pf, "BLOCK_W": 128}
                 for bn, sk, pf in ((8, 1, 0), (4, 1, 1), (4, 1, 0), (16, 1, 0), (32, 1, 0), (2, 1, 1), (8, 2, 0),
                                    (4, 7, 0), (8, 7, 0), (16, 7, 0), (8, 14, 0))]
# down (rows, row blocks per program), 2 warps (the columns are topk x I/8 words); 32 rows or 4+ warps go through
# shared memory. Every program rebuilds the token's activations (2 x SPLIT_K x topk x I fp32 from L2): more rows per
# program (ROW_ITERS > 1, the next block prefetched while this one is computed) amortize that when SPLIT_K > 1.
DOWN = [{"BLOCK_N": bn, "ROW_ITERS": it, "num_stages": 1} for bn, it in
        ((16, 1), (8, 1), (4, 1), (8, 2), (16, 2), (8, 4), (8, 8))]
TUNE_SPACES = {  # name: (starting config, gate_up candidates, down candidates)
    "split-denormal": ({"dequant": "denormal", "pdl": False, "gate_up": DENORMAL_GATE_UP[1], "down": DOWN[0]},
                       DENORMAL_GATE_UP, DOWN),
    "split-half2": ({"dequant": "half2", "pdl": False, "gate_up": HALF2_GATE_UP[0], "down": DOWN[0]},
                    HALF2_GATE_UP, DOWN),
}
