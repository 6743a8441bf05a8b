"""Graph or eager: how much of each component's GPU time ran inside CUDA graphs and how much was launched op by
op, and a warning when the verify forward's attention or MoE kernels ran outside a graph.

Each GPU op is put under the CUDA call whose correlation id it carries (CUPTI gives every kernel of a graph replay
the correlation id of its cudaGraphLaunch): a graph launch makes it "graph", any other call (cudaLaunchKernel,
cuLaunchKernelEx, cudaMemcpyAsync, ...) makes it "eager". With no such call in the trace, CUPTI's graph node id
on the op (newer Kineto writes it) still says "graph"; otherwise it is "unknown", never a guess.
"""
from __future__ import annotations

from collections import defaultdict

from verifybench.harness.answers.trace_read import GpuOp, Trace
from verifybench.harness.answers.trace_rules import Classifier

GRAPH, EAGER, UNKNOWN = "graph", "eager", "unknown"
KINDS = (GRAPH, EAGER, UNKNOWN)
ALL = "all"  # the whole cycle (or verify part), beside the components
# the per-layer kernels whose eager launch is the piecewise-graph downgrade: attention between graph pieces (vLLM's
# Triton MLA backend forced to piecewise graphs), or the MoE left out of the graph
WARN_COMPONENTS = ("attention", "moe")
WARN_NAMES_SHOWN = 3


def launch_kind(trace: Trace, op: GpuOp) -> str:
    call = trace.call_of(op)
    if call is not None:
        return GRAPH if "GraphLaunch" in call.name else EAGER  # cudaGraphLaunch, cuGraphLaunch
    if op.graph_node:  # 0 or absent outside a graph
        return GRAPH
    return UNKNOWN


def _share(eager_us: float, graph_us: float) -> float | None:
    """Eager time over the time whose launch is known; None when none is known."""
    known_us = eager_us + graph_us
    return eager_us / known_us if known_us else None


def launch_split(trace: Trace, op_sets: list[list[GpuOp]], classify: Classifier) -> dict:
    """Mean microseconds per cycle of each component's GPU time (and ALL of it) in graphs, eager and unknown, the
    eager share, and the eager kernels by name (calls and microseconds per cycle)."""
    cycles = len(op_sets)
    us = {kind: defaultdict(float) for kind in KINDS}
    eager: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])  # (component, name) -> [calls, us]
    for ops in op_sets:
        for op in ops:
            comp = classify(op.name) if op.cat == "kernel" else "memcpy"
            kind = launch_kind(trace, op)
            us[kind][comp] += op.dur_us
            us[kind][ALL] += op.dur_us
            if kind == EAGER:
                eager[comp, op.name][0] += 1
                eager[comp, op.name][1] += op.dur_us
    keys = [*classify.components(), ALL]
    out = {f"{kind}_us": {k: us[kind][k] / cycles for k in keys} for kind in KINDS}
    out["eager_share"] = {k: _share(out["eager_us"][k], out["graph_us"][k]) for k in keys}
    rows = [{"name": name, "component": comp, "calls_per_cycle": calls / cycles, "per_cycle_us": total / cycles}
            for (comp, name), (calls, total) in eager.items()]
    out["eager_kernels"] = sorted(rows, key=lambda r: -r["per_cycle_us"])
    return out


def merge_ranks(parts: list[dict]) -> dict:
    """Every entry's max over ranks, as the rest of the report takes it (the slowest rank sets the pace)."""
    out = {}
    for key in (*(f"{kind}_us" for kind in KINDS), "eager_share"):
        out[key] = {}
        for k in parts[0][key]:
            known = [p[key][k] for p in parts if p[key][k] is not None]
            out[key][k] = max(known) if known else None
    kernels: dict[tuple[str, str], dict] = {}
    for p in parts:
        for row in p["eager_kernels"]:
            seen = kernels.get((row["component"], row["name"]))
            if seen is None or row["per_cycle_us"] > seen["per_cycle_us"]:
                kernels[row["component"], row["name"]] = row
    out["eager_kernels"] = sorted(kernels.values(), key=lambda r: -r["per_cycle_us"])
    return out


def add_rank_launch(out: dict, trace: Trace, cycles: list, classify: Classifier) -> dict:
    """One rank's decomposition `out`, with the launch split of its cycles (and of their verify parts)."""
    out["launch"] = launch_split(trace, [c.ops for c in cycles], classify)
    verify = [c.verify_ops for c in cycles if c.verify_ops]
    if out["verify"] is not None and verify:
        out["verify"]["launch"] = launch_split(trace, verify, classify)
    return out


def eager_warnings(result: dict) -> list[dict]:
    """Attention / MoE kernels launched eagerly: in the verify part when one was named, else in the whole cycle."""
    verify = result.get("verify")
    part, launch = ("verify", verify["launch"]) if verify and "launch" in verify else ("cycle", result["launch"])
    warnings = []
    for comp in WARN_COMPONENTS:
        rows = [r for r in launch["eager_kernels"] if r["component"] == comp]
        if rows:
            warnings.append({"component": comp, "part": part,
                             "calls_per_cycle": sum(r["calls_per_cycle"] for r in rows),
                             "per_cycle_us": sum(r["per_cycle_us"] for r in rows),
                             "kernels": [{k: r[k] for k in ("name", "calls_per_cycle", "per_cycle_us")}
                                         for r in rows]})
    return warnings


def add_launch(result: dict) -> dict:
    """The decomposition `result` with the launch split, max over its ranks, and the eager warnings."""
    ranks = result["per_rank"]
    result["launch"] = merge_ranks([r["launch"] for r in ranks])
    if result["verify"] is not None:
        result["verify"]["launch"] = merge_ranks([r["verify"]["launch"] for r in ranks])
    result["eager_warnings"] = eager_warnings(result)
    return result


# ---- the report ----

def _fmt_share(share: float | None) -> str:
    return "unknown" if share is None else f"{100 * share:.1f}"


def launch_table(launch: dict) -> str:
    """Components with GPU time, then ALL: microseconds per cycle in graphs, eager, unknown, and % eager."""
    from tabulate import tabulate

    rows = []
    for k in launch["graph_us"]:
        values = [launch[f"{kind}_us"][k] for kind in KINDS]
        if k == ALL or any(values):
            rows.append([k, *(f"{v:.1f}" for v in values), _fmt_share(launch["eager_share"][k])])
    return tabulate(rows, headers=["component", "graph us", "eager us", "unknown us", "% eager"],
                    disable_numparse=True)


def warning_line(w: dict, short_name) -> str:
    where = ("the verify forward" if w["part"] == "verify"
             else "the cycle (draft steps included; --verify-range narrows it to the verify)")
    shown = w["kernels"][:WARN_NAMES_SHOWN]
    if len(w["kernels"]) == 1:
        names = f"{short_name(shown[0]['name'])} x{shown[0]['calls_per_cycle']:g}"
    else:
        names = ", ".join(f"{short_name(k['name'])} x{k['calls_per_cycle']:g} {k['per_cycle_us'] / 1e3:.3f} ms"
                          for k in shown)
        if len(w["kernels"]) > WARN_NAMES_SHOWN:
            names += f" and {len(w['kernels']) - WARN_NAMES_SHOWN} more kernels"
    calls = w["calls_per_cycle"]
    return (f"warning: {w['component']} of {where} ran outside CUDA graphs: {calls:g} eager "
            f"launch{'' if calls == 1 else 'es'} per cycle taking {w['per_cycle_us'] / 1e3:.3f} ms of GPU time per "
            f"cycle ({names}); a piecewise-graph downgrade? run it in full CUDA graphs")


def launch_lines(result: dict, short_name) -> list[str]:
    """The report's section: the launch table(s), a note when launches are unknown, then the warnings."""
    many = " (max over ranks)" if len(result["ranks"]) > 1 else ""
    lines = ["", f"GPU time by launch, us per cycle{many}: in CUDA graphs, eager (launched op by op), or "
             "unknown (no correlated CUDA call); % eager = eager / (graph + eager):", launch_table(result["launch"])]
    verify = result.get("verify")
    if verify and "launch" in verify:
        lines += ["", "verify part:", launch_table(verify["launch"])]
    unknown_us = result["launch"]["unknown_us"][ALL]
    if unknown_us:
        lines.append(f"launch unknown for {unknown_us:.1f} us per cycle: those GPU ops carry no correlation id of a "
                     "CUDA call in the trace (record with CPU activity on to tell graph from eager)")
    lines += [warning_line(w, short_name) for w in result["eager_warnings"]]
    if result["eager_warnings"] and result["found_by"].startswith("CUDA graph launches"):
        # piecewise graphs repeat per layer, so the costliest repeated graph may be one layer's piece
        lines.append("note: with piecewise graphs the cycles found by graph launches may be layers, not cycles; "
                     "name the cycle's range with --cycle-range for per-cycle figures")
    return lines
