"""What-if: a stored verify decomposition moved onto another GPU described by numbers, as a labelled PROJECTION
range per n (not a measurement). A weight-reading part scales by the copy-bandwidth ratio one of two ways: the whole
part scales (it keeps its eta there), or only its ideal streaming time bytes / copy bandwidth does and the rest
(launches, latency, under-filled SMs) stays; low is the smaller of the two, high the larger, on a faster or a slower
GPU alike (a part already faster than its bytes at copy speed, eta > 1, has no overhead to keep: it scales whole,
and on the same GPU every part projects to itself). A target given as ranges (copy bandwidth, allreduce latency)
widens that: low takes the fast end of both (high copy, low latency), high the slow end. The allreduces are replaced
by the target's latency; parts without bytes (norms) stay as measured.

The copy figure is read + write, as ours: a large device-to-device copy, bytes read + bytes written, per second
(`verifybench baseline` measures it; typically 0.85-0.9x of the memory's datasheet bandwidth). Pass a figure measured
that way, not the datasheet's.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from verifybench.harness.analysis.decompose import Gpu, project
from verifybench.harness.analysis.numbers import MAX_GBPS, finite_float
from verifybench.harness.model.build import MAX_ALLREDUCE_US
from verifybench.harness.measure.results import result_files, store
from verifybench.harness.measure.host.fingerprint import gpu_model
from verifybench.harness.measure.results.store import (BYTES_TABLE, COUNT, COUNT_OR_NULL, NONNEGATIVE, POSITIVE, TEXT,
                                                       Need)
from verifybench.harness.model import presets

# what project reads from each passing case of a verify result, checked when the file is read
NEEDS = {"verify": (
    Need({"params.variant": TEXT, "params.tokens": COUNT}),
    Need({"params.preset": TEXT, "params.tp": COUNT, "params.layers": COUNT_OR_NULL, "derived.copy_gbps": POSITIVE,
          "derived.allreduce_stand_in_us": NONNEGATIVE, "derived.component_bytes": BYTES_TABLE},
         where=lambda c: c["params"].get("variant") == "full"),
)}


@dataclass(frozen=True)
class Target:
    copy_gbps: tuple[float, float]  # read + write, (low, high)
    allreduce_us: tuple[float, float]  # per call at verify sizes, (low, high)
    source: str


TARGETS = {
    "rtx-pro-6000-pcie-tp8": Target(
        (1600.0, 1790.0), (25.0, 60.0),
        "8x RTX PRO 6000 Blackwell over PCIe Gen5, no NVLink: 96 GB GDDR7 at 1.79 TB/s datasheet; copy (read + "
        "write) from 1.6 TB/s (0.9x, as an H200's copy reaches 0.87x of its datasheet) up to the 1.79 TB/s "
        "ceiling; allreduce: NCCL over PCIe at 14-112 KiB, 25-60 us per call (26 us tuned and 48 us untuned "
        "reported for 32 KB on such boxes). ASSUMED, not measured: measure yours with `verifybench "
        "baseline` and torchrun -m verifybench.harness.multigpu.allreduce, and pass --copy-gbps / --allreduce-us"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", type=Path, help="a verify result file of a GPU run (verifybench verify / run), or a "
                   "results folder (its latest verify result)")
    p.add_argument("--target", choices=sorted(TARGETS), default=None,
                   help="a named GPU (its figures are stated assumptions; --copy-gbps/--allreduce-us override them)")
    p.add_argument("--name", default=None, help="what to call the other GPU")
    p.add_argument("--copy-gbps", type=finite_float(0, MAX_GBPS, exclusive=True), default=None,
                   help="its device-to-device copy bandwidth in GB/s, bytes read + written counted, as ours "
                        "(not the datasheet's read bandwidth)")
    p.add_argument("--allreduce-us", type=finite_float(0, MAX_ALLREDUCE_US), default=None,
                   help="its allreduce latency per call at verify sizes (us)")


def target_ranges(args) -> tuple[tuple[float, float], tuple[float, float], str]:
    """(copy low/high, allreduce low/high, source): the named target's, with single given figures over them."""
    t = TARGETS[args.target] if args.target else None
    copy = (args.copy_gbps,) * 2 if args.copy_gbps is not None else (t.copy_gbps if t else None)
    ar = (args.allreduce_us,) * 2 if args.allreduce_us is not None else (t.allreduce_us if t else None)
    if copy is None or ar is None:
        raise ValueError("give --target, or both --copy-gbps and --allreduce-us")
    given = args.copy_gbps is not None or args.allreduce_us is not None
    source = (t.source if t else "") + ("; " if t and given else "") + ("given on the command line" if given else "")
    return copy, ar, source


def streamable_bytes(parts: dict, nbytes: dict, here: Gpu) -> dict:
    """Bytes capped at what the copy bandwidth streams in the part's measured time. A part faster than its bytes at
    copy speed (eta > 1: a read-only kernel beats a read + write copy, or the byte count is high) is all streaming:
    uncapped, its "rest stays" end would keep a negative overhead as zero and come out slower than scaling the
    whole part, even on the same GPU."""
    return {k: min(b, parts[k] * here.copy_gbps * 1e3) if k in parts else b for k, b in nbytes.items()}


def project_range(parts: dict, nbytes: dict, here: Gpu, name: str, copy: tuple, ar: tuple,
                  allreduces: int) -> tuple[float, float]:
    """(low, high) of the whole forward: low from the fast end (high copy, low latency), high from the slow end."""
    nbytes = streamable_bytes(parts, nbytes, here)
    fast = project(parts, nbytes, here, Gpu(name, max(copy), min(ar)), allreduces)
    slow = project(parts, nbytes, here, Gpu(name, min(copy), max(ar)), allreduces)
    low = sum(min(fast[k][0], slow[k][0]) for k in parts)
    high = sum(max(fast[k][1], slow[k][1]) for k in parts)
    return low, high


def _span(r: tuple[float, float]) -> str:
    return f"{r[0]:g}" if r[0] == r[1] else f"{r[0]:g}-{r[1]:g}"


def run(args) -> int:
    copy, ar, source = target_ranges(args)
    name = args.name or args.target or "target GPU"
    path, note = result_files.pick_input(args.result, ("verify",), "RESULT")
    if note:
        print(note)
    run_ = store.load_run(path, NEEDS, "project", gpu_only=True)
    fp = run_["fingerprint"]
    cases = [c for c in run_["cases"] if c["check"]["ok"]]
    iso = {(c["params"]["variant"], c["params"]["tokens"]): c["summary"]["median_us"] for c in cases}
    rows = []
    for c in sorted((c for c in cases if c["params"]["variant"] == "full"), key=lambda c: c["params"]["tokens"]):
        n, d, prm = c["params"]["tokens"], c["derived"], c["params"]
        layers = prm["layers"] or presets.get(prm["preset"], prm["tp"]).layers
        parts = {k[0][len("only-"):]: v for k, v in iso.items() if k[1] == n and k[0].startswith("only-")}
        here = Gpu(gpu_model(fp), d["copy_gbps"], d["allreduce_stand_in_us"])
        low, high = project_range(parts, d["component_bytes"], here, name, copy, ar, allreduces=2 * layers)
        rows.append({"n": n, f"measured_us ({here.name})": c["summary"]["median_us"],
                     "sum_of_parts_us": sum(parts.values()), "projected_low_us": low, "projected_high_us": high})
    if not rows:
        raise ValueError(f"{path}: no passing 'full' verify case to project")
    print(f"PROJECTION (not a measurement) of {path} onto {name}: copy {_span(copy)} GB/s (read + write), "
          f"allreduce {_span(ar)} us per call; figures: {source}.")
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    return 0
