"""`verifybench`: thin command line over the engine and the component modules.

Each component subcommand loops over the same `cases(preset)` the pytest-benchmark module parametrizes over.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from tabulate import tabulate

from harness import fingerprint, hostpin, results
from harness.timing import MODE_HELP, cuda_available

# subcommand -> (module, help). A component module has COMPONENT (results file prefix), cases(preset, tp) ->
# list[CaseSpec] and tables(records) -> [(title, rows)] over the stored case records. Components register here.
COMPONENTS: dict[str, tuple[str, str]] = {
    "harness": ("harness.baseline", "copy-bandwidth ceiling and the sync-distortion exhibit"),
    "graph": ("microbench.bench_graph_replay", "CUDA-graph replay: fixed + per-node cost, host replay(), eager vs "
              "graph, model-shaped graph at 1..8 tokens"),
    "kv_tree": ("microbench.bench_kv_tree", "EAGLE draft tree: organize, build_tree, verify, KV slots, argmax; "
                "kernel vs reference"),
    "skinny_gemm": ("microbench.bench_skinny_gemm", "bf16 projections at n <= 16 tokens: Triton weight-streaming GEMM "
                    "vs cuBLAS (F.linear), cold"),
    "mla_decode": ("microbench.bench_mla_decode", "MLA decode attention of n <= 8 tokens over the latent cache: "
                   "Triton flash-decoding vs the plain-torch path, cold"),
    "moe": ("microbench.bench_moe_int4", "INT4 W4A16 MoE layer at 1..8 tokens: Triton vs reference vs bf16 torch"),
    "allreduce": ("microbench.bench_allreduce", "allreduce call floor in a 1-rank group (multi-GPU: torchrun -m "
                  "harness.allreduce)"),
    "verify": ("microbench.bench_verify", "synthetic one-rank verify forward at 1..8 tokens and its decomposition"),
}
EXIT_OK, EXIT_SLOW, EXIT_BAD_INPUT = 0, 1, 2
CPU_SMOKE_MAX_TIME_S = 0.2


def cpu_banner() -> str:
    return ("NOTE: no CUDA device: CPU smoke profile (tiny shapes, torch CPU code, perf_counter timing). "
            "These are CPU numbers, not GPU numbers.")


def progress(items, description: str):
    """A rich progress bar over `items` (plain iteration when stdout is not a terminal is handled by rich)."""
    from rich.progress import track

    return track(items, description=description, transient=False)


def run_component(subcommand: str, preset: str, tp: int, out_dir: Path | None, context: int | None = None,
                  quiet: bool = False) -> dict:
    """Run every case of one component, save the results file, print its table; returns the run record."""
    module = importlib.import_module(COMPONENTS[subcommand][0])
    takes_context = "context" in inspect.signature(module.cases).parameters
    specs = module.cases(preset=preset, tp=tp, **({"context": context} if context and takes_context else {}))
    fp = fingerprint.collect()
    cases = [spec.run() for spec in progress(specs, f"{subcommand} ({len(specs)} cases)")]
    run = results.make_run(module.COMPONENT, cases, fp, extra={"preset": preset, "tp": tp})
    path = results.save_run(run, out_dir)
    if not quiet:
        for title, rows in module.tables(run["cases"]):
            print(f"\n{title}\n" + tabulate(rows, headers="keys", floatfmt=".4g"))
        failed = [c.name for c in cases if not c.check_ok]
        if failed:
            print(f"FAILED checks (no time reported): {', '.join(failed)}")
        if any(c.measurement and c.measurement.throttled for c in cases):
            print("WARNING: the GPU reported throttling during this run (see clocks_* in the JSON)")
        print(f"saved {path}")
    return run


def _cmd_env(args) -> int:
    fp = fingerprint.collect()
    if args.json:
        print(json.dumps(fp, indent=1))
        return EXIT_OK
    rows = [("gpu model", fp["gpu_model"]), ("results folder", f"results/{fp['slug']}"),
            ("driver", fp["driver"]), ("versions", ", ".join(f"{k} {v}" for k, v in fp["versions"].items() if v)),
            ("git", f"{fp['git']['commit']} dirty={fp['git']['dirty']}")]
    for g in fp["gpus"]:
        now = g.get("now") or {}
        rows.append((f"gpu {g['index']}", f"{g['name']} {g['uuid']} SM {now.get('sm_clock_mhz')}/"
                     f"{g['sm_clock_max_mhz']} MHz mem {now.get('mem_clock_mhz')}/{g['mem_clock_max_mhz']} MHz "
                     f"{now.get('temperature_c')} C {now.get('power_w')} W throttle={now.get('throttle_reasons')} "
                     f"PCIe gen{g['pcie_gen']} x{g['pcie_width']} NVLink {g['nvlink_active']}/{g['nvlink_links']}"))
    rows += [(k, v) for k, v in fp["env"].items()]
    print(tabulate(rows, tablefmt="plain"))
    if not fp["cuda_available"]:
        print(cpu_banner())
    return EXIT_OK


def _cmd_component(args) -> int:
    if not cuda_available():
        print(cpu_banner())
    hostpin.pin()
    run = run_component(args.command, args.preset, args.tp, args.out, args.context)
    return EXIT_OK if all(c["check"]["ok"] for c in run["cases"]) else EXIT_SLOW


def _cmd_compare(args) -> int:
    from harness import compare

    return compare.main(args)


def _cmd_breakeven(args) -> int:
    from harness.decompose import break_even

    be = break_even(args.accept_len, args.decode_ms, args.verify_ms, args.draft_ms, args.overhead_ms)
    print(tabulate([{"accept_len": args.accept_len, "decode_ms": args.decode_ms, "draft_ms": args.draft_ms,
                     "verify_ms": args.verify_ms, "overhead_ms": args.overhead_ms, "cycle_ms": be.cycle_ms,
                     "speedup": be.speedup, "break-even accept len": be.tau_star}], headers="keys", floatfmt=".4g"))
    print("speculation pays off" if be.speedup > 1 else "speculation does NOT pay off at this accept length")
    return EXIT_OK


def _cmd_project(args) -> int:
    """A what-if of a stored verify decomposition on a GPU described by numbers (decompose.project)."""
    from harness import presets
    from harness.decompose import Gpu, project

    run = results.load_run(args.results)
    if run["component"] != "verify":
        raise ValueError(f"{args.results}: a verify result is needed (verifybench verify), got {run['component']!r}")
    cases = [c for c in run["cases"] if c["check"]["ok"]]
    iso = {(c["params"]["variant"], c["params"]["tokens"]): c["summary"]["median_us"] for c in cases}
    rows = []
    for c in sorted((c for c in cases if c["params"]["variant"] == "full"), key=lambda c: c["params"]["tokens"]):
        n, d, prm = c["params"]["tokens"], c["derived"], c["params"]
        layers = prm["layers"] or presets.get(prm["preset"], prm["tp"]).layers
        parts = {k[0][len("only-"):]: v for k, v in iso.items() if k[1] == n and k[0].startswith("only-")}
        here = Gpu(run["fingerprint"]["gpu_model"], d["copy_gbps"], d["allreduce_stand_in_us"])
        there = Gpu(args.name, args.copy_gbps, args.allreduce_us)
        proj = project(parts, d["component_bytes"], here, there, allreduces=2 * layers)
        rows.append({"n": n, f"measured_us ({here.name})": c["summary"]["median_us"],
                     "sum_of_parts_us": sum(parts.values()), "projected_low_us": sum(lo for lo, _ in proj.values()),
                     "projected_high_us": sum(hi for _, hi in proj.values())})
    print(f"PROJECTION (not a measurement) of {args.results} onto {args.name}: copy {args.copy_gbps} GB/s, "
          f"allreduce {args.allreduce_us} us. low: every weight-reading part keeps its eta; high: only its ideal "
          "streaming time scales; allreduces replaced; launch-bound parts unchanged.")
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    return EXIT_OK


def _cmd_run(args) -> int:
    """The main job: every registered component for a preset, then one markdown summary beside the JSON."""
    cpu = not cuda_available()
    hostpin.pin()
    if cpu:
        print(cpu_banner())
        # a smoke run: shorter sampling per case unless asked otherwise
        os.environ.setdefault("VERIFYBENCH_MAX_TIME_S", str(CPU_SMOKE_MAX_TIME_S))
        if args.preset != "tiny":
            print(f"(preset {args.preset} needs a GPU: running the tiny preset at TP 1, context 64 instead)")
            args.preset, args.tp, args.context = "tiny", 1, 64
    chosen = list(COMPONENTS) if args.components is None else args.components.split(",")
    unknown = [c for c in chosen if c not in COMPONENTS]
    if unknown or not chosen:
        raise ValueError(f"unknown component(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(COMPONENTS)}")
    runs = {}
    for sub in chosen:
        print(f"\n== {sub}: {COMPONENTS[sub][1]}")
        runs[sub] = run_component(sub, args.preset, args.tp, args.out, args.context)
    path = write_summary(runs, args, cpu)
    print(f"\nsummary: {path}")
    return EXIT_OK if all(c["check"]["ok"] for r in runs.values() for c in r["cases"]) else EXIT_SLOW


def write_summary(runs: dict, args, cpu: bool) -> Path:
    """Markdown with every component's tables and the fingerprint headline, stored next to the result files."""
    fp = next(iter(runs.values()))["fingerprint"]
    directory = Path(args.out or results.RESULTS_DIR / fp["slug"])
    lines = [f"# verifybench run: {args.preset} TP{args.tp} on {fp['gpu_model']}", ""]
    if cpu:
        lines += [f"**{cpu_banner()}**", ""]
    lines += [f"git {fp['git']['commit']} (dirty={fp['git']['dirty']}), torch {fp['versions']['torch']}, "
              f"driver {fp['driver']}", "", "Each figure: median of device-timed samples in the mode shown; the "
              "results JSON beside this file holds samples, CI and fingerprint.", ""]
    for sub, run in runs.items():
        module = importlib.import_module(COMPONENTS[sub][0])
        lines += [f"## {sub}: {COMPONENTS[sub][1]}", ""]
        for title, rows in module.tables(run["cases"]):
            lines += [f"**{title}**", "", tabulate(rows, headers="keys", tablefmt="github", floatfmt=".4g"), ""]
        for png in getattr(module, "charts", lambda *a: [])(run["cases"], directory):
            lines += [f"![{png.stem}]({png.name})", ""]
        failed = [c["name"] for c in run["cases"] if not c["check"]["ok"]]
        if failed:
            lines += [f"Checks FAILED (no time reported): {', '.join(failed)}", ""]
    stamp = datetime.fromisoformat(run["created_utc"]).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = directory / f"run-{args.preset}-tp{args.tp}-{stamp}.md"  # names the device tool can return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="verifybench",
        description="Device-timed microbenchmarks of the speculative-decoding verify forward. Timing modes: "
        + "; ".join(f"{k}: {v}" for k, v in MODE_HELP.items()),
    )
    sub = p.add_subparsers(dest="command", required=True)

    def add_preset_args(q, default_preset="kimi-k2.5"):
        q.add_argument("--preset", default=default_preset, help="model preset (kimi-k2.5, deepseek-v3, tiny)")
        q.add_argument("--tp", type=int, default=8, help="tensor-parallel degree for per-rank shapes (default 8)")
        q.add_argument("--out", type=Path, default=None, help="results folder (default results/<machine-slug>/)")
        q.add_argument("--context", type=int, default=None,
                       help="context length (tokens in the KV cache) of the verify forward (default 4096)")

    q = sub.add_parser("run", help="the main job: all components for a preset, results + report")
    add_preset_args(q)
    q.add_argument("--components", default=None,
                   help=f"comma-separated subset to run (default all: {','.join(COMPONENTS)})")
    q.set_defaults(func=_cmd_run)

    q = sub.add_parser("breakeven", help="speedup and break-even accept length of speculative decoding",
                       description="speedup = tau * T_decode / (T_draft + T_verify + T_overhead); break-even "
                       "tau* = (T_draft + T_verify + T_overhead) / T_decode. tau = mean tokens accepted per verify, "
                       "bonus token included. Defaults: the Kimi-K2.5 8xH200 deployment (27 ms cycle, 11.1 ms decode).")
    q.add_argument("--accept-len", type=float, required=True, help="tau: mean accepted tokens per verify, bonus included")
    q.add_argument("--decode-ms", type=float, default=11.1, help="one plain decode step (ms)")
    q.add_argument("--verify-ms", type=float, default=25.6, help="one verify forward (ms)")
    q.add_argument("--draft-ms", type=float, default=1.0, help="drafting the tokens (ms)")
    q.add_argument("--overhead-ms", type=float, default=0.4, help="tree build, sampling, bookkeeping (ms)")
    q.set_defaults(func=_cmd_breakeven)

    q = sub.add_parser("project", help="what-if: a stored verify decomposition on another GPU described by numbers",
                       description="Moves each isolated part of a verify result onto another GPU: weight-reading "
                       "parts by the copy-bandwidth ratio (a range: same eta there, or only the ideal streaming time "
                       "scales), the allreduces by the given latency; prints a labelled PROJECTION per n.")
    q.add_argument("results", type=Path, help="a verify result file (results/<machine>/verify-*.json)")
    q.add_argument("--name", default="target GPU", help="what to call the other GPU")
    q.add_argument("--copy-gbps", type=float, required=True, help="its device-to-device copy bandwidth (GB/s)")
    q.add_argument("--allreduce-us", type=float, required=True, help="its allreduce latency at verify sizes (us)")
    q.set_defaults(func=_cmd_project)

    q = sub.add_parser("env", help="print the run fingerprint (GPU, clocks, throttle reasons, versions, env)")
    q.add_argument("--json", action="store_true", help="the whole fingerprint as JSON")
    q.set_defaults(func=_cmd_env)

    q = sub.add_parser("compare", help="noise-aware comparison of two result files (suite or pytest-benchmark JSON)",
                       description="Per case: SAME / FAST / SLOW / AMBG from a Mann-Whitney U test on the samples "
                       "(or from non-overlapping intervals when only summaries exist) plus a minimum effect. "
                       "Exit 0: no case SLOW; 1: a case SLOW (or its check FAILED in NEW); 2: bad input.")
    q.add_argument("base", type=Path, help="baseline: a results/ JSON or a pytest-benchmark JSON")
    q.add_argument("new", type=Path, help="the run to judge, same formats")
    q.add_argument("--min-effect", type=float, default=0.03, help="smallest relative change that counts (0.03 = 3%%)")
    q.add_argument("--alpha", type=float, default=0.01, help="significance level of the test (default 0.01)")
    q.add_argument("--allow-different-hardware", action="store_true", help="compare across GPU models anyway")
    q.set_defaults(func=_cmd_compare)

    for name, (_, help_text) in COMPONENTS.items():
        q = sub.add_parser(name, help=help_text)
        add_preset_args(q)
        q.set_defaults(func=_cmd_component)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except results.ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
