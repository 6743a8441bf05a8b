"""Side-by-side A/B of the verify forward's early-PDL and fusion choices in one process: the full Kimi-K2.5 TP8
one-rank forward (graph mode, the suite's timing engine, fused ops, PDL on) at a few n with each choice switched
off alone, rounds interleaved so that drift hits every variant alike. An experiment tool for deciding what to keep;
the committed figures come from `verifybench run`.
Variants: now; moe_late (the experts' gate_up waits before it computes); keys_late (attention's first key tile after
the wait); qkv_reduce (the qkv GEMM reduces its split-K in its own launch, mla_prep reads y).
Usage: python3 scripts/verify_ab.py [TOKENS=1,4,8] [ROUNDS=2] [OUT_JSON]
"""
import dataclasses
import json
import statistics
import sys

import torch
from tabulate import tabulate

from harness import fingerprint
from harness.timing import measure
from microbench.bench_verify import CONTEXT, REFERENCE_ALLREDUCE_US, _forward


def variants(fwd):
    ops, moe = fwd.ops, fwd.moe_fn
    late_moe = lambda *a, add=None, early=False: moe(*a, add=add, early=False)  # noqa: E731
    late_keys = lambda *a, early_keys=False: ops.mla(*a, early_keys=False)  # noqa: E731
    return {"now": (ops, moe), "moe_late": (ops, late_moe),
            "keys_late": (dataclasses.replace(ops, mla=late_keys), moe),
            "qkv_reduce": (dataclasses.replace(ops, linear_partials=ops.linear), moe)}


def main() -> int:
    tokens = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1,4,8").split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    fwd = _forward("kimi-k2.5", 8, None, CONTEXT, REFERENCE_ALLREDUCE_US)
    base_ops, base_moe = fwd.ops, fwd.moe_fn
    runs: dict[tuple, list[float]] = {}
    try:
        for _ in range(rounds):
            for name, (ops, moe) in variants(fwd).items():
                fwd.ops, fwd.moe_fn = ops, moe
                for n in tokens:
                    ref = fwd.forward(n)[0].clone()  # eager, then the same predictions from the graph
                    m = measure(lambda: fwd.forward(n), mode="graph", calls_per_sample=1, max_time_s=0.6)
                    same = torch.equal(fwd.forward(n)[0], ref)
                    runs.setdefault((name, n), []).append(m.median_us)
                    if not same:
                        print(f"WARNING {name} n={n}: predictions differ between eager and graph")
    finally:
        fwd.ops, fwd.moe_fn = base_ops, base_moe
    rows = []
    for (name, n), us in runs.items():
        now = statistics.median(runs[("now", n)])
        rows.append({"variant": name, "n": n, "median_us": statistics.median(us), "rounds_us": us,
                     "vs_now_%": 100 * (statistics.median(us) / now - 1)})
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump({"tokens": tokens, "rounds": rounds, "fingerprint": fingerprint.collect(), "rows": rows}, f,
                      indent=1, default=str)
    print(tabulate(sorted(rows, key=lambda r: (r["n"], r["variant"])), headers="keys", floatfmt=".4g"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
