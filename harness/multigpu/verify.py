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
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

from verifybench.harness.analysis.numbers import Parser, context_arg, positive_int, tokens_arg
from verifybench.harness.collectives.allreduce_results import measurement_from_dict
from verifybench.harness.collectives.backends import (DTYPE, ArOp, Comm, capture_graph, check_eager, check_graph,
                                                      expected_sum)
from verifybench.harness.measure.results import store, tables
from verifybench.harness.measure.timing.runner import Case
from verifybench.harness.measure.timing.timer import measure
from verifybench.harness.model.forward import VerifyForward
from verifybench.harness.model.presets import CONTEXT, CPU_CONTEXT
from verifybench.harness.multigpu.driver import Agreement, Job, Output, Rank, launch
from verifybench.harness.multigpu.verify_setup import (BACKEND_HELP, NO_HEAD, VARIANTS, build_forward,
                                                       make_allreduce_fn, make_plan)


REL_TOL = 1e-2  # bf16 paths; a real allreduce gives bit-identical streams (sums broadcast to all)
CONTROL_MIN_REL = 0.1  # without the allreduce the ranks' streams must differ by at least this, or the check is blind
DEFAULT_HANG_TIMEOUT_S = 120.0  # the first forward of each n compiles Triton kernels: allow for a cold cache
COMPONENT = "verify_dist"
# figures derived from the timed variants (differences and ratios): on CPU, timer noise, withheld in the table
DERIVED_COLUMNS = ("AR marginal(us)", "per AR(us)", "AR alone/op(us)", "no-AR+stand-ins(us)")


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


def run_backend(name: str, fwd: VerifyForward, xchg: TensorExchange, rank: Rank) -> tuple[list[dict], str | None]:
    """Check then time every n for one backend. Returns this rank's records, or the agreed setup error."""
    plan, comm, agree, guard = rank.plan, rank.comm, rank.agree, rank.guard
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
        rank.next_case()
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


# ---- the job: rank 0's cases, table and notes ----

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
    return cases, (store.withhold(rows, DERIVED_COLUMNS) if plan["device"] == "cpu" else rows)


def table_text(rows: list[dict], device: str) -> str:
    """The per-n table; on CPU through tables.render, which names the withheld columns once above the table instead
    of repeating "withheld: CPU numbers" in every cell."""
    return tables.render(rows) if device == "cpu" else tabulate(rows, headers="keys", floatfmt=".1f", stralign="right")


def notes(plan: dict, world_size: int) -> list[str]:
    """What a reader of the table must know: CPU numbers, ranks against TP, layers run, the stand-in."""
    p, out = plan, []
    if p["device"] == "cpu":
        out.append("NOTE: run on CPU: CPU numbers (gloo, perf_counter timing), not GPU numbers; the figures "
                   "derived from them (allreduce marginal, per allreduce, with stand-ins) are withheld.")
    if world_size < p["tp"]:
        out.append(f"NOTE: {world_size} ranks of a TP-{p['tp']} model: each rank holds the shapes one of "
                   f"{p['tp']} ranks holds, and the allreduce spans {world_size} ranks, not {p['tp']}.")
    elif world_size > p["tp"]:
        out.append(f"NOTE: {world_size} ranks, each with the shapes of a TP-{p['tp']} rank: the allreduce spans "
                   f"{world_size} ranks, more than a TP-{p['tp']} model has.")
    if world_size == 1:
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


class VerifyJob(Job):
    """The distributed verify: per backend and n, the cross-rank check, then the forward with and without its
    allreduce, and the allreduces alone, in graph mode."""

    component, file_prefix, log_tag = COMPONENT, COMPONENT, "[verify_dist]"
    refused = (ValueError, MemoryError)

    def __init__(self):
        self.fwd: VerifyForward | None = None
        self.xchg: TensorExchange | None = None

    def make_plan(self, args) -> dict:
        return make_plan(args)

    def prepare(self, rank: Rank, skipped: dict) -> dict:
        """This rank's forward (none when every backend is skipped), every kernel of every n compiled with no
        collective inside."""
        plan, device, cuda = rank.plan, rank.comm.device, rank.comm.device.type == "cuda"
        rank.guard.mark("build the forward")
        fwd = build_forward(plan, device.type, rank.info.rank) if set(plan["backends"]) - set(skipped) else None
        for n in plan["tokens"] if fwd else ():
            rank.guard.mark(f"compile n{n}")
            fwd.forward(n, VARIANTS["without-allreduce"])
            if cuda:
                torch.cuda.synchronize()
        self.fwd, self.xchg = fwd, TensorExchange(rank.store, rank.info)
        return {"allocated_gb": torch.cuda.memory_allocated(device) / 1e9 if cuda else None,
                "ops": getattr(getattr(fwd, "ops", None), "name", "torch") if fwd else None}  # fused kernels on GPU

    def run_backend(self, name: str, rank: Rank) -> tuple[list[dict], str | None]:
        return run_backend(name, self.fwd, self.xchg, rank)

    build_cases = staticmethod(build_cases)

    def extra(self, out: Output) -> dict:
        return {"table": out.rows, "notes": notes(out.plan, out.info.world_size), "ops": out.ranks[0]["ops"],
                "allreduce": ("disabled (--no-allreduce, debug)" if out.plan["no_allreduce"] else
                              "real: through the named backend across the ranks, inside the forward's CUDA graph"),
                "time_definition": "max over ranks of each rank's median; graph mode, one forward per replay; "
                                   "per AR = (full - without-allreduce) / (2 x layers)"}

    def report(self, out: Output, run: dict) -> None:
        p = out.plan
        for line in notes(p, out.info.world_size):
            print(line)
        ar = "NO allreduce (debug)" if p["no_allreduce"] else "real allreduce"
        print(f"\n# verify forward, {p['preset']} TP-{p['tp']} rank shapes on {out.info.world_size} ranks, "
              f"{p['layers_run']} layers, context {p['context']}, {out.ranks[0]['ops'] or 'no'} ops; {ar}, "
              f"2 per layer; time = max over ranks of the per-rank median, "
              f"{'cpu-loop (no CUDA graph)' if p['device'] == 'cpu' else 'graph mode'}, warm-up {p['warmup_calls']}, "
              f"samples {p['samples']}")
        print(table_text(out.rows, p["device"]), flush=True)


# ---- entry ----

def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="torchrun --nproc-per-node=N -m verifybench.harness.multigpu.verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="model preset (default kimi-k2.5; tiny when the forward runs on CPU, as with "
                   "gloo)")
    p.add_argument("--tp", type=positive_int, help="TP degree whose per-rank shapes each rank holds, whatever the number of "
                   "ranks (default 8; 1 on CPU)")
    p.add_argument("--context", type=context_arg, help=f"cached tokens per layer (default {CONTEXT}; {CPU_CONTEXT} on CPU)")
    p.add_argument("--layers", type=positive_int, help="layers to build (default: the preset's; when they do not fit, the job "
                   "refuses before building and names the --layers that fit)")
    p.add_argument("--tokens", type=tokens_arg, default=tokens_arg("1-8"),
                   help="token counts n, e.g. 1-8 or 1,2,4 (default 1-8)")
    p.add_argument("--allreduce", help="comma list of " + "; ".join(f"{k}: {v}" for k, v in BACKEND_HELP.items())
                   + " (default nccl with CUDA, gloo without)")
    p.add_argument("--warmup", type=positive_int, help="eager forwards before each capture (default 3 GPU, 2 CPU)")
    p.add_argument("--samples", type=positive_int, help="graph replays timed per variant and n (default 40 GPU, 5 CPU)")
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S,
                   help="seconds without progress before the job is ended, naming the stuck rank (default 120: "
                        "the first forward of each n may compile Triton kernels)")
    p.add_argument("--no-allreduce", action="store_true",
                   help="debug: the allreduce does nothing; the cross-rank check must then fail (and report no time)")
    p.add_argument("--out", type=Path, help=f"results folder (default ./{store.DEFAULT_OUT}/<machine>/)")
    p.add_argument("--name", help="results file name (default verify_dist-<UTC time>.json)")
    p.add_argument("--fault", help=argparse.SUPPRESS)  # exit-early:RANK[@CASE] | hang:RANK[@CASE] (tests)
    p.add_argument("--run-tag", help=argparse.SUPPRESS)  # lets tests find this job's processes
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # bad arguments (make_plan refuses them): every rank says so and exits 2, before any rendezvous
    return launch(VerifyJob(), args)


if __name__ == "__main__":
    sys.exit(main())
