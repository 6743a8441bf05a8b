"""Allreduce latency across ranks at verify sizes: nccl, pynccl, symm one/two-shot and gloo, in graph / eager /
isolated modes; an nccl-tests style table (the max over ranks of each rank's median) and a results JSON.

  torchrun --nproc-per-node=N -m verifybench.harness.multigpu.allreduce [--preset kimi-k2.5] [--backend ...] [--mode ...]
  python -m verifybench.harness.multigpu.allreduce --nccl-sweep --nproc-per-node=N   (one fresh torchrun per NCCL setting;
      --list shows the settings, --quick runs two)
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from tabulate import tabulate

from verifybench.harness.analysis.numbers import (Parser, batches_arg, finite_float, name_list, positive_int,
                                                  split_list, tokens_arg)
from verifybench.harness.collectives.allreduce_results import COMPONENT, ENGINE_MODE, MODES, build_cases, tables
from verifybench.harness.collectives.backends import (ALL_BACKENDS, BACKEND_HELP, ELEMENT_BYTES, GPU_BACKENDS, Comm,
                                                      check_eager, check_graph, count_wrong, expected_sum,
                                                      make_backend, prepare_for_timing, unavailable_reason)
from verifybench.harness.measure.results import store
from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from verifybench.harness.measure.results.store import DEFAULT_OUT
from verifybench.harness.measure.results.tables import render
from verifybench.harness.measure.timing.timer import measure
from verifybench.harness.model import presets
from verifybench.harness.multigpu.driver import Job, Output, Rank, launch

MODE_HELP = {"graph": "K ops captured in one CUDA graph, replay time / K (CPU: K calls in a loop)",
             "eager": "K ops back to back between two CUDA events, / K (host launch gaps show when the host is slower)",
             "isolated": "one op per sample after a device-side barrier across ranks (p50/p99)"}
# (warm-up calls, samples, isolated samples, K calls per graph/eager sample): fixed, identical on every rank
DEFAULT_COUNTS = {"cuda": (20, 100, 1000, 64), "cpu": (3, 10, 20, 4)}
DEFAULT_HANG_TIMEOUT_S = 30.0
# The file name's prefix names the kind of result: the one-rank `allreduce` component writes allreduce-<stamp>.json,
# this job allreduce_ranks-<stamp>.json; its stored component stays "allreduce", so baselines load and compare.
FILE_PREFIX = "allreduce_ranks"


# ---- sizes ----



def parse_bytes(text: str) -> int:
    """'14336', '14K', '1.5M' (K = 1024, an optional B) -> bytes; ValueError for anything else ('1_0', '1e3')."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)B?", text.strip().upper())
    if not m:
        raise ValueError(f"not a byte count: {text!r}")
    return int(float(m[1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(m[2], 1))


def plan_sizes(hidden: int, tokens: list[int], batches: list[int], extra: list[int],
               pow2: tuple[int, int] | None) -> list[tuple[int, str]]:
    """(size in bytes, where it comes from): hidden x tokens x batch x 2 bytes (bf16), extras, powers of two."""
    sizes: dict[int, str] = {}
    for b, t in itertools.product(batches, tokens):
        sizes.setdefault(hidden * t * b * ELEMENT_BYTES, f"{t} tok" + (f" x {b} req" if b > 1 else ""))
    for s in extra:
        sizes.setdefault(s, "extra")
    if pow2:
        s = 1 << max(4, math.ceil(math.log2(pow2[0])))
        while s <= pow2[1]:
            sizes.setdefault(s, "pow2")
            s <<= 1
    bad = [s for s in sizes if s % 16]
    if bad:
        raise ValueError(f"sizes must be multiples of 16 bytes (symm-mem alignment): {bad}")
    return sorted(sizes.items())


def check_arguments(args) -> list[str]:
    """Everything a rank would refuse after the rendezvous, refused before it (ValueError naming the option): the
    backends, modes, sizes, token and batch counts, the preset. Returns the backends asked for."""
    requested = name_list(args.backend, "--backend", ALL_BACKENDS) if args.backend else list(ALL_BACKENDS)
    gpu_only = [b for b in requested if b in GPU_BACKENDS] if args.backend else []
    if gpu_only and not torch.cuda.is_available():
        raise ValueError(f"--backend {','.join(gpu_only)} needs a CUDA GPU and this machine has none: use "
                         "--backend gloo")
    try:
        _make_plan(args, "cpu", requested)
    except (KeyError, IndexError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(f"--sizes/--pow2: cannot read {args.sizes or args.pow2!r} ({type(e).__name__})") from None
    return requested


def _comm_for(backend: str, comm: Comm) -> Comm:
    return replace(comm, device=torch.device("cpu")) if backend == "gloo" else comm


def _make_plan(args, device_type: str, requested: list[str]) -> dict:
    hidden = args.hidden or presets.get(args.preset).hidden  # TP does not divide the hidden size
    try:
        pow2 = tuple(parse_bytes(x) for x in args.pow2.split(":")) if args.pow2 else None
        extra = [parse_bytes(s) for s in split_list(args.sizes, "--sizes", "byte counts")] if args.sizes else []
    except ValueError:
        raise ValueError(f"--sizes / --pow2 take byte counts like 14336, 14K, 1M (--pow2 MIN:MAX), got "
                         f"{args.sizes or args.pow2!r}") from None
    if pow2 is not None and (len(pow2) != 2 or not 0 < pow2[0] <= pow2[1]):
        raise ValueError(f"--pow2 takes MIN:MAX with 0 < MIN <= MAX, got {args.pow2!r}")
    if any(s <= 0 for s in extra):
        raise ValueError(f"--sizes must be positive byte counts, got {args.sizes!r}")
    sizes = plan_sizes(hidden, sorted(args.tokens), sorted(args.batches), extra, pow2)
    warm, samples, iso, k = DEFAULT_COUNTS[device_type]
    modes = name_list(args.mode, "--mode", MODES) if args.mode else list(MODES)
    return {"sizes": sizes, "backends": requested, "modes": modes, "preset": args.preset, "tp": args.tp,
            "hidden": hidden, "warmup_calls": args.warmup or warm, "samples": args.samples or samples,
            "isolated_samples": args.isolated_samples or iso, "calls_per_sample": args.calls_per_sample or k}


def _run_backend(name: str, rank: Rank) -> tuple[list[dict], str | None]:
    """Check then time every size of one backend. Returns this rank's records, or the agreed setup error."""
    plan, guard, agree = rank.plan, rank.guard, rank.agree
    comm = _comm_for(name, rank.comm)
    guard.mark(f"{name}: setup")
    max_numel = max(size for size, _ in plan["sizes"]) // ELEMENT_BYTES
    try:
        make, error = make_backend(name, comm, max_numel), None
    except Exception as e:
        make, error = None, f"{type(e).__name__}: {e}"
    errors = agree.allgather(error)
    if any(errors):
        return [], "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    tiny = torch.zeros(1, device=comm.device)

    def barrier():  # device-side: later work on this stream waits for it; a returned collective is progress
        dist.all_reduce(tiny)
        guard.tick()

    records = []
    for size, origin in plan["sizes"]:
        rank.next_case()
        guard.mark(f"{name} {size}B: check")
        numel = size // ELEMENT_BYTES
        local = {"wrong_eager": None, "wrong_graph": None, "error": None}
        try:
            op, expected = make(numel), expected_sum(numel, comm.world_size, comm.device)
            local["wrong_eager"] = check_eager(op, comm, expected)
            if comm.device.type == "cuda" and "graph" in plan["modes"]:
                local["wrong_graph"] = check_graph(op, comm, expected)
        except Exception as e:
            local["error"] = f"{type(e).__name__}: {e}"
        checks = agree.allgather(local)
        rec = {"size_bytes": size, "origin": origin, "checks": checks, "modes": {}}
        failed = any(c["error"] or c["wrong_eager"] or c["wrong_graph"] for c in checks)
        for mode in plan["modes"]:
            guard.mark(f"{name} {size}B: {mode}")
            rec["modes"][mode] = None if failed else _time_mode(op, comm, mode, plan, barrier, expected, guard.tick)
        records.append(rec)
    return records, None


def _time_mode(op, comm, mode, plan, barrier, expected, tick=lambda: None) -> dict:
    """One mode's measurement. Each returned collective counts as progress for the watchdog, so its hang timeout
    bounds one collective, not a whole case (4000 isolated samples of gloo outlast 3 s): on CPU every call ticks
    (one clock read beside a host-timed call of ~100 us); on a GPU the isolated samples tick through their barrier
    and eager calls stay untouched, their host launch cost being part of what eager measures."""
    def run():
        op.run()
        tick()

    prepare_for_timing(op, comm)
    kw = {"mode": ENGINE_MODE[mode], "device": comm.device.type, "warmup_calls": plan["warmup_calls"],
          "samples": plan["isolated_samples"] if mode == "isolated" else plan["samples"]}
    if mode in ("graph", "eager"):
        kw["calls_per_sample"] = plan["calls_per_sample"]
    if mode == "isolated":
        kw["barrier"] = barrier
    m = measure(run if comm.device.type == "cpu" else op.run, **kw)
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    wrong_after = None if op.in_place else count_wrong(op.out, expected)
    return {"measurement": m.as_dict(), "wrong_after": wrong_after}


NCCL_LOG_VARS = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV,GRAPH"}


def _enable_nccl_log() -> str | None:
    """NCCL's init log into a private folder (parsed for the transport it chose) unless the user set NCCL_DEBUG."""
    if "NCCL_DEBUG" in os.environ or "NCCL_DEBUG_SUBSYS" in os.environ:
        return None
    folder = tempfile.mkdtemp(prefix="verifybench-nccl-")
    os.environ.update({**NCCL_LOG_VARS, "NCCL_DEBUG_FILE": f"{folder}/nccl.%h.%p.log"})
    return folder


class AllreduceJob(Job):
    """The allreduce table: per backend, every size checked (nccl-tests' #wrong) then timed in each mode."""

    component, file_prefix, log_tag, empty_ok = COMPONENT, FILE_PREFIX, "[allreduce]", True

    def __init__(self):
        self.cuda = False
        self.nccl_log_dir: str | None = None
        self.nccl_log: dict | None = None

    def check(self, args) -> None:
        check_arguments(args)

    def make_plan(self, args) -> dict:
        requested = name_list(args.backend, "--backend", ALL_BACKENDS) if args.backend else list(ALL_BACKENDS)
        cuda = torch.cuda.is_available() and any(b in GPU_BACKENDS for b in requested)
        return _make_plan(args, "cuda" if cuda else "cpu", requested)

    def uses_cuda(self, plan: dict) -> bool:
        return torch.cuda.is_available() and any(b in GPU_BACKENDS for b in plan["backends"])

    def before_group(self, args, cuda: bool) -> None:
        self.cuda = cuda
        self.nccl_log_dir = _enable_nccl_log() if cuda and args.nccl_log else None

    def unavailable(self, backend: str, comm: Comm) -> str | None:
        return unavailable_reason(backend, _comm_for(backend, comm))

    def run_backend(self, name: str, rank: Rank) -> tuple[list[dict], str | None]:
        return _run_backend(name, rank)

    def build_cases(self, backend, per_rank, plan, world_size):
        return build_cases(backend, per_rank, plan, world_size), []  # its tables are read from the cases

    def extra(self, out: Output) -> dict:
        return {"preset": out.plan["preset"], "tp": out.plan["tp"], "hidden": out.plan["hidden"],
                "label": out.args.label, "device": "cuda" if self.cuda else "cpu", "nccl_log": self.nccl_log,
                "time_definition": "max over ranks of each rank's median; graph and eager: one sample = K ops / K"}

    def closing(self, out: Output) -> None:
        """NCCL's log read back; the variables this run set for itself (that log) kept out of the fingerprint, so
        that compare's NCCL_* diff shows only the user's configuration."""
        if self.nccl_log_dir:
            from verifybench.harness.multigpu.sweep import parse_nccl_logs

            self.nccl_log = parse_nccl_logs(Path(self.nccl_log_dir))
            for key in (*NCCL_LOG_VARS, "NCCL_DEBUG_FILE"):
                out.fp["env"].pop(key, None)

    def report(self, out: Output, run: dict) -> None:
        world, plan = out.info.world_size, out.plan
        if not self.cuda:
            print("NOTE: run on CPU: CPU numbers (gloo, perf_counter timing), not GPU numbers.")
        if world == 1:
            print("NOTE: one rank: each op has no peer (busbw 0). Multi-GPU: torchrun --nproc-per-node=N -m "
                  "verifybench.harness.multigpu.allreduce")
        print(f"\n# allreduce, {world} ranks on {out.info.nnodes} node(s), bf16 sum; time = max over ranks of the "
              f"per-rank median; K={plan['calls_per_sample']} ops per graph/eager sample, warm-up "
              f"{plan['warmup_calls']}, samples {plan['samples']} (isolated {plan['isolated_samples']})")
        for title, rows in tables(run["cases"]):
            if rows:
                # CPU-timed rows (gloo): through tables.render, which names a withheld column once above the table
                withheld = any(store.WITHHELD in row.values() for row in rows)
                print(f"\n{title}\n" + (render(rows) if withheld else
                                         tabulate(rows, headers="keys", floatfmt=".2f", stralign="right")))
        if self.nccl_log and self.nccl_log.get("transports"):
            print(f"NCCL transport (rank 0): {self.nccl_log['transports']}")


# ---- entry ----

def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m verifybench.harness.multigpu.allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kimi-k2.5", help="model preset whose hidden size sets the sizes")
    p.add_argument("--tp", type=positive_int, default=8, help="TP degree for the preset (the hidden size does not change)")
    p.add_argument("--hidden", type=positive_int, help="hidden size, overriding the preset's")
    p.add_argument("--tokens", type=tokens_arg, default=tokens_arg("1-8"),
                   help="token counts, e.g. 1-8 or 1,2,4 (default 1-8)")
    p.add_argument("--batches", type=batches_arg, default=(1,),
                   help="batch sizes multiplying the token counts, e.g. 1,4 (default 1)")
    p.add_argument("--sizes", help="extra sizes in bytes, comma-separated (K/M suffixes, multiples of 16)")
    p.add_argument("--pow2", metavar="MIN:MAX", help="add a power-of-two sweep, e.g. 1K:64M")
    p.add_argument("--backend", help="comma list of " + "; ".join(f"{k}: {v}" for k, v in BACKEND_HELP.items())
                   + " (default: all that run here)")
    p.add_argument("--mode", help="comma list of " + "; ".join(f"{k}: {v}" for k, v in MODE_HELP.items())
                   + " (default: all)")
    p.add_argument("--warmup", type=positive_int, help="warm-up calls per case (default 20 GPU, 3 CPU)")
    p.add_argument("--samples", type=positive_int, help="samples per case in graph and eager modes (default 100 GPU, 10 CPU)")
    p.add_argument("--isolated-samples", type=positive_int, help="samples in isolated mode (default 1000 GPU, 20 CPU)")
    p.add_argument("--calls-per-sample", type=positive_int, help="K: ops per sample in graph (one replay) and eager "
                   "(back to back) modes (default 64 GPU, 4 CPU)")
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S,
                   help="seconds without progress before the job is ended, naming the stuck rank (default 30)")
    p.add_argument("--no-nccl-log", dest="nccl_log", action="store_false",
                   help="do not record NCCL's init log (transport) when NCCL_DEBUG is unset")
    p.add_argument("--out", type=Path, help=f"results folder (default ./{DEFAULT_OUT}/<machine>/)")
    p.add_argument("--name", help="results file name (default allreduce_ranks-<UTC time>.json)")
    sweep = p.add_argument_group("NCCL setting sweep (driver mode, run without torchrun)")
    sweep.add_argument("--nccl-sweep", action="store_true", help="run every setting in its own torchrun, rank them "
                       "at verify sizes, run the best of each group combined, print the winner as export lines")
    sweep.add_argument("--list", action="store_true", help="print the sweep's settings and exit")
    sweep.add_argument("--quick", action="store_true", help="two settings (default and one protocol x algorithm): "
                       "checks the sweep's plumbing, e.g. on CPU, where gloo ignores every NCCL variable")
    sweep.add_argument("--setting", action="append", help="KEY=VAL[,KEY=VAL...] or 'default'; repeatable "
                       "(default: the built-in list, see --list)")
    sweep.add_argument("--nproc-per-node", type=positive_int, help="ranks per setting (default: GPUs here, or 2)")
    sweep.add_argument("--setting-timeout", type=finite_float(0, exclusive=True), default=180, help="seconds per setting (default 180)")
    sweep.add_argument("--sweep-time-limit", type=finite_float(0, exclusive=True), help="total seconds for the sweep (default 1800): a "
                       "setting that might not finish inside it is skipped, and the summary is still written")
    sweep.add_argument("--torchrun-args", default="", help="extra torchrun arguments, e.g. rendezvous options")
    p.add_argument("--label", help=argparse.SUPPRESS)  # sweep setting this rank runs under
    p.add_argument("--fault", help=argparse.SUPPRESS)  # exit-early:RANK[@CASE] | hang:RANK[@CASE] (tests)
    p.add_argument("--run-tag", help=argparse.SUPPRESS)  # lets tests find this job's processes
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nccl_sweep or args.list:  # the driver leaves its environment as launched: it is what export lines read
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            print("error: --nccl-sweep is the driver: run it with plain python, it starts torchrun per setting",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        if not args.list:  # what every setting's job would refuse, refused once
            try:
                check_arguments(args)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return EXIT_BAD_INPUT
        from verifybench.harness.multigpu.sweep import run_sweep

        try:
            return run_sweep(args)
        except KeyboardInterrupt:
            print(flush=True)  # the progress line stops mid-way
            print("interrupted: the setting's torchrun is ended; the summary is written only by a whole sweep, the "
                  "finished settings' results stay in its folder", file=sys.stderr)
            return EXIT_INTERRUPTED
    return launch(AllreduceJob(), args)


if __name__ == "__main__":
    sys.exit(main())
