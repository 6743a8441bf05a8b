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
    """(name, in_features, out_features) of each bf16 projection of one layer, in forward order (the model
    preset says which: Preset.projections())."""

    projections: tuple[tuple[str, int, int], ...]

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
