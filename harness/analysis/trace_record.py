"""`verifybench record`: a PyTorch profiler trace (Chrome JSON, gzipped) of the suite's own verify forward, as an
engine's profiler switch would write one, for `verifybench trace` to decompose beside the suite's direct
measurement of the same forward.

The forward of n tokens is captured as one CUDA graph and replayed --replays times, each replay inside a
record_function range named "verify_forward" (so `verifybench trace --cycle-range verify_forward` finds one cycle per
replay), and timed in the same process with the engine (graph mode) for the direct figure.
"""
from __future__ import annotations

import argparse
import gzip
import json
import tempfile
from pathlib import Path

from verifybench.harness.analysis.numbers import positive_int
from verifybench.harness.engine import results
from verifybench.harness.engine.timing import cuda_available, measure

RANGE = "verify_forward"


def record_forward(out: Path, preset: str, tp: int, context: int, tokens: int, replays: int,
                   layers: int | None = None) -> dict:
    """Trace `replays` replays of the captured forward of `tokens` tokens into `out` (.json.gz); returns the direct
    measurement of the same graph (median us, graph mode) and the trace's path."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from verifybench.harness.model.build import allreduce_stand_in_us, build_forward, release_forwards

    fwd = build_forward(preset, tp, layers, context, allreduce_stand_in_us()[0])
    try:
        fwd.forward(tokens)  # compile and warm before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fwd.forward(tokens)
        graph.replay()
        torch.cuda.synchronize()
        direct = measure(graph.replay, mode="graph", calls_per_sample=1, max_time_s=1.0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                with record_function(RANGE):
                    graph.replay()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            data = gzip.compress(raw.read_bytes(), mtime=0)
        results.write_atomic(out, lambda f: f.write(data))
        del graph
    finally:
        release_forwards()
    return {"trace": str(out), "tokens": tokens, "replays": replays, "direct_median_us": direct.median_us,
            "mode": direct.mode, "samples": direct.summary.n}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="the trace to write (.json.gz)")
    p.add_argument("--preset", default="kimi-k2.5", help="model preset (default kimi-k2.5)")
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel degree (default 8)")
    p.add_argument("--context", type=positive_int, default=4096, help="tokens in the KV cache (default 4096)")
    p.add_argument("--tokens", type=positive_int, default=4, help="tokens verified per forward (default 4)")
    p.add_argument("--replays", type=positive_int, default=5, help="forward replays traced (default 5)")
    p.add_argument("--layers", type=positive_int, default=None, help="layers to build (default all)")


def run(args) -> int:
    from verifybench.harness.components import verify
    from verifybench.harness.model import presets

    if not cuda_available():
        raise ValueError("record traces a CUDA graph of the forward: it needs a GPU")
    if not str(args.out).endswith(".json.gz"):
        raise ValueError(f"the trace is written gzipped: give a name ending in .json.gz, got {args.out}")
    presets.get(args.preset, args.tp, args.layers)
    if args.tokens > verify.MAX_TOKENS:
        raise ValueError(f"--tokens: the forward runs n = 1..{verify.MAX_TOKENS}, got {args.tokens}")
    plan = verify.plan_layers(args.preset, args.tp, args.layers, args.context)  # engine/memory.py's rule
    if plan.units == 0:
        raise ValueError(plan.skip)
    if plan.reduced:
        raise ValueError(f"{plan.note}: pass --layers {plan.units} to trace the forward that fits")
    results.check_writable(args.out.parent)
    info = record_forward(args.out, args.preset, args.tp, args.context, args.tokens, args.replays, args.layers)
    results.write_json_atomic(args.out.with_name(args.out.name.replace(".json.gz", ".direct.json")), info)
    print(json.dumps(info))
    return 0
