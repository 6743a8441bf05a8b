# Over 400 lines: the forward's cases, its decomposition tables, fit and chart read one result shape.
"""Synthetic verify forward of one TP rank at n = 1..8 tokens (CPU: 1..3; --tokens sets them), whole and per
component (isolated: only that component; marginal: the forward without it), each captured as one CUDA graph per n.

Run: verifybench verify (the decomposition report)   or   pytest --benchmark-only microbench/bench_verify.py
"""
from __future__ import annotations

from pathlib import Path

import torch

from verifybench.harness.measure.timing import ceiling, memory
from verifybench.harness.analysis import decompose
# the deployment's drafting and re-extend + bookkeeping per cycle: the report's break-even uses them beside the
# measured forward where no cycle result measured them, labelled as assumptions
from verifybench.harness.analysis.breakeven import ASSUMED_DRAFT_MS, ASSUMED_OVERHEAD_MS, DEPLOYMENT
from verifybench.harness.measure.results.charts import write_png
from verifybench.harness.measure.results.store import batch_of, cpu_numbers, stamp, withhold_on_cpu
from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec, rel_error
from verifybench.harness.measure.timing.timer import cuda_available
from verifybench.harness.model import deployed, deployments, presets
from verifybench.kernels.common import config_tables, pdl
from verifybench.kernels.moe_int4.reference import reference_moe_w4a16
from verifybench.harness.model.build import (allreduce_stand_in_us, as_checkpoint, build_forward, release_forwards)
from verifybench.harness.model.forward import COMPONENTS, FORWARD_MAX_TOKENS, TORCH_OPS, VerifyForward, allocated_bytes

NAME = "verify"
TAKES_BATCH = True  # --batch: B requests per forward, each over its own context (B > 1 cases name their batch)
TAKES_DEPLOYMENT = True  # --engine: the forward with the deployment's decode attention and MoE (model/deployed.py)
HELP = "synthetic one-rank verify forward per token count n and its decomposition"  # n: what ran, said beside it
TOKENS = tuple(range(1, 9))
TOKENS_CPU = (1, 2, 3)  # the CPU smoke run: the torch reference MoE is slow; three points still make a fit
CASE_MAX_TIME_S = 0.6
# fused vs plain-torch small ops on the first layers (one dense, one MoE) with fixed routing: over all 61 random
# layers bf16 rounding differences grow to ~5e-2 and a near-tie in top-k flips an expert (seen on the H200), which
# says nothing about the kernels; each kernel has its own test against its reference
CHECK_LAYERS = 2
FORWARD_TOLERANCE = 1e-2


def fused_vs_torch(fwd: VerifyForward, n: int) -> float:
    """Residual stream after the first CHECK_LAYERS layers, fused small ops vs TORCH_OPS (routing from the static
    buffer in both), as a relative error."""
    body = frozenset(COMPONENTS) - {"head", "router"}
    layers, fused = fwd.layers, fwd.ops
    fwd.layers = layers[:CHECK_LAYERS]
    try:
        h_fused = fwd.forward(n, body).clone()
        fwd.ops = TORCH_OPS
        h_torch = fwd.forward(n, body).clone()
    finally:
        fwd.layers, fwd.ops = layers, fused
    return rel_error(h_fused, h_torch)


def moe_error(fwd: VerifyForward, n: int) -> float:
    """The forward's MoE on its last layer's weights against the fp32 reference, every pair on one expert (the
    reference stays small), as a relative error."""
    s, L, b = fwd.s, fwd.layers[-1], fwd.buf[n]
    x = torch.randn(n * fwd.batch, s.hidden, device=fwd.device, dtype=torch.bfloat16)
    e = int(b["topk_ids"][0, 0])
    ids = torch.full_like(b["topk_ids"], e)
    got = fwd.moe_fn(x, L["w13p"], L["w13s"], L["w2p"], L["w2s"], b["topk_w"], ids)
    ckpt = [as_checkpoint(L[k][e: e + 1], fwd.device, s.expert_group_size) for k in ("w13p", "w2p")]
    ref = reference_moe_w4a16(x, ckpt[0], L["w13s"][e: e + 1], ckpt[1], L["w2s"][e: e + 1], b["topk_w"],
                              torch.zeros_like(ids))
    return rel_error(got, ref)


def plan_layers(preset: str, tp: int, layers: int | None, context: int, batch: int = 1) -> memory.Plan:
    """How many layers of the forward fit the free memory (measure/timing/memory.py's rule; the forward's bytes from
    forward.allocated_bytes): all (or `layers`), else fewer down to the dense layers plus one MoE layer."""
    full = presets.get(preset, tp)
    wanted = layers or full.layers
    least = min(wanted, max(full.dense_layers + 1, CHECK_LAYERS))
    device = "cuda" if cuda_available() else "cpu"
    return memory.plan(lambda n_layers: allocated_bytes(presets.get(preset, tp, n_layers), context, FORWARD_MAX_TOKENS,
                                                        batch),
                       wanted, least, f"the {preset} TP{tp} verify forward at context {context}"
                       + (f" for {batch} requests" if batch > 1 else ""), "layers", device)


def add_arguments(p) -> None:
    deployments.add_arguments(p)


def _case(preset, tp, layers, context, n, variant: str, comps: frozenset, plan: memory.Plan | None = None,
          batch: int = 1, max_batch: int = 1, deployment=None) -> CaseSpec:
    """variant "full-nopdl": the whole forward with programmatic dependent launch off (kernels/common/pdl.py; the other
    variants follow VERIFYBENCH_PDL), measured beside "full" to show what the overlap buys; its check: the residual
    stream equals the PDL forward's bit for bit (every kernel of ours is deterministic, so a difference is a race;
    with the engine's Marlin MoE, whose atomic adds are not, within FORWARD_TOLERANCE).
    `plan`: the memory plan (fewer layers than wanted: named in the case name, params and derived figures);
    `deployment`: (tag, Deployment) whose decode attention and MoE the forward runs (None: ours)."""
    tag, dep = deployment or (None, None)
    ar_us, ar_source = allreduce_stand_in_us()
    no_pdl = variant == "full-nopdl"
    total = layers or presets.get(preset, tp).layers
    if plan is not None and plan.reduced:
        layers = plan.units
    label = f"{preset}-tp{tp}" + (f"-L{layers}" if plan is not None and plan.reduced else "")

    def setup(batch: int, tokens: int):  # the case's params (CaseSpec.prepare): what its record names runs
        if plan is not None and plan.units == 0:
            raise CaseSkipped(plan.skip)
        fwd = build_forward(preset, tp, layers, context, ar_us, max_batch).at_batch(batch)
        comp = deployed.compose(dep, fwd) if dep is not None else None
        fwd = deployed.apply(fwd, comp) if comp else fwd

        def run():
            if not no_pdl:
                return fwd.forward(tokens, comps)
            with pdl.forced(False):
                return fwd.forward(tokens, comps)

        def check():
            if no_pdl:
                fwd.forward(tokens, comps)
                h_pdl = fwd.buf[tokens]["h"].clone()
                run()
                if comp is not None and comp.moe is not None:  # Marlin's atomic adds (sm_90+) sum in no fixed order
                    err = rel_error(fwd.buf[tokens]["h"], h_pdl)
                    return err <= FORWARD_TOLERANCE, (f"residual stream with and without PDL rel_err {err:.2e} (not "
                                                      "bitwise: the engine's Marlin adds its partial sums atomically)")
                same = torch.equal(fwd.buf[tokens]["h"], h_pdl)
                return same, "residual stream equal with and without PDL" if same else "PDL changed the result"
            out = run()
            if variant != "full":
                return True, "runs"
            predicts, accept_index, accepted = out
            ok = 0 <= int(accepted[0]) < tokens and bool(torch.isfinite(fwd.buf[tokens]["predict"]).all())
            detail = f"accepted {int(accepted[0])} of {tokens - 1}"
            if comp is None or comp.moe is None:  # the engine's MoE reads the weights in its own layout: below
                err = moe_error(fwd, tokens)
                ok, detail = ok and err <= 1e-2, f"moe rel_err {err:.2e}; {detail}"
            if comp is not None:  # the engine's decode attention and MoE against torch before they are timed
                good, said = deployed.check(comp, fwd, tokens=(tokens * batch,))
                ok, detail = ok and good, f"{detail}; {said}" if said else detail
            if fwd.ops is not TORCH_OPS:  # fused (or the engine's attention) against plain torch
                err_fwd = fused_vs_torch(fwd, tokens)
                ok = ok and err_fwd <= FORWARD_TOLERANCE
                detail += f"; first {CHECK_LAYERS} layers fused vs torch small ops rel_err {err_fwd:.2e}"
            return ok, detail

        def derive(m):
            d = {"tokens": tokens, "batch": batch, "allreduce_bytes": batch * tokens * fwd.s.hidden * 2,
                 "variant": variant, "allreduce_stand_in_us": ar_us, "allreduce_source": ar_source,
                 "ops": fwd.ops.name}
            d["pdl"] = not no_pdl and pdl.enabled(fwd.device)
            if comp is not None:
                d["deployment"] = comp.params()
            d["config_source"] = config_tables.sources(fwd.device)  # per kernel: tuned / default
            d.update(layers_run=len(fwd.layers), layers_total=total)
            if plan is not None and plan.reduced:
                d["memory_note"] = plan.note
            if variant == "full":
                distinct = fwd.distinct_experts(tokens)
                by = fwd.weight_bytes(tokens, distinct)
                copy = ceiling.copy_gbps(fwd.device)
                d.update(bytes=by["total"], routed_bytes=by["routed_experts"], kv_bytes=by["kv"],
                         component_bytes=by["by_component"],
                         distinct_experts_mean=sum(distinct) / max(1, len(distinct)), copy_gbps=copy,
                         copy_source=ceiling.copy_source(fwd.device),
                         roofline_us=by["total"] / (copy * 1e3), eta=ceiling.eta(by["total"], m.median_us, copy))
                if len(fwd.layers) < total:  # fewer layers for memory: the whole forward estimated by its bytes
                    whole = allocated_bytes(presets.get(preset, tp, total), context, FORWARD_MAX_TOKENS)
                    d["all_layers_scale"] = whole / allocated_bytes(fwd.s, context, FORWARD_MAX_TOKENS)
            return d

        return run, check, derive

    return CaseSpec(f"verify/{label}/" + (f"{tag}/" if tag else "") + (f"B{batch}/" if batch > 1 else "")
                    + f"{variant}/n{n}", {"preset": preset, "tp": tp, "tokens": n, "batch": batch, "context": context,
                                          "layers": layers, "variant": variant,
                                          **(deployments.params(tag, dep) if dep is not None else {})}, "graph", setup,
                    {"calls_per_sample": 1, "max_time_s": CASE_MAX_TIME_S})


def cases(preset: str, tp: int, context: int = presets.CONTEXT, tokens: tuple[int, ...] | None = None,
          layers: int | None = None, batch: tuple[int, ...] | None = None, engine: str | None = None,
          engine_args: str | None = None, deploy_cc: int | None = None) -> list[CaseSpec]:
    """Per n: the full forward, each component alone (isolated) and the forward without it (marginal); where PDL
    can run, the full forward without it too. With `engine`: the forward as that deployment runs it. The layers are planned against the free memory here (listing
    allocates nothing; the components before have released theirs): fewer layers when short, every case skipped
    with the bytes needed and free when not even the least fits."""
    ns = tokens or (TOKENS if cuda_available() else TOKENS_CPU)
    if max(ns) > FORWARD_MAX_TOKENS:
        raise ValueError(f"--tokens: the verify forward runs n = 1..{FORWARD_MAX_TOKENS}, got {max(ns)}")
    batches = tuple(batch or (1,))
    top = max(batches)
    plan = plan_layers(preset, tp, layers, context, top)
    out = []
    gpu = cuda_available()
    deps = deployments.variants(engine, engine_args, cc=deploy_cc)
    for b, n in ((b, n) for b in batches for n in ns):
        def add(variant, comps):
            out.append(_case(preset, tp, layers, context, n, variant, comps, plan, b, top, deps[0] if deps else None))
        add("full", frozenset(COMPONENTS))
        if gpu and pdl.enabled("cuda"):  # PDL on: its cost is shown beside it
            add("full-nopdl", frozenset(COMPONENTS))
        for c in COMPONENTS:
            add(f"only-{c}", frozenset({c}))
            add(f"without-{c}", frozenset(COMPONENTS) - {c})
    return out


def one_batch(records: list[dict]) -> list[dict]:
    """The records of the smallest batch the run holds: the decomposition, fit and break-even are one request's."""
    least = min((batch_of(r) for r in records), default=1)
    return [r for r in records if batch_of(r) == least]


def batch_rows(records: list[dict]) -> list[dict]:
    """The full forward per batch B and tokens n per request: B * n tokens per forward, its time and per token."""
    rows = [{"B": batch_of(r), "n": r["params"]["tokens"], "tokens_per_forward":
             batch_of(r) * r["params"]["tokens"], "forward_us": r["summary"]["median_us"],
             "distinct_experts_mean": r["derived"].get("distinct_experts_mean"),
             "allreduce_KiB": r["derived"].get("allreduce_bytes", 0) / 1024}
            for r in records if r["check"]["ok"] and r["params"]["variant"] == "full"]
    return sorted(rows, key=lambda row: (row["B"], row["n"]))


def decomposition(records: list[dict]) -> dict:
    """From stored case records: the per-n table, the token fit and the break-even at the measured verify times."""
    med = {}
    for r in records:
        if r["check"]["ok"]:
            med.setdefault(r["params"]["variant"], {})[r["params"]["tokens"]] = r["summary"]["median_us"]
    full = med.get("full", {})
    roof = {r["params"]["tokens"]: r["derived"]["roofline_us"] for r in records
            if r["check"]["ok"] and r["params"]["variant"] == "full"}
    iso = {c: med.get(f"only-{c}", {}) for c in COMPONENTS}
    without = {c: med.get(f"without-{c}", {}) for c in COMPONENTS}
    out = {"table": decompose.table(full, iso, without, roof)}
    for row in out["table"]:  # the same forward without programmatic dependent launch, measured beside it
        row["no_pdl_us"] = med.get("full-nopdl", {}).get(row["n"])
    if len(full) >= 3:
        out["fit"] = decompose.token_fit(full)
    return out


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    """PNG charts beside the report: stacked isolated components vs n with the measured forward, and measured vs
    predicted (sum of parts, fit). On CPU the components alone: the parts against the forward are withheld in the
    tables (stance.py), so no measured forward and no measured-vs-predicted chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = one_batch(records)
    dec = decomposition(records)
    rows = dec["table"]
    cpu = cpu_numbers(records)
    if not rows:
        return []
    ns = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    bottom = [0.0] * len(ns)
    for comp in COMPONENTS:
        vals = [(r.get(f"{comp}_us") or 0) / 1e3 for r in rows]
        ax.bar(ns, vals, bottom=bottom, label=comp)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if not cpu:
        ax.plot(ns, [r["measured_us"] / 1e3 for r in rows], "k-o", label="measured forward")
    ax.set_xticks(ns)  # n is an integer: no fractional ticks
    ax.set_xlabel("tokens verified (n)")
    ax.set_ylabel("ms")
    ax.set_title("verify forward: isolated components (stacked)" + (" (CPU numbers: not compared with the "
                                                                     "measured forward)" if cpu else " vs measured"))
    ax.legend(fontsize=8, ncol=2)
    paths = [write_png(fig, Path(directory) / f"verify_components-{stamp}.png")]
    if cpu:
        return paths
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, [r["measured_us"] / 1e3 for r in rows], "k-o", label="measured")
    ax.plot(ns, [r["sum_of_parts_us"] / 1e3 for r in rows], "b--s", label="sum of isolated parts")
    if all(r.get("no_pdl_us") for r in rows):
        ax.plot(ns, [r["no_pdl_us"] / 1e3 for r in rows], "k:x", label="measured, PDL off")
    if all(r.get("no_comm_us") for r in rows):
        ax.plot(ns, [r["no_comm_us"] / 1e3 for r in rows], "m-^", label="measured without allreduce")
    if rows[0].get("roofline_us"):
        ax.plot(ns, [r["roofline_us"] / 1e3 for r in rows], "g:", label="weight+KV roofline")
    if "fit" in dec:
        f = dec["fit"]
        ax.plot(ns, [(f["a"] + f["b"] * n) / 1e3 for n in ns], "r-", alpha=0.5, label="fit a + b n")
    ax.set_xticks(ns)
    ax.set_xlabel("tokens verified (n)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    paths.append(write_png(fig, Path(directory) / f"verify_measured_vs_predicted-{stamp}.png"))
    return paths


def component_eta(records: list[dict]) -> list[dict]:
    """Per n and component: the bytes it must read, its isolated time, and eta = bytes / time / copy bandwidth.
    The gap to the roofline lives where eta is low."""
    iso = {(r["params"]["variant"], r["params"]["tokens"]): r["summary"]["median_us"] for r in records
           if r["check"]["ok"]}
    rows = []
    for r in records:
        d = r["derived"]
        if r["params"]["variant"] != "full" or not r["check"]["ok"] or "component_bytes" not in d:
            continue
        n = r["params"]["tokens"]
        row = {"n": n}
        for comp, nbytes in d["component_bytes"].items():
            t = iso.get((f"only-{comp}", n))
            row[f"{comp}_MB"] = nbytes / 1e6
            row[f"{comp}_eta"] = ceiling.eta(nbytes, t, d["copy_gbps"]) if t else None
        rows.append(row)
    return sorted(rows, key=lambda row: row["n"])


def setup_lines(records: list[dict]) -> list[dict]:
    """What ran: the small-op set, programmatic dependent launch on or off, the allreduce (a stand-in on one GPU),
    the context, the copy bandwidth."""
    full = [r for r in records if r["params"]["variant"] == "full" and r["check"]["ok"]]
    if not full:
        return []
    d, p = full[0]["derived"], full[0]["params"]
    layers = (f"{d['layers_run']} of {d['layers_total']}" if d.get("layers_total") and d.get("layers_run")
              and d["layers_run"] < d["layers_total"] else p["layers"] or "all")
    allreduce = (f"device wait of {d['allreduce_stand_in_us']} us per allreduce ({d.get('allreduce_source', '?')})"
                 if not cpu_numbers(records) else "none: one rank on CPU, the allreduce is a no-op")
    row = {"ops": d.get("ops"), "pdl": d.get("pdl"), "allreduce": allreduce, "context": p["context"], "layers": layers,
           "copy_GBps": d.get("copy_gbps"), "copy_from": d.get("copy_source")}
    if d.get("memory_note"):
        row["memory"] = d["memory_note"]
    return [row]


def measured_overheads(cycle: dict | None) -> tuple[dict, str]:
    """({D: (config label, draft_ms, overhead_ms)}, why empty) from a loaded cycle result: per D the cheapest
    (configuration, attention) case, its draft phase, and as overhead everything else the cycle costs beyond its bare
    forward at D (tree attention, gathers, eager verify, sync, bookkeeping, re-extend). A CPU run's phases are CPU
    numbers: not used."""
    if cycle is None:
        return {}, "no cycle result"
    if cpu_numbers(cycle.get("cases", [])):
        return {}, "the cycle result holds CPU numbers"
    out = {}
    try:
        for case in cycle["cases"]:
            d = case.get("derived", {})
            if not case["check"]["ok"] or "cycle_ms" not in d:
                continue
            p = case["params"]
            draft = d["table_ms"]["draft"]
            overhead = d["cycle_ms"] - draft - d["bare_forward_ms"]
            label = f"({p['steps']},{p['topk']},{p['draft_tokens']}) {p['attention']}"
            best = out.get(p["draft_tokens"])
            if best is None or draft + overhead < best[1] + best[2]:
                out[p["draft_tokens"]] = (label, draft, max(0.0, overhead))
    except (KeyError, TypeError) as e:
        return {}, f"the cycle result cannot be read: missing {e}"
    return out, "" if out else "no passing cycle case"


def break_even_rows(table: list[dict], cycle: dict | None = None) -> list[dict]:
    """tau* = (T_draft + T_verify(n) + T_overhead) / T_decode per n, with T_decode the measured one-token forward.
    With a cycle result (a loaded result dict) that measured draft and overhead, the rows are the n it ran, each with
    its measured ones (never mixed with ASSUMED rows); without one, every row takes the ASSUMED defaults, which the
    title states once."""
    decode = next((r["measured_us"] for r in table if r["n"] == 1), None)
    if decode is None:
        return []
    measured, _ = measured_overheads(cycle)
    rows = []
    for r in table:
        if measured and r["n"] not in measured:
            continue
        config, draft_ms, overhead_ms = measured.get(r["n"], (None, ASSUMED_DRAFT_MS, ASSUMED_OVERHEAD_MS))
        be = decompose.break_even(1.0, decode / 1e3, r["measured_us"] / 1e3, draft_ms, overhead_ms)
        row = {"n": r["n"], "verify_ms": r["measured_us"] / 1e3, "cycle_ms": be.cycle_ms,
               "break-even accept len": be.tau_star, "max accept len (n)": r["n"],
               "pays off at full acceptance": r["n"] > be.tau_star}
        if config:
            row.update({"draft_ms": draft_ms, "overhead_ms": overhead_ms, "draft+overhead": f"measured {config}"})
        rows.append(row)
    return rows


def break_even_title(cycle: dict | None = None, cycle_name: str | None = None) -> str:
    """The break-even table's title: where draft and overhead came from (measured by the cycle result named, or
    ASSUMED)."""
    head = "break-even accept length per n: T_decode = the measured n=1 forward, T_verify(n) = the measured forward"
    assumed = (f"draft {ASSUMED_DRAFT_MS} ms and overhead {ASSUMED_OVERHEAD_MS} ms per cycle ASSUMED (the "
               f"deployment's: {DEPLOYMENT})")
    measured, why = measured_overheads(cycle)
    if not measured:
        return f"{head}, {assumed}" + (f"; {why}, not used" if cycle is not None else "")
    name = cycle_name or f"cycle-{stamp(cycle)}.json"
    return (f"{head}, draft and overhead (the cycle beyond its draft and its bare forward) measured per cycle "
            f"(cycle result {name}, the cheapest case) at n = "
            f"{', '.join(str(d) for d in sorted(measured))}: only the n the cycle ran")


# CPU: withheld (the roofline is bytes over a CPU copy ceiling: nothing a GPU forward is held against)
RATIOS = ("roofline_us", "measured/roofline", "no_comm/roofline", "parts_error_%")


def tables(records: list[dict], cycle: dict | None = None,
           cycle_name: str | None = None) -> list[tuple[str, list[dict]]]:
    """The setup, the decomposition per n, marginal costs, bytes and eta per component, the break-even (with draft
    and overhead measured by `cycle`, a loaded cycle result, where given) and the token fit. From a CPU run (the
    smoke profile) the conclusions CPU timer noise cannot support (roofline ratios, the parts' error, marginal
    costs, eta, break-even accept length, the fit) are withheld in their cells; the times stay."""
    several = len({batch_of(r) for r in records}) > 1
    per_batch = batch_rows(records) if several else []
    records = one_batch(records)
    dec = decomposition(records)
    cpu = cpu_numbers(records)
    short = [{k: v for k, v in row.items() if not k.endswith("_marginal_us")} for row in dec["table"]]
    marginal = [{"n": row["n"], **{k: v for k, v in row.items() if k.endswith("_marginal_us")}} for row in dec["table"]]
    etas = component_eta(records)
    be = break_even_rows(dec["table"], cycle)
    full = [r for r in records if r["params"]["variant"] == "full" and r["check"]["ok"]]
    scale = full[0]["derived"].get("all_layers_scale") if full else None
    if scale:  # fewer layers ran (memory): the whole forward estimated by its bytes, labelled as such
        for row in short:
            row["all_layers_estimate_us"] = row["measured_us"] * scale
    short = withhold_on_cpu(records, short, RATIOS)
    marginal = withhold_on_cpu(records, marginal, lambda k: k != "n")
    etas = withhold_on_cpu(records, etas, lambda k: k.endswith("_eta"))
    # the deployment's assumed draft and overhead are never added to CPU times: the cycle column goes too
    be = withhold_on_cpu(records, be, ("break-even accept len", "pays off at full acceptance", "cycle_ms"))
    layers = setup_lines(records)[0]["layers"] if full else "all"
    out = [deployments.table(records), ("setup (CPU: one rank, torch ops, no allreduce runs)" if cpu else
            "setup (one GPU: the allreduce is a calibrated device wait, not a collective)", setup_lines(records)),
           (f"verify forward ({layers} layers), isolated components (us; each alone in its own "
            + ("CPU loop" if cpu else "graph") + "); no_comm = "
            "forward without allreduce, held against the weight+KV roofline"
            + ("; all_layers_estimate = measured x the whole forward's bytes / the run's (an estimate)" if scale
               else ""), short),
           ("marginal cost of each component (us; forward minus forward without it)", marginal),
           ("bytes and eta of each component (isolated time vs copy bandwidth)", etas)]
    out.append(("break-even accept length per n: withheld, CPU numbers (no assumed draft or overhead is added to "
                "CPU times)" if cpu else break_even_title(cycle, cycle_name), be))
    if per_batch:
        out.append((f"the full forward at B requests of n tokens each (the tables above: B = "
                    f"{batch_of(records[0])}); distinct experts = mean over MoE layers", per_batch))
        fits = decompose.batch_fits(per_batch)
        if fits:
            out.append(("fit of the full forward over the tokens it carries, T = a + b x tokens (tokens = B x n; per "
                        "B over its n, and over every row; 95% CI)", withhold_on_cpu(records, fits,
                                                                                 lambda k: k not in ("B", "tokens"))))
    if "fit" in dec:
        f = dec["fit"]
        row = {"a_us": f["a"], "a_ci_us": f["a_halfwidth"], "b_us": f["b"], "b_ci_us": f["b_halfwidth"],
               "r2": f["r2"], f"fixed_share_a/T({f['n_max']})": f["fixed_share"]}
        out.append((f"fit T(n) = a + b n over n = {', '.join(str(r['n']) for r in dec['table'])} (95% CI)",
                    withhold_on_cpu(records, [row], lambda k: True)))
    return out


def release() -> None:
    release_forwards()
