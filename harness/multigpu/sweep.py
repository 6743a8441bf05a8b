# Over 400 lines: the sweep's settings, its torchrun driver and its ranking are one job's steps.
"""NCCL setting sweep: each setting (P2P/SHM transport, P2P level, protocol x algorithm, channels, buffer size,
threads, ...) runs in a fresh torchrun of verifybench.harness.multigpu.allreduce, the transport and algorithm NCCL chose
are read back from its INFO log, the settings are ranked at verify sizes, the best of each group is run combined,
and the winner is printed as `export` lines, all inside a time budget. On CPU (gloo) the sweep checks its plumbing
only: the times per setting, no ranking, no combined run, no winner and no `export` line (measure/stance.py).

Fresh processes, not fresh process groups: NCCL caches most of its parameters the first time it reads them in a
process (NCCL_PARAM), so a second communicator in the same process would silently keep the first setting.
"""
from __future__ import annotations

import ctypes
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

from verifybench.harness.analysis.numbers import split_list
from verifybench.harness.measure.host import fingerprint
from verifybench.harness.measure import stance
from verifybench.harness.measure.results import store, tables
from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from verifybench.harness.multigpu.driver import SAFE_ENV, force_safe_env

# Knobs that matter for small allreduces on one node, PCIe boxes without NVLink first. "default" is the environment
# as launched. A setting's group comes from its variables (VAR_GROUP): the settings of a group are alternatives,
# different groups are independent, so the sweep ends by combining the best of each. NVLS stays off (SAFE_ENV).
DEFAULT_SETTINGS = (
    "default",
    "NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1",
    "NCCL_P2P_LEVEL=PXB", "NCCL_P2P_LEVEL=PHB", "NCCL_P2P_LEVEL=SYS",
    *(f"NCCL_PROTO={p},NCCL_ALGO={a}" for p in ("LL", "LL128", "Simple") for a in ("Ring", "Tree")),
    *(f"NCCL_MIN_NCHANNELS={c},NCCL_MAX_NCHANNELS={c}" for c in (1, 4, 8, 16, 32)),
    *(f"NCCL_BUFFSIZE={b}" for b in (1 << 20, 2 << 20, 8 << 20)),
    *(f"NCCL_NTHREADS={t}" for t in (64, 128, 256, 512)),
    "NCCL_CUMEM_ENABLE=0",  # legacy IPC handles instead of cuMem
    "NCCL_GRAPH_MIXING_SUPPORT=0",  # no extra cross-stream ordering for mixing graph and eager NCCL calls
)
QUICK_SETTINGS = ("default", "NCCL_PROTO=LL,NCCL_ALGO=Ring")  # the plumbing in two jobs
VAR_GROUP = {"NCCL_P2P_DISABLE": "transport", "NCCL_SHM_DISABLE": "transport", "NCCL_P2P_LEVEL": "transport",
             "NCCL_PROTO": "protocol x algorithm", "NCCL_ALGO": "protocol x algorithm",
             "NCCL_MIN_NCHANNELS": "channels", "NCCL_MAX_NCHANNELS": "channels",
             "NCCL_BUFFSIZE": "buffer size", "NCCL_NTHREADS": "threads"}
COMBINED = "best of each group combined"
GPU_SWEEP_BACKENDS, CPU_SWEEP_BACKENDS = "nccl,pynccl", "gloo"
SWEEP_MODES = "graph"
LOG_SUBSYS = "INIT,ENV,GRAPH,TUNING"
ALGO_IDS = {0: "Tree", 1: "Ring", 2: "CollNetDirect", 3: "CollNetChain", 4: "NVLS", 5: "NVLSTree", 6: "PAT"}
PROTO_IDS = {0: "LL", 1: "LL128", 2: "Simple"}
DEFAULT_BUDGET_S = 1800.0
COMPONENT = "allreduce_sweep"  # the summary's kind, and the prefix of the sweep's folder
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def parse_setting(text: str) -> tuple[str, dict]:
    """'NCCL_PROTO=LL,NCCL_ALGO=Ring' -> (label, env); 'default' -> ('default', {}). Refuses multicast."""
    text = text.strip()
    if text in ("", "default"):
        return "default", {}
    env = {}
    for part in split_list(text, "", "NCCL_NAME=VALUE[,NCCL_NAME=VALUE...] or default"):
        key, eq, value = part.partition("=")
        if not eq or not key.startswith("NCCL_"):
            raise ValueError(f"bad setting {part!r} in {text!r}: expected NCCL_NAME=VALUE")
        env[key] = value
    if env.get("NCCL_NVLS_ENABLE", "0") != "0" or ("NVLS" in env.get("NCCL_ALGO", "").upper()
                                                    and not env["NCCL_ALGO"].startswith("^")):
        raise ValueError(f"setting {text!r} would use NVLS multicast, which stays off on these machines")
    return text, env


def group_of(env: dict) -> str:
    """'protocol x algorithm', 'transport+threads', ...; 'default' for no variables."""
    return "+".join(sorted({VAR_GROUP.get(k, k) for k in env})) or "default"


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


def worker_argv(args, backends: str) -> list[str]:
    """The measurement options of this command line, for each setting's verifybench.harness.multigpu.allreduce run."""
    out = ["--preset", args.preset, "--tp", str(args.tp), "--tokens", ",".join(map(str, args.tokens)),
           "--batches", ",".join(map(str, args.batches)),
           "--backend", args.backend or backends, "--mode", args.mode or SWEEP_MODES,
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


def _end_with_driver() -> None:
    """In each setting's torchrun, before exec: SIGTERM when the driver dies, however it dies (SIGKILL included,
    which no handler of the driver's sees), so that no torchrun and no rank outlive it. Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (timeout, kill) ends the current setting's job as Ctrl-C does


def run_setting(label: str, env_setting: dict, folder: Path, args, nproc: int, backends: str,
                timeout_s: float) -> dict:
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
           f"--nproc-per-node={nproc}", *extra, "-m", "verifybench.harness.multigpu.allreduce",
           *worker_argv(args, backends), "--out", str(folder), "--name", "allreduce.json", "--label", label,
           "--no-nccl-log"]
    t0 = time.monotonic()
    with open(folder / "output.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_end_with_driver)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    wall_s = time.monotonic() - t0
    run = None
    try:
        run = store.load_run(folder / "allreduce.json")
    except store.ResultsError:
        pass
    status = "ok" if rc == 0 else (f"timeout after {timeout_s:.0f} s" if rc is None else f"exit {rc}")
    tail = (folder / "output.log").read_text(errors="replace").splitlines()[-12:] if rc != 0 else []
    return {"label": label, "group": group_of(env_setting), "env": env_setting, "status": status, "wall_s": wall_s,
            "run": run, "nccl_log": parse_nccl_logs(folder), "output_tail": tail, "folder": str(folder)}


# ---- ranking ----

def _times(outcome: dict, verify_only: bool = False) -> dict[tuple[str, int], float]:
    """(backend, size) -> graph-mode time (us) of the passing cases of one setting's run; `verify_only`: only the
    verify sizes (hidden x n tokens x 2 B, one request)."""
    run = outcome["run"] or {"cases": []}
    return {(c["params"]["backend"], c["params"]["size_bytes"]): c["derived"]["time_us"]
            for c in run["cases"] if c["check"]["ok"] and c["params"]["mode"] == "graph"
            and (not verify_only or re.fullmatch(r"\d+ tok", c["params"].get("origin", "")))}


def rank_settings(outcomes: list[dict]) -> list[dict]:
    """Settings by the geometric mean of their graph-mode times over the verify sizes and backends (those the
    default measured, else all measured), fastest first; a setting missing one is left out, not ranked on fewer."""
    times = {o["label"]: _times(o, verify_only=True) for o in outcomes if o["status"] == "ok"}
    times = {label: t for label, t in times.items() if t}
    if not times:
        return []
    common = set(times["default"]) if "default" in times else set().union(*times.values())
    times = {label: t for label, t in times.items() if common <= set(t)}
    geo = {label: math.exp(sum(math.log(t[k]) for k in common) / len(common)) for label, t in times.items()}
    base = geo.get("default")
    groups = {o["label"]: o["group"] for o in outcomes}
    rows = [{"setting": label, "group": groups[label], "geomean(us)": g,
             "x default": g / base if base else None} for label, g in geo.items()]
    return sorted(rows, key=lambda r: r["geomean(us)"])


def base_groups(group: str) -> set[str]:
    return set(group.split("+"))


def combine_winners(outcomes: list[dict], ranking: list[dict]) -> tuple[list[str], dict] | None:
    """The fastest setting of each group (beating the default where one ran), combined while their groups do not
    overlap; None when fewer than two groups contribute (the combination would be one of the runs)."""
    env_of = {o["label"]: o["env"] for o in outcomes}
    base = next((r["geomean(us)"] for r in ranking if r["setting"] == "default"), None)
    taken, labels, env = set(), [], {}
    for r in ranking:  # fastest first: the first of each group is its winner
        if r["setting"] in ("default", COMBINED) or (base is not None and r["geomean(us)"] >= base):
            continue
        groups = base_groups(r["group"])
        if groups & taken:
            continue
        taken |= groups
        labels.append(r["setting"])
        env.update(env_of[r["setting"]])
    return (labels, env) if len(labels) > 1 else None


def export_lines(env_setting: dict, launched: dict) -> list[str]:
    """The winning environment as shell lines: the NCCL_* variables every setting ran under (as launched) with the
    winner's on top. Nothing the sweep did not measure: the multicast switches it forces are not added (on an
    NVSwitch box they would turn NVLS off)."""
    merged = {k: v for k, v in launched.items() if k.startswith("NCCL_") and not k.startswith("NCCL_DEBUG")}
    merged.update(env_setting)
    return [f"export {k}={shlex.quote(v)}" for k, v in sorted(merged.items())]


def summary_tables(outcomes: list[dict], cpu: bool = False) -> list[tuple[str, list[dict]]]:
    """Per setting the graph-mode time per size; per size the fastest setting against the default; the ranking.
    `cpu` (or CPU-timed cases): the times only, no fastest setting and no ranking (CPU numbers, stance.py)."""
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
    records = [c for o in outcomes if o.get("run") for c in o["run"]["cases"]]
    if cpu or stance.cpu_numbers(records):  # gloo on CPU: an order between NCCL settings is noise on unread variables
        return [("cpu-loop time (us) per NCCL setting, max over ranks (CPU numbers: K calls in a Python loop, no CUDA "
                 "graph; not ranked)", grid)]
    base = times.get("default", {})
    best = []
    for b, s in keys:
        candidates = sorted((t[(b, s)], label) for label, t in times.items() if (b, s) in t)
        row = {"backend": b, "size(B)": s, "default(us)": base.get((b, s)), "fastest": candidates[0][1],
               "time(us)": candidates[0][0]}
        if base.get((b, s)):
            row["gain vs default"] = f"{100 * (1 - candidates[0][0] / base[(b, s)]):+.1f}%"
        best.append(row)
    ranking = rank_settings(outcomes)
    return [("graph-mode time (us) per NCCL setting, max over ranks", grid), ("fastest setting per size", best),
            ("settings ranked at verify sizes (geomean over sizes and backends)", ranking)]


# ---- the driver ----

def sweep_settings(args) -> list[tuple[str, dict]]:
    return [parse_setting(s) for s in (args.setting or (QUICK_SETTINGS if args.quick else DEFAULT_SETTINGS))]


def print_setting_list(settings: list[tuple[str, dict]], combine: bool = True) -> None:
    print(f"NCCL settings ({len(settings)}, each in a fresh torchrun; then the {COMBINED}):" if combine
          else f"NCCL settings ({len(settings)}, each in a fresh torchrun):")
    for i, (label, env) in enumerate(settings):
        print(f"  {i + 1:2d}. [{group_of(env)}] {label}")


def _skipped(label: str, env: dict, why: str) -> dict:
    return {"label": label, "group": group_of(env), "env": env, "status": f"skipped ({why})", "wall_s": 0.0,
            "run": None, "nccl_log": {}, "output_tail": [], "folder": None}


def run_sweep(args) -> int:
    try:
        settings = sweep_settings(args)
    except ValueError as e:
        print(f"error: --setting: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.list:
        print_setting_list(settings)
        return EXIT_OK
    gpus = _gpu_count()
    nproc = args.nproc_per_node or gpus or 2
    backends = GPU_SWEEP_BACKENDS if gpus else CPU_SWEEP_BACKENDS
    budget_s = args.sweep_time_limit or DEFAULT_BUDGET_S
    launched = dict(os.environ)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    root = Path(args.out or store.DEFAULT_OUT / _machine_slug()) / f"{COMPONENT}-{stamp}"
    print_setting_list(settings)
    print(f"{nproc} ranks per setting, backends {args.backend or backends}, time budget {budget_s:.0f} s "
          f"(--sweep-time-limit), at most {args.setting_timeout:.0f} s per setting", flush=True)
    cpu = "gloo" in (args.backend or backends).split(",")
    if cpu:
        print("NOTE: gloo on CPU: the NCCL variables do nothing here; this checks the sweep's plumbing: CPU numbers, "
              "no ranking, no winner and no export line.", flush=True)
    forced = {k: launched.get(k) for k, v in SAFE_ENV.items() if launched.get(k) != v}
    if forced:
        was = ", ".join(f"{k} {'unset' if v is None else repr(v)}" for k, v in forced.items())
        print(f"NOTE: every setting runs with {', '.join(f'{k}={SAFE_ENV[k]}' for k in forced)} (launched with {was}): "
              "multicast off" + ("" if cpu else "; the export lines leave these out: they name only what the sweep "
                                 "measured"), flush=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _sweep(settings, args, nproc, backends, budget_s, root, launched, cpu)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sweep(settings, args, nproc: int, backends: str, budget_s: float, root: Path, launched: dict, cpu: bool) -> int:
    t0 = time.monotonic()
    outcomes: list[dict] = []

    def run_one(i: int, total: int, label: str, env: dict) -> None:
        elapsed = time.monotonic() - t0
        left = budget_s - elapsed
        print(f"[sweep {i}/{total}, {elapsed:.0f}/{budget_s:.0f} s] {label} ...", end=" ", flush=True)
        longest = max((o["wall_s"] for o in outcomes), default=0.0)
        if left < max(10.0, longest):
            print("skipped: the time budget would be exceeded", flush=True)
            outcomes.append(_skipped(label, env, "time budget"))
            return
        slug = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-").lower()[:60]
        outcome = run_setting(label, env, root / f"{i - 1:02d}-{slug}", args, nproc, backends,
                              min(args.setting_timeout, left))
        print(f"{outcome['status']} in {outcome['wall_s']:.0f} s; transport {transport_summary(outcome['nccl_log'])}",
              flush=True)
        outcomes.append(outcome)

    total = len(settings) + 1
    for i, (label, env) in enumerate(settings):
        run_one(i + 1, total, label, env)
    combo = None if cpu else combine_winners(outcomes, rank_settings(outcomes))  # CPU: nothing won
    if cpu:
        print(f"[sweep {total}/{total}] {COMBINED}: not run (CPU numbers: no setting is ranked)", flush=True)
    elif combo:
        print(f"combining: {' + '.join(combo[0])}")
        run_one(total, total, COMBINED, combo[1])
    else:
        print(f"[sweep {total}/{total}] {COMBINED}: not run (fewer than two groups have a setting that beat the "
              "default)", flush=True)
    return _report(outcomes, nproc, root, launched, cpu)


def _report(outcomes: list[dict], nproc: int, root: Path, launched: dict, cpu: bool) -> int:
    ranking = [] if cpu else rank_settings(outcomes)  # CPU: no ranking, no winner, no export line (stance.py)
    winner = ranking[0] if ranking else None
    env_of = {o["label"]: o["env"] for o in outcomes}
    exports = export_lines(env_of[winner["setting"]], launched) if winner else []
    fp = next((o["run"]["fingerprint"] for o in outcomes if o["run"]), None) or fingerprint.collect()
    cases = [{**c, "name": f"{o['label']}/{c['name']}", "params": {**c["params"], "nccl_setting": o["label"],
                                                                  "nccl_env": o["env"]}}
             for o in outcomes if o["run"] for c in o["run"]["cases"]]
    extra = {"nproc_per_node": nproc, "settings": [{k: v for k, v in o.items() if k != "run"} for o in outcomes],
             "ranking": ranking, "winner": winner and {**winner, "env": env_of[winner["setting"]],
                                                       "exports": exports}}
    if cpu:
        extra["recommendation"] = stance.NO_NCCL_ADVICE
    run = store.make_run(COMPONENT, [], fp, extra)
    run["cases"] = cases
    root.mkdir(parents=True, exist_ok=True)
    # beside the folder of per-setting runs, named as every result is (<kind>-<stamp>.json): found with the others
    path = store.write_json_atomic(root.parent / f"{root.name}.json", store.validate_run(run, "sweep summary"))
    for title, rows in summary_tables(outcomes, cpu):
        if rows:  # CPU: through tables.render, which names a withheld column once above the table
            print(f"\n{title}\n" + (tables.render(rows) if cpu else
                                     tabulate(rows, headers="keys", floatfmt=".2f", missingval="-")))
    for o in outcomes:
        if o["status"] not in ("ok",) and not o["status"].startswith("skipped"):
            print(f"\n{o['label']}: {o['status']}; last output:\n  " + "\n  ".join(o["output_tail"]))
    if cpu:
        print(f"\nno recommendation: {stance.NO_NCCL_ADVICE} (a plumbing check: the table says which settings ran "
              "and passed)")
    elif winner:
        if winner["setting"] == "default":
            what = "default (no setting beat the environment as launched)" + (", which sets:" if exports else "")
        else:
            what = f"{winner['setting']}; paste to use it:"
        print(f"\nfastest at verify sizes: {what}")
        if exports:
            print("\n".join(exports))
    else:
        print("\nno setting finished with passing checks at the verify sizes: nothing to recommend")
    print(f"saved {path}")
    passed = all(o["status"] == "ok" or o["status"].startswith("skipped") for o in outcomes)
    return EXIT_OK if passed else EXIT_FAILED
