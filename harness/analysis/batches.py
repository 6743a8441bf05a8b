"""Speculation at B requests at once, from a cycle result of `verifybench cycle --batch 1,2,4,8`: per context, batch
and shape (steps, topk, D) the cycle ms, the plain decode step at the same B (B tokens, one per request), the
break-even tau* = T_cycle / T_decode(B), and at the acceptance given the tokens/s per request (1000 * tau / T_cycle)
and in total (B times that), and the speedup over plain decode at the same B (tau * T_decode(B) / T_cycle). As B grows
the forward carries B * D tokens (more distinct experts, a larger allreduce message, B contexts' attention) while a
plain decode carries B: tau* rises, and past some B a shape no longer pays. `largest_paying` names that B per shape
and context. With a measured allreduce over message sizes (a multi-GPU allreduce result or an NCCL sweep) each row's
cycle and plain decode are re-costed at their own message size: the one-GPU stand-in (one latency per call whatever
the size) is replaced by the measured time at B * D rows (and B rows for the decode), measured or interpolated on a
log size scale, never extrapolated past the measured sizes. On CPU numbers nothing is ranked (measure/stance.py):
`would_rank` says what a GPU run would give and which size each B would be costed at.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from verifybench.harness.collectives.allreduce_results import size_series, time_at_size
from verifybench.harness.collectives.backends import GPU_BACKENDS
from verifybench.harness.measure import env, stance
from verifybench.harness.measure.results import store
from verifybench.harness.measure.results.store import batch_of
from verifybench.harness.model import presets

HIDDEN_BYTES = 2  # bf16 activations: one allreduce carries B * D rows of the hidden size at 2 bytes


def passing_cases(run: dict) -> list[dict]:
    """The cases of a result file whose check passed (plan and the levers read these too)."""
    return [c for c in run["cases"] if c["check"]["ok"]]


def case_config(case: dict) -> tuple[int, int, int]:
    """A cycle case's configuration: (steps, topk, draft_tokens)."""
    p = case["params"]
    return p["steps"], p["topk"], p["draft_tokens"]


def batches(run: dict) -> list[int]:
    """The batch sizes a cycle result's passing cases ran."""
    return sorted({batch_of(c) for c in passing_cases(run)})


def smallest_batch(run: dict) -> dict:
    """The result with only its smallest batch's cases: what the one-request analyses (plan, advise's levers) read."""
    least = min((batch_of(c) for c in run["cases"]), default=1)
    return {**run, "cases": [c for c in run["cases"] if batch_of(c) == least]}


def answer_batch(run: dict, path=None) -> str:
    """The heading's words for an answer read from one batch of a batched cycle (smallest_batch): its B, and that
    each tok/s is per request."""
    b = min(batches(run), default=1)
    rate = "one request: tok/s per request is the total" if b == 1 else f"tok/s per request, {b}x that in total"
    return f" at B = {b} (the smallest batch of {path or 'the cycle result'}; {rate})"


def allreduce_costing(path: Path | None) -> dict | None:
    """What the per-batch rows cost each B's allreduce with, read from `path`: from an NCCL sweep, nccl under the
    default setting (what a server pays untouched) and, as the lever, under the sweep's winner; from a multi-GPU
    allreduce result, nccl and, as the lever, the fastest other backend at each size. None without a file; a dict
    with only `note` where the file cannot cost one (a 1-rank result: a call floor with no peer to wait for)."""
    if path is None:
        return None
    run = store.load_run(path)
    series, mode = size_series(run)
    # CPU numbers where only gloo's host times are left: a multi-GPU job's gloo rows beside its GPU backends' are
    # dropped by size_series and do not make the file a CPU one
    cpu = stance.cpu_fingerprint(run.get("fingerprint")) or not any(b in GPU_BACKENDS for b, _ in series)
    out = {"path": str(path), "mode": mode, "cpu": cpu, "alts": {}, "all": series,
           "where": f"{run['fingerprint'].get('gpu_model') or 'a GPU'}"}
    if run["component"] == "allreduce_sweep":
        out["where"] += f" x{run.get('extra', {}).get('nproc_per_node', '?')}"
        out["base_name"], out["base"] = "nccl, NCCL's default setting", series.get(("nccl", "default"))
        try:
            label, win_env = env.sweep_winner(run)
        except ValueError:
            label, win_env = "default", {}
        if label != "default" and ("nccl", label) in series:
            out["alts"][f"the sweep's winner {label}"] = series[("nccl", label)]
            out["lever_env"] = " ".join(f"{k}={v}" for k, v in win_env.items())
        return out
    world = max((c["params"].get("world_size", 1) for c in run["cases"]), default=1)
    if world < 2:
        return {"note": f"{path}: a 1-rank allreduce (each backend's call floor, no peer): not a multi-GPU time, "
                        "no B is costed from it"}
    out["where"] += f" x{world}"
    out["base_name"], out["base"] = "nccl", series.get(("nccl", None))
    out["alts"] = {backend: times for (backend, _), times in series.items() if backend != "nccl"}
    return out


def _cost(row: dict, case: dict, costing: dict) -> None:
    """Re-costs one row's cycle and decode at their own message sizes (in place): each of the forward's 2-per-layer
    allreduces at the measured time in place of the one-GPU stand-in; where either size lies outside the measured
    ones, or the case recorded no stand-in, the row keeps its one-GPU figures and says why."""
    d = case["derived"]
    p = case["params"]
    calls = 2 * (d.get("layers_run") or d.get("layers_total") or presets.get(p["preset"], p["tp"]).layers)
    hidden = presets.get(p["preset"], p["tp"]).hidden
    stand_in = d.get("allreduce_stand_in_us")
    base = costing.get("base") or {}
    at = time_at_size(base, row["allreduce_bytes"])
    at_decode = time_at_size(base, row["B"] * hidden * HIDDEN_BYTES)
    row.update(allreduce_calls=calls, stand_in_us=stand_in, allreduce_at=at, decode_allreduce_at=at_decode,
               costed=at is not None and at_decode is not None and stand_in is not None)
    if row["costed"]:
        row["cycle_ms_one_gpu"], row["decode_ms_one_gpu"] = row["cycle_ms"], row["decode_ms"]
        row["cycle_ms"] += calls * (at[0] - stand_in) / 1e3
        row["decode_ms"] += calls * (at_decode[0] - stand_in) / 1e3
        row["tau_star"] = row["cycle_ms"] / row["decode_ms"]


def rows(run: dict, tau_of=None, costing: dict | None = None) -> list[dict]:
    """One row per passing case: context, B, shape, attention, cycle and decode ms, tau*; with `tau_of(config)` (tau
    or None) also tok/s per request and in total, plain decode's total tok/s at B, the speedup and whether it pays.
    T_decode(B) is the median of the plain decode over the cases at that (context, B). With `costing`
    (allreduce_costing) the cycle and decode are re-costed at each row's allreduce message size (_cost)."""
    cases = passing_cases(run)
    decode: dict[tuple, list[float]] = {}
    for c in cases:
        # a deployment variant's tau* is against its own decode step (cycle --engine --ab), never another's
        decode.setdefault((c["params"]["context"], batch_of(c), c["params"].get("deployment")), []).append(
            c["derived"]["decode_ms"])
    out = []
    for c in cases:
        p, b = c["params"], batch_of(c)
        config = case_config(c)
        cycle_ms = c["summary"]["median_us"] / 1e3
        dec = float(np.median(decode[(p["context"], b, p.get("deployment"))]))
        nbytes = c["derived"].get("allreduce_bytes") or (
            b * p["draft_tokens"] * presets.get(p["preset"], p["tp"]).hidden * HIDDEN_BYTES)
        att = p["attention"] if "deployment" not in p else f"{p['attention']} [{p['deployment']}]"
        row = {"context": p["context"], "B": b, "config": config, "attention": att, "cycle_ms": cycle_ms,
               "decode_ms": dec, "tau_star": cycle_ms / dec, "allreduce_bytes": nbytes}
        if costing and "base" in costing:
            _cost(row, c, costing)
        tau = tau_of(config) if tau_of else None
        if tau is not None:
            cycle_ms, dec = row["cycle_ms"], row["decode_ms"]
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
                                     "measured_B": [], "uncosted_B": []})
        if r.get("costed") is False:  # its allreduce a one-GPU stand-in beside rows paying the measured one
            entry["uncosted_B"].append(r["B"])
            continue
        entry["measured_B"].append(r["B"])
        if r["pays"] and (entry["largest_B"] is None or r["B"] > entry["largest_B"]):
            entry["largest_B"] = r["B"]
    return list(out.values())


def best_per_batch(table: list[dict]) -> list[dict]:
    """Per (context, B): the row of the most total tokens/s (rows with a tau), the B's ranking at a glance."""
    best: dict[tuple, dict] = {}
    # a row left at the one-GPU stand-in would win against rows paying the measured allreduce: ranked only among
    # its own kind
    for r in (r for r in table if "tok_s_total" in r):
        key = (r["context"], r["B"])
        if key in best and best[key].get("costed") is not False and r.get("costed") is False:
            continue
        if key in best and best[key].get("costed") is False and r.get("costed") is not False:
            best[key] = r
            continue
        if key not in best or r["tok_s_total"] > best[key]["tok_s_total"]:
            best[key] = r
    return [best[k] for k in sorted(best)]


def _shape(r: dict) -> str:
    return "(%d,%d,%d) %s" % (*r["config"], r["attention"])


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.4g} KiB"


def _measured_span(costing: dict) -> str:
    sizes = sorted(costing.get("base") or {})
    return f"{_kib(sizes[0])}-{_kib(sizes[-1])}" if sizes else "no size"


def allreduce_line(table: list[dict], costing: dict | None) -> list[str]:
    """Per B * D the allreduce message one verify carries; with a measured allreduce (allreduce_costing) the time
    per call each B's row was costed at (measured or interpolated, and from which sizes), the allreduce ms per
    forward (2 per layer), and the lever (the sweep's winner, or a faster backend) at that size; outside the
    measured sizes it says so and costs nothing."""
    sizes = {}
    for r in table:
        if r.get("allreduce_bytes"):
            sizes.setdefault((r["B"], r["config"][2], r["allreduce_bytes"]), r)
    if not sizes:
        return []
    if costing is None or "base" not in costing:
        return ((["", costing["note"]] if costing else []) + [
            "allreduce per call at each B x D (two per layer; give an allreduce result of several GPUs or an NCCL "
            "sweep beside the cycle, or --nccl-from, to cost each B at its own size):"]
            + [f"- B {b} x D {d} = {b * d} rows: {_kib(n)} per allreduce" for b, d, n in sorted(sizes)])
    if not costing["base"]:
        return ["", f"allreduce: {costing['path']} holds no {costing['base_name']} rows: no B is costed from it"] + [
            f"- B {b} x D {d} = {b * d} rows: {_kib(n)} per allreduce" for b, d, n in sorted(sizes)]
    out = [f"allreduce per call at each B x D, the rows above costed at it ({costing['base_name']}, "
           f"{costing['mode']} mode, measured {_measured_span(costing)} on {costing['where']}: {costing['path']}; "
           "each of the forward's 2 per layer in place of the one-GPU stand-in):"]
    for (b, d, nbytes), r in sorted(sizes.items()):
        head = f"- B {b} x D {d} = {b * d} rows: {_kib(nbytes)} per allreduce: "
        at = r.get("allreduce_at")
        if at is None:
            out.append(head + f"outside the measured sizes {_measured_span(costing)}: not costed (no extrapolation; "
                       f"this B x D keeps the one-GPU stand-in of {r.get('stand_in_us')} us per call)")
            continue
        us, how = at
        calls = r["allreduce_calls"]
        line = head + (f"{us:.4g} us per call ({how}), {calls * us / 1e3:.4g} ms per forward ({calls} calls)")
        if r.get("stand_in_us") is None:
            line += "; the cycle recorded no stand-in: not re-costed"
        elif r.get("decode_allreduce_at") is None:
            line += f"; plain decode's {_kib(r['B'] * nbytes // (b * d))} is outside the measured sizes: not re-costed"
        else:
            line += f" against the one-GPU stand-in's {r['stand_in_us']:g} us"
        alts = {name: got for name, times in costing["alts"].items() if (got := time_at_size(times, nbytes))}
        if alts:
            name = min(alts, key=lambda k: alts[k][0])
            alt_us = alts[name][0]
            saved = calls * (us - alt_us) / 1e3
            line += (f"; lever: {name} {alt_us:.4g} us per call, saves {saved:.4g} ms per cycle" if saved > 0 else
                     f"; {name} ({alt_us:.4g} us) does not beat it at this size")
        out.append(line)
    if costing.get("lever_env"):
        out.append(f"  the lever's setting: {costing['lever_env']} in the server's environment (advise's allreduce "
                   "lever costs it at one request)")
    return out


def would_cost(run: dict, costing: dict | None) -> list[str]:
    """On CPU numbers: the message size each B x D would be costed at, and which measured sizes it would rest on;
    no time."""
    sizes = sorted({(r["B"], r["config"][2], r["allreduce_bytes"]) for r in rows(run) if r.get("allreduce_bytes")})
    # a CPU file's gloo rows ran the same size grid: enough to say which sizes a B would rest on
    base = (costing or {}).get("base") or next(iter((costing or {}).get("all", {}).values()), None)
    out = []
    for b, d, nbytes in sizes:
        line = f"- B {b} x D {d} = {b * d} rows: {_kib(nbytes)} per allreduce"
        if base:
            at = time_at_size(base, nbytes)
            span = f"{_kib(min(base))}-{_kib(max(base))}"
            line += (f", would be costed {at[1]} of {costing['path']}" if at else
                     f", outside {costing['path']}'s measured sizes {span}: would not be costed")
        out.append(line)
    return out


def would_rank(run: dict, costing: dict | None = None) -> list[str]:
    """On CPU numbers: what the per-batch answer would give on a GPU, with no figure and no order, and the message
    size each B would be costed at."""
    bs = ", ".join(map(str, batches(run)))
    ctx = ", ".join(str(c) for c in sorted({c["params"]["context"] for c in passing_cases(run)}))
    return ["", f"## Per batch, on a GPU (not ranked here: B = {bs}; context {ctx})", stance.CPU_STANCE,
            "- per (steps, topk, D) and B: cycle ms, break-even tau* against plain decode at the same B, tok/s per "
            "request and in total, speedup over plain decode at the same B; the best shape per B",
            "- per shape and context: the largest B where it still pays at the acceptance given",
            "- the allreduce message per call at each B x D, each B costed at its own size where a multi-GPU allreduce "
            "result or NCCL sweep is given",
            "- a chart of the speedup (or tau*) over B, one line per context, extend beside split_kv",
            "- measure with `verifybench cycle --batch 1,2,4,8 --contexts 1024,8192` on a GPU",
            "the allreduce size each B x D would be costed at (no time: CPU numbers):"] + would_cost(run, costing)


def lines(run: dict, tau_of=None, allreduce_from: Path | None = None) -> list[str]:
    """The per-batch answer for advise and plan: the best shape per (context, B), then the largest B where each
    shape pays, then the allreduce sizes; with `allreduce_from` (a multi-GPU allreduce result or an NCCL sweep)
    every row costed at its own allreduce size; on CPU numbers would_rank instead."""
    costing = allreduce_costing(allreduce_from)
    if stance.is_cpu_run(run):
        return would_rank(run, costing)
    if costing and costing.get("cpu"):  # a gloo run's host times say nothing of a GPU allreduce at any size
        costing = {"note": f"{allreduce_from}: CPU numbers (gloo): no B is costed from it ({stance.NO_CONCLUSION})"}
    table = rows(run, tau_of, costing)
    costed = costing is not None and "base" in costing and any(r.get("costed") for r in table)
    out = ["", "## Per batch (B requests at once, each over its own context)"]
    if costed:
        out.append("cycle and decode ms: the one-GPU run with each allreduce re-costed at its own message size "
                   "(the allreduce lines below); [stand-in] marks a row whose size was not measured")

    def mark(r):
        return " [stand-in]" if costed and not r.get("costed") else ""
    if tau_of is None:
        out.append("break-even tau* per shape and B (give --accept-len or --accept-rates for tok/s and the largest "
                   "paying B):")
        out += [f"- context {r['context']}, B {r['B']}: {_shape(r)} cycle {r['cycle_ms']:.4g} ms, decode "
                f"{r['decode_ms']:.4g} ms, tau* {r['tau_star']:.3g}{mark(r)}" for r in table]
        return out + allreduce_line(table, costing)
    for r in best_per_batch(table):
        out.append(f"- context {r['context']}, B {r['B']}: best {_shape(r)}: {r['tok_s_total']:.4g} tok/s in total, "
                   f"{r['tok_s_request']:.4g} per request; {r['speedup']:.3g}x plain decode at B {r['B']} "
                   f"({r['decode_tok_s_total']:.4g} tok/s); cycle {r['cycle_ms']:.4g} ms, tau* {r['tau_star']:.3g} "
                   f"(tau {r['tau']:.3g}){mark(r)}")
    out.append("largest B where each shape still pays (beats plain decode at the same B), per context:")
    for e in largest_paying(table):
        got = (f"B {e['largest_B']}" if e["largest_B"] is not None else "at no B measured")
        left = (f"; B {', '.join(map(str, sorted(e['uncosted_B'])))} not judged: allreduce size not measured"
                if e.get("uncosted_B") else "")
        out.append(f"- context {e['context']}, ({','.join(map(str, e['config']))}) {e['attention']}: {got} "
                   f"(measured at B {', '.join(map(str, sorted(set(e['measured_B']))))}{left})")
    return out + allreduce_line(table, costing)


def chart(run: dict, directory: Path, stamp: str, tau_of=None) -> Path | None:
    """The speedup over plain decode at the same B (with an acceptance; else tau*) against B, one line per context,
    one panel per attention (the engine's extend, our split_kv): each line the best shape at that B. None on CPU
    numbers (no comparison is drawn from them) or with fewer than two batches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verifybench.harness.measure.results.charts import write_png

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
