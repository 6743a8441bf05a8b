"""split_kv, the suite's MLA verify attention with a tree mask: a request's heads x D rows form one query matrix, its
keys are cut into splits on the device (one captured graph serves any prefix), and a combine merges the splits.

A request's L_b + D keys are cut into at most num_splits splits of whole key tiles and >= min_split_keys keys; the tree
keys fall in the last split. Programs write normalized partial o and log2-sum-exp; the combine kernel merges the
splits each request used (one split: the first kernel writes o itself). Semantics, checks and the reference:
api.py, which calls `launch` with checked inputs and a complete config.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from verifybench.kernels.common import pdl as _pdl

COMBINE_COLS = 128  # kv_lora columns per combine program, at most
COMBINE_TILE = 8192  # fp32 partial values a combine program holds at once


@triton.jit
def _split_kernel(q, cache, starts, lens, mask, part_o, part_lse, out, T, num_splits, min_split_keys, stride_qh,
                  stride_qt, stride_c, stride_oh, stride_ot, scale_log2, HEADS: tl.constexpr, D: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                  MASK_WORDS: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # q, the tree rows of the cache, lens and the mask may come from the kernels just before
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0) // ROW_BLOCKS
    sp = tl.program_id(1)
    r = (tl.program_id(0) % ROW_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)  # row = head * D + tree token
    row_ok = r < HEADS * D
    head = (r // D).to(tl.int64)
    t = b * D + r % D  # token in q
    q_row = head * stride_qh + t.to(tl.int64) * stride_qt
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    q_lat = tl.load(q + q_row[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    if BLOCK_DR > 0:  # the rope columns DV..DK-1 only enter the scores
        dr = DV + tl.arange(0, BLOCK_DR)
        dr_ok = dr < DK
        q_rope = tl.load(q + q_row[:, None] + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    start = tl.load(starts + b).to(tl.int64)
    prefix = tl.load(lens + b).to(tl.int32)
    n_keys = prefix + D
    splits = tl.maximum(1, tl.minimum(num_splits, tl.cdiv(n_keys, min_split_keys)))
    split_keys = tl.cdiv(tl.cdiv(n_keys, splits), BLOCK_N) * BLOCK_N  # whole key tiles; the combine agrees
    lo = sp * split_keys
    hi = tl.minimum(lo + split_keys, n_keys)  # lo >= hi: a split this request does not use
    if MASK_WORDS:
        word = tl.load(mask + t, mask=row_ok, other=0).to(tl.int64)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of the scores, log2 units
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for s0 in range(lo, hi, BLOCK_N):
        key = s0 + tl.arange(0, BLOCK_N)  # key index in the request: prefix, then tree
        key_ok = key < hi
        rows_at = cache + (start + key)[:, None] * stride_c
        k_lat = tl.load(rows_at + dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(k_lat))
        if BLOCK_DR > 0:
            k_rope = tl.load(rows_at + dr[None, :], mask=key_ok[:, None] & dr_ok[None, :], other=0.0)
            s += tl.dot(q_rope, tl.trans(k_rope))
        col = key - prefix  # tree column; < 0 for a prefix key, which every query sees
        in_tree = (col >= 0) & key_ok
        if MASK_WORDS:
            seen = ((word[:, None] >> tl.minimum(tl.maximum(col, 0), 63)[None, :]) & 1) != 0
        else:
            seen = tl.load(mask + t[:, None].to(tl.int64) * D + col[None, :],
                           mask=row_ok[:, None] & in_tree[None, :], other=0) != 0
        vis = key_ok[None, :] & ((col < 0)[None, :] | seen)
        s = tl.where(vis, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: 2^-inf = 0, no NaN
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
        m = m_new
    if SINGLE:  # l = 0 only for a query that sees no key: NaN, as the reference (padding rows divide by 1)
        o = acc / tl.where(row_ok, l, 1.0)[:, None]
        tl.store(out + head[:, None] * stride_oh + t[:, None].to(tl.int64) * stride_ot + dv[None, :],
                 o.to(out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    else:
        has = l > 0
        part = sp.to(tl.int64) * HEADS * T + head * T + t  # [split, head * T + token]
        ok = row_ok & (lo < n_keys)
        tl.store(part_o + part[:, None] * DV + dv[None, :], acc / tl.where(has, l, 1.0)[:, None],
                 mask=ok[:, None] & dv_ok[None, :])
        tl.store(part_lse + part, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf")), mask=ok)


@triton.jit
def _combine_kernel(lens, part_o, part_lse, out, T, num_splits, min_split_keys, stride_oh, stride_ot,
                    HEADS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0)  # head * T + token
    t = r % T
    n_keys = tl.load(lens + t // D).to(tl.int32) + D
    splits = tl.maximum(1, tl.minimum(num_splits, tl.cdiv(n_keys, min_split_keys)))
    used = tl.cdiv(n_keys, tl.cdiv(tl.cdiv(n_keys, splits), BLOCK_N) * BLOCK_N)  # as _split_kernel cuts them
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < DV
    s = tl.arange(0, BLOCK_S)
    s_ok = s < used
    part = s.to(tl.int64) * HEADS * T + r
    lse = tl.load(part_lse + part, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    o = tl.load(part_o + part[:, None] * DV + c[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
    o_at = out + (r // T).to(tl.int64) * stride_oh + t.to(tl.int64) * stride_ot
    tl.store(o_at + c, (tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)).to(out.dtype.element_ty), mask=c_ok)


def launches(heads: int, b: int, num_splits: int, consts: dict, opts: dict) -> list[tuple]:
    """[(kernel, grid, constexprs, launch options)] of one call: the split kernel over (b x row blocks, num_splits)
    programs, then the combine when num_splits > 1. consts: head dims, tiles and mask kind (mla_verify._launches)."""
    d, dv = consts["D"], consts["DV"]
    row_blocks = triton.cdiv(heads * d, consts["BLOCK_M"])
    out = [(_split_kernel, (b * row_blocks, num_splits),
            dict(consts, HEADS=heads, ROW_BLOCKS=row_blocks, SINGLE=num_splits == 1), opts)]
    if num_splits > 1:
        block_s = triton.next_power_of_2(num_splits)
        block_c = min(COMBINE_COLS, consts["BLOCK_DV"], max(16, COMBINE_TILE // block_s))
        out.append((_combine_kernel, (heads * b * d, triton.cdiv(dv, block_c)),
                    dict(HEADS=heads, D=d, DV=dv, BLOCK_N=consts["BLOCK_N"], BLOCK_S=block_s, BLOCK_C=block_c),
                    dict(num_warps=4, num_stages=1)))
    return out


def launch(plan: list[tuple], q, cache, starts, prefix_lens, mask, out, num_splits: int, min_split_keys: int,
           scale_log2: float, pdl: bool):
    """Run `plan` (launches(...)) into out [heads, T, kv_lora]; the partials of several splits are fp32 scratch from
    torch's caching allocator (the graph's pool when capturing)."""
    heads, t, kv_lora = out.shape
    if num_splits == 1:
        part_o = part_lse = out  # unused pointers
    else:
        part_o = torch.empty(num_splits, heads * t, kv_lora, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, heads * t, dtype=torch.float32, device=q.device)
    kernel, grid, consts, opts = plan[0]
    kernel[grid](q, cache, starts, prefix_lens, mask, part_o, part_lse, out, t, num_splits, min_split_keys,
                 q.stride(0), q.stride(1), cache.stride(0), out.stride(0), out.stride(1), scale_log2, PDL=pdl,
                 **consts, **opts, **_pdl.launch_kwargs(pdl))
    if num_splits > 1:
        kernel, grid, consts, opts = plan[1]
        kernel[grid](prefix_lens, part_o, part_lse, out, t, num_splits, min_split_keys, out.stride(0),
                     out.stride(1), PDL=pdl, **consts, **opts, **_pdl.launch_kwargs(pdl))
    return out
