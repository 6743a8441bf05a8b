"""Fused W4A16 MoE for few tokens (n <= 32) in Triton: two GEMV-style launches that stream each routed expert's
int4 weights, with no sort/align step and no host work in the call (CUDA-graph capturable).

Launch 1, one program per (token-expert pair, split of H, BLOCK_N gate + BLOCK_N up rows): the split's words in
  chunks of BLOCK_W per step, the next chunk's loads issued before this one is computed (PREFETCH); fp32 partial
  gate/up sums per split (SPLIT_K = 1 stores SiLU(g) * u * topk_weight itself).
Launch 2, one program per (token, ROW_ITERS blocks of BLOCK_N rows of H): the columns of one tile are (expert slot,
  word), so all topk experts of the token are loaded at once; it adds the partials in a fixed order, applies SiLU *
  up * topk_weight as it loads its activations, and the combine is a row sum -> y [M, H] in x's dtype (no atomics,
  no memset, deterministic). With "pdl" launch 2 streams its first weight tile while launch 1 finishes
  (programmatic dependent launch, sm_90+).
Pairs of different tokens that share an expert run side by side (pair / token index varies fastest in the grid),
so the second read of those weights hits L2: DRAM streams each distinct expert about once (the SM work is per pair).
Scales are applied once per (row, group) after an in-thread sum over the group's 4 words; masks exist only where
the blocks do not tile the shapes.

Dequantization without int->float conversions: "half2" (CUDA, inline PTX) reads two nibbles at once as an fp16
pair and multiplies them with fp16 pairs of activations; "denormal" (the interpreter's, which cannot run inline
PTX) reads a nibble masked in place as a denormal fp32, n * 16^p * 2^-149, one LOP3, and multiplies it by
x * 2^(64 - 4p); the -8 offset is applied once per group as 8 * sum(x).

Register layout: every tile is 2-D [rows, words] with 4 consecutive words (one 32-value group, a 16-byte load) per
thread and the rows wrapped inside each thread, and the activations are [1, words] tiles in that same layout
(contiguity hints where the compiler cannot see it): triton 3.6 otherwise routes them through shared memory.

Weight layout: the kernels read the "planar" nibble order, made once per weight tensor by a repack
(`kernel_weights`, cached; or `repack_planar` at load with prepacked=True): inside each group nibble i of word w
holds k = 32 g + 4 i + w (checkpoint: 32 g + 8 w + i), so each of the 8 nibble planes multiplies 4 consecutive
activations, one vector load. Same shapes and bytes as the checkpoint.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import weakref
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # PDL (sm_90+; triton >= 3.3)
from triton.runtime.jit import JITFunction

from verifybench.kernels import config_tables
from verifybench.kernels import pdl as _pdl
from verifybench.kernels.config_tables import SMEM_LIMIT_BYTES, device_name  # noqa: F401 (the limits, for callers)
from verifybench.kernels.moe_int4 import PACK, MoeShape, check_moe_inputs, pack_nibbles, unpack_nibbles

CONFIG_PATH = Path(__file__).with_name("moe_int4_configs.json")
# Used on a GPU without a table entry: the winning family (half2 dequant, split kernels; no pdl, which needs sm_90+)
# with the H200 table's blocking in three token ranges (DEFAULT_BLOCKING, keyed by each range's first n): one token
# takes that entry's narrow tiles (2 gate_up rows, one down row per iteration); 2..6 the n = 2 entry's (gate_up 4 rows
# with prefetch, down 8 rows x 4, which wins n = 2..5 and is within 1% at 6); 7 and more the n = 8 entry's. Every
# one fits every supported GPU's shared memory (tests compile them).
DEFAULT_CONFIG = {"dequant": "half2", "pdl": False,
                  "gate_up": {"BLOCK_N": 4, "num_warps": 1, "num_stages": 1, "SPLIT_K": 1, "PREFETCH": 1,
                              "BLOCK_W": 128},
                  "down": {"BLOCK_N": 8, "ROW_ITERS": 4, "num_stages": 1}}
DEFAULT_BLOCKING = {
    1: {"gate_up": {**DEFAULT_CONFIG["gate_up"], "BLOCK_N": 2}, "down": {**DEFAULT_CONFIG["down"], "ROW_ITERS": 1}},
    2: {"gate_up": DEFAULT_CONFIG["gate_up"], "down": DEFAULT_CONFIG["down"]},
    7: {"gate_up": {**DEFAULT_CONFIG["gate_up"], "BLOCK_N": 8, "PREFETCH": 0},
        "down": {**DEFAULT_CONFIG["down"], "ROW_ITERS": 8}},
}
DEQUANTS = ("half2", "denormal")  # half2: group 32, CUDA only (inline PTX)
TUNED_KEYS = ("gate_up", "down", "kernel", "pdl", "dequant")  # what a table entry sets; the rest is its record
# The shapes compiled_shared_bytes compiles at: one Kimi-K2.5 TP8 rank (H 7168, I 256, 384 experts, top-8, g32)
K25_TP8 = MoeShape(tokens=8, hidden=7168, inter=256, experts=384, topk=8, group_size=32)
X_SCALE_DENORMAL = tl.constexpr(2.0**64)  # x * 2^(64-4p) times a nibble read as denormal: n * x * 2^-85
DENORMAL_OFFSET = tl.constexpr(2.0**-82)  # 8 * 2^-85: the -8 of every nibble, applied to sum(x) per group
UNDO_DENORMAL = tl.constexpr(2.0**85)


# ---------------------------------------------------------------------------------------------------- kernels

@triton.jit
def _nib(words, P: tl.constexpr):
    """The nibble at bits 4P..4P+3 of `words` read as a denormal fp32, n * 16^P * 2^-149 (one LOP3, no int->float
    conversion); the caller scales x by 2^(64 - 4P) so products are n * x * 2^-85, and subtracts 8 * sum(x) per
    group."""
    return (words & (15 << (4 * P))).to(tl.float32, bitcast=True)


@triton.jit
def _x_scale(P: tl.constexpr):
    return X_SCALE_DENORMAL * (1.0 / (1 << (4 * P)))


@triton.jit
def _k_of(g, w, i: tl.constexpr, WPG: tl.constexpr):
    """k (within the row) held by nibble i of word w of group g, planar order."""
    return g * (8 * WPG) + i * WPG + w


@triton.jit
def _bf16_bits(bits):
    """bf16 scales loaded as int16 bits -> fp32 (exact: bf16 is the top half of an fp32)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _plane(ptr, word, i: tl.constexpr, mask, WPG: tl.constexpr):
    """Plane i of the activations, [1, W]: ptr + k(word, i)."""
    offs = _k_of(word // WPG, word % WPG, i, WPG)
    # runs of WPG consecutive k: say so, or triton 3.6 loads them in another register layout
    offs = tl.max_contiguous(tl.multiple_of(offs, [1, WPG]), [1, WPG])
    if mask is None:
        v = tl.load(ptr + offs)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0.0)
    return v


@triton.jit
def _load_planes(ptr, word, mask, WPG: tl.constexpr):
    """The 8 activation planes of a chunk of words (shared by every row of the tile)."""
    return (_plane(ptr, word, 0, mask, WPG), _plane(ptr, word, 1, mask, WPG), _plane(ptr, word, 2, mask, WPG),
            _plane(ptr, word, 3, mask, WPG), _plane(ptr, word, 4, mask, WPG), _plane(ptr, word, 5, mask, WPG),
            _plane(ptr, word, 6, mask, WPG), _plane(ptr, word, 7, mask, WPG))


@triton.jit
def _silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u  # fp32 "/" is div.full (approximate) in triton: ~2 ulp


@triton.jit
def _group_sum(t, ROWS: tl.constexpr, G: tl.constexpr, WPG: tl.constexpr):
    """[ROWS, G * WPG] -> [ROWS, G]: the sum over each thread's own WPG words (no data leaves the thread)."""
    return tl.sum(tl.reshape(t, [ROWS, G, WPG]), axis=2)


@triton.jit
def _dot_chunk(wt, x0, x1, x2, x3, x4, x5, x6, x7):
    """sum_i nibble_i(wt) * x_i per word, [rows, W] (x_i pre-scaled by _x_scale(i % 4)); the first plane starts the
    sum (no zero fill)."""
    hi = wt >> 16
    t = _nib(wt, 0) * x0
    t += _nib(wt, 1) * x1
    t += _nib(wt, 2) * x2
    t += _nib(wt, 3) * x3
    t += _nib(hi, 0) * x4
    t += _nib(hi, 1) * x5
    t += _nib(hi, 2) * x6
    t += _nib(hi, 3) * x7
    return t


# ---- "half2" dequant (split kernels, GPU only: inline PTX): packed fp16 pairs, two weights per instruction.
# A word's nibbles i and i + 4 sit at bits 4i and 16 + 4i, so one LOP3 with 0x000F000F << 4i and OR 0x6400 in each
# half reads them as the fp16 pair (1024 + n * 16^i) for i = 0, 1 (for i = 2, 3 from word >> 8); one HADD2/HFMA2
# makes that exactly n - 8, one HFMA2 multiplies it with the matching (x_i, x_{i+4}) pair and accumulates. The 16
# products of each half of a (row, group) are summed in fp16, then the two halves in fp32 and scaled (fp32 from
# there on). Exact dequant; the fp16 sums round (~2^-11 of their size) and need |x| well below 65504 / (8 * 16).
H2_FMA_LO = tl.constexpr(  # (1024 + n) - 1032 = n - 8, then acc + that * x
    "{.reg .b32 t, c; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; mov.b32 c, 0x64086408; sub.f16x2 t, t, c; "
    "fma.rn.f16x2 $0, t, $2, $3;}")
H2_FMA_HI = tl.constexpr(  # (1024 + 16 n) / 16 - 72 = n - 8, then acc + that * x
    "{.reg .b32 t, s, c; lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA; mov.b32 s, 0x2C002C00; "
    "mov.b32 c, 0xD480D480; fma.rn.f16x2 t, t, s, c; fma.rn.f16x2 $0, t, $2, $3;}")
H2_SUM = tl.constexpr(
    "{.reg .f16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; cvt.f32.f16 b, h; add.f32 $0, a, b;}")


@triton.jit
def _h2_pair(lo, hi):
    """Two fp32 tensors -> their fp16 pair (lo in the low half, round to nearest) in an int32 tensor."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _h2_fma(w, xp, acc, HIGH: tl.constexpr):
    """acc + (n - 8) * xp in fp16 pairs: the nibbles at bits 0-3 and 16-19 of w (HIGH: 4-7 and 20-23)."""
    if HIGH:
        r = tl.inline_asm_elementwise(H2_FMA_HI, "=r,r,r,r", [w, xp, acc], dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = tl.inline_asm_elementwise(H2_FMA_LO, "=r,r,r,r", [w, xp, acc], dtype=tl.int32, is_pure=True, pack=1)
    return r


@triton.jit
def _h2_sum(acc):
    """The two fp16 halves of acc added in fp32."""
    return tl.inline_asm_elementwise(H2_SUM, "=f,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _words4(t, ROWS: tl.constexpr, G: tl.constexpr):
    """[ROWS, 4 G] -> the 4 words of each group as [ROWS, G] tensors (each thread holds a whole group: no moves)."""
    a, b = tl.split(tl.reshape(t, [ROWS, G, 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _h2_word(acc, w, p0, p1, p2, p3):
    """acc + one word's 8 products (pairs p0..p3: planes (0, 4), (1, 5), (2, 6), (3, 7))."""
    acc = _h2_fma(w, p0, acc, False)
    acc = _h2_fma(w, p1, acc, True)
    w8 = w >> 8  # nibbles 2, 6 and 3, 7 at the low positions (the sign fill lands above bit 23: masked off)
    acc = _h2_fma(w8, p2, acc, False)
    return _h2_fma(w8, p3, acc, True)


@triton.jit
def _h2_group_dot(wt, p0, p1, p2, p3, ROWS: tl.constexpr, G: tl.constexpr):
    """[ROWS, 4 G] words x the 4 activation pair tiles [1, 4 G] -> per (row, group) sum of (n - 8) * x, fp32."""
    w0, w1, w2, w3 = _words4(wt, ROWS, G)
    a0, a1, a2, a3 = _words4(p0, 1, G)
    b0, b1, b2, b3 = _words4(p1, 1, G)
    c0, c1, c2, c3 = _words4(p2, 1, G)
    d0, d1, d2, d3 = _words4(p3, 1, G)
    acc = tl.zeros([ROWS, G], dtype=tl.int32)  # +0.0 in both halves
    acc = _h2_word(acc, w0, a0, b0, c0, d0)
    acc = _h2_word(acc, w1, a1, b1, c1, d1)
    acc = _h2_word(acc, w2, a2, b2, c2, d2)
    acc = _h2_word(acc, w3, a3, b3, c3, d3)
    return _h2_sum(acc)


@triton.jit
def _gu_load(w_ptrs, s_ptrs, x_row, w0, c0, cols, grp, rmask, WPS: tl.constexpr, UP_W: tl.constexpr,
             UP_S: tl.constexpr, WPG: tl.constexpr, MASKED: tl.constexpr):
    """One chunk of kernel 1: gate and up words [rows, W], their scales [rows, W / WPG], the 8 x planes [1, W]."""
    if MASKED:
        cm = c0 + cols < WPS
        m2 = rmask & cm
        ms = rmask & (c0 // WPG + grp < WPS // WPG)
        wg = tl.load(w_ptrs + c0, mask=m2, other=0)
        wu = tl.load(w_ptrs + UP_W + c0, mask=m2, other=0)
        sg = tl.load(s_ptrs + c0 // WPG, mask=ms, other=0)
        su = tl.load(s_ptrs + UP_S + c0 // WPG, mask=ms, other=0)
    else:  # no masks: no zero fills or predicates (the chunks tile the split and BLOCK_N divides I)
        cm = None
        wg = tl.load(w_ptrs + c0)
        wu = tl.load(w_ptrs + UP_W + c0)
        sg = tl.load(s_ptrs + c0 // WPG)
        su = tl.load(s_ptrs + UP_S + c0 // WPG)
    x0, x1, x2, x3, x4, x5, x6, x7 = _load_planes(x_row, w0 + c0 + cols, cm, WPG)
    return wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N: tl.constexpr,
                G: tl.constexpr, WPG: tl.constexpr, HALF2: tl.constexpr):
    """acc[rows, group] += scale * sum over the group of (nibble - 8) * x, for gate and up."""
    if HALF2:
        p0 = _h2_pair(x0.to(tl.float32), x4.to(tl.float32))
        p1 = _h2_pair(x1.to(tl.float32), x5.to(tl.float32))
        p2 = _h2_pair(x2.to(tl.float32), x6.to(tl.float32))
        p3 = _h2_pair(x3.to(tl.float32), x7.to(tl.float32))
        tg = _h2_group_dot(wg, p0, p1, p2, p3, BLOCK_N, G)
        tu = _h2_group_dot(wu, p0, p1, p2, p3, BLOCK_N, G)
        return acc_g + tg * _bf16_bits(sg), acc_u + tu * _bf16_bits(su)
    f0 = x0.to(tl.float32)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    f3 = x3.to(tl.float32)
    f4 = x4.to(tl.float32)
    f5 = x5.to(tl.float32)
    f6 = x6.to(tl.float32)
    f7 = x7.to(tl.float32)
    c0 = _x_scale(0)
    c1 = _x_scale(1)
    c2 = _x_scale(2)
    c3 = _x_scale(3)
    y0, y1, y2, y3, y4, y5, y6, y7 = f0 * c0, f1 * c1, f2 * c2, f3 * c3, f4 * c0, f5 * c1, f6 * c2, f7 * c3
    tg = _group_sum(_dot_chunk(wg, y0, y1, y2, y3, y4, y5, y6, y7), BLOCK_N, G, WPG)
    tu = _group_sum(_dot_chunk(wu, y0, y1, y2, y3, y4, y5, y6, y7), BLOCK_N, G, WPG)
    # sum((n - 8) x) * 2^-85 = sum(n x 2^-85) - 8 * 2^-85 * sum(x), per group
    off = _group_sum(((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7)), 1, G, WPG) * DENORMAL_OFFSET
    tg -= off
    tu -= off
    return acc_g + tg * _bf16_bits(sg), acc_u + tu * _bf16_bits(su)


@triton.jit(do_not_specialize=["num_pairs"])  # one compile for every n
def _gate_up_split_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, p_ptr, tw_ptr, num_pairs, num_experts, stride_xm,
                          inter: tl.constexpr, words_per_row: tl.constexpr, n_groups: tl.constexpr,
                          TOPK: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                          SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
                          HALF2: tl.constexpr):
    """Split-K gate_up: program (pair, split ks, row block) sums words [ks, ks + 1) * words_per_row / SPLIT_K of
    BLOCK_N gate and BLOCK_N up rows -> fp32 partials p[ks, pair, 0 (gate) | 1 (up), row]; kernel 2 adds them.
    SPLIT_K == 1: the sums are complete here, so it stores SiLU(g) * u * topk_weight in p[0, pair, 0, row] instead.
    Scales are loaded and applied once per (row, group): the [rows, words] products are summed over each thread's
    own group first (a reshape that keeps every value in its thread)."""
    pid = tl.program_id(0)
    pair = pid % num_pairs
    ks = (pid // num_pairs) % SPLIT_K
    nb = pid // (num_pairs * SPLIT_K)
    if WAIT:  # launched with PDL itself (kernels/pdl.py): x, ids and weights come from the kernels before
        gdc_wait()
    if PDL:  # kernel 2 may start (and stream its weights) once every program of this one has started
        gdc_launch_dependents()
    WPS: tl.constexpr = words_per_row // SPLIT_K
    G: tl.constexpr = BLOCK_W // WPG
    MASKED: tl.constexpr = (WPS % BLOCK_W != 0) or (inter % BLOCK_N != 0)
    e = tl.load(ids_ptr + pair).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 0), num_experts - 1)
    tok = pair // TOPK
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows[:, None] < inter
    cols = tl.arange(0, BLOCK_W)[None, :]
    grp = tl.arange(0, G)[None, :]
    w0 = ks * WPS
    gate_rows = (e.to(tl.int64) * (2 * inter) + rows)[:, None]
    w_ptrs = w_ptr + gate_rows * words_per_row + w0 + cols
    s_ptrs = s_ptr + gate_rows * n_groups + w0 // WPG + grp
    x_row = x_ptr + tok * stride_xm
    UP_W: tl.constexpr = inter * words_per_row
    UP_S: tl.constexpr = inter * n_groups
    acc_g = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7 = _gu_load(w_ptrs, s_ptrs, x_row, w0, 0, cols, grp, rmask, WPS,
                                                              UP_W, UP_S, WPG, MASKED)
    if PREFETCH:  # register double buffering: chunk c0's loads are issued before the previous chunk is computed
        for c0 in range(BLOCK_W, WPS, BLOCK_W):
            ng, nu, tg, tu, y0, y1, y2, y3, y4, y5, y6, y7 = _gu_load(w_ptrs, s_ptrs, x_row, w0, c0, cols, grp, rmask,
                                                                      WPS, UP_W, UP_S, WPG, MASKED)
            acc_g, acc_u = _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N,
                                       G, WPG, HALF2)
            wg, wu, sg, su = ng, nu, tg, tu
            x0, x1, x2, x3, x4, x5, x6, x7 = y0, y1, y2, y3, y4, y5, y6, y7
        acc_g, acc_u = _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N, G,
                                   WPG, HALF2)
    else:
        acc_g, acc_u = _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N, G,
                                   WPG, HALF2)
        for c0 in range(BLOCK_W, WPS, BLOCK_W):
            wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7 = _gu_load(w_ptrs, s_ptrs, x_row, w0, c0, cols, grp, rmask,
                                                                      WPS, UP_W, UP_S, WPG, MASKED)
            acc_g, acc_u = _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N,
                                       G, WPG, HALF2)
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if not HALF2:
        gate = gate * UNDO_DENORMAL
        up = up * UNDO_DENORMAL
    out = p_ptr + (ks * num_pairs + pair).to(tl.int64) * (2 * inter) + rows
    if SPLIT_K == 1:
        tl.store(out, _silu_mul(gate, up) * tl.load(tw_ptr + pair).to(tl.float32), mask=rows < inter)
    else:
        tl.store(out, gate, mask=rows < inter)
        tl.store(out + inter, up, mask=rows < inter)


@triton.jit
def _act_plane(p_ptr, pair, tw, word, i: tl.constexpr, mask, num_pairs, inter: tl.constexpr, SPLIT_K: tl.constexpr,
               WPG: tl.constexpr):
    """Plane i of SiLU(gate) * up * topk_weight, [1, W]: the SPLIT_K partials of kernel 1 summed in a fixed order
    (SPLIT_K == 1: kernel 1 stored the product itself)."""
    offs = pair * (2 * inter) + _k_of(word // WPG, word % WPG, i, WPG)
    offs = tl.max_contiguous(tl.multiple_of(offs, [1, WPG]), [1, WPG])
    if SPLIT_K == 1:
        a = tl.load(p_ptr + offs, mask=mask, other=0.0)
    else:
        g = tl.load(p_ptr + offs, mask=mask, other=0.0)
        u = tl.load(p_ptr + offs + inter, mask=mask, other=0.0)
        for ks in tl.static_range(1, SPLIT_K):
            g += tl.load(p_ptr + ks * num_pairs * (2 * inter) + offs, mask=mask, other=0.0)
            u += tl.load(p_ptr + ks * num_pairs * (2 * inter) + offs + inter, mask=mask, other=0.0)
        a = _silu_mul(g, u) * tw
    return a


@triton.jit(do_not_specialize=["num_pairs", "M"])
def _down_split_kernel(p_ptr, tw_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, num_pairs, num_experts, hidden, stride_om, M,
                       inter: tl.constexpr, words_per_row: tl.constexpr, n_groups: tl.constexpr,
                       TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr,
                       ROW_ITERS: tl.constexpr, WORDS: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
                       HALF2: tl.constexpr):
    """Kernel 2: program (token, ROW_ITERS blocks of BLOCK_N rows of H); the columns of a tile are (expert slot,
    word), so all topk experts of the token are loaded at once and the combine is a row sum. It builds the
    activations itself from kernel 1's partials (sum over splits in a fixed order, SiLU(g) * u * topk_weight),
    applies scales per (row, group) like _gate_up_split_kernel, and loads its first weight tile before waiting for
    kernel 1 (PDL)."""
    pid = tl.program_id(0)
    tok = pid % M
    hb = pid // M
    C: tl.constexpr = BLOCK_TOPK * WORDS
    CG: tl.constexpr = C // WPG
    cols = tl.arange(0, C)[None, :]
    j = cols // WORDS
    word = cols % WORDS
    cmask = (j < TOPK) & (word < words_per_row)
    pair = tok * TOPK + j
    e = tl.load(ids_ptr + pair, mask=cmask, other=0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 0), num_experts - 1)
    gcol = tl.arange(0, CG)[None, :]  # (slot, group) columns of the scale tile
    gj = gcol // (WORDS // WPG)
    ggrp = gcol % (WORDS // WPG)
    gmask = (gj < TOPK) & (ggrp < n_groups)
    eg = tl.load(ids_ptr + tok * TOPK + gj, mask=gmask, other=0).to(tl.int32)
    eg = tl.minimum(tl.maximum(eg, 0), num_experts - 1)
    r = tl.arange(0, BLOCK_N)[:, None]
    row0 = hb * (BLOCK_N * ROW_ITERS)
    w_offs = tl.max_contiguous(tl.multiple_of((e.to(tl.int64) * hidden + r) * words_per_row + word, [1, WPG]),
                               [1, WPG])
    s_offs = (eg.to(tl.int64) * hidden + r) * n_groups + ggrp
    m2 = ((row0 + r) < hidden) & cmask
    ms = ((row0 + r) < hidden) & gmask
    wt = tl.load(w_ptr + w_offs + row0 * words_per_row, mask=m2, other=0)
    sc = tl.load(s_ptr + s_offs + row0 * n_groups, mask=ms, other=0)
    if PDL:  # everything above is independent of kernel 1; its partials are read below
        gdc_wait()
        gdc_launch_dependents()  # the kernel after the MoE may start (if it was launched with PDL)
    tw = tl.load(tw_ptr + pair, mask=cmask, other=0.0).to(tl.float32)
    a0 = _act_plane(p_ptr, pair, tw, word, 0, cmask, num_pairs, inter, SPLIT_K, WPG)
    a1 = _act_plane(p_ptr, pair, tw, word, 1, cmask, num_pairs, inter, SPLIT_K, WPG)
    a2 = _act_plane(p_ptr, pair, tw, word, 2, cmask, num_pairs, inter, SPLIT_K, WPG)
    a3 = _act_plane(p_ptr, pair, tw, word, 3, cmask, num_pairs, inter, SPLIT_K, WPG)
    a4 = _act_plane(p_ptr, pair, tw, word, 4, cmask, num_pairs, inter, SPLIT_K, WPG)
    a5 = _act_plane(p_ptr, pair, tw, word, 5, cmask, num_pairs, inter, SPLIT_K, WPG)
    a6 = _act_plane(p_ptr, pair, tw, word, 6, cmask, num_pairs, inter, SPLIT_K, WPG)
    a7 = _act_plane(p_ptr, pair, tw, word, 7, cmask, num_pairs, inter, SPLIT_K, WPG)
    if HALF2:  # the activations as fp16 pairs of planes (i, i + 4), see _h2_fma
        p0, p1, p2, p3 = _h2_pair(a0, a4), _h2_pair(a1, a5), _h2_pair(a2, a6), _h2_pair(a3, a7)
    else:
        off = _group_sum(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), 1, CG, WPG) * DENORMAL_OFFSET
        c0 = _x_scale(0)
        c1 = _x_scale(1)
        c2 = _x_scale(2)
        c3 = _x_scale(3)
        a0, a1, a2, a3, a4, a5, a6, a7 = a0 * c0, a1 * c1, a2 * c2, a3 * c3, a4 * c0, a5 * c1, a6 * c2, a7 * c3
    for it in tl.static_range(ROW_ITERS):
        rows = row0 + it * BLOCK_N
        if it + 1 < ROW_ITERS:  # prefetch the next row block while this one is computed
            m2n = ((rows + BLOCK_N + r) < hidden) & cmask
            msn = ((rows + BLOCK_N + r) < hidden) & gmask
            wt_n = tl.load(w_ptr + w_offs + (rows + BLOCK_N) * words_per_row, mask=m2n, other=0)
            sc_n = tl.load(s_ptr + s_offs + (rows + BLOCK_N) * n_groups, mask=msn, other=0)
        if HALF2:
            y = tl.sum(_h2_group_dot(wt, p0, p1, p2, p3, BLOCK_N, CG) * _bf16_bits(sc), axis=1)
        else:
            t = _group_sum(_dot_chunk(wt, a0, a1, a2, a3, a4, a5, a6, a7), BLOCK_N, CG, WPG) - off
            y = tl.sum(t * _bf16_bits(sc), axis=1) * UNDO_DENORMAL
        out_rows = rows + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + tok * stride_om + out_rows, y.to(out_ptr.dtype.element_ty), mask=out_rows < hidden)
        if it + 1 < ROW_ITERS:
            wt, sc = wt_n, sc_n


# ---------------------------------------------------------------------------------------------------- layout

def repack_planar(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """Checkpoint nibble order -> planar: in each group, nibble i of word w holds k = group_size*g + (group/8)*i + w.
    Same shape and dtype; done in chunks of the leading dimension to bound the temporary memory."""
    wpg = group_size // PACK
    out = torch.empty_like(packed)
    flat_in, flat_out = packed.reshape(-1, packed.shape[-1]), out.view(-1, packed.shape[-1])
    step = max(1, (64 << 20) // (packed.shape[-1] * PACK * 4))
    for r in range(0, flat_in.shape[0], step):
        q = unpack_nibbles(flat_in[r:r + step])  # [rows, K] in k order
        rows, k = q.shape
        q = q.reshape(rows, k // group_size, PACK, wpg).transpose(-1, -2)  # [.., g, w, i] = k of plane i, word w
        flat_out[r:r + step] = pack_nibbles(q.reshape(rows, k))
    return out


def checkpoint_from_planar(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of repack_planar: planar nibble order -> checkpoint order (for checking prepacked weights)."""
    wpg = group_size // PACK
    q = unpack_nibbles(packed.reshape(-1, packed.shape[-1]))
    rows, k = q.shape
    q = q.reshape(rows, k // group_size, wpg, PACK).transpose(-1, -2)
    return pack_nibbles(q.reshape(rows, k)).view(packed.shape)


_CACHE: dict[tuple, tuple] = {}


def kernel_weights(packed: torch.Tensor, scales: torch.Tensor,
                   prepacked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors the kernels read: (packed in planar order, scales as int16 bits), contiguous. The planar repack
    runs once per (tensor, version) and is cached until the source tensor is freed (it doubles that tensor's memory
    meanwhile); call it outside any timed region or graph capture (the bench's check and warm-up do). prepacked:
    `packed` is planar already."""
    scale_bits = scales.contiguous().view(torch.int16)
    if prepacked:
        return packed.contiguous(), scale_bits
    key = (id(packed), packed._version)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is packed:
        return hit[1], scale_bits
    repacked = repack_planar(packed.contiguous(), packed.shape[-1] * PACK // scales.shape[-1])
    _CACHE[key] = (weakref.ref(packed), repacked)
    weakref.finalize(packed, _CACHE.pop, key, None)
    return repacked, scale_bits


# ---------------------------------------------------------------------------------------------------- configs

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_config(device, m: int = 2) -> dict:
    """The config for m tokens on a GPU without a table entry: DEFAULT_CONFIG with the DEFAULT_BLOCKING of m's
    range; in the interpreter (no inline PTX) the same blocking with the "denormal" dequant."""
    first = max([k for k in DEFAULT_BLOCKING if k <= m], default=min(DEFAULT_BLOCKING))
    cfg = {**DEFAULT_CONFIG, **copy.deepcopy(DEFAULT_BLOCKING[first])}
    if torch.device(device).type == "cuda" and not _interpreting():
        return cfg
    return {**cfg, "dequant": "denormal"}


def load_configs(path: Path | str = CONFIG_PATH) -> dict:
    """The tuning table {gpu name: {"dequant", "by_n": {n: {"gate_up", "down", "dequant", "pdl", ...}}}} at `path`;
    read once. Selection reads config_tables.merged(CONFIG_PATH): the user's table over this one."""
    return config_tables.load(path)


def save_configs(table: dict, path: Path | str = CONFIG_PATH) -> Path:
    _SELECTED.clear()
    return config_tables.save(table, path)


def _entry_config(entry: dict, tuned: dict, default: dict) -> dict:
    """A table entry at one n completed from `default`: the entry's dequant, then what the n sets."""
    return {**default, **{k: v for k, v in entry.items() if k == "dequant"},
            **{k: v for k, v in tuned.items() if k in TUNED_KEYS}}


def misfit(config: dict, device, shape: MoeShape = K25_TP8) -> tuple[int, int] | None:
    """(bytes needed, bytes allowed) when `config`'s kernels do not fit the shared memory per block of `device`;
    None when they do, and always off CUDA (the interpreter has no shared memory to fit)."""
    limits = None if _interpreting() else config_tables.device_limits(device)
    if limits is None:
        return None
    need = compiled_shared_bytes(config, limits[0], shape)
    return None if need <= limits[1] else (need, limits[1])


def select(m: int, device, table: dict | None = None) -> tuple[dict, str]:
    """(config, config_source) for m tokens on this GPU. The entry of the GPU's name in `table` (default: the
    shipped table with the user's over it, config_tables.merged) at the largest tuned n <= m (the smallest above,
    for m below every key): source "tuned"; default_config, source "default", when the GPU is not in the table;
    source "default (tuned entry needs N B ...)" when the entry's kernels do not fit the GPU's shared memory per
    block. Selections from the merged tables are recorded for config_tables.defaults_notice."""
    merged = table is None
    table = config_tables.merged(CONFIG_PATH) if merged else table
    entry = table.get(device_name(device)) or {}
    cfg, source = default_config(device, m), "default"
    if entry.get("by_n"):
        keys = sorted(int(k) for k in entry["by_n"])
        n = max([k for k in keys if k <= m], default=keys[0])
        tuned = _entry_config(entry, entry["by_n"][str(n)], cfg)
        too_big = misfit(tuned, device)
        if too_big:
            source = config_tables.fit_source(*too_big)
        else:
            cfg, source = tuned, "tuned"
    if merged:
        config_tables.record("moe_int4", device, f"n={m}", source, bool(entry))
    return cfg, source


_SELECTED: dict[tuple, dict] = {}  # select_config from the tables (host cost of eager calls)


def select_config(m: int, device, table: dict | None = None) -> dict:
    """The config of select() (see there); from the tables, cached per config_tables.state()."""
    if table is not None:
        return select(m, device, table)[0]
    key = (m, str(device), config_tables.state())
    if key not in _SELECTED:
        _SELECTED[key] = select(m, device)[0]
    return dict(_SELECTED[key])


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def check_config(cfg: dict, s, device: torch.device) -> None:
    """ValueError naming the key for a config these shapes cannot run (checked on the host, before any launch)."""
    if cfg.get("kernel", "split") != "split":
        raise ValueError(f"kernel must be 'split' (the only kernel), got {cfg['kernel']!r}")
    if cfg.get("layout", "planar") != "planar":
        raise ValueError(f"layout must be 'planar' (the kernels read the planar order; kernel_weights repacks "
                         f"checkpoint weights), got {cfg['layout']!r}")
    if cfg["dequant"] not in DEQUANTS:
        raise ValueError(f"dequant must be one of {DEQUANTS}, got {cfg['dequant']!r}")
    c1, c2 = cfg["gate_up"], cfg["down"]
    for where, c, keys in (("gate_up", c1, ("BLOCK_N", "num_warps")), ("down", c2, ("BLOCK_N",))):
        for key in keys:
            if not _pow2(c.get(key)):
                raise ValueError(f"{where}.{key} must be a power of two, got {c.get(key)!r}")
    if not isinstance(c2.get("ROW_ITERS", 1), int) or c2.get("ROW_ITERS", 1) < 1:
        raise ValueError(f"down.ROW_ITERS must be an int >= 1, got {c2.get('ROW_ITERS')!r}")
    if "num_warps" in c2 and not _pow2(c2["num_warps"]):
        raise ValueError(f"down.num_warps must be a power of two, got {c2['num_warps']!r}")
    if cfg["dequant"] == "half2" and s.group_size != 32:
        raise ValueError(f"dequant 'half2' needs group size 32 (4 words per group), got {s.group_size}")
    n_groups = s.hidden // s.group_size
    split = c1.get("SPLIT_K", 1)
    if not isinstance(split, int) or isinstance(split, bool) or split < 1 or n_groups % split:
        raise ValueError(f"gate_up.SPLIT_K must divide the {n_groups} groups of a gate_up row "
                         f"(H {s.hidden} / group {s.group_size}), got {split!r}")
    wpg = s.group_size // PACK
    if "BLOCK_W" in c1 and (not _pow2(c1["BLOCK_W"]) or c1["BLOCK_W"] < wpg):
        raise ValueError(f"gate_up.BLOCK_W must be a power of two >= {wpg} words (one group), got {c1['BLOCK_W']!r}")
    if c1.get("PREFETCH", 1) not in (0, 1, False, True):
        raise ValueError(f"gate_up.PREFETCH must be 0 or 1, got {c1['PREFETCH']!r}")
    if cfg.get("pdl") and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        raise ValueError("pdl (programmatic dependent launch) needs sm_90 or newer")


def _launches(cfg: dict, s, pdl: bool, chain: bool) -> list[tuple]:
    """(kernel, grid, constexprs, options) of the two launches of a checked config at shapes `s`."""
    c1, c2 = cfg["gate_up"], cfg["down"]
    wpg, words1 = s.group_size // PACK, s.hidden // PACK
    split, warps1 = c1.get("SPLIT_K", 1), c1["num_warps"]
    words2, block_topk = triton.next_power_of_2(s.inter // PACK), triton.next_power_of_2(s.topk)
    half2 = cfg["dequant"] == "half2"
    gate_up = dict(inter=s.inter, words_per_row=words1, n_groups=s.hidden // s.group_size, TOPK=s.topk, WPG=wpg,
                   BLOCK_N=c1["BLOCK_N"], BLOCK_W=c1.get("BLOCK_W", min(128 * warps1,
                                                                        triton.next_power_of_2(words1 // split))),
                   SPLIT_K=split, PREFETCH=int(c1.get("PREFETCH", 1)), PDL=pdl, WAIT=chain, HALF2=half2)
    down = dict(inter=s.inter, words_per_row=s.inter // PACK, n_groups=s.inter // s.group_size, TOPK=s.topk,
                BLOCK_TOPK=block_topk, WPG=wpg, BLOCK_N=c2["BLOCK_N"], ROW_ITERS=c2.get("ROW_ITERS", 1),
                WORDS=words2, SPLIT_K=split, PDL=pdl, HALF2=half2)
    rows2 = c2["BLOCK_N"] * c2.get("ROW_ITERS", 1)
    return [(_gate_up_split_kernel, (s.tokens * s.topk * split * triton.cdiv(s.inter, c1["BLOCK_N"]),), gate_up,
             {"num_warps": warps1, "num_stages": c1.get("num_stages", 1)}),
            (_down_split_kernel, (s.tokens * triton.cdiv(s.hidden, rows2),), down,
             {"num_warps": c2.get("num_warps", max(1, min(8, block_topk * words2 // 128))),
              "num_stages": c2.get("num_stages", 1)})]


# ---------------------------------------------------------------------------------------------------- shared memory

def compiled_shared_bytes(config: dict, cc: int, shape: MoeShape = K25_TP8) -> int:
    """Shared memory per block, bytes, of the larger of the two kernels that `config` (completed from
    DEFAULT_CONFIG) launches at `shape` with bf16 activations, compiled for sm_<cc> without a GPU (compare with
    SMEM_LIMIT_BYTES[cc]). "pdl" compiles in for sm_90+ only (check_config refuses it below). A few seconds per
    kernel the first time; repeats come from a cache per kernel and from Triton's."""
    return compiled_shared_bytes_many([(config, cc)], shape)[0]


def compiled_shared_bytes_many(cases: list[tuple[dict, int]], shape: MoeShape = K25_TP8) -> list[int]:
    """compiled_shared_bytes of each (config, cc). Under the interpreter (whose kernels, and triton's own jit
    helpers, cannot be compiled) one subprocess without it compiles them all."""
    if not isinstance(_gate_up_split_kernel, JITFunction):
        return config_tables.uninterpreted(__name__, "_shared_bytes_json", [[c, int(cc)] for c, cc in cases],
                                           dataclasses.asdict(shape))
    out = []
    for config, cc in cases:
        cfg = {**DEFAULT_CONFIG, **config}
        check_config(cfg, shape, torch.device("cpu"))
        pdl = bool(cfg.get("pdl")) and cc >= 90
        out.append(max(_kernel_shared(fn.__name__, tuple(sorted(consts.items())), tuple(sorted(opts.items())), int(cc))
                       for fn, _, consts, opts in _launches(cfg, shape, pdl, pdl)))
    return out


def _shared_bytes_json(cases: list, shape: dict) -> list[int]:
    return compiled_shared_bytes_many([(c, cc) for c, cc in cases], MoeShape(**shape))


# The run-time arguments as a bf16 launch passes them; "16:" marks the ints a launch specializes as multiples of 16
# at the shapes compiled (H and E), the others (token and pair counts) are not specialized.
_ARG_TYPES = {"x_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i16", "ids_ptr": "*i32",
              "p_ptr": "*fp32", "tw_ptr": "*fp32", "num_pairs": "i32", "M": "i32", "num_experts": "16:i32",
              "hidden": "16:i32", "stride_xm": "16:i32", "stride_om": "16:i32"}


@functools.lru_cache(maxsize=None)
def _kernel_shared(name: str, consts: tuple, opts: tuple, cc: int) -> int:
    return config_tables.compiled_shared(globals()[name], _ARG_TYPES, dict(consts), dict(opts), cc)


def selectable_configs(table: dict | None = None) -> list[dict]:
    """Every config a GPU can be given, deduplicated: each entry of the shipped table (as select_config completes
    it), the default, and every config the tuner's spaces can end on (any gate_up with any down, pdl or not)."""
    table = load_configs() if table is None else table
    out = [{**DEFAULT_CONFIG, **blocking} for blocking in DEFAULT_BLOCKING.values()]
    out += [_entry_config(entry, tuned, DEFAULT_CONFIG) for entry in table.values()
            for tuned in entry.get("by_n", {}).values()]
    out += [{**base, "gate_up": gu, "down": dn, "pdl": pdl} for base, gate_up, down in TUNE_SPACES.values()
            for gu in gate_up for dn in down for pdl in (False, True)]
    unique = {json.dumps(cfg, sort_keys=True): cfg for cfg in out}
    return list(unique.values())


# ---------------------------------------------------------------------------------------------------- tuning space

# The tuner's spaces (harness/tune/moe_int4.py): a starting config and the gate_up and down candidates its
# coordinate descent sweeps. "split-denormal" is the one the interpreter can run (the tuner's CPU dry run).
# gate_up (rows, SPLIT_K, PREFETCH), one warp over 128 words of a row. All compile without spills for sm_90 with
# triton 3.6 at K2.5 shapes (2.8-4.2 SASS instr/weight; K14: 7.3, half its chunk masked); SPLIT_K 7 is one 128-word
# chunk per program, 2/4/8/14 leave part of the last chunk masked; 64-word chunks (a warp over 2 rows) cost ~2x the
# instructions, BLOCK_N 16 at K1 and BLOCK_N 8 at K2 with prefetch spill.
DENORMAL_GATE_UP = [{"BLOCK_N": bn, "num_warps": 1, "num_stages": 1, "SPLIT_K": sk, "PREFETCH": pf, "BLOCK_W": 128}
                    for bn, sk, pf in ((4, 1, 1), (8, 1, 1), (8, 1, 0), (2, 1, 1), (8, 2, 0), (8, 4, 0), (2, 7, 0),
                                       (4, 7, 0), (8, 7, 0), (16, 7, 0), (8, 8, 0), (8, 14, 0))]
# half2: ~25% fewer SASS instructions per weight and far fewer registers (BN 8 without prefetch: 94 instead of 247),
# so larger and unprefetched blockings fit (sm_90, triton 3.6: no spills in this list; BN 8 and BN 16 with prefetch
# spill)
HALF2_GATE_UP = [{"BLOCK_N": bn, "num_warps": 1, "num_stages": 1, "SPLIT_K": sk, "PREFETCH": pf, "BLOCK_W": 128}
                 for bn, sk, pf in ((8, 1, 0), (4, 1, 1), (4, 1, 0), (16, 1, 0), (32, 1, 0), (2, 1, 1), (8, 2, 0),
                                    (4, 7, 0), (8, 7, 0), (16, 7, 0), (8, 14, 0))]
# down (rows, row blocks per program), 2 warps (the columns are topk x I/8 words); 32 rows or 4+ warps go through
# shared memory. Every program rebuilds the token's activations (2 x SPLIT_K x topk x I fp32 from L2): more rows per
# program (ROW_ITERS > 1, the next block prefetched while this one is computed) amortize that when SPLIT_K > 1.
DOWN = [{"BLOCK_N": bn, "ROW_ITERS": it, "num_stages": 1} for bn, it in
        ((16, 1), (8, 1), (4, 1), (8, 2), (16, 2), (8, 4), (8, 8))]
TUNE_SPACES = {  # name: (starting config, gate_up candidates, down candidates)
    "split-denormal": ({"dequant": "denormal", "pdl": False, "gate_up": DENORMAL_GATE_UP[1], "down": DOWN[0]},
                       DENORMAL_GATE_UP, DOWN),
    "split-half2": ({"dequant": "half2", "pdl": False, "gate_up": HALF2_GATE_UP[0], "down": DOWN[0]},
                    HALF2_GATE_UP, DOWN),
}


# ---------------------------------------------------------------------------------------------------- wrapper

def fused_moe_w4a16(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids, *,
                    config: dict | None = None, check_ids: bool = True, prepacked: bool = False) -> torch.Tensor:
    """The reference's signature and result ([M, H] in x's dtype, fp16 or bf16 x), in two Triton launches.

    config (default: select_config(M, device)), completed from default_config(device, M): {"dequant": "half2" |
    "denormal", "gate_up": {"BLOCK_N", "num_warps", "num_stages", "SPLIT_K" (divides H / group; default 1),
    "PREFETCH" (0/1, default 1), "BLOCK_W" (words per step, default min(128 * num_warps, words per split))},
    "down": {"BLOCK_N", "ROW_ITERS", "num_stages", "num_warps" (default topk * I/256)}, "pdl"}. Kernel 1 writes fp32
    partial gate and up sums per split, kernel 2 adds them (fixed order: deterministic, no atomics, no memset) and
    applies SiLU. "pdl": True (sm_90+) lets kernel 2 start and load its first weight tile while kernel 1 finishes
    (programmatic dependent launch; off in the interpreter); where kernels.pdl.enabled, kernel 1 is launched with
    PDL too (it waits for the kernel before it first) and kernel 2 lets the kernel after the MoE start early. A
    config the shapes cannot run raises ValueError.
    "denormal" is exact for fp16 x, and for bf16 x with |x| in [2^-41, 2^64] (smaller values lose bits; larger
    overflow). "half2" (group 32, CUDA only) multiplies in fp16 pairs and sums runs of 16 products in fp16
    (relative error ~1e-3 of each run): activations must stay well inside fp16's range (|x| and |SiLU(g) * u *
    topk_weight| below ~500, so a run of 16 products of |n - 8| <= 8 cannot overflow). check_ids=False skips the
    host-side id range check (a device sync) for graph capture; ids are then clamped in the kernels.
    prepacked=True: the packed weights are planar already (repack_planar once at load, drop the checkpoint copy):
    nothing is repacked or cached, so a whole model's experts fit without a second copy.
    """
    s = check_moe_inputs(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids,
                         check_ids=check_ids)
    interpret = _interpreting()
    if x.device.type != "cuda" and not interpret:
        raise RuntimeError("fused_moe_w4a16 needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors)")
    wpg = s.group_size // PACK
    if wpg & (wpg - 1):
        raise ValueError(f"the kernel needs a power-of-two group size (8, 16, 32, ...), got {s.group_size}")
    cfg = {**default_config(x.device, s.tokens), **(config or select_config(s.tokens, x.device))}
    check_config(cfg, s, x.device)
    if cfg["dequant"] == "half2" and interpret:
        raise ValueError("dequant 'half2' runs inline PTX, which the Triton interpreter cannot: it needs a CUDA GPU")
    w13, s13 = kernel_weights(w13_packed, w13_scales, prepacked)
    w2, s2 = kernel_weights(w2_packed, w2_scales, prepacked)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.contiguous()  # before kernel 1: nothing may run between the two launches (PDL)
    pairs = s.tokens * s.topk
    out = torch.empty(s.tokens, s.hidden, dtype=x.dtype, device=x.device)
    pdl = bool(cfg.get("pdl")) and not interpret  # the interpreter has no inline asm; same result without
    chain = pdl and _pdl.enabled(x.device)  # kernel 1 also overlaps the kernel before the MoE
    (k1, grid1, consts1, opts1), (k2, grid2, consts2, opts2) = _launches(cfg, s, pdl, chain)
    partials = torch.empty(consts1["SPLIT_K"], pairs, 2, s.inter, dtype=torch.float32, device=x.device)
    k1[grid1](x, w13, s13, ids, partials, tw, pairs, s.experts, x.stride(0), **consts1, **opts1,
              **_pdl.launch_kwargs(chain))
    k2[grid2](partials, tw, w2, s2, ids, out, pairs, s.experts, s.hidden, out.stride(0), s.tokens, **consts2,
              **opts2, **({"launch_pdl": True} if pdl else {}))
    return out
