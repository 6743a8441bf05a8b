"""Fused W4A16 MoE for few tokens (n <= 32) in Triton: two GEMV-style launches that stream each routed expert's
int4 weights, with no sort/align step and no host work in the call (CUDA-graph capturable).

Launch 1, one program per (token-expert pair, BLOCK_N gate + BLOCK_N up rows): all of H in chunks of 128 words
  per warp, the next chunk's loads issued before this one is computed; SiLU(g) * u * topk_weight -> fp32
  [pairs, 4, I] (the same vector pre-scaled for the 4 nibble positions kernel 2 uses).
Launch 2, one program per (token, ROW_ITERS blocks of BLOCK_N rows of H): the columns of one tile are (expert slot,
  word), so all topk experts of the token are loaded at once; the combine is a row sum -> y [M, H] in x's dtype
  (no atomics, no memset, deterministic).
Pairs of different tokens that share an expert run side by side (pair / token index varies fastest in the grid),
so the second read of those weights hits L2: DRAM streams each distinct expert about once (the SM work is per pair).

Dequantization without int->float conversions (1/8 of the FMA rate): "denormal" (default) reads a nibble masked
in place as a denormal fp32, n * 16^p * 2^-149, one LOP3, and multiplies it by x * 2^(64 - 4p); the -8 offset is
applied once per group as 8 * sum(x). "magic" ORs the nibble into 2^23 and subtracts (one FADD more per weight).
Per weight about 1 LOP3 + 1 FFMA; the bf16 scale is applied per 4-word group slice.

Register layout: every tile is 2-D [rows, words] with 4 consecutive words (one 32-value group, a 16-byte load) per
thread and the rows wrapped inside each thread, and the activations are [1, words] tiles in that same layout
(contiguity hints where the compiler cannot see it): triton 3.6 otherwise routes them through shared memory.

Config "kernel": "split" (kernels _gate_up_split_kernel, _down_split_kernel; v3 above is the default): launch 1
  splits each row's K over SPLIT_K programs (fp32 partial gate/up sums; SPLIT_K = 1 stores the activation), launch 2
  adds the partials in a fixed order and applies SiLU * up * topk_weight as it loads its activations, so still two
  launches, no atomics, no memset. Scales are applied once per (row, group) after an in-thread sum over the group's
  4 words, masks exist only where the blocks do not tile the shapes, and with "pdl" launch 2 streams its first
  weight tile while launch 1 finishes (programmatic dependent launch, sm_90+).

Kernel layout ("planar", the default): a one-time repack, cached per weight tensor (`kernel_weights`), reorders the
nibbles inside each group so that nibble i of the group's word w holds k = 32 g + 4 i + w (checkpoint: 32 g + 8 w +
i); each of the 8 nibble planes then multiplies 4 consecutive activations, one vector load. Same shapes and bytes
as the checkpoint; "checkpoint" layout (no repack, strided activation loads, ~5x slower) is kept as a config choice.
"""
from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # PDL (sm_90+; triton >= 3.3)

from verifybench.kernels import config_tables
from verifybench.kernels import pdl as _pdl
from verifybench.kernels.config_tables import device_name
from verifybench.kernels.moe_int4 import PACK, check_moe_inputs, pack_nibbles, unpack_nibbles

CONFIG_PATH = Path(__file__).with_name("moe_int4_configs.json")
LAYOUTS = ("planar", "checkpoint")
# Used when the GPU is not in the table: a fair config for an H100/H200-class part at every n.
DEFAULT_CONFIG = {"layout": "planar", "dequant": "denormal", "kernel": "v3",
                  "gate_up": {"BLOCK_N": 2, "num_warps": 1, "num_stages": 1},
                  "down": {"BLOCK_N": 8, "ROW_ITERS": 1, "num_stages": 1}}
DEQUANTS = ("denormal", "magic", "half2")  # half2: kernel "split", planar, group 32, CUDA only (inline PTX)
KERNELS = ("v3", "split")  # v3: SiLU in kernel 1, [pairs, 4, I] pre-scaled; split: split-K partials, see fused_moe_w4a16
MAGIC = 0x4B000000  # bits of 2^23 in fp32
MAGIC_F = tl.constexpr(8388608.0)
X_SCALE_DENORMAL = tl.constexpr(2.0**64)  # x * 2^(64-4p) times a nibble read as denormal: n * x * 2^-85
DENORMAL_OFFSET = tl.constexpr(2.0**-82)  # 8 * 2^-85: the -8 of every nibble, applied to sum(x) per group
UNDO_DENORMAL = tl.constexpr(2.0**85)


# ---------------------------------------------------------------------------------------------------- kernels

@triton.jit
def _nib(words, magic, P: tl.constexpr, DENORMAL: tl.constexpr):
    """The nibble at bits 4P..4P+3 of `words`, as an exact fp32 without an int->float conversion.
    DENORMAL: the masked bits read as a denormal, n * 16^P * 2^-149 (one LOP3); the caller scales x by
    2^(64 - 4P) so products are n * x * 2^-85, and subtracts 8 * sum(x) per group. Otherwise (magic): OR-ed into
    2^23 and subtracted, (n - 8) * 16^P (LOP3 + FADD; `magic` is a run-time argument so it sits in a register)."""
    if DENORMAL:
        v = (words & (15 << (4 * P))).to(tl.float32, bitcast=True)
    else:
        v = ((words & (15 << (4 * P))) | magic).to(tl.float32, bitcast=True) - (MAGIC_F + 8.0 * (1 << (4 * P)))
    return v


@triton.jit
def _x_scale(P: tl.constexpr, DENORMAL: tl.constexpr):
    if DENORMAL:
        c = X_SCALE_DENORMAL * (1.0 / (1 << (4 * P)))
    else:
        c = 1.0 / (1 << (4 * P))
    return c


@triton.jit
def _k_of(g, w, i: tl.constexpr, WPG: tl.constexpr, PLANAR: tl.constexpr):
    """k (within the row) held by nibble i of word w of group g."""
    if PLANAR:
        k = g * (8 * WPG) + i * WPG + w
    else:
        k = g * (8 * WPG) + w * 8 + i
    return k


@triton.jit
def _bf16_bits(bits):
    """bf16 scales loaded as int16 bits -> fp32 (exact: bf16 is the top half of an fp32)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _plane(ptr, base, word, i: tl.constexpr, mask, WPG: tl.constexpr, PLANAR: tl.constexpr,
           STRIDE_P: tl.constexpr):
    """Plane i of the activations, [1, W]: ptr + base + (i % 4) * STRIDE_P + k(word, i)."""
    offs = base + (i % 4) * STRIDE_P + _k_of(word // WPG, word % WPG, i, WPG, PLANAR)
    if PLANAR:  # runs of WPG consecutive k: say so, or triton 3.6 loads them in another register layout
        offs = tl.max_contiguous(tl.multiple_of(offs, [1, WPG]), [1, WPG])
    if mask is None:
        v = tl.load(ptr + offs)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0.0)
    return v


@triton.jit
def _load_planes(ptr, base, word, mask, WPG: tl.constexpr, PLANAR: tl.constexpr, STRIDE_P: tl.constexpr):
    """The 8 activation planes of a chunk of words (shared by every row of the tile)."""
    return (_plane(ptr, base, word, 0, mask, WPG, PLANAR, STRIDE_P),
            _plane(ptr, base, word, 1, mask, WPG, PLANAR, STRIDE_P),
            _plane(ptr, base, word, 2, mask, WPG, PLANAR, STRIDE_P),
            _plane(ptr, base, word, 3, mask, WPG, PLANAR, STRIDE_P),
            _plane(ptr, base, word, 4, mask, WPG, PLANAR, STRIDE_P),
            _plane(ptr, base, word, 5, mask, WPG, PLANAR, STRIDE_P),
            _plane(ptr, base, word, 6, mask, WPG, PLANAR, STRIDE_P),
            _plane(ptr, base, word, 7, mask, WPG, PLANAR, STRIDE_P))


@triton.jit
def _pick(i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    if i == 0:
        r = p0
    elif i == 1:
        r = p1
    elif i == 2:
        r = p2
    elif i == 3:
        r = p3
    elif i == 4:
        r = p4
    elif i == 5:
        r = p5
    elif i == 6:
        r = p6
    else:
        r = p7
    return r


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, tw_ptr, num_pairs, num_experts, stride_xm, magic,
                    inter: tl.constexpr, words_per_row: tl.constexpr, n_groups: tl.constexpr, TOPK: tl.constexpr,
                    WPG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                    PLANAR: tl.constexpr, DENORMAL: tl.constexpr):
    pid = tl.program_id(0)
    pair = pid % num_pairs
    nb = pid // num_pairs
    e = tl.load(ids_ptr + pair).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 0), num_experts - 1)  # the wrapper checks ids; never read out of bounds
    tok = pair // TOPK
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows[:, None] < inter
    cols = tl.arange(0, BLOCK_W)[None, :]  # words of the row, 4 per thread (one group of 32 k)
    gate_rows = (e.to(tl.int64) * (2 * inter) + rows)[:, None]
    w_ptrs = w_ptr + gate_rows * words_per_row + cols
    s_ptrs = s_ptr + gate_rows * n_groups + cols // WPG
    x_row = x_ptr + tok * stride_xm
    acc_g = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    # register double buffering: the next chunk's loads are in flight while this chunk is computed (Triton does
    # not software-pipeline loads that feed no tl.dot, and one warp's latency is not hidden by the others alone)
    m2 = rmask & (cols < words_per_row)
    wg = tl.load(w_ptrs, mask=m2, other=0)
    wu = tl.load(w_ptrs + inter * words_per_row, mask=m2, other=0)
    sg = tl.load(s_ptrs, mask=m2, other=0)  # one scale per word (4 equal loads per group, L1 hits)
    su = tl.load(s_ptrs + inter * n_groups, mask=m2, other=0)
    x0, x1, x2, x3, x4, x5, x6, x7 = _load_planes(x_row, 0, cols, cols < words_per_row, WPG, PLANAR, 0)
    for c0 in range(0, words_per_row, BLOCK_W):
        nxt = c0 + BLOCK_W + cols
        nmask = rmask & (nxt < words_per_row)
        wg_n = tl.load(w_ptrs + c0 + BLOCK_W, mask=nmask, other=0)
        wu_n = tl.load(w_ptrs + inter * words_per_row + c0 + BLOCK_W, mask=nmask, other=0)
        sg_n = tl.load(s_ptrs + (c0 + BLOCK_W) // WPG, mask=nmask, other=0)
        su_n = tl.load(s_ptrs + inter * n_groups + (c0 + BLOCK_W) // WPG, mask=nmask, other=0)
        y0, y1, y2, y3, y4, y5, y6, y7 = _load_planes(x_row, 0, nxt, nxt < words_per_row, WPG, PLANAR, 0)
        wg_hi = wg >> 16
        wu_hi = wu >> 16
        tg = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        tu = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        xsum = tl.zeros([1, BLOCK_W], dtype=tl.float32)
        for i in tl.static_range(8):
            x = _pick(i, x0, x1, x2, x3, x4, x5, x6, x7).to(tl.float32)
            if DENORMAL:
                xsum += x
            xi = x * _x_scale(i % 4, DENORMAL)
            if i < 4:
                tg += _nib(wg, magic, i % 4, DENORMAL) * xi
                tu += _nib(wu, magic, i % 4, DENORMAL) * xi
            else:
                tg += _nib(wg_hi, magic, i % 4, DENORMAL) * xi
                tu += _nib(wu_hi, magic, i % 4, DENORMAL) * xi
        if DENORMAL:  # sum((n - 8) x) * 2^-85 = sum(n x 2^-85) - 8 * 2^-85 * sum(x)
            off = xsum * DENORMAL_OFFSET
            tg -= off
            tu -= off
        acc_g += tg * _bf16_bits(sg)
        acc_u += tu * _bf16_bits(su)
        wg, wu, sg, su = wg_n, wu_n, sg_n, su_n
        x0, x1, x2, x3, x4, x5, x6, x7 = y0, y1, y2, y3, y4, y5, y6, y7
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if DENORMAL:
        gate = gate * UNDO_DENORMAL
        up = up * UNDO_DENORMAL
    act = gate / (1.0 + tl.exp(-gate)) * up * tl.load(tw_ptr + pair).to(tl.float32)
    # kernel 2 reads act * topk_weight pre-multiplied by its 4 per-position scales: [pairs, 4, inter]
    h_row = h_ptr + pair * (4 * inter) + rows
    for p in tl.static_range(4):
        tl.store(h_row + p * inter, act * _x_scale(p, DENORMAL), mask=rows < inter)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, num_experts, hidden, stride_om, M, magic,
                 inter: tl.constexpr, words_per_row: tl.constexpr, n_groups: tl.constexpr, TOPK: tl.constexpr,
                 BLOCK_TOPK: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr, ROW_ITERS: tl.constexpr,
                 WORDS: tl.constexpr, PLANAR: tl.constexpr, DENORMAL: tl.constexpr):
    pid = tl.program_id(0)
    tok = pid % M
    hb = pid // M
    # columns = (expert slot j of the token, word of its row): all topk experts in one tile, all loads in flight
    cols = tl.arange(0, BLOCK_TOPK * WORDS)[None, :]
    j = cols // WORDS
    word = cols % WORDS
    cmask = (j < TOPK) & (word < words_per_row)
    pair = tok * TOPK + j
    e = tl.load(ids_ptr + pair, mask=cmask, other=0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 0), num_experts - 1)
    r = tl.arange(0, BLOCK_N)[:, None]
    row0 = hb * (BLOCK_N * ROW_ITERS)
    base = e.to(tl.int64) * hidden + r
    w_offs = tl.max_contiguous(tl.multiple_of(base * words_per_row + word, [1, WPG]), [1, WPG])
    s_offs = base * n_groups + word // WPG
    m2 = ((row0 + r) < hidden) & cmask
    wt = tl.load(w_ptr + w_offs + row0 * words_per_row, mask=m2, other=0)
    sc = tl.load(s_ptr + s_offs + row0 * n_groups, mask=m2, other=0)
    # the activations (act * topk_weight, pre-scaled per nibble position) of the token's pairs, loaded once
    a0, a1, a2, a3, a4, a5, a6, a7 = _load_planes(h_ptr, pair * (4 * inter), word, cmask, WPG, PLANAR, inter)
    asum = tl.zeros([1, BLOCK_TOPK * WORDS], dtype=tl.float32)
    if DENORMAL:  # the plain act * topk_weight, summed per word
        for i in tl.static_range(8):
            asum += _pick(i, a0, a1, a2, a3, a4, a5, a6, a7) * (1.0 / _x_scale(i % 4, DENORMAL))
    off = asum * DENORMAL_OFFSET
    for it in tl.static_range(ROW_ITERS):
        rows = row0 + it * BLOCK_N
        if it + 1 < ROW_ITERS:  # prefetch the next row block while this one is computed
            m2n = ((rows + BLOCK_N + r) < hidden) & cmask
            wt_n = tl.load(w_ptr + w_offs + (rows + BLOCK_N) * words_per_row, mask=m2n, other=0)
            sc_n = tl.load(s_ptr + s_offs + (rows + BLOCK_N) * n_groups, mask=m2n, other=0)
        wt_hi = wt >> 16
        t = tl.zeros([BLOCK_N, BLOCK_TOPK * WORDS], dtype=tl.float32)
        for i in tl.static_range(8):
            if i < 4:
                t += _nib(wt, magic, i % 4, DENORMAL) * _pick(i, a0, a1, a2, a3, a4, a5, a6, a7)
            else:
                t += _nib(wt_hi, magic, i % 4, DENORMAL) * _pick(i, a0, a1, a2, a3, a4, a5, a6, a7)
        if DENORMAL:
            t = t - off
        y = tl.sum(t * _bf16_bits(sc), axis=1)
        if DENORMAL:
            y = y * UNDO_DENORMAL
        out_rows = rows + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + tok * stride_om + out_rows, y.to(out_ptr.dtype.element_ty), mask=out_rows < hidden)
        if it + 1 < ROW_ITERS:
            wt, sc = wt_n, sc_n


@triton.jit
def _silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u  # fp32 "/" is div.full (approximate) in triton: ~2 ulp


@triton.jit
def _group_sum(t, ROWS: tl.constexpr, G: tl.constexpr, WPG: tl.constexpr):
    """[ROWS, G * WPG] -> [ROWS, G]: the sum over each thread's own WPG words (no data leaves the thread)."""
    return tl.sum(tl.reshape(t, [ROWS, G, WPG]), axis=2)


@triton.jit
def _dot_chunk(wt, x0, x1, x2, x3, x4, x5, x6, x7, magic, DENORMAL: tl.constexpr):
    """sum_i nibble_i(wt) * x_i per word, [rows, W] (x_i pre-scaled by _x_scale(i % 4)); the first plane starts the
    sum (no zero fill)."""
    hi = wt >> 16
    t = _nib(wt, magic, 0, DENORMAL) * x0
    t += _nib(wt, magic, 1, DENORMAL) * x1
    t += _nib(wt, magic, 2, DENORMAL) * x2
    t += _nib(wt, magic, 3, DENORMAL) * x3
    t += _nib(hi, magic, 0, DENORMAL) * x4
    t += _nib(hi, magic, 1, DENORMAL) * x5
    t += _nib(hi, magic, 2, DENORMAL) * x6
    t += _nib(hi, magic, 3, DENORMAL) * x7
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
             UP_S: tl.constexpr, WPG: tl.constexpr, PLANAR: tl.constexpr, MASKED: tl.constexpr):
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
    x0, x1, x2, x3, x4, x5, x6, x7 = _load_planes(x_row, 0, w0 + c0 + cols, cm, WPG, PLANAR, 0)
    return wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, magic, BLOCK_N: tl.constexpr,
                G: tl.constexpr, WPG: tl.constexpr, DENORMAL: tl.constexpr, HALF2: tl.constexpr):
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
    c0 = _x_scale(0, DENORMAL)
    c1 = _x_scale(1, DENORMAL)
    c2 = _x_scale(2, DENORMAL)
    c3 = _x_scale(3, DENORMAL)
    y0, y1, y2, y3, y4, y5, y6, y7 = f0 * c0, f1 * c1, f2 * c2, f3 * c3, f4 * c0, f5 * c1, f6 * c2, f7 * c3
    tg = _group_sum(_dot_chunk(wg, y0, y1, y2, y3, y4, y5, y6, y7, magic, DENORMAL), BLOCK_N, G, WPG)
    tu = _group_sum(_dot_chunk(wu, y0, y1, y2, y3, y4, y5, y6, y7, magic, DENORMAL), BLOCK_N, G, WPG)
    if DENORMAL:  # sum((n - 8) x) * 2^-85 = sum(n x 2^-85) - 8 * 2^-85 * sum(x), per group
        off = _group_sum(((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7)), 1, G, WPG) * DENORMAL_OFFSET
        tg -= off
        tu -= off
    return acc_g + tg * _bf16_bits(sg), acc_u + tu * _bf16_bits(su)


@triton.jit(do_not_specialize=["num_pairs"])  # one compile for every n
def _gate_up_split_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, p_ptr, tw_ptr, num_pairs, num_experts, stride_xm, magic,
                          inter: tl.constexpr, words_per_row: tl.constexpr, n_groups: tl.constexpr,
                          TOPK: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                          SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr, PLANAR: tl.constexpr,
                          DENORMAL: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
                          HALF2: tl.constexpr = False):
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
                                                              UP_W, UP_S, WPG, PLANAR, MASKED)
    if PREFETCH:  # register double buffering: chunk c0's loads are issued before the previous chunk is computed
        for c0 in range(BLOCK_W, WPS, BLOCK_W):
            ng, nu, tg, tu, y0, y1, y2, y3, y4, y5, y6, y7 = _gu_load(w_ptrs, s_ptrs, x_row, w0, c0, cols, grp, rmask,
                                                                      WPS, UP_W, UP_S, WPG, PLANAR, MASKED)
            acc_g, acc_u = _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, magic, BLOCK_N,
                                       G, WPG, DENORMAL, HALF2)
            wg, wu, sg, su = ng, nu, tg, tu
            x0, x1, x2, x3, x4, x5, x6, x7 = y0, y1, y2, y3, y4, y5, y6, y7
        acc_g, acc_u = _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, magic, BLOCK_N, G,
                                   WPG, DENORMAL, HALF2)
    else:
        acc_g, acc_u = _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, magic, BLOCK_N, G,
                                   WPG, DENORMAL, HALF2)
        for c0 in range(BLOCK_W, WPS, BLOCK_W):
            wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7 = _gu_load(w_ptrs, s_ptrs, x_row, w0, c0, cols, grp, rmask,
                                                                      WPS, UP_W, UP_S, WPG, PLANAR, MASKED)
            acc_g, acc_u = _gu_compute(acc_g, acc_u, wg, wu, sg, su, x0, x1, x2, x3, x4, x5, x6, x7, magic, BLOCK_N,
                                       G, WPG, DENORMAL, HALF2)
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if DENORMAL and not HALF2:
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
               WPG: tl.constexpr, PLANAR: tl.constexpr):
    """Plane i of SiLU(gate) * up * topk_weight, [1, W]: the SPLIT_K partials of kernel 1 summed in a fixed order
    (SPLIT_K == 1: kernel 1 stored the product itself)."""
    offs = pair * (2 * inter) + _k_of(word // WPG, word % WPG, i, WPG, PLANAR)
    if PLANAR:
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
                       magic, inter: tl.constexpr, words_per_row: tl.constexpr, n_groups: tl.constexpr,
                       TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr,
                       ROW_ITERS: tl.constexpr, WORDS: tl.constexpr, SPLIT_K: tl.constexpr, PLANAR: tl.constexpr,
                       DENORMAL: tl.constexpr, PDL: tl.constexpr, HALF2: tl.constexpr = False):
    """Kernel 2 of the split-K path: as _down_kernel (columns = (expert slot, word)), but it builds the activations
    itself from kernel 1's partials (sum over splits in a fixed order, SiLU(g) * u * topk_weight), applies scales per
    (row, group) like _gate_up_split_kernel, and loads its first weight tile before waiting for kernel 1 (PDL)."""
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
    a0 = _act_plane(p_ptr, pair, tw, word, 0, cmask, num_pairs, inter, SPLIT_K, WPG, PLANAR)
    a1 = _act_plane(p_ptr, pair, tw, word, 1, cmask, num_pairs, inter, SPLIT_K, WPG, PLANAR)
    a2 = _act_plane(p_ptr, pair, tw, word, 2, cmask, num_pairs, inter, SPLIT_K, WPG, PLANAR)
    a3 = _act_plane(p_ptr, pair, tw, word, 3, cmask, num_pairs, inter, SPLIT_K, WPG, PLANAR)
    a4 = _act_plane(p_ptr, pair, tw, word, 4, cmask, num_pairs, inter, SPLIT_K, WPG, PLANAR)
    a5 = _act_plane(p_ptr, pair, tw, word, 5, cmask, num_pairs, inter, SPLIT_K, WPG, PLANAR)
    a6 = _act_plane(p_ptr, pair, tw, word, 6, cmask, num_pairs, inter, SPLIT_K, WPG, PLANAR)
    a7 = _act_plane(p_ptr, pair, tw, word, 7, cmask, num_pairs, inter, SPLIT_K, WPG, PLANAR)
    if HALF2:  # the activations as fp16 pairs of planes (i, i + 4), see _h2_fma
        p0, p1, p2, p3 = _h2_pair(a0, a4), _h2_pair(a1, a5), _h2_pair(a2, a6), _h2_pair(a3, a7)
    else:
        off = _group_sum(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), 1, CG, WPG) * DENORMAL_OFFSET
        c0 = _x_scale(0, DENORMAL)
        c1 = _x_scale(1, DENORMAL)
        c2 = _x_scale(2, DENORMAL)
        c3 = _x_scale(3, DENORMAL)
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
            t = _group_sum(_dot_chunk(wt, a0, a1, a2, a3, a4, a5, a6, a7, magic, DENORMAL), BLOCK_N, CG, WPG)
            if DENORMAL:
                t = t - off
            y = tl.sum(t * _bf16_bits(sc), axis=1)
            if DENORMAL:
                y = y * UNDO_DENORMAL
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


def kernel_weights(packed: torch.Tensor, scales: torch.Tensor, layout: str,
                   prepacked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors the kernels read: (packed in `layout`, scales as int16 bits), contiguous. The planar repack runs
    once per (tensor, version) and is cached until the source tensor is freed (it doubles that tensor's memory
    meanwhile); call it outside any timed region or graph capture (the bench's check and warm-up do)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    scale_bits = scales.contiguous().view(torch.int16)
    if layout == "checkpoint" or prepacked:
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

def load_configs(path: Path | str = CONFIG_PATH) -> dict:
    """The tuning table {gpu name: {"layout", "dequant", "by_n": {n: {"gate_up", "down", ...}}}}; read once."""
    return config_tables.load(path)


def save_configs(table: dict, path: Path | str = CONFIG_PATH) -> Path:
    return config_tables.save(table, path)


def select_config(m: int, device: torch.device, table: dict | None = None) -> dict:
    """The tuned config for m tokens on this GPU: the table entry for the GPU's name, at the largest tuned n <= m
    (the smallest above, for m below every key); DEFAULT_CONFIG when the GPU is not in the table."""
    table = load_configs() if table is None else table
    entry = table.get(device_name(device))
    if not entry or not entry.get("by_n"):
        return DEFAULT_CONFIG
    keys = sorted(int(k) for k in entry["by_n"])
    n = max([k for k in keys if k <= m], default=keys[0])
    tuned = {k: v for k, v in entry["by_n"][str(n)].items() if k in ("gate_up", "down", "kernel", "pdl", "dequant")}
    return {**DEFAULT_CONFIG, **{k: v for k, v in entry.items() if k in ("layout", "dequant")}, **tuned}


# ---------------------------------------------------------------------------------------------------- wrapper

def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def check_config(cfg: dict, s, device: torch.device) -> None:
    """ValueError naming the key for a config these shapes cannot run (checked on the host, before any launch)."""
    if cfg["layout"] not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {cfg['layout']!r}")
    if cfg["dequant"] not in DEQUANTS:
        raise ValueError(f"dequant must be one of {DEQUANTS}, got {cfg['dequant']!r}")
    kernel = cfg.get("kernel", "v3")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    c1, c2 = cfg["gate_up"], cfg["down"]
    for where, c, keys in (("gate_up", c1, ("BLOCK_N", "num_warps")), ("down", c2, ("BLOCK_N",))):
        for key in keys:
            if not _pow2(c.get(key)):
                raise ValueError(f"{where}.{key} must be a power of two, got {c.get(key)!r}")
    if not isinstance(c2.get("ROW_ITERS", 1), int) or c2.get("ROW_ITERS", 1) < 1:
        raise ValueError(f"down.ROW_ITERS must be an int >= 1, got {c2.get('ROW_ITERS')!r}")
    if "num_warps" in c2 and not _pow2(c2["num_warps"]):
        raise ValueError(f"down.num_warps must be a power of two, got {c2['num_warps']!r}")
    split_keys = [k for k in ("SPLIT_K", "PREFETCH", "BLOCK_W") if k in c1]
    if kernel == "v3":
        if split_keys or cfg.get("pdl") or cfg["dequant"] == "half2":
            raise ValueError(f"gate_up {split_keys}, pdl and dequant 'half2' need kernel 'split' (config has kernel "
                             f"'v3')")
        return
    if cfg["dequant"] == "half2" and (cfg["layout"] != "planar" or s.group_size != 32):
        raise ValueError(f"dequant 'half2' needs the planar layout and group size 32 (4 words per group), got "
                         f"{cfg['layout']!r} and {s.group_size}")
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


def fused_moe_w4a16(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids, *,
                    config: dict | None = None, check_ids: bool = True, prepacked: bool = False) -> torch.Tensor:
    """The reference's signature and result ([M, H] in x's dtype, fp16 or bf16 x), in two Triton launches.

    config (default: select_config(M, device)): {"layout": "planar" | "checkpoint", "dequant": "denormal" |
    "magic" | "half2", "kernel": "v3" | "split", "gate_up": {...}, "down": {"BLOCK_N", "ROW_ITERS", "num_stages"}, "pdl"}.
    kernel "v3" (default): gate_up {"BLOCK_N", "num_warps", "num_stages"}; kernel 1 takes 128 * num_warps words per
    step and writes SiLU(g) * u * w; kernel 2 gets topk * I/256 warps.
    kernel "split": gate_up also takes "SPLIT_K" (divides H / group; default 1), "PREFETCH" (0/1, default 1) and
    "BLOCK_W" (words per step, default min(128 * num_warps, words per split)); kernel 1 writes fp32 partial gate and
    up sums per split, kernel 2 adds them (fixed order: deterministic, no atomics, no memset) and applies SiLU;
    down may set "num_warps". "pdl": True (sm_90+, split only) lets kernel 2 start and load its first weight tile
    while kernel 1 finishes (programmatic dependent launch; off in the interpreter); where kernels.pdl.enabled,
    kernel 1 is launched with PDL too (it waits for the kernel before it first) and kernel 2 lets the kernel after
    the MoE start early. A config the shapes cannot run raises ValueError.
    "denormal" is exact for fp16 x, and for bf16 x with |x| in [2^-41, 2^64] (smaller values lose bits; larger
    overflow). "half2" (kernel "split", planar, group 32, CUDA only) multiplies in fp16 pairs and sums runs of 16
    products in fp16 (relative error ~1e-3 of each run): activations must stay well inside fp16's range (|x| and
    |SiLU(g) * u * topk_weight| below ~500, so a run of 16 products of |n - 8| <= 8 cannot overflow). check_ids=False skips the host-side id range check (a device sync) for graph capture; ids are then
    clamped in the kernels. prepacked=True: the packed weights are already in the config's layout (repack_planar
    once at load, drop the checkpoint copy): nothing is repacked or cached, so a whole model's experts fit without
    a second copy.
    """
    s = check_moe_inputs(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids,
                         check_ids=check_ids)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if x.device.type != "cuda" and not interpret:
        raise RuntimeError("fused_moe_w4a16 needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors)")
    wpg = s.group_size // PACK
    if wpg & (wpg - 1):
        raise ValueError(f"the kernel needs a power-of-two group size (8, 16, 32, ...), got {s.group_size}")
    cfg = {**DEFAULT_CONFIG, **(config or select_config(s.tokens, x.device))}
    check_config(cfg, s, x.device)
    w13, s13 = kernel_weights(w13_packed, w13_scales, cfg["layout"], prepacked)
    w2, s2 = kernel_weights(w2_packed, w2_scales, cfg["layout"], prepacked)
    planar, denormal, half2 = cfg["layout"] == "planar", cfg["dequant"] == "denormal", cfg["dequant"] == "half2"
    if half2 and interpret:
        raise ValueError("dequant 'half2' runs inline PTX, which the Triton interpreter cannot: it needs a CUDA GPU")
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.contiguous()  # before kernel 1: nothing may run between the two launches (PDL)
    pairs = s.tokens * s.topk
    out = torch.empty(s.tokens, s.hidden, dtype=x.dtype, device=x.device)
    c1, c2 = cfg["gate_up"], cfg["down"]
    warps1 = c1["num_warps"]
    words1, words2 = s.hidden // PACK, triton.next_power_of_2(s.inter // PACK)
    block_topk = triton.next_power_of_2(s.topk)
    warps2 = c2.get("num_warps", max(1, min(8, block_topk * words2 // 128)))
    if cfg.get("kernel", "v3") == "split":
        split = c1.get("SPLIT_K", 1)
        wps = words1 // split
        block_w = c1.get("BLOCK_W", min(128 * warps1, triton.next_power_of_2(wps)))
        pdl = bool(cfg.get("pdl")) and not interpret  # the interpreter has no inline asm; same result without
        extra = {"launch_pdl": True} if pdl else {}
        chain = pdl and _pdl.enabled(x.device)  # kernel 1 also overlaps the kernel before the MoE
        partials = torch.empty(split, pairs, 2, s.inter, dtype=torch.float32, device=x.device)
        _gate_up_split_kernel[(pairs * split * triton.cdiv(s.inter, c1["BLOCK_N"]),)](
            x, w13, s13, ids, partials, tw, pairs, s.experts, x.stride(0), MAGIC, inter=s.inter, words_per_row=words1,
            n_groups=s.hidden // s.group_size, TOPK=s.topk, WPG=wpg, BLOCK_N=c1["BLOCK_N"], BLOCK_W=block_w,
            SPLIT_K=split, PREFETCH=int(c1.get("PREFETCH", 1)), PLANAR=planar, DENORMAL=denormal, PDL=pdl,
            WAIT=chain, HALF2=half2, num_warps=warps1, num_stages=c1.get("num_stages", 1), **_pdl.launch_kwargs(chain))
        _down_split_kernel[(s.tokens * triton.cdiv(s.hidden, c2["BLOCK_N"] * c2.get("ROW_ITERS", 1)),)](
            partials, tw, w2, s2, ids, out, pairs, s.experts, s.hidden, out.stride(0), s.tokens,
            MAGIC, inter=s.inter, words_per_row=s.inter // PACK, n_groups=s.inter // s.group_size, TOPK=s.topk,
            BLOCK_TOPK=block_topk, WPG=wpg, BLOCK_N=c2["BLOCK_N"], ROW_ITERS=c2.get("ROW_ITERS", 1), WORDS=words2,
            SPLIT_K=split, PLANAR=planar, DENORMAL=denormal, PDL=pdl, HALF2=half2, num_warps=warps2,
            num_stages=c2.get("num_stages", 1), **extra)
        return out
    h = torch.empty(pairs, 4, s.inter, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(pairs * triton.cdiv(s.inter, c1["BLOCK_N"]),)](
        x, w13, s13, ids, h, tw, pairs, s.experts, x.stride(0), MAGIC, inter=s.inter,
        words_per_row=words1, n_groups=s.hidden // s.group_size, TOPK=s.topk, WPG=wpg, BLOCK_N=c1["BLOCK_N"],
        BLOCK_W=min(128 * warps1, triton.next_power_of_2(words1)), PLANAR=planar,
        DENORMAL=denormal, num_warps=warps1, num_stages=c1.get("num_stages", 1))
    _down_kernel[(s.tokens * triton.cdiv(s.hidden, c2["BLOCK_N"] * c2.get("ROW_ITERS", 1)),)](
        h, w2, s2, ids, out, s.experts, s.hidden, out.stride(0), s.tokens, MAGIC, inter=s.inter,
        words_per_row=s.inter // PACK, n_groups=s.inter // s.group_size, TOPK=s.topk, BLOCK_TOPK=block_topk,
        WPG=wpg, BLOCK_N=c2["BLOCK_N"], ROW_ITERS=c2.get("ROW_ITERS", 1), WORDS=words2, PLANAR=planar,
        DENORMAL=denormal, num_warps=warps2, num_stages=c2.get("num_stages", 1))
    return out
