"""Real rank faults under torchrun (gloo, CPU): one non-zero rank is really SIGKILLed or SIGSTOPped while the ranks
are inside the timed allreduce loop. The job must end non-zero within --hang-timeout + MARGIN_S of the signal, name
the faulty rank as torchrun's root cause (never a healthy rank that only noticed it), leave no output marked
complete and no process behind. A --hang-timeout the watchdog cannot honour is refused at the edge with exit 2.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import early_jobs
from verifybench.harness.multigpu import allreduce, driver, verify, watchdog
from verifybench.harness.multigpu.driver import RankInfo
from torchrun_jobs import REPO, alive, assert_no_orphans, rank_processes, rank_step, start_job

# The faulty rank is not rank 0, and more healthy ranks than rank 0 see it fail (a late failure path once blamed
# rank 0); the deployment's 8 ranks run in the sweep's and verify_dist's jobs (test_allreduce.py, test_verify_dist.py)
WORLD, FAULTY = 4, 3
HANG_TIMEOUT_S = 10.0
MARGIN_S = 10.0  # the launcher's teardown (it polls every 0.1 s) and a loaded CPU's slack
START_S = 180  # the ranks must reach the timed loop within this
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
# a long eager loop (samples x K gloo allreduces), so the fault lands inside a collective
JOB = ["-m", "verifybench.harness.multigpu.allreduce", "--backend", "gloo", "--preset", "tiny", "--tokens", "1",
       "--mode", "eager", "--warmup", "2", "--samples", "5000", "--calls-per-sample", "3",
       "--hang-timeout", str(HANG_TIMEOUT_S)]
IN_LOOP = ": eager"  # the label Watchdog.mark gets the timed loop (harness/multigpu/allreduce.py)


def _fault_in_loop(out_dir, sig: signal.Signals) -> tuple[int, str, float]:
    """Start the job, wait until rank FAULTY is in the timed loop, send `sig` to it; (rc, output, seconds from the
    signal to the launcher's exit). The stopped process, if still there at the end, is killed by its pid."""
    proc, tag = start_job(TORCHRUN + JOB + ["--out", str(out_dir), "--name", "r.json"])
    victim = None
    try:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and proc.poll() is None:
            ranks = rank_processes(tag)
            if FAULTY in ranks and IN_LOOP in (rank_step(ranks[FAULTY][1], FAULTY) or ""):
                victim = ranks[FAULTY][0]
                break
            time.sleep(0.2)
        assert victim, f"rank {FAULTY} never reached the timed loop:\n{proc.communicate(timeout=30)[0][-3000:]}"
        time.sleep(0.3)  # inside a collective by now: each gloo allreduce is a few ms
        os.kill(victim, sig)
        signalled = time.monotonic()
        try:
            out, _ = proc.communicate(timeout=HANG_TIMEOUT_S + MARGIN_S + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"the job did not end within {HANG_TIMEOUT_S + MARGIN_S + 30} s of {sig.name}:\n{out[-3000:]}")
        return proc.returncode, out, time.monotonic() - signalled
    finally:
        if victim and alive(tag):
            try:
                os.kill(victim, signal.SIGKILL)  # a stopped process ignores everything else
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        assert_no_orphans(tag)


def _fault_job(sig: signal.Signals) -> tuple:
    out_dir = early_jobs.scratch("rank-fault")
    return (*_fault_in_loop(out_dir, sig), out_dir)


# timed bounds: last, with the other timed jobs (tests/early_jobs.py)
TIMED_JOBS = {"killed_run": lambda: _fault_job(signal.SIGKILL), "frozen_run": lambda: _fault_job(signal.SIGSTOP)}


@pytest.fixture(scope="module")
def killed_run() -> tuple:
    """(rc, output, seconds from the signal to the launcher's exit, output folder) of the job whose rank was killed."""
    return early_jobs.timed_result(f"{__name__}::killed_run", TIMED_JOBS["killed_run"])


@pytest.fixture(scope="module")
def frozen_run() -> tuple:
    """The same, of the job whose rank was stopped (SIGSTOP)."""
    return early_jobs.timed_result(f"{__name__}::frozen_run", TIMED_JOBS["frozen_run"])


def _check_outcome(rc: int, out: str, after_s: float, out_dir) -> None:
    assert rc != 0, out[-3000:]
    assert after_s < HANG_TIMEOUT_S + MARGIN_S, (after_s, out[-3000:])
    root = re.search(r"Root Cause \(first observed failure\):\s*\[0\]:.*?rank\s*:\s*(\d+) \(local_rank", out, re.S)
    assert root and int(root.group(1)) == FAULTY, out[-3000:]
    # no healthy rank blames itself ("rank 0: failed: ...") or another healthy rank
    assert not re.search(rf"rank (?!{FAULTY}\b)\d+: failed|root cause: rank (?!{FAULTY}\b)\d+", out), out[-3000:]
    for path in out_dir.iterdir():  # rank 0 saves after each backend: nothing may claim to be complete
        assert not path.name.endswith(".tmp"), path
        assert not json.loads(path.read_text())["extra"]["complete"], path


def test_a_rank_killed_mid_collective_is_the_root_cause_and_the_job_ends_at_once(killed_run):
    rc, out, after_s, out_dir = killed_run
    _check_outcome(rc, out, after_s, out_dir)
    assert "Signal 9 (SIGKILL)" in out
    assert after_s < MARGIN_S, after_s  # a death needs no timeout: the launcher sees the exit


def test_a_frozen_rank_is_named_and_ended_within_the_hang_timeout(frozen_run):
    rc, out, after_s, out_dir = frozen_run
    _check_outcome(rc, out, after_s, out_dir)
    assert f"root cause: rank {FAULTY} stopped responding" in out, out[-3000:]
    assert "killed its process" in out  # so the launcher saw it end, instead of waiting out SIGTERM on it


def test_a_hang_timeout_the_watchdog_cannot_honour_is_refused_at_the_edge():
    """NaN would switch the watchdog off, 0 or a negative value end a healthy job at the first check: exit 2 and
    one line naming the option, before any rendezvous (a plain run: the same code runs in every torchrun rank)."""
    r = subprocess.run([sys.executable, "-m", "verifybench.harness.multigpu.allreduce", "--backend", "gloo", "--preset",
                        "tiny", "--hang-timeout", "nan"], cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip() and "forced" not in line]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert lines == ["error: --hang-timeout must be a number of seconds in [1, 86400], got nan"], r.stderr[-2000:]
    assert "saved" not in r.stdout


@pytest.mark.parametrize("value", ["nan", "-1", "0", "0.5", "inf", "1e9", "abc", None])
def test_every_hang_timeout_outside_its_range_is_named(value):
    with pytest.raises(ValueError, match=r"--hang-timeout must be a number of seconds in \[1, 86400\]"):
        watchdog.check_hang_timeout(value)
    assert watchdog.check_hang_timeout("30") == 30.0


def test_an_unwritable_out_is_refused_before_the_rendezvous_on_rank_0(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    info = RankInfo(0, 2, 0, 2, "127.0.0.1", 1, True, "r", "h")
    with pytest.raises(ValueError, match="output folder .*a-file/sub is not writable"):
        driver.check_edge(SimpleNamespace(hang_timeout=30, out=blocker / "sub"), info)
    other = RankInfo(1, 2, 1, 2, "127.0.0.1", 1, True, "r", "h")  # only rank 0 writes results
    driver.check_edge(SimpleNamespace(hang_timeout="30", out=blocker / "sub"), other)
    args = SimpleNamespace(hang_timeout="12.5", out=None)
    driver.check_edge(args, info)
    assert args.hang_timeout == 12.5


class FakeStore:
    """The two calls of a torch.distributed store that the guard's reads use, over a dict of JSON values."""

    def __init__(self, values: dict):
        self.values = values

    def check(self, keys) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key) -> bytes:
        return json.dumps(self.values[key]).encode()


def _watchdog_seeing(peers: dict[int, int]) -> watchdog.Watchdog:
    """A Watchdog (no store, no thread) whose peers' published pids are `peers` (rank -> pid, on this host)."""
    w = watchdog.Watchdog.__new__(watchdog.Watchdog)
    w.info = RankInfo(0, len(peers) + 1, 0, len(peers) + 1, "127.0.0.1", 1, True, "r", socket.gethostname())
    w.peers = sorted(peers)
    w.where = {r: {"host": w.info.host, "pid": pid, "seq": 3, "label": "gloo 512B: eager"} for r, pid in peers.items()}
    w.statuses, w.seen_beat = {}, {r: (1, time.monotonic()) for r in peers}
    w._thread = None
    return w


def test_the_culprit_of_a_failed_collective_is_the_peer_whose_process_died_or_stopped():
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    try:
        healthy, dead, stopped, terminated = sleepers
        for p in (dead, terminated):
            p.kill()
            p.wait()  # reaped: its pid is gone, as torchrun reaps a killed rank
        assert _watchdog_seeing({1: healthy.pid}).find_culprit(window_s=0.2) is None
        found = _watchdog_seeing({1: healthy.pid, 2: dead.pid}).find_culprit(window_s=0.2)
        assert list(found) == [2] and found[2].startswith(f"died (process {dead.pid}")
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        found = _watchdog_seeing({1: healthy.pid, 3: stopped.pid}).find_culprit(window_s=0.2)
        assert list(found) == [3] and "is stopped" in found[3]
        w = _watchdog_seeing({1: healthy.pid})
        w.statuses = {1: {"state": "error", "message": "ValueError: bad"}}  # a peer that reported its own error
        assert w.find_culprit(window_s=0.2) == {1: "failed: ValueError: bad"}
        w = _watchdog_seeing({1: healthy.pid})
        w.where = {}  # a peer on another host: only its heartbeat can tell
        w.seen_beat = {1: (5, time.monotonic() - 30)}
        found = w.find_culprit(window_s=0.2)
        assert list(found) == [1] and found[1].startswith("stopped responding: no heartbeat for 30 s")
        assert w.find_culprit(FakeStore({"hb/1": 6}), window_s=0.2) is None  # it beat since: only our reads lagged
        w = _watchdog_seeing({1: healthy.pid, 2: dead.pid})
        w.statuses = {1: {"state": "error", "message": "RuntimeError: peer closed"}}  # an error that followed
        assert list(w.find_culprit(window_s=0.2)) == [2]  # the peer that ended without a word is the cause
        w = _watchdog_seeing({1: healthy.pid, 2: dead.pid})
        where, w.where = w.where, {}  # pids not read yet by the watchdog thread: the store has them
        found = w.find_culprit(FakeStore({f"progress/{r}": p for r, p in where.items()}), window_s=0.2)
        assert list(found) == [2] and found[2].startswith(f"died (process {dead.pid}")
        # the launcher already ending the job: a terminated healthy rank looks as gone as the faulty one
        found = _watchdog_seeing({1: terminated.pid, 2: healthy.pid, 5: dead.pid}).find_culprit(window_s=0.2)
        assert sorted(found) == [1, 5]
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def _exit_message(w: watchdog.Watchdog, why: dict[int, str]) -> str:
    """What `w.peers_down(why)` exits with, caught instead of ending the test process."""
    said = []

    def record(message, code, **_):
        said.append((message, code))
        raise SystemExit

    w._abort = record
    with pytest.raises(SystemExit):
        w.peers_down(why, "; this rank's RuntimeError followed from it")
    (message, code), = said
    assert code == watchdog.EXIT_PEER_FAILED
    return message


def test_peers_gone_together_are_named_together_never_the_lowest_rank_alone():
    gone = [subprocess.Popen(["true"]) for _ in range(2)]
    for p in gone:
        p.wait()
    w = _watchdog_seeing({1: gone[0].pid, 5: gone[1].pid})
    one = _exit_message(w, {5: "died (process 9 on h is gone), at #3"})
    assert one.startswith("root cause: rank 5 died") and one.endswith("followed from it")
    both = _exit_message(w, {1: "died (process 8 on h is gone), at #3", 5: "died (process 9 on h is gone), at #3"})
    assert both.startswith("ranks 1, 5 ended together (rank 1 died") and "root cause: rank" not in both
    assert "the launcher's root cause names it" in both


def test_only_a_sibling_worker_of_this_job_is_ever_killed():
    other = subprocess.Popen(["sleep", "60"])  # another command line, another parent: not this job's worker
    try:
        assert not watchdog._same_job(other.pid)
        assert watchdog.process_state(other.pid) in ("S", "R")
    finally:
        other.kill()
        other.wait()
    assert watchdog.process_state(other.pid) is None


JOB_COUNTS = [("allreduce", flag) for flag in ("--warmup", "--samples", "--isolated-samples", "--calls-per-sample",
                                               "--tp", "--hidden", "--nproc-per-node")]
JOB_COUNTS += [("verify", flag) for flag in ("--warmup", "--samples", "--layers", "--context", "--tp")]


@pytest.mark.parametrize("job, flag", JOB_COUNTS)
@pytest.mark.parametrize("value", ["0", "-3", "2.5"])
def test_a_count_of_zero_is_refused_in_one_line_when_parsed_not_swapped_for_the_default(job, flag, value, capsys):
    parser = (allreduce if job == "allreduce" else verify).build_parser()
    with pytest.raises(SystemExit) as stop:
        parser.parse_args([flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert f"argument {flag}: " in err[0] and value in err[0]
    assert getattr(parser.parse_args([flag, "1"]), flag[2:].replace("-", "_")) == 1


@pytest.mark.parametrize("flag", ["--setting-timeout", "--sweep-time-limit"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_sweep_time_that_is_not_a_positive_number_of_seconds_is_refused_when_parsed(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        allreduce.build_parser().parse_args([flag, value])
    assert stop.value.code == 2 and f"argument {flag}: " in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["bogus", "exit-early", "hang:x", "hang:1@y", "crash:1"])
def test_a_fault_that_cannot_be_read_is_refused_at_the_edge_naming_the_allowed_values(spec):
    info = RankInfo(1, 2, 1, 2, "127.0.0.1", 1, True, "r", "h")
    with pytest.raises(ValueError, match=r"expected exit-early:RANK\[@CASE\] or hang:RANK\[@CASE\]"):
        driver.check_edge(SimpleNamespace(hang_timeout=30, out=None, fault=spec), info)
    driver.check_edge(SimpleNamespace(hang_timeout=30, out=None, fault="hang:1@2"), info)


@pytest.mark.parametrize("job, argv", [("allreduce", ["--backend", "gloo,nccl"]), ("allreduce", ["--backend", "pynccl"]),
                                       ("verify", ["--allreduce", "nccl"]), ("verify", ["--allreduce", "symm-one-shot"])])
def test_a_gpu_backend_is_refused_on_a_cpu_box_in_one_line(job, argv, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = allreduce if job == "allreduce" else verify
    assert module.main(["--preset", "tiny", "--tp", "1", *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "forced" not in line]
    assert len(err) == 1 and "needs a CUDA GPU and this machine has none" in err[0], err
