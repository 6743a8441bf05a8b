"""Where the verify forward's device time goes, per kernel: one eager Kimi-K2.5 TP8 forward at n tokens under the
torch profiler (CUPTI kernel records: device durations, no launch gaps), summed by kernel name, with each kernel's
share and count per layer. Eager launches are spaced out by the host, so durations do not overlap (PDL off).
Usage: python3 scripts/verify_profile.py [N] [OUT_JSON]
"""
import json
import sys

import torch
from tabulate import tabulate

from kernels import pdl
from microbench.bench_verify import CONTEXT, REFERENCE_ALLREDUCE_US, _forward


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    fwd = _forward("kimi-k2.5", 8, None, CONTEXT, REFERENCE_ALLREDUCE_US)
    layers = fwd.s.layers
    with pdl.forced(False):
        fwd.forward(n)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd.forward(n)
            torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            by_name.setdefault(e.name, []).append(e.device_time)
    total = sum(sum(v) for v in by_name.values())
    rows = sorted(({"kernel": k[:60], "calls": len(v), "per_layer": len(v) / layers, "total_us": sum(v),
                    "mean_us": sum(v) / len(v), "share_%": 100 * sum(v) / total} for k, v in by_name.items()),
                  key=lambda r: -r["total_us"])
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump({"n": n, "layers": layers, "kernel_us_total": total, "rows": rows}, f, indent=1)
    print(f"n={n}: {sum(r['calls'] for r in rows)} kernels, {total:.0f} us of kernel time "
          f"({sum(r['calls'] for r in rows) / layers:.1f} kernels per layer)")
    print(tabulate(rows[:25], headers="keys", floatfmt=".4g"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
