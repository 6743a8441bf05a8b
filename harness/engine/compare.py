"""Noise-aware comparison of two runs: per-case verdict SAME / FAST / SLOW / AMBG, and the fingerprint diff.

Reads the suite's result files and pytest-benchmark JSON (with or without raw data). Per case: a Mann-Whitney U test
on the samples (or, when a file has only summaries, whether the intervals overlap) and a minimum effect:
|change| < min effect is SAME; significant and >= min effect is SLOW or FAST; not significant but >= min effect is
AMBG. A case whose check failed in NEW is FAIL. Exit 0: no case SLOW or FAIL; 1: a regression; 2: bad input.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats
from tabulate import tabulate

from verifybench.harness.engine import fingerprint as fpmod
from verifybench.harness.engine import results
from verifybench.harness.engine.timing import HOST_TIMED_MODES, host_timed

EXIT_OK, EXIT_SLOW, EXIT_BAD_INPUT = 0, 1, 2
# fields that change between any two runs of the same machine: never a reason to distrust a comparison
VOLATILE = ("created_utc", ".now.")
MIN_SAMPLES_FOR_TEST = 5


@dataclass
class CaseData:
    name: str
    mode: str | None
    ok: bool
    median_us: float | None = None
    samples_us: np.ndarray | None = None
    interval_us: tuple[float, float] | None = None  # median CI, or q1..q3 when that is all a file has
    throttled: bool = False
    host_probe_us: float | None = None  # mean of the engine's host-speed probes around the case (hostprobe.py)
    host_timed: bool = False  # its samples include host time (timing.host_timed)
    process_state: dict | None = None  # timing.process_state() when the case was sampled


@dataclass
class RunData:
    path: Path
    kind: str  # "suite" | "pytest-benchmark"
    fingerprint: dict
    cases: dict[str, CaseData]


def _probe(values) -> float | None:
    return float(np.mean(values)) if values else None


def _from_suite(path: Path, data: dict) -> RunData:
    run = results.validate_run(data, str(path))
    cases = {}
    for c in run["cases"]:
        if not c["check"]["ok"]:
            cases[c["name"]] = CaseData(c["name"], c.get("mode"), ok=False)
            continue
        s = c["summary"]
        lo, hi = s.get("ci_low_us"), s.get("ci_high_us")
        cases[c["name"]] = CaseData(c["name"], c["mode"], True, float(s["median_us"]),
                                    np.asarray(c["samples_us"], dtype=float),
                                    (lo, hi) if lo is not None and hi is not None else (s["q1_us"], s["q3_us"]),
                                    bool(c.get("throttled")), _probe(c.get("host_probe_us")),
                                    host_timed(c["mode"], c.get("device", "cuda")), c.get("process_state"))
    return RunData(path, "suite", run["fingerprint"], cases)


def _from_pytest_benchmark(path: Path, data: dict) -> RunData:
    if not isinstance(data.get("benchmarks"), list):
        raise results.ResultsError(f"{path}: pytest-benchmark JSON without a 'benchmarks' list")
    cases = {}
    for b in data["benchmarks"]:
        try:
            st = b["stats"]
            # the suite's case name when our adapter ran it: pytest and CLI results of a case then line up
            name = (b.get("extra_info") or {}).get("case") or b.get("fullname") or b["name"]
            raw = st.get("data")
            samples = np.asarray(raw, dtype=float) * 1e6 if raw else None
            extra = b.get("extra_info") or {}
            cases[name] = CaseData(name, extra.get("mode"), True, float(st["median"]) * 1e6, samples,
                                   (float(st["q1"]) * 1e6, float(st["q3"]) * 1e6), bool(extra.get("throttled")),
                                   _probe(extra.get("host_probe_us")),
                                   host_timed(extra.get("mode") or "", extra.get("device") or "cuda"),
                                   extra.get("process_state"))
        except (KeyError, TypeError, ValueError) as e:
            raise results.ResultsError(f"{path}: malformed benchmark entry ({e!r})") from None
    machine = data.get("machine_info") or {}
    return RunData(path, "pytest-benchmark", machine.get("verifybench") or {}, cases)


def load(path: Path) -> RunData:
    """Either format; anything else raises ResultsError naming the file and the reason."""
    data = results.read_json(path)
    if data.get("schema") == results.SCHEMA or "schema" in data:
        return _from_suite(Path(path), data)
    if "benchmarks" in data and "machine_info" in data:
        return _from_pytest_benchmark(Path(path), data)
    raise results.ResultsError(f"{path}: neither a verifybench result nor a pytest-benchmark JSON file")


def verdict(base: CaseData, new: CaseData, min_effect: float = 0.03, alpha: float = 0.01) -> tuple[str, float, str]:
    """(verdict, relative change of the median, how significance was judged).

    Significant (Mann-Whitney U p < alpha on the samples, or non-overlapping intervals when only summaries exist)
    and |change| >= min_effect: SLOW or FAST. |change| < min_effect: SAME (a real but negligible difference is
    SAME). A change >= min_effect that is not significant: AMBG.
    """
    if not new.ok:
        return "FAIL", float("nan"), "check failed in NEW"
    if not base.ok:
        return "AMBG", float("nan"), "check failed in BASE"
    if base.mode and new.mode and base.mode != new.mode:
        return "AMBG", float("nan"), f"modes differ ({base.mode} vs {new.mode})"
    change = new.median_us / base.median_us - 1
    if (base.samples_us is not None and new.samples_us is not None
            and min(len(base.samples_us), len(new.samples_us)) >= MIN_SAMPLES_FOR_TEST):
        p = stats.mannwhitneyu(base.samples_us, new.samples_us, alternative="two-sided").pvalue
        significant, how = p < alpha, f"U p={p:.2g}"
    else:
        (b_lo, b_hi), (n_lo, n_hi) = base.interval_us, new.interval_us
        significant = n_lo > b_hi or n_hi < b_lo
        how = "intervals " + ("disjoint" if significant else "overlap")
    if abs(change) < min_effect:
        return "SAME", change, how
    if not significant:
        return "AMBG", change, how
    return ("SLOW" if change > 0 else "FAST"), change, how


def _flatten(d, prefix="") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = d
    return out


def fingerprint_diff(base: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, base value, new value) for every stable field that differs; missing values are None."""
    fb, fn = _flatten(base), _flatten(new)
    keys = sorted(set(fb) | set(fn))
    return [(k, fb.get(k), fn.get(k)) for k in keys
            if fb.get(k) != fn.get(k) and not any(v in f".{k}." or k.startswith(v) for v in VOLATILE)]


def env_warnings(base: dict, new: dict) -> list[str]:
    """One line per NCCL_* / CUDA_* variable that changed, vanished or appeared (a lost NCCL setting cost a real
    deployment ~30% of its throughput)."""
    eb, en = base.get("env") or {}, new.get("env") or {}
    lines = []
    for k in sorted(set(eb) | set(en)):
        if not k.startswith(("NCCL_", "CUDA_")) or eb.get(k) == en.get(k):
            continue
        if k not in en:
            lines.append(f"WARNING: {k} is missing in NEW (BASE had {k}={eb[k]})")
        elif k not in eb:
            lines.append(f"WARNING: {k}={en[k]} is set in NEW but not in BASE")
        else:
            lines.append(f"WARNING: {k} changed: {eb[k]} -> {en[k]}")
    return lines


def compare_runs(base: RunData, new: RunData, min_effect: float, alpha: float) -> tuple[list[dict], list[str]]:
    rows, only = [], []
    for name in base.cases.keys() | new.cases.keys():
        if name not in new.cases:
            only.append(f"only in BASE: {name}")
            continue
        if name not in base.cases:
            only.append(f"only in NEW: {name}")
            continue
        b, n = base.cases[name], new.cases[name]
        v, change, how = verdict(b, n, min_effect, alpha)
        host = (n.host_probe_us / b.host_probe_us - 1) * 100 if b.host_probe_us and n.host_probe_us else None
        rows.append({"case": name, "mode": n.mode or b.mode, "base_us": b.median_us, "new_us": n.median_us,
                     "change_%": change * 100, "host_%": host, "test": how, "verdict": v,
                     "host_timed": n.host_timed or b.host_timed,
                     "state_differs": bool(b.process_state and n.process_state and b.process_state != n.process_state)})
    rows.sort(key=lambda r: r["case"])
    return rows, sorted(only)


def host_moved_along(row: dict, min_effect: float) -> bool:
    """The host probe changed by >= min_effect in the direction the case did (both slower or both faster)."""
    host = row.get("host_%")
    return host is not None and abs(host) >= min_effect * 100 and (host > 0) == (row["change_%"] > 0)


def add_arguments(q) -> None:
    from pathlib import Path as _Path

    q.add_argument("base", type=_Path, help="baseline: a suite result JSON (.json or .json.gz) or pytest-benchmark JSON")
    q.add_argument("new", type=_Path, help="the run to judge, same formats")
    q.add_argument("--min-effect", type=float, default=0.03, help="smallest relative change that counts, in [0, 1) "
                   "(default 0.03 = 3%%)")
    q.add_argument("--alpha", type=float, default=0.01, help="significance level of the test, in (0, 1) (default 0.01)")
    q.add_argument("--allow-different-hardware", action="store_true", help="compare across GPU models anyway")


def run(args) -> int:
    if not 0 <= args.min_effect < 1 or not 0 < args.alpha < 1:
        print("error: --min-effect must be in [0, 1) and --alpha in (0, 1)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        base, new = load(args.base), load(args.new)
    except results.ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    gb, gn = fpmod.gpu_model(base.fingerprint), fpmod.gpu_model(new.fingerprint)
    if not base.fingerprint or not new.fingerprint:
        print("WARNING: a file carries no verifybench fingerprint: the hardware cannot be checked")
    elif gb != gn and not args.allow_different_hardware:
        print(f"error: different GPU models ({gb} vs {gn}); pass --allow-different-hardware to compare anyway",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    rows, only = compare_runs(base, new, args.min_effect, args.alpha)
    if not rows:
        print("error: the two files share no case", file=sys.stderr)
        return EXIT_BAD_INPUT
    if all(r["host_%"] is None for r in rows):  # files from before the probe: no empty column
        for r in rows:
            del r["host_%"]
    print(f"BASE {base.path} ({base.kind})\nNEW  {new.path} ({new.kind})")
    print(f"min effect {args.min_effect:.1%}, alpha {args.alpha:g}")
    hidden = ("host_timed", "state_differs")
    print(tabulate([{k: v for k, v in r.items() if k not in hidden} for r in rows], headers="keys", floatfmt=".4g"))
    for line in only:
        print(line)
    diff = fingerprint_diff(base.fingerprint, new.fingerprint)
    print("\nfingerprint diff: " + ("none" if not diff else ""))
    if diff:
        print(tabulate(diff, headers=["field", "BASE", "NEW"]))
    for line in env_warnings(base.fingerprint, new.fingerprint):
        print(line)
    for label, run in (("BASE", base), ("NEW", new)):
        hot = [c.name for c in run.cases.values() if c.throttled]
        if hot:
            print(f"WARNING: {label}: the GPU throttled during {len(hot)} case(s), e.g. {hot[0]}")
    host_moves = [r for r in rows if r["verdict"] in ("SLOW", "FAST") and r["host_timed"]]
    if host_moves:
        print(f"NOTE: {len(host_moves)} of the SLOW/FAST cases are host-timed ({', '.join(HOST_TIMED_MODES)} or a "
              "CPU timer): on shared VMs these moved by up to +-170% between two processes with no code change "
              "(README, 'Measured on our H200s'); compare them within one process")
        followed = [r for r in host_moves if host_moved_along(r, args.min_effect)]
        if followed:
            print(f"NOTE: in {len(followed)} of them the host-speed probe moved the same way by at least "
                  f"{args.min_effect:.0%} (column host_%): the host's CPU changed speed, e.g. {followed[0]['case']}")
    moved = [r for r in rows if r["state_differs"] and r["verdict"] != "SAME"]
    if moved:
        print(f"NOTE: {len(moved)} non-SAME case(s) ran in a different process state in BASE and NEW (cupy imported, "
              "process group): that alone moved tiny graph nodes by up to 30% on an H200 (README), "
              f"e.g. {moved[0]['case']}")
    for label, timed in (("device-timed", False), ("host-timed", True)):
        part = [r for r in rows if r["host_timed"] == timed]
        if part:
            print(f"{label}: {sum(r['verdict'] == 'SAME' for r in part)} of {len(part)} SAME")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("SAME", "FAST", "SLOW", "AMBG", "FAIL")}
    print("summary: " + ", ".join(f"{v} {c}" for v, c in counts.items() if c))
    return EXIT_SLOW if counts["SLOW"] or counts["FAIL"] else EXIT_OK
