"""MLA decode attention of the verify forward (attn_core, DESIGN.md 4.5) at one rank's shape (Kimi-K2.5 TP8: 8 heads,
n = 1..8 query tokens, D = 576 = 512 latent + 64 rope, over context + n keys, bf16): the Triton flash-decoding kernel
(kernels/mla_decode.py) with the tuned table's config and with the untuned default, beside the plain-torch path the
forward used before (q @ keys.T in bf16 -> float -> * scale -> softmax -> bf16 -> @ keys[:, :512]). Cold: every
call reads another cache, >= 4 caches totalling >= 4x L2, inside the graph (DESIGN.md 3), as a forward reads each
layer's cache once.

Run: pytest --benchmark-only microbench/bench_mla_decode.py
Tune: python3 -m microbench.bench_mla_decode tune [--out PATH] [--time-limit S]   (CPU check: tune --smoke)
"""
from __future__ import annotations

import copy
import importlib
import math
import os
import time
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
import triton

from harness import ceiling, presets
from harness.runner import CaseSpec, rel_error
from harness.timing import cuda_available, l2_bytes, measure
from kernels import mla_decode as md
from kernels.verify_forward import TORCH_OPS
from microbench.tune_cli import report_tune, tune_main

COMPONENT = "mla_decode"
GPU_NS = (1, 4, 8)
GPU_CONTEXTS = (4096, 32768)
CPU_NS = (1, 4, 8)
CPU_CONTEXTS = (256,)
TUNE_NS = tuple(range(1, 9))
TUNE_CONTEXTS = (4096, 32768)  # table buckets: a length uses the largest bucket <= it
MAX_N = 8  # caches hold context + MAX_N rows, so every n of one context shares them
MIN_COPIES = 4
MAX_COPIES = 64
TOL = 1e-2  # bf16 output (DESIGN.md 3)
IMPLS = ("triton", "triton-default", "torch")  # triton: select_config (tuned table); torch: verify_forward's path
# triton.jit picks the interpreter at decoration time: CPU runs of the kernel need TRITON_INTERPRET=1 before import
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Attn:
    heads: int
    d: int  # kv_lora + rope dims
    kv_lora: int
    scale: float  # (qk_nope + qk_rope) ** -0.5, what the MLA forward passes


def attn_shape(preset: str = "kimi-k2.5", tp: int = 8) -> Attn:
    p = presets.get(preset, tp)
    return Attn(p.heads, p.kv_lora + p.qk_rope, p.kv_lora, (p.qk_nope + p.qk_rope) ** -0.5)


def bytes_moved(a: Attn, n: int, length: int, itemsize: int = 2) -> int:
    """What must move: the cache rows once (every head shares them), q and o."""
    return (length * a.d + a.heads * n * (a.d + a.kv_lora)) * itemsize


def splits_run(cfg: dict, length: int) -> int:
    """The split count the kernel launches for cfg at `length` (whole key tiles per split, no empty split)."""
    per = triton.cdiv(triton.cdiv(length, cfg["num_splits"]), cfg["block_keys"]) * cfg["block_keys"]
    return triton.cdiv(length, per)


def programs(cfg: dict, a: Attn, n: int, length: int) -> int:
    """Stage-1 programs: row blocks x splits."""
    return triton.cdiv(a.heads * n, cfg["block_rows"]) * splits_run(cfg, length)


# ---------------------------------------------------------------------------------------------------- inputs

def _copies(rows: int, d: int, itemsize: int, device: str) -> int:
    """Caches per rotation: >= MIN_COPIES and >= 4x L2 in all (DESIGN.md 3), at most MAX_COPIES."""
    if device != "cuda":
        return MIN_COPIES
    return min(MAX_COPIES, max(MIN_COPIES, math.ceil(4 * l2_bytes() / (rows * d * itemsize))))


@lru_cache(maxsize=len(TUNE_CONTEXTS))  # the tuner holds every context's rotation (~0.4 GB on an H200)
def _caches(rows: int, d: int, device: str, dtype: torch.dtype) -> tuple:
    """The rotation's caches (one per layer a forward would read), random."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    count = _copies(rows, d, dtype.itemsize, device)
    return tuple(torch.randn(rows, d, device=device, generator=gen).to(dtype) for _ in range(count))


def _dtype(impl: str, device: str) -> torch.dtype:
    if device == "cuda":
        return torch.bfloat16
    return torch.float16 if impl != "torch" else torch.float32  # bf16 arithmetic is wrong in the interpreter


def _impl_fn(impl: str, a: Attn, length: int, cfg: dict | None):
    if impl == "torch":
        return lambda q, c: TORCH_OPS.mla(q, c, length, a.kv_lora, a.scale)
    return lambda q, c: md.mla_decode(q, c, length, a.kv_lora, a.scale, config=cfg)


def _check(fn, a: Attn, n: int, length: int, cache: torch.Tensor) -> tuple[bool, str]:
    """Fresh random q against the fp32 reference."""
    q = torch.randn(a.heads, n, a.d, device=cache.device).to(cache.dtype)
    ref = md.mla_decode_reference(q.float(), cache.float(), length, a.kv_lora, a.scale)
    out = fn(q, cache)
    err = rel_error(out.float(), ref)
    ok = tuple(out.shape) == tuple(ref.shape) and out.dtype == q.dtype and err <= TOL
    return ok, f"rel_err={err:.2e} vs fp32 reference (tol {TOL:g}), {out.dtype} out"


def _config(impl: str, a: Attn, n: int, length: int, device: str, dtype: torch.dtype) -> dict | None:
    if impl == "triton":
        return md.select_config(n, a.heads, length, device, d=a.d, kv_lora=a.kv_lora, dtype=dtype)
    if impl == "triton-default":
        return md.default_config(n, a.heads, length, device)
    return None


# ---------------------------------------------------------------------------------------------------- cases

def _case(a: Attn, n: int, context: int, impl: str, device: str, measure_kw: dict, preset: str, tp: int) -> CaseSpec:
    dtype = _dtype(impl, device)
    length = context + n  # the verify forward writes its n tokens' slots, then attends all of them
    params = {"preset": preset, "tp": tp, "heads": a.heads, "D": a.d, "kv_lora": a.kv_lora, "n": n,
              "context": context, "length": length, "impl": impl, "device": device,
              "dtype": str(dtype).split(".")[1]}
    name = f"mla/{preset}-tp{tp}/ctx{context}/{impl}/n{n}"

    def setup():
        caches = _caches(context + MAX_N, a.d, device, dtype)
        cfg = _config(impl, a, n, length, device, dtype)
        fn = _impl_fn(impl, a, length, cfg)
        qs = [torch.randn(a.heads, n, a.d, device=device).to(dtype) for _ in caches]  # one q per layer
        fns = [lambda q=q, c=c: fn(q, c) for q, c in zip(qs, caches)]

        def derive(m) -> dict:
            moved = bytes_moved(a, n, length, dtype.itemsize)
            cp = ceiling.copy_gbps(device)
            d = {"bytes_moved": moved, "cache_bytes": length * a.d * dtype.itemsize,
                 "gbps": ceiling.gbps(moved, m.median_us), "eta": ceiling.eta(moved, m.median_us, cp),
                 "floor_us": moved / (cp * 1e3), "copy_gbps": cp, "rotation": len(fns)}
            if cfg is not None:
                d["config"] = cfg
                d["splits_run"] = splits_run(cfg, length)
                d["programs"] = programs(cfg, a, n, length)
            return d

        return fns, (lambda: _check(fn, a, n, length, caches[0])), derive

    return CaseSpec(name=name, params=params, mode="graph", setup=setup, measure_kw={"device": device, **measure_kw})


def cases(preset: str = "kimi-k2.5", tp: int = 8) -> list[CaseSpec]:
    """GPU: n in GPU_NS at GPU_CONTEXTS, the kernel (tuned and default config) and the torch path, graph mode with
    cache rotation. CPU (preset tiny): the torch path in fp32, plus the interpreted kernel when TRITON_INTERPRET=1
    was set before import."""
    a = attn_shape(preset, tp)
    if not cuda_available():
        if preset != "tiny":
            raise ValueError(f"preset {preset!r} needs a GPU (a 37 MB cache per layer at 32k); use 'tiny' on CPU")
        quick = {"max_time_s": 0.2, "warmup_s": 0.0, "min_samples": 3}
        out = [_case(a, n, c, "torch", "cpu", quick, preset, tp) for c in CPU_CONTEXTS for n in CPU_NS]
        if _INTERPRET:
            out += [_case(a, n, c, "triton", "cpu", quick, preset, tp) for c in CPU_CONTEXTS for n in (1, 4)]
        return out
    return [_case(a, n, c, impl, "cuda", {"max_time_s": 0.5}, preset, tp)
            for c in GPU_CONTEXTS for n in GPU_NS for impl in IMPLS]


# ---------------------------------------------------------------------------------------------------- tables

def _cfg_str(cfg: dict | None) -> str:
    if not cfg:
        return ""
    return (f"s{cfg['num_splits']} {cfg['block_rows']}x{cfg['block_keys']} w{cfg['num_warps']} "
            f"st{cfg['num_stages']}")


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """Per case (us, GB/s, eta) and per (context, n) the tuned kernel beside the default config and the torch path."""
    ok, per_case = ceiling.streaming_case_rows(records, "mla/")
    by_key: dict[tuple, dict] = {}
    for r in ok:
        prm, d = r["params"], r["derived"]
        row = by_key.setdefault((prm["preset"], prm["tp"], prm["context"], prm["n"]), {
            "context": prm["context"], "n": prm["n"], "MB": d["bytes_moved"] / 1e6, "floor_us": d["floor_us"]})
        us = r["summary"]["median_us"]
        if prm["impl"] == "triton":
            row.update({"triton_us": us, "triton_eta": d["eta"], "config": _cfg_str(d.get("config")),
                        "programs": d.get("programs")})
        elif prm["impl"] == "triton-default":
            row["default_us"] = us
        else:
            row.update({"torch_us": us, "torch_eta": d["eta"]})
    side = list(by_key.values())
    for row in side:
        if row.get("triton_us") and row.get("torch_us"):
            row["speedup"] = row["torch_us"] / row["triton_us"]
    return [("MLA decode per case (graph mode, caches rotated)", per_case),
            ("MLA decode: Triton (tuned / default config) vs the torch path", side)]


# ---------------------------------------------------------------------------------------------------- pytest

BENCH_CASES = cases("kimi-k2.5", 8) if cuda_available() else cases("tiny", 1)


@pytest.mark.parametrize("spec", BENCH_CASES, ids=lambda s: s.name)
def test_mla_decode(device_benchmark, spec):
    case = device_benchmark(spec)
    assert case.check_ok


# ---------------------------------------------------------------------------------------------------- tuning

SPLITS = (16, 32, 64, 128, 256)
# (block_rows, block_keys, num_warps, num_stages) tried at the best split's program count; a tile is tried only
# where block_rows <= the rows rounded up to a power of two (more would be padding). Every (n, tile) is one
# compile (ROWS and NQ are constexpr), the dominant cost of the sweep, so the list stays short: bigger key tiles
# or a deeper pipeline put more cache bytes in flight per SM; 32/64 rows read the cache once for more rows.
TILES = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3), (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2)]
SMOKE = Attn(2, 48, 32, 48 ** -0.5)
SMOKE_SPLITS = (2, 4)
SMOKE_TILES = [(16, 32, 4, 2), (16, 16, 4, 3)]


def _tile_cfg(tile, num_splits: int) -> dict:
    br, bk, nw, ns = tile
    return {"num_splits": num_splits, "block_rows": br, "block_keys": bk, "num_warps": nw, "num_stages": ns}


class _Tuner:
    """One (n, context): the rotation's caches and queries, the fp32 reference; times configs cold (graph mode,
    caches rotated). A config over the deadline, failing its check or refused by the compiler times inf."""

    def __init__(self, a: Attn, n: int, context: int, device: str, dtype: torch.dtype, measure_kw: dict,
                 deadline: float, log):
        self.a, self.n, self.length, self.device, self.kw, self.deadline, self.log = \
            a, n, context + n, device, measure_kw, deadline, log
        self.caches = _caches(context + MAX_N, a.d, device, dtype)
        gen = torch.Generator(device=device)
        gen.manual_seed(n)
        self.qs = [torch.randn(a.heads, n, a.d, device=device, generator=gen).to(dtype) for _ in self.caches]
        self.ref = md.mla_decode_reference(self.qs[0].float(), self.caches[0].float(), self.length, a.kv_lora,
                                           a.scale)
        self.timed: dict[tuple, float] = {}

    def full(self, cfg: dict) -> dict:
        """cfg with num_splits as launched (so equal launches time once and the table stores what ran)."""
        return {**cfg, "num_splits": splits_run(cfg, self.length)}

    def time(self, cfg: dict | None) -> float:
        """Median us of one call (cfg None: the torch path)."""
        key = tuple(sorted(cfg.items())) if cfg else None
        if key in self.timed:
            return self.timed[key]
        if time.perf_counter() > self.deadline:
            return math.inf
        fn = _impl_fn("torch" if cfg is None else "triton", self.a, self.length, cfg)
        try:
            err = rel_error(fn(self.qs[0], self.caches[0]).float(), self.ref)
            if not err <= TOL:
                raise RuntimeError(f"rel_err {err:.2e} > {TOL}")
            fns = [lambda q=q, c=c: fn(q, c) for q, c in zip(self.qs, self.caches)]
            us = measure(fns, mode="graph", device=self.device, **self.kw).median_us
        except Exception as e:  # a config the compiler or the GPU refuses is skipped, not fatal
            self.log(f"  n={self.n} len={self.length} {_cfg_str(cfg) or 'torch'} skipped: {type(e).__name__}: "
                     f"{str(e)[:200]}")
            us = math.inf
        self.timed[key] = us
        return us

    def best(self, cands: list[dict], best: dict, best_us: float) -> tuple[dict, float]:
        for c in cands:
            us = self.time(c)
            if us < best_us:
                best, best_us = c, us
        return best, best_us


def _split_cands(t: _Tuner, tile_cfg: dict, splits) -> list[dict]:
    """Split counts at one tile, bounded by its key tiles, as launched, without repeats."""
    tiles = triton.cdiv(t.length, tile_cfg["block_keys"])
    out = {t.full({**tile_cfg, "num_splits": s})["num_splits"] for s in splits if 1 <= s <= tiles}
    return [{**tile_cfg, "num_splits": s} for s in sorted(out)]


def tune(out: str | None = None, time_limit_s: float = 90.0, smoke: bool = False, preset: str = "kimi-k2.5",
         tp: int = 8, log=print) -> dict:
    """Tune n in TUNE_NS at TUNE_CONTEXTS and write the table JSON to `out` (a whole table: the committed one, or the
    file at `out`, with this GPU's buckets replaced). Pass 1 over every (n, context) first, so a time limit still
    leaves every shape its most valuable tuning: (1) the split count at the default tile (the default fills too
    few SMs), then per n: (2) each tile at the program count (row blocks x splits) that won (1), (3) half and
    double the winner's splits. Shapes not reached keep the default at run time (default_us = us when nothing beat
    it or time ran out)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    device = "cuda" if cuda_available() and not smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    a = SMOKE if smoke else attn_shape(preset, tp)
    ns, contexts = ((1, 2), (64, 128)) if smoke else (TUNE_NS, TUNE_CONTEXTS)
    splits, tiles = (SMOKE_SPLITS, SMOKE_TILES) if smoke else (SPLITS, TILES)
    kw = ({"max_time_s": 0.02, "min_samples": 2, "warmup_calls": 1, "calls_per_sample": 1} if smoke else
          {"max_time_s": 0.1, "warmup_s": 0.0})
    cp = ceiling.copy_gbps(device)
    state: dict[tuple, dict] = {}  # (context, n) -> tuner, default and best config and their times
    for context in contexts:  # pass 1; one compile per n (ROWS and NQ are constexpr), then timing only
        for n in ns:
            t = _Tuner(a, n, context, device, dtype, kw, deadline, log)
            default = t.full(md.default_config(n, a.heads, t.length, device))
            s = state[(context, n)] = {"tuner": t, "default": default, "default_us": t.time(default),
                                       "torch_us": t.time(None)}
            s["best"], s["us"] = t.best(_split_cands(t, default, splits), default, s["default_us"])
    partial = []  # shapes the time limit left with pass 1 only
    log(f"pass 1 (splits at the default tile) done [{time.perf_counter() - t0:.0f} s]")
    for n in ns:  # passes 2 and 3, n outer: the contexts of one n share its compiled tiles
        for context in contexts:
            s = state[(context, n)]
            t = s["tuner"]
            if time.perf_counter() > deadline:
                if s["us"] < math.inf:
                    partial.append(f"n={n} ctx={context}")
                continue
            progs = programs(s["best"], a, n, t.length)
            rows = a.heads * n
            for tile in tiles:
                if tile[0] > max(16, triton.next_power_of_2(rows)):
                    continue
                cfg = _tile_cfg(tile, max(1, round(progs / triton.cdiv(rows, tile[0]))))
                s["best"], s["us"] = t.best([t.full(cfg)], s["best"], s["us"])
            best = s["best"]
            s["best"], s["us"] = t.best(_split_cands(t, best, (best["num_splits"] // 2, best["num_splits"] * 2)),
                                        best, s["us"])
            log(f"ctx {context} n={n}: torch {s['torch_us']:.2f} us, default {s['default_us']:.2f} us "
                f"({_cfg_str(s['default'])}), best {s['us']:.2f} us ({_cfg_str(s['best'])}) "
                f"[{time.perf_counter() - t0:.0f} s]")
    for s in state.values():
        del s["tuner"]
    _caches.cache_clear()
    name = md.device_name(device)
    path = out or DEFAULT_TUNE_OUT
    base = path if os.path.isfile(path) else md.CONFIG_PATH
    table = copy.deepcopy(md.load_configs(str(base)))
    entry = table.setdefault(name, {})
    shapes = entry.setdefault("shapes", {})
    rows, skipped = [], []
    for (context, n), s in sorted(state.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        length = context + n
        if not s["us"] < math.inf:
            skipped.append(f"n={n} ctx={context}")
            continue
        shapes.setdefault(md.shape_key(a.heads, n, a.d, a.kv_lora), {})[str(context)] = {
            **s["best"], "us": round(s["us"], 3), **{k: round(s[k], 3) if s[k] < math.inf else None  # strict JSON
                                                    for k in ("default_us", "torch_us")}}
        moved = bytes_moved(a, n, length, dtype.itemsize)
        rows.append({"n": n, "length": length, "torch_us": s["torch_us"], "default_us": s["default_us"],
                     "best_us": s["us"], "vs_default": s["default_us"] / s["us"] if s["default_us"] < math.inf
                     else None, "eta": ceiling.eta(moved, s["us"], cp),
                     "programs": programs(s["best"], a, n, length), "config": _cfg_str(s["best"])})
    entry["tuned_on"] = {"preset": "smoke" if smoke else f"{preset}-tp{tp}", "torch": torch.__version__,
                         "triton": importlib.import_module("triton").__version__,
                         "date_utc": time.strftime("%Y-%m-%d", time.gmtime()),
                         "sweep_s": round(time.perf_counter() - t0), "copy_gbps": round(cp, 1)}
    written = md.save_configs(table, path)
    partial_note = (f"time limit ({time_limit_s:.0f} s) reached: split count only (default tile): "
                    f"{', '.join(partial)}",)
    report_tune(log, written, t0, name, cp, rows, time_limit_s, skipped, partial_note if partial else ())
    return table


DEFAULT_TUNE_OUT = "mla_decode_configs.tuned.json"  # the committed table is overwritten only when --out names it


def main(argv=None) -> int:
    return tune_main(argv, "microbench.bench_mla_decode", __doc__, md.CONFIG_PATH, DEFAULT_TUNE_OUT, 90.0, _INTERPRET,
                     lambda args: tune(args.out, args.time_limit, smoke=args.smoke, preset=args.preset, tp=args.tp))


if __name__ == "__main__":
    raise SystemExit(main())
