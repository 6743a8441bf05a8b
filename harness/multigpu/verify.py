"""The synthetic verify forward on N ranks with a real allreduce: each rank runs one TP rank's forward of the preset
at --tp, and the two allreduces per layer go over the N ranks through the chosen backend, captured in the forward's
CUDA graph. Per token count n: a cross-rank check, then the full forward, the forward without its allreduce and the
allreduces alone, each timed in graph mode with counts fixed on every rank.

  torchrun --nproc-per-node=N -m verifybench.harness.multigpu.verify [--preset kimi-k2.5] [--tp 8] [--context 4096] [--layers L]
      [--tokens 1-8] [--allreduce nccl,pynccl,symm-one-shot,symm-two-shot | gloo] [--out DIR] [--hang-timeout S]

Shapes are those one of --tp ranks holds, whatever N is: N < TP means "N ranks of a TP-tp model" (the allreduce
then spans N GPUs, not tp). Weights are random and differ per rank, except those TP replicates (q_a/kv_a, router);
the inputs (h0 and every stand-in buffer) are identical on every rank, so with a real allreduce the residual stream
after every layer is identical on every rank, and without one it differs: that is the check (with the nccl-tests
pattern check of the allreduce itself).
Reported per n: time = max over ranks of each rank's median; allreduce marginal = full - without; per allreduce =
marginal / (2 x layers); beside it the device wait the one-GPU report stands in at that size (VERIFYBENCH_ALLREDUCE_US
or VERIFYBENCH_ALLREDUCE_FROM). A rank that dies or hangs ends the job non-zero within --hang-timeout, naming it.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import traceback
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from verifybench.harness.multigpu import report
from verifybench.harness.model.presets import default_scope
from verifybench.harness.engine import fingerprint, memory
from verifybench.harness.model import presets
from verifybench.harness.engine import results
from verifybench.harness.multigpu.allreduce import parse_int_list
from verifybench.harness.collectives.backends import (DTYPE, GPU_BACKENDS, ArOp, Comm, backend_versions,
                                        capture_graph, check_eager, check_graph, expected_sum, make_backend,
                                        unavailable_reason)
from verifybench.harness.collectives.allreduce_results import measurement_from_dict
from verifybench.harness.multigpu.guard import init_group, maybe_fault, parse_fault, rank_main
from verifybench.harness.multigpu.ranks import Agreement, announce_safe_env
from verifybench.harness.multigpu.watchdog import Watchdog
from verifybench.harness.engine.results import Case
from verifybench.harness.engine.timing import measure
from verifybench.harness.model import build
from verifybench.harness.model.forward import COMPONENTS, VerifyForward, allocated_bytes

COMPONENT = "verify_dist"
BACKENDS = (*GPU_BACKENDS, "gloo")
ALL = frozenset(COMPONENTS)
VARIANTS = {"full": ALL, "without-allreduce": ALL - {"allreduce"}, "only-allreduce": frozenset({"allreduce"})}
BACKEND_HELP = {  # how each reduces the forward's [n, hidden] bf16 tensors, which are not preallocated buffers
    "nccl": "torch.distributed.all_reduce in place on the NCCL process group",
    "pynccl": "raw ncclAllReduce through cupy.cuda.nccl, in place, on torch's current stream (as serving engines "
              "call it inside their graphs)",
    "symm-one-shot": "torch symmetric memory: the tensor copied into a symmetric buffer (inside the kernel where "
                     "torch has one_shot_all_reduce_copy_out), every rank loads all peers' over P2P into the tensor",
    "symm-two-shot": "torch symmetric memory: copy into a symmetric buffer, reduce-scatter + all-gather over P2P "
                     "loads into the tensor",
    "gloo": "torch.distributed.all_reduce on gloo: the forward runs on CPU (the smoke run)",
}
NO_HEAD = ALL - {"head"}  # the head's lm_head is a per-rank vocab shard: its argmax differs by design
# (warm-up calls, samples) per variant and n, identical on every rank; one forward per graph replay
DEFAULT_COUNTS = {"cuda": (3, 40), "cpu": (2, 5)}
REL_TOL = 1e-2  # bf16 paths; a real allreduce gives bit-identical streams (sums broadcast to all)
CONTROL_MIN_REL = 0.1  # without the allreduce the ranks' streams must differ by at least this, or the check is blind
STORE_TIMEOUT_S = 600  # blocking store reads; the watchdog ends a real hang long before
DEFAULT_HANG_TIMEOUT_S = 120.0  # the first forward of each n compiles Triton kernels: allow for a cold cache


# ---- the cross-rank check (pure: unit-tested) ----

def spread(tensors: list[torch.Tensor]) -> dict:
    """How far each rank's tensor is from rank 0's: max ||t_r - t_0|| / ||t_0|| (float64), bit identity, finiteness."""
    ref = tensors[0].double()
    denom = ref.norm().item()
    rel = [((t.double() - ref).norm().item() / denom) if denom else float("inf") for t in tensors[1:]]
    return {"max_rel_diff": max(rel, default=0.0), "bit_identical": all(torch.equal(t, tensors[0]) for t in tensors),
            "finite": all(bool(torch.isfinite(t.float()).all()) for t in tensors)}


def consistency_verdict(real: list, control: list | None = None, replayed: list | None = None,
                        tol: float = REL_TOL) -> tuple[bool, str]:
    """The residual stream after the last layer, one tensor per rank (None: that rank produced none).

    `real`: eager forward with the allreduce; `replayed`: the same captured in a CUDA graph and replayed; both must
    agree across ranks within `tol`. `control`: the forward without its allreduce, which must *differ* across
    ranks (else identical streams prove nothing: the weights would not be rank-dependent)."""
    ok, parts = True, []
    for what, ts in (("eager", real), ("graph replay", replayed)):
        if ts is None:
            continue
        missing = [r for r, t in enumerate(ts) if t is None]
        if missing:
            ok = False
            parts.append(f"{what}: rank(s) {missing} produced no residual stream")
            continue
        s = spread(ts)
        if not s["finite"]:
            ok = False
            parts.append(f"{what}: non-finite values in the residual stream")
        elif s["max_rel_diff"] > tol:
            ok = False
            parts.append(f"{what}: residual stream differs across ranks (max rel diff {s['max_rel_diff']:.2e} > "
                         f"{tol:g}): the allreduce did not reduce")
        elif len(ts) == 1:
            parts.append(f"{what}: one rank, nothing to compare")
        else:
            same = "bit-identical" if s["bit_identical"] else f"max rel diff {s['max_rel_diff']:.1e}"
            parts.append(f"{what}: residual stream {same} across {len(ts)} ranks")
    if control is not None and len(control) > 1:
        if any(t is None for t in control):
            ok = False
            parts.append("control: a rank produced no residual stream")
        else:
            c = spread(control)["max_rel_diff"]
            if c < CONTROL_MIN_REL:
                ok = False
                parts.append(f"control: ranks agree without the allreduce too (rel diff {c:.2e}): the check is blind")
            else:
                parts.append(f"without the allreduce they differ (rel diff {c:.2f})")
    return ok, "; ".join(parts)


# ---- the forward on this rank ----

def check_memory(plan: dict, device: str, sharers: int = 1) -> None:
    """MemoryError naming the bytes and the --layers that would fit, when this rank's forward does not fit its share
    of the free memory (engine/memory.py's rule): before building, not by dying of OOM halfway through. On a CPU the
    `sharers` ranks of a host share its memory; on GPUs each rank has its own."""
    s = presets.get(plan["preset"], plan["tp"], plan["layers"])

    def need(n_layers: int) -> int:
        return allocated_bytes(replace(s, layers=n_layers), plan["context"], max(plan["tokens"]))

    what = (f"one rank's {plan['preset']} TP{plan['tp']} forward at context {plan['context']}"
            + (f" on a host shared by {sharers} ranks" if sharers > 1 else ""))
    fit = memory.plan(need, s.layers, min(s.layers, s.dense_layers + 1), what, "layers", device,
                      free=memory.free_bytes(device) // sharers)
    if fit.units < s.layers:
        raise MemoryError(fit.skip or memory.shortfall(f"{what} ({s.layers} layers)", need(s.layers),
                                                       fit.free_bytes, device) + f": --layers {fit.units} fits")


def same_inputs(fwd: VerifyForward, seed: int = 0) -> None:
    """Redraw every per-n input and stand-in buffer identically on every rank: VerifyForward draws them from the
    global generator after the rank-seeded weights. Drawn on CPU (the same numbers on any GPU), then moved."""
    device, fwd.device = fwd.device, "cpu"
    torch.manual_seed(seed)
    try:
        bufs = {n: fwd._buffers(n) for n in fwd.buf}
    finally:
        fwd.device = device
    fwd.buf = {n: {k: v.to(device) for k, v in b.items()} for n, b in bufs.items()}


def replicate_weights(fwd: VerifyForward, seed: int = 0) -> None:
    """Make the weights TP replicates (fused q_a/kv_a projection, router) identical on every rank, as in a
    deployment: the ranks then route the same tokens to the same experts and do the same MoE work, so waits at
    the allreduce come from the allreduce, not from routing that differs per rank. The rest stays rank-seeded."""
    for i, L in enumerate(fwd.layers):
        for key in ("q_a_kv_a", "router"):
            if key in L:
                gen = torch.Generator(device=fwd.device).manual_seed(seed * 1000 + i)
                w = torch.randn(L[key].shape, generator=gen, device=fwd.device, dtype=L[key].dtype)
                L[key].copy_(w / L[key].shape[-1] ** 0.5)


def build_forward(plan: dict, device: str, rank: int) -> VerifyForward:
    """This rank's forward: the one-GPU report's MoE, tree verify and small-op set; rank-dependent weights except
    the replicated ones; inputs identical on every rank."""
    s = presets.get(plan["preset"], plan["tp"], plan["layers"])
    if device == "cuda":  # each rank its own GPU, now current; a CPU plan was checked before the rendezvous
        check_memory(plan, device)
    fwd = VerifyForward(s, plan["context"], device, build.moe_fn(device), None, build.chain_verify(device),
                        max_tokens=max(plan["tokens"]), seed=1 + rank, ops=build.forward_ops(device))
    replicate_weights(fwd)
    same_inputs(fwd)
    return fwd


# ---- allreduce_fn(t): in place over the N ranks, graph-capturable on CUDA ----

def make_allreduce_fn(name: str, comm: Comm, max_numel: int):
    """`fn(t)` sums a contiguous [n, hidden] bf16 tensor in place over every rank. Collective: every rank calls it."""
    if name in ("nccl", "gloo"):
        return lambda t: dist.all_reduce(t)
    if name == "pynccl":
        from cupy.cuda import nccl

        make = make_backend(name, comm, max_numel)  # the uid exchange and the communicator
        nc, bf16, op_sum = make.communicator, getattr(nccl, "NCCL_BFLOAT16", 9), nccl.NCCL_SUM

        def fn(t):  # in place; torch's current stream at call time (the capture stream inside torch.cuda.graph)
            nc.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), bf16, op_sum, torch.cuda.current_stream().cuda_stream)

        fn.keep = make
        return fn
    if name in ("symm-one-shot", "symm-two-shot"):
        from verifybench.harness.collectives.backends import _symm_group_name

        make = make_backend(name, comm, max_numel)  # the rendezvoused symmetric buffer
        buf, group, ops = make.buffer, _symm_group_name(), torch.ops.symm_mem
        if name == "symm-one-shot" and hasattr(ops, "one_shot_all_reduce_copy_out"):
            def fn(t):  # the kernel copies t into the buffer itself; each thread copies then writes the same
                flat = t.view(-1)  # elements, so the output may be t
                ops.one_shot_all_reduce_copy_out(buf[: flat.numel()], flat, "sum", group, flat)
        elif name == "symm-one-shot":
            def fn(t):
                flat = t.view(-1)
                sym = buf[: flat.numel()]
                sym.copy_(flat)
                ops.one_shot_all_reduce_out(sym, "sum", group, flat)
        else:
            def fn(t):  # copy in; reduce-scatter in the buffers, all-gather into t (or copy back)
                flat = t.view(-1)
                sym = buf[: flat.numel()]
                sym.copy_(flat)
                if hasattr(ops, "two_shot_all_reduce_out"):
                    ops.two_shot_all_reduce_out(sym, "sum", group, flat)
                else:
                    ops.two_shot_all_reduce_(sym, "sum", group)
                    flat.copy_(sym)

        fn.keep = make
        return fn
    raise ValueError(f"unknown backend {name!r}")


class TensorExchange:
    """All-gather of small bf16 tensors through the store (never a device collective, so a broken backend cannot
    hang the check). Every rank calls it the same number of times; None travels as an empty value."""

    def __init__(self, store: dist.Store, info):
        self.store, self.info, self.calls = store, info, 0

    def allgather(self, t: torch.Tensor | None, shape: tuple) -> list[torch.Tensor | None]:
        self.calls += 1
        key = f"vd/x/{self.calls}/"
        data = b"" if t is None else t.detach().to("cpu", DTYPE).contiguous().view(torch.int16).numpy().tobytes()
        self.store.set(key + str(self.info.rank), data)
        out = []
        for r in range(self.info.world_size):
            raw = self.store.get(key + str(r))
            ok = bool(raw) and len(raw) == 2 * torch.Size(shape).numel()
            out.append(torch.frombuffer(bytearray(raw), dtype=torch.int16).view(DTYPE).view(shape) if ok else None)
        return out


# ---- one backend on this rank ----

def _local_check(fwd: VerifyForward, n: int, fn, comm: Comm) -> tuple[dict, list]:
    """This rank's part of the check: the allreduce's own pattern check at [n, hidden] (eager, and captured and
    replayed on CUDA), and the residual stream of the forward eager, replayed (CUDA), and without its allreduce."""
    shape, cuda = (n, fwd.s.hidden), fwd.device == "cuda"
    local = {"wrong_eager": None, "wrong_graph": None, "error": None}
    streams: list = [None, None, None]  # eager, graph replay, control
    try:
        t = torch.empty(shape, dtype=DTYPE, device=fwd.device)
        op = ArOp("verify", t.view(-1), t.view(-1), lambda: fn(t))
        expected = expected_sum(t.numel(), comm.world_size, comm.device)
        local["wrong_eager"] = check_eager(op, comm, expected)
        if cuda:
            local["wrong_graph"] = check_graph(op, comm, expected)
        streams[0] = fwd.forward(n, NO_HEAD).clone()
        if cuda:
            out = torch.empty(shape, dtype=DTYPE, device=fwd.device)
            graph = capture_graph(lambda: out.copy_(fwd.forward(n, NO_HEAD)))
            graph.replay()
            torch.cuda.synchronize()
            streams[1] = out.clone()
            del graph
        streams[2] = fwd.forward(n, NO_HEAD - {"allreduce"}).clone()
    except Exception as e:  # reported as this n's failure; a peer stuck in a collective left here is the watchdog's
        traceback.print_exc()
        local["error"] = f"{type(e).__name__}: {e}"
    return local, streams


def check_n(fwd: VerifyForward, n: int, fn, comm: Comm, agree: Agreement, xchg: TensorExchange) -> tuple[bool, str]:
    """The verdict for n, computed by every rank from the same gathered data (so all ranks time, or none)."""
    local, streams = _local_check(fwd, n, fn, comm)
    shape = (n, fwd.s.hidden)
    checks = agree.allgather(local)
    real, replayed, control = (xchg.allgather(t, shape) for t in streams)
    errors = [f"rank {r}: {c['error']}" for r, c in enumerate(checks) if c["error"]]
    if errors:
        return False, "; ".join(errors)
    wrong = sum((c["wrong_eager"] or 0) + (c["wrong_graph"] or 0) for c in checks)
    graph_checked = checks[0]["wrong_graph"] is not None
    ok, detail = consistency_verdict(real, control, replayed if graph_checked else None)
    pattern = (f"allreduce #wrong {wrong} of {n * fwd.s.hidden} x {comm.world_size} ranks (eager"
               + (", graph replay x2)" if graph_checked else ")"))
    return ok and wrong == 0, f"{pattern}; {detail}"


def _time_variant(fwd: VerifyForward, n: int, variant: str, plan: dict) -> dict:
    """Graph mode, fixed counts: every rank replays the same number of times (collectives inside)."""
    b, saved = fwd.buf[n], None
    if variant == "only-allreduce":  # the static stand-in is reduced in place over and over: time it on zeros
        saved = b["attn_out"].clone()
        b["attn_out"].zero_()
    try:
        comps = VARIANTS[variant]
        m = measure(lambda: fwd.forward(n, comps), mode="graph", device=fwd.device,
                    warmup_calls=plan["warmup_calls"], samples=plan["samples"], calls_per_sample=1)
    finally:
        if saved is not None:
            b["attn_out"].copy_(saved)
    return m.as_dict()


def run_backend(name, fwd, plan, comm, agree, xchg, guard, fault, counter) -> tuple[list[dict], str | None]:
    """Check then time every n for one backend. Returns this rank's records, or the agreed setup error."""
    guard.mark(f"{name}: setup")
    try:
        fn, error = make_allreduce_fn(name, comm, max(plan["tokens"]) * fwd.s.hidden), None
    except Exception as e:
        fn, error = None, f"{type(e).__name__}: {e}"
    errors = agree.allgather(error)
    if any(errors):
        return [], "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    fwd.allreduce_fn = (lambda t: None) if plan["no_allreduce"] else fn
    records = []
    for n in plan["tokens"]:
        maybe_fault(fault, comm.rank, next(counter))
        guard.mark(f"{name} n{n}: check")
        ok, detail = check_n(fwd, n, fwd.allreduce_fn, comm, agree, xchg)
        rec = {"n": n, "ok": ok, "detail": detail, "variants": {}}
        if ok:
            for variant in VARIANTS:
                guard.mark(f"{name} n{n}: {variant}")
                agree.allgather(None)  # a host barrier: the ranks start each measurement together
                rec["variants"][variant] = _time_variant(fwd, n, variant, plan)
        records.append(rec)
    fwd.allreduce_fn = None
    return records, None


# ---- rank 0: cases, table, file ----

def build_cases(name: str, per_rank: list[list[dict]], plan: dict, world_size: int) -> tuple[list[Case], list[dict]]:
    """Per n and variant one Case: time = max over ranks of each rank's median, samples of that slowest rank.
    The allreduce figures go on the full forward's case and into the table row."""
    cases, rows = [], []
    n_ar = 2 * plan["layers_run"]
    for i, n in enumerate(plan["tokens"]):
        recs = [r[i] for r in per_rank]
        stand_in = plan["stand_in_by_n_us"][i]
        ok, detail = recs[0]["ok"], recs[0]["detail"]
        size = n * plan["hidden"] * 2
        row = {"n": n, "size(B)": size, "backend": name}
        base = {"preset": plan["preset"], "tp": plan["tp"], "world_size": world_size, "backend": name, "tokens": n,
                "context": plan["context"], "layers": plan["layers_run"]}
        if plan["no_allreduce"]:
            base["debug"] = "no-allreduce"
        if not ok:
            cases += [Case(f"{COMPONENT}/{name}/{v}/n{n}", {**base, "variant": v}, False, detail) for v in VARIANTS]
            rows.append({**row, "full(us)": "FAIL", "check": "FAIL"})
            continue
        meds = {v: [r["variants"][v]["summary"]["median_us"] for r in recs] for v in VARIANTS}
        t = {v: max(m) for v, m in meds.items()}
        marginal = t["full"] - t["without-allreduce"]
        ar = {"allreduces_per_forward": n_ar, "allreduce_bytes": size, "allreduce_marginal_us": marginal,
              "per_allreduce_marginal_us": marginal / n_ar, "per_allreduce_alone_us": t["only-allreduce"] / n_ar,
              "stand_in_us": stand_in, "stand_in_forward_us": t["without-allreduce"] + n_ar * stand_in}
        for v in VARIANTS:
            slowest = max(range(world_size), key=lambda r: meds[v][r])
            derived = {"time_us": t[v], "rank_medians_us": meds[v], "slowest_rank": slowest,
                       **(ar if v == "full" else {})}
            cases.append(Case(f"{COMPONENT}/{name}/{v}/n{n}", {**base, "variant": v}, True, detail,
                              measurement_from_dict(recs[slowest]["variants"][v]), derived))
        rows.append({**row, "full(us)": t["full"], "no-AR(us)": t["without-allreduce"], "AR marginal(us)": marginal,
                     "per AR(us)": marginal / n_ar, "AR alone/op(us)": t["only-allreduce"] / n_ar,
                     "stand-in(us)": stand_in, "no-AR+stand-ins(us)": ar["stand_in_forward_us"], "check": "ok"})
    return cases, rows


class Output:
    """Rank 0's results file, re-saved after each backend so a later crash keeps the earlier numbers."""

    def __init__(self, args, info, plan: dict, ranks: list[dict]):
        self.args, self.info, self.plan, self.ranks = args, info, plan, ranks
        self.cases: list[Case] = []
        self.rows: list[dict] = []
        self.versions: dict = {}
        self.fp = fingerprint.collect()
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.name = args.name or f"{COMPONENT}-{stamp}.json"
        self.path: Path | None = None

    def add(self, backend: str, per_rank: list[list[dict]], skipped: dict, versions: dict) -> None:
        self.versions = versions
        if per_rank and per_rank[0]:
            cases, rows = build_cases(backend, per_rank, self.plan, self.info.world_size)
            self.cases += cases
            self.rows += rows
        self.save(skipped, complete=False)

    @property
    def all_ok(self) -> bool:
        return bool(self.cases) and all(c.check_ok for c in self.cases)

    def notes(self) -> list[str]:
        p, i = self.plan, self.info
        out = []
        if p["device"] == "cpu":
            out.append("NOTE: run on CPU: CPU numbers (gloo, perf_counter timing), not GPU numbers.")
        if i.world_size < p["tp"]:
            out.append(f"NOTE: {i.world_size} ranks of a TP-{p['tp']} model: each rank holds the shapes one of "
                       f"{p['tp']} ranks holds, and the allreduce spans {i.world_size} ranks, not {p['tp']}.")
        elif i.world_size > p["tp"]:
            out.append(f"NOTE: {i.world_size} ranks, each with the shapes of a TP-{p['tp']} rank: the allreduce spans "
                       f"{i.world_size} ranks, more than a TP-{p['tp']} model has.")
        if i.world_size == 1:
            out.append("NOTE: one rank: the allreduce has no peer. Multi-GPU: torchrun --nproc-per-node=N -m "
                       "verifybench.harness.multigpu.verify")
        if p["layers_run"] != p["preset_layers"]:
            out.append(f"NOTE: {p['layers_run']} of the preset's {p['preset_layers']} layers, not scaled.")
        if p["no_allreduce"]:
            out.append("NOTE: --no-allreduce (debug): the allreduce is a no-op, the cross-rank check must fail.")
        per_n = "" if len(set(p["stand_in_by_n_us"])) == 1 else "; at each n's size in the table"
        out.append(f"stand-in: {p['stand_in_us']:g} us per allreduce in the one-GPU report ({p['stand_in_source']})"
                   + per_n)
        return out

    def save(self, skipped: dict, complete: bool) -> dict:
        i = self.info
        extra = {"world_size": i.world_size, "local_world_size": i.local_world_size, "nnodes": i.nnodes,
                 "plan": self.plan, "skipped": skipped, "versions": self.versions, "complete": complete,
                 "ranks": self.ranks, "table": self.rows, "notes": self.notes(), "ops": self.ranks[0]["ops"],
                 "allreduce": ("disabled (--no-allreduce, debug)" if self.plan["no_allreduce"] else
                               "real: through the named backend across the ranks, inside the forward's CUDA graph"),
                 "time_definition": "max over ranks of each rank's median; graph mode, one forward per replay; "
                                    "per AR = (full - without-allreduce) / (2 x layers)"}
        run = results.make_run(COMPONENT, self.cases, self.fp, extra)
        self.path = results.save_run(run, self.args.out, self.name)
        return run

    def finish(self, skipped: dict) -> None:
        from tabulate import tabulate

        self.save(skipped, complete=True)
        p = self.plan
        for line in self.notes():
            print(line)
        for b, why in skipped.items():
            print(f"skipped {b}: {why}")
        failed = [c.name for c in self.cases if not c.check_ok]
        if failed:
            details = {c.check_detail for c in self.cases if not c.check_ok}
            print(f"FAILED checks (no time reported): {', '.join(failed)}\n  " + "\n  ".join(sorted(details)))
        if fingerprint.throttled(self.fp):
            print("WARNING: a GPU reported throttling when the run started")
        print(f"saved {self.path}")
        ar = "NO allreduce (debug)" if p["no_allreduce"] else "real allreduce"
        print(f"\n# verify forward, {p['preset']} TP-{p['tp']} rank shapes on {self.info.world_size} ranks, "
              f"{p['layers_run']} layers, context {p['context']}, {self.ranks[0]['ops'] or 'no'} ops; {ar}, "
              f"2 per layer; time = max over ranks of the per-rank median, graph mode, warm-up {p['warmup_calls']}, "
              f"samples {p['samples']}")
        print(tabulate(self.rows, headers="keys", floatfmt=".1f", stralign="right"), flush=True)


# ---- one rank ----

def make_plan(args) -> dict:
    """Everything every rank must agree on; validated before any process group exists (same answer on every rank)."""
    cuda = torch.cuda.is_available()
    if args.context is not None and not 1 <= args.context <= 1 << 20:
        raise ValueError(f"--context must be in 1..{1 << 20} tokens, got {args.context}")
    backends = args.allreduce.split(",") if args.allreduce else ["nccl" if cuda else "gloo"]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown --allreduce {unknown}; choose from {', '.join(BACKENDS)}")
    if "gloo" in backends and len(backends) > 1:
        raise ValueError("gloo runs the forward on CPU: run it on its own, not with GPU backends")
    tokens = parse_int_list(args.tokens.replace("..", "-"))
    if not tokens or tokens[0] < 1:
        raise ValueError(f"--tokens needs counts >= 1, got {args.tokens!r}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers needs at least 1, got {args.layers}")
    device = "cuda" if cuda and backends != ["gloo"] else "cpu"
    default_preset, default_tp, default_context = default_scope(device == "cuda")  # CPU: the smoke profile's tiny
    preset = args.preset if args.preset is not None else default_preset
    tp = args.tp if args.tp is not None else default_tp
    context = args.context if args.context is not None else default_context
    s = presets.get(preset, tp, args.layers)  # raises on an unknown preset or a TP that does not divide
    warm, samples = DEFAULT_COUNTS[device]
    ar_us, ar_source = build.allreduce_stand_in_us()
    by_n = [build.allreduce_stand_in_us(n * s.hidden * 2)[0] for n in tokens]  # a measured figure: at each n's size
    plan = {"preset": preset, "tp": tp, "context": context, "layers": args.layers,
            "layers_run": s.layers, "preset_layers": presets.get(preset).layers, "hidden": s.hidden,
            "tokens": tokens, "backends": backends, "device": device, "warmup_calls": args.warmup or warm,
            "samples": args.samples or samples, "calls_per_sample": 1, "no_allreduce": args.no_allreduce,
            "stand_in_us": ar_us, "stand_in_source": ar_source, "stand_in_by_n_us": by_n, "variants": list(VARIANTS),
            "rank_bytes": allocated_bytes(s, context, max(tokens))}
    if device == "cpu":
        check_memory(plan, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return plan


def run_rank(args, info, store, guard: Watchdog) -> int:
    """Everything one rank does; rank 0 also prints and saves. Returns the exit code."""
    agree = Agreement(store, info)
    plan = agree.broadcast(make_plan(args) if info.rank == 0 else None)  # rank 0's word on every count
    cuda = plan["device"] == "cuda"
    device = init_group(info, store, cuda, args.hang_timeout, guard)
    comm = Comm(info.rank, info.world_size, info.local_world_size, device, store)
    skipped: dict[str, str] = {}
    for r, reasons in enumerate(agree.allgather({b: unavailable_reason(b, comm) for b in plan["backends"]})):
        for b, reason in reasons.items():
            if reason:
                skipped.setdefault(b, f"rank {r}: {reason}")
    guard.mark("build the forward")
    fwd = build_forward(plan, device.type, info.rank) if set(plan["backends"]) - set(skipped) else None
    me = {"host": info.host, "local_rank": info.local_rank, "pid": os.getpid(),
          "device": torch.cuda.get_device_name(device) if cuda else "cpu",
          "allocated_gb": torch.cuda.memory_allocated(device) / 1e9 if cuda else None,
          "ops": getattr(getattr(fwd, "ops", None), "name", "torch") if fwd else None}  # fused kernels on a GPU
    ranks = agree.allgather(me)
    out = Output(args, info, plan, ranks) if info.rank == 0 else None
    for n in plan["tokens"] if fwd else ():  # compile every kernel of every n with no collective inside
        guard.mark(f"compile n{n}")
        fwd.forward(n, VARIANTS["without-allreduce"])
        if cuda:
            torch.cuda.synchronize()
    xchg, fault, counter = TensorExchange(store, info), parse_fault(args.fault), itertools.count()
    for name in plan["backends"]:
        if name in skipped:
            continue
        records, error = run_backend(name, fwd, plan, comm, agree, xchg, guard, fault, counter)
        if error:
            skipped[name] = error
        gathered = agree.gather(records)
        guard.mark(f"{name}: save")  # on every rank: the watchdog compares step numbers across ranks
        if out:
            out.add(name, gathered, skipped, backend_versions(comm))
    guard.mark("finish")
    if out:
        out.finish(skipped)
        return 0 if out.all_ok else 1
    return 0


# ---- entry ----

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node=N -m verifybench.harness.multigpu.verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="model preset (default kimi-k2.5; tiny when the forward runs on CPU, as with "
                   "gloo)")
    p.add_argument("--tp", type=int, help="TP degree whose per-rank shapes each rank holds, whatever the number of "
                   "ranks (default 8; 1 on CPU)")
    p.add_argument("--context", type=int, help="cached tokens per layer (default 4096; 64 on CPU)")
    p.add_argument("--layers", type=int, help="layers to build (default: the preset's; when they do not fit, the job "
                   "refuses before building and names the --layers that fit)")
    p.add_argument("--tokens", default="1-8", help="token counts n, e.g. 1-8 or 1,2,4 (default 1-8)")
    p.add_argument("--allreduce", help="comma list of " + "; ".join(f"{k}: {v}" for k, v in BACKEND_HELP.items())
                   + " (default nccl with CUDA, gloo without)")
    p.add_argument("--warmup", type=int, help="eager forwards before each capture (default 3 GPU, 2 CPU)")
    p.add_argument("--samples", type=int, help="graph replays timed per variant and n (default 40 GPU, 5 CPU)")
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S,
                   help="seconds without progress before the job is ended, naming the stuck rank (default 120: "
                        "the first forward of each n may compile Triton kernels)")
    p.add_argument("--no-allreduce", action="store_true",
                   help="debug: the allreduce does nothing; the cross-rank check must then fail (and report no time)")
    p.add_argument("--out", type=Path, help=f"results folder (default ./{results.DEFAULT_OUT}/<machine>/)")
    p.add_argument("--name", help="results file name (default verify_dist-<UTC time>.json)")
    p.add_argument("--fault", help=argparse.SUPPRESS)  # exit-early:RANK[@CASE] | hang:RANK[@CASE] (tests)
    p.add_argument("--run-tag", help=argparse.SUPPRESS)  # lets tests find this job's processes
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report.PREFIX = "[verify_dist]"
    announce_safe_env()
    try:
        make_plan(args)  # bad arguments: every rank says so and exits 2, before any rendezvous
    except (ValueError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank_main(run_rank, args, STORE_TIMEOUT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
