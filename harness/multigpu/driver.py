"""The one driver of the torchrun jobs (the allreduce table, the distributed verify): launch, who each rank is, the
store and the agreement through it, the process group, the loop over backends, and rank 0's results file and report.

A job declares what it times (a Job: its plan, its per-backend run, its cases and tables); everything else is here,
as nccl-tests' common.cu is for its collectives. The watchdog and the exit that names a root cause: watchdog.py.
Ranks never tear down their process groups: they flush and `os._exit`, because teardown is where jobs hang.
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from verifybench.harness.collectives.backends import Comm, backend_versions, unavailable_reason
from verifybench.harness.measure.host import fingerprint
from verifybench.harness.measure.results import store
from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_FAULT, EXIT_OK, EXIT_RANK_ERROR
from verifybench.harness.measure.timing.runner import Case
from verifybench.harness.multigpu import watchdog
from verifybench.harness.multigpu.watchdog import Watchdog, check_hang_timeout, hard_exit, log_prefix

STORE_TIMEOUT_S = 600  # blocking store reads; the watchdog ends a real hang long before


# ---- who a rank is, and how the ranks talk outside any device collective ----

# Multicast (NVLS, multimem) stays off on our H200s; every rank and child process gets these.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def force_safe_env(env: dict | None = None) -> dict:
    """Set SAFE_ENV in `env` (default os.environ), overriding other values; returns the overridden {key: old}."""
    env = os.environ if env is None else env
    changed = {k: env[k] for k, v in SAFE_ENV.items() if k in env and env[k] != v}
    env.update(SAFE_ENV)
    return changed


@dataclass(frozen=True)
class RankInfo:
    """Who this process is. `agent_store`: torchrun's agent hosts the store, so it outlives every rank."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool
    run_id: str
    host: str

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_info() -> RankInfo:
    """From torchrun's environment; without it (plain `python -m`), a single rank with a private store."""
    env = os.environ
    if "RANK" not in env:
        return RankInfo(0, 1, 0, 1, "127.0.0.1", _free_port(), False, uuid.uuid4().hex[:12], socket.gethostname())
    run_id = f"{env.get('TORCHELASTIC_RUN_ID', 'run')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return RankInfo(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env["MASTER_PORT"]),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        run_id=run_id,
        host=socket.gethostname(),
    )


def open_store(info: RankInfo, timeout_s: float, host_it: bool = False) -> dist.Store:
    """A store connection namespaced by run. `host_it`: this process serves the store (rank 0 without an agent)."""
    store = dist.TCPStore(info.master_addr, info.master_port, info.world_size if host_it else None, host_it,
                          timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"verifybench/{info.run_id}/", store)


class Agreement:
    """All-gather / broadcast of JSON values through the store: backend-agnostic, and never a device collective.

    Every rank must call the same methods in the same order (keys are numbered by call).
    """

    def __init__(self, store: dist.Store, info: RankInfo):
        self.store, self.info, self.calls = store, info, 0

    def _key(self, rank: int) -> str:
        return f"agree/{self.calls}/{rank}"

    def allgather(self, value) -> list:
        self.calls += 1
        self.store.set(self._key(self.info.rank), json.dumps(value))
        return [json.loads(self.store.get(self._key(r))) for r in range(self.info.world_size)]

    def gather(self, value, root: int = 0) -> list | None:
        self.calls += 1
        self.store.set(self._key(self.info.rank), json.dumps(value))
        if self.info.rank != root:
            return None
        return [json.loads(self.store.get(self._key(r))) for r in range(self.info.world_size)]

    def broadcast(self, value, root: int = 0):
        self.calls += 1
        if self.info.rank == root:
            self.store.set(self._key(root), json.dumps(value))
            return value
        return json.loads(self.store.get(self._key(root)))


def announce_safe_env() -> None:
    """force_safe_env() for this process, saying on stderr what it overrode."""
    overridden = force_safe_env()
    if overridden:
        forced = ", ".join(f"{k}={SAFE_ENV[k]} (was {v!r})" for k, v in overridden.items())
        print(f"{log_prefix()} forced {forced}: multicast stays off", file=sys.stderr)


# ---- what a job declares ----

class Job:
    """A torchrun job: what it plans, checks and times per backend, and how its records become cases and tables.
    One instance per process; rank 0's also shapes the results file (`extra`) and prints the report (`report`)."""

    component = ""  # the stored component
    file_prefix = ""  # the results file is <file_prefix>-<UTC stamp>.json unless --name says otherwise
    log_tag = "[allreduce]"  # starts every line a rank writes on stderr
    empty_ok = False  # whether a run that measured nothing (every backend skipped) exits 0
    refused: tuple = (ValueError,)  # what check() may raise for a bad argument (exit 2 before any rendezvous)

    def check(self, args) -> None:
        """Refuse a bad argument before the rendezvous (every rank says so and exits 2)."""
        self.make_plan(args)

    def make_plan(self, args) -> dict:
        """Everything every rank must agree on; rank 0's is broadcast. Must hold "backends"."""
        raise NotImplementedError

    def uses_cuda(self, plan: dict) -> bool:
        return plan["device"] == "cuda"

    def before_group(self, args, cuda: bool) -> None:
        """What must be set before the process group starts (NCCL reads its environment then)."""

    def unavailable(self, backend: str, comm: Comm) -> str | None:
        return unavailable_reason(backend, comm)

    def prepare(self, rank: "Rank", skipped: dict) -> dict:
        """Build and warm what every backend shares; returns facts about this rank for the results file."""
        return {}

    def run_backend(self, name: str, rank: "Rank") -> tuple[list[dict], str | None]:
        """Check then time one backend: this rank's records, or the agreed setup error."""
        raise NotImplementedError

    def build_cases(self, backend: str, per_rank: list[list[dict]], plan: dict,
                    world_size: int) -> tuple[list[Case], list[dict]]:
        """Rank 0: one backend's records of every rank -> its cases and table rows."""
        raise NotImplementedError

    def extra(self, out: "Output") -> dict:
        """The job's own fields in the results file."""
        return {}

    def closing(self, out: "Output") -> None:
        """Rank 0, before the final save."""

    def report(self, out: "Output", run: dict) -> None:
        """Rank 0: the notes and tables, printed before the skipped backends, failed checks and file name."""


@dataclass
class Rank:
    """What a job's run_backend gets: this rank, its communicator, the agreed plan, the agreement and the watchdog."""

    info: RankInfo
    comm: Comm
    plan: dict
    agree: Agreement
    guard: Watchdog
    store: dist.Store
    fault: tuple[str, int, int] | None
    cases: itertools.count

    def next_case(self) -> None:
        """A new case (a size, a token count): where --fault strikes in the failure-path tests."""
        maybe_fault(self.fault, self.info.rank, next(self.cases))


def run_job(job: Job, args, info: RankInfo, store: dist.Store, guard: Watchdog) -> int:
    """Everything one rank does; rank 0 also prints and saves. Returns the exit code."""
    agree = Agreement(store, info)
    plan = agree.broadcast(job.make_plan(args) if info.rank == 0 else None)  # rank 0's word on every count
    cuda = job.uses_cuda(plan)
    job.before_group(args, cuda)
    device = init_group(info, store, cuda, args.hang_timeout, guard)
    comm = Comm(info.rank, info.world_size, info.local_world_size, device, store)
    skipped: dict[str, str] = {}
    for r, reasons in enumerate(agree.allgather({b: job.unavailable(b, comm) for b in plan["backends"]})):
        for b, reason in reasons.items():
            if reason:
                skipped.setdefault(b, f"rank {r}: {reason}")
    rank = Rank(info, comm, plan, agree, guard, store, parse_fault(args.fault), itertools.count())
    facts = job.prepare(rank, skipped)
    ranks = agree.allgather({"host": info.host, "local_rank": info.local_rank, "pid": os.getpid(),
                             "device": torch.cuda.get_device_name(device) if cuda else "cpu", **facts})
    out = Output(job, args, info, plan, ranks) if info.rank == 0 else None
    for name in plan["backends"]:
        if name in skipped:
            continue
        records, error = job.run_backend(name, rank)
        if error:
            skipped[name] = error
        gathered = agree.gather(records)
        guard.mark(f"{name}: save")  # on every rank: the watchdog compares step numbers across ranks
        if out:
            out.add(name, gathered, skipped, backend_versions(comm))  # the versions as they stand after it ran
    guard.mark("finish")
    if out:
        out.finish(skipped)
        return EXIT_OK if out.all_ok else EXIT_FAILED
    return EXIT_OK


# ---- rank 0's results file and report ----

class Output:
    """Rank 0's results file, re-saved after each backend so a later crash keeps the earlier numbers; the report."""

    def __init__(self, job: Job, args, info: RankInfo, plan: dict, ranks: list[dict]):
        self.job, self.args, self.info, self.plan, self.ranks = job, args, info, plan, ranks
        self.cases: list[Case] = []
        self.rows: list[dict] = []
        self.versions: dict = {}
        self.fp = fingerprint.collect()
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.name = args.name or f"{job.file_prefix}-{stamp}.json"
        self.path: Path | None = None

    def add(self, backend: str, per_rank: list[list[dict]], skipped: dict, versions: dict) -> None:
        self.versions = versions
        if per_rank and per_rank[0]:
            cases, rows = self.job.build_cases(backend, per_rank, self.plan, self.info.world_size)
            self.cases += cases
            self.rows += rows
        self.save(skipped, complete=False)

    @property
    def all_ok(self) -> bool:
        return (bool(self.cases) or self.job.empty_ok) and all(c.check_ok for c in self.cases)

    def save(self, skipped: dict, complete: bool) -> dict:
        i = self.info
        extra = {"world_size": i.world_size, "local_world_size": i.local_world_size, "nnodes": i.nnodes,
                 "plan": self.plan, "skipped": skipped, "versions": self.versions, "complete": complete,
                 "ranks": self.ranks, **self.job.extra(self)}
        run = store.make_run(self.job.component, self.cases, self.fp, extra)
        self.path = store.save_run(run, self.args.out, self.name, update=self.path)
        return run

    def finish(self, skipped: dict) -> None:
        self.job.closing(self)
        self.job.report(self, self.save(skipped, complete=True))
        for b, why in skipped.items():
            print(f"skipped {b}: {why}")
        failed = [c for c in self.cases if not c.check_ok]
        if failed:
            details = sorted({c.check_detail for c in failed if c.check_detail})
            print(f"FAILED checks (no time reported): {', '.join(c.name for c in failed)}"
                  + "".join(f"\n  {d}" for d in details))
        if fingerprint.throttled(self.fp):
            print("WARNING: a GPU reported throttling when the run started")
        print(f"saved {self.path}", flush=True)


# ---- launch: the checks before the rendezvous, the rank's main around the watchdog, the process group ----

def parse_fault(spec: str | None) -> tuple[str, int, int] | None:
    """'exit-early:RANK[@CASE]' or 'hang:RANK[@CASE]' -> (kind, rank, case index); for the failure-path tests."""
    if not spec:
        return None
    kind, _, where = spec.partition(":")
    rank, _, case = where.partition("@")
    if kind not in ("exit-early", "hang") or not rank.isdigit() or (case and not case.isdigit()):
        raise ValueError(f"bad --fault {spec!r}: expected exit-early:RANK[@CASE] or hang:RANK[@CASE]")
    return kind, int(rank), int(case or 0)


def maybe_fault(fault: tuple[str, int, int] | None, rank: int, case_index: int) -> None:
    if not fault or fault[1] != rank or fault[2] != case_index:
        return
    if fault[0] == "exit-early":
        print(f"{log_prefix()} rank {rank}: injected fault: exiting with code {EXIT_FAULT} at case {case_index}",
              file=sys.stderr, flush=True)
        os._exit(EXIT_FAULT)  # like a crash: no status report, no cleanup
    print(f"{log_prefix()} rank {rank}: injected fault: sleeping forever at case {case_index}", file=sys.stderr,
          flush=True)
    while True:
        time.sleep(3600)


def check_edge(args, info: RankInfo) -> None:
    """What every job checks before its rendezvous (ValueError naming the option): --hang-timeout, --fault, and on
    rank 0, which writes the results, that a given --out folder can be written (not only after the measuring). The
    counts are checked when the command line is parsed (analysis/numbers.py)."""
    args.hang_timeout = check_hang_timeout(args.hang_timeout)
    parse_fault(getattr(args, "fault", None))  # read after the rendezvous: a bad one would end every rank there
    if info.rank == 0 and getattr(args, "out", None) is not None:
        from verifybench.harness.measure.results.store import check_writable

        check_writable(args.out)  # ResultsError, a ValueError


def launch(job: Job, args) -> int:
    """A torchrun job's entry, on every rank: multicast off (announce_safe_env), `job.check(args)` before any
    rendezvous (a `job.refused` exception: its line on stderr, EXIT_BAD_INPUT on every rank), then rank_main."""
    watchdog.PREFIX = job.log_tag
    announce_safe_env()
    try:
        job.check(args)
    except job.refused as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    rank_main(job, args)
    return EXIT_OK


def rank_main(job: Job, args) -> None:
    """A torchrun worker (or a lone process) around run_job: the watchdog
    runs throughout, an exception is reported to the other ranks, and the process never returns: it exits without
    process-group teardown (where jobs hang). An exception that followed from a peer's death or freeze (a collective
    that lost its peer) names that peer as the root cause instead. Rank 0, when it serves the store, waits for the
    others' status. An argument check_edge refuses exits EXIT_BAD_INPUT before any rendezvous."""
    info = rank_info()
    try:
        check_edge(args, info)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        hard_exit(EXIT_BAD_INPUT)
    # ~0.8 s to import, now rather than at a rank's first summary, inside its loop and the watchdog's window
    import scipy.stats  # noqa: F401

    store = open_store(info, STORE_TIMEOUT_S, host_it=info.rank == 0 and not info.agent_store)
    guard = Watchdog(info, lambda timeout_s: open_store(info, timeout_s), args.hang_timeout).start()
    try:
        code = run_job(job, args, info, store, guard)
    except BaseException as e:
        guard.wait_for_abort()  # the watchdog already named the cause and is ending this process
        traceback.print_exc()
        culprits = guard.find_culprit(store) if isinstance(e, Exception) else None
        if culprits:
            guard.peers_down(culprits, f"; this rank's {type(e).__name__} followed from it")
        guard.report("error", f"{type(e).__name__}: {e} (on {info.host})")
        print(f"{log_prefix()} rank {info.rank}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        hard_exit(EXIT_RANK_ERROR)
    guard.stop()
    guard.report("done")
    if info.rank == 0 and not info.agent_store:  # this process serves the store: let the others finish with it
        deadline = time.monotonic() + args.hang_timeout
        while time.monotonic() < deadline and not store.check([f"status/{r}" for r in range(info.world_size)]):
            time.sleep(0.1)
    hard_exit(code)


def init_group(info: RankInfo, store: dist.Store, use_cuda: bool, hang_timeout_s: float,
               guard: Watchdog) -> torch.device:
    """This rank's device, and the default process group on the shared store (gloo for CPU tensors, NCCL for CUDA
    ones) with a timeout well past the watchdog's, which ends real hangs first."""
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    device = torch.device("cuda", info.local_rank) if use_cuda else torch.device("cpu")
    guard.mark("init process group")
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", store=dist.PrefixStore("pg/", store),
                            rank=info.rank, world_size=info.world_size,
                            timeout=timedelta(seconds=max(120.0, 4 * hang_timeout_s)),
                            device_id=device if use_cuda else None)
    return device
