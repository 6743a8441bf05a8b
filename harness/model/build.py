"""Builds the synthetic verify forward for a preset on this machine: the routed-expert kernel, the small-op set,
the tree verify and the allreduce (a calibrated device wait on one GPU), cached per configuration.
"""
from __future__ import annotations

import contextlib
import math

import torch

from verifybench.harness.measure.timing.runner import release_unreferenced
from verifybench.harness.measure.timing.timer import cuda_available, measure
from verifybench.harness.model import presets
from verifybench.harness.model.forward import TORCH_OPS, VerifyForward, fused_ops
from verifybench.kernels.common import settings
from verifybench.kernels.moe_int4.reference import reference_moe_w4a16

# The stand-in allreduce when no measured figure is given: NCCL's all_reduce_perf, graph mode, 2xH200
REFERENCE_ALLREDUCE_US = 7.7


def device_wait(us: float):
    """A device-side wait of `us` microseconds (torch.cuda._sleep, calibrated here in a graph): the one-GPU
    stand-in for an allreduce of that latency."""
    probe = 200_000
    t = measure(lambda: torch.cuda._sleep(probe), mode="graph", calls_per_sample=8, max_time_s=0.3)
    cycles = max(1, int(probe * us / t.median_us))
    return lambda tensor: torch.cuda._sleep(cycles)


def chain_verify(device: str):
    from verifybench.kernels.tree.api import verify_tree_greedy

    backend = "kernel" if device == "cuda" else "reference"
    lists = {}

    def verify(candidates, predict):
        b, n = candidates.shape  # B requests' chains, each over its own rows of predict
        if (b, n) not in lists:
            idx = torch.arange(b * n, device=device).view(b, n)
            step = torch.arange(1, n + 1, device=device).view(1, n).expand(b, n)
            lists[b, n] = (idx, torch.where(step < n, step, -1).contiguous(), torch.full_like(idx, -1))
        idx, nxt, sib = lists[b, n]
        return verify_tree_greedy(candidates, idx, nxt, sib, predict, n, backend=backend)

    return verify


def moe_fn(device: str):
    """The routed experts. On CUDA the Triton kernel reads the random weights as already repacked (`prepacked`):
    a whole rank's experts (~71 GB for K2.5 TP8) then fit once, with no cached second copy."""
    if device == "cuda":
        from verifybench.kernels.moe_int4.configs import select_config
        from verifybench.kernels.moe_int4.api import fused_moe_w4a16

        def moe(x, *rest):  # the tuned config for this n, in the layout the weights were generated in
            cfg = {**select_config(x.shape[0], x.device), "layout": "planar"}
            return fused_moe_w4a16(x, *rest, check_ids=False, prepacked=True, config=cfg)

        return moe
    return reference_moe_w4a16


def as_checkpoint(packed, device: str, group_size: int):
    """The reference reads the checkpoint nibble order; on CUDA the forward's weights are in the kernel's."""
    if device != "cuda":
        return packed
    from verifybench.kernels.moe_int4.api import checkpoint_from_planar

    return checkpoint_from_planar(packed, group_size)


_FORWARD: dict = {}  # the one forward kept, by its arguments


def build_forward(preset: str, tp: int, layers: int | None, context: int, allreduce_us: float,
                  batch: int = 1) -> VerifyForward:
    """The forward of one rank of `preset` at TP `tp` (`layers` layers, None: all) over `context` cached tokens of
    each of up to `batch` requests (at_batch picks fewer), on this machine's device; one at a time is kept (a K2.5 TP8
    rank holds ~75 GB), and the one kept is let go *before* another is built: two side by side do not fit even on an
    H200 (a cycle over two contexts ran out of memory so)."""
    key = (preset, tp, layers, context, allreduce_us, batch)
    if key not in _FORWARD:
        release_forwards()
        device = "cuda" if cuda_available() else "cpu"
        ar = device_wait(allreduce_us) if device == "cuda" else (lambda t: None)
        _FORWARD[key] = VerifyForward(presets.get(preset, tp, layers), context, device, moe_fn(device), ar,
                                      chain_verify(device), ops=forward_ops(device), batch=batch)
    return _FORWARD[key]


def release_forwards() -> None:
    """Drop the kept forward and give its memory back to the device (gc first: a finished case's cycle and its
    captured graphs may still hold it through reference cycles)."""
    _FORWARD.clear()
    release_unreferenced()


def forward_ops(device: str):
    """On a GPU the engine-style fused kernels; VERIFYBENCH_VERIFY_OPS=torch runs one torch op per kernel instead
    (to show what the kernel count costs). On CPU plain torch: the smoke run checks the plumbing, not the kernels."""
    return fused_ops() if ops_choice(device) == "fused" else TORCH_OPS


def ops_choice(device: str) -> str:
    """VERIFYBENCH_VERIFY_OPS (fused or torch; default fused on a GPU, torch on CPU), checked."""
    choice = settings.read(settings.VERIFY_OPS, "fused" if device == "cuda" else "torch")
    if choice not in ("fused", "torch"):
        raise ValueError(f"VERIFYBENCH_VERIFY_OPS must be fused or torch, got {choice!r}")
    return choice


MAX_ALLREDUCE_US = 10_000.0  # 10 ms: beyond any allreduce of a verify step (a unit slip, us for ns, lands above)
_SOURCE: list[str] = []  # the --allreduce-from of the cases being listed (allreduce_source), innermost last


@contextlib.contextmanager
def allreduce_source(spec: str | None):
    """Inside the block the stand-in reads `spec` (a run's --allreduce-from, PATH[:BACKEND]) in place of
    VERIFYBENCH_ALLREDUCE_FROM: handed in by the caller, never written to the environment, so nothing the process or
    a child runs later sees it. None: no change."""
    if spec is None:
        yield
        return
    _SOURCE.append(spec)
    try:
        yield
    finally:
        _SOURCE.pop()


def allreduce_stand_in_us(size_bytes: int | None = None, source: str | None = None) -> tuple[float, str]:
    """The latency the one-GPU stand-in waits, and where it comes from. VERIFYBENCH_ALLREDUCE_US: a number of
    microseconds in [0, MAX_ALLREDUCE_US]. VERIFYBENCH_ALLREDUCE_FROM: an allreduce result or NCCL sweep summary,
    PATH or PATH:BACKEND, whose measured time is taken at `size_bytes` (the forward's hidden x n x 2 B, nearest
    size) or, without it, as the median over its verify sizes; fastest backend unless one is named. Not both.
    `source` (else the innermost allreduce_source) stands in for VERIFYBENCH_ALLREDUCE_FROM: --allreduce-from."""
    source = source or (_SOURCE[-1] if _SOURCE else None)
    text, spec = settings.read(settings.ALLREDUCE_US), source or settings.read(settings.ALLREDUCE_FROM)
    if text is not None and spec is not None:
        raise ValueError("set VERIFYBENCH_ALLREDUCE_US or VERIFYBENCH_ALLREDUCE_FROM (--allreduce-from), not both")
    if spec is not None:
        from verifybench.harness.collectives.allreduce_results import stand_in_from_result

        us, source = stand_in_from_result(spec, size_bytes)
        if not (math.isfinite(us) and 0 <= us <= MAX_ALLREDUCE_US):
            raise ValueError(f"VERIFYBENCH_ALLREDUCE_FROM: {source}: {us} us is outside [0, {MAX_ALLREDUCE_US:g}]")
        return us, f"measured: {source}"
    if text is None:
        return REFERENCE_ALLREDUCE_US, ("reference figure (NCCL all_reduce_perf, graph mode, 2xH200 over NVLink; "
                                        "PCIe boxes are slower: measure yours)")
    try:
        us = float(text)
    except ValueError:
        us = math.nan
    if not (math.isfinite(us) and 0 <= us <= MAX_ALLREDUCE_US):
        raise ValueError(f"VERIFYBENCH_ALLREDUCE_US must be microseconds in [0, {MAX_ALLREDUCE_US:g}], got {text!r}")
    return us, "VERIFYBENCH_ALLREDUCE_US"
