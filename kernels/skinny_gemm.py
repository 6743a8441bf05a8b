"""Skinny GEMM y = x @ w.T for the bf16 projections of the verify forward: x [n, K] with n <= 16
tokens, w [N, K] streamed from DRAM once. cuBLAS runs these as weight-streaming GEMV-like GEMMs at ~1/3 of copy
bandwidth for the per-rank Kimi-K2.5 shapes; here each shape and token bucket gets a tuned launch.

Design: a program owns BLOCK_N rows of w (output columns) and one K range. Where cdiv(N, BLOCK_N) programs are too
few to keep every SM streaming (router 384 rows, shared expert 512, q_b 1536), K is split into SPLIT_K ranges, each
its own program, and the fp32 partials [SPLIT_K, n, N] are summed in split order, so results are deterministic:
- reduce "serial" (one launch): each program stores its partial, bumps a per-column-block counter (acq_rel), and
  the program that finishes last sums the partials and writes y, then resets the counter to 0 for the next launch
  or graph replay. The counters live in a per-device int32 buffer zeroed once outside any capture.
- reduce "kernel": a second tiny launch sums the partials (one graph node more, no counters).
Kinds (config "kind"):
- "dot": swap-AB tensor-core tile, tl.dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, 16]) (tokens padded to 16; masked
  rows are never read); Triton's software pipeliner keeps num_stages - 1 tiles of w in flight (cp.async to shared
  memory). The same kernel serves every n <= 16, so its timing barely moves with n.
- "fma": n <= 8, no tensor cores and no shared memory: w tiles go straight to registers as 16-byte vectors, the
  next tile's loads issued before this one is used (register double buffering; the pipeliner only pipelines loads
  that feed a tl.dot), one fp32 accumulator tile per token, each thread's 16-byte slice summed in-thread per step.
Rows past N are clamped (re-read row N-1) rather than masked, so w loads stay unpredicated 16-byte vectors; stores
are masked. fp32 accumulation always; y is rounded once to x's dtype.
add (optional residual [n, N]): y = x @ w.T + add, the add done in fp32 on the accumulator (or on the reduced sum)
and rounded once with it, so e.g. the shared expert's down projection writes routed MoE output + its own in one
launch. Kind "torch" is F.linear then a torch add: rounded twice there.
act="silu_mul" (optional): x is gate_up [n, 2K] and each x tile is silu(gate) * up, computed in fp32 as it loads and
rounded once to x's dtype, so the MLP's activation needs no launch of its own (the tuned tables were timed without it).
PDL (kernels/pdl.py; pdl=None follows pdl.enabled): every Triton launch of a call gets launch_pdl and a PDL constexpr.
Only w (static weights) loads before gdc_wait(), then gdc_launch_dependents(); nothing is stored and no counter is
touched before the wait (the previous kernel may still read y's memory, the counters or x). "dot" issues its first
w tile before the wait (that step peeled off the pipelined loop, whose cp.async pipelining is unchanged; for
shared_down's K = 256 the whole w tile; the peeled tile costs one more stage of shared memory); "fma" its first w
tile; the "kernel" reduce waits at its top (it reads the partials).

The wrapper checks shapes on the host only (no device sync; outputs from torch.empty), so it is CUDA-graph
capturable once compiled. Kernels run for CUDA tensors, and for CPU tensors when TRITON_INTERPRET=1 was set before
import (tests); other CPU tensors take the reference (the CPU smoke profile).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from verifybench.kernels import config_tables
from verifybench.kernels import pdl as _pdl
from verifybench.kernels.config_tables import device_name
from verifybench.kernels.fused_ops import silu_mul_reference

CONFIG_PATH = Path(__file__).with_name("skinny_gemm_configs.json")
MAX_TOKENS = 16
FMA_MAX_TOKENS = 8  # the fma kernel unrolls one accumulator per token, 8 at most
DOT_BLOCK_M = 16  # tl.dot needs every dimension >= 16: tokens are padded to 16
KINDS = ("dot", "fma", "torch")  # "torch": F.linear (cuBLAS), chosen where the tune measured it faster
REDUCES = ("serial", "kernel")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_SMS = 132  # H200; used where no CUDA device reports its count
COUNTER_SLOTS = 1 << 14  # column blocks a split launch may have (N / BLOCK_N); grown outside capture if needed
# Used when the GPU or shape is not in the table (SPLIT_K None: from the shape), the kinds and tiles the H200 table
# picks most: for one or two tokens the fma kernel wherever a row holds more than one of its 1024-element steps
# (15 of the 16 such shape-and-n entries there); else the dot kernel, 32 x 256 tiles over rows of LONG_K elements
# or more (the most frequent winner there) and 64 x 128 over shorter ones. Each fits 101,376 B of shared memory on every supported
# architecture (tests compile them).
DEFAULT_DOT = {"kind": "dot", "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": None, "reduce": "serial", "num_warps": 4,
               "num_stages": 4}
DEFAULT_DOT_LONG_K = {**DEFAULT_DOT, "BLOCK_N": 32, "BLOCK_K": 256}
DEFAULT_FMA = {"kind": "fma", "BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": None, "reduce": "serial", "num_warps": 4,
               "num_stages": 1}
DEFAULT_FMA_MAX_TOKENS = 2
LONG_K = 4096
# triton.jit picks the interpreter at decoration time, so dispatch follows the same moment
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------------- kernels

@triton.jit
def _serial_reduce(p_ptr, y_ptr, add_ptr, cnt_ptr, pid_n, M, N, stride_ym, stride_am, n_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ADD: tl.constexpr):
    """Called by every split program after storing its partial: the last one to arrive sums all partials in split
    order (deterministic), adds `add` (ADD), writes y and re-arms the counter."""
    tl.debug_barrier()  # every thread's partial is stored before the count goes up (release below publishes them)
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == n_split - 1:
        rm = tl.arange(0, BLOCK_M)[:, None]
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        mask = (rm < M) & (rn < N)
        offs = rm * N + rn
        # .cg: read at L2, the point of coherence (other SMs wrote these)
        total = tl.load(p_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, n_split):
            total += tl.load(p_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if ADD:
            total += tl.load(add_ptr + rm * stride_am + rn, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rm * stride_ym + rn, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _w_tile(w_ptrs, k, k1, rk, EVEN_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of w; w is read once: evict_first keeps x and the partials in L2."""
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=(k + rk)[None, :] < k1, other=0.0, eviction_policy="evict_first")
    return w


@triton.jit
def _x_load(ptrs, mask, K, ACT: tl.constexpr):
    """An x tile; ACT: x is gate_up [n, 2K], and the tile is silu(gate) * up (up K columns after gate), in fp32 and
    rounded once to x's dtype (fused_ops.silu_mul_reference)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if ACT:
        g = x.to(tl.float32)
        u = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = (g / (1.0 + tl.exp(-g)) * u).to(x.dtype)
    return x


@triton.jit
def _dot_step(acc, w, x_ptrs, k, k1, rk, m_in, K, EVEN_K: tl.constexpr, IEEE: tl.constexpr, ACT: tl.constexpr):
    """acc += w tile @ x tile^T (x rows past M read as 0)."""
    if EVEN_K:
        xt = _x_load(x_ptrs, m_in, K, ACT)
    else:
        xt = _x_load(x_ptrs, m_in & ((k + rk)[None, :] < k1), K, ACT)
    if IEEE:  # fp32 inputs: full precision, not TF32
        acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(xt), acc)
    return acc


@triton.jit(do_not_specialize=["M", "n_split"])  # one compile serves every n and split
def _dot_kernel(x_ptr, w_ptr, y_ptr, add_ptr, p_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym, stride_am, k_per_split,
                n_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                SERIAL: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, ADD: tl.constexpr,
                PDL: tl.constexpr, ACT: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # clamped, not masked: w loads stay 16-byte vectors
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k0 = pid_k * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * K + (k0 + rk)[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :]
    m_in = rm[:, None] < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # swap-AB: w is the MMA's M side, tokens its N side
    k_loop = k0
    if PDL:  # the first step, peeled off the pipelined loop, streams its w tile (every split has one) before the
        # wait; x may be the previous kernel's output, so it loads after
        w = _w_tile(w_ptrs, k0, k1, rk, EVEN_K)
        gdc_wait()
        gdc_launch_dependents()
        acc = _dot_step(acc, w, x_ptrs, k0, k1, rk, m_in, K, EVEN_K, IEEE, ACT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_loop = k0 + BLOCK_K
    for k in range(k_loop, k1, BLOCK_K):  # the pipeliner keeps num_stages - 1 w and x tiles in flight
        acc = _dot_step(acc, _w_tile(w_ptrs, k, k1, rk, EVEN_K), x_ptrs, k, k1, rk, m_in, K, EVEN_K, IEEE, ACT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    if SPLIT:
        tl.store(p_ptr + (pid_k * M + rm[None, :]) * N + rn[:, None], acc, mask=mask)
        if SERIAL:
            _serial_reduce(p_ptr, y_ptr, add_ptr, cnt_ptr, pid_n, M, N, stride_ym, stride_am, n_split, BLOCK_M,
                           BLOCK_N, ADD)
    else:
        if ADD:
            acc += tl.load(add_ptr + rm[None, :] * stride_am + rn[:, None], mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _x_row(x_ptr, m: tl.constexpr, M, stride_xm, k_mask, K, ACT: tl.constexpr):
    """Token m's activations of this step, [1, BLOCK_K] in the w tile's layout (rows past M read as 0)."""
    return _x_load(x_ptr + m * stride_xm, k_mask & (m < M), K, ACT)


@triton.jit
def _fma(acc, wf, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / VEC] += per-thread 16-byte slice sums of w * x (no data leaves the thread)."""
    prod = wf * x.to(tl.float32)
    return acc + tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)


@triton.jit
def _fma_out(acc, m: tl.constexpr, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am,
             SPLIT: tl.constexpr, ADD: tl.constexpr):
    out = tl.sum(acc, axis=1)
    mask = (rn < N) & (m < M)
    if SPLIT:
        tl.store(p_ptr + (pid_k * M + m) * N + rn, out, mask=mask)
    else:
        if ADD:
            out += tl.load(add_ptr + m * stride_am + rn, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + rn, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "n_split"])
def _fma_kernel(x_ptr, w_ptr, y_ptr, add_ptr, p_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym, stride_am, k_per_split,
                n_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                SPLIT: tl.constexpr, SERIAL: tl.constexpr, EVEN_K: tl.constexpr, ADD: tl.constexpr,
                PDL: tl.constexpr, ACT: tl.constexpr = False):
    # Tokens are unrolled by hand (x0..x7, a0..a7; BLOCK_M in 1, 2, 4, 8): one [BLOCK_N, BLOCK_K / VEC] fp32
    # accumulator each, and their x rows in the w tile's layout, so nothing goes through shared memory.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_K)[None, :]
    k0 = pid_k * k_per_split
    k1 = tl.minimum(k0 + k_per_split, K)
    w_ptrs = w_ptr + rows * K + k0 + cols
    x_ptrs = x_ptr + k0 + cols
    if EVEN_K:
        km = k0 < k1  # uniform: keeps the loads unpredicated per element
    else:
        km = (k0 + cols) < k1
    w = tl.load(w_ptrs, mask=km, other=0.0, eviction_policy="evict_first")  # read once; x and partials stay in L2
    if PDL:  # the first w tile streams in while the previous kernel finishes; x may be its output
        gdc_wait()
        gdc_launch_dependents()
    x0 = _x_row(x_ptrs, 0, M, stride_xm, km, K, ACT)
    a0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    if BLOCK_M > 1:
        x1 = _x_row(x_ptrs, 1, M, stride_xm, km, K, ACT)
        a1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    if BLOCK_M > 2:
        x2 = _x_row(x_ptrs, 2, M, stride_xm, km, K, ACT)
        x3 = _x_row(x_ptrs, 3, M, stride_xm, km, K, ACT)
        a2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        a3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    if BLOCK_M > 4:
        x4 = _x_row(x_ptrs, 4, M, stride_xm, km, K, ACT)
        x5 = _x_row(x_ptrs, 5, M, stride_xm, km, K, ACT)
        x6 = _x_row(x_ptrs, 6, M, stride_xm, km, K, ACT)
        x7 = _x_row(x_ptrs, 7, M, stride_xm, km, K, ACT)
        a4 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        a5 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        a6 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        a7 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    for k in range(k0, k1, BLOCK_K):
        # the next step's loads go out before this step's arithmetic (past k1 they are masked off)
        if EVEN_K:
            nm = k + BLOCK_K < k1
        else:
            nm = (k + BLOCK_K + cols) < k1
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_n = tl.load(w_ptrs, mask=nm, other=0.0, eviction_policy="evict_first")
        y0 = _x_row(x_ptrs, 0, M, stride_xm, nm, K, ACT)
        if BLOCK_M > 1:
            y1 = _x_row(x_ptrs, 1, M, stride_xm, nm, K, ACT)
        if BLOCK_M > 2:
            y2 = _x_row(x_ptrs, 2, M, stride_xm, nm, K, ACT)
            y3 = _x_row(x_ptrs, 3, M, stride_xm, nm, K, ACT)
        if BLOCK_M > 4:
            y4 = _x_row(x_ptrs, 4, M, stride_xm, nm, K, ACT)
            y5 = _x_row(x_ptrs, 5, M, stride_xm, nm, K, ACT)
            y6 = _x_row(x_ptrs, 6, M, stride_xm, nm, K, ACT)
            y7 = _x_row(x_ptrs, 7, M, stride_xm, nm, K, ACT)
        wf = w.to(tl.float32)
        a0 = _fma(a0, wf, x0, BLOCK_N, BLOCK_K, VEC)
        x0 = y0
        if BLOCK_M > 1:
            a1 = _fma(a1, wf, x1, BLOCK_N, BLOCK_K, VEC)
            x1 = y1
        if BLOCK_M > 2:
            a2 = _fma(a2, wf, x2, BLOCK_N, BLOCK_K, VEC)
            a3 = _fma(a3, wf, x3, BLOCK_N, BLOCK_K, VEC)
            x2, x3 = y2, y3
        if BLOCK_M > 4:
            a4 = _fma(a4, wf, x4, BLOCK_N, BLOCK_K, VEC)
            a5 = _fma(a5, wf, x5, BLOCK_N, BLOCK_K, VEC)
            a6 = _fma(a6, wf, x6, BLOCK_N, BLOCK_K, VEC)
            a7 = _fma(a7, wf, x7, BLOCK_N, BLOCK_K, VEC)
            x4, x5, x6, x7 = y4, y5, y6, y7
        w = w_n
    _fma_out(a0, 0, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am, SPLIT, ADD)
    if BLOCK_M > 1:
        _fma_out(a1, 1, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am, SPLIT, ADD)
    if BLOCK_M > 2:
        _fma_out(a2, 2, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am, SPLIT, ADD)
        _fma_out(a3, 3, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am, SPLIT, ADD)
    if BLOCK_M > 4:
        _fma_out(a4, 4, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am, SPLIT, ADD)
        _fma_out(a5, 5, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am, SPLIT, ADD)
        _fma_out(a6, 6, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am, SPLIT, ADD)
        _fma_out(a7, 7, rn, y_ptr, add_ptr, p_ptr, pid_k, M, N, stride_ym, stride_am, SPLIT, ADD)
    if SPLIT and SERIAL:
        _serial_reduce(p_ptr, y_ptr, add_ptr, cnt_ptr, pid_n, M, N, stride_ym, stride_am, n_split, BLOCK_M, BLOCK_N,
                       ADD)


@triton.jit(do_not_specialize=["M", "n_split"])
def _reduce_kernel(p_ptr, y_ptr, add_ptr, M, N, stride_ym, stride_am, n_split, BLOCK: tl.constexpr,
                   ADD: tl.constexpr, PDL: tl.constexpr):
    """reduce "kernel": y[m, n] = sum over s of p[s, m, n], in split order (+ add[m, n])."""
    if PDL:  # the partials are the previous launch's output
        gdc_wait()
        gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    total = tl.load(p_ptr + i, mask=mask, other=0.0)
    for s in range(1, n_split):
        total += tl.load(p_ptr + s * M * N + i, mask=mask, other=0.0)
    m = i // N
    if ADD:
        total += tl.load(add_ptr + m * stride_am + (i - m * N), mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + (i - m * N), total.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------- configs

def _pow2(v) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


def sm_count(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def auto_split_k(N: int, K: int, block_n: int, block_k: int, sms: int = DEFAULT_SMS) -> int:
    """SPLIT_K so that column blocks x splits >= 2 x SMs (each SM gets >= 2 programs' worth of bytes in flight),
    never more splits than BLOCK_K steps."""
    blocks, steps = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    return max(1, min(steps, triton.cdiv(2 * sms, blocks)))


def default_config(n: int, N: int, K: int, sms: int = DEFAULT_SMS, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The untuned choice for n tokens and w [N, K]: DEFAULT_FMA, DEFAULT_DOT_LONG_K or DEFAULT_DOT (see there);
    fp32 the dot kernel with 64-element steps; SPLIT_K from auto_split_k."""
    if dtype == torch.float32:
        cfg = {**DEFAULT_DOT, "BLOCK_K": 64}
    elif n <= DEFAULT_FMA_MAX_TOKENS and K > DEFAULT_FMA["BLOCK_K"]:
        cfg = dict(DEFAULT_FMA)
    else:
        cfg = dict(DEFAULT_DOT_LONG_K if K >= LONG_K else DEFAULT_DOT)
    cfg["SPLIT_K"] = auto_split_k(N, K, cfg["BLOCK_N"], cfg["BLOCK_K"], sms)
    return cfg


def default_configs() -> list[dict]:
    """One config of each tile default_config can return (the 2-byte ones, then fp32's)."""
    return [default_config(1, 4096, LONG_K), default_config(4, 4096, LONG_K), default_config(4, 4096, LONG_K // 4),
            default_config(1, 4096, LONG_K, dtype=torch.float32)]


def check_config(cfg: dict, n: int) -> dict:
    """A complete config (missing keys from DEFAULT_DOT) or a ValueError naming the bad key."""
    if not isinstance(cfg, dict):
        raise ValueError(f"config must be a dict, got {type(cfg).__name__}")
    unknown = set(cfg) - set(DEFAULT_DOT) - set(TABLE_EXTRAS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_DOT)}")
    c = {**DEFAULT_DOT, **cfg}
    if c["kind"] not in KINDS:
        raise ValueError(f"config kind must be one of {KINDS}, got {c['kind']!r}")
    if c["kind"] == "torch":
        return c
    if c["reduce"] not in REDUCES:
        raise ValueError(f"config reduce must be one of {REDUCES}, got {c['reduce']!r}")
    low = 16 if c["kind"] == "dot" else 1  # tl.dot needs >= 16
    if not (_pow2(c["BLOCK_N"]) and low <= c["BLOCK_N"] <= 256):
        raise ValueError(f"BLOCK_N must be a power of two in {low}..256 for kind {c['kind']!r}, got {c['BLOCK_N']}")
    if not (_pow2(c["BLOCK_K"]) and 16 <= c["BLOCK_K"] <= 8192):
        raise ValueError(f"BLOCK_K must be a power of two in 16..8192, got {c['BLOCK_K']}")
    if c["SPLIT_K"] is not None and not (isinstance(c["SPLIT_K"], int) and c["SPLIT_K"] >= 1):
        raise ValueError(f"SPLIT_K must be an int >= 1 (or None: from the shape), got {c['SPLIT_K']!r}")
    if c["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {c['num_warps']!r}")
    if not (isinstance(c["num_stages"], int) and 1 <= c["num_stages"] <= 8):
        raise ValueError(f"num_stages must be an int in 1..8, got {c['num_stages']!r}")
    if c["kind"] == "fma" and n > FMA_MAX_TOKENS:
        raise ValueError(f"kind 'fma' handles n <= {FMA_MAX_TOKENS} tokens, got n={n}; use kind 'dot'")
    return c


# Tiles the tuner sweeps. Dot: (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_N >= 64 with 4 warps runs wgmma on
# sm_90, below it mma.sync; shared memory = stages x (BLOCK_N + 16) x BLOCK_K x 2 B (a stage more with PDL on sm_90,
# the peeled first step), so these span 1-3 CTAs per SM and 64-144 KB of w in flight per SM; the 6-8 stage tiles go
# deeper for a latency-bound CTA; BLOCK_N = 16 gives the 2112-row projection one column block per SM without
# split-K. A tile over a GPU's shared memory is skipped there (fits).
TUNE_DOT_TILES = [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (32, 256, 4, 4), (64, 128, 8, 5),
                  (64, 128, 4, 6), (64, 128, 4, 8), (32, 256, 4, 8), (16, 256, 4, 4), (16, 512, 4, 4),
                  (16, 256, 2, 6)]
# Fma: (BLOCK_N, BLOCK_K, num_warps) per token bucket: BLOCK_K = 8 x 32 x warps x U, so each thread streams U
# 16-byte slices of BLOCK_N rows per step; registers grow with the tokens (x and accumulators are per token).
TUNE_FMA_TILES = {1: [(4, 1024, 4), (8, 1024, 4)], 2: [(4, 1024, 4), (8, 1024, 4)], 4: [(4, 1024, 4), (2, 2048, 8)],
                  8: [(2, 1024, 4), (2, 2048, 8)]}
TABLE_EXTRAS = ("us", "cublas_us", "default_us")  # timings the tuner stores beside a config
_SELECTED: dict[tuple, dict] = {}  # select_config results from the tables (host cost of eager calls)


def dot_config(tile, split=None, reduce="serial") -> dict:
    bn, bk, nw, ns = tile
    return {"kind": "dot", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "reduce": reduce, "num_warps": nw,
            "num_stages": ns}


def fma_config(tile, split=None) -> dict:
    bn, bk, nw = tile
    return {"kind": "fma", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "reduce": "serial", "num_warps": nw,
            "num_stages": 1}


def load_configs(path: Path | str = CONFIG_PATH) -> dict:
    """The tuning table {gpu name: {"shapes": {"N,K": {n bucket: config}}, "tuned_on": {...}}} at `path`; read
    once. Selection reads config_tables.merged(CONFIG_PATH): the user's table over this one."""
    return config_tables.load(path)


def save_configs(table: dict, path: Path | str) -> Path:
    _SELECTED.clear()
    return config_tables.save(table, path)


def shape_key(N: int, K: int) -> str:
    return f"{N},{K}"


# ---------------------------------------------------------------------------------------------------- shared memory

_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_SHARED: dict[tuple, int] = {}


def _itemsize(dtype: str) -> int:
    return torch.finfo(getattr(torch, dtype)).bits // 8


def shared_bytes_bound(config: dict, dtype: str = "bfloat16") -> int:
    """An upper bound of compiled_shared_bytes on every architecture, without compiling (tests hold it to that):
    a stage more than num_stages, and the x tile twice (the fused activation loads gate and up)."""
    c = check_config(config, 1)
    if c["kind"] == "torch":
        return 0
    if c["kind"] == "fma":  # no tiles in shared memory: the per-token reductions' scratch only
        return 8 * 4 * c["BLOCK_N"] * max(32, c["BLOCK_K"] // 8)
    return (c["num_stages"] + 1) * (c["BLOCK_N"] + 2 * DOT_BLOCK_M) * c["BLOCK_K"] * _itemsize(dtype)


def compiled_shared_bytes(config: dict, cc: int, dtype: str = "bfloat16") -> int:
    """Shared memory per block (bytes) the config needs on sm_<cc>, compiled without a GPU: the larger of the fused
    activation on and off, with PDL on sm_90+ (as launched by default; a PDL launch holds the peeled first tile
    too, so without PDL needs no more). fma at 2 tokens: its per-token reductions reuse one scratch. Cached per
    tile; under the interpreter one subprocess without it compiles."""
    c = check_config(config, 1)
    if c["kind"] == "torch":
        return 0
    tile = {k: c[k] for k in ("kind", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    key = (*tile.values(), int(cc), dtype)
    if key not in _SHARED:
        if _INTERPRET:
            _SHARED[key] = config_tables.uninterpreted(__name__, "compiled_shared_bytes", tile, int(cc), dtype)
            return _SHARED[key]
        ty = _TRITON_TYPES[dtype]
        types = {"x_ptr": f"*{ty}", "w_ptr": f"*{ty}", "y_ptr": f"*{ty}", "add_ptr": f"*{ty}", "p_ptr": "*fp32",
                 "cnt_ptr": "*i32", "M": "i32", "n_split": "i32", **{k: "16:i32" for k in (
                     "N", "K", "stride_xm", "stride_ym", "stride_am", "k_per_split")}}
        dot = c["kind"] == "dot"
        consts = dict(BLOCK_M=DOT_BLOCK_M if dot else 2, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                      SPLIT=True, SERIAL=True, EVEN_K=True, ADD=True,
                      **({"IEEE": dtype == "float32"} if dot else {"VEC": 16 // _itemsize(dtype)}))
        opts = {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}
        _SHARED[key] = max(config_tables.compiled_shared(_dot_kernel if dot else _fma_kernel, types,
                                                         {**consts, "ACT": act, "PDL": cc >= 90}, opts, int(cc))
                           for act in (False, True))
    return _SHARED[key]


def fits(config: dict, cc: int, limit: int, dtype: str = "bfloat16") -> tuple[bool, int]:
    """(whether the config fits `limit` bytes of shared memory per block on sm_<cc>, the bytes it needs or its
    bound); compiles only when the bound does not fit."""
    bound = shared_bytes_bound(config, dtype)
    if bound <= limit:
        return True, bound
    need = compiled_shared_bytes(config, cc, dtype)
    return need <= limit, need


def selectable_configs() -> list[dict]:
    """Every config selection or the tuner can pick on some GPU: the defaults (bf16 and fp32 tiles), the tuner's
    tiles and every entry of the shipped table; kind "torch" (cuBLAS) left out, one per tile."""
    out = default_configs()
    out += [dot_config(t) for t in TUNE_DOT_TILES]
    out += [fma_config(t) for tiles in TUNE_FMA_TILES.values() for t in tiles]
    for gpu in load_configs().values():
        for buckets in gpu.get("shapes", {}).values():
            out += [{k: v for k, v in c.items() if k not in TABLE_EXTRAS} for c in buckets.values()]
    seen, unique = set(), []
    for c in out:
        c = check_config(c, 1)
        key = tuple(c[k] for k in ("kind", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
        if c["kind"] != "torch" and key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


# ---------------------------------------------------------------------------------------------------- selection

def select(n: int, N: int, K: int, device, table: dict | None = None,
           dtype: torch.dtype = torch.bfloat16) -> tuple[dict, str]:
    """(config, config_source) for n tokens and w [N, K] on this GPU. The entry of the GPU's name and the shape in
    `table` (default: the shipped table with the user's over it, config_tables.merged), at the smallest tuned n
    bucket >= n (buckets are powers of two, so an fma config runs with the BLOCK_M it was tuned with; the largest
    bucket above every bucket): source "tuned". default_config, source "default", when the GPU or shape is
    missing, the bucket's config cannot serve n (an fma config above 8 tokens), or x is fp32 (the table holds
    2-byte tunings); source "default (tuned entry needs N B ...)" when the entry does not fit the GPU's shared
    memory per block. Selections from the merged tables are recorded for config_tables.defaults_notice."""
    merged = table is None
    table = config_tables.merged(CONFIG_PATH) if merged else table
    gpu = table.get(device_name(device), {})
    buckets = gpu.get("shapes", {}).get(shape_key(N, K))
    cfg, source = None, "default"
    if buckets and dtype != torch.float32:
        keys = sorted(int(b) for b in buckets)
        b = min([k for k in keys if k >= n], default=keys[-1])
        try:
            cfg = check_config({k: v for k, v in buckets[str(b)].items() if k in DEFAULT_DOT}, n)
        except ValueError:
            cfg = None
        limits = config_tables.device_limits(device)
        if cfg is not None and limits is not None:
            ok, need = fits(cfg, *limits, str(dtype).split(".")[1])
            if not ok:
                cfg, source = None, config_tables.fit_source(need, limits[1])
        if cfg is not None:
            source = "tuned"
    if cfg is None:
        cfg = default_config(n, N, K, sm_count(device), dtype)
    if merged:
        config_tables.record("skinny_gemm", device, f"n={n}", source, bool(gpu))
    return cfg, source


def select_config(n: int, N: int, K: int, device, table: dict | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config of select() (see there)."""
    return select(n, N, K, device, table, dtype)[0]


# ---------------------------------------------------------------------------------------------------- wrapper

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
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
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


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, slots: int) -> torch.Tensor:
    """Arrival counters for reduce "serial": a per-device zeroed buffer that every launch leaves zeroed. Made
    outside capture; a capture that finds none gets a zeroed buffer of its own (a memset node, replayed each time)."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= slots:
        return buf
    fresh = torch.zeros(max(slots, COUNTER_SLOTS), dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _COUNTERS[device] = fresh
    return fresh


def plan(n: int, N: int, K: int, cfg: dict, sms: int = DEFAULT_SMS) -> dict:
    """Launch geometry of a config: column blocks, effective splits (no empty split), K per split."""
    block_k = cfg["BLOCK_K"]
    steps = triton.cdiv(K, block_k)
    split = cfg["SPLIT_K"] or auto_split_k(N, K, cfg["BLOCK_N"], block_k, sms)
    per_split = triton.cdiv(steps, min(split, steps))
    return {"blocks": triton.cdiv(N, cfg["BLOCK_N"]), "split": triton.cdiv(steps, per_split),
            "k_per_split": per_split * block_k}


def linear(x: torch.Tensor, w: torch.Tensor, config: dict | None = None, *, add: torch.Tensor | None = None,
           act: str | None = None, pdl: bool | None = None) -> torch.Tensor:
    """y = x @ w.T (+ add): x [n, K] (n <= 16; bf16, fp16 or fp32; any row stride, last-dim stride 1), w [N, K]
    contiguous, same dtype -> y [n, N] in x's dtype, fp32 accumulation.

    config (default: select_config(n, N, K, device)): {"kind": "dot" | "fma" | "torch", "BLOCK_N", "BLOCK_K", "SPLIT_K"
    (None: from the shape), "reduce": "serial" | "kernel", "num_warps", "num_stages"}; see the module doc.
    add: [n, N] in x's dtype and device, last-dim stride 1, any row stride; added in fp32 before the one rounding
    (kind "torch": rounded twice). y is a new tensor, so add never aliases it.
    act "silu_mul": x is gate_up [n, 2K] (gate columns, then up) and y = (silu(gate) * up) @ w.T (+ add), the
    activation computed as each x tile loads (fp32, rounded once to x's dtype: fused_ops.silu_mul_reference):
    the shared expert's and dense MLP's down projections without a separate activation launch.
    pdl: launch with programmatic dependent launch (None: kernels.pdl.enabled(x.device)); True where PDL cannot
    run (CPU, the interpreter, pre-sm_90, VERIFYBENCH_PDL=0) silently runs without it; kind "torch" ignores it."""
    _check_inputs(x, w, act)
    n, K = x.shape[0], w.shape[1]
    N = w.shape[0]
    if add is not None:
        _check_add(add, x, N)
    if not (x.is_cuda or _INTERPRET):
        return linear_reference(x, w, add, act).to(x.dtype)
    if config is None:
        key = (n, N, K, x.device, x.dtype, config_tables.state())
        config = _SELECTED.get(key) or _SELECTED.setdefault(key, select_config(n, N, K, x.device, dtype=x.dtype))
    cfg = check_config(config, n)
    if cfg["kind"] == "torch":
        y = torch.nn.functional.linear(silu_mul_reference(x) if act else x, w)
        return y if add is None else y.add_(add)
    sms = sm_count(x.device)
    geo = plan(n, N, K, cfg, sms)
    blocks, split, k_per_split = geo["blocks"], geo["split"], geo["k_per_split"]
    serial = split > 1 and cfg["reduce"] == "serial"
    y = torch.empty(n, N, dtype=x.dtype, device=x.device)
    partials = torch.empty(split, n, N, dtype=torch.float32, device=x.device) if split > 1 else y
    counters = _counters(x.device, blocks) if serial else y
    even_k = K % cfg["BLOCK_K"] == 0
    on = _pdl.resolve(pdl, x.device)
    has_add = add is not None
    add_t, stride_am = (add, add.stride(0)) if has_add else (y, 0)  # a placeholder pointer when ADD is off
    args = (x, w, y, add_t, partials, counters, n, N, K, x.stride(0), y.stride(0), stride_am, k_per_split, split)
    common = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT=split > 1, SERIAL=serial, EVEN_K=even_k,
                  ADD=has_add, PDL=on, ACT=bool(act), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  **_pdl.launch_kwargs(on))
    if cfg["kind"] == "dot":
        _dot_kernel[(blocks, split)](*args, BLOCK_M=DOT_BLOCK_M, IEEE=x.dtype == torch.float32, **common)
    else:
        _fma_kernel[(blocks, split)](*args, BLOCK_M=triton.next_power_of_2(n), VEC=16 // x.element_size(),
                                     **common)
    if split > 1 and not serial:
        block = 1024
        _reduce_kernel[(triton.cdiv(n * N, block),)](partials, y, add_t, n, N, y.stride(0), stride_am, split,
                                                     BLOCK=block, ADD=has_add, PDL=on, num_warps=4,
                                                     **_pdl.launch_kwargs(on))
    return y
