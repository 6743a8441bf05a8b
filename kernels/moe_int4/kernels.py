"""The two Triton kernels of the fused W4A16 MoE for few tokens (n <= 32), their grids and the checks a config must
pass: two GEMV-style launches that stream each routed expert's int4 weights, no sort/align step, no host work.

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
the blocks do not tile the shapes. The int4 products: kernels_dequant.py.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # PDL (sm_90+; triton >= 3.3)

from verifybench.kernels.common import devices, interpret
from verifybench.kernels.moe_int4.reference import PACK
from verifybench.kernels.moe_int4.kernels_dequant import (DENORMAL_OFFSET, UNDO_DENORMAL, _bf16_bits, _dot_chunk,
                                                          _group_sum, _h2_group_dot, _h2_pair, _k_of, _load_planes,
                                                          _x_scale)

DEQUANTS = ("half2", "denormal")  # half2: group 32, CUDA only (inline PTX)


@triton.jit
def _silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u  # fp32 "/" is div.full (approximate) in triton: ~2 ulp


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
    if WAIT:  # launched with PDL itself (kernels/common/pdl.py): x, ids and weights come from the kernels before
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


# ---------------------------------------------------------------------------------------------------- launches

def interpreting() -> bool:
    """Whether TRITON_INTERPRET=1 is set (the interpreter runs no inline PTX and has no PDL)."""
    return interpret.active()


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
    if cfg.get("pdl") and device.type == "cuda" and devices.capability(device) < 90:
        raise ValueError("pdl (programmatic dependent launch) needs sm_90 or newer")


def launches(cfg: dict, s, pdl: bool, chain: bool) -> list[tuple]:
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
