"""`verifybench tune`: tune the config tables of the suite's Triton kernels on this GPU (the skinny GEMM, the MLA
decode attention, the INT4 MoE), each within its share of the time budget."""
from __future__ import annotations

import argparse
import time

from verifybench.harness.analysis.numbers import finite_float

TUNERS = ("skinny_gemm", "mla_decode", "moe_int4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--components", default=",".join(TUNERS), help=f"kernels to tune (default {','.join(TUNERS)})")
    p.add_argument("--budget-s", type=finite_float(30), default=600.0, help="wall-clock budget for all (default 600)")
    p.add_argument("--out", default=None, help="folder for the tuned tables (default: this directory)")
    p.add_argument("--preset", default="kimi-k2.5")
    p.add_argument("--tp", type=int, default=8)


def run(args) -> int:
    import importlib
    from pathlib import Path

    names = [n.strip() for n in args.components.split(",") if n.strip()]
    unknown = [n for n in names if n not in TUNERS]
    if unknown or not names:
        raise ValueError(f"--components: choose from {', '.join(TUNERS)}, got {args.components!r}")
    out = Path(args.out or ".")
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        share = (args.budget_s - (time.perf_counter() - t0)) / (len(names) - i)
        mod = importlib.import_module(f"{__name__}.{name}")
        path = str(out / f"{name}_configs.tuned.json")
        if name == "moe_int4":
            mod.tune(args.preset, args.tp, out=path, max_minutes=share / 60)
        elif name == "skinny_gemm":
            mod.tune(args.preset, args.tp, out=path, time_limit_s=share)
        else:
            mod.tune(path, share, preset=args.preset, tp=args.tp)
    return 0
