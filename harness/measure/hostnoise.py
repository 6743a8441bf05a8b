"""How much this host's CPU speed wanders: the hostprobe loop every ~50 ms and, on a GPU, the host cost of
`replay()` of a one-node graph and of an eager launch, with their spread and how they follow the probe."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from verifybench.harness.measure.timing import timer
from verifybench.harness.measure.host.hostprobe import probe_us
from verifybench.harness.measure.timing.capture import graph_capture

FIGURES = ("probe_us", "replay_us", "eager_us")


def series(seconds: float, gpu: bool) -> list[dict]:
    """Every ~50 ms: the probe and, on a GPU, two host-bound figures through the engine: the host cost of
    replay() of a one-node graph (median of 10, host_call) and the eager launch rate of a tiny kernel (hot, 64
    calls per sample, median of 3)."""
    if gpu:
        import torch

        from verifybench.kernels.graph_replay.api import tiny_kernel

        x = torch.zeros(1, dtype=torch.int64, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            tiny_kernel(x)
    rows, t_start = [], time.perf_counter()
    while time.perf_counter() - t_start < seconds:
        row = {"t_s": time.perf_counter() - t_start, "probe_us": probe_us()}
        if gpu:
            # fixed sample counts: the engine's host gate stays off, this series is the ungated truth
            row["replay_us"] = timer.measure(graph.replay, mode="host_call", samples=10, warmup_calls=1).median_us
            row["eager_us"] = timer.measure(lambda: tiny_kernel(x), mode="hot", samples=3, calls_per_sample=64,
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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seconds", type=float, default=20.0, help="how long to sample, in (0, 3600] (default 20)")
    ap.add_argument("--json", type=Path, help="write the series and its summary here")


def run(args) -> int:
    if not 0 < args.seconds <= 3600:  # NaN fails this too
        raise ValueError(f"--seconds must be in (0, 3600], got {args.seconds}")
    import torch

    from verifybench.harness.measure.host import fingerprint, hostpin
    from verifybench.harness.measure.results.store import check_writable, write_json_new

    if args.json:  # before sampling, not after
        if args.json.is_dir():
            raise ValueError(f"--json {args.json}: a folder, not a file name")
        check_writable(args.json.parent)
    pin = hostpin.pin()
    rows = series(args.seconds, gpu=torch.cuda.is_available())
    summary = summarize_series(rows)
    if args.json:
        written = write_json_new(args.json, {"host_pin": pin, "fingerprint": fingerprint.collect(),
                                             "summary": summary, "series": rows})
        print(f"wrote {written}")
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

