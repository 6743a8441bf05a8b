# Over 400 lines: the ranking, its per-context and per-batch tables and the command share one cost model.
"""Ranks speculative configurations (steps, topk, D draft tokens including the root) by tokens per second from
measured costs and an acceptance profile, with the break-even accept length of each.

Per configuration:  T_cycle = T_draft + T_verify(D) + T_reextend + T_other  (or the measured cycle),
tok/s = 1000 * tau / T_cycle,  speedup over plain decode = tau * T_decode / T_cycle,  break-even tau* =
T_cycle / T_decode; tau = mean tokens accepted per cycle, bonus token included (1 <= tau <= min(steps, D-1) + 1).

Costs, one source:
  a cycle result (verifybench cycle): each passing case's measured cycle and phases; T_decode the median of every
      passing case's plain decode (the same on every invocation); every attention variant in the file is ranked
      (--attention extend or split_kv plans one, and the answer names the others the file holds); a phase pass that
      sums past the measured cycle shows other as 0 and says so;
  a verify result (verifybench verify): T_verify(D) = the suite's full forward at n = D, T_decode = its n = 1
      forward; draft, re-extend and other as given, else the ASSUMED defaults below;
  numbers: --decode-ms and --verify-ms "D:ms,..." (other D from the least-squares line T(D) = a + b*D through
      the given points, said so in the verify column; refused where that line falls with D, as it would give
      verify times and cycles that shrink, or turn negative, with more draft tokens).
ASSUMED when not given (the Kimi-K2.5 deployment on 8x RTX PRO 6000 Blackwell, PCIe, SGLang EAGLE-3: a 27 ms
cycle at 3 draft tokens, 25.6 ms of it verify): draft 1.0 ms per cycle over its 2 steps, so 0.5 ms per step
(--draft-ms per cycle or --draft-step-ms per step; a step is costed alike at any topk), re-extend 0.3 ms, other
(tree build, sync, bookkeeping) 0.1 ms.

Acceptance, one of:
  --accept-len "3:2.4,6:3.1": tau per D, or per "steps,topk,D" ("5,4,8:3.3;2,1,3:2.4"), as engines log it;
  --accept-rates "0.8,0.7,0.6": p_k = P(depth k accepted | depth k-1 accepted), k = 1..; one rate = every depth.
      tau = 1 + sum_{k=1..L} prod_{j<=k} p_j with L = min(steps, D-1), exact under this model for a chain
      (topk 1); for a tree (topk > 1) the same rates are applied to its best path, depth limited by steps and by
      D-1: an APPROXIMATION (a tree accepts more per depth and reaches less deep); measure its tau, use --accept-len.
A cycle result of several batch sizes (`cycle --batch 1,2,4,8`): the ranking above at its smallest batch (--batch N
picks another), then per batch (analysis/batches.py): per shape and B the cycle, tau* against plain decode at the
same B, tok/s per request and in total, the speedup, and the largest B where each shape still pays, per context.
Results from a CPU smoke run are refused: conclusions from CPU numbers are withheld.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tabulate import tabulate

from verifybench.harness.analysis import batches
from verifybench.harness.analysis.batches import case_config, passing_cases
from verifybench.harness.analysis.breakeven import ASSUMED_DRAFT_STEP_MS, ASSUMED_OTHER_MS, ASSUMED_REEXTEND_MS
from verifybench.harness.analysis.numbers import (FORWARD_ROWS_MAX, MAX_STEP_MS, TOKEN_COUNT_MAX, context_arg,
                                                  finite_float, int_in, out_path,
                                                  parse_configs, parse_keyed, parse_rates, RATES_HELP)  # noqa: F401  (plan.*)
from verifybench.harness.measure.results import result_files, store
from verifybench.harness.measure.results.store import COUNT, FINITE_TABLE, POSITIVE, TEXT, Need, batch_of

DEFAULT_CONFIGS = "2,1,3;3,1,4;5,1,6;5,4,8"
COMPARE_D = (3, 6)  # the deployment's two draft-token counts


@dataclass(frozen=True)
class Cost:
    """One configuration's cycle, ms. verify_from: measured, given, interpolated or extrapolated (the line)."""

    config: tuple[int, int, int]
    draft_ms: float
    verify_ms: float
    overhead_ms: float  # re-extend + other
    cycle_ms: float
    verify_from: str


def max_accept_len(config: tuple[int, int, int]) -> int:
    steps, _, d = config
    return min(steps, d - 1) + 1


def tau_from_rates(rates: list[float], config: tuple[int, int, int]) -> float:
    """1 + sum_{k=1..L} prod_{j<=k} p_j, L = min(steps, D-1); one rate stands for every depth."""
    depth = max_accept_len(config) - 1
    if len(rates) == 1:
        rates = rates * depth
    if len(rates) < depth:
        raise ValueError(f"--accept-rates: {config} reaches depth {depth}, rates given for {len(rates)} depths")
    return 1.0 + float(np.cumprod(rates[:depth]).sum())


# what plan reads from each passing case of the result kinds it takes, checked when the file is read
NEEDS = {
    "cycle": (Need({"params.steps": COUNT, "params.topk": COUNT, "params.draft_tokens": COUNT,
                    "params.attention": TEXT, "params.preset": TEXT, "params.tp": COUNT, "params.context": COUNT,
                    "derived.table_ms": FINITE_TABLE,
                    "derived.decode_ms": POSITIVE}),),
    "verify": (Need({"params.variant": TEXT}), Need({"params.tokens": COUNT},
                                                     where=lambda c: c["params"].get("variant") == "full")),
}


def load_result(given) -> tuple[dict, Path, str]:
    """(run, its file, a note when a folder or a glob chose it): the latest cycle result, else verify result, of a
    folder; every field plan reads checked; a CPU smoke run refused."""
    path, note = result_files.pick_input(given, tuple(NEEDS), "RESULT")
    run = store.load_run(path, NEEDS, "plan", gpu_only=True)
    if not passing_cases(run):
        raise store.ResultsError(f"{path}: no passing case (every check failed or it holds none): nothing to plan")
    return run, path, note


def cycle_cases(run: dict, attention: str = "all", context: int | None = None) -> list[dict]:
    """A cycle result's passing cases of one attention variant ("all", the default: every one), at `context` (None:
    the one context the file holds; `cycle --contexts` files hold several: --context picks one)."""
    cases = passing_cases(run)
    if not cases:
        raise ValueError("the cycle result has no passing case (every check failed or it holds none): nothing to plan")
    contexts = sorted({c["params"]["context"] for c in cases})
    if context is not None:
        if context not in contexts:
            raise ValueError(f"--context {context}: the cycle result holds contexts {contexts}")
        cases = [c for c in cases if c["params"]["context"] == context]
    elif len(contexts) > 1:
        raise ValueError(f"the cycle result holds contexts {contexts} (cycle --contexts): pick one with --context N, "
                         f"e.g. --context {contexts[len(contexts) // 2]}")
    if attention != "all":
        have = sorted({c["params"].get("attention") for c in cases})
        cases = [c for c in cases if c["params"].get("attention") == attention]
        if not cases:
            raise ValueError(f"--attention {attention}: no passing cycle case of it; the file holds {have}")
    scopes = {(c["params"]["preset"], c["params"]["tp"], c["params"]["context"]) for c in cases}
    if len(scopes) > 1:
        raise ValueError(f"cycle result holds several preset/tp/context {sorted(scopes)}; plan needs one")
    return cases


# a cycle case's per-phase table: each column under the plain name or the deployment profiler's name
TABLE_NAMES = {"draft": ("draft",), "verify": ("verify", "target verify"), "reextend": ("reextend", "draft re-extend"),
               "other": ("other",)}


def table_ms(case: dict) -> dict[str, float]:
    """A cycle case's phases in ms under the plain names (TABLE_NAMES); ValueError naming the case for one missing."""
    t = case["derived"].get("table_ms", {})
    out = {}
    for column, names in TABLE_NAMES.items():
        found = [t[n] for n in names if n in t]
        if not found:
            raise ValueError(f"cycle case {case['name']!r}: table_ms has no {' or '.join(map(repr, names))}")
        out[column] = found[0]
    return out


def cycle_costs(run: dict, attention: str = "all", context: int | None = None) -> tuple[dict, float]:
    """({(config, attention): Cost}, T_decode ms) from a cycle result: the measured cycle (median) and its phases,
    other floored at 0 (see clipped_other); T_decode the median of every passing case's plain decode, whatever
    `attention` picks, so one file gives one T_decode."""
    costs = {}
    for c in cycle_cases(run, attention, context):
        t = table_ms(c)
        key = (case_config(c), c["params"]["attention"])
        if key in costs:
            raise ValueError(f"cycle result holds {key} twice")
        costs[key] = Cost(case_config(c), t["draft"], t["verify"], t["reextend"] + max(0.0, t["other"]),
                          c["summary"]["median_us"] / 1e3, "measured")
    return costs, float(np.median([c["derived"]["decode_ms"] for c in cycle_cases(run, "all", context)]))


def clipped_other(run: dict, attention: str = "all", context: int | None = None) -> list[str]:
    """The cases whose phases sum past the measured cycle (other < 0: the phase pass and the whole-cycle pass
    disagree by that much), as "label other_ms"."""
    return [f"({','.join(map(str, case_config(c)))}) {c['params']['attention']} {table_ms(c)['other']:+.2f} ms"
            for c in cycle_cases(run, attention, context) if table_ms(c)["other"] < 0]


def newest_cycle(directory: Path) -> Path | None:
    """The newest cycle result in a results folder (result_files.latest_of_kind: by the UTC time in the names)."""
    return result_files.latest_of_kind(directory, "cycle")


def verify_points(run: dict) -> tuple[dict[int, float], float]:
    """({n: full forward ms}, T_decode ms = the n = 1 forward) from a verify result."""
    least = min((batch_of(c) for c in passing_cases(run)), default=1)  # one request's forward
    full = {c["params"]["tokens"]: c["summary"]["median_us"] / 1e3 for c in passing_cases(run)
            if c["params"].get("variant") == "full" and batch_of(c) == least}
    if 1 not in full or len(full) < 2:
        raise ValueError("verify result: needs passing full forwards at n = 1 and at least one more n")
    return full, full[1]


def modelled_costs(configs, points: dict[int, float], draft_ms: float | None, draft_step_ms: float,
                   overhead_ms: float, measured: str) -> tuple[dict, tuple[float, float] | None]:
    """Cost per config from verify points {D: ms} (tagged `measured`), others from the least-squares line
    (returned as (a, b) when used); draft = draft_ms per cycle, else steps * draft_step_ms."""
    line = None
    costs = {}
    for config in configs:
        d = config[2]
        if d in points:
            verify, source = points[d], measured
        else:
            if len(points) < 2:
                raise ValueError(f"--verify-ms: one point (D={next(iter(points))}) gives no line for D={d}; give "
                                 f"verify times at >= 2 D, or --configs whose D is {next(iter(points))}")
            b, a = np.polyfit(list(points), list(points.values()), 1)
            line = (float(a), float(b))
            verify = line[0] + line[1] * d
            source = "interpolated" if min(points) < d < max(points) else "extrapolated"
            if b < 0 and source == "extrapolated" or verify <= 0:
                raise ValueError(f"--verify-ms: the verify times given fall with D (T(D) = {a:.4g} {b:+.4g}*D ms); "
                                 f"drawn out to D={d} that line gives {verify:.4g} ms, a cycle that shrinks with more "
                                 "draft tokens: give the verify time at that D, or --configs within the D given")
        draft = draft_ms if draft_ms is not None else config[0] * draft_step_ms
        costs[(config, None)] = Cost(config, draft, verify, overhead_ms, draft + verify + overhead_ms, source)
    return costs, line


def rank(costs: dict, decode_ms: float, tau_of) -> list[dict]:
    """Rows by tok/s, best first; tau_of(config) -> tau."""
    rows = []
    several = len({attention for _, attention in costs}) > 1  # name the variant only where there is a choice
    for (config, attention), c in costs.items():
        tau, top = tau_of(config), max_accept_len(config)
        if not 1 <= tau <= top:
            raise ValueError(f"accept length {tau:g} for {config} outside 1..{top} (min(steps, D-1) + bonus)")
        tau_star = c.cycle_ms / decode_ms
        rows.append({"config": "(%d,%d,%d)" % config + (f" {attention}" if several else ""),
                     "config_tuple": list(config), "attention": attention,
                     **{k: v for k, v in asdict(c).items() if k != "config"},
                     "tau": tau, "max_tau": top, "tok_s": 1000 * tau / c.cycle_ms,
                     "speedup": tau * decode_ms / c.cycle_ms, "tau_star": tau_star,
                     "pays": "yes" if tau > tau_star else "no" if tau_star <= top else "never (tau* > max tau)"})
    return sorted(rows, key=lambda r: -r["tok_s"])


TABLE_COLUMNS = {"config": "config", "draft_ms": "draft_ms", "verify_ms": "verify_ms", "verify_from": "verify",
                 "overhead_ms": "reextend+other_ms", "cycle_ms": "T_cycle_ms", "tau": "tau", "max_tau": "max tau",
                 "tok_s": "tok/s", "speedup": "speedup", "tau_star": "break-even tau*", "pays": "pays"}


def answer(rows: list[dict], decode_ms: float, compare_d=COMPARE_D, batch: int | None = None) -> list[str]:
    """The one-line answer: the best config, then the best at two draft-token counts side by side. `batch`: a
    batched cycle's B, named with each rate per request and in total."""
    best = rows[0]
    per = "" if batch is None else f" per request at B {batch}" + (
        f" ({batch * best['tok_s']:.4g} in total)" if batch > 1 else " (one request: the total)")
    dec = "" if batch is None else f" per request at B {batch}"
    lines = [f"best: {best['config']} at {best['tok_s']:.4g} tok/s{per}, {best['speedup']:.3g}x plain decode "
             f"({1000 / decode_ms:.4g} tok/s{dec}); it pays above tau* = {best['tau_star']:.3g}"
             + ("" if best["speedup"] > 1 else "; at this acceptance no configuration beats plain decode")]
    by_d = {}
    for r in rows:  # rows are best first: the first seen per D is its best
        by_d.setdefault(r["config_tuple"][2], r)
    pair = compare_d if all(d in by_d for d in compare_d) else (min(by_d), max(by_d))
    if pair[0] != pair[1]:
        lo, hi = by_d[pair[0]], by_d[pair[1]]
        winner = hi if hi["tok_s"] > lo["tok_s"] else lo
        loser = lo if winner is hi else hi
        lines.append(f"{pair[0]} vs {pair[1]} draft tokens{dec}: {lo['config']} {lo['tok_s']:.4g} tok/s (tau "
                     f"{lo['tau']:.3g}, T_cycle {lo['cycle_ms']:.4g} ms, tau* {lo['tau_star']:.3g}) vs {hi['config']} "
                     f"{hi['tok_s']:.4g} tok/s (tau {hi['tau']:.3g}, T_cycle {hi['cycle_ms']:.4g} ms, tau* "
                     f"{hi['tau_star']:.3g}): {winner['config_tuple'][2]} wins by "
                     f"{100 * (winner['tok_s'] / loser['tok_s'] - 1):.3g}%; {pair[1]} beats {pair[0]} when "
                     f"tau({pair[1]})/tau({pair[0]}) > {hi['cycle_ms'] / lo['cycle_ms']:.4g}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", nargs="*", type=Path, default=[],
                   help="a cycle or verify result file, or a results folder (its latest cycle result, else verify "
                        "result), or several files of one kind (the latest); else the costs come from the numbers "
                        "below")
    p.add_argument("--configs", default=None,
                   help=f"steps,topk,D;... (default: the cost source's configs, else {DEFAULT_CONFIGS})")
    acc = p.add_mutually_exclusive_group(required=True)
    acc.add_argument("--accept-rates", default=None, help=RATES_HELP)
    acc.add_argument("--accept-len", default=None, help="tau per D or per steps,topk,D: '3:2.4,6:3.1' (>= 1)")
    p.add_argument("--attention", default="all",
                   help="cycle result: the attention variant to plan (extend, split_kv, or all; default all: every "
                   "variant the file holds, ranked together)")
    p.add_argument("--context", type=context_arg, default=None,
                   help="cycle result of `cycle --contexts`: the context to plan at (one of those it holds)")
    p.add_argument("--deployment", default=None, metavar="VARIANT",
                   help="cycle result of `cycle --engine ... --ab`: the variant to plan (deployed, ours, or an A/B "
                   "variant's name; default deployed), its own plain decode as T_decode")
    p.add_argument("--batch", type=int_in(1, FORWARD_ROWS_MAX), default=None,
                   help="cycle result of `cycle --batch`: the batch size to rank at (default its smallest, then the "
                   "per-batch answer for every batch it holds)")
    p.add_argument("--decode-ms", type=finite_float(0, MAX_STEP_MS, exclusive=True), default=None,
                   help="one plain decode step (ms); overrides a result file's")
    p.add_argument("--verify-ms", default=None, help="verify time per D: 'D:ms,...' (ms > 0)")
    p.add_argument("--draft-ms", type=finite_float(0, MAX_STEP_MS), default=None,
                   help="drafting, per cycle whatever the steps (ms)")
    p.add_argument("--draft-step-ms", type=finite_float(0, MAX_STEP_MS), default=None,
                   help=f"drafting, per draft step (ms; default {ASSUMED_DRAFT_STEP_MS} ASSUMED)")
    p.add_argument("--reextend-ms", type=finite_float(0, MAX_STEP_MS), default=None,
                   help=f"draft re-extend per cycle (ms; default {ASSUMED_REEXTEND_MS} ASSUMED)")
    p.add_argument("--other-ms", type=finite_float(0, MAX_STEP_MS), default=None,
                   help=f"tree build, sync, bookkeeping per cycle (ms; default {ASSUMED_OTHER_MS} ASSUMED)")
    p.add_argument("--json", type=out_path, default=None, metavar="OUT",
                   help="also write the rows as JSON (a new file: never over the input or an existing file)")


def one_deployment(run: dict, tag: str | None) -> dict:
    """A cycle result's cases of one deployment variant (`cycle --engine ... --ab`: `tag`, default "deployed"), its
    T_decode its own; a result of the suite's kernels as it is. Says which it plans."""
    tags = sorted({c["params"]["deployment"] for c in run["cases"] if "deployment" in c.get("params", {})})
    if not tags:
        if tag is not None:
            raise ValueError(f"--deployment {tag}: the cycle result ran the suite's kernels (no cycle --engine)")
        print("planning the suite's kernels (the cycle ran no --engine)")
        return run
    want = tag or ("deployed" if "deployed" in tags else tags[0])
    if want not in tags:
        raise ValueError(f"--deployment {want}: the cycle result holds {', '.join(tags)}")
    cases = [c for c in run["cases"] if c.get("params", {}).get("deployment") == want]
    others = [t for t in tags if t != want]
    print(f"planning the deployment variant {want!r}: {cases[0]['params'].get('deployment_line')}, flags "
          f"{cases[0]['params'].get('engine_args') or '(defaults)'}" + (f" (the file also holds {', '.join(others)})"
                                                                      if others else ""))
    return {**run, "cases": cases}


def _costs(args, configs) -> tuple[dict, float, list[str], str | None]:
    """(costs, T_decode ms, notes saying where each figure came from, the note on the verify line if one was
    drawn)."""
    given = {k: getattr(args, k.replace("-", "_")) for k in ("draft-ms", "draft-step-ms", "reextend-ms", "other-ms")}
    if args.draft_ms is not None and args.draft_step_ms is not None:
        raise ValueError("--draft-ms (per cycle) and --draft-step-ms (per step): give one")
    run = None
    if args.result:
        run, args.result, note = load_result(args.result)
        if note:
            print(note)
    else:
        args.result = None
    args.per_batch, args.at_batch = None, None
    if run is not None and run["component"] == "cycle":
        sizes = batches.batches(run)
        if args.batch is not None and args.batch not in sizes:
            raise ValueError(f"--batch {args.batch}: the cycle result holds batches {sizes}")
        if len(sizes) > 1:
            args.per_batch = run
        if len(sizes) > 1 or min(sizes) > 1:  # a batched answer names its B
            args.at_batch = args.batch or min(sizes)
        run = {**run, "cases": [c for c in run["cases"] if batches.batch_of(c) == (args.batch or min(sizes))]}
        run = one_deployment(run, args.deployment)
        extra = [f"--{k}" for k, v in given.items() if v is not None] + (["--verify-ms"] if args.verify_ms else [])
        if extra:
            raise ValueError(f"{' '.join(extra)}: the cycle result's measured phases are used; cost flags go with a "
                             "verify result or numbers")
        costs, decode = cycle_costs(run, args.attention, args.context)
        held = sorted({c["params"].get("attention") for c in cycle_cases(run, "all", args.context)})
        if configs is not None:
            missing = [c for c in configs if not any(k[0] == c for k in costs)]
            if missing:
                raise ValueError(f"--configs: {missing} not in {args.result} (it holds "
                                 f"{sorted({k[0] for k in costs})})")
            costs = {k: v for k, v in costs.items() if k[0] in configs}
        at = (f" at batch {args.at_batch} (--batch picks another); tok/s per request, {args.at_batch}x that in "
              "total" if args.at_batch else "")
        notes, line_note = [f"costs: measured cycle (median) and phases of {args.result}{at}"], None
        if args.attention != "all":
            others = [a for a in held if a != args.attention]
            notes.append(f"attention: {args.attention} only" + (f"; the file also holds {', '.join(others)} "
                                                                 "(--attention all ranks them together)" if others else ""))
        else:
            notes.append(f"attention: every variant in the file ranked ({', '.join(held)})")
        clipped = clipped_other(run, args.attention, args.context)
        if clipped:
            notes.append("other shown as 0 where the phases sum past the measured cycle (the two timing passes "
                         f"disagree): {'; '.join(clipped)}")
    else:
        if args.batch is not None:
            raise ValueError("--batch picks one batch of a cycle result (cycle --batch); this source has none")
        if args.context is not None:
            raise ValueError("--context picks one context of a cycle result (cycle --contexts); this source has one")
        if run is not None and run["component"] != "verify":
            raise ValueError(f"{args.result}: a cycle or verify result is needed, got {run['component']!r}")
        if run is not None and args.verify_ms:
            raise ValueError("--verify-ms: the verify result's forward is used; give one or the other")
        if run is None and (args.verify_ms is None or args.decode_ms is None):
            raise ValueError("without a result file give --decode-ms and --verify-ms 'D:ms,...'")
        points, decode = verify_points(run) if run else (parse_keyed(args.verify_ms, "--verify-ms", 0, MAX_STEP_MS),
                                                         None)
        if any(v <= 0 for v in points.values()):
            raise ValueError(f"--verify-ms: times must be > 0 ms, got {args.verify_ms!r}")
        if any(not isinstance(k, int) for k in points):
            raise ValueError("--verify-ms: keys are D (draft tokens), e.g. 3:25.6,6:28.7")
        step = ASSUMED_DRAFT_STEP_MS if args.draft_step_ms is None else args.draft_step_ms
        reextend = ASSUMED_REEXTEND_MS if args.reextend_ms is None else args.reextend_ms
        other = ASSUMED_OTHER_MS if args.other_ms is None else args.other_ms
        costs, line = modelled_costs(configs or parse_configs(DEFAULT_CONFIGS), points, args.draft_ms, step,
                                     reextend + other, "measured" if run else "given")
        mark = {True: "given", False: "ASSUMED"}
        draft = (f"draft {args.draft_ms:g} ms per cycle (given)" if args.draft_ms is not None else
                 f"draft {step:g} ms per step ({mark[args.draft_step_ms is not None]})")
        notes = [(f"verify: the suite's full forward of {args.result} (n = D; one rank, synthetic)" if run else
                  "verify: given per D") + f"; {draft}; re-extend {reextend:g} ms "
                 f"({mark[args.reextend_ms is not None]}); other {other:g} ms ({mark[args.other_ms is not None]})"]
        line_note = line and f"verify at D not given: least-squares line T(D) = {line[0]:.4g} + {line[1]:.4g}*D ms"
    if args.decode_ms is not None:
        decode = args.decode_ms
        notes.append(f"T_decode {decode:g} ms (given)")
    else:
        notes.append(f"T_decode {decode:.4g} ms (measured in {args.result}; the median over its passing cases)")
    return costs, decode, notes, line_note


def run(args) -> int:
    configs = parse_configs(args.configs) if args.configs is not None else None
    if args.json is not None:
        store.refuse_inputs(args.json, args.result if isinstance(args.result, list) else [args.result], "--json")
    costs, decode, notes, line_note = _costs(args, configs)
    if args.accept_rates is not None:
        rates = parse_rates(args.accept_rates)
        tau_of = lambda config: tau_from_rates(rates, config)  # noqa: E731
        notes.append(f"tau from per-depth rates {rates}" + (" (trees: applied to the best path, an APPROXIMATION)"
                                                            if any(k[0][1] > 1 for k in costs) else ""))
    else:
        taus = parse_keyed(args.accept_len, "--accept-len", 1, TOKEN_COUNT_MAX)
        known = {k[0] for k in costs if k[0] in taus or k[0][2] in taus}
        if configs is not None and known != {k[0] for k in costs}:
            raise ValueError(f"--accept-len: no accept length for {sorted({k[0] for k in costs} - known)}")
        dropped = sorted({k[0] for k in costs} - known)
        if not known:
            raise ValueError(f"--accept-len: none of its keys {sorted(taus, key=str)} matches a config "
                             f"{sorted({k[0] for k in costs})}")
        if dropped:
            notes.append(f"not ranked (no accept length given): {', '.join('(%d,%d,%d)' % c for c in dropped)}")
        costs = {k: v for k, v in costs.items() if k[0] in known}
        tau_of = lambda config: taus.get(config, taus.get(config[2]))  # noqa: E731
        notes.append("tau as given (mean accepted tokens per cycle, bonus included)")
    rows = rank(costs, decode, tau_of)
    if any(r["verify_from"] in ("interpolated", "extrapolated") for r in rows):
        notes.append(line_note)
    lines = answer(rows, decode, batch=getattr(args, "at_batch", None))
    print("\n".join(notes))
    print(tabulate([{TABLE_COLUMNS[k]: r[k] for k in TABLE_COLUMNS} for r in rows], headers="keys", floatfmt=".4g"))
    print("\n".join(lines))
    if args.per_batch is not None:
        print("\n".join(batches.lines(args.per_batch, tau_of)))
    if args.json:
        written = store.write_json_new(args.json, {"command": "plan", "source": str(args.result or "numbers"),
                                                      "decode_ms": decode, "notes": notes, "answer": lines,
                                                      "rows": rows}, [args.result], "--json")
        print(f"wrote {written}")
    return 0
