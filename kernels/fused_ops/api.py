"""Fused elementwise ops of the verify forward as one Triton kernel each, the way serving engines run
them (SGLang/vLLM fused_add_rmsnorm, a fused softmax + top-k router), with plain-torch fp32 references. silu_and_mul
has no launch of its own: kernels/skinny_gemm/ computes it as the down projection loads its input (act="silu_mul").

Why: as separate torch ops an RMSNorm is ~8 kernels and softmax + topk + casts ~4; at n <= 8 tokens each costs its
launch (~1.3 us in a CUDA graph), 3-4 ms per Kimi-K2.5 forward in all. Here each op is one launch.

Semantics (the references are the definition; kernels differ only by fp32 reduction order and fast exp/rsqrt):
- rmsnorm(x, w): y = (x * rsqrt(mean(x^2) + eps)) rounded to x.dtype, times w, rounded to x.dtype: with w in x's
  dtype this is bit-for-bit what `(normed).to(x.dtype) * w` does in torch (harness/model/forward.py's _rmsnorm).
- add_rmsnorm(h, delta, w): h = round_to_h_dtype(h + delta) in place, then y = rmsnorm(new h, w).
- silu_mul_reference(gate_up [n, 2I]): silu(gate) * up in fp32, rounded once to the input dtype.
- softmax_topk(logits, k): fp32 softmax over E, the k largest probabilities in descending order; ties go to the lower
  index (torch.topk leaves them unspecified); ids stay in 0..E-1 even for rows with NaN logits.
Every wrapper checks shapes, dtypes and strides on the host only (no device sync, outputs from torch.empty), so
all are CUDA-graph capturable once compiled. Rows are [n, H] with last-dim stride 1; the row stride is free (column
slices of a wider tensor need no copy). Kernels run for CUDA tensors, and for CPU tensors when TRITON_INTERPRET=1 was
set before import (tests); other CPU tensors take the reference (the CPU smoke profile).
pdl (every op; None: pdl.enabled): programmatic dependent launch, see kernels/common/pdl.py. The norms load their
weight before the wait, so a weight must not be written by the kernel launched just before.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from verifybench.kernels.common import interpret
from verifybench.kernels.common import pdl as _pdl
from verifybench.kernels.common.validators import check_matrix

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW = 16384  # a whole row lives in registers: 16384 fp32 over 16 warps = 32 values per thread
MAX_EXPERTS = 8192
MAX_TOPK = 64  # the selection loop is unrolled k times
# triton.jit picks the interpreter at decoration time, so dispatch follows the same moment
_INTERPRET = interpret.active()


# ---------------------------------------------------------------------------------------------------- kernels

@triton.jit
def _rmsnorm_kernel(x_ptr, delta_ptr, w_ptr, y_ptr, stride_x, stride_delta, stride_y, eps, H: tl.constexpr,
                    BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < H
    w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)  # a weight: may load before the wait (PDL)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + i, mask=m, other=0.0).to(tl.float32)
    if ADD:  # the residual keeps its dtype: the norm reads the rounded sum, as the unfused forward does
        x = x + tl.load(delta_ptr + row * stride_delta + i, mask=m, other=0.0).to(tl.float32)
        x_rounded = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + i, x_rounded, mask=m)
        x = x_rounded.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + i, (normed * w).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, stride_logits, E: tl.constexpr, K: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    # Probabilities are >= 0, so their fp32 bits order like the values; key = bits << 32 | (BLOCK - 1 - index)
    # makes one int64 max per pick find the largest probability and, among equal ones, the lowest index.
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    valid = i < E
    x = tl.load(logits_ptr + row * stride_logits + i, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    bits = p.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # keys of valid lanes stay >= 0 even for NaN: ids in range
    key = (bits.to(tl.int64) << 32) | (BLOCK - 1 - i).to(tl.int64)
    key = tl.where(valid, key, -1)
    j = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for t in tl.static_range(K):
        best = tl.max(key, axis=0)
        idx = (BLOCK - 1 - (best & (BLOCK - 1))).to(tl.int32)
        top_w = tl.where(j == t, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), top_w)
        top_i = tl.where(j == t, idx, top_i)
        key = tl.where(i == idx, -1, key)
    tl.store(w_ptr + row * K + j, top_w, mask=j < K)
    tl.store(ids_ptr + row * K + j, top_i, mask=j < K)


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 512))  # 16 values per thread: two 16-byte loads of bf16


# ---------------------------------------------------------------------------------------------------- checks

def _check_rows(name: str, t, n: int | None = None, width: int | None = None) -> None:
    check_matrix(name, t, FLOAT_DTYPES, "float16, bfloat16 or float32", "2-D [rows, features]")
    if n is not None and t.shape[0] != n or width is not None and t.shape[1] != width:
        raise ValueError(f"{name} must be [{n}, {width}], got {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} needs last-dim stride 1 (got strides {t.stride()}); pass .contiguous()")


def _check_weight(weight, hidden: int, like: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"weight must be a float16/bfloat16/float32 tensor, got {getattr(weight, 'dtype', weight)}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if hidden > 1 and weight.stride(0) != 1:
        raise ValueError(f"weight needs stride 1, got {weight.stride()}")
    if weight.device != like.device:
        raise ValueError(f"weight is on {weight.device}, the rows on {like.device}")


def _check_hidden(hidden: int) -> None:
    if not 1 <= hidden <= MAX_ROW:
        raise ValueError(f"hidden size must be 1..{MAX_ROW} (a whole row is held in registers), got {hidden}")


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda or _INTERPRET


# ---------------------------------------------------------------------------------------------------- ops

def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            pdl: bool | None = None) -> torch.Tensor:
    """x [n, H] (last-dim stride 1, any row stride), weight [H] -> y [n, H] in x's dtype, one launch.

    out: write y there instead ([n, H], x's dtype, last-dim stride 1; x itself or disjoint from it). out=x
    normalizes in place, which lets the forward norm kv_a[:, :512] inside its [n, 576] buffer without a torch.cat."""
    _check_rows("x", x)
    n, hidden = x.shape
    _check_hidden(hidden)
    _check_weight(weight, hidden, x)
    if out is None:
        out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    else:
        _check_rows("out", out, n, hidden)
        if out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"out must be {x.dtype} on {x.device}, got {out.dtype} on {out.device}")
    if not _use_kernel(x):
        return out.copy_(rmsnorm_reference(x, weight, eps))
    if n:
        block = triton.next_power_of_2(hidden)
        on = _pdl.resolve(pdl, x.device)
        _rmsnorm_kernel[(n,)](x, x, weight, out, x.stride(0), 0, out.stride(0), eps, H=hidden, BLOCK=block,
                              ADD=False, PDL=on, num_warps=_row_warps(block), **_pdl.launch_kwargs(on))
    return out


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                pdl: bool | None = None) -> torch.Tensor:
    """h += delta in place (h keeps its dtype; the sum is taken in fp32 and rounded once), then y = rmsnorm(h):
    the residual add and the next norm in one launch. h, delta [n, H] with last-dim stride 1; returns y [n, H]."""
    _check_rows("h", h)
    n, hidden = h.shape
    _check_rows("delta", delta, n, hidden)
    _check_hidden(hidden)
    _check_weight(weight, hidden, h)
    if delta.device != h.device:
        raise ValueError(f"delta is on {delta.device}, h on {h.device}")
    if n > 1 and h.stride(0) < hidden:
        raise ValueError(f"rows of h overlap (row stride {h.stride(0)} < {hidden}): the in-place update would race")
    if not _use_kernel(h):
        return add_rmsnorm_reference(h, delta, weight, eps)
    y = torch.empty(n, hidden, dtype=h.dtype, device=h.device)
    if n:
        block = triton.next_power_of_2(hidden)
        on = _pdl.resolve(pdl, h.device)
        _rmsnorm_kernel[(n,)](h, delta, weight, y, h.stride(0), delta.stride(0), y.stride(0), eps, H=hidden,
                              BLOCK=block, ADD=True, PDL=on, num_warps=_row_warps(block), **_pdl.launch_kwargs(on))
    return y


def softmax_topk(logits: torch.Tensor, k: int, pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] (last-dim stride 1) -> (weights fp32 [n, k], ids int32 [n, k]): the k largest fp32 softmax
    probabilities, descending, ties to the lower index. One launch, one program per token."""
    _check_rows("logits", logits)
    n, experts = logits.shape
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"logits must have 1..{MAX_EXPERTS} experts, got {experts}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(experts, MAX_TOPK):
        raise ValueError(f"k must be an int in 1..min(E={experts}, {MAX_TOPK}), got {k!r}")
    if not _use_kernel(logits):
        return softmax_topk_reference(logits, k)
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int32, device=logits.device)
    if n:
        block = triton.next_power_of_2(experts)
        # one warp holds 512 experts in 16 registers per thread, and its reductions need no shared memory
        on = _pdl.resolve(pdl, logits.device)
        _softmax_topk_kernel[(n,)](logits, weights, ids, logits.stride(0), E=experts, K=k, BLOCK=block,
                                   BLOCK_K=triton.next_power_of_2(k), PDL=on, num_warps=max(1, min(4, block // 512)),
                                   **_pdl.launch_kwargs(on))
    return weights, ids


# ---------------------------------------------------------------------------------------------------- references

def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def add_rmsnorm_reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                          eps: float = 1e-6) -> torch.Tensor:
    h.copy_((h.float() + delta.float()).to(h.dtype))
    return rmsnorm_reference(h, weight, eps)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [n, 2I] in fp32, rounded once to its dtype (what kernels.skinny_gemm's
    act="silu_mul" prologue feeds its GEMM)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)


def softmax_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1)
    return weights, ids.to(torch.int32)
