"""What the tuned tables buy on this GPU: the Kimi-K2.5 TP8 verify forward and one MoE layer at n = 1..8, each timed
with the tuned tables and with every kernel on its defaults (tables hidden), interleaved in one process (GPU only).

    python3 scripts/defaults_vs_tuned.py OUT.json [--rounds 3] [--preset kimi-k2.5 --tp 8 --context 4096]

Graph mode through the suite's engine; rounds alternate which side goes first, and each figure is the median of its
rounds' medians. The MoE layer rotates over the forward's MoE layers (cold weights, as a forward reads them).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from verifybench.harness.engine import results
from verifybench.harness.engine.timing import cuda_available, measure
from verifybench.harness.model.build import allreduce_stand_in_us, build_forward
from verifybench.kernels import config_tables

NS = tuple(range(1, 9))
SIDES = ("tuned", "default")


def moe_calls(fwd, n: int) -> list:
    """One call per MoE layer of the forward: the routed experts of n tokens at the forward's routing."""
    b = fwd.buf[n]
    x = torch.randn(n, fwd.s.hidden, device=fwd.device, dtype=torch.bfloat16)
    return [lambda L=L: fwd.moe_fn(x, L["w13p"], L["w13s"], L["w2p"], L["w2s"], b["topk_w"], b["topk_ids"])
            for L in fwd.layers if "w13p" in L]


def timed_us(fns, side: str, max_time_s: float) -> float:
    """Median us of one call in graph mode, the tables hidden for side "default" (selection runs at the warm-up
    and the capture, inside the block)."""
    with config_tables.defaults_only(side == "default"):
        return measure(fns, mode="graph", device="cuda", max_time_s=max_time_s).median_us


def compare(fwd, rounds: int, max_time_s: float, log=print) -> list[dict]:
    rows = []
    for n in NS:
        jobs = {"forward": [lambda n=n: fwd.forward(n)], "moe": moe_calls(fwd, n)}
        seen = {(what, side): [] for what in jobs for side in SIDES}
        for r in range(rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                for what, fns in jobs.items():
                    seen[(what, side)].append(timed_us(fns, side, max_time_s))
        row = {"n": n}
        for what in jobs:
            tuned, default = (statistics.median(seen[(what, s)]) for s in SIDES)
            row.update({f"{what}_tuned_us": tuned, f"{what}_default_us": default,
                        f"{what}_gap_pct": 100 * (default - tuned) / tuned,
                        f"{what}_rounds_us": {s: seen[(what, s)] for s in SIDES}})
        log(f"n={n}: forward {row['forward_tuned_us']:.1f} / {row['forward_default_us']:.1f} us, "
            f"moe {row['moe_tuned_us']:.2f} / {row['moe_default_us']:.2f} us")
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    return tabulate([{"n": r["n"], **{f"{w}_{k}": r[f"{w}_{k}"] for w in ("forward", "moe")
                                      for k in ("tuned_us", "default_us", "gap_pct")}} for r in rows],
                    headers="keys", floatfmt=".2f")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-time-s", type=float, default=0.5, help="sampling cap of one measurement")
    ap.add_argument("--preset", default="kimi-k2.5")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=None, help="layers of the forward (default all)")
    args = ap.parse_args(argv)
    if not cuda_available():
        print("defaults_vs_tuned needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    results.check_writable(args.out.parent)
    fwd = build_forward(args.preset, args.tp, args.layers, args.context, allreduce_stand_in_us()[0])
    rows = compare(fwd, args.rounds, args.max_time_s)
    gpu = config_tables.device_name("cuda")
    results.write_json_atomic(args.out, {"gpu": gpu, "preset": args.preset, "tp": args.tp, "context": args.context,
                                         "layers": len(fwd.layers), "rounds": args.rounds, "mode": "graph",
                                         "rows": rows})
    print(f"wrote {args.out}")
    config_tables.print_defaults_notice()
    print(f"{gpu}, {args.preset} TP{args.tp}, context {args.context}: tuned tables vs defaults (gap: default slower "
          "by)\n" + table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
