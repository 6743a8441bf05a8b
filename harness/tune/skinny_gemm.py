"""Tuner of the skinny_gemm kernel's config table (run through `verifybench tune`)."""
from __future__ import annotations

import importlib
import math
import time

import torch
import torch.nn.functional as F

from verifybench.harness.measure.timing import ceiling
from verifybench.harness.measure.timing.runner import rel_error
from verifybench.harness.measure.timing.timer import cuda_available, measure
from verifybench.harness.components.skinny_gemm import Shape, TOL, config_str, shapes, weight_copies
from verifybench.harness.tune.common import merged_table, report_tune
from verifybench.kernels.common import devices
from verifybench.kernels.skinny_gemm import api as sg
from verifybench.kernels.skinny_gemm import kernels as sgk
from verifybench.kernels.skinny_gemm import configs as sgs

TUNE_NS = (1, 2, 4, 8)  # table buckets; n <= 16 beyond them gets bucket 16 (the best dot config)
SMOKE_SHAPES = [Shape("smoke_split", 48, 256, 1), Shape("smoke_wide", 128, 64, 1)]


def fitting(cfgs: list[dict], device: str, log) -> list[dict]:
    """The configs that fit this GPU's shared memory per block (all of them off CUDA); the rest named in the log."""
    limits = devices.device_limits(device)
    if limits is None:
        return cfgs
    out = []
    for c in cfgs:
        ok, need = sgs.fits(c, *limits)
        if ok:
            out.append(c)
        else:
            log(f"  skipped {config_str(c)}: needs {need} B shared memory, this GPU allows {limits[1]} B")
    return out


class _Tuner:
    """One shape's rotation, inputs and references; times configs cold (graph mode, weights rotated)."""

    def __init__(self, shape: Shape, device: str, dtype: torch.dtype, measure_kw: dict, deadline: float, log):
        self.shape, self.device, self.dtype, self.kw, self.deadline, self.log = shape, device, dtype, measure_kw, \
            deadline, log
        self.ws = weight_copies(shape.N, shape.K, device, dtype)
        self.sms = sgs.sm_count(device)
        self.xs, self.refs = {}, {}

    def _inputs(self, n: int):
        if n not in self.xs:
            self.xs[n] = [torch.randn(n, self.shape.K, device=self.device).to(self.dtype) for _ in self.ws]
            self.refs[n] = sg.linear_reference(self.xs[n][0], self.ws[0])
        return self.xs[n]

    def full(self, cfg: dict) -> dict:
        """The config with SPLIT_K resolved (the table stores what ran)."""
        c = sgs.check_config(cfg, 1)
        return {**c, "SPLIT_K": sgk.plan(1, self.shape.N, self.shape.K, c, self.sms)["split"]}

    def time(self, n: int, cfg: dict | None) -> float:
        """Median us of one call (cfg None: F.linear); inf when over time, failing its check or refused."""
        if time.perf_counter() > self.deadline:
            return math.inf
        fn = F.linear if cfg is None else (lambda x, w: sg.linear(x, w, cfg))
        try:
            xs = self._inputs(n)
            err = rel_error(fn(xs[0], self.ws[0]).float(), self.refs[n])
            if not err <= TOL:
                raise RuntimeError(f"rel_err {err:.2e} > {TOL}")
            fns = [lambda x=x, w=w: fn(x, w) for x, w in zip(xs, self.ws)]
            return measure(fns, mode="graph", device=self.device, **self.kw).median_us
        except Exception as e:  # a config the compiler or the GPU refuses is skipped, not fatal
            self.log(f"  {self.shape.name} n={n} {config_str(cfg) or 'F.linear'} skipped: {type(e).__name__}: "
                     f"{str(e)[:200]}")
            return math.inf

    def best(self, n: int, cands: list[dict]) -> tuple[dict | None, float]:
        timed = [(self.time(n, c), i) for i, c in enumerate(cands)]
        us, i = min(timed)
        return (cands[i], us) if us < math.inf else (None, math.inf)


def tune_shape(shape: Shape, device: str, ns=TUNE_NS, measure_kw: dict | None = None, deadline: float = math.inf,
               smoke: bool = False, log=print) -> dict:
    """Buckets {n: config + us + cublas_us} for one shape. The dot kernel is the same for every n <= 16, so its tile
    and split are searched once (at the largest n), then timed per n beside the fma candidates for that n."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    kw = measure_kw or {"max_time_s": 0.15, "warmup_s": 0.0}
    t = _Tuner(shape, device, dtype, kw, deadline, log)
    tiles = sgs.TUNE_DOT_TILES[:2] if smoke else sgs.TUNE_DOT_TILES
    n_dot = max(ns)
    dot, dot_us = t.best(n_dot, fitting([sgs.dot_config(tile) for tile in tiles], device, log))
    if dot is None:
        return {}
    # split-K around the heuristic's choice and none at all (one launch, no partials), then the other reduction
    s = t.full(dot)["SPLIT_K"]
    cands = {t.full({**dot, "SPLIT_K": v})["SPLIT_K"]: v for v in ([1, max(1, s // 2), s * 2] if s > 1 else [2, 4])}
    cands.pop(s, None)  # what runs after rounding to whole steps per split, minus the one timed already
    if cands:
        cand, us = t.best(n_dot, [{**dot, "SPLIT_K": v} for v in cands.values()])
        if us < dot_us:
            dot, dot_us = cand, us
    if t.full(dot)["SPLIT_K"] > 1:
        us = t.time(n_dot, {**dot, "reduce": "kernel"})
        if us < dot_us:
            dot, dot_us = {**dot, "reduce": "kernel"}, us
    dot = t.full(dot)
    buckets = {}
    for n in ns:
        us_dot = dot_us if n == n_dot else t.time(n, dot)
        fma_tiles = sgs.TUNE_FMA_TILES[_fma_bucket(n)][: 1 if smoke else None]
        fma_cfgs = fitting([sgs.fma_config(tile) for tile in fma_tiles], device, log)
        fma, us_fma = t.best(n, fma_cfgs) if n <= sgs.FMA_MAX_TOKENS and fma_cfgs else (None, math.inf)
        cfg, us = (dot, us_dot) if us_dot <= us_fma else (t.full(fma), us_fma)
        if us < math.inf:
            buckets[str(n)] = {**cfg, "us": round(us, 3)}
            default_us = t.time(n, sgs.default_config(n, shape.N, shape.K, t.sms, dtype))
            if default_us < math.inf:  # what the table buys over the untuned choice
                buckets[str(n)]["default_us"] = round(default_us, 3)
            cublas = t.time(n, None)
            if cublas < math.inf:
                buckets[str(n)]["cublas_us"] = round(cublas, 3)
                if cublas < us:  # the engine would keep cuBLAS here: so does the forward
                    buckets[str(n)] = {"kind": "torch", "us": round(cublas, 3), "cublas_us": round(cublas, 3),
                                       **{k: v for k, v in buckets[str(n)].items() if k == "default_us"}}
    us = t.time(sg.MAX_TOKENS, dot) if str(sg.MAX_TOKENS) not in buckets else math.inf
    if us < math.inf:  # n = 9..16: the dot kernel
        buckets[str(sg.MAX_TOKENS)] = {**dot, "us": round(us, 3)}
    return buckets


def _fma_bucket(n: int) -> int:
    """The TUNE_FMA_TILES key for n tokens: the next power of two (the fma kernel's BLOCK_M)."""
    return min(8, 1 << (max(1, n) - 1).bit_length())


def tune(out: str, time_limit_s: float = 100.0, smoke: bool = False, preset: str = "kimi-k2.5", tp: int = 8,
         log=print) -> dict | None:
    """Tune every shape of the preset (or SMOKE_SHAPES on CPU) and write the table JSON to `out`: the table there
    (else none) with this GPU's entry (there, else the shipped one) updated shape by shape. Shapes left when the
    time limit hits keep the default config at run time. Returns the table written, or None (nothing written) when
    no shape was measured."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    device = "cuda" if cuda_available() and not smoke else "cpu"
    todo = SMOKE_SHAPES if smoke else shapes(preset, tp)
    ns = (1, 2) if smoke else TUNE_NS
    kw = ({"max_time_s": 0.02, "min_samples": 2, "warmup_calls": 1, "calls_per_sample": 1} if smoke else
          {"max_time_s": 0.15, "warmup_s": 0.0})
    copy = ceiling.copy_gbps(device)
    results, skipped = {}, []
    for shape in todo:
        if time.perf_counter() > deadline:
            skipped.append(shape.name)
            continue
        t1 = time.perf_counter()
        b = tune_shape(shape, device, ns, kw, deadline, smoke, log)
        if b:
            results[shape] = b
        log(f"{shape.name} [{shape.N}, {shape.K}] ({time.perf_counter() - t1:.1f} s): "
            + "; ".join(f"n={n} {c['us']:.2f} us {config_str(c)}" for n, c in b.items()))
    weight_copies.cache_clear()
    name = sgs.device_name(device)
    if not results:
        log(f"skinny_gemm: no shape measured in {time_limit_s:.0f} s; no table written")
        return None
    table, entry = merged_table(out, sgs.CONFIG_PATH, name)
    entry["shapes"] = {**entry.get("shapes", {}), **{s.key: b for s, b in results.items()}}
    entry["tuned_on"] = {"preset": f"{preset}-tp{tp}" if not smoke else "smoke", "torch": torch.__version__,
                         "triton": importlib.import_module("triton").__version__,
                         "date_utc": time.strftime("%Y-%m-%d", time.gmtime()),
                         "sweep_s": round(time.perf_counter() - t0), "copy_gbps": round(copy, 1)}
    written = sgs.save_configs(table, out)
    rows = []
    for shape, b in results.items():
        for n, c in sorted(b.items(), key=lambda kv: int(kv[0])):
            moved = sg.bytes_moved(int(n), shape.N, shape.K, 2)
            cub, dflt = c.get("cublas_us"), c.get("default_us")
            rows.append({"shape": shape.name, "N,K": shape.key, "n": int(n), "cublas_us": cub, "default_us": dflt,
                         "best_us": c["us"],
                         "speedup": cub / c["us"] if cub else None, "eta": ceiling.eta(moved, c["us"], copy),
                         "cublas_eta": ceiling.eta(moved, cub, copy) if cub else None, "config": config_str(c)})
    report_tune(log, written, t0, name, copy, rows, time_limit_s, skipped)
    return table
