"""`verifybench record`: a PyTorch profiler trace (Chrome JSON, gzipped) of the suite's own verify forward or
speculative cycle, as an engine's profiler switch would write one, for `verifybench trace` to decompose beside the
suite's direct measurement of the same graphs in the same process.

forward: the forward of n tokens captured as one CUDA graph, replayed --replays times, each replay inside a
record_function range "verify_forward"; with --components, each component's isolated forward too, in ranges
"only-<component>". cycle: --replays whole cycles (harness/model/cycle.py) in ranges "spec_cycle", each phase in a
range of its own name. Beside the trace, <name>.direct.json holds the engine's measurement of each range's graph or
cycle (graph mode, or cycle mode).
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import tempfile
from pathlib import Path

from verifybench.harness.analysis.numbers import MAX_CONTEXT, context_arg, name_list, positive_int, tokens_upto
from verifybench.harness.model.presets import CONTEXT
from verifybench.harness.model.forward import FORWARD_MAX_TOKENS
from verifybench.harness.measure.results import store
from verifybench.harness.measure.timing.timer import cuda_available, measure
from verifybench.harness.measure.timing.capture import graph_capture

RANGE = "verify_forward"
CYCLE_RANGE = "spec_cycle"


def _export(prof, out: Path) -> Path:
    """The trace, gzipped, as a new file (never over an earlier one): returns the path written."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        data = gzip.compress(raw.read_bytes(), mtime=0)
    return store.write_new(out, data)


def _captured(fn):
    import torch

    fn()  # compile and warm before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def record_forward(out: Path, preset: str, tp: int, context: int, tokens: int, replays: int,
                   layers: int | None = None, components: tuple[str, ...] = ()) -> dict:
    """Trace `replays` replays of the captured forward of `tokens` tokens (and of each of `components` alone) into
    `out` (.json.gz); returns the direct measurement of each graph (median us, graph mode) and the trace's path."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from verifybench.harness.model.build import allreduce_stand_in_us, build_forward, release_forwards

    fwd = build_forward(preset, tp, layers, context, allreduce_stand_in_us()[0])
    try:
        bodies = {RANGE: lambda: fwd.forward(tokens)}
        bodies.update({f"only-{c}": (lambda c=c: fwd.forward(tokens, frozenset({c}))) for c in components})
        # graph mode captures the same body into a graph of its own: the direct figure of the traced graph
        direct = {name: measure(fn, mode="graph", calls_per_sample=1, max_time_s=1.0) for name, fn in bodies.items()}
        graphs = {name: _captured(fn) for name, fn in bodies.items()}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for name, g in graphs.items():
                for _ in range(replays):
                    with record_function(name):
                        g.replay()
            torch.cuda.synchronize()
        out = _export(prof, out)
        del graphs
    finally:
        release_forwards()
    return {"trace": str(out), "what": "forward", "tokens": tokens, "replays": replays,
            "direct_median_us": direct[RANGE].median_us, "mode": "graph", "samples": direct[RANGE].summary.n,
            "ranges": {name: {"median_us": m.median_us, "samples": m.summary.n} for name, m in direct.items()}}


def record_cycle(out: Path, preset: str, tp: int, context: int, config: str, attention: str, replays: int,
                 layers: int | None = None) -> dict:
    """Trace `replays` whole cycles, each in a "spec_cycle" range with its phases in ranges of their own, into `out`;
    returns the direct measurement of the cycle and its phases (cycle mode) in the same process."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from verifybench.harness.components.cycle import make_cycle
    from verifybench.harness.model.build import allreduce_stand_in_us, build_forward, release_forwards
    from verifybench.harness.components.cycle import parse_configs
    from verifybench.harness.model.cycle import PHASES

    (cfg,) = parse_configs(config)
    ar_us = allreduce_stand_in_us()[0]
    fwd = build_forward(preset, tp, layers, context, ar_us)
    try:
        cyc = make_cycle(fwd, cfg, attention, ar_us)[0]
        direct = measure(cyc.step, mode="cycle", phases=PHASES, max_time_s=1.5)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                with record_function(CYCLE_RANGE), contextlib.ExitStack() as stack:
                    phase = iter(PHASES)
                    stack.enter_context(record_function(next(phase)))

                    def mark(name, stack=stack, phase=phase):
                        stack.close()  # the phase that just ended
                        following = next(phase, None)
                        if following:
                            stack.enter_context(record_function(following))

                    cyc.step(mark)
            torch.cuda.synchronize()
        out = _export(prof, out)
        del cyc
    finally:
        release_forwards()
    phases = {p: sorted(v["device_us"])[len(v["device_us"]) // 2] for p, v in direct.phases.items()}
    return {"trace": str(out), "what": "cycle", "config": config, "attention": attention, "replays": replays,
            "direct_median_us": direct.median_us, "mode": "cycle", "samples": direct.summary.n,
            "phases_median_us": phases}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="the trace to write (.json.gz)")
    p.add_argument("--preset", default="kimi-k2.5", help="model preset (default kimi-k2.5)")
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel degree (default 8)")
    p.add_argument("--context", type=context_arg, default=CONTEXT, help=f"tokens in the KV cache, 1..{MAX_CONTEXT} "
                   f"(default {CONTEXT})")
    p.add_argument("--tokens", type=tokens_upto(FORWARD_MAX_TOKENS, one=True), default=4,
                   help=f"tokens verified per forward, one count in 1..{FORWARD_MAX_TOKENS} (default 4)")
    p.add_argument("--replays", type=positive_int, default=5, help="forward replays traced (default 5)")
    p.add_argument("--layers", type=positive_int, default=None, help="layers to build (default all)")
    p.add_argument("--what", choices=("forward", "cycle"), default="forward",
                   help="the verify forward (default) or the whole speculative cycle")
    p.add_argument("--components", default="", help="forward: components also traced alone, comma-separated "
                   "(e.g. moe,attn_core), each in a range only-<component>")
    p.add_argument("--config", default="2,1,3", help="cycle: steps,topk,draft_tokens (default 2,1,3)")
    p.add_argument("--attention", choices=("extend", "split_kv"), default="extend",
                   help="cycle: the verify attention (default extend, the engine's)")


def run(args) -> int:
    from verifybench.harness.components import verify
    from verifybench.harness.model import presets

    if not cuda_available():
        raise ValueError("record traces a CUDA graph of the forward: it needs a GPU")
    if not str(args.out).endswith(".json.gz"):
        raise ValueError(f"the trace is written gzipped: give a name ending in .json.gz, got {args.out}")
    presets.get(args.preset, args.tp, args.layers)
    plan = verify.plan_layers(args.preset, args.tp, args.layers, args.context)  # measure/timing/memory.py's rule
    if plan.units == 0:
        raise ValueError(plan.skip)
    if plan.reduced:
        raise ValueError(f"{plan.note}: pass --layers {plan.units} to trace the forward that fits")
    from verifybench.harness.model.forward import COMPONENTS

    comps = tuple(name_list(args.components, "--components", COMPONENTS)) if args.components else ()
    if args.what == "cycle":
        from verifybench.harness.components.cycle import parse_configs

        parse_configs(args.config)
    store.check_writable(args.out.parent)
    if args.what == "cycle":
        info = record_cycle(args.out, args.preset, args.tp, args.context, args.config, args.attention, args.replays,
                            args.layers)
    else:
        info = record_forward(args.out, args.preset, args.tp, args.context, args.tokens, args.replays, args.layers,
                              comps)
    trace = Path(info["trace"])  # the name written: a numbered one when OUT existed
    store.write_json_new(trace.with_name(trace.name.replace(".json.gz", ".direct.json")), info)
    print(json.dumps(info))
    return 0
