"""`verifybench trace`: decomposes a serving engine's speculative cycle, read from PyTorch profiler traces (one
per rank), into components by kernel-name rules, with the GPU's idle (host-bound) time, beside the suite's parts.

Per cycle: busy time per component (sum of its kernels' durations), gpu_idle (window time with nothing running on
the GPU), overlap (busy time counted twice because kernels ran together: on two streams, or back to back with
programmatic dependent launch), total (the cycle's GPU window, first start to last end). They add up exactly:
sum(components) + gpu_idle - overlap = total. Ranks: each alone, then the max over ranks of each entry.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from verifybench.harness.analysis.numbers import TOKEN_COUNT_MAX, out_path, positive_int, tokens_upto
from verifybench.harness.answers.trace_against import against_table, load_against
from verifybench.harness.answers.trace_cycles import Cycle, find_cycles
from verifybench.harness.answers.trace_graphs import add_launch, add_rank_launch, launch_lines
from verifybench.harness.answers.trace_read import GpuOp, Trace, TraceError, read_ranks
from verifybench.harness.answers.trace_rules import ACCOUNTS, Classifier, RulesError, check_rules, load_rules

SCHEMA, SCHEMA_VERSION = "verifybench.trace", 1
from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_OK  # noqa: E402
# host calls that wait for the GPU: the cycle's device-to-host syncs
SYNC_CALL = re.compile(r"Synchronize|^cudaMemcpy(2D)?$|^cuMemcpy(DtoH|HtoD)?(_v2)?$")
OTHER_SHOWN = 10
SHORT_NAME_CHARS = 72  # an unmatched kernel's name in the report; --json keeps the full name


def _union_us(ops: list[GpuOp]) -> float:
    total, lo, hi = 0.0, None, None
    for op in sorted(ops, key=lambda o: o.start_us):
        if hi is None or op.start_us > hi:
            total += 0.0 if hi is None else hi - lo
            lo, hi = op.start_us, op.end_us
        else:
            hi = max(hi, op.end_us)
    return total + (0.0 if hi is None else hi - lo)


def cycle_parts(ops: list[GpuOp], classify: Classifier) -> tuple[dict[str, float], dict[str, list]]:
    """Busy microseconds per component, gpu_idle, overlap and total of one cycle's GPU work; and the unmatched
    ("other") kernels as name -> [calls, microseconds]."""
    parts: dict[str, float] = defaultdict(float)
    other: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for op in ops:
        comp = classify(op.name) if op.cat == "kernel" else "memcpy"
        parts[comp] += op.dur_us
        if comp == "other":
            other[op.name][0] += 1
            other[op.name][1] += op.dur_us
    union = _union_us(ops)
    window = max(op.end_us for op in ops) - min(op.start_us for op in ops) if ops else 0.0
    parts.update(gpu_idle=window - union, overlap=sum(op.dur_us for op in ops) - union, total=window)
    return parts, other


def _stats(rows: list[dict], keys: list[str]) -> dict[str, dict[str, float]]:
    """Mean, min and max over cycles of each key (absent = 0)."""
    cols = {k: [r.get(k, 0.0) for r in rows] for k in keys}
    return {"per_cycle_us": {k: math.fsum(v) / len(v) for k, v in cols.items()},
            "per_cycle_min_us": {k: min(v) for k, v in cols.items()},
            "per_cycle_max_us": {k: max(v) for k, v in cols.items()}}


def _other_list(others: list[dict], cycles: int) -> list[dict]:
    merged: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for other in others:
        for name, (calls, us) in other.items():
            merged[name][0] += calls
            merged[name][1] += us
    rows = [{"name": n, "calls": c, "total_us": us, "per_cycle_us": us / cycles} for n, (c, us) in merged.items()]
    return sorted(rows, key=lambda r: -r["total_us"])


def _calls(ops: list[GpuOp], classify: Classifier) -> dict[str, float]:
    calls: dict[str, float] = defaultdict(float)
    for op in ops:
        calls[classify(op.name) if op.cat == "kernel" else "memcpy"] += 1
    return calls


def _part(op_sets: list[list[GpuOp]], classify: Classifier, keys: list[str]) -> dict:
    parts = [cycle_parts(ops, classify) for ops in op_sets]
    comps = [k for k in keys if k not in ACCOUNTS]
    calls = _stats([_calls(ops, classify) for ops in op_sets], comps)["per_cycle_us"]
    return {**_stats([p for p, _ in parts], keys), "per_cycle_calls": calls,
            "other_kernels": _other_list([o for _, o in parts], len(parts))}


def _host(trace: Trace, cycles: list[Cycle]) -> dict[str, float] | None:
    """Mean CPU time per cycle: its window, the CUDA runtime/driver calls in it, and those of them that wait."""
    rows = []
    for c in cycles:
        if c.host_t0_us is None:
            return None
        calls = [k for k in trace.calls_between(c.host_t0_us, c.host_t1_us) if (k.pid, k.tid) in c.threads]
        rows.append({"window": c.host_t1_us - c.host_t0_us, "runtime": sum(k.end_us - k.start_us for k in calls),
                     "sync": sum(k.end_us - k.start_us for k in calls if SYNC_CALL.search(k.name))})
    return _stats(rows, ["window", "runtime", "sync"])["per_cycle_us"]


def _rank(rank: int, trace: Trace, classify: Classifier, cycle_range, verify_range) -> dict:
    cycles, found_by = find_cycles(trace, cycle_range, verify_range)
    keys = [*classify.components(), *ACCOUNTS]
    starts = [c.ops[0].start_us for c in cycles]
    periods = [b - a for a, b in zip(starts, starts[1:])]
    out = {"rank": rank, "file": str(trace.path), "cycles": len(cycles), "found_by": found_by,
           **_part([c.ops for c in cycles], classify, keys),
           "period_us": math.fsum(periods) / len(periods) if periods else None, "host_us": _host(trace, cycles),
           "verify": None}
    verify = [c.verify_ops for c in cycles if c.verify_ops]
    if verify:
        out["verify"] = {"cycles": len(verify), **_part(verify, classify, keys)}
    return add_rank_launch(out, trace, cycles, classify)


def _max_over_ranks(parts: list[dict]) -> dict:
    """Every entry's max over ranks (the slowest rank sets each part's pace), min/max over all ranks' cycles."""
    keys = parts[0]["per_cycle_us"].keys()
    others: dict[str, dict] = {}
    for p in parts:
        for row in p["other_kernels"]:
            if row["name"] not in others or row["per_cycle_us"] > others[row["name"]]["per_cycle_us"]:
                others[row["name"]] = row
    calls = parts[0]["per_cycle_calls"].keys()
    return {"per_cycle_us": {k: max(p["per_cycle_us"][k] for p in parts) for k in keys},
            "per_cycle_calls": {k: max(p["per_cycle_calls"][k] for p in parts) for k in calls},
            "per_cycle_min_us": {k: min(p["per_cycle_min_us"][k] for p in parts) for k in keys},
            "per_cycle_max_us": {k: max(p["per_cycle_max_us"][k] for p in parts) for k in keys},
            "other_kernels": sorted(others.values(), key=lambda r: -r["per_cycle_us"])}


def decompose(paths: list[str | Path], rules=None, cycle_range: str | None = None,
              verify_range: str | None = None) -> dict:
    """The decomposition of the traces in `paths` (one per rank) as a JSON-ready dict. `rules`: None (the
    default table), a --rules file path, a list of [regex, component] pairs put before the defaults, or a
    Classifier. Raises TraceError / RulesError naming the file and the fault."""
    if isinstance(rules, Classifier):
        classify = rules
    else:
        user = load_rules(rules) if isinstance(rules, (str, Path)) else check_rules(rules or [], "rules")
        classify = Classifier(user)
    ranked, rank_source = read_ranks(paths)
    per_rank = [_rank(r, t, classify, cycle_range, verify_range) for r, t in ranked]
    counts = {p["cycles"] for p in per_rank}
    found = {p["found_by"] for p in per_rank}
    found_by = found.pop() if len(found) == 1 else "; ".join(f"rank {p['rank']}: {p['found_by']}" for p in per_rank)
    if len(counts) > 1:
        found_by += " (ranks disagree on the cycle count: " + ", ".join(
            f"rank {p['rank']} {p['cycles']}" for p in per_rank) + "; the smallest is reported)"
    periods = [p["period_us"] for p in per_rank if p["period_us"] is not None]
    hosts = [p["host_us"] for p in per_rank if p["host_us"]]
    verify = [p["verify"] for p in per_rank if p["verify"]]
    return add_launch({"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                       "files": [p["file"] for p in per_rank], "ranks": [p["rank"] for p in per_rank],
                       "rank_source": rank_source, "rules": [list(r) for r in classify.user_rules],
                       "cycle_range": cycle_range, "verify_range": verify_range,
                       "cycles": min(counts), "found_by": found_by, **_max_over_ranks(per_rank),
                       "period_us": max(periods) if periods else None,
                       "host_us": {k: max(h[k] for h in hosts) for k in hosts[0]} if hosts else None,
                       "verify": ({"cycles": min(v["cycles"] for v in verify), **_max_over_ranks(verify)}
                                  if len(verify) == len(per_rank) else None),
                       "per_rank": per_rank})


# ---- the report ----

def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _unmangle(name: str) -> str | None:
    """The qualified name of an Itanium-mangled symbol (_Z, nested or not), "<...>" for its template arguments,
    its parameter types left out; None if it does not read as one."""
    rest, parts = name[2:], []
    if rest.startswith("N"):
        rest = rest[1:].lstrip("rVK")
    while rest[:1].isdigit():
        digits = len(rest) - len(rest.lstrip("0123456789"))
        size = int(rest[:digits])
        parts.append(rest[digits:digits + size])
        rest = rest[digits + size:]
    return "::".join(parts) + ("<...>" if rest.startswith("I") else "") if parts and all(parts) else None


def short_name(name: str) -> str:
    """A kernel's name as a reader scans it: the qualified base name, template arguments as <...>, no return
    type or parameter list, at most SHORT_NAME_CHARS characters."""
    if name.startswith("_Z"):
        name = _unmangle(name) or name
    out, depth = [], 0
    for ch in name.replace("(anonymous namespace)", "{anonymous}"):
        if ch == "(" and depth == 0 and out:
            break
        if ch == "<":
            depth += 1
            if depth == 1:
                out.append("<...>")
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    text = "".join(out).strip()
    text = re.sub(r"^(void|static|__global__)\s+", "", text)
    return text if len(text) <= SHORT_NAME_CHARS else text[:SHORT_NAME_CHARS - 3] + "..."


def decomposition_table(result: dict, part: str | None = None) -> str:
    """Components (those with time on some rank), then gpu_idle, overlap and total, in microseconds per cycle."""
    from tabulate import tabulate

    whole = result if part is None else result[part]
    ranks = result["per_rank"]
    rank_parts = [r if part is None else r[part] for r in ranks]
    mean, lo, hi = whole["per_cycle_us"], whole["per_cycle_min_us"], whole["per_cycle_max_us"]
    total = mean["total"]
    rows = []
    for k in mean:
        if k not in ACCOUNTS and not any(p["per_cycle_max_us"][k] for p in rank_parts):
            continue
        label = {"overlap": "overlap (subtract)", "total": "total (GPU window)"}.get(k, k)
        row = [label, _fmt(mean[k])]
        if len(ranks) > 1:
            row += [_fmt(p["per_cycle_us"][k]) for p in rank_parts]
        rows.append(row + [_fmt(lo[k]), _fmt(hi[k]), f"{100 * mean[k] / total:.1f}" if total else "-"])
    head = ["component", "us/cycle" + (" (max over ranks)" if len(ranks) > 1 else "")]
    head += [f"rank {r['rank']}" for r in ranks] if len(ranks) > 1 else []
    return tabulate(rows, headers=head + ["min", "max", "% of total"], disable_numparse=True)


def format_report(result: dict) -> str:
    ranks = result["ranks"]
    lines = [f"{result['cycles']} cycle(s), found by {result['found_by']}",
             f"rank(s) {', '.join(map(str, ranks))} (from the {result['rank_source']}); "
             + ("kernel rules: defaults" if not result["rules"] else f"kernel rules: {len(result['rules'])} "
                "user rule(s) before the defaults"),
             "", decomposition_table(result),
             "components + gpu_idle - overlap = total; gpu_idle is time inside the cycle with no GPU work (host-bound)"]
    if result["period_us"] is not None:
        lines.append(f"cycle period (one cycle's first GPU start to the next's): {result['period_us']:.1f} us")
    if result["host_us"]:
        h = result["host_us"]
        lines.append(f"host per cycle: window {h['window']:.1f} us, CUDA runtime/driver calls {h['runtime']:.1f} us, "
                     f"of which waiting (synchronize, blocking copies) {h['sync']:.1f} us")
    if result["verify"]:
        lines += ["", f"verify part ({result['verify']['cycles']} cycles):", decomposition_table(result, "verify")]
    other = result["other_kernels"][:OTHER_SHOWN]
    if other:
        lines += ["", "kernels no rule matched (\"other\"; add a --rules entry), us per cycle (full names in "
                  "--json):"]
        lines += [f"  {r['per_cycle_us']:10.1f}  {short_name(r['name'])}" for r in other]
        if len(result["other_kernels"]) > OTHER_SHOWN:
            lines.append(f"  ... {len(result['other_kernels']) - OTHER_SHOWN} more in --json")
    return "\n".join(lines + launch_lines(result, short_name))


# ---- the suite side by side ----

def against_file(given) -> Path:
    """The verify result --against names: a file, a results folder's latest verify result, or the latest of several
    files (a glob), said when chosen; TraceError otherwise."""
    from verifybench.harness.measure.results.result_files import pick_input
    from verifybench.harness.measure.results.store import ResultsError

    try:
        path, note = pick_input(given, ("verify",), "--against")
    except ResultsError as e:
        raise TraceError(str(e)) from None
    if note:
        print(note)
    return path


# ---- outputs ----

def _write_new(path: str | Path, write, inputs=(), option: str = "output") -> Path:
    """store.write_new: never onto an input trace, never over an existing file (a fresh name instead)."""
    from verifybench.harness.measure.results.store import ResultsError, write_new

    try:
        return write_new(Path(path), write, inputs, option)
    except ResultsError as e:
        raise TraceError(str(e)) from None


def write_json(result: dict, path: str | Path, inputs=()) -> Path:
    return _write_new(path, (json.dumps(result, indent=1) + "\n").encode(), inputs, "--json")


def write_chart(result: dict, path: str | Path, inputs=()) -> Path:
    """One stacked bar per rank: each component's busy time and the idle time, us per cycle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = result["per_rank"]
    keys = [k for k in result["per_cycle_us"] if k not in ACCOUNTS and result["per_cycle_us"][k] > 0] + ["gpu_idle"]
    fig, ax = plt.subplots(figsize=(4.5 + 1.2 * len(ranks), 5))
    bottom = [0.0] * len(ranks)
    for k in keys:
        vals = [r["per_cycle_us"][k] for r in ranks]
        idle = k == "gpu_idle"
        ax.bar([f"rank {r['rank']}" for r in ranks], vals, bottom=bottom, label=k, hatch="//" if idle else None,
               color="0.85" if idle else None, edgecolor="0.5" if idle else None)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("us per cycle (busy time; overlap counted in each part)")
    ax.set_title(textwrap.fill(f"{result['cycles']} cycles, found by {result['found_by']}", 60), fontsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    try:
        return _write_new(path, lambda f: fig.savefig(f, format="png", dpi=120), inputs, "--chart")
    finally:
        plt.close(fig)


# ---- command line ----

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="PyTorch profiler Chrome trace(s), .json or .json.gz, one per rank (ranks from -TP-<r>, "
                        "rank<r> or profiler_out_<r> in the names, else the order given)")
    p.add_argument("--cycle-range", metavar="NAME", help="record_function / NVTX range that spans one cycle "
                   "(exact name, else names containing it); default: repeated CUDA graph launches, else a "
                   "periodic kernel sequence")
    p.add_argument("--verify-range", metavar="NAME", help="range of the verify step: decomposed on its own inside "
                   "each cycle (alone: each such range is a cycle)")
    p.add_argument("--rules", metavar="FILE", help='extra kernel-name rules, checked before the defaults: a JSON '
                   'list of [regex, component] pairs, e.g. [["my_allreduce", "allreduce"], ["^gemm_", '
                   '"projections"]]; regexes are searched in the kernel name, case-insensitive')
    p.add_argument("--against", metavar="RESULT", nargs="+", help="a suite verify result file, a results folder (its "
                   "latest verify result) or several files (the latest): engine time per part beside the suite's "
                   "isolated time for it")
    p.add_argument("--tokens", metavar="N", type=tokens_upto(TOKEN_COUNT_MAX, one=True), help="tokens per verify in the engine: the suite's "
                   "n to compare with (default: the largest n in RESULT)")
    p.add_argument("--layers", metavar="N", type=positive_int, help="layers in the engine's forward, when they "
                   "differ from RESULT's: the suite is scaled per layer to N (default: refused when the trace's "
                   "allreduce kernels say another number)")
    p.add_argument("--json", metavar="OUT", type=out_path, help="write the decomposition as JSON (a new file: never "
                   "over a trace or an existing file)")
    p.add_argument("--chart", metavar="PNG", type=out_path, help="write a stacked bar chart, one bar per rank (a new "
                   "file, as --json)")


def run(args: argparse.Namespace) -> int:
    from verifybench.harness.measure.results.store import ResultsError, refuse_inputs

    try:
        if args.tokens is not None and not args.against:
            raise TraceError("--tokens N picks the suite's n for --against RESULT; give --against too")
        if args.layers is not None and not args.against:
            raise TraceError("--layers N scales the suite of --against RESULT; give --against too")
        inputs = [*args.traces, *(args.against or ()), *([args.rules] if args.rules else [])]
        for option, path in (("--json", args.json), ("--chart", args.chart)):
            if path is not None:
                refuse_inputs(path, inputs, option)
        against = against_file(args.against) if args.against else None
        suite = load_against(against) if against else None
        result = decompose(args.traces, args.rules, args.cycle_range, args.verify_range)
        # the comparison may refuse (layers): before anything is printed, so a refusal is its one line
        beside = against_table(result, suite, args.tokens, str(against), args.layers) if suite else None
        print(format_report(result))
        if beside is not None:
            from tabulate import tabulate

            rows, note = beside
            print(f"\nbeside the suite ({against}; {note}):")
            print(tabulate([[r[0], _fmt(r[1]), _fmt(r[2]), "-" if r[3] is None else f"{r[3]:.2f}"] for r in rows],
                           headers=["part  [suite | trace components]", "engine us", "suite us", "engine/suite"],
                           disable_numparse=True))
        if args.json:
            print(f"wrote {write_json(result, args.json, inputs)}")
        if args.chart:
            print(f"wrote {write_chart(result, args.chart, inputs)}")
    except (TraceError, RulesError, ResultsError) as e:
        print(f"verifybench trace: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"verifybench trace: error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="verifybench trace")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
