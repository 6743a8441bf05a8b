"""The engine's flags as measured A/B (`cycle --engine E --ab ...`): per context, batch and draft shape, each variant's
measured ms per cycle and its tau* against its OWN plain decode step, ranked; the parts ours stood in for, named.

Where a variant's kernel could not run (a stand-in ran in its place), its cycle is projected: the measured cycle with
the stand-in's per-forward time swapped for the engine kernel's from mla_verify (verify attention) and mla_decode
(the plain decode step), marked "projected"; without those rows the variant is listed unranked, said why.
"""
from __future__ import annotations

import numpy as np

from verifybench.harness.analysis.batches import case_config, passing_cases
from verifybench.harness.answers.levers import attention_per_forward_ms
from verifybench.harness.measure import stance
from verifybench.harness.measure.results import compare
from verifybench.harness.measure.results.store import WITHHELD, batch_of
from verifybench.harness.model.deployments import stand_in_text

# our kernel that stands in for each engine kernel, as mla_verify / mla_decode name them
VERIFY_OURS = {"sglang.extend": "extend", "flashinfer.mla": "split_kv"}
DECODE_OURS = {"sglang.decode": "triton", "flashinfer.decode": "triton"}
# compare's minimum effect: a variant within it of the deployed one has changed nothing the measurement can tell
MIN_EFFECT = 0.03
# each variant's cycle is one case run once, after the one before it: the host's speed drifts between cases
ONCE = ("each variant ran once, one after the other: before reading a difference of a few % as the flag's, run the "
        "A/B again and `verifybench compare` the two (docs/FINDINGS.md §11)")
PROJECTED = ("verify attention", "decode attention")  # the parts whose engine kernel a component result times


def deployed_cases(run: dict) -> list[dict]:
    """The passing cycle cases that ran as a deployment (cycle --engine)."""
    return [c for c in passing_cases(run) if "deployment" in c["params"]]


def _decode_layer_us(runs: dict, impl: str, context: int) -> float | None:
    rows = [c for c in passing_cases(runs.get("mla_decode", {"cases": []})) if c["params"].get("impl") == impl
            and c["params"].get("context") == context and c["params"].get("tokens") == 1 and batch_of(c) == 1]
    return rows[0]["summary"]["median_us"] if rows else None


def _projected(case: dict, runs: dict) -> tuple[float | None, float | None, str]:
    """(cycle ms, decode ms, how) of a case whose parts stood in: the engine's kernel swapped in from the component
    results; (None, None, why) where they do not hold it."""
    d, p = case["derived"], case["params"]
    cycle, decode, how = d["cycle_ms"], d["decode_ms"], []
    layers, ctx, b = d.get("layers_total", 61), p["context"], batch_of(case)
    for part, engine, ours, _ in d["deployment"]["stand_ins"]:
        if part == "verify attention":
            if "mla_verify" not in runs:
                return None, None, f"{engine} stood in for by {ours}, and no mla_verify result to project with"
            try:
                theirs, _ = attention_per_forward_ms(runs, engine, p["draft_tokens"], ctx, b)
                mine, _ = attention_per_forward_ms(runs, VERIFY_OURS.get(engine, "split_kv"), p["draft_tokens"], ctx, b)
            except ValueError as e:
                return None, None, f"{engine} stood in for: {e}"
            cycle += theirs - mine
            how.append(f"verify attention {engine} {theirs:.3g} ms per forward (mla_verify) for {ours}'s {mine:.3g}")
        elif part == "decode attention":
            theirs, mine = (_decode_layer_us(runs, k, ctx) for k in (engine, DECODE_OURS.get(engine, "triton")))
            splits = p.get("kernels", {}).get("decode kv splits")
            if theirs is None or mine is None or (engine == "sglang.decode" and splits not in (None, 8)):
                return None, None, (f"{engine} stood in for by {ours}, and no mla_decode row of it at context {ctx}"
                                    + (f" with {splits} KV splits" if splits not in (None, 8) else ""))
            decode += layers * (theirs - mine) / 1e3  # the plain decode step only: the cycle runs no MLA decode
            how.append(f"decode {engine} {theirs:.3g} us per layer (mla_decode) for {ours}'s {mine:.3g}")
        else:  # the draft's attention (a small cache) and the MoE: measured with ours, said so
            how.append(f"{part}: {ours} stood in for {engine} (not projected)")
    return cycle, decode, "; ".join(how)


def rows(runs: dict) -> list[dict]:
    """One row per deployment case: its group (context, B, shape), variant, flags, measured (or projected) cycle and
    decode, tau* = cycle / its own decode, and what stood in."""
    out = []
    for c in deployed_cases(runs["cycle"]):
        p, d = c["params"], c["derived"]
        stood = d.get("deployment", {}).get("stand_ins", [])
        row = {"context": p["context"], "B": batch_of(c), "shape": case_config(c), "variant": p["deployment"],
               "flags": p.get("engine_args") or "the engine's defaults", "cycle_ms": d["cycle_ms"],
               "decode_ms": d["decode_ms"], "status": "measured", "note": "", "stand_ins": stand_in_text(stood),
               "case": c}
        if any(part in PROJECTED for part, *_ in stood):
            cycle, decode, how = _projected(c, runs)
            row.update(cycle_ms=cycle, decode_ms=decode, status="projected" if cycle is not None else "unranked",
                       note=how)
        row["tau_star"] = row["cycle_ms"] / row["decode_ms"] if row["cycle_ms"] is not None else None
        out.append(row)
    return out


def lines(runs: dict) -> list[str]:
    """The A/B section for advise: [] where the cycle result ran no deployment."""
    if "cycle" not in runs:
        return []
    table = rows(runs)
    if not table:
        return []
    line = next((c["params"]["deployment_line"] for c in deployed_cases(runs["cycle"])
                 if c["params"]["deployment"] == "deployed"), table[0]["flags"])
    out = ["", "## The engine's flags, measured A/B (each variant's own decode step is its tau*'s denominator)",
           f"base: {line}", ONCE]
    cpu = stance.any_cpu([runs["cycle"]])
    groups: dict[tuple, list[dict]] = {}
    for r in table:
        groups.setdefault((r["context"], r["B"], r["shape"]), []).append(r)
    for (ctx, b, shape), rs in sorted(groups.items()):
        out.append(f"context {ctx}, B {b}, (steps, topk, D) {shape}:")
        base = next((r for r in rs if r["variant"] == "deployed" and r["cycle_ms"] is not None), None)
        ranked = sorted((r for r in rs if r["cycle_ms"] is not None), key=lambda r: r["cycle_ms"])
        for i, r in enumerate(ranked if not cpu else rs, 1):
            if cpu:
                out.append(f"- {r['variant']} ({r['flags']}): {WITHHELD}; stand-ins: {r['stand_ins']}")
                continue
            saved = "" if base is None or r is base else _against(r, base)
            out.append(f"{i}. {r['variant']} ({r['flags']}): {r['cycle_ms']:.4g} ms per cycle{saved}; its decode "
                       f"{r['decode_ms']:.4g} ms, tau* {r['tau_star']:.3g} [{r['status']}]")
            if r["note"]:
                out.append(f"   {r['note']}")
            if r["stand_ins"] != "none":
                out.append(f"   stand-ins: {r['stand_ins']}")
        for r in rs if not cpu else []:
            if r["cycle_ms"] is None:
                out.append(f"- {r['variant']} ({r['flags']}): not ranked: {r['note']}")
    return out


def _against(r: dict, base: dict) -> str:
    """The variant against the deployed one: compare's verdict on the two cases' cycle samples (Mann-Whitney U and
    the minimum effect) where both were measured; the minimum effect alone where one was projected."""
    diff = r["cycle_ms"] - base["cycle_ms"]
    if r["status"] == base["status"] == "measured":
        v, _, how = compare.verdict(_case_data(base["case"]), _case_data(r["case"]), MIN_EFFECT)
    else:
        v = "SAME" if abs(diff / base["cycle_ms"]) < MIN_EFFECT else "FAST" if diff < 0 else "SLOW"
        how = "projected: no samples"
    return {"FAST": f", saves {-diff:.4g} ms against the deployed ({how})",
            "SLOW": f", costs {diff:.4g} ms more than the deployed ({how})",
            "SAME": f", within {100 * MIN_EFFECT:.0f}% of the deployed ({diff:+.3g} ms): no change",
            "AMBG": f", {diff:+.3g} ms against the deployed, not significant ({how}): no change the samples show"}[v]


def _case_data(c: dict) -> compare.CaseData:
    s = c["summary"]
    return compare.CaseData(c["name"], c["mode"], True, s["median_us"], np.asarray(c["samples_us"], dtype=float),
                            (s["q1_us"], s["q3_us"]))
