"""Workloads for the CUDA-graph replay component: a tiny kernel to chain N times, and a model-shaped stack of the
per-layer projection GEMMs of one tensor-parallel rank, with plain-torch references.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def tiny_kernel(x: torch.Tensor) -> None:
    """One launch of the smallest kernel torch issues: an in-place add on a one-element tensor."""
    x.add_(1)


def straight_line(x: torch.Tensor, kernels: int) -> None:
    """`kernels` dependent tiny kernels: the body of a straight-line graph of that many nodes."""
    for _ in range(kernels):
        tiny_kernel(x)


@dataclass(frozen=True)
class LayerShapes:
    """Per-rank (in_features, out_features) of each bf16 projection of one MoE layer, in forward order.

    From DESIGN.md 4.5 (Kimi-K2.5 at TP8: fused q_a/kv_a 7168->2112 replicated, q_b 1536->8x192, kv_b absorbed
    512->8x256, o_proj 8x128->7168, router 7168->384 replicated, shared expert 7168->2x256 and 256->7168).
    The routed INT4 experts are their own component and are not in this stack.
    """

    projections: tuple[tuple[str, int, int], ...]

    @classmethod
    def mla_moe(cls, hidden: int, heads: int, q_lora: int, kv_lora: int, qk_nope: int, qk_rope: int, v_head: int,
                experts: int, shared_intermediate: int) -> "LayerShapes":
        return cls((
            ("q_a_kv_a", hidden, q_lora + kv_lora + qk_rope),
            ("q_b", q_lora, heads * (qk_nope + qk_rope)),
            ("kv_b", kv_lora, heads * (qk_nope + v_head)),
            ("o_proj", heads * v_head, hidden),
            ("router", hidden, experts),
            ("shared_gate_up", hidden, 2 * shared_intermediate),
            ("shared_down", shared_intermediate, hidden),
        ))

    @property
    def weight_bytes(self) -> int:
        return sum(k * n for _, k, n in self.projections) * 2  # bf16


class ModelStack:
    """`layers` layers of distinct random bf16 weights (a real forward never re-reads a layer's weights), and per
    token count a set of input activations. Each GEMM reads its own input: only shapes, bytes and order matter."""

    def __init__(self, shapes: LayerShapes, layers: int, device: str, dtype: torch.dtype = torch.bfloat16):
        self.shapes, self.device, self.dtype = shapes, device, dtype
        # [out, in] as nn.Linear stores them, so the GEMMs are the ones a real engine runs
        self.weights = [[torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _, k, n in shapes.projections]
                        for _ in range(layers)]

    def inputs(self, tokens: int) -> list[torch.Tensor]:
        return [torch.randn(tokens, k, device=self.device, dtype=self.dtype) for _, k, _ in self.shapes.projections]

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """All layers' projections in order; returns the last layer's outputs."""
        for layer in self.weights:
            outs = [torch.nn.functional.linear(x, w) for x, w in zip(xs, layer)]
        return outs

    def reference_last_layer(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x.double() @ w.double().T for x, w in zip(xs, self.weights[-1])]

    @property
    def kernels_per_forward(self) -> int:
        return len(self.weights) * len(self.shapes.projections)
