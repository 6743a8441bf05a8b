"""`verifybench tune`: tune the config tables of the suite's Triton kernels (the skinny GEMM, the MLA decode attention,
the INT4 MoE) on this GPU, each within its share of one time budget, and write them to your config folder.

The tables go to $VERIFYBENCH_CONFIG_DIR, else ~/.config/verifybench/ (or --out), one JSON per kernel, written
atomically; each holds this GPU's entry (the shipped one with the tuned shapes replaced) beside any other GPU's you
tuned before. Selection reads the shipped tables with yours merged over them per GPU name, so `verifybench run`
then uses them; the shipped tables in the package are never written. A kernel whose tune measured nothing writes
no table, and the command exits 1. Without a CUDA GPU it exits 2: there is nothing to tune.
"""
from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

from verifybench.harness.analysis.numbers import finite_float, name_list
from verifybench.harness.measure.exits import EXIT_FAILED, EXIT_OK
from verifybench.harness.measure.timing.timer import cuda_available
from verifybench.kernels.common import config_tables

TUNERS = ("skinny_gemm", "mla_decode", "moe_int4")
MAX_BUDGET_S = 24 * 3600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--components", default=",".join(TUNERS), help=f"kernels to tune (default {','.join(TUNERS)})")
    p.add_argument("--budget-s", type=finite_float(30), default=600.0,
                   help="wall-clock budget in seconds for all of them, split evenly as each finishes (default 600)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for the tables (default ${config_tables.CONFIG_DIR_ENV}, else ~/.config/verifybench)")
    p.add_argument("--preset", default="kimi-k2.5", help="model preset whose shapes are tuned (default kimi-k2.5)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel degree: per-rank shapes (default 8)")


def parse_components(text: str) -> list[str]:
    return name_list(text, "--components", TUNERS)


def table_path(name: str, out: Path | None) -> Path:
    """Where the tune of kernel `name` writes: its shipped table's file name in --out or the user's folder."""
    shipped = importlib.import_module(_KERNELS[name]).CONFIG_PATH
    return (out / shipped.name) if out is not None else config_tables.user_path(shipped)


_KERNELS = {"skinny_gemm": "verifybench.kernels.skinny_gemm.configs",  # the module of each shipped table (CONFIG_PATH)
            "mla_decode": "verifybench.kernels.mla_decode.configs",
            "moe_int4": "verifybench.kernels.moe_int4.configs"}


def tune_one(name: str, path: Path, share_s: float, preset: str, tp: int, log) -> bool:
    """Run one kernel's tuner into `path`; whether it wrote a table (False: it measured nothing)."""
    mod = importlib.import_module(f"{__name__}.{name}")
    try:
        if name == "moe_int4":
            table = mod.tune(preset, tp, out=str(path), max_minutes=share_s / 60, log=log)
        else:
            table = mod.tune(str(path), share_s, preset=preset, tp=tp, log=log)
    except RuntimeError as e:  # the tuner's "measured nothing"
        log(f"{name}: {e}")
        return False
    return bool(table)


def run(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    names = parse_components(args.components)
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if args.budget_s > MAX_BUDGET_S:
        raise ValueError(f"--budget-s must be <= {MAX_BUDGET_S:.0f}, got {args.budget_s:g}")
    from verifybench.harness.model import presets

    presets.get(args.preset, args.tp)  # an unknown preset or a TP that does not divide: named before any work
    if not cuda_available():
        raise ValueError("verifybench tune needs a CUDA GPU: it times this GPU's kernels (nothing was written)")
    paths = {name: table_path(name, args.out) for name in names}
    t0 = time.perf_counter()
    wrote, empty = [], []
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TextColumn("of {task.total:.0f} s"))
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("tune", total=args.budget_s)

        def log(*parts):
            bar.update(task, completed=min(args.budget_s, time.perf_counter() - t0))
            bar.console.print(*parts, markup=False, highlight=False)

        for i, name in enumerate(names):
            share = (args.budget_s - (time.perf_counter() - t0)) / (len(names) - i)
            bar.update(task, description=f"tune {name} ({i + 1}/{len(names)})")
            log(f"== {name}: {share:.0f} s, table {paths[name]}")
            (wrote if tune_one(name, paths[name], share, args.preset, args.tp, log) else empty).append(name)
        bar.update(task, completed=min(args.budget_s, time.perf_counter() - t0), description="tune done")
    for name in wrote:
        print(f"{name}: wrote {paths[name]}")
    if empty:
        print(f"measured nothing, no table written: {', '.join(empty)}")
        return EXIT_FAILED
    return EXIT_OK
