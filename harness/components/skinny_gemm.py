"""Skinny bf16 GEMMs of the verify forward, y = x @ w.T with x [n, K] at n = 1..8 tokens and the per-rank weight shapes
of a preset (Kimi-K2.5 TP8: q_a/kv_a, q_b, o_proj, router, shared expert, layer-0 dense MLP, lm_head): the Triton
kernel (kernels/skinny_gemm/, tuned table or default config; each case records which and why as config_source) and
F.linear (cuBLAS) side by side, cold: every call reads another weight copy, >= 4 copies totalling >= 4x L2, inside
the graph.

Run: pytest --benchmark-only microbench/bench_skinny_gemm.py; tune this GPU's table: verifybench tune
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pathlib import Path

import torch
import torch.nn.functional as F

from verifybench.harness.measure.timing import ceiling, memory
from verifybench.harness.model import presets
from verifybench.harness.measure.results.store import CPU_TIMING, cpu_numbers
from verifybench.harness.measure.results.tables import side_by_side
from verifybench.harness.measure.timing.runner import CPU_COPIES, CaseSkipped, CaseSpec, rel_error
from verifybench.harness.measure.timing.timer import cold_rotation_sets, cuda_available
from verifybench.kernels.skinny_gemm import api as sg
from verifybench.kernels.skinny_gemm import kernels as sgk
from verifybench.kernels.skinny_gemm import configs as sgs

NAME = "skinny_gemm"
HELP = "bf16 projections at n <= 16 tokens: Triton weight-streaming GEMM vs cuBLAS (F.linear), cold"
GPU_NS = (1, 4, 8)
CPU_NS = (1, 4, 8)
MAX_COPIES = 64
TOL = 1e-2  # bf16 output: a few ulp of bf16 over K-long fp32 sums
IMPLS = ("triton", "torch")  # torch = F.linear: cuBLAS on a GPU


@dataclass(frozen=True)
class Shape:
    name: str
    N: int  # rows of w (output features)
    K: int
    per_forward: int  # how often one verify forward runs it

    @property
    def key(self) -> str:
        return sgs.shape_key(self.N, self.K)


def shapes(preset: str = "kimi-k2.5", tp: int = 8) -> list[Shape]:
    """The bf16 projections of one rank's verify forward (harness/model/forward.py), largest share of bytes first."""
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

def max_copies(device: str) -> int:
    return MAX_COPIES if device == "cuda" else CPU_COPIES


@lru_cache(maxsize=1)
def weight_copies(N: int, K: int, device: str, dtype: torch.dtype, count: int | None = None) -> tuple:
    """The rotation's weight copies (`count`, default the cold-rotation rule's), random with unit-variance outputs;
    one shape held at a time."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    count = count or cold_rotation_sets(N * K * dtype.itemsize, device, max_copies(device))
    return tuple((torch.randn(N, K, device=device, generator=gen) / K**0.5).to(dtype) for _ in range(count))


_HELD: dict = {}  # the shape whose copies weight_copies holds, and its memory plan


def planned_copies(shape: Shape, device: str, dtype: torch.dtype) -> tuple[tuple, memory.Plan]:
    """The weight copies of `shape` as many as fit the free memory (measure/timing/memory.py; at least one, else
    CaseSkipped), planned once per shape after the previous shape's copies are dropped."""
    key = (shape.N, shape.K, device, dtype)
    if _HELD.get("key") != key:
        weight_copies.cache_clear()
        per_set = shape.N * shape.K * dtype.itemsize
        wanted = cold_rotation_sets(per_set, device, max_copies(device))
        _HELD.update(key=key, plan=memory.plan(lambda c: c * per_set, wanted,
                                               1, f"the {shape.name} weight copies", "copies", device))
    plan = _HELD["plan"]
    if plan.units == 0:
        raise CaseSkipped(plan.skip)
    return weight_copies(shape.N, shape.K, device, dtype, plan.units), plan


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

def make_case(shape: Shape, n: int, impl: str, device: str, measure_kw: dict, preset: str, tp: int,
          config: dict | None = None) -> CaseSpec:
    dtype = _dtype(impl, device)
    params = {"preset": preset, "tp": tp, "shape": shape.name, "N": shape.N, "K": shape.K, "tokens": n, "impl": impl,
              "device": device, "dtype": str(dtype).split(".")[1]}
    name = f"skinny/{preset}-tp{tp}/{shape.name}/{impl}/n{n}"

    def setup(tokens: int):  # the case's params (CaseSpec.prepare): what its record names runs
        ws, plan = planned_copies(shape, device, dtype)
        cfg, source = None, None
        if impl == "triton" and (device == "cuda" or sg._INTERPRET):
            cfg, source = (config, "given") if config else sgs.select(tokens, shape.N, shape.K, device, dtype=dtype)
        fn = _impl_fn(impl, cfg)
        xs = [torch.randn(tokens, shape.K, device=device).to(dtype) for _ in ws]  # one x per copy, as layers differ
        fns = [lambda x=x, w=w: fn(x, w) for x, w in zip(xs, ws)]

        def derive(m) -> dict:
            moved = sg.bytes_moved(tokens, shape.N, shape.K, dtype.itemsize)
            copy = ceiling.copy_gbps(device)
            d = {"bytes_moved": moved, "weight_bytes": shape.N * shape.K * dtype.itemsize,
                 "gbps": ceiling.gbps(moved, m.median_us), "eta": ceiling.eta(moved, m.median_us, copy),
                 "floor_us": moved / (copy * 1e3), "copy_gbps": copy, "rotation": len(fns),
                 "per_forward": shape.per_forward, **({"memory_note": plan.note} if plan.reduced else {})}
            if cfg is not None:
                d["config"], d["config_source"] = cfg, source
                d["plan"] = sgk.plan(tokens, shape.N, shape.K, cfg, sgs.sm_count(device))
            return d

        return fns, (lambda: _check(fn, tokens, shape.K, ws[0])), derive

    return CaseSpec(name=name, params=params, mode="graph", setup=setup, measure_kw={"device": device, **measure_kw})


def cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None = None) -> list[CaseSpec]:
    """GPU: every shape at GPU_NS, Triton and F.linear (cuBLAS), graph mode with weight rotation. CPU (preset tiny):
    F.linear in fp32 at CPU_NS, plus the interpreted kernel at two shapes when TRITON_INTERPRET=1 was set."""
    if not cuda_available():
        if preset != "tiny":
            raise ValueError(f"preset {preset!r} needs a GPU (293 MB lm_head per rank); use preset 'tiny' on CPU")
        rotation = {"calls_per_sample": CPU_COPIES}  # a sample is one pass over the copies
        out = [make_case(s, n, "torch", "cpu", rotation, preset, tp) for s in shapes(preset, tp)
               for n in tokens or CPU_NS]
        if sg._INTERPRET:
            out += [make_case(s, n, "triton", "cpu", {}, preset, tp) for s in shapes(preset, tp)[:2] for n in (1, 4)]
        return out
    return [make_case(s, n, impl, "cuda", {"max_time_s": 0.5}, preset, tp)
            for s in shapes(preset, tp) for n in tokens or GPU_NS for impl in IMPLS]


# ---------------------------------------------------------------------------------------------------- tables

def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """Per case (us, GB/s, eta) and per (shape, n) the Triton kernel beside F.linear."""
    ok, per_case = ceiling.streaming_case_rows(records, "skinny/")
    sources = {r["derived"].get("config_source") for r in ok if r["params"]["impl"] == "triton"}

    def fill(row: dict, r: dict, us: float) -> None:
        prm, d = r["params"], r["derived"]
        row[f"{prm['impl']}_us"] = us
        if prm["impl"] == "triton":  # the source once in the title when every config has the same one
            row["config"] = config_str(d.get("config")) + (f" ({d.get('config_source')})" if len(sources) > 1 else "")

    side = side_by_side(records, ok, lambda p: (p["preset"], p["tp"], p["shape"], p["tokens"]),
                        lambda r: {"shape": r["params"]["shape"], "N,K": f"{r['params']['N']},{r['params']['K']}",
                                   "n": r["params"]["tokens"]}, fill,
                        (("speedup", "torch_us", "triton_us"),),
                        ("speedup",))  # an interpreter's time says nothing of a GPU kernel's speed
    for row in side:
        row["config"] = row.pop("config", None)  # last: the widest column
    # MB, eta and floor are per case in the first table: repeated here they made this one too wide to print whole
    source = f"; every config {next(iter(sources))}" if len(sources) == 1 else ""
    return [("Skinny GEMM per case (" + (CPU_TIMING if cpu_numbers(records) else "graph mode") + ", weights rotated)",
             per_case),
            (f"Skinny GEMM: Triton vs F.linear (cuBLAS on GPU){source}; MB, eta and floor per case above", side)]


def config_str(cfg: dict | None) -> str:
    if not cfg:
        return ""
    if cfg.get("kind") == "torch":
        return "F.linear (cuBLAS)"
    red = f" {cfg['reduce']}" if (cfg.get("SPLIT_K") or 1) > 1 else ""
    return (f"{cfg['kind']} {cfg['BLOCK_N']}x{cfg['BLOCK_K']} s{cfg.get('SPLIT_K')}{red} "
            f"w{cfg['num_warps']} st{cfg['num_stages']}")


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    return []


def release() -> None:
    """Drop the cached weight copies (up to 64 per shape)."""
    weight_copies.cache_clear()
    _HELD.clear()
