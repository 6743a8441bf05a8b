"""Slow subprocess work spread over the CPU's cores: fixtures started when the session is collected, to run beside
the single-process tests (the fixture that needs one waits for it; conftest.py), and serial compiles split."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# the end-to-end tiny run of tests/test_cli_run.py (the tiny preset named: on a GPU machine too a quick run)
RUN_ARGS = ["run", "--preset", "tiny", "--tp", "1", "--context", "64"]
RUN_ENV = {"VERIFYBENCH_MAX_TIME_S": "0.05"}
RUN_TIMEOUT_S = 900

_started: dict[str, tuple[subprocess.Popen, Path]] = {}
_done: list[Path] = []  # folders removed at the session's end
started_at_collection: set[str] = set()


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


def running() -> list[str]:
    return [name for name, (proc, _) in _started.items() if proc.poll() is None]


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


def stop_all() -> None:
    """At the session's end (an interrupted or -x run too): no job left behind, no folder left in /tmp."""
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
