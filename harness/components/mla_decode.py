"""MLA decode attention of the verify forward (attn_core) at one rank's shape (Kimi-K2.5 TP8: 8 heads,
n = 1..8 query tokens, D = 576 = 512 latent + 64 rope, over context + n keys, bf16): the Triton flash-decoding kernel
(kernels/mla_decode/) with the tuned table's config and with the untuned default, beside the plain-torch path the
forward used before (q @ keys.T in bf16 -> float -> * scale -> softmax -> bf16 -> @ keys[:, :512]). Cold: every
call reads another cache, >= 4 caches totalling >= 4x L2, inside the graph, as a forward reads each layer's cache
once. Each kernel case records its config and config_source (tuned, default, or why a tuned entry was not used).
Beside them, where SGLang can be imported, its own Triton decode kernel called as its backend calls it
(harness/engines/sglang.py), and on a GPU with FlashInfer installed FlashInfer's MLA decode as SGLang's flashinfer_mla
backend plans it (harness/engines/flashinfer.py; its plan() host-timed beside), on the same caches and queries,
checked and timed the same way; skipped with the reason where they cannot.
With --batch, B requests, each with its own n tokens over its own context + n rows (request b's from row
b x (context + 8)): the engines take them in one call, as their backends do; our kernel and the torch path take one
request per launch, so they run B launches in the one graph (the verify forward at B > 1 runs mla_verify's batched
split-KV instead, timed there). Each case checks every request against the reference and against it run alone.

Each case of our kernels carries its memory and latency floors and the bound between them
(harness/measure/timing/floors.py): the last table, "near the limit", sets the case beside them.

Run: pytest --benchmark-only microbench/bench_mla_decode.py; tune this GPU's table: verifybench tune
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pathlib import Path

import torch
import triton

from verifybench.harness import engines
from verifybench.harness.measure.timing import ceiling, floors, memory
from verifybench.harness.engines import backends
from verifybench.harness.model import presets
from verifybench.harness.measure.results.store import CPU_TIMING, batch_of, cpu_numbers
from verifybench.harness.measure.results.tables import side_by_side
from verifybench.harness.measure.timing.runner import CPU_COPIES, CaseSkipped, CaseSpec, rel_error, say_once
from verifybench.harness.measure.timing.timer import cold_rotation_sets, cuda_available
from verifybench.kernels.common import interpret
from verifybench.kernels.mla_decode import api as md
from verifybench.kernels.mla_decode import configs as mds
from verifybench.harness.model.forward import TORCH_OPS

NAME = "mla_decode"
HELP = "MLA decode attention of n <= 8 tokens over the latent cache: Triton flash-decoding vs plain torch, cold"
TAKES_BATCH = True  # --batch: B requests per call, each over its own context (B > 1 cases name their batch)
GPU_NS = (1, 3, 4, 6, 8)  # the plain decode (1) and the verify forward at the cycle's D = 3, 4, 6, 8
GPU_CONTEXTS = (4096, 32768)
CPU_NS = (1, 4, 8)
CPU_CONTEXTS = (256,)  # in place of the CPU profile's default context (presets.CPU_CONTEXT), said so
CPU_INTERPRETED_NS = (1, 4)  # the interpreted kernels' n without --tokens
CPU_INTERPRETED_CONTEXT_MAX = 4096  # past it the interpreter takes minutes a case
MAX_N = 8  # each request's region holds context + MAX_N rows, so every n of one context shares it
MAX_COPIES = 64
TOL = 1e-2  # bf16 output: a few ulp of bf16 over softmax-weighted fp32 sums
IMPLS = ("triton", "triton-default", "torch")  # triton: select_config (tuned table); torch: model/forward.py's path
# the engines' own kernels, rows of their own beside ours, as harness/engines/backends.py declares them
ENGINE_IMPLS = tuple(b.row for b in backends.of(NAME, engines_only=True))
ENGINES = tuple(dict.fromkeys(b.engine for b in backends.of(NAME, engines_only=True)))  # their table columns
# triton.jit picks the interpreter at decoration time: CPU runs of the kernel need TRITON_INTERPRET=1 before import
INTERPRET = interpret.active()


@dataclass(frozen=True)
class Attn:
    heads: int
    d: int  # kv_lora + rope dims
    kv_lora: int
    scale: float  # (qk_nope + qk_rope) ** -0.5, what the MLA forward passes


def attn_shape(preset: str = "kimi-k2.5", tp: int = 8) -> Attn:
    p = presets.get(preset, tp)
    return Attn(p.heads, p.kv_lora + p.qk_rope, p.kv_lora, (p.qk_nope + p.qk_rope) ** -0.5)


def bytes_moved(a: Attn, n: int, length: int, itemsize: int = 2, batch: int = 1) -> int:
    """What must move: each of `batch` requests' cache rows once (every head shares them), q and o."""
    return batch * (length * a.d + a.heads * n * (a.d + a.kv_lora)) * itemsize


def splits_run(cfg: dict, length: int) -> int:
    """The split count the kernel launches for cfg at `length` (whole key tiles per split, no empty split)."""
    return triton.cdiv(length, md.split_keys(length, cfg["num_splits"], cfg["block_keys"]))


def programs(cfg: dict, a: Attn, n: int, length: int) -> int:
    """Stage-1 programs: row blocks x splits, as the kernel's launch plan has them."""
    _, grid, _, _ = md.launches(a.heads, n, a.d, a.kv_lora, length, cfg["num_splits"], mds.check_config(cfg))[0]
    return grid[0] * grid[1]


# ---------------------------------------------------------------------------------------------------- inputs

def max_copies(device: str) -> int:
    return MAX_COPIES if device == "cuda" else CPU_COPIES


@lru_cache(maxsize=2)  # the tuner holds both contexts' rotations (~0.4 GB on an H200)
def cache_copies(rows: int, d: int, device: str, dtype: torch.dtype, count: int | None = None) -> tuple:
    """The rotation's caches (one per layer a forward would read; `count`, default the cold-rotation rule's),
    random."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    count = count or cold_rotation_sets(rows * d * dtype.itemsize, device, max_copies(device))
    return tuple(torch.randn(rows, d, device=device, generator=gen).to(dtype) for _ in range(count))


_HELD: dict = {}  # the (rows, d, device, dtype) whose caches the component holds, and its memory plan


def planned_caches(rows: int, d: int, device: str, dtype: torch.dtype, batch: int = 1) -> tuple[tuple, memory.Plan]:
    """The rotation's caches (`rows` holds all `batch` requests' regions), as many as fit the free memory
    (measure/timing/memory.py; at least one, else CaseSkipped), planned once per cache shape after the previous
    shape's caches are dropped."""
    key = (rows, d, device, dtype)
    if _HELD.get("key") != key:
        cache_copies.cache_clear()
        per_set = rows * d * dtype.itemsize
        wanted = cold_rotation_sets(per_set, device, max_copies(device))
        what = f"the {rows}-row KV-cache copies" + (f" of {batch} requests" if batch > 1 else "")
        _HELD.update(key=key, plan=memory.plan(lambda c: c * per_set, wanted, 1, what, "copies", device))
    plan = _HELD["plan"]
    if plan.units == 0:
        raise CaseSkipped(plan.skip)
    return cache_copies(rows, d, device, dtype, plan.units), plan


def _dtype(impl: str, device: str) -> torch.dtype:
    if device == "cuda":
        return torch.bfloat16
    return torch.float16 if impl != "torch" else torch.float32  # bf16 arithmetic is wrong in the interpreter


def impl_fn(impl: str, a: Attn, length: int, cfg: dict | None):
    if impl == "torch":
        return lambda q, c: TORCH_OPS.mla(q, c, length, a.kv_lora, a.scale)
    return lambda q, c: md.mla_decode(q, c, length, a.kv_lora, a.scale, config=cfg)


def layout(batch: int, context: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) int32 [B]: request b's n tokens attend rows [b x (context + MAX_N), + length)."""
    starts = torch.arange(batch, dtype=torch.int32, device=device) * (context + MAX_N)
    return starts, torch.full((batch,), length, dtype=torch.int32, device=device)


def requests_fn(impl: str, a: Attn, starts: list[int], lengths: list[int], cfgs: list):
    """fn(q, cache) of our kernel or the torch path over B requests (q [heads, B * n, D], request-major), one launch
    per request over its own rows cache[start_b:] (the kernel takes one request; cfgs: one config each)."""
    if len(starts) == 1 and starts[0] == 0:
        return impl_fn(impl, a, lengths[0], cfgs[0])  # one request: the call the tuner and the forward make

    def fn(q, cache):
        n = q.shape[1] // len(starts)
        out = torch.empty(q.shape[0], q.shape[1], a.kv_lora, dtype=q.dtype, device=q.device)
        for b, (start, length, cfg) in enumerate(zip(starts, lengths, cfgs)):
            rows = slice(b * n, (b + 1) * n)
            if impl == "torch":
                out[:, rows] = TORCH_OPS.mla(q[:, rows], cache[start:], length, a.kv_lora, a.scale)
            else:  # the kernel writes its request's rows in place: no copy in the timed graph
                md.mla_decode(q[:, rows], cache[start:], length, a.kv_lora, a.scale, config=cfg, out=out[:, rows])
        return out
    return fn


def engine_fns(impl: str, a: Attn, n: int, starts: torch.Tensor, lens: torch.Tensor, qs, caches) -> tuple:
    """The engine's decode of the requests (starts / lens [B]: n tokens each over rows [start_b, start_b + len_b))
    over the rotation, one run() per layer sharing one forward's metadata or plan (as the backend shares it), the
    call the check makes, FlashInfer's plan (None for SGLang) and what the record adds (SGLang's max_kv_splits),
    through the backend's declared call (harness/engines/calls.py); CaseSkipped with the one-line reason where the
    engine cannot run here."""
    backend = backends.for_row(NAME, impl)
    guard = engines.engine_call(backend.engine)
    try:
        runs_here, why = backend.enabled(caches[0].device.type)
        if not runs_here:
            raise engines.EngineMissing(why)
        make, plan = guard(backend.function("call"))(starts, lens, n, a.heads, a.kv_lora, a.d - a.kv_lora, a.scale,
                                                     caches[0].dtype)
        runs = [make(q, c) for q, c in zip(qs, caches)]
        # the engine's kernels compiled before the timed region, a failure there its rows' one-line skip
        guard(lambda: [run() for run in runs])()
    except engines.EngineMissing as e:
        raise engines.skipped(e) from None
    return runs, lambda q, c: make(q, c)(), plan, getattr(make, "record", {})


def check_requests(fn, alone, a: Attn, n: int, starts: list[int], lengths: list[int],
                   cache: torch.Tensor) -> tuple[bool, str]:
    """Fresh random q of B requests (n tokens each) against the fp32 reference of each request over its own rows
    and, for B > 1, each request's rows against that request run alone (alone(b) -> its fn(q_b, cache))."""
    q = torch.randn(a.heads, len(starts) * n, a.d, device=cache.device).to(cache.dtype)
    rows = [slice(b * n, (b + 1) * n) for b in range(len(starts))]
    ref = torch.cat([md.mla_decode_reference(q[:, r].float(), cache[s:].float(), length, a.kv_lora, a.scale)
                     for r, s, length in zip(rows, starts, lengths)], 1)
    out = fn(q, cache)
    err = rel_error(out.float(), ref)
    ok = tuple(out.shape) == tuple(ref.shape) and out.dtype == q.dtype and err <= TOL
    detail = f"rel_err={err:.2e} vs fp32 reference (tol {TOL:g}), {out.dtype} out"
    if len(starts) > 1:
        worst = max(rel_error(out[:, r].float(), alone(b)(q[:, r].contiguous(), cache).float())
                    for b, r in enumerate(rows))
        ok = ok and worst <= TOL
        detail += f"; each of {len(starts)} requests run alone: rel_err <= {worst:.2e}"
    return ok, detail


def _config(impl: str, a: Attn, n: int, length: int, device: str, dtype: torch.dtype) -> tuple[dict | None, str]:
    """(config, config_source) of an implementation (None for the torch path)."""
    if impl == "triton":
        return mds.select(n, a.heads, length, device, d=a.d, kv_lora=a.kv_lora, dtype=dtype)
    if impl == "triton-default":
        return mds.default_config(n, a.heads, length, device), "default"
    return None, None


# ---------------------------------------------------------------------------------------------------- cases

def make_case(a: Attn, n: int, context: int, impl: str, device: str, measure_kw: dict, preset: str, tp: int,
              batch: int = 1) -> CaseSpec:
    dtype = _dtype(impl, device)
    backend = backends.for_row(NAME, impl)
    engine = backend is not None and backend.engine is not None
    length = context + n  # the verify forward writes its n tokens' slots, then attends all of them
    params = {"preset": preset, "tp": tp, "heads": a.heads, "DK": a.d, "kv_lora": a.kv_lora, "tokens": n,
              "context": context, "length": length, "batch": batch, "impl": impl, "device": device,
              "dtype": str(dtype).split(".")[1], **({"engine": engines.label(backend.engine)} if engine else {})}
    requests = f"B{batch}/" if batch > 1 else ""  # B = 1 keeps the names the baselines compare by
    name = f"mla/{preset}-tp{tp}/ctx{context}/{requests}{impl}/n{n}"

    def setup(batch: int, tokens: int):  # the case's params (CaseSpec.prepare): what its record names runs
        caches, plan = planned_caches(batch * (context + MAX_N), a.d, device, dtype, batch)
        qs = [torch.randn(a.heads, batch * tokens, a.d, device=device).to(dtype) for _ in caches]  # one q per layer
        starts, lens = layout(batch, context, length, device)
        firsts, lengths = starts.tolist(), lens.tolist()
        if engine:
            cfg, source = None, None
            fns, fn, plan_call, engine_record = engine_fns(impl, a, tokens, starts, lens, qs, caches)
            alone = lambda b: engine_fns(impl, a, tokens, starts[b:b + 1], lens[b:b + 1], (),  # noqa: E731
                                         caches)[1]
        else:
            cfg, source, plan_call, engine_record = *_config(impl, a, tokens, length, device, dtype), None, {}
            fn = requests_fn(impl, a, firsts, lengths, [cfg] * batch)
            fns = [lambda q=q, c=c: fn(q, c) for q, c in zip(qs, caches)]
            alone = lambda b: requests_fn(impl, a, firsts[b:b + 1], lengths[b:b + 1], [cfg])  # noqa: E731

        def derive(m) -> dict:
            moved = bytes_moved(a, tokens, length, dtype.itemsize, batch)
            cp = ceiling.copy_gbps(device)
            d = {"bytes_moved": moved, "cache_bytes": batch * length * a.d * dtype.itemsize,
                 "gbps": ceiling.gbps(moved, m.median_us), "eta": ceiling.eta(moved, m.median_us, cp),
                 "floor_us": moved / (cp * 1e3), "copy_gbps": cp, "rotation": len(fns),
                 **engine_record, **({"memory_note": plan.note} if plan.reduced else {})}
            if cfg is not None:
                d["config"], d["config_source"] = cfg, source
                d["splits_run"] = splits_run(cfg, length)
                d["programs"] = batch * programs(cfg, a, tokens, length)  # one launch per request
                # its latency floor: empty kernels of the grids each request's launches have, as requests_fn makes them
                d.update(floors.figures(m, d["floor_us"], [
                    one for b, (start, keys) in enumerate(zip(firsts, lengths))
                    for one in md.launch_grids(qs[0][:, b * tokens:(b + 1) * tokens], caches[0][start:], keys,
                                               a.kv_lora, a.scale, config=cfg)]))
            if plan_call is not None:  # FlashInfer: planned once per decode forward, on the host, before the replay
                from verifybench.harness.engines import flashinfer

                d["plan_host_us"] = flashinfer.plan_host_us(plan_call)
            return d

        return fns, (lambda: check_requests(fn, alone, a, tokens, firsts, lengths, caches[0])), derive

    # whatever fails in an engine's setup or check (an engine of another release) skips its row in one line
    guarded = engines.engine_rows(backend.engine if engine else None, setup)
    return CaseSpec(name=name, params=params, mode="graph", setup=guarded, measure_kw={"device": device, **measure_kw})


def cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None = None,
          batch: tuple[int, ...] | None = None) -> list[CaseSpec]:
    """GPU: n in GPU_NS at GPU_CONTEXTS, the kernel (tuned and default config), the torch path and the engines'
    kernels, graph mode with cache rotation. CPU (preset tiny): the torch path in fp32, plus the interpreted kernels
    (ours and the engines') when TRITON_INTERPRET=1 was set before import. Each at every batch (B requests, default
    1; the command refuses B x n past FORWARD_ROWS_MAX, as in a verify forward, on the cases listed here)."""
    a = attn_shape(preset, tp)
    if tokens and max(tokens) > MAX_N:
        raise ValueError(f"--tokens: the MLA decode caches hold n = 1..{MAX_N} query tokens, got {max(tokens)}")
    batches = tuple(batch or (1,))
    if not cuda_available():
        if preset != "tiny":
            raise ValueError(f"preset {preset!r} needs a GPU (a 37 MB cache per layer at 32k); use 'tiny' on CPU")
        # --tokens and --context mean what they mean on a GPU; where the CPU profile picks a value, one line says so
        ns, interpreted_ns = tokens or CPU_NS, tokens or CPU_INTERPRETED_NS
        contexts = CPU_CONTEXTS if context == presets.CPU_CONTEXT else (context,)
        if contexts != (context,):
            say_once(f"mla_decode on CPU: context {', '.join(map(str, contexts))} in place of the profile's "
                     f"{context} (enough keys for the split kernel to split; --context N runs N)")
        interpreted = tuple(min(c, CPU_INTERPRETED_CONTEXT_MAX) for c in contexts)
        if INTERPRET and interpreted != contexts:
            say_once(f"mla_decode on CPU: the interpreted kernels at context {CPU_INTERPRETED_CONTEXT_MAX} in place "
                     f"of {', '.join(map(str, contexts))} (the Triton interpreter's time); the torch path at "
                     f"{', '.join(map(str, contexts))}")
        rotation = {"calls_per_sample": CPU_COPIES}  # a sample is one pass over the caches
        out = [make_case(a, n, c, "torch", "cpu", rotation, preset, tp, b) for c in contexts for b in batches
               for n in ns]
        if INTERPRET:
            out += [make_case(a, n, c, impl, "cpu", {}, preset, tp, b) for impl in ("triton", *ENGINE_IMPLS)
                    for c in interpreted for b in batches for n in interpreted_ns]
        return out
    return [make_case(a, n, c, impl, "cuda", {"max_time_s": 0.5}, preset, tp, b)
            for c in sorted({context, *GPU_CONTEXTS}) for b in batches for n in tokens or GPU_NS
            for impl in (*IMPLS, *ENGINE_IMPLS)]


# ---------------------------------------------------------------------------------------------------- tables

def config_str(cfg: dict | None) -> str:
    if not cfg:
        return ""
    return (f"s{cfg['num_splits']} {cfg['block_rows']}x{cfg['block_keys']} w{cfg['num_warps']} "
            f"st{cfg['num_stages']}")


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """Per case (us, GB/s, eta) and per (context, n) the tuned kernel beside the default config, the torch path and
    SGLang's kernel (its median, and ours / its)."""
    ok, per_case = ceiling.streaming_case_rows(records, "mla/")

    def fill(row: dict, r: dict, us: float) -> None:
        prm, d = r["params"], r["derived"]
        if prm["impl"] == "triton":
            row.update({"triton_us": us, "triton_eta": d["eta"], "config": config_str(d.get("config")),
                        "config_source": d.get("config_source"), "programs": d.get("programs")})
        elif prm["impl"] == "triton-default":
            row["default_us"] = us
        elif prm["impl"] in ENGINE_IMPLS:  # "<engine>_us" (and its host-side plan), as declared
            engine = backends.for_row(NAME, prm["impl"]).engine
            row[f"{engine}_us"] = us
            row.setdefault("engine", prm["engine"])
            if "plan_host_us" in d:
                row[f"{engine}_plan_host_us"] = d["plan_host_us"]
        else:
            row.update({"torch_us": us, "torch_eta": d["eta"]})

    several = len({batch_of(r) for r in ok}) > 1  # a B column where the run holds several
    side = side_by_side(
        records, ok, lambda p: (p["preset"], p["tp"], p["context"], p.get("batch", 1), p["tokens"]),
        lambda r: {"context": r["params"]["context"], **({"B": batch_of(r)} if several else {}),
                   "n": r["params"]["tokens"], "MB": r["derived"]["bytes_moved"] / 1e6,
                   "floor_us": r["derived"]["floor_us"]}, fill,
        (("speedup", "torch_us", "triton_us"),  # triton/<engine> < 1: ours is the faster
         *((f"triton/{e}", "triton_us", f"{e}_us") for e in ENGINES)),
        # a CPU copy ceiling says nothing about a GPU kernel's distance from its own, nor an interpreter of its speed
        lambda k: k.endswith("eta") or k in ("floor_us", "speedup") or k.startswith("triton/"))
    near = floors.table(ok, lambda r: {"context": r["params"]["context"], **({"B": batch_of(r)} if several else {}),
                                       "n": r["params"]["tokens"], "impl": r["params"]["impl"]})
    return [("MLA decode per case (" + (CPU_TIMING if cpu_numbers(records) else "graph mode") + ", caches rotated)",
             per_case),
            ("MLA decode: Triton (tuned / default config) vs the torch path and the engines' kernels", side),
            *([(floors.title("MLA decode, our kernel"), near)] if near else [])]


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    return []


def release() -> None:
    """Drop the cached KV-cache copies."""
    cache_copies.cache_clear()
    _HELD.clear()
