"""Tuner of the mla_decode kernel's config table (run through `verifybench tune`)."""
from __future__ import annotations

import importlib
import math
import time

import torch
import triton

from verifybench.harness.measure.timing import ceiling
from verifybench.harness.measure.timing.runner import rel_error
from verifybench.harness.measure.timing.timer import cuda_available, measure
from verifybench.harness.components.mla_decode import (Attn, MAX_N, TOL, attn_shape, bytes_moved, cache_copies,
                                                        config_str, impl_fn, programs, splits_run)
from verifybench.harness.tune.common import merged_table, report_tune
from verifybench.kernels.common import devices
from verifybench.kernels.mla_decode import api as md
from verifybench.kernels.mla_decode import configs as mds

TUNE_NS = tuple(range(1, 9))
TUNE_CONTEXTS = (4096, 32768)  # table buckets: a length uses the largest bucket <= it

# ---------------------------------------------------------------------------------------------------- tuning

SPLITS = mds.TUNE_SPLITS
TILES = mds.TUNE_TILES
SMOKE = Attn(2, 48, 32, 48 ** -0.5)
SMOKE_SPLITS = (2, 4)
SMOKE_TILES = [(16, 32, 4, 2), (16, 16, 4, 3)]


def _fits(a: Attn, n: int, tile, device: str, log) -> bool:
    """Whether the tile fits this GPU's shared memory per block (always off CUDA); a miss is named in the log."""
    limits = devices.device_limits(device)
    if limits is None:
        return True
    ok, need = mds.fits(mds.tile_config(tile), *limits, heads=a.heads, n=n, d=a.d, kv_lora=a.kv_lora)
    if not ok:
        log(f"  n={n} tile {tile} skipped: needs {need} B shared memory, this GPU allows {limits[1]} B")
    return ok


class _Tuner:
    """One (n, context): the rotation's caches and queries, the fp32 reference; times configs cold (graph mode,
    caches rotated). A config over the deadline, failing its check or refused by the compiler times inf."""

    def __init__(self, a: Attn, n: int, context: int, device: str, dtype: torch.dtype, measure_kw: dict,
                 deadline: float, log):
        self.a, self.n, self.length, self.device, self.kw, self.deadline, self.log = \
            a, n, context + n, device, measure_kw, deadline, log
        self.caches = cache_copies(context + MAX_N, a.d, device, dtype)
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
        fn = impl_fn("torch" if cfg is None else "triton", self.a, self.length, cfg)
        try:
            err = rel_error(fn(self.qs[0], self.caches[0]).float(), self.ref)
            if not err <= TOL:
                raise RuntimeError(f"rel_err {err:.2e} > {TOL}")
            fns = [lambda q=q, c=c: fn(q, c) for q, c in zip(self.qs, self.caches)]
            us = measure(fns, mode="graph", device=self.device, **self.kw).median_us
        except Exception as e:  # a config the compiler or the GPU refuses is skipped, not fatal
            self.log(f"  n={self.n} len={self.length} {config_str(cfg) or 'torch'} skipped: {type(e).__name__}: "
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


def tune(out: str, time_limit_s: float = 90.0, smoke: bool = False, preset: str = "kimi-k2.5", tp: int = 8,
         log=print) -> dict | None:
    """Tune n in TUNE_NS at TUNE_CONTEXTS and write the table JSON to `out`: the table there (else none) with this
    GPU's entry (there, else the shipped one) updated bucket by bucket; None and nothing written when no shape was
    measured. Pass 1 over every (n, context) first, so a time limit still
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
            default = t.full(mds.default_config(n, a.heads, t.length, device))
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
                if tile[0] > max(16, triton.next_power_of_2(rows)) or not _fits(a, n, tile, device, log):
                    continue
                cfg = mds.tile_config(tile, max(1, round(progs / triton.cdiv(rows, tile[0]))))
                s["best"], s["us"] = t.best([t.full(cfg)], s["best"], s["us"])
            best = s["best"]
            s["best"], s["us"] = t.best(_split_cands(t, best, (best["num_splits"] // 2, best["num_splits"] * 2)),
                                        best, s["us"])
            log(f"ctx {context} n={n}: torch {s['torch_us']:.2f} us, default {s['default_us']:.2f} us "
                f"({config_str(s['default'])}), best {s['us']:.2f} us ({config_str(s['best'])}) "
                f"[{time.perf_counter() - t0:.0f} s]")
    for s in state.values():
        del s["tuner"]
    cache_copies.cache_clear()
    name = mds.device_name(device)
    if not any(s["us"] < math.inf for s in state.values()):
        log(f"mla_decode: no shape measured in {time_limit_s:.0f} s; no table written")
        return None
    table, entry = merged_table(out, mds.CONFIG_PATH, name)
    shapes = entry.setdefault("shapes", {})
    rows, skipped = [], []
    for (context, n), s in sorted(state.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        length = context + n
        if not s["us"] < math.inf:
            skipped.append(f"n={n} ctx={context}")
            continue
        shapes.setdefault(mds.shape_key(a.heads, n, a.d, a.kv_lora), {})[str(context)] = {
            **s["best"], "us": round(s["us"], 3), **{k: round(s[k], 3) if s[k] < math.inf else None  # strict JSON
                                                    for k in ("default_us", "torch_us")}}
        moved = bytes_moved(a, n, length, dtype.itemsize)
        rows.append({"n": n, "length": length, "torch_us": s["torch_us"], "default_us": s["default_us"],
                     "best_us": s["us"], "vs_default": s["default_us"] / s["us"] if s["default_us"] < math.inf
                     else None, "eta": ceiling.eta(moved, s["us"], cp),
                     "programs": programs(s["best"], a, n, length), "config": config_str(s["best"])})
    entry["tuned_on"] = {"preset": "smoke" if smoke else f"{preset}-tp{tp}", "torch": torch.__version__,
                         "triton": importlib.import_module("triton").__version__,
                         "date_utc": time.strftime("%Y-%m-%d", time.gmtime()),
                         "sweep_s": round(time.perf_counter() - t0), "copy_gbps": round(cp, 1)}
    written = mds.save_configs(table, out)
    partial_note = (f"time limit ({time_limit_s:.0f} s) reached: split count only (default tile): "
                    f"{', '.join(partial)}",)
    report_tune(log, written, t0, name, cp, rows, time_limit_s, skipped, partial_note if partial else ())
    return table
