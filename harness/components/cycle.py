"""The whole EAGLE-3 speculative cycle of one TP rank as SGLang's EAGLE worker runs it, per phase, with no sync but
the cycle's own: draft steps / target verify / draft re-extend / other, and what the verify costs beyond the forward.

Run: verifybench cycle [--configs "2,1,3;3,1,4;5,1,6;5,4,8"] [--attention extend,split_kv] [--contexts 1024,4096]
                      [--batch 1,2,4,8]
With --batch, B requests at once, each over its own context: draft, tree, verify and re-extend carry B times the rows,
the plain decode it is held against runs B tokens; a case of B > 1 names its batch (B1 names are unchanged).
With --engine sglang [--engine-args "FLAGS"]: each part runs the kernel those flags deploy (model/deployed.py; ours in
its place where it cannot run here, named with the reason); --ab "FLAGS;FLAGS" (or --ab levers) runs the cases once
more per variant of the flags, named for it; `verifybench advise` on the folder ranks them by measured ms per cycle.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from verifybench.harness.analysis.cycle_charts import passing_rows as _ok, row_key as _key
from verifybench.harness.analysis.cycle_charts import several_batches as _several_batches
from verifybench.harness.analysis.cycle_charts import several_contexts as _several_contexts
from verifybench.harness.analysis.cycle_charts import context_chart as _context_chart
from verifybench.harness.analysis.cycle_charts import context_chart_line  # noqa: F401 (cycle.context_chart_line)
from verifybench.harness.analysis.numbers import context_list, contexts_arg, name_list, nonempty
from verifybench.harness.analysis.numbers import parse_configs as read_configs
from verifybench.harness.components.mla_verify import variant_config
from verifybench.harness.measure.timing import memory
from verifybench.harness.measure.results.charts import write_png
from verifybench.harness.measure.results.store import cpu_numbers, withhold_on_cpu
from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec, release_unreferenced, say_once
from verifybench.harness.measure.timing.timer import cuda_available, measure
from verifybench.harness.model import deployed, deployments, presets
from verifybench.harness.model.build import allreduce_stand_in_us, build_forward, device_wait, release_forwards
from verifybench.harness.model.cycle import ATTENTION, ENGINE_PHASES, PHASES, Cycle, SpecConfig
from verifybench.harness.model.draft import draft_shape, weight_bytes
from verifybench.harness.model.forward import FORWARD_MAX_TOKENS, allocated_bytes

NAME = "cycle"
TAKES_BATCH = True  # --batch: requests per cycle
TAKES_DEPLOYMENT = True  # `run --engine`: the engine as deployed (and ours beside it)
HELP = "the whole EAGLE-3 cycle (draft, tree, verify with the tree mask, sync, bookkeeping, re-extend) per phase"
GPU_CONFIGS = "2,1,3;3,1,4;5,1,6;5,4,8"  # (steps, topk, draft tokens): SGLang's chain default for Kimi and beyond
CPU_CONFIGS = "2,1,3;2,2,3"
# several batches on a GPU: the deployment's two draft-token counts (D = 3 and 6, the --accept-len 3:..,6:.. profile),
# so that 4 batches x 2 contexts x 2 attention variants fit one GPU session's call
BATCH_CONFIGS = "2,1,3;5,1,6"
CASE_MAX_TIME_S = 1.5
PART_MAX_TIME_S = 0.4  # each forward measured beside the cycle
ROOT_TOKEN = 7  # the checks' last verified token
# The phases and the whole cycle are timed in separate passes; past this they disagree (a disturbed pass), and
# "other" (the cycle minus the phases) would show that disagreement as a time, negative or inflated.
PHASES_AGREE = 0.03


def add_arguments(p) -> None:
    p.add_argument("--configs", type=nonempty("configurations"), default=None,
                   help="(steps,topk,draft_tokens) triples separated by ';' (default "
                   f"{GPU_CONFIGS} on a GPU, {BATCH_CONFIGS} with several --batch sizes or --ab, {CPU_CONFIGS} on "
                   "CPU); "
                   f"draft tokens include the root, at most {FORWARD_MAX_TOKENS}")
    p.add_argument("--attention", type=nonempty("attention variants"), default=None,
                   help="verify attention variants, comma-separated: extend (the "
                   "engine's serial prefill kernel), split_kv (ours) (default both on a GPU; CPU: the torch reference)")
    p.add_argument("--contexts", type=contexts_arg, default=None,
                   help="several contexts, comma-separated (e.g. 1024,4096,16384): the cycle's phases per context and "
                   "a chart of cycle ms against context (cycle_contexts-<UTC time>.png in the results folder; on a GPU "
                   "only, said so on CPU); replaces --context")
    deployments.add_arguments(p, ab=True)


def parse_contexts(text) -> list[int]:
    """"1024,4096" -> [1024, 4096]: distinct contexts in 1..MAX_CONTEXT, in the order given (numbers.context_list);
    a tuple from the argparse type passes through."""
    return list(text) if isinstance(text, (tuple, list)) else list(context_list(text))


def parse_configs(text: str) -> list[SpecConfig]:
    """plan's reader of --configs (the one), each triple then checked as a cycle (SpecConfig)."""
    return [SpecConfig(*t) for t in read_configs(text)]


def _plan(preset: str, tp: int, context: int, cfgs: list[SpecConfig], batch: int = 1) -> memory.Plan:
    """The layers that fit: the target forward and the draft with `batch` requests' caches (the largest batch of
    the run: every batch at a context runs the same layers, so they compare)."""
    full = presets.get(preset, tp)
    rows = max(max(c.topk, c.steps + 1) for c in cfgs)
    extra = weight_bytes(draft_shape(full), context, rows, batch=batch)
    device = "cuda" if cuda_available() else "cpu"
    return memory.plan(lambda n: allocated_bytes(presets.get(preset, tp, n), context, FORWARD_MAX_TOKENS, batch)
                       + extra, full.layers, full.dense_layers + 1, f"the {preset} TP{tp} target forward and draft "
                       f"model at context {context}" + (f" for {batch} requests" if batch > 1 else ""), "layers",
                       device)


def cases(preset: str, tp: int, context: int = presets.CONTEXT, tokens: tuple[int, ...] | None = None,
          configs: str | None = None, attention: str | None = None, contexts: str | None = None,
          batch: tuple[int, ...] | None = None, engine: str | None = None, engine_args: str | None = None,
          ab: str | None = None, beside_ours: bool = False, deploy_cc: int | None = None) -> list[CaseSpec]:
    """One case per (context, batch, configuration, attention variant); `tokens` keeps the configurations with those
    draft-token counts; `contexts` ("1024,4096") replaces the one context; `batch` the requests per cycle (default
    1), each with its own cache of the context. With `engine`: per deployment (the one given, each --ab variant,
    and with `beside_ours` ours) the attention is the deployment's; a variant whose flags set the draft shape runs
    that shape, FlashInfer's verify only chains (topk 1)."""
    gpu = cuda_available()
    for name, text in (("--configs", configs), ("--attention", attention), ("--contexts", contexts)):
        if isinstance(text, str) and not text.strip():
            raise ValueError(f"{name}: an empty list; leave the option out for the defaults")
    several_batches = len(batch or ()) > 1
    cfgs = parse_configs(configs if configs is not None else (CPU_CONFIGS if not gpu else BATCH_CONFIGS
                                                              if several_batches or ab else GPU_CONFIGS))
    if tokens:
        kept = [c for c in cfgs if c.draft_tokens in tokens]
        if not kept and configs is not None:
            raise ValueError(f"--tokens {','.join(map(str, tokens))}: no cycle configuration has that many draft "
                             "tokens (see --configs)")
        if not kept:  # `run --tokens 1,2,4,8` on CPU, whose shapes have D = 3: the cycle runs them, said so
            say_once(f"cycle: --tokens {','.join(map(str, tokens))} names no draft-token count of its default shapes "
                     f"({';'.join(f'{c.steps},{c.topk},{c.draft_tokens}' for c in cfgs)}): it runs those (`verifybench cycle --configs` picks others)")
        cfgs = kept or cfgs
    too_many = [c.label for c in cfgs if c.draft_tokens > FORWARD_MAX_TOKENS]
    if too_many:
        raise ValueError(f"--configs: at most {FORWARD_MAX_TOKENS} draft tokens, got {', '.join(too_many)}")
    variants = (name_list(attention, "--attention", ATTENTION) if attention is not None
                else list(ATTENTION) if gpu else ["split_kv"])
    batches = tuple(batch or (1,))
    several = contexts is not None
    deps = deployments.variants(engine, engine_args, ab, beside_ours, deploy_cc)
    out = []
    for ctx in parse_contexts(contexts) if several else [context]:
        plan = _plan(preset, tp, ctx, cfgs, max(batches))
        if not deps:
            out += [_case(preset, tp, ctx, c, v, plan, several, b, max(batches)) for b in batches for c in cfgs
                    for v in variants]
        for tag, dep in deps:
            shape = deployments.spec_shape(dep)
            mine = [SpecConfig(*shape)] if shape else [c for c in cfgs if c.topk == 1 or not
                                                       deployments.chains_only(dep)]
            atts = ([deployments.cycle_attention(dep)] if dep.engine else variants if attention else ["split_kv"])
            out += [_case(preset, tp, ctx, c, v, plan, several, b, max(batches), (tag, dep)) for b in batches
                    for c in mine for v in atts]
    return out


def _median_ms(samples_us: list[float]) -> float:
    return statistics.median(samples_us) / 1e3


def make_cycle(fwd, cfg: SpecConfig, attention: str, allreduce_us: float, comp=None) -> tuple[Cycle, dict, str]:
    """The cycle over `fwd` as the component runs it: the logits all-gather a device wait of the allreduce
    stand-in's latency (none on CPU), the attention variant's tiles (the engine's for extend, with no programmatic
    dependent launch, as the engine launches its Triton kernels); also the tiles and where they come from. comp: a
    deployment's composition (model/deployed.py): its verify and draft attention in place of ours."""
    gpu = fwd.device == "cuda"
    att_cfg, att_source = variant_config(attention, fwd.device)
    # a Cycle refers to itself (its target's ops and its graphs call its methods), so the previous case's buffers and
    # graphs wait for the collector: collected here, their memory is this one's (an H100 once ran out without it)
    release_unreferenced()
    cyc = Cycle(fwd, cfg, attention, device_wait(allreduce_us) if gpu else (lambda t: None), graphs=gpu,
                attention_config=att_cfg, attention_pdl=False if attention == "extend" else None, deployed=comp)
    return cyc, att_cfg, att_source


def _notes(judged: list) -> str:
    """Cycle.check_drafts' notes (near-ties flipped between two runs), each once, for a check's line."""
    return "".join(sorted({f" ({note})" for _, _, note in judged if note}))


def as_requests(batch: int, value) -> list:
    """A cycle's per-request answer as a list of requests (batch 1 answers for its one request)."""
    return [value] if batch == 1 else list(value)


def _case(preset: str, tp: int, context: int, cfg: SpecConfig, attention: str, plan: memory.Plan,
          named_context: bool = False, batch: int = 1, max_batch: int = 1, deployment=None) -> CaseSpec:
    """deployment: (tag, Deployment) the case runs as (None: the suite's kernels, named as before)."""
    tag, dep = deployment or (None, None)
    ar_us, ar_source = allreduce_stand_in_us()
    layers = plan.units if plan.reduced else None
    total = presets.get(preset, tp).layers

    def setup(batch: int, steps: int, topk: int, draft_tokens: int):  # the case's params (CaseSpec.prepare)
        shape = SpecConfig(steps, topk, draft_tokens)  # the draft shape its record names
        if plan.units == 0:
            raise CaseSkipped(plan.skip)
        fwd = build_forward(preset, tp, layers, context, ar_us, max_batch).at_batch(batch)
        comp = deployed.compose(dep, fwd) if dep is not None and dep.engine else None
        fwd = deployed.apply(fwd, comp) if comp else fwd
        cyc, att_cfg, att_source = make_cycle(fwd, shape, attention, ar_us, comp)
        d = draft_tokens

        def check():
            err = cyc.attention_error()
            # the engine's MoE at the token counts its forwards run: the plain decode step's and the verify's
            ok, kernels = deployed.check(comp, fwd, cyc.draft, (batch, batch * d)) if comp else (True, "")
            ok = ok and err <= 1e-2
            detail = [f"tree attention vs masked torch reference rel_err {err:.2e}"] + ([kernels] if kernels else [])
            greedy = as_requests(batch, cyc.greedy_continuation(ROOT_TOKEN))
            each = "" if batch == 1 else f" in each of {batch} requests"
            if shape.topk == 1:  # a chain: the target's own continuation is a path the tree holds
                judged = cyc.check_drafts(ROOT_TOKEN, [g[: d - 1] for g in greedy], greedy)
                good = all(j_ok for _, j_ok, _ in judged)
                ok = ok and good
                detail.append(f"oracle draft accepted {min(n for n, _, _ in judged)} of {d - 1}{each}"
                              f"{_notes(judged)}, emitted the target's greedy tokens: {good}")
            wrong = [[(g[0] + 1) % cyc.full_vocab] * (d - 1) for g in greedy]
            judged = cyc.check_drafts(ROOT_TOKEN, wrong, greedy)
            good = all(j_ok and n == 0 for n, j_ok, _ in judged)
            ok = ok and good
            detail.append(f"wrong draft accepted {max(n for n, _, _ in judged)}{each}{_notes(judged)}, emitted the "
                          f"bonus token only: {good}")
            cyc.accepted = cyc.cycles = 0
            return ok, "; ".join(detail)

        def derive(m):
            out = {**_derive(m, fwd, cyc, shape, attention, ar_us, ar_source, total, plan),
                   "attention_config": att_cfg, "attention_config_source": att_source}
            return {**out, **deployed.derived(comp, out)} if comp else out

        return cyc.step, check, derive

    label = f"{preset}-tp{tp}" + (f"-L{plan.units}" if plan.reduced else "")
    shown = dep.verify_attention if dep is not None and dep.engine else attention  # the deployment's kernel
    return CaseSpec(f"cycle/{label}/" + (f"{tag}/" if tag else "") + (f"ctx{context}/" if named_context else "")
                    + (f"B{batch}/" if batch > 1 else "") + f"{cfg.label}/{shown}",
                    {"preset": preset, "tp": tp, "context": context, "batch": batch, "layers": layers,
                     "steps": cfg.steps, "topk": cfg.topk, "draft_tokens": cfg.draft_tokens, "attention": shown,
                     **(deployments.params(tag, dep) if dep is not None else {})}, "cycle", setup,
                    {"phases": PHASES, "max_time_s": CASE_MAX_TIME_S})


def _derive(m, fwd, cyc: Cycle, cfg: SpecConfig, attention, ar_us, ar_source, total, plan) -> dict:
    d = cfg.draft_tokens
    accepted = cyc.accepted / max(1, cyc.cycles * cyc.batch)  # per request

    def forward_us(fn) -> float:
        return measure(fn, mode="graph", calls_per_sample=1, max_time_s=PART_MAX_TIME_S).median_us

    bare_us = forward_us(lambda: fwd.forward(d))
    decode_us = forward_us(lambda: fwd.forward(1))
    graph_us = forward_us(cyc.verify_body)
    attn_tree_us = forward_us(lambda: cyc.target.forward(d, frozenset({"attn_core"})))
    attn_decode_us = forward_us(lambda: fwd.forward(d, frozenset({"attn_core"})))
    phases_ms = {p: _median_ms(m.phases[p]["device_us"]) for p in PHASES}
    host_ms = {p: _median_ms(m.phases[p]["host_us"]) for p in PHASES}
    cycle_ms = m.median_us / 1e3
    table_ms = {k: sum(phases_ms[p] for p in v) for k, v in ENGINE_PHASES.items()}
    table_ms["other"] = cycle_ms - sum(table_ms.values())
    in_cycle_ms = table_ms["target verify"]
    beyond = {"tree_attention": (attn_tree_us - attn_decode_us) / 1e3,
              "graph_rest": (graph_us - bare_us - (attn_tree_us - attn_decode_us)) / 1e3,
              "verify_eager": phases_ms["verify"] - graph_us / 1e3,
              "sync": phases_ms["sync"], "bookkeeping": phases_ms["bookkeeping"]}
    out = {"phases_ms": phases_ms, "host_phases_ms": host_ms, "cycle_ms": cycle_ms,
           "phases_sum_error": sum(phases_ms.values()) / cycle_ms - 1, "table_ms": table_ms,
           "decode_ms": decode_us / 1e3, "decode_mode": "graph", "bare_forward_ms": bare_us / 1e3,
           "verify_graph_ms": graph_us / 1e3, "verify_in_cycle_ms": in_cycle_ms,
           "beyond_bare_ms": beyond, "beyond_bare_total_ms": in_cycle_ms - bare_us / 1e3,
           "attention_per_forward_ms": {"tree": attn_tree_us / 1e3, "decode (forward's)": attn_decode_us / 1e3},
           "accepted_mean": accepted, "allreduce_stand_in_us": ar_us, "allreduce_source": ar_source,
           "logits_gather": f"device wait of {ar_us} us (the allreduce stand-in's latency)" if fwd.device == "cuda"
           else "none (one rank)", "attention_ran": attention if fwd.device == "cuda" else "torch reference",
           "graphs": cyc.graphs, "layers_run": len(fwd.layers), "layers_total": total, "batch": cyc.batch,
           # what one allreduce of the verify carries (B * D rows of the hidden size, bf16): the size advise reads
           # a measured allreduce at
           "allreduce_bytes": cyc.batch * d * fwd.s.hidden * 2}
    if plan.reduced:
        out["memory_note"] = plan.note
    return out


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """The deployment's per-phase table, the fine phases (device and host), the verify beyond the bare forward,
    and the cycle against a plain decode step."""
    rows = _ok(records)
    cpu = cpu_numbers(records)
    engine, fine, beyond, vs = [], [], [], []
    for r in rows:
        dv, key = r["derived"], _key(r, _several_contexts(rows), _several_batches(rows))
        cyc = dv["cycle_ms"]
        row = {**key, **{f"{k}_ms": v for k, v in dv["table_ms"].items()},
               **{f"{k}_%": 100 * v / cyc for k, v in dv["table_ms"].items()}, "cycle_ms": cyc}
        if abs(dv["phases_sum_error"]) > PHASES_AGREE:  # the two passes disagree: "other" would be that gap
            row["other_ms"] = row["other_%"] = None
        engine.append(row)
        fine.append({**key, **({} if cpu else {f"{p}_ms": dv["phases_ms"][p] for p in PHASES}),
                     **{f"{p}_host_ms": dv["host_phases_ms"][p] for p in PHASES},
                     "sum_vs_cycle_%": 100 * dv["phases_sum_error"]})
        beyond.append({**key, "bare_forward_ms": dv["bare_forward_ms"], "verify_in_cycle_ms": dv["verify_in_cycle_ms"],
                       **{f"{k}_ms": v for k, v in dv["beyond_bare_ms"].items()},
                       "beyond_total_ms": dv["beyond_bare_total_ms"]})
        vs.append({**key, "decode_ms": dv["decode_ms"], "cycle_ms": cyc, "break-even accept len": cyc / dv["decode_ms"],
                   "accepted per cycle (random draft)": dv["accepted_mean"]})
    # other = the cycle minus the phases, and the shares: derived from two passes, withheld on CPU
    engine = withhold_on_cpu(records, engine, lambda k: k.endswith("_%") or k == "other_ms")
    fine = withhold_on_cpu(records, fine, ("sum_vs_cycle_%",))
    beyond = withhold_on_cpu(records, beyond, lambda k: k not in ("deployment", "context", "B", "steps,topk,D",
                                                                  "attention", "bare_forward_ms", "verify_in_cycle_ms"))
    vs = withhold_on_cpu(records, vs, ("break-even accept len",))
    first = rows[0]["derived"] if rows else {}
    allreduce = (f"device wait of {first.get('allreduce_stand_in_us')} us ({first.get('allreduce_source')})"
                 if not cpu else "none: one rank on CPU, no collective and no stand-in wait")
    setup = [{"layers": f"{first.get('layers_run')} of {first.get('layers_total')}", "graphs": first.get("graphs"),
              "allreduce": allreduce, "logits gather": first.get("logits_gather"),
              **({"memory": first["memory_note"]} if first.get("memory_note") else {})}] if rows else []
    return [deployments.table(records),
            ("setup (CPU: eager torch, perf_counter between phases; the tree attention is the torch reference)" if cpu
             else "setup (one GPU: allreduce and all-gather are device waits of a stated latency)", setup),
            ("the cycle as the deployment's profiler splits it (ms per cycle; other = cycle - the phases, blank "
             f"where the phases' sum is more than {100 * PHASES_AGREE:.0f}% off the cycle)", engine),
            ("phases, host (perf_counter) only: no device on CPU, ms; their sum against the cycle measured without "
             "phase stamps" if cpu else "phases, device (CUDA events between phases, no sync added) and host "
             "(perf_counter), ms; their sum against the cycle measured without phase events", fine),
            ("what the verify in the cycle costs beyond the bare forward at the same n (ms per cycle): "
             "tree_attention = the tree-masked attention kernel against the forward's decode attention, every "
             "layer; graph_rest = the rest of the verify graph against the bare forward (embedding, logits all-gather, "
             "hidden-state capture); verify_eager = argmax and greedy tree verify after the graph, launch gaps "
             "included; sync = accept lengths to the host; bookkeeping = slots freed and kept, gathers", beyond),
            ("the cycle against a plain decode step (the n = 1 forward of the same run); break-even accept length = "
             "cycle / decode", vs)]


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    """Stacked phases per configuration, against the cycle measured without phase stamps; on CPU the phases alone:
    their sum against the cycle is withheld in the tables (stance.py), so the chart draws no cycle to compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _ok(records)
    if not rows:
        return []
    labels = ["\n".join(f"{v}" for v in _key(r, _several_contexts(rows), _several_batches(rows)).values())
              for r in rows]  # what ran
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    bottom = [0.0] * len(rows)
    for p in PHASES:
        vals = [r["derived"]["phases_ms"][p] for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cpu = cpu_numbers(records)
    if not cpu:
        ax.plot(labels, [r["derived"]["cycle_ms"] for r in rows], "k_", markersize=30, label="cycle (no phase events)")
    ax.set_xlabel("configuration (steps, topk, draft tokens) and verify attention")
    ax.set_ylabel("ms per cycle")
    ax.set_title("EAGLE-3 cycle per phase" + ("\n(CPU numbers: host-stamped phases of a second pass; their sum is "
                                              "not the cycle, not compared)" if cpu else ""))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    out = [write_png(fig, Path(directory) / f"cycle_phases-{stamp}.png")]
    if _several_contexts(rows) and not cpu_numbers(records):
        out.append(_context_chart(rows, directory, stamp))
    from verifybench.harness.analysis import batches

    over_b = batches.chart({"cases": records}, directory, stamp)  # tau* over B (advise: speedup at an acceptance)
    return out + ([over_b] if over_b else [])


def release() -> None:
    release_forwards()  # it gives the device's cached blocks back too
