"""Host CPU speed probe: a fixed pure-interpreter workload, timed with perf_counter beside the real samples.

Eager launch rate, `replay()` cost and sync round trips are CPU work. On the lent H200 VMs the CPU runs in two
states, fast and about 1.7x slower, flipping every 0.05-4 s with load we cannot see (other guests on the same
cores); host-timed figures follow the probe (Spearman rho ~0.7), so a run's host-timed medians were a mix of the
two states in proportions that differed run to run.

HostGate keeps a batch of samples only when the probe read the fast state before and after it: host-timed figures
are then the host's cost at full speed, reproducible between runs, and each case records how many batches it
dropped (VERIFYBENCH_HOST_GATE=off keeps every batch). `compare` also shows how far the probe moved (host_%).

`python3 -m harness.hostprobe --seconds S` samples the probe (and, on a GPU, the host cost of replaying a one-node
CUDA graph) over time and prints how much the host's speed wanders in this process.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

FIGURES = ("probe_us", "replay_us", "eager_us")
PROBE_ITERS = 2000  # about 40-80 us of interpreter work on the CPUs we run on


def _work(iters: int) -> int:
    acc = 0
    for i in range(iters):
        acc += i * i
    return acc


def probe_us(reps: int = 5) -> float:
    """Median microseconds of `reps` runs of the fixed loop: the host's current speed for interpreter work."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _work(PROBE_ITERS)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


SLOW_FACTOR = 1.4  # fast state ~85-105 us, slow ~130-170 us on the lent VMs: 1.4x the fastest read splits them
CALIBRATE_S = 0.3  # first read of a process: probe this long for the fast-state reference (fast spells: ~0.2 s)
GATE_ENV = "VERIFYBENCH_HOST_GATE"


class HostGate:
    """Says whether the host is in its fast state: probe <= SLOW_FACTOR x the fastest probe this process has read."""

    def __init__(self, probe=probe_us, factor: float = SLOW_FACTOR, calibrate_s: float = CALIBRATE_S):
        self.probe, self.factor, self.calibrate_s = probe, factor, calibrate_s
        self.ref_us = math.inf

    def read(self) -> tuple[float, bool]:
        """(probe us, fast?). The first read probes for calibrate_s to find the fast state's level."""
        if self.ref_us == math.inf:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < self.calibrate_s or self.ref_us == math.inf:
                self.ref_us = min(self.ref_us, self.probe())
        p = self.probe()
        self.ref_us = min(self.ref_us, p)
        return p, p <= self.factor * self.ref_us


_process_gate: HostGate | None = None


def process_gate() -> HostGate | None:
    """The process-wide gate (one fast-state reference per process), or None when VERIFYBENCH_HOST_GATE=off."""
    global _process_gate
    setting = os.environ.get(GATE_ENV, "on").strip().lower()
    if setting not in ("on", "off"):
        raise ValueError(f"{GATE_ENV} must be on or off, got {setting!r}")
    if setting == "off":
        return None
    if _process_gate is None:
        _process_gate = HostGate()
    return _process_gate


def series(seconds: float, gpu: bool) -> list[dict]:
    """Every ~50 ms: the probe and, on a GPU, two host-bound figures through the engine: the host cost of
    replay() of a one-node graph (median of 10, host_call) and the eager launch rate of a tiny kernel (hot, 64
    calls per sample, median of 3)."""
    from harness import timing

    if gpu:
        import torch

        from kernels.graph_replay import tiny_kernel

        x = torch.zeros(1, dtype=torch.int64, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tiny_kernel(x)
    rows, t_start = [], time.perf_counter()
    while time.perf_counter() - t_start < seconds:
        row = {"t_s": time.perf_counter() - t_start, "probe_us": probe_us()}
        if gpu:
            # fixed sample counts: the engine's host gate stays off, this series is the ungated truth
            row["replay_us"] = timing.measure(graph.replay, mode="host_call", samples=10, warmup_calls=1).median_us
            row["eager_us"] = timing.measure(lambda: tiny_kernel(x), mode="hot", samples=3, calls_per_sample=64,
                                             warmup_calls=1).median_us
        rows.append(row)
        time.sleep(0.05)
    return rows


def summarize_series(rows: list[dict]) -> dict:
    """Spread of each column over time (p10/median/p90, p90/p10), and how the replay cost follows the probe."""
    import numpy as np
    from scipy import stats

    out = {"slots": len(rows)}
    for key in FIGURES:
        vals = np.asarray([r[key] for r in rows if key in r], dtype=float)
        if len(vals):
            p10, med, p90 = np.percentile(vals, [10, 50, 90])
            out[key] = {"p10": p10, "median": med, "p90": p90, "p90_over_p10": p90 / p10}
    for key in FIGURES[1:]:
        if key in out and len(rows) >= 3:
            rho, p = stats.spearmanr([r["probe_us"] for r in rows], [r[key] for r in rows])
            out[f"spearman_probe_{key}"] = {"rho": float(rho), "p": float(p)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m harness.hostprobe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="how long to sample (default 20)")
    ap.add_argument("--json", type=Path, help="write the series and its summary here")
    args = ap.parse_args(argv)
    if not 0 < args.seconds <= 3600:
        ap.error("--seconds must be in (0, 3600]")
    import torch

    from harness import fingerprint, hostpin
    from harness.results import write_json_atomic

    pin = hostpin.pin()
    rows = series(args.seconds, gpu=torch.cuda.is_available())
    summary = summarize_series(rows)
    if args.json:
        write_json_atomic(args.json, {"host_pin": pin, "fingerprint": fingerprint.collect(), "summary": summary,
                                      "series": rows})
    print(f"host pin: {pin.get('cpu')} ({pin.get('reason')}); {summary['slots']} slots over {args.seconds:g} s")
    for key in FIGURES:
        if key in summary:
            s = summary[key]
            print(f"{key:10s} p10 {s['p10']:8.2f}  median {s['median']:8.2f}  p90 {s['p90']:8.2f}  "
                  f"p90/p10 {s['p90_over_p10']:.2f}")
        if f"spearman_probe_{key}" in summary:
            s = summary[f"spearman_probe_{key}"]
            print(f"{'':10s} follows the probe: Spearman rho {s['rho']:.2f} (p={s['p']:.2g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
