"""Slow subprocess work spread over the CPU's cores: fixtures started when the session is collected, to run beside
the single-process tests (the fixture that needs one waits for it; conftest.py).

At collection the tiny end-to-end run starts (a process of its own), and the jobs a test file names in EARLY_JOBS
(fixture name -> a function of no arguments that runs its subprocesses and returns what the fixture checks) are
queued on one thread, one after another. The jobs a file names in TIMED_JOBS (the same form) have timed bounds:
they follow once every early job and the tiny run have ended, so that no other job loads the host beside them (one
after another on a small host, at once on one with cores to spare). Every job's processes run at a lower CPU
priority (JOB_NICE) than the tests: the single-process tests are the session's longest path, and the jobs only have
to end before their readers, which run after the other tests (the timed jobs' readers last).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# the end-to-end tiny run of tests/suite/test_cli_run.py (the tiny preset named: on a GPU machine too a quick run)
RUN_ARGS = ["run", "--preset", "tiny", "--tp", "1", "--context", "64"]
RUN_ENV = {"VERIFYBENCH_MAX_TIME_S": "0.05"}
RUN_TIMEOUT_S = 900
JOB_NICE = 10  # the jobs' niceness: the tests take a core first, the jobs the rest
LANES = ("early-job", "timed-job")  # the jobs' thread names: what they start runs at JOB_NICE

# The environment as the session began: a job runs on its thread while tests change os.environ (monkeypatch), so it
# builds its processes' environment from this. Unpinned unless the caller pinned: a test session is no quiet host,
# and every GPU job pinned itself to the one CPU VERIFYBENCH_PIN_CPU=auto picks, its compile threads with it, where
# they queued behind each other (on a 16-core H200 the tiny run got a tenth of that CPU for five minutes).
ENVIRON = {"VERIFYBENCH_PIN_CPU": "off", **os.environ}

_started: dict[str, tuple[subprocess.Popen, Path]] = {}
_done: list[Path] = []  # folders removed at the session's end
started_at_collection: set[str] = set()
_lane: ThreadPoolExecutor | None = None  # the EARLY_JOBS, one at a time
_jobs: dict[str, Future] = {}
_timed_fns: dict[str, object] = {}  # the TIMED_JOBS of the session's tests, module::fixture -> function
_timed_start: Future | None = None  # on the early lane, behind every early job: starts the timed jobs
_timed_lane: ThreadPoolExecutor | None = None
_timed: dict[str, Future] = {}
_live: set[subprocess.Popen] = set()  # the jobs' processes (each in its own session), ended with the session
_stopping = False


def start_run(base: Path | None = None) -> tuple[subprocess.Popen, Path]:
    """Start `verifybench run` on the tiny preset into `base`/out (default base: a fresh temporary folder), its
    output in files beside it (a pipe nobody reads would stop it once full); returns at once."""
    base = base or Path(tempfile.mkdtemp(prefix="verifybench-run-"))
    cmd = [sys.executable, "-m", "verifybench.harness", *RUN_ARGS, "--out", str(base / "out")]
    with open(base / "stdout.txt", "w") as stdout, open(base / "stderr.txt", "w") as stderr:
        # without TRITON_INTERPRET, as a user runs it: the command line switches the interpreter on by itself
        env = {**{k: v for k, v in ENVIRON.items() if k != "TRITON_INTERPRET"}, **RUN_ENV}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)
    _yield_cpu(proc.pid)
    return proc, base


def _yield_cpu(pid: int) -> None:
    """Lower the process's CPU priority to JOB_NICE (at once, before it starts children, which inherit it)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, max(JOB_NICE, os.getpriority(os.PRIO_PROCESS, pid)))
    except OSError:  # gone already, or not ours to change: it runs at the tests' priority
        pass


def start(name: str) -> None:
    if name == "run" and name not in _started:
        _started[name] = start_run()
        started_at_collection.add(name)


def job_fixtures(item, registry: str = "EARLY_JOBS") -> dict:
    """module::fixture -> job function, of the EARLY_JOBS (or TIMED_JOBS) fixtures the test `item` uses."""
    module = getattr(item, "module", None)
    named = getattr(module, registry, {})
    return {f"{module.__name__}::{f}": named[f] for f in getattr(item, "fixturenames", ()) if f in named}


def timed(item) -> bool:
    return bool(job_fixtures(item, "TIMED_JOBS"))


def place(item) -> int:
    """The test session's order, as a sort key: 0 the other tests; 1 the early jobs' readers, which find them done
    (their jobs load the second core while the single-process tests run); 2 the timed jobs' readers."""
    if timed(item):
        return 2
    return int("run_dir" in getattr(item, "fixturenames", ()) or bool(job_fixtures(item)))


def submit(name: str, fn) -> None:
    """Queue the EARLY_JOBS function `fn` under `name` (module::fixture) on the jobs' thread."""
    global _lane
    if name not in _jobs:
        _lane = _lane or ThreadPoolExecutor(1, thread_name_prefix=LANES[0])
        _jobs[name] = _lane.submit(fn)
        started_at_collection.add(name)


def job_result(name: str, fn):
    """What `fn` returns: from the job queued at collection, waited for, or run here (a test run alone, -k)."""
    job = _jobs.get(name)
    return job.result() if job is not None else fn()


def register_timed(name: str, fn) -> None:
    """Note the TIMED_JOBS function `fn` (module::fixture) of a collected test; queue_timed starts them."""
    _timed_fns.setdefault(name, fn)


def queue_timed() -> None:
    """Queue the start of the noted timed jobs on the early lane, behind every early job queued so far."""
    global _lane, _timed_start
    if _timed_fns and _timed_start is None:
        _lane = _lane or ThreadPoolExecutor(1, thread_name_prefix=LANES[0])
        _timed_start = _lane.submit(_start_timed)


def _start_timed() -> None:
    global _timed_lane
    run = _started.get("run")  # the tiny run, unless its reader has taken it: no other job beside them
    if run is not None:
        run[0].wait(timeout=RUN_TIMEOUT_S)
    # at once where cores are spare; one after another on a small host, where their ranks' start-up would starve
    # the others' timed loops
    width = min(len(_timed_fns), max(1, (os.cpu_count() or 1) // 4))
    _timed_lane = ThreadPoolExecutor(width, thread_name_prefix=LANES[1])
    _timed.update({n: _timed_lane.submit(f) for n, f in _timed_fns.items()})


def timed_result(name: str, fn):
    """What `fn` returns: from the timed job started behind the early jobs, waited for; a job not noted at
    collection (a test run alone) runs here."""
    if _timed_start is not None:
        _timed_start.result()
    job = _timed.get(name)
    return job.result() if job is not None else fn()


def scratch(prefix: str) -> Path:
    """A fresh temporary folder for a job's output, removed at the session's end."""
    base = Path(tempfile.mkdtemp(prefix=f"verifybench-{prefix}-"))
    _done.append(base)
    return base


def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen in a session of its own, ended (the whole group) when the test session ends."""
    if _stopping:
        raise RuntimeError("the test session is ending: no new job")
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    _live.add(proc)
    if threading.current_thread().name.startswith(LANES):
        _yield_cpu(proc.pid)
    return proc


def communicate(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str | None, bool]:
    """(its stdout, its stderr, whether it was killed past `timeout_s`) of a process started by popen; past the
    timeout its whole group is ended."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
        killed = False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        killed = True
    _live.discard(proc)
    return out, err, killed


def run(cmd: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) through popen; a timeout fails the caller's test."""
    proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    out, err, killed = communicate(proc, timeout_s)
    if killed:
        raise subprocess.TimeoutExpired(cmd, timeout_s, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """End the process group `proc` leads: SIGINT first, as Ctrl-C would, so that a driver ends the jobs it started
    in sessions of their own (the NCCL sweep's torchruns); SIGKILL what is left after `grace_s`."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def finish(proc: subprocess.Popen, base: Path) -> tuple[int, str, str, Path]:
    """Wait for a started job: (rc, stdout, stderr, its output folder); killed past RUN_TIMEOUT_S."""
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
        note = ""
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        note = f"\n(killed after {RUN_TIMEOUT_S} s)"
    return (proc.returncode, (base / "stdout.txt").read_text(), (base / "stderr.txt").read_text() + note,
            base / "out")


def run_result() -> tuple[int, str, str, Path]:
    """The tiny run, waited for: the one started at collection, or one started here (a test file run alone)."""
    proc, base = _started.pop("run", None) or start_run()
    _done.append(base)
    return finish(proc, base)


def stop_all() -> None:
    """At the session's end (an interrupted or -x run too): no job left behind, no folder left in /tmp."""
    global _stopping, _lane, _timed_lane, _timed_start
    _stopping = True  # no new process from here
    for proc in list(_live):
        _kill_group(proc)
    for proc, base in _started.values():  # before the lanes: a timed start may be waiting for the tiny run
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _done.append(base)
    if _lane is not None:  # the jobs in hand end with their killed processes
        _lane.shutdown(wait=True, cancel_futures=True)
    if _timed_lane is not None:  # read only now: a timed start in hand on the early lane may have opened it
        _timed_lane.shutdown(wait=True, cancel_futures=True)
    _lane = _timed_lane = _timed_start = None
    _jobs.clear()
    _timed.clear()
    _timed_fns.clear()
    _started.clear()
    _stopping = False
    for base in _done:
        shutil.rmtree(base, ignore_errors=True)
    _done.clear()
