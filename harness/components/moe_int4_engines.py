"""The engine rows of the INT4 MoE component: SGLang's Triton W4A16 MoE ("sglang.triton") and its Marlin MoE
("sglang.marlin"), each built from our layer and input once, outside the timed call, and run on the same rotation.

moe_int4.py makes the cases; here is what each engine row needs per case: its setup (or the row's one-line skip)
and call(layer, x, topk_weights, topk_ids) that builds the engine's per-input state on first use and runs it.
"""
from __future__ import annotations

import torch

from verifybench.harness import engines
from verifybench.harness.measure.timing.runner import CaseSkipped
from verifybench.harness.model import presets
from verifybench.kernels.common import interpret

SGLANG = "sglang.triton"  # SGLang's Triton W4A16 MoE (its ROCm method), timed beside ours
MARLIN = "sglang.marlin"  # SGLang's Marlin MoE (what it serves these weights with on CUDA)


class TritonEngine:
    """SGLang's W4A16 MoE for one case: its config for n tokens, and call(layer, x, tw, ids) that builds the engine's
    per-input state once per input (outside the timed region: setup and the check call it first) and runs it."""

    def __init__(self, sglang, picked: dict, group_size: int):
        self.sglang, self.picked, self.group_size, self.built = sglang, picked, group_size, {}
        self.tolerance = None  # the component's
        self.record = {"kernel": engines.label("sglang"), "config": picked["config"],
                       "down_config": picked["down_config"], "config_source": picked["source"],
                       "engine_note": ("fused_experts_impl's calls; block alignment (ours) outside the timed region "
                                       "(sgl-kernel op in SGLang), SiLU*up in torch (sgl-kernel in SGLang)")}

    def call(self, layer: tuple, x, tw, ids):
        key = (id(layer[0]), id(x), id(tw), id(ids))
        if key not in self.built:
            w13, w13s = self.sglang.w4a16_weights(layer[0], layer[1])
            w2, w2s = self.sglang.w4a16_weights(layer[2], layer[3])
            run = self.sglang.moe_w4a16(x, w13, w13s, w2, w2s, tw, ids, self.group_size, self.picked)
            self.built[key] = (layer, x, tw, ids, run)  # held: the ids cannot be reused meanwhile
        return self.built[key][-1]()


# (id of our layer's first tensor, dtype) -> (our layer, held so the id stays its own; its Marlin copy): each layer
# is repacked once per component run, not once per case (release() drops them)
_REPACKED: dict = {}


class MarlinEngine:
    """SGLang's Marlin MoE for one case: each of our layers repacked once by SGLang's own loader step (a Marlin copy
    of the layer beside ours, kept for the component's later cases), and call(layer, x, tw, ids) that builds the
    per-input state (block alignment) once per input and runs fused_marlin_moe's calls. record: the kernel,
    block_size_m, atomic add, what ran in torch."""

    def __init__(self, marlin, group_size: int):
        self.marlin, self.group_size, self.built = marlin, group_size, {}
        self.record = {"kernel": engines.label("sglang")}
        from verifybench.harness.engines.marlin import TOLERANCE

        self.tolerance = TOLERANCE  # its bf16 dequant and split-K sums (marlin.TOLERANCE says why)

    def call(self, layer: tuple, x, tw, ids):
        key = (id(layer[0]), id(x), id(tw), id(ids))
        if key not in self.built:
            held = _REPACKED.get((id(layer[0]), x.dtype))
            if held is None or held[0] is not layer:
                held = _REPACKED[id(layer[0]), x.dtype] = (layer, self.marlin.marlin_layer(*layer, self.group_size,
                                                                                           x.dtype))
            run = self.marlin.moe_marlin(x, held[1], tw, ids)
            self.record.update({"marlin": run.info, "engine_note": self.marlin.describe(run.info)})
            self.built[key] = (layer, x, tw, ids, run)  # held: the ids cannot be reused meanwhile
        return self.built[key][-1]()


def setup(impl: str, p: presets.Preset, n: int, device: str):
    """The engine row's kernels for this case, or its skip (one line, with the reason)."""
    if impl == MARLIN:
        from verifybench.harness.engines import marlin

        if device != "cuda":
            raise engines.skipped(f"{engines.label('sglang')}: {marlin.CPU_REASON}")
        try:
            marlin.build(torch.bfloat16)  # its JIT kernels, the line first: a first use builds them for minutes
        except engines.EngineMissing as e:
            raise engines.skipped(e) from None
        return MarlinEngine(marlin, p.expert_group_size)
    if device != "cuda" and not interpret.active():
        raise CaseSkipped("the Triton kernels need a GPU, or TRITON_INTERPRET=1 set before import on CPU")
    try:
        from verifybench.harness.engines import sglang

        picked = sglang.moe_w4a16_config(n, p.experts, p.hidden, p.expert_intermediate, p.topk,
                                         p.expert_group_size)
    except engines.EngineMissing as e:
        raise engines.skipped(e) from None
    return TritonEngine(sglang, picked, p.expert_group_size)


def first_calls(engine, fns: list) -> None:
    """The engine's per-input setup done and its kernels compiled (SGLang's Triton JIT, the Marlin JIT build and
    repack) before the timed region; what fails inside the engine skips the row in one line."""
    try:
        engines.engine_call("sglang")(lambda: [fn() for fn in fns])()
    except engines.EngineMissing as e:
        raise engines.skipped(e) from None


def ran(records: list[dict]) -> str:
    """The engine rows' kernels, from their own records, for the side-by-side title."""
    out = ""
    triton = next((r for r in records if r["params"]["impl"] == SGLANG), None)
    if triton is not None:
        kernel = triton["derived"].get("kernel", "sglang")
        out += (f"; sglang = {kernel}'s Triton W4A16 MoE, block alignment (ours) outside the timed region, SiLU*up "
                "in torch")
    marlin = next((r for r in records if r["params"]["impl"] == MARLIN), None)
    if marlin is not None:
        out += f"; marlin = {marlin['derived'].get('engine_note', marlin['derived'].get('kernel', 'sglang'))}"
    return out


def release() -> None:
    """Drop the Marlin copies of the layers (one INT4 layer set each)."""
    _REPACKED.clear()
