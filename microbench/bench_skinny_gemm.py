"""Skinny bf16 GEMMs of the verify forward, y = x @ w.T with x [n, K] at n = 1..8 tokens and the per-rank weight shapes
of a preset (Kimi-K2.5 TP8: q_a/kv_a, q_b, o_proj, router, shared expert, layer-0 dense MLP, lm_head): the Triton
kernel (kernels/skinny_gemm.py, tuned table or default config) and F.linear (cuBLAS) side by side, cold: every call
reads another weight copy, >= 4 copies totalling >= 4x L2, inside the graph (DESIGN.md 3).

Run: pytest --benchmark-only microbench/bench_skinny_gemm.py
Tune: python3 -m microbench.bench_skinny_gemm tune [--out PATH] [--time-limit S]   (CPU check: tune --smoke)
"""
from __future__ import annotations

import importlib
import math
import os
import time
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F

from harness import ceiling, presets
from harness.runner import CaseSpec, rel_error
from harness.timing import cuda_available, l2_bytes, measure
from kernels import skinny_gemm as sg
from microbench.tune_cli import report_tune, tune_main

COMPONENT = "skinny_gemm"
GPU_NS = (1, 4, 8)
CPU_NS = (1, 4, 8)
TUNE_NS = (1, 2, 4, 8)  # table buckets; n <= 16 beyond them gets bucket 16 (the best dot config)
MIN_COPIES = 4
MAX_COPIES = 64
CPU_L2_BYTES = 64 << 20
TOL = 1e-2  # bf16 output (DESIGN.md 3)
IMPLS = ("triton", "torch")  # torch = F.linear: cuBLAS on a GPU


@dataclass(frozen=True)
class Shape:
    name: str
    N: int  # rows of w (output features)
    K: int
    per_forward: int  # how often one verify forward runs it

    @property
    def key(self) -> str:
        return sg.shape_key(self.N, self.K)


def shapes(preset: str = "kimi-k2.5", tp: int = 8) -> list[Shape]:
    """The bf16 projections of one rank's verify forward (kernels/verify_forward.py), largest share of bytes first."""
    p = presets.get(preset, tp)
    latent = p.kv_lora + p.qk_rope
    out = [Shape("q_a_kv_a", p.q_lora + latent, p.hidden, p.layers),
           Shape("o_proj", p.hidden, p.heads * p.v_head, p.layers),
           # the full forward runs router and shared gate_up as one GEMM; each alone in the isolated components
           Shape("router_shared_gate_up", p.experts + 2 * p.expert_intermediate, p.hidden, p.moe_layers),
           Shape("shared_gate_up", 2 * p.expert_intermediate, p.hidden, p.moe_layers),
           Shape("router", p.experts, p.hidden, p.moe_layers),
           Shape("q_b", p.heads * (p.qk_nope + p.qk_rope), p.q_lora, p.layers),
           Shape("lm_head", p.vocab, p.hidden, 1),
           Shape("shared_down", p.hidden, p.expert_intermediate, p.moe_layers),
           Shape("dense_gate_up", 2 * p.dense_intermediate, p.hidden, p.dense_layers),
           Shape("dense_down", p.hidden, p.dense_intermediate, p.dense_layers)]
    return [s for s in out if s.per_forward > 0]


# ---------------------------------------------------------------------------------------------------- inputs

def _copies(N: int, K: int, itemsize: int, device: str) -> int:
    """Weight copies per rotation: >= MIN_COPIES and >= 4x L2 in all (DESIGN.md 3), at most MAX_COPIES."""
    if device != "cuda":
        return MIN_COPIES
    return min(MAX_COPIES, max(MIN_COPIES, math.ceil(4 * l2_bytes() / (N * K * itemsize))))


@lru_cache(maxsize=1)
def _weights(N: int, K: int, device: str, dtype: torch.dtype) -> tuple:
    """The rotation's weight copies, random with unit-variance outputs; one shape held at a time."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    count = _copies(N, K, dtype.itemsize, device)
    return tuple((torch.randn(N, K, device=device, generator=gen) / K**0.5).to(dtype) for _ in range(count))


def _dtype(impl: str, device: str) -> torch.dtype:
    if device == "cuda":
        return torch.bfloat16
    return torch.float16 if impl == "triton" else torch.float32  # bf16 arithmetic is wrong in the interpreter


def _impl_fn(impl: str, config: dict | None):
    if impl == "triton":
        return lambda x, w: sg.linear(x, w, config)
    return F.linear


def _check(fn, n: int, K: int, w: torch.Tensor) -> tuple[bool, str]:
    """Fresh random x against the fp32 reference."""
    x = torch.randn(n, K, device=w.device).to(w.dtype)
    ref = sg.linear_reference(x, w)
    out = fn(x, w)
    err = rel_error(out.float(), ref)
    ok = tuple(out.shape) == tuple(ref.shape) and out.dtype == x.dtype and err <= TOL
    return ok, f"rel_err={err:.2e} vs fp32 reference (tol {TOL:g}), {out.dtype} out"


# ---------------------------------------------------------------------------------------------------- cases

def _case(shape: Shape, n: int, impl: str, device: str, measure_kw: dict, preset: str, tp: int,
          config: dict | None = None) -> CaseSpec:
    dtype = _dtype(impl, device)
    params = {"preset": preset, "tp": tp, "shape": shape.name, "N": shape.N, "K": shape.K, "n": n, "impl": impl,
              "device": device, "dtype": str(dtype).split(".")[1]}
    name = f"skinny/{preset}-tp{tp}/{shape.name}/{impl}/n{n}"

    def setup():
        ws = _weights(shape.N, shape.K, device, dtype)
        cfg = None
        if impl == "triton" and (device == "cuda" or sg._INTERPRET):
            cfg = config or sg.select_config(n, shape.N, shape.K, device, dtype=dtype)
        fn = _impl_fn(impl, cfg)
        xs = [torch.randn(n, shape.K, device=device).to(dtype) for _ in ws]  # one x per copy, as layers differ
        fns = [lambda x=x, w=w: fn(x, w) for x, w in zip(xs, ws)]

        def derive(m) -> dict:
            moved = sg.bytes_moved(n, shape.N, shape.K, dtype.itemsize)
            copy = ceiling.copy_gbps(device)
            d = {"bytes_moved": moved, "weight_bytes": shape.N * shape.K * dtype.itemsize,
                 "gbps": ceiling.gbps(moved, m.median_us), "eta": ceiling.eta(moved, m.median_us, copy),
                 "floor_us": moved / (copy * 1e3), "copy_gbps": copy, "rotation": len(fns),
                 "per_forward": shape.per_forward}
            if cfg is not None:
                d["config"] = cfg
                d["plan"] = sg.plan(n, shape.N, shape.K, cfg, sg.sm_count(device))
            return d

        return fns, (lambda: _check(fn, n, shape.K, ws[0])), derive

    return CaseSpec(name=name, params=params, mode="graph", setup=setup, measure_kw={"device": device, **measure_kw})


def cases(preset: str = "kimi-k2.5", tp: int = 8) -> list[CaseSpec]:
    """GPU: every shape at GPU_NS, Triton and F.linear (cuBLAS), graph mode with weight rotation. CPU (preset tiny):
    F.linear in fp32 at CPU_NS, plus the interpreted kernel at two shapes when TRITON_INTERPRET=1 was set."""
    if not cuda_available():
        if preset != "tiny":
            raise ValueError(f"preset {preset!r} needs a GPU (293 MB lm_head per rank); use preset 'tiny' on CPU")
        quick = {"max_time_s": 0.2, "warmup_s": 0.0, "min_samples": 3}
        out = [_case(s, n, "torch", "cpu", quick, preset, tp) for s in shapes(preset, tp) for n in CPU_NS]
        if sg._INTERPRET:
            out += [_case(s, n, "triton", "cpu", quick, preset, tp) for s in shapes(preset, tp)[:2] for n in (1, 4)]
        return out
    return [_case(s, n, impl, "cuda", {"max_time_s": 0.5}, preset, tp)
            for s in shapes(preset, tp) for n in GPU_NS for impl in IMPLS]


# ---------------------------------------------------------------------------------------------------- tables

def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """Per case (us, GB/s, eta) and per (shape, n) the Triton kernel beside F.linear."""
    ok, per_case = ceiling.streaming_case_rows(records, "skinny/")
    by_key: dict[tuple, dict] = {}
    for r in ok:
        prm, d = r["params"], r["derived"]
        row = by_key.setdefault((prm["preset"], prm["tp"], prm["shape"], prm["n"]), {
            "shape": prm["shape"], "N,K": f"{prm['N']},{prm['K']}", "n": prm["n"], "MB": d["bytes_moved"] / 1e6,
            "floor_us": d["floor_us"]})
        us = r["summary"]["median_us"]
        if prm["impl"] == "triton":
            row.update({"triton_us": us, "triton_eta": d["eta"], "config": _cfg_str(d.get("config"))})
        else:
            row.update({"torch_us": us, "torch_eta": d["eta"]})
    side = list(by_key.values())
    for row in side:
        if row.get("triton_us") and row.get("torch_us"):
            row["speedup"] = row["torch_us"] / row["triton_us"]
    return [("Skinny GEMM per case (graph mode, weights rotated)", per_case),
            ("Skinny GEMM: Triton vs F.linear (cuBLAS on GPU)", side)]


def _cfg_str(cfg: dict | None) -> str:
    if not cfg:
        return ""
    if cfg.get("kind") == "torch":
        return "F.linear (cuBLAS)"
    red = f" {cfg['reduce']}" if (cfg.get("SPLIT_K") or 1) > 1 else ""
    return (f"{cfg['kind']} {cfg['BLOCK_N']}x{cfg['BLOCK_K']} s{cfg.get('SPLIT_K')}{red} "
            f"w{cfg['num_warps']} st{cfg['num_stages']}")


# ---------------------------------------------------------------------------------------------------- pytest

BENCH_CASES = cases("kimi-k2.5", 8) if cuda_available() else cases("tiny", 1)


@pytest.mark.parametrize("spec", BENCH_CASES, ids=lambda s: s.name)
def test_skinny_gemm(device_benchmark, spec):
    case = device_benchmark(spec)
    assert case.check_ok


# ---------------------------------------------------------------------------------------------------- tuning

# (BLOCK_N, BLOCK_K, num_warps, num_stages). BLOCK_N >= 64 with 4 warps runs wgmma on sm_90, below it mma.sync;
# smem per CTA = stages x (BLOCK_N + 16) x BLOCK_K x 2 B (one tile more with PDL: the peeled first step), so these
# range over 1-3 CTAs per SM and 64-144 KB of w in flight per SM. The last three go deeper (6-8 stages, 120-180 KB
# with PDL on sm_90, triton 3.6): ncu showed the tuned tiles long-scoreboard-bound at one 4-warp CTA per SM
# (results/nvidia-h200-x1/verify-half2/ncu-layer-n8.txt). Timed on the H200 (results/nvidia-h200-x1/tune-a9bf804/):
# only lm_head picks one (8 stages, -3%); every projection of a layer keeps its 3-4 stage tile. The BLOCK_N = 16 tiles
# (mma.sync, 48-160 KB of shared memory with PDL) give the 2112-row q_a/kv_a projection one column block per SM
# without split-K (no reduce launch), and the 384-1536-row GEMMs 4x the blocks of BLOCK_N = 64 at less split-K.
# Timed on the H200 (results/nvidia-h200-x1/tune-669a51f/): they win only the router and shared gate_up run alone
# (-2%); q_a/kv_a keeps BLOCK_N 64 with split-K 4. That sweep timed o_proj's dot tiles ~10% slower than the one
# before, so the committed table was kept.
DOT_TILES = [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (32, 256, 4, 4), (64, 128, 8, 5), (64, 128, 4, 6),
             (64, 128, 4, 8), (32, 256, 4, 8), (16, 256, 4, 4), (16, 512, 4, 4), (16, 256, 2, 6)]
# (BLOCK_N, BLOCK_K, num_warps) per token bucket: BLOCK_K = 8 x 32 x warps x U, so each thread streams U 16-byte
# slices of BLOCK_N rows per step; registers grow with the tokens (x and accumulators are per token).
FMA_TILES = {1: [(4, 1024, 4), (8, 1024, 4)], 2: [(4, 1024, 4), (8, 1024, 4)], 4: [(4, 1024, 4), (2, 2048, 8)],
             8: [(2, 1024, 4), (2, 2048, 8)]}
SMOKE_SHAPES = [Shape("smoke_split", 48, 256, 1), Shape("smoke_wide", 128, 64, 1)]


def _dot(tile, split=None, reduce="serial") -> dict:
    bn, bk, nw, ns = tile
    return {"kind": "dot", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "reduce": reduce, "num_warps": nw,
            "num_stages": ns}


def _fma(tile, split=None) -> dict:
    bn, bk, nw = tile
    return {"kind": "fma", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "reduce": "serial", "num_warps": nw,
            "num_stages": 1}


class _Tuner:
    """One shape's rotation, inputs and references; times configs cold (graph mode, weights rotated)."""

    def __init__(self, shape: Shape, device: str, dtype: torch.dtype, measure_kw: dict, deadline: float, log):
        self.shape, self.device, self.dtype, self.kw, self.deadline, self.log = shape, device, dtype, measure_kw, \
            deadline, log
        self.ws = _weights(shape.N, shape.K, device, dtype)
        self.sms = sg.sm_count(device)
        self.xs, self.refs = {}, {}

    def _inputs(self, n: int):
        if n not in self.xs:
            self.xs[n] = [torch.randn(n, self.shape.K, device=self.device).to(self.dtype) for _ in self.ws]
            self.refs[n] = sg.linear_reference(self.xs[n][0], self.ws[0])
        return self.xs[n]

    def full(self, cfg: dict) -> dict:
        """The config with SPLIT_K resolved (the table stores what ran)."""
        c = sg.check_config(cfg, 1)
        return {**c, "SPLIT_K": sg.plan(1, self.shape.N, self.shape.K, c, self.sms)["split"]}

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
            self.log(f"  {self.shape.name} n={n} {_cfg_str(cfg) or 'F.linear'} skipped: {type(e).__name__}: "
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
    tiles = DOT_TILES[:2] if smoke else DOT_TILES
    n_dot = max(ns)
    dot, dot_us = t.best(n_dot, [_dot(tile) for tile in tiles])
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
        fma_tiles = FMA_TILES[_fma_bucket(n)][: 1 if smoke else None]
        fma, us_fma = t.best(n, [_fma(tile) for tile in fma_tiles]) if n <= sg.FMA_MAX_TOKENS else (None, math.inf)
        cfg, us = (dot, us_dot) if us_dot <= us_fma else (t.full(fma), us_fma)
        if us < math.inf:
            buckets[str(n)] = {**cfg, "us": round(us, 3)}
            cublas = t.time(n, None)
            if cublas < math.inf:
                buckets[str(n)]["cublas_us"] = round(cublas, 3)
                if cublas < us:  # the engine would keep cuBLAS here: so does the forward
                    buckets[str(n)] = {"kind": "torch", "us": round(cublas, 3), "cublas_us": round(cublas, 3)}
    us = t.time(sg.MAX_TOKENS, dot) if str(sg.MAX_TOKENS) not in buckets else math.inf
    if us < math.inf:  # n = 9..16: the dot kernel
        buckets[str(sg.MAX_TOKENS)] = {**dot, "us": round(us, 3)}
    return buckets


def _fma_bucket(n: int) -> int:
    """The FMA_TILES key for n tokens: the next power of two (the fma kernel's BLOCK_M)."""
    return min(8, 1 << (max(1, n) - 1).bit_length())


def tune(preset: str = "kimi-k2.5", tp: int = 8, out: str | None = None, time_limit_s: float = 100.0,
         smoke: bool = False, log=print) -> dict:
    """Tune every shape of the preset (or SMOKE_SHAPES on CPU) and write the table JSON to `out` (a whole table:
    the committed one with this GPU's entry replaced shape by shape). Shapes left when the time limit hits keep the
    default config at run time."""
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
            + "; ".join(f"n={n} {c['us']:.2f} us {_cfg_str(c)}" for n, c in b.items()))
    _weights.cache_clear()
    name = sg.device_name(device)
    path = out or DEFAULT_TUNE_OUT
    table = dict(sg.load_configs(path if os.path.isfile(path) else sg.CONFIG_PATH))
    entry = dict(table.get(name, {}))
    entry["shapes"] = {**entry.get("shapes", {}), **{s.key: b for s, b in results.items()}}
    entry["tuned_on"] = {"preset": f"{preset}-tp{tp}" if not smoke else "smoke", "torch": torch.__version__,
                         "triton": importlib.import_module("triton").__version__,
                         "date_utc": time.strftime("%Y-%m-%d", time.gmtime()),
                         "sweep_s": round(time.perf_counter() - t0), "copy_gbps": round(copy, 1)}
    table[name] = entry
    written = sg.save_configs(table, path)
    rows = []
    for shape, b in results.items():
        for n, c in sorted(b.items(), key=lambda kv: int(kv[0])):
            moved = sg.bytes_moved(int(n), shape.N, shape.K, 2)
            cub = c.get("cublas_us")
            rows.append({"shape": shape.name, "N,K": shape.key, "n": int(n), "cublas_us": cub, "best_us": c["us"],
                         "speedup": cub / c["us"] if cub else None, "eta": ceiling.eta(moved, c["us"], copy),
                         "cublas_eta": ceiling.eta(moved, cub, copy) if cub else None, "config": _cfg_str(c)})
    report_tune(log, written, t0, name, copy, rows, time_limit_s, skipped)
    return table


DEFAULT_TUNE_OUT = "skinny_gemm_configs.tuned.json"  # the committed table is overwritten only when --out names it


def main(argv=None) -> int:
    return tune_main(argv, "microbench.bench_skinny_gemm", __doc__, sg.CONFIG_PATH, DEFAULT_TUNE_OUT, 100.0,
                     sg._INTERPRET, lambda args: tune(args.preset, args.tp, args.out, args.time_limit, smoke=args.smoke))


if __name__ == "__main__":
    raise SystemExit(main())
