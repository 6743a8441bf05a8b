"""NCCL setting sweep: each setting (NCCL_PROTO, NCCL_ALGO, channel counts, P2P level, ...) runs in a fresh torchrun of
verifybench.harness.dist.allreduce, and the transport and algorithm NCCL chose are read back from its INFO log.

Fresh processes, not fresh process groups: NCCL caches most of its parameters the first time it reads them in a
process (NCCL_PARAM), so a second communicator in the same process would silently keep the first setting.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from tabulate import tabulate

from verifybench.harness.engine import fingerprint
from verifybench.harness.engine import results
from verifybench.harness.dist.guard import force_safe_env

# Small-message knobs for one node; "default" is the environment as launched. NVLS stays off (SAFE_ENV).
DEFAULT_SETTINGS = (
    "default",
    "NCCL_PROTO=LL", "NCCL_PROTO=LL128", "NCCL_PROTO=Simple",
    "NCCL_ALGO=Ring", "NCCL_ALGO=Tree",
    "NCCL_MIN_NCHANNELS=1,NCCL_MAX_NCHANNELS=1", "NCCL_MIN_NCHANNELS=2,NCCL_MAX_NCHANNELS=2",
    "NCCL_MIN_NCHANNELS=8,NCCL_MAX_NCHANNELS=8", "NCCL_MIN_NCHANNELS=32",
    "NCCL_PROTO=LL,NCCL_ALGO=Ring,NCCL_MAX_NCHANNELS=2",
    "NCCL_P2P_LEVEL=LOC",  # no peer-to-peer: what the SHM transport costs
    "NCCL_CUMEM_ENABLE=0",  # legacy IPC handles instead of cuMem
    "NCCL_GRAPH_MIXING_SUPPORT=0",  # no extra cross-stream ordering for mixing graph and eager NCCL calls
)
SWEEP_BACKENDS = "nccl,pynccl"
SWEEP_MODES = "graph"
LOG_SUBSYS = "INIT,ENV,GRAPH,TUNING"
ALGO_IDS = {0: "Tree", 1: "Ring", 2: "CollNetDirect", 3: "CollNetChain", 4: "NVLS", 5: "NVLSTree", 6: "PAT"}
PROTO_IDS = {0: "LL", 1: "LL128", 2: "Simple"}


def parse_setting(text: str) -> tuple[str, dict]:
    """'NCCL_PROTO=LL,NCCL_ALGO=Ring' -> (label, env); 'default' -> ('default', {}). Refuses multicast."""
    text = text.strip()
    if text in ("", "default"):
        return "default", {}
    env = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.startswith("NCCL_"):
            raise ValueError(f"bad setting {part!r} in {text!r}: expected NCCL_NAME=VALUE")
        env[key] = value
    if env.get("NCCL_NVLS_ENABLE", "0") != "0" or ("NVLS" in env.get("NCCL_ALGO", "").upper()
                                                    and not env["NCCL_ALGO"].startswith("^")):
        raise ValueError(f"setting {text!r} would use NVLS multicast, which stays off on these machines")
    return text, env


# ---- NCCL's INFO log ----

def parse_nccl_log(text: str) -> dict:
    """Transport, channels, algorithm/protocol choices and the variables NCCL says it took from the environment."""
    transports = Counter(m.group(1).rstrip(",.") for m in re.finditer(r" via (\S+)", text))
    choices: Counter = Counter()
    for algo, proto in re.findall(r"algorithm, (\w+), protocol, (\w+)", text):
        choices[f"{algo}/{proto}"] += 1
    for nbytes, algo, proto in re.findall(r"(\d+) Bytes -> Algo (\d+) proto (\d+)", text):
        choices[f"{nbytes}B {ALGO_IDS.get(int(algo), algo)}/{PROTO_IDS.get(int(proto), proto)}"] += 1
    version = re.search(r"NCCL version (\S+)", text)
    return {
        "version": version.group(1) if version else None,
        "transports": dict(transports.most_common()),
        "env": {k: v.rstrip(".") for k, v in re.findall(r"(NCCL_[A-Z0-9_]+) set by environment to (\S+)", text)},
        "coll_channels": sorted({int(x) for x in re.findall(r"(\d+) coll channels", text)}),
        "nvls_channels": sorted({int(x) for x in re.findall(r"(\d+) nvls channels", text)}),
        "algo_proto": dict(choices.most_common(20)),
    }


def parse_nccl_logs(folder: Path) -> dict:
    """parse_nccl_log over every nccl.*.log in `folder` (one per process), merged."""
    files = sorted(Path(folder).glob("nccl.*.log"))
    out = parse_nccl_log("\n".join(f.read_text(errors="replace") for f in files))
    out["files"] = len(files)
    return out


def transport_summary(log: dict) -> str:
    """'P2P/CUMEM/read x48' style: the connection types NCCL set up, most used first."""
    return ", ".join(f"{t} x{n}" for t, n in list(log.get("transports", {}).items())[:3]) or "?"


# ---- the driver ----

def _machine_slug() -> str:
    """The results folder name from NVML alone: the driver must not hold a CUDA context while ranks run."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if count else None
        name = name.decode() if isinstance(name, bytes) else name
        return fingerprint.machine_slug({"gpus": [{"name": name}] * count}) if count else "cpu"
    except Exception:
        return "cpu"


def _gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0


def worker_argv(args) -> list[str]:
    """The measurement options of this command line, for each setting's verifybench.harness.dist.allreduce run."""
    out = ["--preset", args.preset, "--tp", str(args.tp), "--tokens", args.tokens, "--batches", args.batches,
           "--backend", args.backend or SWEEP_BACKENDS, "--mode", args.mode or SWEEP_MODES,
           "--hang-timeout", str(args.hang_timeout)]
    for flag, value in (("--hidden", args.hidden), ("--sizes", args.sizes), ("--pow2", args.pow2),
                        ("--warmup", args.warmup), ("--samples", args.samples),
                        ("--isolated-samples", args.isolated_samples), ("--calls-per-sample", args.calls_per_sample),
                        ("--run-tag", args.run_tag)):
        if value is not None:
            out += [flag, str(value)]
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """torchrun and its ranks share the process group we started them in: end all of them."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_setting(label: str, env_setting: dict, folder: Path, args, nproc: int) -> dict:
    """One fresh torchrun under `env_setting`; returns its status, log summary and results (if any)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    force_safe_env(env)
    env.update(env_setting)
    if "NCCL_DEBUG" not in os.environ:
        env.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": LOG_SUBSYS,
                    "NCCL_DEBUG_FILE": str(folder / "nccl.%h.%p.log")})
    extra = shlex.split(args.torchrun_args)
    cmd = [sys.executable, "-m", "torch.distributed.run", *([] if extra else ["--standalone"]),
           f"--nproc-per-node={nproc}", *extra, "-m", "verifybench.harness.dist.allreduce", *worker_argv(args),
           "--out", str(folder), "--name", "allreduce.json", "--label", label, "--no-nccl-log"]
    t0 = time.monotonic()
    with open(folder / "output.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.setting_timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    wall_s = time.monotonic() - t0
    run = None
    try:
        run = results.load_run(folder / "allreduce.json")
    except results.ResultsError:
        pass
    status = "ok" if rc == 0 else (f"timeout after {args.setting_timeout:.0f} s" if rc is None else f"exit {rc}")
    tail = (folder / "output.log").read_text(errors="replace").splitlines()[-12:] if rc != 0 else []
    return {"label": label, "env": env_setting, "status": status, "wall_s": wall_s, "run": run,
            "nccl_log": parse_nccl_logs(folder), "output_tail": tail, "folder": str(folder)}


def _times(outcome: dict) -> dict[tuple[str, int], float]:
    """(backend, size) -> graph-mode time (us) of the passing cases of one setting's run."""
    run = outcome["run"] or {"cases": []}
    return {(c["params"]["backend"], c["params"]["size_bytes"]): c["derived"]["time_us"]
            for c in run["cases"] if c["check"]["ok"] and c["params"]["mode"] == "graph"}


def summary_tables(outcomes: list[dict]) -> list[tuple[str, list[dict]]]:
    """Per setting the graph-mode time per size; per size the fastest setting against the default."""
    times = {o["label"]: _times(o) for o in outcomes}
    keys = sorted({k for t in times.values() for k in t})
    sizes = sorted({s for _, s in keys})
    backends = sorted({b for b, _ in keys}, key=lambda b: (b != "pynccl", b))
    grid = []
    for o in outcomes:
        for b in backends:
            row = {"setting": o["label"], "backend": b}
            row.update({f"{s}B": times[o["label"]].get((b, s)) for s in sizes})
            row.update({"transport": transport_summary(o["nccl_log"]), "status": o["status"]})
            grid.append(row)
    base = times.get("default", {})
    best = []
    for b, s in keys:
        candidates = sorted((t[(b, s)], label) for label, t in times.items() if (b, s) in t)
        row = {"backend": b, "size(B)": s, "default(us)": base.get((b, s)), "fastest": candidates[0][1],
               "time(us)": candidates[0][0]}
        if base.get((b, s)):
            row["gain vs default"] = f"{100 * (1 - candidates[0][0] / base[(b, s)]):+.1f}%"
        best.append(row)
    overall = []
    for b in backends:
        for label, t in times.items():
            common = [s for s in sizes if (b, s) in t and (b, s) in base]
            if common and len(common) == len([s for s in sizes if (b, s) in base]):
                geo = math.exp(sum(math.log(t[(b, s)] / base[(b, s)]) for s in common) / len(common))
                overall.append({"backend": b, "setting": label, "time / default (geomean over sizes)": geo})
    overall.sort(key=lambda r: (r["backend"], r["time / default (geomean over sizes)"]))
    return [("graph-mode time (us) per NCCL setting, max over ranks", grid),
            ("fastest setting per size", best), ("settings ranked (all sizes)", overall)]


def run_sweep(args) -> int:
    settings = [parse_setting(s) for s in (args.setting or DEFAULT_SETTINGS)]
    nproc = args.nproc_per_node or _gpu_count() or 2
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    root = Path(args.out or results.RESULTS_DIR / _machine_slug()) / f"allreduce-sweep-{stamp}"
    outcomes = []
    t0 = time.monotonic()
    for i, (label, env) in enumerate(settings):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-").lower()
        print(f"[sweep {i + 1}/{len(settings)}] {label} ...", end=" ", flush=True)
        if args.sweep_time_limit and time.monotonic() - t0 + args.setting_timeout > args.sweep_time_limit:
            print("skipped: the sweep's time limit would be exceeded", flush=True)
            outcomes.append({"label": label, "env": env, "status": "skipped (time limit)", "wall_s": 0.0, "run": None,
                             "nccl_log": {}, "output_tail": [], "folder": None})
            continue
        outcome = run_setting(label, env, root / f"{i:02d}-{slug}", args, nproc)
        print(f"{outcome['status']} in {outcome['wall_s']:.0f} s; transport {transport_summary(outcome['nccl_log'])}",
              flush=True)
        outcomes.append(outcome)
    fp = next((o["run"]["fingerprint"] for o in outcomes if o["run"]), fingerprint.collect())
    cases = [{**c, "name": f"{o['label']}/{c['name']}", "params": {**c["params"], "nccl_setting": o["label"],
                                                                  "nccl_env": o["env"]}}
             for o in outcomes if o["run"] for c in o["run"]["cases"]]
    extra = {"nproc_per_node": nproc, "settings": [{k: v for k, v in o.items() if k != "run"} for o in outcomes]}
    run = results.make_run("allreduce_sweep", [], fp, extra)
    run["cases"] = cases
    path = results.write_json_atomic(root / "summary.json", results.validate_run(run, "sweep summary"))
    for title, rows in summary_tables(outcomes):
        if rows:
            print(f"\n{title}\n" + tabulate(rows, headers="keys", floatfmt=".2f", missingval="-"))
    for o in outcomes:
        if o["status"] != "ok":
            print(f"\n{o['label']}: {o['status']}; last output:\n  " + "\n  ".join(o["output_tail"]))
    print(f"saved {path}")
    return 0 if all(o["status"] in ("ok", "skipped (time limit)") for o in outcomes) else 1
