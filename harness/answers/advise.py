# Over 400 lines: the answer, the levers and the command read one results folder the same way (levers.py: the math).
"""`verifybench advise`: the answer first (what the verify forward and cycle are made of), then the levers that
move a speculative cycle, ranked by ms saved per cycle, each with its engine setting and the files it came from.

RESULTS: a folder (the latest file of each kind in it: the name's prefix before -<UTC stamp>, or a baseline's stem)
or result files; default the latest run's folder under ./verifybench-results/. Each lever is applied alone to the
engine's cycle (its serial `extend` verify attention at (2,1,3), the deployment's shape) and costed through plan's
model: T_cycle after, break-even tau* = T_cycle / T_decode, tok/s = 1000 * tau / T_cycle at the given acceptance.
A lever whose measurement is missing names the command that would measure it. On CPU results (any input of CPU
numbers) every figure is withheld, nothing is ranked and no engine setting is printed: advise lists the levers it
would rank on a GPU and the command that measures each (measure/stance.py).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from verifybench.harness.analysis import batches
from verifybench.harness.answers import ab, inputs, plan, stand_ins
from verifybench.harness.answers.levers import attention_per_forward_ms, engine_attention_levers
from verifybench.harness.answers.levers import lever as _lever
from verifybench.harness.answers.levers import ok_cases as _ok
from verifybench.harness.answers.engine_settings import setting
from verifybench.harness.analysis.fit import linear_fit
from verifybench.harness.analysis.numbers import TOKEN_COUNT_MAX, context_arg, out_path
from verifybench.harness.measure import env, stance
from verifybench.harness.measure.results import result_files, store

KINDS = ("verify", "cycle", "mla_verify", "allreduce_sweep", "verify_dist", "defaults_vs_tuned", "graph_replay",
         "mla_decode", "moe_int4")  # the last two for their engine rows beside ours (answers/stand_ins.py)
SIZE_KINDS = ("allreduce",)  # read for its times over message sizes only (the per-batch section)
ENGINE_CONFIG = (2, 1, 3)  # the deployment's shape: 2 draft steps, topk 1, 3 draft tokens
EXTEND = ("extend", "sglang.extend")  # the engine's serial verify kernel: our stand-in's name and its own
ANSWER_LINES = 15
# the command that measures each lever: named for a lever the results cannot cost, and on CPU for every lever
MEASURE = {
    "verify attention": "verifybench cycle --attention extend,split_kv",
    "allreduce": "python3 -m verifybench.harness.multigpu.allreduce --nccl-sweep --nproc-per-node=N (then advise "
                 "--nccl-from its file)",
    "draft shape": "advise --accept-len D:tau,... (or --accept-rates) to rank the shapes",
    "kernel configs": "verifybench tune, then the defaults_vs_tuned comparison",
    "CUDA graphs": "verifybench graph_replay",
    "host gaps": "verifybench trace ENGINE_TRACE --json trace-summary.json (then pass it)",
}


def resolve(paths: list[Path]) -> dict[str, Path]:
    """{kind: file}: for each folder the latest file of each kind, files as given (a later one of a kind wins)."""
    found: dict[str, Path] = {}
    for p in paths:
        if p.is_dir():
            for kind in sorted({k for f in p.glob("*.json*") if f.is_file() and (k := result_files.kind_of(f))}):
                found[kind] = result_files.latest_of_kind(p, kind)
        elif p.exists():
            # an allreduce result is read only by the per-batch section (batches.py), never loaded with the rest:
            # a multi-GPU job's gloo rows are host times that would mark every figure as CPU numbers
            found[inputs.file_kind(p, KINDS + SIZE_KINDS)] = p
        else:
            raise ValueError(f"{p}: no such file or folder (give a results folder or result files)")
    return found


def default_folder() -> Path:
    """The latest run's folder: the most recently written machine folder under ./verifybench-results/."""
    folders = [d for d in store.DEFAULT_OUT.glob("*") if d.is_dir()]
    if not folders:
        raise ValueError(f"no RESULTS given and no run under {store.DEFAULT_OUT}/ (run `verifybench run`, or give "
                         "a folder such as results/baselines/nvidia-h200-x1)")
    return max(folders, key=lambda d: d.stat().st_mtime)


def load(found: dict[str, Path]) -> dict[str, dict]:
    return inputs.load(found, KINDS)  # each file checked for what advise reads (answers/inputs.py)


def is_cpu(runs: dict[str, dict]) -> bool:
    return stance.any_cpu(runs.values())


# ---- the costs ----

def cycle_at(runs: dict, context: int | None) -> tuple[dict, int]:
    """{(config, attention): case} of the cycle result at `context` if it ran there, else at its context nearest to
    it (the lever then moves the attention by mla_verify); returns the context used."""
    cases = _ok(runs["cycle"])
    if not cases:
        raise ValueError("the cycle result has no passing case (every check failed): nothing to cost")
    have = sorted({c["params"]["context"] for c in cases})
    ctx = min(have, key=lambda c: abs(c - context)) if context else have[len(have) // 2]
    return {(plan.case_config(c), c["params"]["attention"]): c for c in cases if c["params"]["context"] == ctx}, ctx


def decode_ms(cases: dict) -> float:
    """plan's T_decode of cycle_at's cases (one context): the median of their plain decode (a deployment's own where
    the file ran one: ours beside it decodes with our kernel)."""
    mine = [c for c in cases.values() if c["params"].get("deployment") == "deployed"] or list(cases.values())
    return float(np.median([c["derived"]["decode_ms"] for c in mine]))


def forward_fit(runs: dict):
    full = {c["params"]["tokens"]: c["summary"]["median_us"] / 1e3 for c in _ok(runs["verify"])
            if c["params"]["variant"] == "full"}
    return linear_fit(list(full), list(full.values())), full


# ---- the levers ----

def levers(runs: dict, found: dict, taus, context: int | None, engine: str) -> list[dict]:
    """Every lever the results can cost, then the missing ones with the command that would measure them."""
    out, missing, said = [], [], []
    if "cycle" not in runs or not _ok(runs["cycle"]):
        return [{"lever": "all", "missing": "verifybench cycle (the cycle every lever is costed against)"}]
    cases, ctx = cycle_at(runs, context)
    decode = decode_ms(cases)
    # the engine's cycle: extend (its serial kernel) at its shape, else the nearest the file holds
    base_case = cases.get((ENGINE_CONFIG, "extend")) or next(  # a deployment's own cycle first (cycle --engine)
        (c for k, c in cases.items() if k[0] == ENGINE_CONFIG and c["params"].get("deployment") == "deployed"),
        None) or next(
        (c for k, c in cases.items() if k[1] == "extend"), None) or next(iter(cases.values()))
    base_att = base_case["params"]["attention"]
    config = plan.case_config(base_case)
    base = base_case["summary"]["median_us"] / 1e3
    tau = taus(config) if taus else None
    want = context or ctx
    f_cycle = str(found["cycle"])

    # verify attention kernel
    split = cases.get((config, "split_kv")) if base_att in EXTEND else None
    if split is not None and (stance.stand_in(split) or stance.stand_in(base_case)):
        # a torch reference stood in for the kernels: its time says nothing about extend against split_kv
        missing.append(("verify attention", f"{MEASURE['verify attention']} where the kernels run (this cycle's "
                        "rows are a torch reference standing in for them)"))
    elif split is not None and (want == ctx or "mla_verify" in runs):
        before, after, status, files, note = base, split["summary"]["median_us"] / 1e3, "measured", [f_cycle], \
            f"context {ctx}, both measured in the cycle"
        if want != ctx:
            d, b = config[2], batches.batch_of(base_case)  # mla_verify's rows at the cycle's batch, never mixed
            ext_now, how = attention_per_forward_ms(runs, "extend", d, want, b)
            spl_now, _ = attention_per_forward_ms(runs, "split_kv", d, want, b)
            ext_then, _ = attention_per_forward_ms(runs, "extend", d, ctx, b)
            spl_then, _ = attention_per_forward_ms(runs, "split_kv", d, ctx, b)
            before, after, status = base + ext_now - ext_then, after + spl_now - spl_then, "projected"
            files = [f_cycle, str(found["mla_verify"])]
            note = (f"context {want}: the cycle at {ctx} moved by mla_verify's per-forward attention ({how}): "
                    f"extend {ext_now:.4g} ms, split_kv {spl_now:.4g} ms per forward at {want}")
        engine_levers = engine_attention_levers(runs, found, config, want, before, after, status, files, engine, tau,
                                                decode, batches.batch_of(base_case))
        if engine_levers:
            out += engine_levers
            before = engine_levers[0]["before_ms"]  # the engine's own kernel in the cycle it pays
        else:
            out.append(_lever("verify attention: extend -> split_kv", before, after, status, files,
                              setting("attention", engine), tau, decode,
                              note + "; extend is our stand-in for the engine's kernel (no engine rows in mla_verify: "
                              "with SGLang installed, `verifybench mla_verify` times its own beside ours)"))
        if config[1] == 1 and not any("FlashInfer" in lv["lever"] for lv in engine_levers):
            missing.append(("verify attention -> FlashInfer MLA", "verifybench mla_verify on a GPU with SGLang and "
                            "FlashInfer installed (their kernels beside ours, FlashInfer's plan() timed)"))
        base = before  # the other levers start from the cycle at the user's context
    else:
        missing.append(("verify attention", f"verifybench cycle --contexts {want}" if split is not None else
                        MEASURE["verify attention"]))

    # allreduce: the sweep's winner against its default, per call x calls per forward x one target forward
    if "allreduce_sweep" in runs:
        sweep = runs["allreduce_sweep"]
        label, win_env = env.sweep_winner(sweep)
        times = env.sweep_times(sweep)
        want_bytes = base_case["derived"].get("allreduce_bytes") or 7168 * 2 * config[2]
        size = min(times["default"], key=lambda s: abs(s - want_bytes))
        per_call_us = times["default"][size] - times[label][size]
        calls = 2 * base_case["derived"].get("layers_total", 61)
        calls_from = "2 per layer"
        if "verify_dist" in runs:
            calls = next(c["derived"]["allreduces_per_forward"] for c in _ok(runs["verify_dist"])
                         if c["derived"].get("allreduces_per_forward"))
            calls_from = "verify_dist"
        saved = per_call_us * calls / 1e3
        envtxt = " ".join(f"{k}={v}" for k, v in win_env.items()) or "NCCL defaults"
        out.append(_lever(f"allreduce: {label} (the NCCL sweep's winner)", base, base - saved, "projected",
                          [f_cycle, str(found["allreduce_sweep"])] + ([str(found["verify_dist"])]
                                                                      if "verify_dist" in runs else []),
                          setting("allreduce", engine, env=envtxt), tau, decode,
                          f"{per_call_us:.3g} us per call at {size} B x {calls} allreduces per forward "
                          f"({calls_from}) x 1 target forward per cycle; measured on the sweep's "
                          f"{sweep['fingerprint'].get('gpu_model')} x{sweep['extra'].get('nproc_per_node')}; "
                          "this cycle's "
                          f"allreduce is a {base_case['derived'].get('allreduce_stand_in_us')} us stand-in, so the "
                          "saving holds where a call costs what the sweep's default did"))
    else:
        missing.append(("allreduce", MEASURE["allreduce"]))

    # draft shape: the best (steps, topk, D) at the given acceptance, same attention as the engine's
    shapes = {k[0]: c for k, c in cases.items() if k[1] == base_att}
    if taus and tau is None:
        missing.append(("draft shape", f"advise --accept-len {config[2]}:TAU,... (an accept length for {config}, the "
                        "shape every other is ranked against; the ones given match only other shapes)"))
    elif taus:
        ranked = sorted(((1000 * taus(k) / (c["summary"]["median_us"] / 1e3), k) for k, c in shapes.items()
                         if taus(k) is not None), reverse=True)
        if ranked and ranked[0][1] != config:
            best = ranked[0][1]
            t_best = shapes[best]["summary"]["median_us"] / 1e3
            # ms per cycle at equal tokens: the shape's cycle scaled to the engine shape's accepted tokens
            lv = _lever(f"draft shape: {config} -> {best}", base, t_best * tau / taus(best), "measured", [f_cycle],
                        setting("draft", engine, steps=best[0], topk=best[1], d=best[2]), tau, decode,
                        f"tau {taus(best):g} vs {tau:g}; after = its cycle per {tau:g} accepted tokens")
            lv["tok_s"], lv["tau_star"] = 1000 * taus(best) / t_best, t_best / decode  # its own cycle's
            out.append(lv)
        else:  # no lever, and the reason said: a silent gap reads as "nothing to gain"
            others = [k for k in sorted(shapes) if taus(k) is None]
            said.append(("draft shape", f"{config} stays: " + (
                f"the only shape given an accept length; the cycle also ran {', '.join(map(str, others))} (give "
                "--accept-len D:tau for their D to rank them)" if ranked and len(ranked) == 1 else
                "no shape of the cycle has an accept length given" if not ranked else
                "it gives the most tok/s of the shapes ranked at this acceptance")))
    else:
        missing.append(("draft shape", MEASURE["draft shape"]))

    # kernel configs: what the defaults would cost against the tuned tables, forward at n = D
    if "defaults_vs_tuned" in runs:
        row = min(runs["defaults_vs_tuned"]["rows"], key=lambda r: abs(r["n"] - config[2]))
        gap = (row["forward_default_us"] - row["forward_tuned_us"]) / 1e3
        out.append(_lever("kernel configs: defaults -> tuned", base + gap, base, "measured",
                          [f_cycle, str(found["defaults_vs_tuned"])], setting("configs", engine), tau, decode,
                          f"forward at n = {row['n']}: {row['forward_default_us'] / 1e3:.4g} -> "
                          f"{row['forward_tuned_us'] / 1e3:.4g} ms"))
    else:
        missing.append(("kernel configs", MEASURE["kernel configs"]))

    # CUDA graphs: the model-shaped graph against its eager (hot) run, scaled to the cycle's layers
    model = [c for c in _ok(runs["graph_replay"]) if "model" in c["params"]] if "graph_replay" in runs else []
    hot = {c["params"]["tokens"]: c for c in model if c["mode"] == "hot"}
    graph = {c["params"]["tokens"]: c for c in model if c["mode"] == "graph"}
    if hot and graph:
        n = min((n for n in hot if n in graph), key=lambda n: abs(n - config[2]))
        layers = int(hot[n]["params"]["model"].rsplit("-L", 1)[1]) if "-L" in hot[n]["params"]["model"] else 61
        scale = base_case["derived"].get("layers_total", 61) / layers
        gap = (hot[n]["summary"]["median_us"] - graph[n]["summary"]["median_us"]) / 1e3 * scale
        out.append(_lever("CUDA graphs: eager -> graph", base + gap, base, "measured", [
            f_cycle, str(found["graph_replay"])], setting("graphs", engine), tau, decode,
            f"{hot[n]['params']['model']} at n = {n}, scaled x{scale:.3g} to the cycle's layers"))
    else:
        missing.append(("CUDA graphs", MEASURE["CUDA graphs"]))

    # host gaps: GPU idle inside the cycle, from an engine trace's summary
    if "trace" in found:
        per = inputs.read(found["trace"]).get("per_cycle_us")
        if not isinstance(per, dict) or not isinstance(per.get("gpu_idle"), (int, float)):
            missing.append(("host gaps", f"verifybench trace ENGINE_TRACE --json SUMMARY ({found['trace']} holds no "
                            "per_cycle_us.gpu_idle)"))
        else:
            idle = per["gpu_idle"] / 1e3
            out.append(_lever("host gaps: hide the GPU idle", base, base - idle, "projected", [str(found["trace"])],
                              setting("host", engine), tau, decode,
                              "the upper bound: every idle ms inside the traced cycle hidden"))
    else:
        missing.append(("host gaps", MEASURE["host gaps"]))
    if config != ENGINE_CONFIG or base_att not in EXTEND:  # the file lacks the engine's cycle: name the one used
        for lv in out:
            lv["note"] = f"against the cycle at {config} {base_att} ({f_cycle} holds no {ENGINE_CONFIG} extend " \
                         f"case); " + lv["note"]
    out.sort(key=lambda r: -(r["saved_ms"] if r["saved_ms"] is not None else -1e9))
    return out + [{"lever": name, "said": why} for name, why in said] + [{"lever": name, "missing": cmd}
                                                                        for name, cmd in missing]


# ---- the answer ----

def answer(runs: dict, found: dict, context: int | None) -> list[str]:
    """At most ANSWER_LINES lines: the forward's a and b, the fixed part's make-up, what the cycle adds, why."""
    lines = []
    fit = None
    try:
        fit, full = forward_fit(runs) if "verify" in runs else (None, None)
    except ValueError as e:  # too few token counts for a line with a CI (a short CPU run)
        lines.append(f"forward ({found['verify']}): no line: {e}")
    n1 = next((c for c in _ok(runs["verify"]) if c["params"]["variant"] == "full" and c["params"]["tokens"] == 1),
              None) if fit is not None else None
    if fit is not None and n1 is None:
        lines.append(f"forward ({found['verify']}): T(n) = {fit.a:.3g} + {fit.b:.3g} ms*n; no passing n = 1 case "
                     "to split the fixed part by")
    elif fit is not None:
        only_ar = [c for c in _ok(runs["verify"]) if c["params"]["variant"] == "only-allreduce"
                   and c["params"]["tokens"] == 1]
        ar_ms = only_ar[0]["summary"]["median_us"] / 1e3 if only_ar else None
        stream_ms = n1["derived"]["roofline_us"] / 1e3
        lines.append(f"forward ({found['verify']}): T(n) = {fit.a:.3g} +- {fit.a_halfwidth:.2g} ms + "
                     f"{fit.b:.3g} +- {fit.b_halfwidth:.2g} ms*n (r2 {fit.r2:.2f}, n = {min(full)}..{max(full)})")
        parts = [f"weight streaming at n=1 {stream_ms:.3g} ms (bytes / copy bandwidth)"]
        if ar_ms is not None:
            parts.insert(0, f"allreduces {ar_ms:.3g} ms (the only-allreduce forward: 122 x "
                            f"{n1['derived']['allreduce_stand_in_us']:g} us stand-in)")
        rest = fit.a - stream_ms - (ar_ms or 0)
        lines.append(f"fixed part a = {fit.a:.3g} ms: " + "; ".join(parts) + f"; the rest {rest:.3g} ms (launches, "
                     "attention, small ops)")
    elif "verify" not in runs:
        lines.append("forward: no verify result (run `verifybench verify`)")
    if "cycle" in runs and not _ok(runs["cycle"]):
        lines.append(f"cycle ({found['cycle']}): no passing case: every check failed, nothing to cost")
    elif "cycle" in runs:
        cases, ctx = cycle_at(runs, context)
        if context and context != ctx:  # the asked context, or say that the cycle lacks it
            lines.append(f"cycle at context {context}: not measured (the cycle file ran at context {ctx}: the lines "
                         "below are at that context; the levers project to yours where they say so)")
        for att in ("extend", "split_kv"):
            c = cases.get((ENGINE_CONFIG, att))
            if c is None:
                continue
            d, t = c["derived"], plan.table_ms(c)
            beyond = d.get("beyond_bare_ms", {})
            lines.append(f"cycle {ENGINE_CONFIG} {att} at context {ctx}: {c['summary']['median_us'] / 1e3:.4g} ms = "
                         f"forward at D {d['bare_forward_ms']:.3g} + beyond it {d['beyond_bare_total_ms']:.3g} ("
                         + ", ".join(f"{k} {v:.2g}" for k, v in beyond.items()) + f") + draft {t['draft']:.3g} + "
                         f"re-extend {t['reextend']:.3g} ms; attention {d['attention_per_forward_ms']['tree']:.3g} "
                         "ms per forward")
        ext, spl = cases.get((ENGINE_CONFIG, "extend")), cases.get((ENGINE_CONFIG, "split_kv"))
        if ext and spl and fit is not None:
            e_att = ext["derived"]["attention_per_forward_ms"]["tree"]
            lines.append(f"why verify barely grows with tokens: each token adds {fit.b:.2g} ms to a fixed "
                         f"{fit.a:.3g} ms, and the engine's serial extend attention adds {e_att:.3g} ms per forward "
                         f"at context {ctx} whatever D (split_kv: "
                         f"{spl['derived']['attention_per_forward_ms']['tree']:.3g} ms)")
    else:
        lines.append("cycle: no cycle result (run `verifybench cycle`)")
    return lines[:ANSWER_LINES]


def _fmt(v, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def would_rank(runs: dict) -> list[str]:
    """On CPU numbers: the levers advise would rank once run on a GPU, each with the command that measures it;
    no figure, no order, no engine setting."""
    stood_in = sorted({s for c in runs.get("cycle", {}).get("cases", []) if (s := stance.stand_in(c))})
    out = ["", "## Levers advise would rank on a GPU (not ranked here)", stance.CPU_STANCE]
    for name, cmd in MEASURE.items():
        note = (f" (this cycle ran a torch reference in place of {' and '.join(stood_in)}: no attention kernel ran)"
                if name == "verify attention" and stood_in else "")
        out.append(f"- {name}: on a GPU, `{cmd}`{note}")
    return out


def deployment_line(runs: dict) -> str:
    """Whom the answer is for: the deployment the cycle ran as (cycle --engine), else the suite's kernels."""
    from verifybench.harness.model.deployments import SUITE

    return next((c["params"]["deployment_line"] for c in runs.get("cycle", {}).get("cases", [])
                 if c.get("params", {}).get("deployment") == "deployed"), SUITE.line())


def lines_for(runs: dict, found: dict, taus=None, context: int | None = None, engine: str = "sglang",
              nccl_from: Path | None = None) -> list[str]:
    """The answer, then the ranked levers, then lost settings: plain lines for the terminal and the report.
    CPU numbers (stance.any_cpu): the answer's figures withheld, and the levers listed unranked (would_rank)."""
    cpu = is_cpu(runs)
    per_batch, at_b, measured_ab, line = [], "", ab.lines(runs), deployment_line(runs)
    if "cycle" in runs:  # the A/B's variants have their section; the rest reads the deployment and ours beside it
        runs = {**runs, "cycle": {**runs["cycle"], "cases": [c for c in runs["cycle"]["cases"] if c.get(
            "params", {}).get("deployment") in (None, "deployed", "ours")]}}
    if "cycle" in runs and len(batches.batches(runs["cycle"])) > 1 or any(
            batches.batch_of(c) > 1 for c in runs.get("cycle", {}).get("cases", [])):
        # the answer and the levers are one request's; B requests at once get their own section
        # each B costed at its own allreduce size: the sweep (NCCL's settings) first, else a multi-GPU result
        per_batch = batches.lines(runs["cycle"], taus, found.get("allreduce_sweep") or found.get("allreduce"))
        runs = {**runs, "cycle": batches.smallest_batch(runs["cycle"])}
        at_b = batches.answer_batch(runs["cycle"], found.get("cycle"))
    if "verify" in runs:  # its fit is one request's
        runs = {**runs, "verify": batches.smallest_batch(runs["verify"])}
    out = ["## The answer" + at_b, f"(for {line})"] + (["(CPU numbers: every figure below is withheld)"] if cpu else [])
    ans = answer(runs, found, context)
    out += [f"{re.split(r'[0-9(:=]', a)[0].strip()}: {store.WITHHELD}" if cpu else a for a in ans]
    out += measured_ab
    if cpu:
        return out + would_rank(runs) + per_batch + stand_ins.lines(runs) + (
            ["", "## Lost settings"] + env.nccl_warnings(nccl_from) if nccl_from is not None else [])
    held = sorted({c["params"]["context"] for c in _ok(runs["cycle"])}) if "cycle" in runs else []
    at_ctx = f" (at context {cycle_at(runs, context)[1]} of the cycle's {', '.join(map(str, held))}: --context picks)" \
        if len(held) > 1 else ""
    out += ["", ("## Levers, ranked by ms saved per cycle (each alone, against the engine's cycle)" if not measured_ab
                 else "## Levers the A/B did not run (arithmetic on the component results, each alone)") + at_b
            + at_ctx]
    for i, lv in enumerate(levers(runs, found, taus, context, engine), 1):
        if "missing" in lv:
            out.append(f"- {lv['lever']}: not measured here; measure it with `{lv['missing']}`")
            continue
        if "said" in lv:
            out.append(f"- {lv['lever']}: {lv['said']}")
            continue
        out.append(f"{i}. {lv['lever']}: {_fmt(lv['before_ms'])} -> {_fmt(lv['after_ms'])} ms per cycle "
                   f"(saves {_fmt(lv['saved_ms'])} ms); break-even tau* {_fmt(lv['tau_star'], '.3g')}"
                   + (f"; {_fmt(lv['tok_s'])} tok/s" if lv["tok_s"] is not None else "")
                   + f" [{lv['status']}: {', '.join(lv['files'])}]")
        out.append(f"   {lv['note']}")
        out.append(f"   {lv['how']}")
    out += per_batch + stand_ins.lines(runs)
    if nccl_from is not None:
        out += ["", "## Lost settings"] + env.nccl_warnings(nccl_from)
    return out


def report_lines(runs_by_component: dict[str, dict], out_dir: Path) -> list[str]:
    """The report's opening: the answer and the levers for this run's results (files named as saved)."""
    found = {name: out_dir / f"{name}-{store.stamp(run)}.json" for name, run in runs_by_component.items()}
    runs = {k: v for k, v in runs_by_component.items() if k in KINDS}
    return [line.replace("## ", "### ") for line in lines_for(runs, found)] + [""]


def _checked(taus):
    """tau_of(config) refusing an accept length outside 1..min(steps, D-1)+1, as plan does."""
    def tau_of(config):
        tau = taus(config)
        if tau is not None and not 1 <= tau <= plan.max_accept_len(config):
            raise ValueError(f"accept length {tau:g} for {config} outside 1..{plan.max_accept_len(config)} "
                             "(min(steps, D-1) + bonus)")
        return tau
    return tau_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results_in", nargs="*", type=Path, metavar="RESULTS",
                   help="a results folder (the latest file of each kind) or result files; default the latest "
                   f"run's folder under ./{store.DEFAULT_OUT}/")
    acc = p.add_mutually_exclusive_group()
    acc.add_argument("--accept-len", default=None, help="tau per D or steps,topk,D: '3:2.4,6:3.1' (>= 1); gives tok/s")
    acc.add_argument("--accept-rates", default=None, help=plan.RATES_HELP)
    p.add_argument("--context", type=context_arg, default=None,
                   help="context length to advise at (default the cycle's); between measured contexts the "
                   "attention is interpolated from mla_verify, said so")
    p.add_argument("--engine", choices=("sglang", "vllm"), default="sglang", help="whose settings to print")
    p.add_argument("--nccl-from", type=Path, default=None, metavar="SWEEP",
                   help="a saved NCCL sweep: its winner costs the allreduce lever, and each NCCL_* variable here "
                   "that differs from it is warned about; a batched cycle's rows are costed at each B x D's size")
    p.add_argument("--allreduce-from", type=Path, default=None, metavar="RESULT",
                   help="an allreduce result of several GPUs (torchrun -m verifybench.harness.multigpu.allreduce): "
                   "a batched cycle's rows costed at each B x D's message size from its nccl times (where no sweep "
                   "is given), a faster backend as the lever")
    p.add_argument("--chart-dir", type=out_path, default=None, metavar="DIR",
                   help="where the per-batch chart goes (default beside the cycle result; ./"
                   f"{store.DEFAULT_OUT}/ where that is the checkout's results/ or cannot be written)")


def run(args) -> int:
    found = resolve(args.results_in or [default_folder()])
    if args.nccl_from is not None:
        env.load_sweep(args.nccl_from)  # a file that is not a sweep is refused by name, before anything else
        found["allreduce_sweep"] = args.nccl_from
    if args.allreduce_from is not None:
        kind = store.load_run(args.allreduce_from)["component"]
        if kind != "allreduce":
            raise ValueError(f"--allreduce-from {args.allreduce_from}: a {kind} result, not an allreduce result "
                             "(an NCCL sweep goes to --nccl-from)")
        found["allreduce"] = args.allreduce_from
    runs = load(found)
    taus = None
    if args.accept_len is not None:  # '' is refused by the parser, not read as "not given"
        given = plan.parse_keyed(args.accept_len, "--accept-len", 1, TOKEN_COUNT_MAX)
        taus = lambda c: given.get(c, given.get(c[2]))  # noqa: E731
        for note in inputs.match_shapes(given, runs):
            print(note)
    elif args.accept_rates is not None:
        rates = plan.parse_rates(args.accept_rates)
        taus = lambda c: plan.tau_from_rates(rates, c)  # noqa: E731
    if taus is not None:
        taus = _checked(taus)
    print("\n".join(lines_for(runs, found, taus, args.context, args.engine, args.nccl_from)))
    if "cycle" in runs:  # B requests at once: a chart (GPU numbers, several batches)
        where = args.chart_dir or store.chart_dir(Path(found["cycle"]).parent)
        png = batches.chart(runs["cycle"], where, store.stamp(runs["cycle"]), taus)
        if png is not None:
            print(f"chart: {png}")
    return 0
