"""Probes of the torchrun jobs: a rank killed, frozen or leaving early mid-collective must end the job non-zero
within the hang timeout, naming that rank; and --hang-timeout's range."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from probe_base import REPO, Case, Result, module_main


def _ranks(tag: str) -> dict[int, tuple[int, dict]]:
    """rank -> (pid, environment) of the job's live workers: the tests' own finder (tests/torchrun_jobs.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from torchrun_jobs import rank_processes

    return rank_processes(tag)


def _step(env: dict, rank: int) -> str:
    from datetime import timedelta

    import torch.distributed as dist
    try:
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timedelta(seconds=5),
                              wait_for_workers=False)
        run_id = f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        s = dist.PrefixStore(f"verifybench/{run_id}/", store)
        key = f"progress/{rank}"
        return json.loads(s.get(key))["label"] if s.check([key]) else ""
    except Exception:
        return ""


def torchrun_case(work: Path, name: str, world: int, faulty: int, how: str, hang_timeout_s: float,
                  extra: tuple = ()) -> Case:
    """A real torchrun job of `world` gloo ranks; `how`: a signal name sent to rank `faulty` once it is in the timed
    loop, or 'inject' (the job's own --fault). Right: non-zero within hang timeout + 10 s of the fault, torchrun's
    root cause is the faulty rank, no healthy rank blamed, nothing marked complete."""
    margin_s = 10.0

    def runner(_timeout_s):
        folder = work / f"tr-{uuid.uuid4().hex[:6]}"
        tag = f"probe-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
               "verifybench.harness.multigpu.allreduce", "--backend", "gloo", "--preset", "tiny", "--tokens", "1",
               "--mode", "eager", "--warmup", "2", "--samples", "3000", "--calls-per-sample", "3", "--hang-timeout",
               str(hang_timeout_s), "--out", str(folder), "--name", "r.json", *extra, "--run-tag", tag]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        victim, fault_at = None, t0
        try:
            if how != "inject":
                while time.monotonic() - t0 < 240 and proc.poll() is None and victim is None:
                    ranks = _ranks(tag)
                    if faulty in ranks and ": eager" in _step(ranks[faulty][1], faulty):
                        victim = ranks[faulty][0]
                    time.sleep(0.2)
                if victim is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    out = proc.communicate()[0]
                    return Result("return", {"error": "never reached the loop", "out": out[-2000:]})
                time.sleep(0.3)
                os.kill(victim, getattr(signal, how))
                fault_at = time.monotonic()
            try:
                out = proc.communicate(timeout=hang_timeout_s + margin_s + (240 if how == "inject" else 30))[0]
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out = proc.communicate()[0]
                return Result("timeout", out=out[-3000:], wall_s=time.monotonic() - t0)
            ended_s = time.monotonic() - fault_at
            root = re.search(r"Root Cause \(first observed failure\):\s*\[0\]:.*?rank\s*:\s*(\d+)", out, re.S)
            complete = [p.name for p in folder.glob("*.json") if json.loads(p.read_text())["extra"].get("complete")]
            blamed = re.findall(rf"rank (?!{faulty}\b)\d+: failed|root cause: rank (?!{faulty}\b)\d+", out)
            return Result("return", {"rc": proc.returncode, "ended_s": round(ended_s, 1),
                                     "root_cause": int(root.group(1)) if root else None, "complete": complete,
                                     "healthy_blamed": blamed[:3], "out": out[-1500:]},
                          wall_s=time.monotonic() - t0)
        finally:
            if victim:
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()

    def check(res):
        v = res.value
        if not isinstance(v, dict) or "rc" not in v:
            return False, str(v)[:300]
        facts = {k: v[k] for k in ("rc", "ended_s", "root_cause", "complete", "healthy_blamed")}
        if v["rc"] == 0 or v["complete"] or v["root_cause"] != faulty or v["healthy_blamed"]:
            return False, f"{facts}"
        if how != "inject" and v["ended_s"] > hang_timeout_s + margin_s:
            return "hang", f"ended {v['ended_s']} s after the fault, past {hang_timeout_s} + {margin_s}: {facts}"
        return True, f"{facts}"

    return Case("rank-faults", name, bad=False, check=check, runner=runner)


def rank_fault_cases(work: Path, torchrun: bool) -> list[Case]:
    out = []
    if torchrun:
        out += [torchrun_case(work, "SIGKILL rank 1 of 2 mid-collective", 2, 1, "SIGKILL", 10.0),
                torchrun_case(work, "SIGSTOP rank 1 of 2 mid-collective", 2, 1, "SIGSTOP", 10.0),
                torchrun_case(work, "SIGKILL rank 3 of 4 mid-collective", 4, 3, "SIGKILL", 10.0),
                torchrun_case(work, "rank 1 of 2 exits early (injected)", 2, 1, "inject", 10.0,
                              ("--fault", "exit-early:1@0"))]
    for value in ("nan", "-1", "0", "inf", "-inf", "abc", "0.01"):
        for module in ("allreduce", "verify"):
            argv = ["--preset", "tiny", "--hang-timeout", value]
            argv += ["--backend", "gloo"] if module == "allreduce" else ["--tp", "1", "--allreduce", "gloo"]
            out.append(module_main("rank-faults", module, [*argv, "--out", work / "ht"], "--hang-timeout"))
    return out
