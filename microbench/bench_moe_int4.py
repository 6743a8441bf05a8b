"""INT4 (W4A16) routed-expert MoE layer at 1..8 (16, 32) tokens: the Triton kernel, the fp32 torch reference and
dense bf16 weights through plain torch, side by side, cold (weights rotated over >= 4 layers inside the graph).

Run: pytest --benchmark-only microbench/bench_moe_int4.py    Tune: python3 -m microbench.bench_moe_int4 tune
"""
from __future__ import annotations

import argparse
import math
import os
import time
from functools import lru_cache

import pytest
import torch

from harness import ceiling, presets
from harness.runner import CaseSpec, rel_error
from harness.timing import cuda_available, l2_bytes, measure
from kernels import moe_int4 as moe
from kernels import moe_int4_triton as mt

COMPONENT = "moe_int4"
GPU_NS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
REF_NS = (1, 4, 8)
CPU_NS = (1, 4, 8)
LAYERS = 4  # distinct full weight sets in every rotation (DESIGN.md 3: a verify forward never re-reads a layer)
MAX_SLOTS = 32
TRACE_ENV = "VERIFYBENCH_MOE_TRACE"  # a routing trace file (moe.load_routing_trace formats) adds "trace" cases
IDEAL_INT4_GAIN = 2 / (0.5 + 2 / 32)  # bf16 bytes / int4+scale bytes per weight = 3.56
TOL = 1e-2


# ---------------------------------------------------------------------------------------------------- inputs

def _shape(preset: str, tp: int) -> presets.Preset:
    return presets.get(preset, tp)


@lru_cache(maxsize=1)
def _int4_layers(preset: str, tp: int, device: str, count: int) -> tuple:
    """`count` layers of random INT4 experts (uniform nibbles; scales sized so every projection keeps unit
    variance), each a full [E, ...] set: (w13_packed, w13_scales, w2_packed, w2_scales)."""
    p = _shape(preset, tp)
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
def _dense_layers(preset: str, tp: int, device: str, count: int, dtype: torch.dtype) -> tuple:
    """The same experts dequantized to `dtype` (bf16 on GPU): what the model would be without INT4."""
    gs = _shape(preset, tp).expert_group_size
    out = []
    for w13p, w13s, w2p, w2s in _int4_layers(preset, tp, device, count):
        dense = []
        for packed, scales in ((w13p, w13s), (w2p, w2s)):
            w = torch.empty(*packed.shape[:-1], packed.shape[-1] * 8, dtype=dtype, device=device)
            for e0 in range(0, packed.shape[0], 16):  # bounded fp32 temporaries
                w[e0:e0 + 16] = moe.dequantize_w4a16(packed[e0:e0 + 16], scales[e0:e0 + 16], gs).to(dtype)
            dense.append(w)
        out.append(tuple(dense))
    return tuple(out)


def _routing(kind: str, m: int, p: presets.Preset, seed: int, device: str):
    if kind == "uniform":
        return moe.route_uniform(m, p.experts, p.topk, seed=seed, device=device)
    if kind == "skewed":
        return moe.route_skewed(m, p.experts, p.topk, seed=seed, device=device)
    if kind == "trace":
        trace = moe.load_routing_trace(os.environ[TRACE_ENV], p.experts, p.topk)
        return moe.trace_windows(trace, m, 1, seed=seed, device=device)[0]
    raise ValueError(f"unknown routing {kind!r}")


def _slots(p: presets.Preset, n: int, device: str) -> int:
    """Rotation length: >= LAYERS, and enough (layer, routing) pairs that the weights they touch are >= 4x L2."""
    l2 = l2_bytes() if device == "cuda" else 64 << 20
    per_call = moe.expected_distinct_experts(n, p.experts, p.topk) * moe.expert_bytes_int4(
        p.hidden, p.expert_intermediate, p.expert_group_size)
    return min(MAX_SLOTS, max(LAYERS, math.ceil(4 * l2 / per_call)))


# ---------------------------------------------------------------------------------------------------- cases

def _case(preset: str, tp: int, impl: str, n: int, routing: str, device: str, mode: str,
          measure_kw: dict, config: dict | None = None) -> CaseSpec:
    p = _shape(preset, tp)
    act_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dense_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if impl == "triton":
        act_dtype = torch.bfloat16 if device == "cuda" else torch.float16
    weight_format = f"int4-g{p.expert_group_size}" if impl != "torch-dense" else str(dense_dtype).split(".")[1]
    params = {"preset": preset, "tp": tp, "impl": impl, "n": n, "routing": routing, "device": device,
              "act_dtype": str(act_dtype).split(".")[1], "weights": weight_format, "experts": p.experts,
              "topk": p.topk, "hidden": p.hidden, "inter": p.expert_intermediate}
    name = f"moe/{preset}-tp{tp}/{impl if impl != 'torch-dense' else 'torch-' + weight_format}/n{n}/{routing}"

    def setup():
        layers = _int4_layers(preset, tp, device, LAYERS)
        dense = _dense_layers(preset, tp, device, LAYERS, dense_dtype) if impl == "torch-dense" else None
        slots = _slots(p, n, device) if mode == "graph" else LAYERS
        bytes_per_expert = (moe.expert_bytes_bf16(p.hidden, p.expert_intermediate) if impl == "torch-dense" else
                            moe.expert_bytes_int4(p.hidden, p.expert_intermediate, p.expert_group_size))

        def call(layer: int, x, tw, ids, *, check_ids: bool):
            if impl == "triton":
                return mt.fused_moe_w4a16(x, *layers[layer], tw, ids, config=config, check_ids=check_ids)
            if impl == "reference":
                return moe.reference_moe_w4a16(x, *layers[layer], tw, ids)
            return moe.moe_dense_torch(x, *dense[layer], tw, ids)

        fns, counts = [], []
        for s in range(slots):
            x = torch.randn(n, p.hidden, device=device).to(act_dtype)
            tw, ids = _routing(routing, n, p, seed=1000 * n + s, device=device)
            counts.append(moe.moe_bytes(ids, p.hidden, bytes_per_expert, act_dtype.itemsize))
            fns.append(lambda layer=s % LAYERS, x=x, tw=tw, ids=ids: call(layer, x, tw, ids, check_ids=False))

        def check():
            x = torch.randn(n, p.hidden, device=device).to(act_dtype)
            tw, ids = _routing(routing, n, p, seed=int(torch.randint(1 << 30, ())), device=device)
            ref = moe.reference_moe_w4a16(x.float(), *layers[0], tw, ids)
            out = call(0, x, tw, ids, check_ids=True)
            err = rel_error(out.float(), ref)
            ok = out.shape == ref.shape and out.dtype == x.dtype and err <= TOL
            return ok, f"rel_err={err:.2e} vs fp32 reference (tol {TOL:g}), {out.dtype} out"

        def derive(m) -> dict:
            mean = {k: sum(c[k] for c in counts) / len(counts) for k in counts[0]}
            copy = ceiling.copy_gbps(device)
            return {"distinct_experts": mean["distinct_experts"],
                    "expected_distinct_uniform": moe.expected_distinct_experts(n, p.experts, p.topk),
                    "bytes_moved": mean["bytes_moved"], "weight_bytes": mean["weight_bytes"],
                    "gbps": ceiling.gbps(mean["bytes_moved"], m.median_us),
                    "eta": ceiling.eta(mean["bytes_moved"], m.median_us, copy),
                    "floor_us": mean["bytes_moved"] / (copy * 1e3), "copy_gbps": copy, "rotation": len(fns)}

        return fns, check, derive

    return CaseSpec(name=name, params=params, mode=mode, setup=setup, measure_kw={"device": device, **measure_kw})


def cases(preset: str = "kimi-k2.5", tp: int = 8) -> list[CaseSpec]:
    """GPU: the Triton kernel at n in GPU_NS (uniform, skewed, and trace when TRACE_ENV names a file) and the
    plain-torch bf16 path at the same n in graph mode; the torch reference at REF_NS, eager and L2-flushed (it
    syncs on the host), capped at 1 s each. CPU (preset tiny): the reference and dense fp32 torch at CPU_NS."""
    if not cuda_available():
        if preset != "tiny":
            raise ValueError(f"preset {preset!r} needs a GPU (1.19 GB per K2.5 layer); use preset 'tiny' on CPU")
        quick = {"max_time_s": 0.2, "warmup_s": 0.0, "min_samples": 3}
        return [_case(preset, tp, impl, n, "uniform", "cpu", mode, quick)
                for impl, mode in (("reference", "cold"), ("torch-dense", "graph")) for n in CPU_NS]
    routings = ["uniform", "skewed"] + (["trace"] if os.environ.get(TRACE_ENV) else [])
    out = [_case(preset, tp, "triton", n, r, "cuda", "graph", {"max_time_s": 1.0}) for r in routings for n in GPU_NS]
    out += [_case(preset, tp, "torch-dense", n, "uniform", "cuda", "graph", {"max_time_s": 1.0}) for n in GPU_NS]
    out += [_case(preset, tp, "reference", n, "uniform", "cuda", "cold", {"max_time_s": 1.0}) for n in REF_NS]
    return out


# ---------------------------------------------------------------------------------------------------- tables

def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """Per case (us, distinct experts, GB/s, eta, floor), and per (preset, n) the three paths side by side."""
    ok = [r for r in records if r["name"].startswith("moe/") and r["check"]["ok"] and "summary" in r]
    per_case = [{"case": r["name"], "mode": r["mode"], "median_us": r["summary"]["median_us"],
                 "distinct": r["derived"]["distinct_experts"], "MB": r["derived"]["bytes_moved"] / 1e6,
                 "GB/s": r["derived"]["gbps"], "eta": r["derived"]["eta"], "floor_us": r["derived"]["floor_us"]}
                for r in ok]
    by_key: dict[tuple, dict] = {}
    for r in ok:
        prm = r["params"]
        row = by_key.setdefault((prm["preset"], prm["tp"], prm["n"]), {
            "preset": f"{prm['preset']}-tp{prm['tp']}", "n": prm["n"]})
        us = r["summary"]["median_us"]
        if prm["impl"] == "triton" and prm["routing"] == "uniform":
            row.update({"distinct": r["derived"]["distinct_experts"], "triton_us": us, "eta": r["derived"]["eta"],
                        "floor_us": r["derived"]["floor_us"]})
        elif prm["impl"] == "triton":
            row[f"triton_{prm['routing']}_us"] = us
        elif prm["impl"] == "torch-dense":
            row["torch_dense_us"] = us
        else:
            row["reference_us"] = us
    side = []
    for row in by_key.values():
        if row.get("triton_us") and row.get("torch_dense_us"):
            row["dense/int4"] = row["torch_dense_us"] / row["triton_us"]
            row["of_ideal_3.56x"] = row["dense/int4"] / IDEAL_INT4_GAIN
        if row.get("triton_us") and row.get("reference_us"):
            row["ref/triton"] = row["reference_us"] / row["triton_us"]
        side.append(row)
    side.sort(key=lambda r: (r["preset"], r["n"]))
    return [("INT4 MoE layer per case (cold: weights rotated through the graph)", per_case),
            ("INT4 MoE layer side by side (uniform routing unless named; dense = plain torch, bf16 weights on GPU)",
             side)]


# ---------------------------------------------------------------------------------------------------- pytest

BENCH_CASES = ([c for pr in ("kimi-k2.5", "deepseek-v3") for c in cases(pr, 8)] if cuda_available()
               else cases("tiny", 1))


@pytest.mark.parametrize("spec", BENCH_CASES, ids=lambda s: s.name)
def test_moe_int4(device_benchmark, spec):
    case = device_benchmark(spec)
    assert case.check_ok


# ---------------------------------------------------------------------------------------------------- tuning

# (rows, warps): kernel 1 holds 2 chunks of BLOCK_N gate + BLOCK_N up rows in registers; 8 rows spill on 3.6
GATE_UP_CANDIDATES = [{"BLOCK_N": bn, "num_warps": nw, "num_stages": 1} for bn, nw in
                      ((2, 1), (4, 1), (2, 2), (4, 2), (2, 4))]
# (rows, row blocks per program): ROW_ITERS > 1 prefetches the next block while computing this one
DOWN_CANDIDATES = [{"BLOCK_N": bn, "ROW_ITERS": it, "num_stages": 1} for bn, it in
                   ((4, 1), (8, 1), (16, 1), (4, 2), (8, 2), (2, 4), (4, 4))]


def _time_config(preset: str, tp: int, n: int, config: dict, max_time_s: float) -> float:
    """Median us of one config (graph mode, cold rotation), after its check; inf when it fails to build or check."""
    try:
        spec = _case(preset, tp, "triton", n, "uniform", "cuda", "graph", {}, config=config)
        fns, check, _ = spec.setup()
        ok, detail = check()
        if not ok:
            raise RuntimeError(detail)
        return measure(fns, mode="graph", max_time_s=max_time_s, warmup_s=0.02).median_us
    except Exception as e:  # a config the compiler or the GPU refuses is skipped, not fatal
        print(f"  config {config} at n={n} skipped: {type(e).__name__}: {str(e)[:200]}")
        return math.inf


def tune(preset: str = "kimi-k2.5", tp: int = 8, ns=GPU_NS, max_time_s: float = 0.25, log=print) -> dict:
    """A small sweep on this GPU (graph mode, cold rotation, uniform routing): layout x dequant at n = 1 and 8,
    then per n the gate_up blocking, then the down blocking (about a minute on an H200). Writes this GPU's entry
    into mt.CONFIG_PATH, keyed by torch.cuda.get_device_name()."""
    t0 = time.perf_counter()
    base = dict(mt.DEFAULT_CONFIG)
    globals_ = {(lay, dq): sum(_time_config(preset, tp, n, {**base, "layout": lay, "dequant": dq}, max_time_s)
                               for n in (1, 8)) for lay in mt.LAYOUTS for dq in ("denormal", "magic")}
    for (lay, dq), us in sorted(globals_.items(), key=lambda kv: kv[1]):
        log(f"layout {lay:10s} dequant {dq:8s}: n=1 + n=8 = {us:8.1f} us")
    layout, dequant = min(globals_, key=globals_.get)
    base.update(layout=layout, dequant=dequant)
    by_n = {}
    for n in ns:
        t1 = [_time_config(preset, tp, n, {**base, "gate_up": c}, max_time_s) for c in GATE_UP_CANDIDATES]
        best1 = GATE_UP_CANDIDATES[t1.index(min(t1))]
        t2 = [_time_config(preset, tp, n, {**base, "gate_up": best1, "down": c}, max_time_s)
              for c in DOWN_CANDIDATES]
        best2 = DOWN_CANDIDATES[t2.index(min(t2))]
        by_n[str(n)] = {"gate_up": best1, "down": best2, "us": round(min(t2), 2)}
        log(f"n={n:2d}: gate_up " + " ".join(f"{c['BLOCK_N']}/{c['num_warps']}/{c['num_stages']}:{t:.1f}"
                                            for c, t in zip(GATE_UP_CANDIDATES, t1))
            + " | down " + " ".join(f"{c['BLOCK_N']}x{c['ROW_ITERS']}:{t:.1f}" for c, t in zip(DOWN_CANDIDATES, t2))
            + f" -> {min(t2):.1f} us")
    table = dict(mt.load_configs())
    table[torch.cuda.get_device_name()] = {
        "layout": layout, "dequant": dequant, "by_n": by_n,
        "tuned_on": {"preset": f"{preset}-tp{tp}", "torch": torch.__version__,
                     "triton": __import__("triton").__version__,
                     "date_utc": time.strftime("%Y-%m-%d", time.gmtime()), "sweep_s": round(time.perf_counter() - t0)}}
    path = mt.save_configs(table)
    log(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return table


def profile(preset: str = "kimi-k2.5", tp: int = 8, ns=(1, 4, 8), calls: int = 64, log=print) -> None:
    """Per-kernel device time (torch.profiler) of the Triton path, eager calls rotated over the cold slots."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for n in ns:
        fns, _, _ = _case(preset, tp, "triton", n, "uniform", "cuda", "graph", {}).setup()
        for f in fns:
            f()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in range(calls):
                fns[c % len(fns)]()
            torch.cuda.synchronize()
        per = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per.setdefault(ev.name, []).append(ev.device_time_total if hasattr(ev, "device_time_total")
                                                   else ev.cuda_time_total)
        log(f"n={n}: " + ", ".join(f"{k[:40]} {sorted(v)[len(v) // 2]:.1f} us x{len(v) // calls}"
                                     for k, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m microbench.bench_moe_int4", description=__doc__)
    ap.add_argument("command", choices=["tune", "profile"])
    ap.add_argument("--preset", default="kimi-k2.5")
    ap.add_argument("--tp", type=int, default=8)
    args = ap.parse_args(argv)
    if not cuda_available():
        print(f"{args.command} needs a CUDA GPU")
        return 2
    (tune if args.command == "tune" else profile)(args.preset, args.tp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
