"""INT4 (W4A16) routed-expert MoE layer at 1..8 (16, 32) tokens: the Triton kernel, the fp32 torch reference and
dense bf16 weights through plain torch, side by side, cold (weights rotated over >= 4 layers inside the graph).

Where SGLang is installed, its own Triton W4A16 MoE ("sglang.triton", harness/engines/sglang.py) runs beside ours
with the same weights (its layout is a view of ours), check and timing: the calls fused_experts_impl makes with
--moe-runner-backend triton, its config from try_get_optimal_moe_config, with the block alignment computed by ours
outside the timed region (SGLang runs an sgl-kernel op there) and SiLU * up in torch (sgl-kernel's silu_and_mul in
SGLang). On CUDA, SGLang 0.5.10.post1 serves compressed-tensors W4A16 MoE with Marlin instead (its Triton method is
chosen on ROCm): "sglang.marlin" (harness/engines/marlin.py) is that path, its JIT kernels built with nvcc, our
layers repacked once by SGLang's own loader step, fused_marlin_moe's calls (sgl-kernel's SiLU*up and top-k sum in
torch where sgl-kernel is absent). Engine rows: moe_int4_engines.py. CPU: the Triton row in the interpreter at the
smallest n (the kernels run there only under TRITON_INTERPRET=1); the Marlin row is listed, skipped (needs CUDA).

Each case of our kernels carries its memory and latency floors and the bound between them
(harness/measure/timing/floors.py): the last table, "near the limit", sets the case beside them.

Run: verifybench moe_int4   or   pytest --benchmark-only microbench/bench_moe_int4.py. Tune: verifybench tune.
"""
from __future__ import annotations

import math
from functools import lru_cache

from pathlib import Path

import torch

from verifybench.harness.measure.timing import ceiling, floors, memory
from verifybench.harness.model import presets
from verifybench.harness.measure.results.store import CPU_TIMING, cpu_numbers
from verifybench.harness.measure.results.tables import side_by_side
from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec, rel_error
from verifybench.harness.measure.timing.timer import cold_rotation_sets, cuda_available
from verifybench.harness.components import moe_int4_engines as engine_rows
from verifybench.harness.components.moe_int4_engines import MARLIN, SGLANG
from verifybench.kernels.common import settings
from verifybench.kernels.moe_int4 import reference as moe
from verifybench.kernels.moe_int4 import api as mt
from verifybench.kernels.moe_int4 import configs as ms

NAME = "moe_int4"
HELP = "INT4 W4A16 MoE layer at 1..8 (16, 32) tokens: Triton vs the fp32 reference vs bf16 torch"
GPU_NS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
REF_NS = (1, 4, 8)
CPU_NS = (1, 4, 8)
LAYERS = 4  # distinct full weight sets in every rotation (a verify forward never re-reads a layer)
MAX_SLOTS = 32
TRACE_ENV = settings.MOE_TRACE  # a routing trace file (moe.load_routing_trace formats) adds "trace" cases
IDEAL_INT4_GAIN = 2 / (0.5 + 2 / 32)  # bf16 bytes / int4+scale bytes per weight = 3.56
TOL = 1e-2


# ---------------------------------------------------------------------------------------------------- inputs

def preset_shape(preset: str, tp: int) -> presets.Preset:
    return presets.get(preset, tp)


@lru_cache(maxsize=1)
def int4_layers(preset: str, tp: int, device: str, count: int) -> tuple:
    """`count` layers of random INT4 experts (uniform nibbles; scales sized so every projection keeps unit
    variance), each a full [E, ...] set: (w13_packed, w13_scales, w2_packed, w2_scales)."""
    p = preset_shape(preset, tp)
    e, h, i, gs = p.experts, p.hidden, p.expert_intermediate, p.expert_group_size
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)

    def linear(n, k):
        packed = torch.randint(-(1 << 31), (1 << 31) - 1, (e, n, k // 8), dtype=torch.int32, device=device,
                               generator=gen)
        std = 1.0 / (4.6 * math.sqrt(k))  # (nibble - 8) has std 4.6
        scales = (std * (0.5 + torch.rand(e, n, k // gs, device=device, generator=gen))).to(torch.bfloat16)
        return packed, scales

    return tuple((*linear(2 * i, h), *linear(h, i)) for _ in range(count))


@lru_cache(maxsize=1)
def dense_layers(preset: str, tp: int, device: str, count: int, dtype: torch.dtype,
                 int4_count: int | None = None) -> tuple:
    """The first `count` of the `int4_count` (default `count`) INT4 layers dequantized to `dtype` (bf16 on GPU):
    what the model would be without INT4."""
    gs = preset_shape(preset, tp).expert_group_size
    out = []
    for w13p, w13s, w2p, w2s in int4_layers(preset, tp, device, int4_count or count)[:count]:
        dense = []
        for packed, scales in ((w13p, w13s), (w2p, w2s)):
            w = torch.empty(*packed.shape[:-1], packed.shape[-1] * 8, dtype=dtype, device=device)
            for e0 in range(0, packed.shape[0], 16):  # bounded fp32 temporaries
                w[e0:e0 + 16] = moe.dequantize_w4a16(packed[e0:e0 + 16], scales[e0:e0 + 16], gs).to(dtype)
            dense.append(w)
        out.append(tuple(dense))
    return tuple(out)


_PLANS: dict = {}  # (preset, tp, device, what) -> memory plan of the layer sets, made once per component run


def planned_layers(preset: str, tp: int, device: str, dense_dtype: torch.dtype | None = None) -> tuple[tuple,
                                                                                                       memory.Plan]:
    """The INT4 layer sets (dense_dtype None) or their dense copies, as many of LAYERS as fit the free memory
    (measure/timing/memory.py): the INT4 sets count twice (the kernel's planar repack is cached beside each) and on a
    GPU three times (the Marlin row's copy too; on CPU that row skips), the dense ones 3.56x an INT4 set. At least
    one set, else CaseSkipped."""
    p = preset_shape(preset, tp)
    int4_set = p.experts * moe.expert_bytes_int4(p.hidden, p.expert_intermediate, p.expert_group_size)
    key = (preset, tp, device, "int4")
    if key not in _PLANS:
        copies = 3 if device == "cuda" else 2
        _PLANS[key] = memory.plan(lambda c: copies * c * int4_set, LAYERS, 1,
                                  f"the {preset} TP{tp} INT4 expert layers",
                                  "layer sets", device)
    plan = _PLANS[key]
    if plan.units == 0:
        raise CaseSkipped(plan.skip)
    layers = int4_layers(preset, tp, device, plan.units)
    if dense_dtype is None:
        return layers, plan
    dkey = (preset, tp, device, "dense")
    if dkey not in _PLANS:
        dense_set = p.experts * moe.expert_bytes_bf16(p.hidden, p.expert_intermediate) * dense_dtype.itemsize // 2
        _PLANS[dkey] = memory.plan(lambda c: c * dense_set, plan.units, 1,
                                   f"the {preset} TP{tp} dense ({dense_dtype}) expert layers", "layer sets", device)
    dplan = _PLANS[dkey]
    if dplan.units == 0:
        raise CaseSkipped(dplan.skip)
    return dense_layers(preset, tp, device, dplan.units, dense_dtype, plan.units), dplan


def _routing(kind: str, m: int, p: presets.Preset, seed: int, device: str):
    if kind == "uniform":
        return moe.route_uniform(m, p.experts, p.topk, seed=seed, device=device)
    if kind == "skewed":
        return moe.route_skewed(m, p.experts, p.topk, seed=seed, device=device)
    if kind == "trace":
        trace = moe.load_routing_trace(settings.read(TRACE_ENV), p.experts, p.topk)
        return moe.trace_windows(trace, m, 1, seed=seed, device=device)[0]
    raise ValueError(f"unknown routing {kind!r}")


def _slots(p: presets.Preset, n: int, device: str) -> int:
    """Rotation length: >= LAYERS, and enough (layer, routing) pairs that the weights they touch are >= 4x L2."""
    per_call = moe.expected_distinct_experts(n, p.experts, p.topk) * moe.expert_bytes_int4(
        p.hidden, p.expert_intermediate, p.expert_group_size)
    return cold_rotation_sets(math.ceil(per_call), device, MAX_SLOTS)


# ---------------------------------------------------------------------------------------------------- cases

def _config_record(impl: str, n: int, device: str, config: dict | None) -> dict:
    """The Triton kernel's config and where it came from (the tuned table, the default, or given by the case)."""
    if impl != "triton":
        return {}
    if config is not None:
        return {"config": config, "config_source": "given"}
    cfg, source = ms.select(n, device)
    return {"config": cfg, "config_source": source}


def make_case(preset: str, tp: int, impl: str, n: int, routing: str, device: str, mode: str,
          measure_kw: dict, config: dict | None = None) -> CaseSpec:
    p = preset_shape(preset, tp)
    act_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dense_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if impl in ("triton", SGLANG, MARLIN):  # fp16 in the interpreter: its bf16 arithmetic is wrong
        act_dtype = torch.bfloat16 if device == "cuda" else torch.float16
    weight_format = f"int4-g{p.expert_group_size}" if impl != "torch-dense" else str(dense_dtype).split(".")[1]
    params = {"preset": preset, "tp": tp, "impl": impl, "tokens": n, "routing": routing, "device": device,
              "act_dtype": str(act_dtype).split(".")[1], "weights": weight_format, "experts": p.experts,
              "experts_per_token": p.topk, "hidden": p.hidden, "inter": p.expert_intermediate}
    name = f"moe/{preset}-tp{tp}/{impl if impl != 'torch-dense' else 'torch-' + weight_format}/n{n}/{routing}"

    def setup(tokens: int):  # the case's params (CaseSpec.prepare): what its record names runs
        engine = None
        if impl in (SGLANG, MARLIN):
            engine = engine_rows.setup(impl, p, tokens, device)
        layers, plan = planned_layers(preset, tp, device)
        dense, notes = None, [plan.note] if plan.reduced else []
        if impl == "torch-dense":
            dense, dplan = planned_layers(preset, tp, device, dense_dtype)
            notes += [dplan.note] if dplan.reduced else []
        sets = len(dense) if dense is not None else len(layers)
        slots = _slots(p, tokens, device) if mode == "graph" else sets
        bytes_per_expert = (moe.expert_bytes_bf16(p.hidden, p.expert_intermediate) if impl == "torch-dense" else
                            moe.expert_bytes_int4(p.hidden, p.expert_intermediate, p.expert_group_size))

        def call(layer: int, x, tw, ids, *, check_ids: bool):
            if engine is not None:
                return engine.call(layers[layer], x, tw, ids)
            if impl == "triton":
                return mt.fused_moe_w4a16(x, *layers[layer], tw, ids, config=config, check_ids=check_ids)
            if impl == "reference":
                return moe.reference_moe_w4a16(x, *layers[layer], tw, ids)
            return moe.moe_dense_torch(x, *dense[layer], tw, ids)

        fns, counts, inputs = [], [], []
        for s in range(slots):
            x = torch.randn(tokens, p.hidden, device=device).to(act_dtype)
            tw, ids = _routing(routing, tokens, p, seed=1000 * tokens + s, device=device)
            counts.append(moe.moe_bytes(ids, p.hidden, bytes_per_expert, act_dtype.itemsize))
            inputs = inputs or [x, tw, ids]  # the first slot's: what the latency floor's grids are read from
            fns.append(lambda layer=s % sets, x=x, tw=tw, ids=ids: call(layer, x, tw, ids, check_ids=False))
        if engine is not None:  # its per-input setup done and its kernels built before the timed region
            engine_rows.first_calls(engine, fns)

        def check():
            x = torch.randn(tokens, p.hidden, device=device).to(act_dtype)
            tw, ids = _routing(routing, tokens, p, seed=int(torch.randint(1 << 30, ())), device=device)
            ref = moe.reference_moe_w4a16(x.float(), *layers[0], tw, ids)
            out = call(0, x, tw, ids, check_ids=True)
            err = rel_error(out.float(), ref)
            tol = (engine.tolerance if engine is not None else None) or TOL
            ok = out.shape == ref.shape and out.dtype == x.dtype and err <= tol
            return ok, f"rel_err={err:.2e} vs fp32 reference (tol {tol:g}), {out.dtype} out"

        def derive(m) -> dict:
            mean = {k: sum(c[k] for c in counts) / len(counts) for k in counts[0]}
            copy = ceiling.copy_gbps(device)
            d = {"distinct_experts": mean["distinct_experts"],
                 "expected_distinct_uniform": moe.expected_distinct_experts(tokens, p.experts, p.topk),
                 "bytes_moved": mean["bytes_moved"], "weight_bytes": mean["weight_bytes"],
                 "gbps": ceiling.gbps(mean["bytes_moved"], m.median_us),
                 "eta": ceiling.eta(mean["bytes_moved"], m.median_us, copy),
                 "floor_us": mean["bytes_moved"] / (copy * 1e3), "copy_gbps": copy, "rotation": len(fns),
                 "layer_sets": sets, **({"memory_note": "; ".join(notes)} if notes else {}),
                 **_config_record(impl, tokens, device, config), **(engine.record if engine is not None else {})}
            if impl == "triton":  # our kernel's latency floor: empty kernels of the two launches' grids
                x, tw, ids = inputs
                d.update(floors.figures(m, d["floor_us"], mt.launch_grids(x, *layers[0], tw, ids, config=config)))
            return d

        return fns, check, derive

    return CaseSpec(name=name, params=params, mode=mode, setup=setup, measure_kw={"device": device, **measure_kw})


CPU_TRITON_SKIP = ("the Triton kernel in the interpreter takes several minutes per case at these shapes; "
                   "tests/kernels/test_moe_int4.py checks it against the reference there")


def _skipped_triton_case(preset: str, tp: int, n: int) -> CaseSpec:
    """On CPU the Triton case is listed as skipped with its reason, so the run's summary says it did not run."""
    def setup():
        raise CaseSkipped(CPU_TRITON_SKIP)

    return CaseSpec(name=f"moe/{preset}-tp{tp}/triton/n{n}/uniform", params={"preset": preset, "tp": tp,
                    "impl": "triton", "tokens": n, "routing": "uniform", "device": "cpu"}, mode="graph", setup=setup)


def cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None = None) -> list[CaseSpec]:
    """GPU: the Triton kernel at n in GPU_NS (uniform, skewed, and trace when TRACE_ENV names a file) and the
    plain-torch bf16 path at the same n in graph mode; the torch reference at REF_NS in hot mode (eager: it syncs
    on the host for every expert, so its time is host-bound, the gate applies and the L2 state does not matter),
    capped at 1 s each. CPU (preset tiny): the reference and dense fp32 torch at CPU_NS."""
    if not cuda_available():
        if preset != "tiny":
            raise ValueError(f"preset {preset!r} needs a GPU (1.19 GB per K2.5 layer); use preset 'tiny' on CPU")
        return [make_case(preset, tp, impl, n, "uniform", "cpu", mode, {})
                for impl, mode in (("reference", "cold"), ("torch-dense", "graph")) for n in tokens or CPU_NS] + [
            _skipped_triton_case(preset, tp, min(tokens or CPU_NS)),
            make_case(preset, tp, SGLANG, min(tokens or CPU_NS), "uniform", "cpu", "graph", {}),
            make_case(preset, tp, MARLIN, min(tokens or CPU_NS), "uniform", "cpu", "graph", {})]
    routings = ["uniform", "skewed"] + (["trace"] if settings.read(TRACE_ENV) else [])
    ns = tokens or GPU_NS
    ref_ns = [n for n in ns if n in REF_NS] or [min(ns)]
    out = [make_case(preset, tp, "triton", n, r, "cuda", "graph", {"max_time_s": 1.0}) for r in routings for n in ns]
    out += [make_case(preset, tp, "torch-dense", n, "uniform", "cuda", "graph", {"max_time_s": 1.0}) for n in ns]
    out += [make_case(preset, tp, engine, n, "uniform", "cuda", "graph", {"max_time_s": 1.0})
            for engine in (SGLANG, MARLIN) for n in ns]
    out += [make_case(preset, tp, "reference", n, "uniform", "cuda", "hot", {"max_time_s": 1.0}) for n in ref_ns]
    return out


# ---------------------------------------------------------------------------------------------------- tables

def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """Per case (us, distinct experts, GB/s, eta, floor), and per (preset, n) the three paths side by side."""
    ok, per_case = ceiling.streaming_case_rows(records, "moe/", with_mode=True)

    def fill(row: dict, r: dict, us: float) -> None:
        prm = r["params"]
        if prm["impl"] == "triton" and prm["routing"] == "uniform":
            row.update({"distinct": r["derived"]["distinct_experts"], "triton_us": us, "eta": r["derived"]["eta"],
                        "floor_us": r["derived"]["floor_us"]})
        elif prm["impl"] == "triton":
            row[f"triton_{prm['routing']}_us"] = us
        elif prm["impl"] == "torch-dense":
            row["torch_dense_us"] = us
        elif prm["impl"] == SGLANG:
            row["sglang_us"] = us
        elif prm["impl"] == MARLIN:
            row["marlin_us"] = us
        else:
            row["reference_us"] = us

    side = side_by_side(
        records, ok, lambda p: (p["preset"], p["tp"], p["tokens"]),
        lambda r: {"preset": f"{r['params']['preset']}-tp{r['params']['tp']}", "n": r["params"]["tokens"]}, fill,
        (("dense/int4", "torch_dense_us", "triton_us"), ("of_ideal_3.56x", "torch_dense_us", "triton_us",
                                                          IDEAL_INT4_GAIN), ("ref/triton", "reference_us", "triton_us"),
         ("triton/sglang", "triton_us", "sglang_us"), ("triton/marlin", "triton_us", "marlin_us")),
        # CPU timings of torch paths and the interpreter: no eta, no verdict on the INT4 gain
        ("eta", "floor_us", "dense/int4", "of_ideal_3.56x", "ref/triton", "triton/sglang", "triton/marlin"))
    side.sort(key=lambda r: (r["preset"], r["n"]))
    near = floors.table(ok, lambda r: {"preset": f"{r['params']['preset']}-tp{r['params']['tp']}",
                                       "n": r["params"]["tokens"], "routing": r["params"]["routing"],
                                       "distinct": r["derived"]["distinct_experts"]})
    return [("INT4 MoE layer per case (" + (CPU_TIMING if cpu_numbers(records) else
                                             "cold: weights rotated through the graph") + ")", per_case),
            ("INT4 MoE layer side by side (uniform routing unless named; dense = "
             f"{_dense_ran(ok)}{engine_rows.ran(ok)})", side),
            *([(floors.title("INT4 MoE layer, our kernel"), near)] if near else [])]


def _dense_ran(records: list[dict]) -> str:
    """What the dense rows ran, from their own records: bf16 weights on a GPU, float32 on CPU."""
    dense = next((r for r in records if r["params"]["impl"] == "torch-dense"), None)
    if dense is None:
        return "plain torch (no dense case ran)"
    where = "GPU" if dense["params"]["device"] == "cuda" else "CPU"
    return f"plain torch, {dense['params']['weights']} weights on {where}"


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    return []


def release() -> None:
    """Drop the cached expert layers (about 5 GB for K2.5: four full layers), the cached kernel weights and the
    engine's Marlin copies."""
    int4_layers.cache_clear()
    dense_layers.cache_clear()
    _PLANS.clear()
    engine_rows.release()
