"""The Triton kernels of the skinny GEMM (api.py): y = x @ w.T for n <= 16 tokens, w streamed once, split
over K where the column blocks are too few to fill the SMs; `launch` runs them for a checked call and a complete config.

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
PDL (common/pdl.py; pdl=None follows pdl.enabled): every Triton launch of a call gets launch_pdl and a PDL constexpr.
Only w (static weights) loads before gdc_wait(), then gdc_launch_dependents(); nothing is stored and no counter is
touched before the wait (the previous kernel may still read y's memory, the counters or x). "dot" issues its first
w tile before the wait (that step peeled off the pipelined loop, whose cp.async pipelining is unchanged; for
shared_down's K = 256 the whole w tile; the peeled tile costs one more stage of shared memory); "fma" its first w
tile; the "kernel" reduce waits at its top (it reads the partials).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from verifybench.kernels.common import pdl as _pdl
from verifybench.kernels.common.devices import DEFAULT_SMS

DOT_BLOCK_M = 16  # tl.dot needs every dimension >= 16: tokens are padded to 16
COUNTER_SLOTS = 1 << 14  # column blocks a split launch may have (N / BLOCK_N); grown outside capture if needed


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


# ---------------------------------------------------------------------------------------------------- launch

def auto_split_k(N: int, K: int, block_n: int, block_k: int, sms: int = DEFAULT_SMS) -> int:
    """SPLIT_K so that column blocks x splits >= 2 x SMs (each SM gets >= 2 programs' worth of bytes in flight),
    never more splits than BLOCK_K steps."""
    blocks, steps = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    return max(1, min(steps, triton.cdiv(2 * sms, blocks)))


def plan(n: int, N: int, K: int, cfg: dict, sms: int = DEFAULT_SMS) -> dict:
    """Launch geometry of a config: column blocks, effective splits (no empty split), K per split."""
    block_k = cfg["BLOCK_K"]
    steps = triton.cdiv(K, block_k)
    split = cfg["SPLIT_K"] or auto_split_k(N, K, cfg["BLOCK_N"], block_k, sms)
    per_split = triton.cdiv(steps, min(split, steps))
    return {"blocks": triton.cdiv(N, cfg["BLOCK_N"]), "split": triton.cdiv(steps, per_split),
            "k_per_split": per_split * block_k}


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


def launch(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None, act: bool, cfg: dict, sms: int,
           pdl: bool) -> torch.Tensor:
    """y [n, N] = x @ w.T (+ add) with a complete "dot" or "fma" config on `sms` SMs (linear checks the inputs and
    picks the config); the split partials are fp32 scratch from torch's caching allocator."""
    n, K = x.shape[0], w.shape[1]
    N = w.shape[0]
    geo = plan(n, N, K, cfg, sms)
    blocks, split, k_per_split = geo["blocks"], geo["split"], geo["k_per_split"]
    serial = split > 1 and cfg["reduce"] == "serial"
    y = torch.empty(n, N, dtype=x.dtype, device=x.device)
    partials = torch.empty(split, n, N, dtype=torch.float32, device=x.device) if split > 1 else y
    counters = _counters(x.device, blocks) if serial else y
    even_k = K % cfg["BLOCK_K"] == 0
    has_add = add is not None
    add_t, stride_am = (add, add.stride(0)) if has_add else (y, 0)  # a placeholder pointer when ADD is off
    args = (x, w, y, add_t, partials, counters, n, N, K, x.stride(0), y.stride(0), stride_am, k_per_split, split)
    common = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT=split > 1, SERIAL=serial, EVEN_K=even_k,
                  ADD=has_add, PDL=pdl, ACT=act, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  **_pdl.launch_kwargs(pdl))
    if cfg["kind"] == "dot":
        _dot_kernel[(blocks, split)](*args, BLOCK_M=DOT_BLOCK_M, IEEE=x.dtype == torch.float32, **common)
    else:
        _fma_kernel[(blocks, split)](*args, BLOCK_M=triton.next_power_of_2(n), VEC=16 // x.element_size(),
                                     **common)
    if split > 1 and not serial:
        block = 1024
        _reduce_kernel[(triton.cdiv(n * N, block),)](partials, y, add_t, n, N, y.stride(0), stride_am, split,
                                                     BLOCK=block, ADD=has_add, PDL=pdl, num_warps=4,
                                                     **_pdl.launch_kwargs(pdl))
    return y
