"""The int4 x activation products of the fused W4A16 MoE (kernels.py), as Triton device functions: nibbles
read without int->float conversions, the planar activation loads, and the group sums, in two dequant variants.

Dequantization without int->float conversions: "half2" (CUDA, inline PTX) reads two nibbles at once as an fp16
pair and multiplies them with fp16 pairs of activations; "denormal" (the interpreter's, which cannot run inline
PTX) reads a nibble masked in place as a denormal fp32, n * 16^p * 2^-149, one LOP3, and multiplies it by
x * 2^(64 - 4p); the -8 offset is applied once per group as 8 * sum(x).

Register layout: every tile is 2-D [rows, words] with 4 consecutive words (one 32-value group, a 16-byte load) per
thread and the rows wrapped inside each thread, and the activations are [1, words] tiles in that same layout
(contiguity hints where the compiler cannot see it): triton 3.6 otherwise routes them through shared memory.
The weights are in the planar nibble order (api.repack_planar): inside each group nibble i of word w
holds k = 32 g + 4 i + w, so each of the 8 nibble planes multiplies 4 consecutive activations, one vector load.
"""
from __future__ import annotations

import triton
import triton.language as tl

X_SCALE_DENORMAL = tl.constexpr(2.0**64)  # x * 2^(64-4p) times a nibble read as denormal: n * x * 2^-85
DENORMAL_OFFSET = tl.constexpr(2.0**-82)  # 8 * 2^-85: the -8 of every nibble, applied to sum(x) per group
UNDO_DENORMAL = tl.constexpr(2.0**85)


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
