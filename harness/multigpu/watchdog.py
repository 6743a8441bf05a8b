"""The watchdog of a torchrun rank and its report: heartbeat and progress in the store, read from every peer in a
daemon thread; the judgement that the job cannot finish (a peer died, froze or failed; a rank stopped making
progress); the one line that names why, and the exit itself (no teardown), ordered so that the launcher sees the
faulty rank go first and names it.

It runs on its own store connection in a daemon thread, so it keeps working while the main thread is blocked in a
collective, a CUDA synchronize or a graph replay (none of which a timeout in torch.distributed covers). A rank that
fails only because a peer died or froze waits CULPRIT_FIRST_S before it exits, so the launcher sees the faulty rank
go first and names it as the root cause; a frozen peer on the same host is killed for that reason.
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from verifybench.harness.measure.exits import (EXIT_BAD_INPUT, EXIT_FAULT, EXIT_PEER_FAILED,  # noqa: F401
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


HANG_TIMEOUT_RANGE_S = (1.0, 86400.0)  # below 1 s the heartbeat (0.5 s) cannot tell a slow step from a hang


def check_hang_timeout(value) -> float:
    """--hang-timeout as seconds, or ValueError naming it and the range (NaN would switch the watchdog off, a value
    <= 0 would end a healthy job at its first check)."""
    lo, hi = HANG_TIMEOUT_RANGE_S
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and lo <= seconds <= hi):
        raise ValueError(f"--hang-timeout must be a number of seconds in [{lo:g}, {hi:g}], got {value!r}")
    return seconds



class Watchdog(RootCause):
    """Heartbeat + progress per rank in the store; aborts this process when the job cannot finish.

    - a peer that reports an error, whose process is gone (same host: at once), or whose heartbeat stops for
      `dead_timeout_s`: exit EXIT_PEER_FAILED, CULPRIT_FIRST_S after naming it (peers gone at once are named
      together: see peers_down); a frozen peer on this host (its
      heartbeat stopped, its process still there, e.g. SIGSTOP) is killed first, since the launcher only sees exits
      and would otherwise wait out its own 30 s SIGTERM timeout on a process that cannot act on SIGTERM;
    - no progress on this rank for `hang_timeout_s` (marks come from the main thread via `mark`): the ranks with
      the oldest step are named as stuck; a stuck rank exits EXIT_STUCK at once (with its stack), the others
      EXIT_WAITED after CULPRIT_FIRST_S, so torchrun's "root cause" is the stuck rank when it can still exit.
    Worst case from a failure to every rank gone: min(dead_timeout_s, hang_timeout_s) + 1 s (the read period) +
    CULPRIT_FIRST_S + the launcher's teardown.
    """

    def __init__(self, info, connect, hang_timeout_s: float, dead_timeout_s: float | None = None,
                 period_s: float = 0.5):
        """`info`: the rank (driver.RankInfo); `connect(timeout_s)`: a store connection of the watchdog's own."""
        self.info = info
        self.hang_timeout_s = check_hang_timeout(hang_timeout_s)
        self.dead_timeout_s = dead_timeout_s or max(5.0, hang_timeout_s / 2)
        self.period_s = period_s
        self.store = connect(max(5.0, self.dead_timeout_s))
        self.seq, self.label = 0, "start"
        self.changed = time.monotonic()
        self.stopped = False
        self.aborting = threading.Event()  # set once this process has decided to exit for a reason it names
        self._abort_lock = threading.Lock()
        self.peers = [r for r in range(info.world_size) if r != info.rank]
        self.where: dict[int, dict] = {}  # rank -> its published progress (host, pid), as last read
        self.statuses: dict[int, dict] = {}  # rank -> its status once it reported one
        self.seen_beat: dict[int, tuple] = {}  # rank -> (last heartbeat value, when it changed)
        self._thread = threading.Thread(target=self._loop, name="allreduce-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._publish_progress()
        self._thread.start()
        return self

    def mark(self, label: str) -> None:
        """The main thread reached a new step (same sequence on every rank)."""
        self.seq += 1
        self.label = label
        self.changed = time.monotonic()

    def tick(self) -> None:
        """Progress inside a step (a collective returned): a long step (4000 isolated samples) is not a hang."""
        self.changed = time.monotonic()

    def stop(self) -> None:
        self.stopped = True

    def _publish_progress(self) -> None:
        self.store.set(f"progress/{self.info.rank}", json.dumps(
            {"seq": self.seq, "label": self.label, "host": self.info.host, "pid": os.getpid()}))

    def _get(self, key: str):
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _loop(self) -> None:
        start = last_ok = last_read = time.monotonic()
        beat, published_seq = 0, -1
        self.seen_beat = {r: (None, start) for r in self.peers}
        read_every_s = max(1.0, len(self.peers) / 16)  # every rank reads every peer: keep the store load O(N) per s
        while not self.stopped:
            time.sleep(self.period_s)
            if self.stopped or self.aborting.is_set():
                return
            now = time.monotonic()
            try:
                beat += 1
                self.store.set(f"hb/{self.info.rank}", str(beat))
                if self.seq != published_seq:
                    published_seq = self.seq
                    self._publish_progress()
                if now - last_read < read_every_s:
                    last_ok = now
                    continue
                last_read = now
                peers = {r: (self._get(f"hb/{r}"), self._get(f"status/{r}")) for r in self.peers}
                for r in self.peers:
                    if r not in self.where:
                        p = self._get(f"progress/{r}")
                        if p:
                            self.where[r] = p
                last_ok = now
            except Exception as e:
                if now - last_ok > self.dead_timeout_s:
                    self._abort(f"lost the rendezvous store {self.info.master_addr}:{self.info.master_port} for "
                                f"{now - last_ok:.0f} s ({type(e).__name__}); the launcher is gone", EXIT_PEER_FAILED,
                                culprit_first=False)
                continue
            try:
                self._judge(peers, now)
            except Exception as e:  # never let a malformed value end the watchdog silently
                sys.stderr.write(f"{log_prefix()} rank {self.info.rank}: watchdog: {type(e).__name__}: {e}\n")

    def _local_pid(self, rank: int) -> int | None:
        w = self.where.get(rank)
        return int(w["pid"]) if w and w.get("host") == self.info.host and w.get("pid") else None

    def _local_fault(self, rank: int) -> str | None:
        """Why local peer `rank` cannot be alive and well, from its process state; None when it looks fine or is
        not on this host."""
        pid = self._local_pid(rank)
        if pid is None:
            return None
        state = process_state(pid)
        if state is None or state in "ZX":
            return f"died (process {pid} on {self.info.host} is {'gone' if state is None else 'a zombie'})"
        if state in "Tt":
            return f"is stopped (process {pid} on {self.info.host}: SIGSTOP or a debugger)"
        return None

    def _judge(self, peers: dict, now: float) -> None:
        for r, (_, status) in peers.items():
            if status:
                self.statuses[r] = status
        died = {}  # gone without a word: no timeout needed, and the cause before any peer's reported error
        for r in self.peers:
            fault = None if r in self.statuses else self._local_fault(r)
            if fault and fault.startswith("died") and not self._status_now(r):
                died[r] = f"{fault}, at {self._step_of(r)}"
        if died:
            self.peers_down(died)
        for r, (hb, status) in peers.items():
            if status and status["state"] == "error":
                self.peer_down(r, f"failed: {status['message']}", kill=False)  # it is exiting on its own
            if status:  # done or aborted on its own: nothing more to watch
                continue
            fault = self._local_fault(r)
            if hb != self.seen_beat[r][0]:
                self.seen_beat[r] = (hb, now)
            elif now - self.seen_beat[r][1] > max(self.dead_timeout_s, self.hang_timeout_s if hb is None else 0):
                what = "never started beating" if hb is None else "stopped responding"
                self.peer_down(r, f"{what}: no heartbeat for {now - self.seen_beat[r][1]:.0f} s"
                               + (f"; it {fault}" if fault else "") + f" (last step: {self._step_of(r)})", kill=True)
        if now - self.changed > self.hang_timeout_s:
            self._abort_stuck(now)

    def _status_now(self, rank: int, store: dist.Store | None = None) -> dict | None:
        """Rank's reported status read now (through `store` when the caller is not the watchdog thread)."""
        return self._read(f"status/{rank}", store)

    def _step_of(self, rank: int, store: dist.Store | None = None) -> str:
        p = self._read(f"progress/{rank}", store)
        if p is None and store is None:
            p = self.where.get(rank)
        return f"#{p['seq']} '{p['label']}' on {p['host']} pid {p['pid']}" if p else "unknown"

    def _read(self, key: str, store: dist.Store | None = None):
        """The JSON value at `key` read now: through `store` (the caller's own connection), else through the
        watchdog's when called on its thread; None when absent, unreadable, or neither is at hand."""
        if store is None and threading.current_thread() is not self._thread:
            return None
        try:
            return self._get(key) if store is None else (json.loads(store.get(key)) if store.check([key]) else None)
        except Exception:
            return None

    def _abort_stuck(self, now: float) -> None:
        # a peer whose heartbeat stopped is frozen, not merely slow: it is the cause whatever its step (a hang
        # timeout shorter than the dead timeout would otherwise blame every rank of a collective it never joined)
        frozen = [r for r in self.peers if r not in self.statuses and now - self.seen_beat[r][1] > 2.5]
        if frozen:
            r = frozen[0]
            fault = self._local_fault(r)
            self.peer_down(r, f"stopped responding: no heartbeat for {now - self.seen_beat[r][1]:.0f} s"
                           + (f"; it {fault}" if fault else "") + f" (last step: {self._step_of(r)})", kill=True)
        progress = {self.info.rank: self.seq}
        for r in self.peers:
            try:
                p = self._get(f"progress/{r}")
            except Exception:
                p = None
            progress[r] = p["seq"] if p else -1
        oldest = min(progress.values())
        stuck = sorted(r for r, s in progress.items() if s == oldest)
        waiting = sorted(set(progress) - set(stuck))
        stalled_s = now - self.changed
        if not waiting:
            msg = (f"all {len(stuck)} ranks made no progress for {stalled_s:.0f} s (rank {self.info.rank} at "
                   f"{self._step_of(self.info.rank)}): a collective that never completes")
            self._abort(msg, EXIT_STUCK, dump_stack=True, culprit_first=False)
        who = f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))}"
        msg = (f"{who} stopped making progress (no new step for over {self.hang_timeout_s:.0f} s); last step: "
               + "; ".join(f"rank {r} {self._step_of(r)}" for r in stuck)
               + "; waiting: " + "; ".join(f"rank {r} at {self._step_of(r)}" for r in waiting))
        if self.info.rank in stuck:
            self._abort(msg, EXIT_STUCK, dump_stack=True, culprit_first=False)
        self._abort(msg, EXIT_WAITED)

    def find_culprit(self, store: dist.Store | None = None,
                     window_s: float | None = None) -> dict[int, str] | None:
        """{rank: why} of the peer that failed, died or froze, watched for up to `window_s` (default: long enough to
        see a remote peer's heartbeat stop; 0.5 s when every peer is on this host, where the process state says it
        at once), or None. For the main thread (with its own `store` connection), after an exception that a
        collective may have raised only because of such a peer. A peer that ended without a word comes before one
        that reported an error (that error may have followed from the silent one); every peer found ended without
        a word is returned (see peers_down); a heartbeat that looks stale is read again before it blames anyone (a
        loaded host delays this rank's reads, not only peers)."""
        for r in self.peers:  # the watchdog thread may not have read every peer's pid yet
            if r not in self.where and (p := self._read(f"progress/{r}", store)):
                self.where[r] = p
        read_every_s = max(1.0, len(self.peers) / 16)
        local = all(self._local_pid(r) is not None for r in self.peers)
        window_s = window_s if window_s is not None else (0.5 if local else 2 * read_every_s + 1)
        start = time.monotonic()
        while True:
            statuses = {r: self.statuses.get(r) or self._status_now(r, store) for r in self.peers}
            silent = {}
            for r in self.peers:
                fault = None if statuses[r] else self._local_fault(r)
                if fault:  # it may have reported just before its process ended
                    statuses[r] = self._status_now(r, store)
                    if not statuses[r]:
                        silent[r] = f"{fault}, at {self._step_of(r, store)}"
            if silent:
                return silent
            for r in self.peers:
                if statuses[r] and statuses[r]["state"] == "error":
                    return {r: f"failed: {statuses[r]['message']}"}
            now = time.monotonic()
            if now - start >= window_s:
                break
            time.sleep(0.05)
        for r in self.peers:  # seen beating by the watchdog thread's reads, once a read period, unless frozen
            if r not in self.statuses and r in self.seen_beat and self.seen_beat[r][1] < now - read_every_s - 1:
                beat = self._read(f"hb/{r}", store)
                if beat is not None and beat != self.seen_beat[r][0]:
                    continue  # it beat since this rank's watchdog last looked: alive
                return {r: f"stopped responding: no heartbeat for {now - self.seen_beat[r][1]:.0f} s"}
        return None
