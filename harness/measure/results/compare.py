"""Noise-aware comparison of two runs: per-case verdict SAME / FAST / SLOW / AMBG, and the fingerprint diff.

Reads the suite's result files and pytest-benchmark JSON (with or without raw data; compare_files.py). Per case: a
Mann-Whitney U test on the samples (or, when a file has only summaries, whether the intervals overlap) and a minimum
effect: |change| < min effect is SAME; significant and >= min effect is SLOW or FAST; not significant but >= min
effect is AMBG. A case whose check failed in NEW is FAIL; a case skipped in either file (it could not run there) gets no
verdict and is listed. Samples, when a file has them, are the truth: the summary is recomputed from them, and a file
whose stored summary disagrees with its samples, or with null, non-finite or non-positive figures, is refused.
compare warns when BASE and NEW were measured by different method versions.
Exit 0: no case SLOW or FAIL; 1: a regression; 2: bad input (a file or an argument, named on stderr).
Two CPU runs (stance.py: CPU numbers carry no verdict): the samples side by side, no verdict, exit 0 unless a check
failed in NEW (a correctness failure, not a timing).
"""
from __future__ import annotations

import sys
from pathlib import Path

from tabulate import tabulate

from verifybench.harness.measure.host import fingerprint as fpmod
from verifybench.harness.measure.results import store
from verifybench.harness.measure import stance
from verifybench.harness.measure.results import compare_cpu, result_files
# compare.load and its types, for compare's importers
from verifybench.harness.measure.results.compare_files import CaseData, RunData, load  # noqa: F401
from verifybench.harness.measure.timing.modes import HOST_TIMED_MODES
from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_OK, EXIT_FAILED as EXIT_SLOW  # noqa: E402
# fields that change between any two runs of the same machine: never a reason to distrust a comparison
VOLATILE = ("created_utc", ".now.")
MIN_SAMPLES_FOR_TEST = 5


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
        from scipy import stats  # ~0.8 s to import: only a comparison with samples needs it

        p = stats.mannwhitneyu(base.samples_us, new.samples_us, alternative="two-sided").pvalue
        significant, how = p < alpha, f"U p={p:.2g}"
    else:
        (b_lo, b_hi), (n_lo, n_hi) = base.interval_us, new.interval_us
        significant = n_lo > b_hi or n_hi < b_lo
        how = "intervals " + ("disjoint" if significant else "overlap")
    if change == 0 or abs(change) < min_effect:  # identical medians are SAME at any min effect, 0 included
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
    """One verdict row per case in both files that ran in both; lines for the cases in one file only and for the
    cases skipped (could not run there: no verdict)."""
    rows, only = [], []
    for name in base.cases.keys() | new.cases.keys():
        skipped = [f"{label} ({run.cases[name].skipped})" for label, run in (("BASE", base), ("NEW", new))
                   if name in run.cases and run.cases[name].skipped]
        if skipped:
            only.append(f"skipped in {' and '.join(skipped)}: {name}")
            continue
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

    q.add_argument("base", type=_Path, help="baseline: a suite result JSON (.json or .json.gz), pytest-benchmark "
                   "JSON, or a results folder (its latest file of NEW's kind)")
    q.add_argument("new", type=_Path, nargs="+", help="the run to judge, same formats; a results folder (its latest "
                   "file of BASE's kind), or several files of one kind as a glob gives them (the latest is used)")
    q.add_argument("--kind", default=None, help="the kind of result to take from a folder (the file-name prefix "
                   "before -<UTC time>, e.g. verify); default: the kind the other side's file name says")
    q.add_argument("--min-effect", type=float, default=0.03,
                   help="smallest relative change that counts, in [0, 1) (default 0.03 = 3%%)")
    q.add_argument("--alpha", type=float, default=0.01, help="significance level of the test, in (0, 1) (default 0.01)")
    q.add_argument("--allow-different-hardware", action="store_true", help="compare across GPU models anyway")


def inputs(args) -> tuple[Path, Path, list[str]]:
    """(BASE file, NEW file, notes saying which file a folder or a glob gave): a folder gives its latest file of
    the kind --kind or the other side's file name says."""
    base, new = [args.base], list(args.new) if isinstance(args.new, (list, tuple)) else [args.new]
    for label, given in (("BASE", base), ("NEW", new)):  # a missing file is named as its own side's, first
        if len(given) == 1 and not Path(given[0]).exists():
            raise store.ResultsError(f"{label} {given[0]}: no such file or folder")
    kind = getattr(args, "kind", None)
    if kind is None:
        files = [g for g in (base, new) if not (len(g) == 1 and g[0].is_dir())]
        named = {result_files.kind_of(p) for g in files for p in g} - {None}
        if len(files) < 2 and len(named) == 1:
            kind = named.pop()
        elif not files:
            shared = sorted(set(result_files.kinds_in(base[0])) & set(result_files.kinds_in(new[0])))
            raise store.ResultsError(f"BASE {base[0]} and NEW {new[0]} are both folders: name the kind with "
                                       f"--kind (both hold: {', '.join(shared) or 'no kind in common'})")
    folders = [(label, g[0]) for label, g in (("BASE", base), ("NEW", new)) if len(g) == 1 and g[0].is_dir()]
    if kind is None and folders:
        label, folder = folders[0]
        raise store.ResultsError(f"{label} {folder} is a folder and the other side's file name says no kind of "
                                   f"result to take from it: {_pass_kind(folder)}")
    kinds = (kind,) if kind else ()
    try:
        (b, nb), (n, nn) = result_files.pick_input(base, kinds, "BASE"), result_files.pick_input(new, kinds, "NEW")
    except store.ResultsError as e:
        if getattr(args, "kind", None) is not None or not folders:
            raise
        # the kind came from the other side's file name (a name of the user's, new.json): say what to pass
        raise store.ResultsError(f"{e}; the kind {kind!r} came from the other side's file name: "
                                   f"{_pass_kind(folders[0][1])}") from None
    return b, n, [note for note in (nb, nn) if note]


def _pass_kind(folder: Path) -> str:
    """What to pass instead when a folder's kind is not known: --kind with a kind it holds, or a file."""
    held = result_files.kinds_in(folder)
    return (f"pass --kind {held[0]} (it holds: {', '.join(held)}), or name a file in it" if held else
            "it holds no result file; name a result file instead")


def _gpu(run: RunData) -> str:
    try:
        return str(fpmod.gpu_model(run.fingerprint))
    except ValueError as e:  # a fingerprint that contradicts itself (an edited GPU name)
        raise store.ResultsError(f"{run.path}: {e}") from None
    except (KeyError, TypeError, IndexError, AttributeError):
        raise store.ResultsError(f"{run.path}: the fingerprint's GPU entry is malformed") from None


def cpu_against_gpu(base: RunData, new: RunData, gb: str, gn: str) -> str | None:
    """The refusal when one side is a CPU smoke run and the other a GPU run: their cases (presets, shapes) are not
    the same, whatever the hardware flag says."""
    if not base.fingerprint or not new.fingerprint or (gb == "cpu") == (gn == "cpu"):
        return None
    side = lambda label, run, gpu: (f"{label} {run.path} is a CPU smoke run" if gpu == "cpu"  # noqa: E731
                                    else f"{label} {run.path} a GPU run ({gpu})")
    return (f"{side('BASE', base, gb)}, {side('NEW', new, gn)}: a CPU smoke run (the tiny preset) and a GPU run "
            "measure different cases and cannot be compared; compare CPU runs with CPU runs, GPU with GPU")


def cpu_numbers(*runs: RunData) -> bool:
    """Either run holds CPU numbers (stance.py): a CPU fingerprint, or no case timed anywhere but on the CPU (a GPU
    run's few host-timed rows, gloo's allreduce beside the GPU cases, leave it a GPU run: those rows are named
    host-timed in its verdicts)."""
    def cpu_only(run: RunData) -> bool:
        timed = [c for c in run.cases.values() if c.ok]
        return bool(timed) and all(c.device == "cpu" for c in timed)
    return any(stance.cpu_fingerprint(r.fingerprint) or cpu_only(r) for r in runs)


def _version(run: RunData) -> str:
    return str(run.method_version) if run.method_version is not None else "unknown (a file from before the field)"


def run(args) -> int:
    if not 0 <= args.min_effect < 1:  # NaN fails this too
        print(f"error: --min-effect must be in [0, 1), got {args.min_effect}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not 0 < args.alpha < 1:
        print(f"error: --alpha must be in (0, 1), got {args.alpha}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        base_path, new_path, notes = inputs(args)
        base, new = load(base_path), load(new_path)
        gb, gn = _gpu(base), _gpu(new)
    except store.ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    refusal = cpu_against_gpu(base, new, gb, gn)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for note in notes:
        print(note)
    if not base.fingerprint or not new.fingerprint:
        print("WARNING: a file carries no verifybench fingerprint: the hardware cannot be checked")
    elif gb != gn and not args.allow_different_hardware:
        print(f"error: different GPU models ({gb} vs {gn}); pass --allow-different-hardware to compare anyway",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if cpu_numbers(base, new):
        print(f"BASE {base.path} ({base.kind})\nNEW  {new.path} ({new.kind})")
        return compare_cpu.report(base, new, EXIT_OK, EXIT_SLOW)
    rows, only = compare_runs(base, new, args.min_effect, args.alpha)
    if not rows:
        shared = base.cases.keys() & new.cases.keys()
        print(f"error: {base.path} and {new.path} share no case" if not shared else
              f"error: no case ran in both {base.path} and {new.path} ({len(shared)} shared, every one skipped)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if all(r["host_%"] is None for r in rows):  # files from before the probe: no empty column
        for r in rows:
            del r["host_%"]
    print(f"BASE {base.path} ({base.kind})\nNEW  {new.path} ({new.kind})")
    print(f"min effect {args.min_effect:.1%}, alpha {args.alpha:g}")
    if base.method_version != new.method_version:
        print(f"WARNING: BASE was measured by method version {_version(base)}, NEW by {_version(new)}: a change of "
              "the measuring method alone can move figures (measure/timing/timer.py METHOD_VERSION says what changed)")
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
              "(docs/measuring.md, 'Host-timed figures do not repeat across processes'); compare them within one "
              "process")
        followed = [r for r in host_moves if host_moved_along(r, args.min_effect)]
        if followed:
            print(f"NOTE: in {len(followed)} of them the host-speed probe moved the same way by at least "
                  f"{args.min_effect:.0%} (column host_%): the host's CPU changed speed, e.g. {followed[0]['case']}")
    moved = [r for r in rows if r["state_differs"] and r["verdict"] != "SAME"]
    if moved:
        print(f"NOTE: {len(moved)} non-SAME case(s) ran in a different process state in BASE and NEW (cupy imported, "
              "process group): that alone moved tiny graph nodes by up to 31% on an H200 "
              f"(docs/FINDINGS.md, 'Measuring method'), e.g. {moved[0]['case']}")
    for label, timed in (("device-timed", False), ("host-timed", True)):
        part = [r for r in rows if r["host_timed"] == timed]
        if part:
            print(f"{label}: {sum(r['verdict'] == 'SAME' for r in part)} of {len(part)} SAME")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("SAME", "FAST", "SLOW", "AMBG", "FAIL")}
    print("summary: " + ", ".join(f"{v} {c}" for v, c in counts.items() if c))
    return EXIT_SLOW if counts["SLOW"] or counts["FAIL"] else EXIT_OK
