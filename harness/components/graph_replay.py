"""CUDA-graph replay component: replay time of straight-line graphs of N tiny kernels (fixed + per-node cost),
the host cost of replay(), the same kernels launched eagerly, and a model-shaped graph at 1..8 tokens.

Run: verifybench graph_replay   or   pytest --benchmark-only microbench/bench_graph_replay.py
"""
from __future__ import annotations

from pathlib import Path

import torch

from verifybench.harness.measure.timing import ceiling, memory
from verifybench.harness.model import presets
from verifybench.harness.model.forward import FORWARD_MAX_TOKENS
from verifybench.harness.analysis.fit import LinearFit, linear_fit
from verifybench.harness.measure.results.store import CPU_TIMING, cpu_numbers, mode_label, withhold_on_cpu
from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec, rel_error
from verifybench.harness.measure.timing.timer import cuda_available
from verifybench.kernels.graph_replay.api import LayerShapes, ModelStack, straight_line, tiny_kernel
from verifybench.harness.measure.timing.capture import graph_capture

NAME = "graph_replay"
HELP = "CUDA-graph replay: fixed + per-node cost, host replay(), eager vs graph, model-shaped graph at 1..8 tokens"
NODE_COUNTS_CUDA = tuple(2**i for i in range(13))  # 1 .. 4096
NODE_COUNTS_CPU = (1, 4, 16, 64, 256)
EAGER_COUNTS = (1, 16, 256)
TOKENS = tuple(range(1, FORWARD_MAX_TOKENS + 1))
STRAIGHT_MAX_TIME_S = 0.5  # 13 points in well under the 10 s the issue allows


def _counter(device: str) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def _capture(x: torch.Tensor, kernels: int) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with graph_capture(g):
        straight_line(x, kernels)
    return g


def _counts(x: torch.Tensor, run, want: int) -> tuple[bool, str]:
    """The check of every case here: run from a zeroed counter; each tiny kernel adds one."""
    x.zero_()
    run()
    got = int(x.item())  # .item() waits for the device
    return got == want, f"counter {got} (want {want})"


def _straight_case(kernels: int, device: str) -> CaseSpec:
    def setup():
        x = _counter(device)

        def check():
            ok, detail = _counts(x, lambda: straight_line(x, kernels), kernels)
            if ok and device == "cuda":  # the captured graph must run every node: two replays add 2N
                g = _capture(x, kernels)
                ok, detail = _counts(x, lambda: (g.replay(), g.replay()), 2 * kernels)
            return ok, detail

        def derive(m):
            return {"kernels": kernels, "replay_us": m.median_us * m.calls_per_sample}

        return (lambda: tiny_kernel(x)), check, derive

    # graph mode with K = N captures exactly the straight-line graph of N nodes; samples are replay / N
    return CaseSpec(f"graph/straight/N{kernels}", {"kernels": kernels, "device": device}, "graph", setup,
                    {"calls_per_sample": kernels, "max_time_s": STRAIGHT_MAX_TIME_S, "device": device})


def _host_replay_case(kernels: int) -> CaseSpec:
    def setup():
        x = _counter("cuda")
        g = _capture(x, kernels)
        return g.replay, (lambda: _counts(x, g.replay, kernels)), lambda m: {"kernels": kernels}

    return CaseSpec(f"graph/host_replay/N{kernels}", {"kernels": kernels}, "host_call", setup,
                    {"max_time_s": STRAIGHT_MAX_TIME_S})


def _eager_case(kernels: int, device: str) -> CaseSpec:
    def setup():
        x = _counter(device)

        def fn():
            straight_line(x, kernels)

        return fn, (lambda: _counts(x, fn, kernels)), lambda m: {"kernels": kernels,
                                                                 "per_kernel_us": m.median_us / kernels}

    return CaseSpec(f"graph/eager/N{kernels}", {"kernels": kernels, "device": device}, "hot", setup,
                    {"max_time_s": STRAIGHT_MAX_TIME_S, "device": device})


def _model_case(stack_factory, tokens: int, mode: str, device: str, label: str, note: str = "") -> CaseSpec:
    def setup(tokens: int):  # the case's params (CaseSpec.prepare): what its record names runs
        stack = stack_factory()
        xs = stack.inputs(tokens)

        def check():
            errs = [rel_error(o, r) for o, r in zip(stack.forward(xs), stack.reference_last_layer(xs))]
            tol = 1e-2 if stack.dtype == torch.bfloat16 else 1e-5
            return max(errs) <= tol, f"max rel_err {max(errs):.2e} (tol {tol:g})"

        def derive(m):
            weight_bytes = stack.shapes.weight_bytes * len(stack.weights)
            return {"tokens": tokens, "kernels": stack.kernels_per_forward, "layers": len(stack.weights),
                    "weight_bytes": weight_bytes, "gbps": ceiling.gbps(weight_bytes, m.median_us),
                    "eta": ceiling.eta(weight_bytes, m.median_us, ceiling.copy_gbps(device)),
                    **({"memory_note": note} if note else {})}

        return (lambda: stack.forward(xs)), check, derive

    return CaseSpec(f"graph/model/{label}/n{tokens}/{mode}", {"tokens": tokens, "device": device, "model": label},
                    mode, setup, {"calls_per_sample": 1, "device": device} if mode == "graph" else {"device": device})


def cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None = None,
          layers: int | None = None) -> list[CaseSpec]:
    device = "cuda" if cuda_available() else "cpu"
    p = presets.get(preset, tp)
    shapes = LayerShapes(p.projections())
    layers = layers or (p.moe_layers if device == "cuda" else 2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # the model-shaped stack: as many layers as fit the free memory (measure/timing/memory.py), said in its label
    plan = memory.plan(lambda n_layers: n_layers * shapes.weight_bytes * dtype.itemsize // 2, layers, 1,
                       f"the {p.name} TP{tp} model-shaped graph", "layers", device)
    layers = plan.units or layers
    stack: list[ModelStack] = []

    def shared_stack() -> ModelStack:  # one set of weights for all token counts, built on first use
        if plan.units == 0:
            raise CaseSkipped(plan.skip)
        if not stack:
            stack.append(ModelStack(shapes, layers, device, dtype))
        return stack[0]

    label = f"{p.name}-tp{tp}-L{layers}"
    counts = NODE_COUNTS_CUDA if device == "cuda" else NODE_COUNTS_CPU
    out = [_straight_case(n, device) for n in counts]
    if device == "cuda":
        out += [_host_replay_case(n) for n in counts]
    out += [_eager_case(n, device) for n in EAGER_COUNTS]
    tokens = tokens or TOKENS
    out += [_model_case(shared_stack, n, "graph", device, label, plan.note) for n in tokens]
    out += [_model_case(shared_stack, n, "hot", device, label, plan.note) for n in sorted({min(tokens), max(tokens)})]
    return out


def replay_fit(records: list[dict]) -> LinearFit:
    """Replay time (us) of the straight-line graphs vs node count: fixed cost a + per-node cost b."""
    pts = [(r["derived"]["kernels"], r["derived"]["replay_us"]) for r in records
           if r["name"].startswith("graph/straight/") and r["check"]["ok"]]
    return linear_fit(*zip(*pts))


def launch_floor_us(kernel_count: int, fit: LinearFit) -> float:
    """Predicted replay time of a graph of `kernel_count` nodes whose kernels take no time of their own."""
    return fit.predict(kernel_count)


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    ok = [r for r in records if r["check"]["ok"]]
    by = {r["name"]: r for r in ok}
    straight = [r for r in ok if r["name"].startswith("graph/straight/")]
    rows = []
    for r in straight:
        n = r["derived"]["kernels"]
        host = by.get(f"graph/host_replay/N{n}")
        rows.append({"nodes": n, "replay_us": r["derived"]["replay_us"], "per_node_us": r["summary"]["median_us"],
                     "host_replay_call_us": host["summary"]["median_us"] if host else None})
    out = [("straight-line graphs of N tiny kernels (" + ("CPU: a loop of N calls, no graph" if straight and
            straight[0]["device"] == "cpu" else "device time of one replay; host time of the replay() call") + ")",
            rows)]
    cpu = cpu_numbers(records)
    if len(straight) >= 3:
        f = replay_fit(records)
        fit_row = {"fixed_us": f.a, "fixed_ci_us": f.a_halfwidth, "per_node_us": f.b, "per_node_ci_us": f.b_halfwidth,
                   "per_node_ci_%": 100 * f.b_halfwidth / f.b if f.b else None, "r2": f.r2,
                   # on CPU the fit is withheld: how long it took to measure would be all the table said
                   **({} if cpu else {"measured_in_s": sum(r["wall_s"] for r in straight)})}
        out.append(("fit: replay_us = fixed + per_node * N (95% CI)" + (
            "; CPU numbers: a loop of calls, no graph: says nothing of a GPU's replay cost" if cpu else ""),
            withhold_on_cpu(records, [fit_row], lambda k: k != "measured_in_s")))
    eager = [{"kernels": r["derived"]["kernels"], "eager_per_kernel_us": r["derived"]["per_kernel_us"]}
             for r in ok if r["name"].startswith("graph/eager/")]
    out.append(("eager launches (hot, events): per-kernel cost", eager))
    model = [{"tokens": r["derived"]["tokens"], "mode": mode_label(r), "kernels": r["derived"]["kernels"],
              "layers": r["derived"]["layers"], "time_us": r["summary"]["median_us"],
              "weight_GB/s": r["derived"]["gbps"], "eta": r["derived"]["eta"],
              **({"note": r["derived"]["memory_note"]} if r["derived"].get("memory_note") else {})}
             for r in ok if r["name"].startswith("graph/model/")]
    out.append(("model-shaped graph (per-layer projection GEMMs, distinct weights per layer)"
                + (f"; {CPU_TIMING}" if cpu else ""),
                withhold_on_cpu(records, model, ("eta", "weight_GB/s"))))
    return out


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    return []


def release() -> None:
    """Each case's setup owns its stack; nothing is cached at module level."""
