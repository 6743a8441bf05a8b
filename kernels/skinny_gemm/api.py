"""Skinny GEMM y = x @ w.T for the bf16 projections of the verify forward: x [n, K] with n <= 16
tokens, w [N, K] streamed from DRAM once. cuBLAS runs these as weight-streaming GEMV-like GEMMs at ~1/3 of copy
bandwidth for the per-rank Kimi-K2.5 shapes; here each shape and token bucket gets a tuned launch.

The kernels and their launch (dot, fma, split-K reduces, PDL): kernels.py; the configs, tables and
selection: configs.py. This module checks the inputs, picks the config and holds the reference.
The wrapper checks shapes on the host only (no device sync; outputs from torch.empty), so it is CUDA-graph
capturable once compiled. Kernels run for CUDA tensors, and for CPU tensors when TRITON_INTERPRET=1 was set before
import (tests); other CPU tensors take the reference (the CPU smoke profile).
"""
from __future__ import annotations


import torch

from verifybench.kernels.common import interpret
from verifybench.kernels.common import pdl as _pdl
from verifybench.kernels.common.validators import check_matrix
from verifybench.kernels.skinny_gemm import kernels
from verifybench.kernels.fused_ops.api import silu_mul_reference
from verifybench.kernels.skinny_gemm.configs import cached_config, check_config, sm_count

MAX_TOKENS = 16
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# triton.jit picks the interpreter at decoration time, so dispatch follows the same moment
_INTERPRET = interpret.active()
ACTS = (None, "silu_mul")




def linear_reference(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None,
                     act: str | None = None) -> torch.Tensor:
    """x @ w.T (+ add) in plain torch fp32 (the result stays fp32); act "silu_mul": x is gate_up [n, 2K] and the
    GEMM reads fused_ops.silu_mul_reference(x)."""
    y = (silu_mul_reference(x) if act else x).float() @ w.float().t()
    return y if add is None else y + add.float()


def bytes_moved(n: int, N: int, K: int, itemsize: int = 2) -> int:
    """Bytes a call must move: w once, x, and y (split-K partials are overhead, not counted)."""
    return (N * K + n * K + n * N) * itemsize


def _check_inputs(x, w, act=None) -> None:
    for name, t in (("x", x), ("w", w)):
        check_matrix(name, t, FLOAT_DTYPES, "bfloat16, float16 or float32")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must have one dtype, got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, w on {w.device}")
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    n, k = x.shape
    if not 1 <= n <= MAX_TOKENS:
        raise ValueError(f"x must have 1..{MAX_TOKENS} rows (tokens), got {n}")
    if act and (k != 2 * w.shape[1] or k < 2):
        raise ValueError(f"act {act!r}: x is gate_up [n, 2K] for w [N, K], got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if not act and (w.shape[1] != k or w.shape[0] < 1 or k < 1):
        raise ValueError(f"x [n, K] and w [N, K] must agree on K >= 1, got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if k > 1 and x.stride(1) != 1:
        raise ValueError(f"x needs last-dim stride 1 (got strides {x.stride()}); pass .contiguous()")
    if not w.is_contiguous():
        raise ValueError(f"w must be contiguous (got strides {w.stride()})")


def _check_add(add, x, N: int) -> None:
    if not isinstance(add, torch.Tensor):
        raise ValueError(f"add must be a torch.Tensor or None, got {type(add).__name__}")
    if add.shape != (x.shape[0], N):
        raise ValueError(f"add must be [n, N] = [{x.shape[0]}, {N}], got {tuple(add.shape)}")
    if add.dtype != x.dtype:
        raise ValueError(f"add must have x's dtype {x.dtype}, got {add.dtype}")
    if add.device != x.device:
        raise ValueError(f"add is on {add.device}, x on {x.device}")
    if N > 1 and add.stride(1) != 1:
        raise ValueError(f"add needs last-dim stride 1 (got strides {add.stride()}); pass .contiguous()")


def linear(x: torch.Tensor, w: torch.Tensor, config: dict | None = None, *, add: torch.Tensor | None = None,
           act: str | None = None, pdl: bool | None = None) -> torch.Tensor:
    """y = x @ w.T (+ add): x [n, K] (n <= 16; bf16, fp16 or fp32; any row stride, last-dim stride 1), w [N, K]
    contiguous, same dtype -> y [n, N] in x's dtype, fp32 accumulation.

    config (default: select_config(n, N, K, device)): {"kind": "dot" | "fma" | "torch", "BLOCK_N", "BLOCK_K", "SPLIT_K"
    (None: from the shape), "reduce": "serial" | "kernel", "num_warps", "num_stages"}; see kernels.py.
    add: [n, N] in x's dtype and device, last-dim stride 1, any row stride; added in fp32 before the one rounding
    (kind "torch": rounded twice). y is a new tensor, so add never aliases it.
    act "silu_mul": x is gate_up [n, 2K] (gate columns, then up) and y = (silu(gate) * up) @ w.T (+ add), the
    activation computed as each x tile loads (fp32, rounded once to x's dtype: fused_ops.silu_mul_reference):
    the shared expert's and dense MLP's down projections without a separate activation launch.
    pdl: launch with programmatic dependent launch (None: pdl.enabled(x.device)); True where PDL cannot
    run (CPU, the interpreter, pre-sm_90, VERIFYBENCH_PDL=0) silently runs without it; kind "torch" ignores it."""
    _check_inputs(x, w, act)
    n, K = x.shape[0], w.shape[1]
    N = w.shape[0]
    if add is not None:
        _check_add(add, x, N)
    if not (x.is_cuda or _INTERPRET):
        return linear_reference(x, w, add, act).to(x.dtype)
    if config is None:
        config = cached_config(n, N, K, x.device, x.dtype)
    cfg = check_config(config, n)
    if cfg["kind"] == "torch":
        y = torch.nn.functional.linear(silu_mul_reference(x) if act else x, w)
        return y if add is None else y.add_(add)
    return kernels.launch(x, w, add, bool(act), cfg, sm_count(x.device), _pdl.resolve(pdl, x.device))
