"""`verifybench env`: the run fingerprint of this machine and process (GPUs, GPU-to-GPU links and P2P access, clocks
and throttle reasons, versions, NCCL_*/CUDA_*/TORCH_* variables, git state), as a table or JSON."""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from tabulate import tabulate

from verifybench.harness.measure import stance
from verifybench.harness.measure.host import fingerprint, topology
from verifybench.harness.measure.results import store



def sweep_times(sweep: dict, backend: str = "nccl") -> dict[str, dict[int, float]]:
    """An NCCL sweep result's graph-mode time (us) per setting label and verify size (bytes), passing cases only."""
    out: dict[str, dict[int, float]] = {}
    for c in sweep["cases"]:
        p = c["params"]
        if c["check"]["ok"] and p.get("mode") == "graph" and p.get("backend") == backend and "tok" in p.get("origin", ""):
            out.setdefault(p["nccl_setting"], {})[p["size_bytes"]] = c["summary"]["median_us"]
    return out


def sweep_winner(sweep: dict) -> tuple[str, dict[str, str]]:
    """(label, NCCL_* environment) of the sweep's fastest setting: the lowest geometric mean over the verify sizes
    the default measured (the sweep's own ranking rule), the default when nothing beats it."""
    times = sweep_times(sweep)
    if "default" not in times:
        raise ValueError("NCCL sweep: no passing default setting to rank against")
    sizes = set(times["default"])
    geo = {label: math.exp(sum(math.log(t[s]) for s in sizes) / len(sizes))
           for label, t in times.items() if sizes <= set(t)}
    label = min(geo, key=geo.get)
    envs = {c["params"]["nccl_setting"]: c["params"].get("nccl_env", {}) for c in sweep["cases"]}
    return label, dict(envs.get(label, {}))


def lost_settings(winner_env: dict[str, str], environ=None) -> list[str]:
    """One warning per NCCL_* variable whose value here differs from the sweep winner's (missing, or set to
    something else, or set here where the winner left NCCL's default)."""
    environ = os.environ if environ is None else environ
    here = {k: v for k, v in environ.items() if k.startswith("NCCL_") and not k.startswith("NCCL_DEBUG")}
    out = []
    for key in sorted(set(winner_env) | set(here)):
        want, have = winner_env.get(key), here.get(key)
        if want != have:
            out.append(f"{key}: here {have if have is not None else 'unset'}, the sweep's winner "
                       f"{want if want is not None else 'unset (NCCL default)'}")
    return out


def load_sweep(sweep_path: Path) -> dict:
    """A saved NCCL sweep (allreduce_sweep) result, or ValueError saying in one line what the file is instead."""
    run = store.load_run(sweep_path)
    if run["component"] != "allreduce_sweep":
        raise ValueError(f"--nccl-from {sweep_path}: a {run['component']} result, not an NCCL sweep result; give the "
                         "allreduce_sweep-<UTC time>.json file the sweep saved")
    return run


def nccl_warnings(sweep_path: Path, environ=None) -> list[str]:
    """The lost-settings lines for a saved sweep: its winner, then each NCCL_* variable that differs here; for a
    CPU sweep one line saying it recommends nothing (stance.py)."""
    run = load_sweep(sweep_path)
    if stance.is_cpu_run(run):
        return [f"NCCL sweep {sweep_path}: a CPU sweep (gloo): {stance.NO_NCCL_ADVICE}"]
    label, env = sweep_winner(run)
    lost = lost_settings(env, environ)
    head = f"NCCL sweep {sweep_path}: winner {label!r}"
    return [head + (": every NCCL_* variable here matches it" if not lost else
                    f"; {len(lost)} NCCL_* setting(s) differ here (lost settings?):")] + [f"  WARNING {x}" for x in lost]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="the whole fingerprint as JSON")
    p.add_argument("--nccl-from", type=Path, default=None, metavar="SWEEP",
                   help="a saved NCCL sweep result (allreduce_sweep): warn about each NCCL_* variable here that "
                   "differs from its winner (settings a container restart lost)")


def run(args) -> int:
    warnings = nccl_warnings(args.nccl_from) if args.nccl_from else []  # a bad file is refused before collecting
    fp = fingerprint.collect()
    if args.json:
        print(json.dumps(fp | ({"nccl_lost_settings": warnings} if warnings else {}), indent=1))
        return 0
    rows = [("gpu model", fp["gpu_model"]), ("machine", fp["slug"]), ("driver", fp["driver"]),
            ("versions", ", ".join(f"{k} {v}" for k, v in fp["versions"].items() if v and k != "engines")),
            ("engines", ", ".join(f"{k} {v}" for k, v in fp["versions"].get("engines", {}).items() if v)
             or "none installed (sglang, flashinfer, sgl-kernel, vllm)"),
            ("git", f"{fp['git']['commit']} dirty={fp['git']['dirty']}")]
    for g in fp["gpus"]:
        now = g.get("now") or {}
        rows.append((f"gpu {g['index']}", f"{g['name']} {g['uuid']} SM {now.get('sm_clock_mhz')}/"
                     f"{g['sm_clock_max_mhz']} MHz mem {now.get('mem_clock_mhz')}/{g['mem_clock_max_mhz']} MHz "
                     f"{now.get('temperature_c')} C {now.get('power_w')} W throttle={now.get('throttle_reasons')} "
                     f"PCIe gen{g['pcie_gen']} x{g['pcie_width']} NVLink {g['nvlink_active']}/{g['nvlink_links']}"))
    rows += [(k, v) for k, v in fp["env"].items()]
    print(tabulate(rows, tablefmt="plain"))
    print("\n" + topology.table(fp["topology"]))
    if not fp["cuda_available"]:
        print("no CUDA device: the fingerprint of a CPU machine")
    if warnings:
        print("\n" + "\n".join(warnings))
    return 0
