"""`verifybench run` and the one-component commands: validate the scope, run each component's cases (check, then
time), store one result JSON per component, print its tables, and write the run's markdown report with its charts.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import torch

from verifybench.harness import components
from verifybench.harness.answers import advise
from verifybench.harness.analysis.numbers import (FORWARD_ROWS_MAX, MAX_CONTEXT, check_forward_rows, context_arg,
                                                  int_in, out_path, request_batches_arg, tokens_arg)
from verifybench.harness.measure.host import fingerprint, hostpin, hostprobe, interpreter
from verifybench.harness.measure.results import store, tables
from verifybench.harness.measure.timing import memory, timer
from verifybench.harness.measure.exits import EXIT_FAILED, EXIT_OK
from verifybench.harness.measure.timing.runner import release_unreferenced
from verifybench.harness.measure.timing.timer import cuda_available
from verifybench.harness.model.presets import CONTEXT, CPU_CONTEXT
from verifybench.kernels.common import config_tables, settings


def cpu_banner() -> str:
    return ("NOTE: no CUDA device: CPU smoke profile (tiny preset, torch CPU code, perf_counter timing). "
            f"{interpreter.describe()} These are CPU numbers, not GPU numbers.")


def figures_line(cpu: bool) -> str:
    """What a figure of the report is, as it was measured here."""
    if cpu:
        return ("Each figure: the median of perf_counter samples of CPU code (torch, and the Triton interpreter where "
                "a table names Triton); mode cpu-loop is K calls in a Python loop (a GPU run's `graph`: no CUDA graph here). "
                "The result JSON beside this file holds the samples and the fingerprint.")
    return ("Each figure: the median of device-timed samples in the mode shown; the result JSON beside this file "
            "holds the samples, their confidence interval and the fingerprint.")


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n" + tables.render(rows))


def add_scope_arguments(p: argparse.ArgumentParser, tokens: bool = True, batch: bool = False) -> None:
    p.add_argument("--preset", default=None, help="model preset: kimi-k2.5, deepseek-v3, tiny (default kimi-k2.5 "
                   "with a GPU; without one only tiny runs, the CPU smoke profile)")
    p.add_argument("--tp", type=int_in(1), default=None,
                   help="tensor-parallel degree: per-rank shapes (default 8; 1 on CPU)")
    p.add_argument("--context", type=context_arg, default=None,
                   help=f"tokens already in the KV cache, 1..{MAX_CONTEXT} (default {CONTEXT}; {CPU_CONTEXT} on CPU)")
    if tokens:  # a component whose shapes hold no token count takes no --tokens (argparse refuses it, exit 2)
        p.add_argument("--tokens", type=tokens_arg, default=None, help="token counts to verify, e.g. 1,2,4,8 or 1-8 "
                       "(default: each component's own set)")
    if batch:  # requests per step, each over its own context; a component without batches takes no --batch
        p.add_argument("--batch", type=request_batches_arg, default=None,
                       help=f"requests at once, e.g. 1,2,4,8 (default 1), each with its own KV cache of --context "
                       f"tokens; B x tokens per request at most {FORWARD_ROWS_MAX}. `run`: the components that take "
                       f"it ({', '.join(batch_components())}); the others run one request")
    p.add_argument("--out", type=out_path, default=None,
                   help=f"results folder (default ./{store.DEFAULT_OUT}/<machine>/, outside the checkout's results/)")
    p.add_argument("--allreduce-from", metavar="RESULT[:BACKEND]", default=None,
                   help="one GPU: the allreduce stand-in waits the latency measured in this allreduce or NCCL-sweep "
                   "result (the named backend, else the fastest; graph mode, nearest size) instead of the reference "
                   "7.7 us; the same as VERIFYBENCH_ALLREDUCE_FROM, for this run only")


def batch_components() -> list[str]:
    """The registered components whose cases take --batch (TAKES_BATCH)."""
    return [n for n in components.REGISTRY if getattr(components.load(n), "TAKES_BATCH", False)]


def resolve_scope(args) -> dict:
    """Every scope argument checked before anything is measured; the CPU smoke profile runs the tiny preset only."""
    from verifybench.harness.model import presets

    gpu = cuda_available()
    preset, tp, context = presets.default_scope(gpu)
    if args.preset is not None and args.preset not in presets.PRESETS:  # unknown first: "needs a GPU" would mislead
        raise ValueError(f"--preset: unknown preset {args.preset!r}; choose one of {', '.join(presets.PRESETS)}")
    if not gpu and args.preset not in (None, "tiny"):
        raise ValueError(f"preset {args.preset!r} needs a GPU; without one the CPU smoke profile runs --preset tiny")
    preset = args.preset or preset
    tp = tp if args.tp is None else args.tp
    context = context if args.context is None else args.context
    presets.get(preset, tp)  # unknown preset, or a TP that does not divide: ValueError naming it
    out = Path(args.out) if args.out else None
    allreduce_from = getattr(args, "allreduce_from", None)
    if allreduce_from:
        from verifybench.harness.model import build

        build.allreduce_stand_in_us(source=allreduce_from)  # the file read and checked now, before anything is measured
    return {"preset": preset, "tp": tp, "context": context, "out": out, "tokens": getattr(args, "tokens", None),
            "batch": getattr(args, "batch", None), "cpu": not gpu, "options": component_options(args),
            "engine": getattr(args, "engine", None), "engine_args": getattr(args, "engine_args", None),
            "deploy_cc": getattr(args, "deploy_cc", None),
            "allreduce_from": allreduce_from}


def component_options(args) -> dict:
    """The options a component's own add_arguments declared, as given on its command line (None: not given)."""
    module = components.load(args.command) if getattr(args, "command", None) in components.REGISTRY else None
    if module is None or not hasattr(module, "add_arguments"):
        return {}
    probe = argparse.ArgumentParser(add_help=False)
    module.add_arguments(probe)
    return {a.dest: getattr(args, a.dest) for a in probe._actions if getattr(args, a.dest, None) is not None}


def _cases(name: str, scope: dict) -> list:
    options = scope.get("options", {}) if scope.get("component") == name else {}
    module = components.load(name)
    if scope.get("batch") and getattr(module, "TAKES_BATCH", False):
        options = {**options, "batch": scope["batch"]}
    if scope.get("component") != name and getattr(module, "TAKES_DEPLOYMENT", False) and (
            scope.get("engine") or scope.get("engine_args")):  # `run --engine`: the engine as deployed
        options = {**options, "engine": scope["engine"], "engine_args": scope.get("engine_args"),
                   "deploy_cc": scope.get("deploy_cc"),
                   **({"beside_ours": True} if name == "cycle" else {})}  # ours beside it: what it could reach
    from verifybench.harness.model import build

    with build.allreduce_source(scope.get("allreduce_from")):  # --allreduce-from, handed to the stand-in
        specs = module.cases(scope["preset"], scope["tp"], scope["context"], scope["tokens"], **options)
    if getattr(module, "TAKES_BATCH", False):  # B x D: the one check, on the batch and tokens each case will run
        check_forward_rows([s.params for s in specs])
    return specs


def check_cases(names: list[str], scope: dict) -> None:
    """List every component's cases once before anything is measured (listing allocates nothing): a scope one of
    them cannot run (a token count beyond its buffers, a preset it cannot shape) is refused here, not mid-run."""
    for name in names:
        _cases(name, scope)


def progress(items, description: str):
    """A rich progress bar over `items` (rich prints plain lines when stdout is not a terminal)."""
    from rich.progress import track

    return track(items, description=description, transient=False)


def run_component(name: str, scope: dict, out_dir: Path, quiet: bool = False) -> tuple[dict, Path]:
    """Run every case of one component, save its result file, print its tables, free what it cached. Returns the
    run and the file it was saved as (a fresh name when another run took the usual one)."""
    module = components.load(name)
    specs = _cases(name, scope)
    fp = fingerprint.collect()
    extra = {k: v for k, v in scope.items() if k in ("preset", "tp", "context", "tokens", "batch", "options")}
    planned, cases = len(specs), []
    try:
        for spec in progress(specs, f"{name} ({planned} cases)"):
            cases.append(spec.run())
    except KeyboardInterrupt:
        # minutes of measurement are not thrown away: the cases that finished are saved, the file says it is partial
        if not cases:
            raise
        run = store.make_run(name, cases, fp, extra={**extra, "interrupted_after_cases": len(cases),
                                                       "cases_planned": planned})
        raise KeyboardInterrupt(f"{name}'s {len(cases)} finished cases of {planned} are in "
                                f"{store.save_run(run, out_dir)}") from None
    finally:
        specs = None  # their setups may hold what the cases built (a shared weight stack)
        module.release()
        release_unreferenced()
    run = store.make_run(name, cases, fp, extra=extra)
    path = store.save_run(run, out_dir)
    run["saved_path"] = str(path)  # in memory only: the summary and the report name the file
    if not quiet:
        for title, rows in module.tables(run["cases"]):
            print_table(title, rows)
        failed = [c.name for c in cases if not c.check_ok and not c.skipped]
        skipped = [f"{c.name} ({c.skipped})" for c in cases if c.skipped]
        if skipped:
            print(f"skipped (cannot run here): {'; '.join(skipped)}")
        if failed:
            print(f"FAILED checks (no time reported): {', '.join(failed)}")
        if any(c.measurement and c.measurement.throttled for c in cases):
            print("WARNING: the GPU reported throttling during this run (see clocks_* in the JSON)")
        print(f"saved {path}")
    return run, path


def failed_cases(run: dict) -> list[str]:
    return [c["name"] for c in run["cases"] if not c["check"]["ok"] and not c.get("skipped")]


def verified_lines(runs: dict[str, dict]) -> list[str]:
    """What the run verified: components, cases checked / passed / failed / skipped (each skip reason once, with
    its cases); a failure or a skip is indented under the counts."""
    cases = [c for run in runs.values() for c in run["cases"]]
    skipped = [c for c in cases if c.get("skipped")]
    failed = [c for c in cases if not c["check"]["ok"] and not c.get("skipped")]
    passed = [c for c in cases if c["check"]["ok"]]
    lines = [f"components run: {len(runs)} ({', '.join(runs)})",
             f"cases: {len(passed) + len(failed)} checked, {len(passed)} passed, {len(failed)} failed, "
             f"{len(skipped)} skipped"]
    lines += [f"  FAILED {c['name']}: {c['check'].get('detail', '')}" for c in failed]
    by_reason: dict[str, list[str]] = {}
    for c in skipped:
        by_reason.setdefault(c["skipped"], []).append(c["name"])
    for reason, names in by_reason.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        lines.append(f"  skipped {len(names)}: {reason} ({shown})")
    return lines


def summary_lines(runs: dict[str, dict], wall_s: float, report: Path | None) -> list[str]:
    """The run's closing summary: what was verified, wall time, the report and the result files."""
    lines = verified_lines(runs) + [f"wall time: {wall_s:.0f} s"]
    if report is not None:
        lines.append(f"report: {report}")
    files = [run["saved_path"] for run in runs.values() if run.get("saved_path")]
    if files:
        lines.append(f"results: {Path(files[0]).parent}/ ({', '.join(Path(f).name for f in files)})")
    return lines


def tokens_run(run: dict) -> str:
    """" Ran at n = 1, 2, 3 tokens.": the token counts the run's cases ran at (a help text's range is a GPU's
    default; the CPU runs fewer), or "" for a component without them."""
    ns = {c["params"].get("tokens") for c in run["cases"] if not c.get("skipped")}
    ns = sorted(n for n in ns if isinstance(n, int))
    return f" Ran at n = {', '.join(map(str, ns))} tokens." if ns else ""


def as_markdown_list(lines: list[str]) -> list[str]:
    """Plain lines as Markdown that renders one line per line: headings and blank lines kept, numbered items kept,
    an indented line a nested item, any other line an item of its own (a bare line would join its neighbours into
    one paragraph)."""
    out = []
    for line in lines:
        if not line.strip() or line.startswith("#") or re.match(r"(- |\d+\. )", line):
            out.append(line)
        elif line.startswith(" "):
            out.append(f"   - {line.strip()}")  # under a "1. " item: indented to its text
        else:
            out.append(f"- {line}")
    return out


def report_opening(runs: dict[str, dict], scope: dict, out_dir: Path) -> list[str]:
    """A GPU report opens with the answer and the levers (advise's); a CPU report with what was verified, then one
    line saying its timings are CPU numbers: an answer from them would be all withheld cells."""
    if not scope["cpu"]:
        return as_markdown_list(advise.report_lines(runs, out_dir))
    return (["## What was verified (CPU smoke profile)", ""] + as_markdown_list(verified_lines(runs)) + [""]
            + [f"**The timings below are CPU numbers, their figures withheld:** a figure derived from them (fits, "
               f"ratios, eta, break-even, the answer and its levers) would say nothing of a GPU, so it is withheld, "
               f"its column named above its table. {interpreter.describe()}", ""])


def write_report(runs: dict[str, dict], scope: dict, out_dir: Path, notices: list[str] = (),
                 saved: dict[str, Path] | None = None) -> Path:
    """Markdown with every component's tables and charts, the fingerprint headline and `notices` (which kernels ran
    on defaults), beside the result files (`saved`: component -> its file, named in the report). Every file of the
    run carries the run's UTC time in its name, numbered when another run of that second took the name."""
    saved = saved or {}
    first = next(iter(runs.values()))
    fp, stamp = first["fingerprint"], store.stamp(first)
    lines = [f"# verifybench run: {scope['preset']} TP{scope['tp']}, context {scope['context']}, on {fp['gpu_model']}",
             "", f"For {deployment_line(runs)}.", ""]
    lines += report_opening(runs, scope, out_dir)
    lines += [f"**{line}**" for line in notices] + ([""] if notices else [])
    if memory.cap_bytes() is not None:
        lines += [f"Memory capped at {memory.gib(memory.cap_bytes())} ({memory.CAP_ENV}); a component short of "
                  "memory ran fewer layers or rotation sets (said in its tables) or skipped a case (listed).", ""]
    lines += [f"git {fp['git']['commit']} (dirty={fp['git']['dirty']}), torch {fp['versions']['torch']}, "
              f"driver {fp['driver']}, method version {first.get('method_version')}", "",
              figures_line(scope["cpu"]), ""]
    for name, run in runs.items():
        module = components.load(name)
        lines += [f"## {name}: {module.HELP}", ""]
        source = saved.get(name) or run.get("saved_path")
        if source:
            lines += [f"From `{Path(source).name}`.{tokens_run(run)}", ""]
        # the verify break-even takes the draft and overhead the cycle measured in the same run
        measured = {"cycle": runs["cycle"], "cycle_name": saved["cycle"].name if "cycle" in saved else
                    f"cycle-{store.stamp(runs['cycle'])}.json"} if name == "verify" and "cycle" in runs else {}
        for title, rows in module.tables(run["cases"], **measured):
            lines += [f"**{title}**", "", tables.render(rows, "github"), ""]
        for png in module.charts(run["cases"], out_dir, stamp):
            lines += [f"![{png.stem}]({png.name})", ""]
        if failed_cases(run):
            lines += [f"Checks FAILED (no time reported): {', '.join(failed_cases(run))}", ""]
        skipped = [f"{c['name']} ({c['skipped']})" for c in run["cases"] if c.get("skipped")]
        if skipped:
            lines += [f"Skipped (cannot run here): {'; '.join(skipped)}", ""]
    return store.write_new(out_dir / f"run-{scope['preset']}-tp{scope['tp']}-{stamp}.md", "\n".join(lines).encode())


def _check_pin_cpu() -> None:
    text = settings.read(hostpin.ENV)
    if text is None or text.strip().lower() in ("auto", "off"):
        return
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not text.strip().isdigit() or (allowed and int(text) not in allowed):
        raise ValueError(f"{hostpin.ENV} must be auto, off or one of this process's CPUs {allowed}, got {text!r}")


def check_environment(gpu: bool) -> None:
    """Every VERIFYBENCH_* setting a run reads, checked before anything is measured (ValueError naming it and what
    it allows)."""
    from verifybench.harness.model import build
    from verifybench.kernels.common import pdl

    timer.max_time_from_env()
    build.allreduce_stand_in_us()
    build.ops_choice("cuda" if gpu else "cpu")
    pdl.enabled("cpu")  # reads and checks VERIFYBENCH_PDL
    config_tables.hidden()  # reads and checks VERIFYBENCH_CONFIG_TABLES
    hostprobe.process_gate()
    memory.cap_bytes()
    _check_pin_cpu()
    trace = settings.read(settings.MOE_TRACE)
    if trace is not None and not Path(trace).is_file():
        raise ValueError(f"VERIFYBENCH_MOE_TRACE must name a routing trace file, got {trace!r} (no such file)")


def prepare(scope: dict) -> Path:
    """Check the environment, pin the host, cap the memory, set one torch thread for the CPU smoke profile, check
    the output folder: all before measuring (the profile's sampling rule: runner.cpu_measure_kw)."""
    check_environment(not scope["cpu"])
    out = store.check_writable(scope["out"] or store.default_dir(fingerprint.collect()))
    hostpin.pin()
    if scope["cpu"]:
        print(cpu_banner())
        torch.set_num_threads(1)  # one thread, as on a pinned GPU host: timings without thread-pool noise
    cap = memory.apply_cap()
    if cap:
        print(f"memory capped at {memory.gib(cap['cap_bytes'])} ({memory.CAP_ENV})"
              + (f" of the card's {memory.gib(cap['total_bytes'])}" if "total_bytes" in cap else ""))
    return out


def deployment_line(runs: dict[str, dict]) -> str:
    """Whom the run answers for: the engine as deployed (`run --engine`; ours beside it), else the suite's kernels."""
    from verifybench.harness.model.deployments import SUITE

    line = next((c["params"]["deployment_line"] for run in runs.values() for c in run["cases"]
                 if c.get("params", {}).get("deployment") == "deployed"), None)
    return f"{line}, with the suite's kernels beside it (what the engine could reach)" if line else SUITE.line()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from verifybench.harness.model import deployments

    add_scope_arguments(p, batch=True)
    deployments.add_arguments(p)
    p.add_argument("--components", default=None,
                   help=f"comma-separated subset (default all, in this order: {', '.join(components.REGISTRY)})")


def run(args) -> int:
    """The main job: every registered component (or --components) for a preset, then one markdown report."""
    started = time.monotonic()
    names = components.parse_names(args.components)
    scope = resolve_scope(args)
    check_cases(names, scope)
    out_dir = prepare(scope)
    runs, saved = {}, {}
    for name in names:
        print(f"\n== {name}: {components.load(name).HELP}")
        runs[name], saved[name] = run_component(name, scope, out_dir)
    notices = config_tables.defaults_notice()
    path = write_report(runs, scope, out_dir, notices, saved)
    for line in notices:
        print(line)
    print("\n== summary" + (f" (CPU smoke profile: CPU numbers) {interpreter.describe()}" if scope["cpu"] else ""))
    for line in summary_lines(runs, time.monotonic() - started, path):
        print(line)
    return EXIT_FAILED if any(failed_cases(r) for r in runs.values()) else EXIT_OK


def run_one(args) -> int:
    """`verifybench <component>`: one component's cases, tables and result file."""
    started = time.monotonic()
    scope = resolve_scope(args)
    scope["component"] = args.command
    check_cases([args.command], scope)
    out_dir = prepare(scope)
    result = run_component(args.command, scope, out_dir)[0]
    if args.command == "cycle" and scope["options"].get("contexts"):  # the chart its --help promises
        from verifybench.harness.components import cycle

        print(cycle.context_chart_line(result["cases"], out_dir, store.stamp(result)))
    if args.command == "cycle" and len(scope.get("batch") or ()) > 1:  # tau* over B, one line per context
        from verifybench.harness.analysis import batches

        png = batches.chart(result, out_dir, store.stamp(result))
        print(f"chart: {png}" if png else "no chart of tau* over B on CPU: CPU numbers draw no comparison; `verifybench "
              "advise` on a GPU run's folder draws it (with --accept-len: the speedup over B)")
    config_tables.print_defaults_notice()
    print("\n== summary" + (f" (CPU smoke profile: CPU numbers) {interpreter.describe()}" if scope["cpu"] else ""))
    for line in summary_lines({args.command: result}, time.monotonic() - started, None):
        print(line)
    return EXIT_FAILED if failed_cases(result) else EXIT_OK
