"""The glue around MLA attention in the verify forward (harness/model/forward.py) as one Triton launch per step,
with plain-torch fp32 references.

Why: unfused, the steps between the qkv projection and o_proj are 2 RMSNorms, 2 KV-slot copies, bmm + cat for the
absorbed query and bmm + a transpose copy for the value up-projection; at n <= 16 tokens each kernel costs its launch
(~2-3 us in a CUDA graph). Here they are 3 launches: mla_prep, q_absorb, v_up.

Semantics (the references are the definition; kernels differ only by fp32 reduction order and fast rsqrt):
- mla_prep(qkv [n, q_lora + kv_lora + rope], q_ln, kv_ln, cache, pos, q_lora, kv_lora) -> q_a [n, q_lora]:
  q_a = rmsnorm(qkv[:, :q_lora], q_ln); cache[pos + i, :kv_lora] = rmsnorm(qkv[i, q_lora:q_lora + kv_lora], kv_ln);
  cache[pos + i, kv_lora:] = qkv[i, q_lora + kv_lora:] (the rope part, copied). rmsnorm is
  kernels/fused_ops/'s rmsnorm_reference (normalize in fp32, round to the dtype, times the weight, round again). Cache
  rows outside [pos, pos + n) are not touched.
- q_absorb(qh [n, heads, nope + rope], w_uk [heads, nope, kv_lora], rope) -> q [heads, n, kv_lora + rope]:
  q[h, i, :kv_lora] = qh[i, h, :nope] @ w_uk[h] (fp32 sum, rounded once to qh's dtype); q[h, i, kv_lora:] =
  qh[i, h, nope:].
- v_up(o_lat [heads, n, kv_lora], w_uv [heads, kv_lora, v_head]) -> o [n, heads * v_head]:
  o[i, h * v_head + j] = sum_c o_lat[h, i, c] * w_uv[h, c, j] (fp32 sum, rounded once to o_lat's dtype).
Every wrapper checks shapes, dtypes, strides and devices on the host only (no device sync, outputs from torch.empty),
so all are CUDA-graph capturable once compiled. Activations need last-dim stride 1 only (views of a wider linear
output need no copy); weights are contiguous. `pdl` (None: pdl.enabled) launches with programmatic
dependent launch: each program loads only its weights before gdc_wait() (kernels/common/pdl.py's rules). Kernels run for
CUDA tensors, and for CPU tensors when TRITON_INTERPRET=1 was set before import (tests); other CPU tensors take
the reference.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # PDL (sm_90+; triton >= 3.3)

from verifybench.kernels.common import interpret
from verifybench.kernels.common import pdl as pdl_mod
from verifybench.kernels.fused_ops.api import FLOAT_DTYPES, MAX_ROW, rmsnorm_reference

MAX_NOPE = 256  # q_absorb holds a head's whole [nope, BLOCK_C] w_uk tile in registers
MAX_KV_LORA = 1024  # v_up holds a head's whole [kv_lora, BLOCK_V] w_uv tile in registers
ROWS = 16  # token rows per tl.dot (its minimum M); fewer tokens are masked, more loop
BLOCK_C = 32  # q_absorb latent columns per program: Kimi's 8 heads x 512 / 32 = 128 programs stream w_uk
BLOCK_V = 16  # v_up output columns per program: 8 heads x 128 / 16 = 64 programs stream w_uv
# triton.jit picks the interpreter at decoration time, so dispatch follows the same moment
_INTERPRET = interpret.active()


# ---------------------------------------------------------------------------------------------------- kernels

@triton.jit
def _rms_row(x, w, H: tl.constexpr, eps, dtype: tl.constexpr):
    # as rmsnorm_reference: the normalized row is rounded to the dtype before the weight multiplies it
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)).to(dtype).to(tl.float32)
    return (normed * w).to(dtype)


@triton.jit(do_not_specialize=["pos"])  # one compile for every cache position
def _mla_prep_kernel(qkv_ptr, q_ln_ptr, kv_ln_ptr, cache_ptr, q_a_ptr, stride_qkv, stride_cache, pos, per_request,
                     request_stride, eps, Q_LORA: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_KV: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    # program (i, 0): the q row of token i; (i, 1): its kv row and rope part, written into cache row
    # pos + (i // per_request) * request_stride + i % per_request (each request's tokens after its own prefix)
    row = tl.program_id(0).to(tl.int64)
    src = qkv_ptr + row * stride_qkv
    dtype = q_a_ptr.dtype.element_ty
    # the two branches use their own names: triton needs a name bound in both to have one type
    if tl.program_id(1) == 0:
        iq = tl.arange(0, BLOCK_Q)
        wq = tl.load(q_ln_ptr + iq, mask=iq < Q_LORA, other=0.0).to(tl.float32)
        if PDL:  # the norm weight is static; qkv comes from the kernel before
            gdc_wait()
            gdc_launch_dependents()
        xq = tl.load(src + iq, mask=iq < Q_LORA, other=0.0).to(tl.float32)
        tl.store(q_a_ptr + row * Q_LORA + iq, _rms_row(xq, wq, Q_LORA, eps, dtype), mask=iq < Q_LORA)
    else:
        ik = tl.arange(0, BLOCK_KV)
        wk = tl.load(kv_ln_ptr + ik, mask=ik < KV_LORA, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        dst = cache_ptr + (pos + (row // per_request) * request_stride + row % per_request) * stride_cache
        xk = tl.load(src + Q_LORA + ik, mask=ik < KV_LORA, other=0.0).to(tl.float32)
        tl.store(dst + ik, _rms_row(xk, wk, KV_LORA, eps, dtype), mask=ik < KV_LORA)
        if ROPE > 0:
            j = tl.arange(0, BLOCK_R)
            tl.store(dst + KV_LORA + j, tl.load(src + Q_LORA + KV_LORA + j, mask=j < ROPE), mask=j < ROPE)


@triton.jit(do_not_specialize=["n"])  # one compile for every token count
def _q_absorb_kernel(qh_ptr, w_ptr, q_ptr, n, stride_qh_n, stride_qh_h, NOPE: tl.constexpr, ROPE: tl.constexpr,
                     KV_LORA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    # program (h, cb): latent columns [cb * BLOCK_C, +BLOCK_C) of head h for all tokens; cb == 0 also copies rope
    h = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    k = tl.arange(0, BLOCK_K)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    w = tl.load(w_ptr + h * (NOPE * KV_LORA) + k[:, None] * KV_LORA + c[None, :],
                mask=(k[:, None] < NOPE) & (c[None, :] < KV_LORA), other=0.0)
    if PDL:  # w_uk is static; qh comes from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    WIDTH: tl.constexpr = KV_LORA + ROPE
    src = qh_ptr + h * stride_qh_h
    dst = q_ptr + h * n * WIDTH
    for r0 in range(0, n, BLOCK_N):
        r = r0 + tl.arange(0, BLOCK_N)[:, None]
        a = tl.load(src + r * stride_qh_n + k[None, :], mask=(r < n) & (k[None, :] < NOPE), other=0.0)
        acc = tl.dot(a, w, input_precision="ieee")  # fp32 inputs stay fp32 (no tf32)
        tl.store(dst + r * WIDTH + c[None, :], acc.to(q_ptr.dtype.element_ty), mask=(r < n) & (c[None, :] < KV_LORA))
        if ROPE > 0:
            if cb == 0:
                j = tl.arange(0, BLOCK_R)[None, :]
                m = (r < n) & (j < ROPE)
                tl.store(dst + r * WIDTH + KV_LORA + j, tl.load(src + r * stride_qh_n + NOPE + j, mask=m), mask=m)


@triton.jit(do_not_specialize=["n"])
def _v_up_kernel(lat_ptr, w_ptr, o_ptr, n, stride_lat_h, stride_lat_n, HEADS: tl.constexpr, KV_LORA: tl.constexpr,
                 V_HEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                 PDL: tl.constexpr):
    # program (h, vb): output columns h * V_HEAD + [vb * BLOCK_V, +BLOCK_V) for all tokens
    h = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    w = tl.load(w_ptr + h * (KV_LORA * V_HEAD) + k[:, None] * V_HEAD + v[None, :],
                mask=(k[:, None] < KV_LORA) & (v[None, :] < V_HEAD), other=0.0)
    if PDL:  # w_uv is static; o_lat comes from the attention kernel before
        gdc_wait()
        gdc_launch_dependents()
    src = lat_ptr + h * stride_lat_h
    for r0 in range(0, n, BLOCK_N):
        r = r0 + tl.arange(0, BLOCK_N)[:, None]
        a = tl.load(src + r * stride_lat_n + k[None, :], mask=(r < n) & (k[None, :] < KV_LORA), other=0.0)
        acc = tl.dot(a, w, input_precision="ieee")
        tl.store(o_ptr + r * (HEADS * V_HEAD) + h * V_HEAD + v[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=(r < n) & (v[None, :] < V_HEAD))


# ---------------------------------------------------------------------------------------------------- checks

def _check(name: str, t, dims: int, layout: str, like: torch.Tensor | None = None, like_name: str = "") -> None:
    """A float tensor of `dims` dims with last-dim stride 1, on like's device (and in its dtype when given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs last-dim stride 1 (got strides {t.stride()}); pass .contiguous()")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, {like_name} on {like.device}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple, layout: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {layout} = {list(shape)}, got {list(t.shape)}")


def _check_same_dtype(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.dtype != like.dtype:
        raise ValueError(f"{name} must have {like_name}'s dtype {like.dtype}, got {t.dtype}")


def _check_int(name: str, v, low: int, high: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"{name} must be an int in {low}..{high}, got {v!r}")


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda or _INTERPRET


def _pdl_on(pdl, t: torch.Tensor) -> bool:
    return pdl_mod.resolve(pdl, t.device)


# ---------------------------------------------------------------------------------------------------- ops

def mla_prep(qkv: torch.Tensor, q_ln: torch.Tensor, kv_ln: torch.Tensor, cache: torch.Tensor, pos: int, q_lora: int,
             kv_lora: int, eps: float = 1e-6, *, pdl: bool | None = None, per_request: int | None = None,
             request_stride: int = 0) -> torch.Tensor:
    """qkv [n, q_lora + kv_lora + rope] (last-dim stride 1, any row stride) -> q_a = rmsnorm(q part) [n, q_lora];
    writes rmsnorm(kv part) and the rope part into cache [rows, kv_lora + rope] rows pos..pos+n-1. One launch.
    Several requests (n = B * per_request tokens, request-major): request b's tokens go to rows
    pos + b * request_stride + j, j < per_request."""
    _check("qkv", qkv, 2, "[n, q_lora + kv_lora + rope]")
    _check_int("q_lora", q_lora, 1, MAX_ROW)
    _check_int("kv_lora", kv_lora, 1, MAX_ROW)
    _check("cache", cache, 2, "[rows, kv_lora + rope]", qkv, "qkv")
    _check_same_dtype("cache", cache, qkv, "qkv")
    n, width = qkv.shape
    rows, latent = cache.shape
    rope = latent - kv_lora
    if not 0 <= rope <= MAX_ROW:
        raise ValueError(f"cache must be [rows, kv_lora + rope] with kv_lora = {kv_lora} and rope in 0..{MAX_ROW}, "
                         f"got {list(cache.shape)}")
    if width != q_lora + latent:
        raise ValueError(f"qkv must be [n, q_lora + kv_lora + rope] = [n, {q_lora + latent}] (cache width "
                         f"{latent}), got {list(qkv.shape)}")
    if rows > 1 and cache.stride(0) < latent:
        raise ValueError(f"rows of cache overlap (row stride {cache.stride(0)} < {latent})")
    for name, w, size, layout in (("q_ln", q_ln, q_lora, "[q_lora]"), ("kv_ln", kv_ln, kv_lora, "[kv_lora]")):
        _check(name, w, 1, layout, qkv, "qkv")
        _check_shape(name, w, (size,), layout)
    per = n if per_request is None else per_request
    _check_int("request_stride", request_stride, 0, rows)
    if per_request is not None:
        _check_int("per_request", per, 1, max(n, 1))
    if n and (n % per or n > per and request_stride < per):
        raise ValueError(f"per_request must divide n ({n}) and request_stride ({request_stride}) be >= it (requests' "
                         f"rows must not overlap), got {per_request}")
    last = (n - 1) // per * request_stride + per if n else 0  # one past the last row written, from pos
    if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0 or pos + last > rows:
        raise ValueError(f"pos must be an int with 0 <= pos and pos + n <= cache rows (n {n}, rows {rows}), "
                         f"got {pos!r}")
    pdl = _pdl_on(pdl, qkv)
    if not _use_kernel(qkv):
        return mla_prep_reference(qkv, q_ln, kv_ln, cache, pos, q_lora, kv_lora, eps, per, request_stride)
    q_a = torch.empty(n, q_lora, dtype=qkv.dtype, device=qkv.device)
    if n:
        block_q, block_kv = triton.next_power_of_2(q_lora), triton.next_power_of_2(kv_lora)
        warps = max(1, min(16, max(block_q, block_kv) // 512))  # 16 values per thread, as fused_ops' rmsnorm
        _mla_prep_kernel[(n, 2)](qkv, q_ln, kv_ln, cache, q_a, qkv.stride(0), cache.stride(0), pos, per,
                                 request_stride, eps,
                                 Q_LORA=q_lora, KV_LORA=kv_lora, ROPE=rope, BLOCK_Q=block_q, BLOCK_KV=block_kv,
                                 BLOCK_R=triton.next_power_of_2(max(rope, 1)), PDL=pdl, num_warps=warps,
                                 **pdl_mod.launch_kwargs(pdl))
    return q_a


def q_absorb(qh: torch.Tensor, w_uk: torch.Tensor, rope: int, *, pdl: bool | None = None) -> torch.Tensor:
    """qh [n, heads, nope + rope] (last-dim stride 1, e.g. a view of the [n, heads * (nope + rope)] q_b output),
    w_uk [heads, nope, kv_lora] contiguous -> q [heads, n, kv_lora + rope] contiguous: the absorbed nope part, then
    the rope part. One launch: bmm + cat."""
    _check("qh", qh, 3, "[n, heads, nope + rope]")
    _check("w_uk", w_uk, 3, "[heads, nope, kv_lora]", qh, "qh")
    _check_same_dtype("w_uk", w_uk, qh, "qh")
    if not w_uk.is_contiguous():
        raise ValueError(f"w_uk must be contiguous, got strides {w_uk.stride()}")
    n, heads, width = qh.shape
    _check_int("rope", rope, 0, max(width - 1, 0))
    nope = width - rope
    kv_lora = w_uk.shape[2]
    _check_shape("w_uk", w_uk, (heads, nope, kv_lora), "[heads, nope, kv_lora]")
    if not 1 <= nope <= MAX_NOPE or kv_lora < 1:
        raise ValueError(f"q_absorb needs nope in 1..{MAX_NOPE} and kv_lora >= 1, got nope {nope}, kv_lora {kv_lora}")
    pdl = _pdl_on(pdl, qh)
    if not _use_kernel(qh):
        return q_absorb_reference(qh, w_uk, rope)
    q = torch.empty(heads, n, kv_lora + rope, dtype=qh.dtype, device=qh.device)
    if n and heads:
        block_c = min(BLOCK_C, max(16, triton.next_power_of_2(kv_lora)))
        _q_absorb_kernel[(heads, triton.cdiv(kv_lora, block_c))](
            qh, w_uk, q, n, qh.stride(0), qh.stride(1), NOPE=nope, ROPE=rope, KV_LORA=kv_lora, BLOCK_N=ROWS,
            BLOCK_K=max(16, triton.next_power_of_2(nope)), BLOCK_C=block_c,
            BLOCK_R=triton.next_power_of_2(max(rope, 1)), PDL=pdl, num_warps=4, **pdl_mod.launch_kwargs(pdl))
    return q


def v_up(o_lat: torch.Tensor, w_uv: torch.Tensor, *, pdl: bool | None = None) -> torch.Tensor:
    """o_lat [heads, n, kv_lora] (last-dim stride 1), w_uv [heads, kv_lora, v_head] contiguous -> o [n, heads * v_head]
    contiguous, ready for o_proj. One launch: bmm + the transpose copy."""
    _check("o_lat", o_lat, 3, "[heads, n, kv_lora]")
    _check("w_uv", w_uv, 3, "[heads, kv_lora, v_head]", o_lat, "o_lat")
    _check_same_dtype("w_uv", w_uv, o_lat, "o_lat")
    if not w_uv.is_contiguous():
        raise ValueError(f"w_uv must be contiguous, got strides {w_uv.stride()}")
    heads, n, kv_lora = o_lat.shape
    v_head = w_uv.shape[2]
    _check_shape("w_uv", w_uv, (heads, kv_lora, v_head), "[heads, kv_lora, v_head]")
    if not 1 <= kv_lora <= MAX_KV_LORA or v_head < 1:
        raise ValueError(f"v_up needs kv_lora in 1..{MAX_KV_LORA} and v_head >= 1, got {kv_lora}, {v_head}")
    pdl = _pdl_on(pdl, o_lat)
    if not _use_kernel(o_lat):
        return v_up_reference(o_lat, w_uv)
    o = torch.empty(n, heads * v_head, dtype=o_lat.dtype, device=o_lat.device)
    if n and heads:
        _v_up_kernel[(heads, triton.cdiv(v_head, BLOCK_V))](
            o_lat, w_uv, o, n, o_lat.stride(0), o_lat.stride(1), HEADS=heads, KV_LORA=kv_lora, V_HEAD=v_head,
            BLOCK_N=ROWS, BLOCK_K=max(16, triton.next_power_of_2(kv_lora)), BLOCK_V=BLOCK_V, PDL=pdl, num_warps=4,
            **pdl_mod.launch_kwargs(pdl))
    return o


# ---------------------------------------------------------------------------------------------------- references

def mla_prep_reference(qkv: torch.Tensor, q_ln: torch.Tensor, kv_ln: torch.Tensor, cache: torch.Tensor, pos: int,
                       q_lora: int, kv_lora: int, eps: float = 1e-6, per_request: int | None = None,
                       request_stride: int = 0) -> torch.Tensor:
    per = per_request or max(qkv.shape[0], 1)
    for b in range(0, qkv.shape[0], per):
        slots = cache[pos + b // per * request_stride: pos + b // per * request_stride + per]
        slots[:, :kv_lora] = rmsnorm_reference(qkv[b: b + per, q_lora: q_lora + kv_lora], kv_ln, eps)
        slots[:, kv_lora:] = qkv[b: b + per, q_lora + kv_lora:]
    return rmsnorm_reference(qkv[:, :q_lora], q_ln, eps)


def q_absorb_reference(qh: torch.Tensor, w_uk: torch.Tensor, rope: int) -> torch.Tensor:
    nope = qh.shape[2] - rope
    lat = torch.bmm(qh[:, :, :nope].transpose(0, 1).float(), w_uk.float()).to(qh.dtype)
    return torch.cat([lat, qh[:, :, nope:].transpose(0, 1)], dim=-1)


def v_up_reference(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    heads, n, _ = o_lat.shape
    o = torch.bmm(o_lat.float(), w_uv.float()).to(o_lat.dtype)
    return o.transpose(0, 1).reshape(n, heads * w_uv.shape[2])
