"""What-if: a stored verify decomposition moved onto another GPU described by numbers, as a labelled PROJECTION
range per n (not a measurement). Weight-reading parts scale by the copy-bandwidth ratio: low = only the ideal
streaming time bytes / copy bandwidth scales and the rest (launches, latency, under-filled SMs) stays; high = the
whole part scales (it keeps its eta there). For a slower GPU the scaled part is the larger one: low <= high always.
The allreduces are replaced by the given latency; parts without bytes (norms) stay as measured.

Copy bandwidth is the suite's definition: a large device-to-device copy, bytes read + bytes written, per second
(`verifybench baseline` measures it; it is about 0.85-0.9x the memory's datasheet bandwidth x 1 for reads alone).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tabulate import tabulate

from verifybench.harness.analysis.decompose import Gpu, project
from verifybench.harness.analysis.numbers import finite_float
from verifybench.harness.engine import results
from verifybench.harness.model import presets

# Named targets: (copy GB/s read + write, allreduce us per call at verify sizes, where the figures come from)
TARGETS = {
    "rtx-pro-6000-pcie-tp8": (1600.0, 30.0, "RTX PRO 6000 Blackwell, 96 GB GDDR7 at 1.79 TB/s datasheet: copy "
                              "assumed 0.9x of it; allreduce: NCCL over PCIe Gen5 at 14-112 KiB, 26-48 us reported "
                              "for 32 KB with and without NCCL tuning on such boxes, 30 us taken. ASSUMED, not "
                              "measured: measure yours with `verifybench baseline` and torchrun -m "
                              "verifybench.harness.dist.allreduce, and pass --copy-gbps / --allreduce-us"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a verify result file (verifybench verify / run)")
    p.add_argument("--target", choices=sorted(TARGETS), default=None,
                   help="a named GPU (its figures are stated assumptions; --copy-gbps/--allreduce-us override them)")
    p.add_argument("--name", default=None, help="what to call the other GPU")
    p.add_argument("--copy-gbps", type=finite_float(0, exclusive=True), default=None,
                   help="its device-to-device copy bandwidth in GB/s, bytes read + written counted (as ours)")
    p.add_argument("--allreduce-us", type=finite_float(0), default=None,
                   help="its allreduce latency per call at verify sizes (us)")


def run(args) -> int:
    copy, ar, source = TARGETS[args.target] if args.target else (None, None, "given on the command line")
    copy = args.copy_gbps if args.copy_gbps is not None else copy
    ar = args.allreduce_us if args.allreduce_us is not None else ar
    if copy is None or ar is None:
        raise ValueError("give --target, or both --copy-gbps and --allreduce-us")
    name = args.name or args.target or "target GPU"
    run_ = results.load_run(args.result)
    if run_["component"] != "verify":
        raise ValueError(f"{args.result}: a verify result is needed (verifybench verify), got {run_['component']!r}")
    if run_["fingerprint"].get("gpu_model") == "cpu" or not run_["fingerprint"].get("cuda_available", True):
        raise ValueError(f"{args.result}: a CPU smoke run; its numbers are CPU numbers and cannot be projected")
    cases = [c for c in run_["cases"] if c["check"]["ok"]]
    iso = {(c["params"]["variant"], c["params"]["tokens"]): c["summary"]["median_us"] for c in cases}
    rows = []
    for c in sorted((c for c in cases if c["params"]["variant"] == "full"), key=lambda c: c["params"]["tokens"]):
        n, d, prm = c["params"]["tokens"], c["derived"], c["params"]
        layers = prm["layers"] or presets.get(prm["preset"], prm["tp"]).layers
        parts = {k[0][len("only-"):]: v for k, v in iso.items() if k[1] == n and k[0].startswith("only-")}
        here = Gpu(run_["fingerprint"]["gpu_model"], d["copy_gbps"], d["allreduce_stand_in_us"])
        there = Gpu(name, copy, ar)
        proj = project(parts, d["component_bytes"], here, there, allreduces=2 * layers)
        rows.append({"n": n, f"measured_us ({here.name})": c["summary"]["median_us"],
                     "sum_of_parts_us": sum(parts.values()), "projected_low_us": sum(lo for lo, _ in proj.values()),
                     "projected_high_us": sum(hi for _, hi in proj.values())})
    if not rows:
        raise ValueError(f"{args.result}: no passing 'full' verify case to project")
    print(f"PROJECTION (not a measurement) of {args.result} onto {name}: copy {copy:g} GB/s (read + write), "
          f"allreduce {ar:g} us per call; figures {source}.")
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    return 0
