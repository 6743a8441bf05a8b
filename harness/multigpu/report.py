"""Root-cause reporting for the torchrun jobs: the exit codes, the one line that names why a rank ends the job, and
the exit itself (no teardown), ordered so that the launcher sees the faulty rank go first and names it.

A rank that fails only because a peer died or froze waits CULPRIT_FIRST_S before it exits, so the launcher sees the
faulty rank go first and names it as the root cause; a frozen peer on the same host is killed for that reason.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

from verifybench.harness.engine.exits import (EXIT_BAD_INPUT, EXIT_FAULT, EXIT_PEER_FAILED,  # noqa: E402
                                              EXIT_RANK_ERROR, EXIT_STUCK, EXIT_WAITED)
# a rank that fails because of a peer exits this long after the faulty one, so the launcher (torchrun polls its
# workers every 0.1 s by default) records the faulty rank first: its "Root Cause" is the first exit it observes
CULPRIT_FIRST_S = 2.0
PREFIX = "[allreduce]"


def process_state(pid: int) -> str | None:
    """The one-letter state of a local process from /proc (R, S, D, T stopped, t traced, Z zombie, X dead), or None
    when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _same_job(pid: int) -> bool:
    """Whether local process `pid` is a sibling worker of this one: same parent (the launcher) and command line."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open("/proc/self/cmdline", "rb") as f:
            mine = f.read()
    except (OSError, IndexError, ValueError):
        return False
    return ppid == os.getppid() and cmdline == mine


def log_prefix() -> str:
    """Message prefix with the wall-clock time, so a log shows when a failure happened and when the job ended."""
    return f"{PREFIX} {time.strftime('%H:%M:%S')}"


class RootCause:
    """How a rank tells its peers where it stands and ends the job naming the cause; mixed into the Watchdog, whose
    detection decides when. Needs `info`, `store`, `aborting`, `_abort_lock` and `_local_pid(rank)` from it."""

    def report(self, state: str, message: str = "") -> None:
        """Tell peers this rank is done or failed (they stop watching it, or abort with its message)."""
        try:
            self.store.set(f"status/{self.info.rank}", json.dumps({"state": state, "message": message}))
        except Exception:
            pass

    def peers_down(self, why: dict[int, str], context: str = "") -> None:
        """Exit because of the peers in `why` (rank -> what happened to it). One is the root cause (peer_down; a
        frozen one is killed). Several found gone at once cannot be ordered from here: once the launcher sees the
        first exit it terminates the other ranks, which then look just as gone, and naming the lowest rank would
        blame a healthy one. They are all named, and the launcher's root cause, which saw the first exit, decides."""
        if len(why) == 1:
            (rank, reason), = why.items()
            self.peer_down(rank, reason, context, kill=not reason.startswith("failed"))
            return
        listed = "; ".join(f"rank {r} {reason}" for r, reason in sorted(why.items()))
        self._abort(f"ranks {', '.join(map(str, sorted(why)))} ended together ({listed}): which one went first "
                    f"cannot be told from here, the launcher's root cause names it{context}", EXIT_PEER_FAILED)

    def peer_down(self, rank: int, why: str, context: str = "", kill: bool = False) -> None:
        """Exit because peer `rank` is the root cause. With `kill`, a process of this job on this host that is still
        there (frozen) is killed first, so the launcher sees it end: it only sees exits, and a stopped process
        would sit out its SIGTERM timeout (30 s) after this rank left, with this rank named."""
        pid = self._local_pid(rank)
        killed = ""
        if kill and pid and process_state(pid) not in (None, "Z", "X") and _same_job(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed = f"; killed its process {pid} so that the launcher sees it end first"
            except OSError as e:
                killed = f"; could not kill its process {pid} ({e.strerror})"
        self._abort(f"root cause: rank {rank} {why}{killed}{context}", EXIT_PEER_FAILED)

    def wait_for_abort(self) -> None:
        """Block for good when another thread of this process is already exiting for a reason it named."""
        if self.aborting.is_set():
            while True:
                time.sleep(3600)

    def _abort(self, message: str, code: int, dump_stack: bool = False, culprit_first: bool = True) -> None:
        """Say why, tell the peers, and exit `code`; with `culprit_first`, only CULPRIT_FIRST_S later (another rank
        is the cause: the launcher must see that one exit first)."""
        with self._abort_lock:  # the first to decide exits the process; a second caller waits for that
            if self.aborting.is_set():
                while True:
                    time.sleep(3600)
            self.aborting.set()
        sys.stderr.write(f"{log_prefix()} rank {self.info.rank}: ABORT (exit {code}): {message}\n")
        if dump_stack:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.report("aborted", message)
        if culprit_first:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            time.sleep(CULPRIT_FIRST_S)
        hard_exit(code)


def hard_exit(code: int) -> None:
    """Flush and leave without destructors: no process-group, NCCL or CUDA teardown that could hang."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
