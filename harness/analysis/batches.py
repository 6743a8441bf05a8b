"""Speculation at B requests at once, from a cycle result of `verifybench cycle --batch 1,2,4,8`: per context, batch
and shape (steps, topk, D) the cycle ms, the plain decode step at the same B (B tokens, one per request), the
break-even tau* = T_cycle / T_decode(B), and at the acceptance given the tokens/s per request (1000 * tau / T_cycle)
and in total (B times that), and the speedup over plain decode at the same B (tau * T_decode(B) / T_cycle). As B grows
the forward carries B * D tokens (more distinct experts, a larger allreduce message, B contexts' attention) while a
plain decode carries B: tau* rises, and past some B a shape no longer pays. `largest_paying` names that B per shape
and context. On CPU numbers nothing is ranked (engine/stance.py): `would_rank` says what a GPU run would give.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from verifybench.harness.engine import stance
from verifybench.harness.model import presets

HIDDEN_BYTES = 2  # bf16 activations: one allreduce carries B * D rows of the hidden size at 2 bytes


def passing_cases(run: dict) -> list[dict]:
    return [c for c in run["cases"] if c["check"]["ok"]]


def case_config(case: dict) -> tuple[int, int, int]:
    p = case["params"]
    return p["steps"], p["topk"], p["draft_tokens"]


def batch_of(case: dict) -> int:
    """A cycle case's requests per cycle; a result written before --batch existed ran one."""
    return case["params"].get("batch", 1)


def batches(run: dict) -> list[int]:
    """The batch sizes a cycle result's passing cases ran."""
    return sorted({batch_of(c) for c in passing_cases(run)})


def smallest_batch(run: dict) -> dict:
    """The result with only its smallest batch's cases: what the one-request analyses (plan, advise's levers) read."""
    least = min((batch_of(c) for c in run["cases"]), default=1)
    return {**run, "cases": [c for c in run["cases"] if batch_of(c) == least]}


def rows(run: dict, tau_of=None) -> list[dict]:
    """One row per passing case: context, B, shape, attention, cycle and decode ms, tau*; with `tau_of(config)` (tau
    or None) also tok/s per request and in total, plain decode's total tok/s at B, the speedup and whether it pays.
    T_decode(B) is the median of the plain decode over the cases at that (context, B)."""
    cases = passing_cases(run)
    decode: dict[tuple, list[float]] = {}
    for c in cases:
        decode.setdefault((c["params"]["context"], batch_of(c)), []).append(c["derived"]["decode_ms"])
    out = []
    for c in cases:
        p, b = c["params"], batch_of(c)
        config = case_config(c)
        cycle_ms = c["summary"]["median_us"] / 1e3
        dec = float(np.median(decode[(p["context"], b)]))
        nbytes = c["derived"].get("allreduce_bytes") or (
            b * p["draft_tokens"] * presets.get(p["preset"], p["tp"]).hidden * HIDDEN_BYTES)
        row = {"context": p["context"], "B": b, "config": config, "attention": p["attention"], "cycle_ms": cycle_ms,
               "decode_ms": dec, "tau_star": cycle_ms / dec, "allreduce_bytes": nbytes}
        tau = tau_of(config) if tau_of else None
        if tau is not None:
            row.update(tau=tau, tok_s_request=1000 * tau / cycle_ms, tok_s_total=b * 1000 * tau / cycle_ms,
                       decode_tok_s_total=b * 1000 / dec, speedup=tau * dec / cycle_ms, pays=tau * dec > cycle_ms)
        out.append(row)
    return sorted(out, key=lambda r: (r["context"], r["attention"], r["config"], r["B"]))


def largest_paying(table: list[dict]) -> list[dict]:
    """Per (context, attention, shape): the largest B measured at which it still beats plain decode at the same B
    (None: at no B), and the B it was measured at; rows need a tau (rows(..., tau_of))."""
    out: dict[tuple, dict] = {}
    for r in (r for r in table if "pays" in r):
        key = (r["context"], r["attention"], r["config"])
        entry = out.setdefault(key, {"context": key[0], "attention": key[1], "config": key[2], "largest_B": None,
                                     "measured_B": []})
        entry["measured_B"].append(r["B"])
        if r["pays"] and (entry["largest_B"] is None or r["B"] > entry["largest_B"]):
            entry["largest_B"] = r["B"]
    return list(out.values())


def best_per_batch(table: list[dict]) -> list[dict]:
    """Per (context, B): the row of the most total tokens/s (rows with a tau), the B's ranking at a glance."""
    best: dict[tuple, dict] = {}
    for r in (r for r in table if "tok_s_total" in r):
        key = (r["context"], r["B"])
        if key not in best or r["tok_s_total"] > best[key]["tok_s_total"]:
            best[key] = r
    return [best[k] for k in sorted(best)]


def _shape(r: dict) -> str:
    return "(%d,%d,%d) %s" % (*r["config"], r["attention"])


def allreduce_line(table: list[dict], sweep: Path | None) -> list[str]:
    """Per B * D the allreduce message one verify carries; with a measured allreduce (a one-rank-per-GPU result or
    an NCCL sweep) its time at the nearest measured size, the size the multi-GPU forward would pay."""
    sizes = sorted({(r["B"], r["config"][2], r["allreduce_bytes"]) for r in table if r.get("allreduce_bytes")})
    if not sizes:
        return []
    out = []
    for b, d, nbytes in sizes:
        line = f"- B {b} x D {d} = {b * d} rows: {nbytes / 1024:.4g} KiB per allreduce"
        if sweep is not None:
            from verifybench.harness.collectives.allreduce_results import stand_in_from_result

            us, source = stand_in_from_result(str(sweep), nbytes)
            line += f", measured {us:.4g} us ({source})"
        out.append(line)
    return (["allreduce per call at each B x D (two per layer)" + ("" if sweep else "; give an allreduce or NCCL "
             "sweep result beside the cycle for the measured time at each size") + ":"] + out)


def would_rank(run: dict) -> list[str]:
    """On CPU numbers: what the per-batch answer would give on a GPU, with no figure and no order."""
    bs = ", ".join(map(str, batches(run)))
    ctx = ", ".join(str(c) for c in sorted({c["params"]["context"] for c in passing_cases(run)}))
    return ["", f"## Per batch, on a GPU (not ranked here: B = {bs}; context {ctx})", stance.CPU_STANCE,
            "- per (steps, topk, D) and B: cycle ms, break-even tau* against plain decode at the same B, tok/s per "
            "request and in total, speedup over plain decode at the same B; the best shape per B",
            "- per shape and context: the largest B where it still pays at the acceptance given",
            "- the allreduce message per call at each B x D, and its measured time where an allreduce result is given",
            "- a chart of the speedup (or tau*) over B, one line per context, extend beside split_kv",
            "- measure with `verifybench cycle --batch 1,2,4,8 --contexts 1024,8192` on a GPU"]


def lines(run: dict, tau_of=None, sweep: Path | None = None) -> list[str]:
    """The per-batch answer for advise and plan: the best shape per (context, B), then the largest B where each
    shape pays, then the allreduce sizes; on CPU numbers would_rank instead."""
    if stance.is_cpu_run(run):
        return would_rank(run)
    table = rows(run, tau_of)
    out = ["", "## Per batch (B requests at once, each over its own context)"]
    if tau_of is None:
        out.append("break-even tau* per shape and B (give --accept-len or --accept-rates for tok/s and the largest "
                   "paying B):")
        out += [f"- context {r['context']}, B {r['B']}: {_shape(r)} cycle {r['cycle_ms']:.4g} ms, decode "
                f"{r['decode_ms']:.4g} ms, tau* {r['tau_star']:.3g}" for r in table]
        return out + allreduce_line(table, sweep)
    for r in best_per_batch(table):
        out.append(f"- context {r['context']}, B {r['B']}: best {_shape(r)}: {r['tok_s_total']:.4g} tok/s in total, "
                   f"{r['tok_s_request']:.4g} per request; {r['speedup']:.3g}x plain decode at B {r['B']} "
                   f"({r['decode_tok_s_total']:.4g} tok/s); cycle {r['cycle_ms']:.4g} ms, tau* {r['tau_star']:.3g} "
                   f"(tau {r['tau']:.3g})")
    out.append("largest B where each shape still pays (beats plain decode at the same B), per context:")
    for e in largest_paying(table):
        got = (f"B {e['largest_B']}" if e["largest_B"] is not None else "at no B measured")
        out.append(f"- context {e['context']}, ({','.join(map(str, e['config']))}) {e['attention']}: {got} "
                   f"(measured at B {', '.join(map(str, sorted(e['measured_B'])))})")
    return out + allreduce_line(table, sweep)


def chart(run: dict, directory: Path, stamp: str, tau_of=None) -> Path | None:
    """The speedup over plain decode at the same B (with an acceptance; else tau*) against B, one line per context,
    one panel per attention (the engine's extend, our split_kv): each line the best shape at that B. None on CPU
    numbers (no comparison is drawn from them) or with fewer than two batches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verifybench.harness.engine.charts import write_png

    if stance.is_cpu_run(run) or len(batches(run)) < 2:
        return None
    table = rows(run, tau_of)
    attentions = sorted({r["attention"] for r in table})
    fig, axes = plt.subplots(1, len(attentions), figsize=(5.5 * len(attentions), 4.2), sharey=True, squeeze=False)
    for ax, att in zip(axes[0], attentions):
        for ctx in sorted({r["context"] for r in table}):
            pts: dict[int, float] = {}
            for r in (r for r in table if r["attention"] == att and r["context"] == ctx):
                y = r["speedup"] if tau_of and "speedup" in r else r["tau_star"]
                better = max if tau_of and "speedup" in r else min
                pts[r["B"]] = better(pts.get(r["B"], y), y)
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], "o-", label=f"context {ctx}")
        if tau_of:
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches(run))
        ax.get_xaxis().set_major_formatter(plt.FuncFormatter(lambda v, _: f"{int(v)}"))
        ax.set_xlabel("requests at once (B)")
        ax.set_title(f"{att}" + (" (the engine's attention)" if att == "extend" else " (split-KV)"))
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("speedup over plain decode at the same B (best shape)" if tau_of else
                          "break-even tau* (best shape; lower is better)")
    fig.suptitle("EAGLE-3 at B requests: where speculation stops paying" + (" (below 1: it does not)" if tau_of
                                                                            else ""))
    return write_png(fig, Path(directory) / f"cycle_batches-{stamp}.png")
