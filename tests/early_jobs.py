"""Slow subprocess work spread over the CPU's cores: fixtures started when the session is collected, to run beside
the single-process tests (the fixture that needs one waits for it; conftest.py), and serial compiles split.

Two kinds start at collection: the tiny end-to-end run (a process of its own), and the jobs a test file names in
EARLY_JOBS (fixture name -> a function of no arguments that runs its subprocesses and returns what the fixture
checks), run one after another on one thread, so that at most one of them loads the CPU beside the tests."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# the end-to-end tiny run of tests/test_cli_run.py (the tiny preset named: on a GPU machine too a quick run)
RUN_ARGS = ["run", "--preset", "tiny", "--tp", "1", "--context", "64"]
RUN_ENV = {"VERIFYBENCH_MAX_TIME_S": "0.05"}
RUN_TIMEOUT_S = 900

# Tests whose bounds are timed (a dead or hung rank ends its job within so many seconds) run last, after every early
# job has ended, so that no extra load moves them: these files, and the tests that use these fixtures (module-scoped,
# so set up before conftest's per-test wait: each calls wait_all itself).
TIMED_FILES = ("test_rank_faults.py",)
TIMED_FIXTURES = ("fault_runs", "two_rank_runs")

# The environment as the session began: a job runs on its thread while tests change os.environ (monkeypatch), so it
# builds its processes' environment from this.
ENVIRON = dict(os.environ)

_started: dict[str, tuple[subprocess.Popen, Path]] = {}
_done: list[Path] = []  # folders removed at the session's end
started_at_collection: set[str] = set()
_lane: ThreadPoolExecutor | None = None  # the EARLY_JOBS, one at a time
_jobs: dict[str, Future] = {}
_live: set[subprocess.Popen] = set()  # the jobs' processes (each in its own session), ended with the session
_stopping = False


def start_run(base: Path | None = None) -> tuple[subprocess.Popen, Path]:
    """Start `verifybench run` on the tiny preset into `base`/out (default base: a fresh temporary folder), its
    output in files beside it (a pipe nobody reads would stop it once full); returns at once."""
    base = base or Path(tempfile.mkdtemp(prefix="verifybench-run-"))
    cmd = [sys.executable, "-m", "verifybench.harness", *RUN_ARGS, "--out", str(base / "out")]
    with open(base / "stdout.txt", "w") as stdout, open(base / "stderr.txt", "w") as stderr:
        # without TRITON_INTERPRET, as a user runs it: the command line switches the interpreter on by itself
        env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **RUN_ENV}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)
    return proc, base


def start(name: str) -> None:
    if name == "run" and name not in _started:
        _started[name] = start_run()
        started_at_collection.add(name)


def early_fixtures(item) -> dict:
    """module::fixture -> job function, of the EARLY_JOBS fixtures the test `item` uses."""
    module = getattr(item, "module", None)
    named = getattr(module, "EARLY_JOBS", {})
    return {f"{module.__name__}::{f}": named[f] for f in getattr(item, "fixturenames", ()) if f in named}


def timed(item) -> bool:
    return item.path.name in TIMED_FILES or any(f in TIMED_FIXTURES for f in getattr(item, "fixturenames", ()))


def place(item) -> int:
    """The test session's order, as a sort key: 0 the other tests; 1 the early jobs' readers, which find them done
    (their jobs load the second core while the single-process tests run); 2 the timed tests, on a quiet host."""
    if timed(item):
        return 2
    return int("run_dir" in getattr(item, "fixturenames", ()) or bool(early_fixtures(item)))


def running() -> list[str]:
    return [name for name, (proc, _) in _started.items() if proc.poll() is None]


def submit(name: str, fn) -> None:
    """Queue the EARLY_JOBS function `fn` under `name` (module::fixture) on the jobs' thread."""
    global _lane
    if name not in _jobs:
        _lane = _lane or ThreadPoolExecutor(1, thread_name_prefix="early-job")
        _jobs[name] = _lane.submit(fn)
        started_at_collection.add(name)


def job_result(name: str, fn):
    """What `fn` returns: from the job queued at collection, waited for, or run here (a test run alone, -k)."""
    job = _jobs.get(name)
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


def wait_all() -> None:
    """Let every started job end before a test whose bounds are timed (the rank-fault runs)."""
    for name in running():
        _started[name][0].wait(timeout=RUN_TIMEOUT_S)
    for job in list(_jobs.values()):
        job.exception()  # waits; a failed job fails its own fixture, not this


def stop_all() -> None:
    """At the session's end (an interrupted or -x run too): no job left behind, no folder left in /tmp."""
    global _stopping, _lane
    _stopping = True
    for proc in list(_live):
        _kill_group(proc)
    if _lane is not None:
        _lane.shutdown(wait=True, cancel_futures=True)  # the job in hand ends with its killed processes
        _lane = None
    _jobs.clear()
    _stopping = False
    for proc, base in _started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _done.append(base)
    _started.clear()
    for base in _done:
        shutil.rmtree(base, ignore_errors=True)
    _done.clear()


def in_halves(fn, items: list) -> list:
    """fn(items) as fn(first half) and fn(second half) at once, results in order: for the compiles for each
    architecture, which under the interpreter hand their whole list to one serial subprocess, so that both cores
    of a CPU box work. Without the interpreter they compile in this process: one call, as before."""
    if os.environ.get("TRITON_INTERPRET") != "1" or len(items) < 2 or (os.cpu_count() or 1) < 2:
        return fn(items)
    half = len(items) // 2
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(fn, (items[:half], items[half:]))
    return [*first, *second]
