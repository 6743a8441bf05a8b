"""The Triton flash-decoding kernels of MLA decode attention (api.py): stage 1 streams a split of the latent
cache for every query row, stage 2 combines the splits; `launch` runs them for a checked call and a complete config.

Stage 1, grid (row blocks, splits): the heads x n query rows are one [heads * n, D] matrix (every head reads the
  same cache), BLOCK_M of them per program; each program streams its split of the keys in BLOCK_N-key tiles read
  once for all its rows (the tile serves both dots: scores from all D columns, values from the first kv_lora),
  online softmax in fp32 (exp2 domain), and writes its normalized partial o [splits, rows, kv_lora] fp32 and
  log2-sum-exp [splits, rows]. Row blocks of one split are adjacent in the grid, so with several row blocks the
  cache is read from DRAM about once and the repeats hit L2.
Stage 2, grid (rows, kv_lora chunks): combines the splits by log-sum-exp weights and writes o in q's dtype.
With one split, stage 1 writes o itself (one launch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from verifybench.kernels.common import pdl as _pdl

MAX_SPLITS = 256
COMBINE_SPLITS = MAX_SPLITS  # splits stage 2 reads per step: all of them, so its loops run once (two L2 round trips)
COMBINE_COLS = 128  # kv_lora columns per stage-2 program, at most
COMBINE_TILE = 8192  # fp32 partial values a stage-2 program holds at once (64 registers per thread at 4 warps)


@triton.jit
def _split_kernel(q, cache, part_o, part_lse, out, length, split_keys, stride_qh, stride_qn, stride_c, stride_oh,
                  stride_on, scale_log2, ROWS: tl.constexpr, NQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
                  SINGLE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # q and the verify tokens' cache rows come from the kernels just before
        gdc_wait()
        gdc_launch_dependents()
    rb = tl.program_id(0)
    sp = tl.program_id(1)
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)  # query row = head * NQ + token; rows past ROWS are zero padding
    row_ok = r < ROWS
    q_row = (r // NQ).to(tl.int64) * stride_qh + (r % NQ) * stride_qn
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    q_lat = tl.load(q + q_row[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    if BLOCK_DR > 0:  # the rope columns DV..D-1 only enter the scores
        dr = DV + tl.arange(0, BLOCK_DR)
        dr_ok = dr < D
        q_rope = tl.load(q + q_row[:, None] + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    lo = sp * split_keys
    hi = tl.minimum(lo + split_keys, length)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of the scores, log2 units
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)
        key_ok = key < hi
        rows_at = cache + key.to(tl.int64)[:, None] * stride_c
        k_lat = tl.load(rows_at + dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(k_lat))
        if BLOCK_DR > 0:
            k_rope = tl.load(rows_at + dr[None, :], mask=key_ok[:, None] & dr_ok[None, :], other=0.0)
            s += tl.dot(q_rope, tl.trans(k_rope))
        # every tile holds at least one valid key (start < hi), so each row's max is finite
        s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
        m = m_new
    has = l > 0  # false only for an empty split, which the host never launches
    o = acc / tl.where(has, l, 1.0)[:, None]
    if SINGLE:
        o_row = (r // NQ).to(tl.int64) * stride_oh + (r % NQ) * stride_on
        tl.store(out + o_row[:, None] + dv[None, :], o.to(out.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
    else:
        part = sp * ROWS + r
        tl.store(part_o + part[:, None].to(tl.int64) * DV + dv[None, :], o, mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(part_lse + part, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf")), mask=row_ok)


@triton.jit
def _combine_kernel(part_o, part_lse, out, num_splits, stride_oh, stride_on, ROWS: tl.constexpr, NQ: tl.constexpr,
                    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < DV
    s = tl.arange(0, BLOCK_S)
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        top = tl.maximum(top, tl.load(part_lse + (s0 + s) * ROWS + r, mask=s0 + s < num_splits,
                                      other=float("-inf")))
    top_all = tl.max(top, axis=0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ok = s0 + s < num_splits
        w = tl.exp2(tl.load(part_lse + (s0 + s) * ROWS + r, mask=ok, other=float("-inf")) - top_all)
        part = ((s0 + s) * ROWS + r).to(tl.int64)
        o = tl.load(part_o + part[:, None] * DV + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        total += w
    o_row = (r // NQ).to(tl.int64) * stride_oh + (r % NQ) * stride_on
    tl.store(out + o_row + c, (acc / tl.sum(total, axis=0)).to(out.dtype.element_ty), mask=c_ok)


def split_keys(length: int, num_splits: int, block_keys: int) -> int:
    """Keys per split: the context cut into num_splits, rounded up to whole key tiles."""
    return triton.cdiv(triton.cdiv(length, num_splits), block_keys) * block_keys


def launches(heads: int, n: int, d: int, kv_lora: int, length: int, num_splits: int, cfg: dict) -> list[tuple]:
    """[(kernel, grid, constexprs, launch options)] of one call: stage 1 over (row blocks, splits), the context cut
    into whole key tiles per split and lowered so that no split is empty, then stage 2 where there are several."""
    rows = heads * n
    splits = triton.cdiv(length, split_keys(length, num_splits, cfg["block_keys"]))  # no empty split
    single = splits == 1
    out = [(_split_kernel, (triton.cdiv(rows, cfg["block_rows"]), splits),
            dict(ROWS=rows, NQ=n, D=d, DV=kv_lora, BLOCK_M=cfg["block_rows"], BLOCK_N=cfg["block_keys"],
                 BLOCK_DV=max(16, triton.next_power_of_2(kv_lora)),
                 BLOCK_DR=max(16, triton.next_power_of_2(d - kv_lora)) if d > kv_lora else 0, SINGLE=single),
            dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))]
    if not single:
        block_s = min(COMBINE_SPLITS, triton.next_power_of_2(splits))
        block_c = min(COMBINE_COLS, triton.next_power_of_2(kv_lora), max(16, COMBINE_TILE // block_s))
        out.append((_combine_kernel, (rows, triton.cdiv(kv_lora, block_c)),
                    dict(ROWS=rows, NQ=n, DV=kv_lora, BLOCK_S=block_s, BLOCK_C=block_c), dict(num_warps=4)))
    return out


def launch(plan: list[tuple], q, cache, out, length: int, num_splits: int, scale_log2: float, pdl: bool):
    """Run `plan` (launches(...)) for q [heads, n, D] over cache[:length] into out [heads, n, kv_lora] (mla_decode
    checks the inputs and picks the config); the partials are fp32 scratch from torch's caching allocator (the
    graph's pool when capturing)."""
    kernel, grid, consts, opts = plan[0]
    rows, kv_lora, splits = consts["ROWS"], consts["DV"], grid[1]
    if consts["SINGLE"]:
        part_o = part_lse = out  # unused pointers
    else:
        part_o = torch.empty(splits, rows, kv_lora, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, rows, dtype=torch.float32, device=q.device)
    keys = split_keys(length, num_splits, consts["BLOCK_N"])
    kernel[grid](q, cache, part_o, part_lse, out, length, keys, q.stride(0), q.stride(1), cache.stride(0),
                 out.stride(0), out.stride(1), scale_log2, PDL=pdl, **consts, **opts, **_pdl.launch_kwargs(pdl))
    if not consts["SINGLE"]:
        kernel, grid, consts, opts = plan[1]
        kernel[grid](part_o, part_lse, out, splits, out.stride(0), out.stride(1), PDL=pdl, **consts, **opts,
                     **_pdl.launch_kwargs(pdl))
    return out
