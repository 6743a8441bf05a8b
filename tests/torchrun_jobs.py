"""Launching torchrun jobs from tests: each in its own session with a unique tag on its command line, killed as a
group past a timeout, and checked for processes left behind (the allreduce and verify_dist failure-path tests)."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import early_jobs

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
BOUND_S = 60  # the issues' bound: a dead or hung rank ends the job within this


def run_job(cmd: list[str], timeout_s: float, drop_env: tuple[str, ...] = ()) -> tuple[int, str, float, str]:
    """Run `cmd` (+ a unique --run-tag) in its own session; returns rc, output, wall seconds, tag."""
    t0 = time.monotonic()
    proc, tag = start_job(cmd, drop_env)
    out, _, killed = early_jobs.communicate(proc, timeout_s)
    if killed:
        pytest.fail(f"did not end within {timeout_s} s:\n{out[-3000:]}")
    return proc.returncode, out, time.monotonic() - t0, tag


def run_jobs_at_once(cmds: list[list[str]], timeout_s: float, drop_env: tuple[str, ...] = ()) -> list[tuple]:
    """run_job of each command, all started together (a fault job mostly waits: for its timeout, for the
    launcher's teardown), results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(cmds)) as pool:
        return list(pool.map(lambda cmd: run_job(cmd, timeout_s, drop_env), cmds))


def alive(tag: str) -> list[str]:
    """Live (non-zombie) processes whose command line carries `tag`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag.encode() in cmdline and state != "Z":
            found.append(d.name + ": " + cmdline.replace(b"\0", b" ").decode(errors="replace")[:120])
    return found


def assert_no_orphans(tag: str, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while alive(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(tag), f"processes left behind: {alive(tag)}"


def start_job(cmd: list[str], drop_env: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Like run_job, but returns at once: (the launcher process, its tag); the caller waits and reads."""
    tag = f"job-{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in early_jobs.ENVIRON.items() if k not in drop_env}
    env.update(OMP_NUM_THREADS="1")
    proc = early_jobs.popen(cmd + ["--run-tag", tag], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, tag


def rank_processes(tag: str) -> dict[int, tuple[int, dict]]:
    """rank -> (pid, environment) of the live worker processes of the job tagged `tag` (the launcher has no RANK)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if tag.encode() not in (d / "cmdline").read_bytes():
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except OSError:
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            found[int(env["RANK"])] = (int(d.name), env)
    return found


def rank_step(env: dict, rank: int) -> str | None:
    """The step label rank `rank` last published to the job's store (harness/multigpu/watchdog.py), or None."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timedelta(seconds=5),
                          wait_for_workers=False)
    run_id = f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    prefixed = dist.PrefixStore(f"verifybench/{run_id}/", store)
    key = f"progress/{rank}"
    return json.loads(prefixed.get(key))["label"] if prefixed.check([key]) else None
