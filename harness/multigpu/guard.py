"""The frame of every torchrun job (allreduce, verify): the checks before the rendezvous, the process group, and
the rank's main around the watchdog; and the fault injection the failure-path tests use.

Ranks never tear down their process groups: they flush and `os._exit`, because teardown is where jobs hang.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from verifybench.harness.multigpu.ranks import RankInfo, announce_safe_env, open_store, rank_info
from verifybench.harness.multigpu.report import (EXIT_BAD_INPUT, EXIT_FAULT, EXIT_RANK_ERROR, hard_exit,
                                                 log_prefix)
from verifybench.harness.multigpu.watchdog import Watchdog, check_hang_timeout

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
        from verifybench.harness.engine.results import check_writable

        check_writable(args.out)  # ResultsError, a ValueError


def start_ranks(run_rank, args, store_timeout_s: float, check, refused=(ValueError,)) -> int:
    """A torchrun job's entry, on every rank: multicast off (announce_safe_env), `check(args)` before any rendezvous
    (a `refused` exception: its line on stderr, EXIT_BAD_INPUT on every rank), then rank_main."""
    announce_safe_env()
    try:
        check(args)
    except refused as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    rank_main(run_rank, args, store_timeout_s)
    return 0


def rank_main(run_rank, args, store_timeout_s: float) -> None:
    """A torchrun worker (or a lone process) around `run_rank(args, info, store, guard) -> exit code`: the watchdog
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

    store = open_store(info, store_timeout_s, host_it=info.rank == 0 and not info.agent_store)
    guard = Watchdog(info, args.hang_timeout).start()
    try:
        code = run_rank(args, info, store, guard)
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
