"""What the tuned tables buy on this GPU: the Kimi-K2.5 TP8 verify forward and one MoE layer at n = 1..8, each timed
with the shipped tables ("tuned"), with every kernel on its defaults (tables hidden) and, with --user-dir, with the
tables `verifybench tune` wrote there over the shipped ones ("retuned"), interleaved in one process (GPU only).

    python3 scripts/defaults_vs_tuned.py OUT.json [--user-dir DIR] [--rounds 3] [--preset kimi-k2.5 --tp 8]

Graph mode through the suite's engine; rounds alternate which side goes first, and each figure is the median of its
rounds' medians. The MoE layer rotates over the forward's MoE layers (cold weights, as a forward reads them).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from unittest import mock
from pathlib import Path

import torch

from verifybench.harness.measure.host import fingerprint
from verifybench.harness.measure.results import store
from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_OK
from verifybench.harness.measure.timing.timer import cuda_available, measure
from verifybench.harness.model.build import allreduce_stand_in_us, build_forward
from verifybench.kernels.common import config_tables, devices

NS = tuple(range(1, 9))
SIDES = ("tuned", "default")  # plus "retuned" with --user-dir


def moe_calls(fwd, n: int) -> list:
    """One call per MoE layer of the forward: the routed experts of n tokens at the forward's routing."""
    b = fwd.buf[n]
    x = torch.randn(n, fwd.s.hidden, device=fwd.device, dtype=torch.bfloat16)
    return [lambda L=L: fwd.moe_fn(x, L["w13p"], L["w13s"], L["w2p"], L["w2s"], b["topk_w"], b["topk_ids"])
            for L in fwd.layers if "w13p" in L]


@contextlib.contextmanager
def tables(side: str, dirs: dict[str, str]):
    """Selection inside the block as on `side`: the shipped tables alone (an empty user folder), none (defaults), or
    the user's folder over the shipped ones. Selection caches key on the folder, so each side re-selects."""
    with mock.patch.dict(os.environ, {config_tables.CONFIG_DIR_ENV: dirs.get(side, dirs["tuned"])}), \
            config_tables.defaults_only(side == "default"):
        yield


def timed_us(fns, side: str, dirs: dict[str, str], max_time_s: float) -> float:
    """Median us of one call in graph mode with `side`'s tables (selection runs at the warm-up and the capture,
    inside the block)."""
    with tables(side, dirs):
        return measure(fns, mode="graph", device="cuda", max_time_s=max_time_s).median_us


def compare(fwd, rounds: int, max_time_s: float, dirs: dict[str, str], log=print) -> list[dict]:
    sides = SIDES + (("retuned",) if "retuned" in dirs else ())
    rows = []
    for n in NS:
        jobs = {"forward": [lambda n=n: fwd.forward(n)], "moe": moe_calls(fwd, n)}
        seen = {(what, side): [] for what in jobs for side in sides}
        for r in range(rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                for what, fns in jobs.items():
                    seen[(what, side)].append(timed_us(fns, side, dirs, max_time_s))
        row = {"n": n}
        for what in jobs:
            us = {s: statistics.median(seen[(what, s)]) for s in sides}
            row.update({f"{what}_{s}_us": us[s] for s in sides})
            row.update({f"{what}_{s}_gap_pct": 100 * (us[s] - us["tuned"]) / us["tuned"] for s in sides[1:]})
            row[f"{what}_rounds_us"] = {s: seen[(what, s)] for s in sides}
        log(f"n={n}: " + "; ".join(f"{what} " + " / ".join(f"{row[f'{what}_{s}_us']:.2f}" for s in sides) + " us"
                                   for what in jobs) + f" ({' / '.join(sides)})")
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    keys = [k for k in rows[0] if k.endswith(("_us", "_pct")) and not k.endswith("rounds_us")]
    return tabulate([{"n": r["n"], **{k: r[k] for k in keys}} for r in rows], headers="keys", floatfmt=".2f")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--user-dir", type=Path, default=None,
                    help="a folder of tables from `verifybench tune`: timed as a third side, over the shipped ones")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-time-s", type=float, default=0.5, help="sampling cap of one measurement")
    ap.add_argument("--preset", default="kimi-k2.5")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=None, help="layers of the forward (default all)")
    args = ap.parse_args(argv)
    if not cuda_available():
        print("defaults_vs_tuned needs a CUDA GPU", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.user_dir is not None and not any(args.user_dir.glob("*_configs.json")):
        ap.error(f"--user-dir {args.user_dir}: no *_configs.json table there")
    store.check_writable(args.out.parent)
    fwd = build_forward(args.preset, args.tp, args.layers, args.context, allreduce_stand_in_us()[0])
    with tempfile.TemporaryDirectory() as empty:
        dirs = {"tuned": empty, **({"retuned": str(args.user_dir)} if args.user_dir else {})}
        rows = compare(fwd, args.rounds, args.max_time_s, dirs)
    gpu = devices.device_name("cuda")
    written = store.write_json_new(args.out, {"gpu": gpu, "preset": args.preset, "tp": args.tp, "context": args.context,
                                               "layers": len(fwd.layers), "rounds": args.rounds, "mode": "graph",
                                               "user_dir": str(args.user_dir) if args.user_dir else None,
                                               "rows": rows, "fingerprint": fingerprint.collect()})
    print(f"wrote {written}")
    config_tables.print_defaults_notice()
    print(f"{gpu}, {args.preset} TP{args.tp}, context {args.context}: shipped tables (tuned) vs defaults"
          + (" vs the user's tables (retuned)" if args.user_dir else "") + " (gap: slower than tuned by)\n"
          + table(rows))
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
