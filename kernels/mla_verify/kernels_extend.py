"""extend, the engine-style MLA verify attention with a tree mask: what SGLang's Triton backend runs for verify (its
prefill kernel), written from its description; one head per program, a serial loop over the whole prefix.

Grid (B, heads, cdiv(D, BLOCK_M)): a serial loop over the prefix, then one over the D tree keys with the mask; scores as
a 512- plus a 64-wide dot; each key tile loaded twice, for the scores and as values (the engine's K and V buffers are
views of one cache). As the engine does, the prefix is read through a page table (one int64 cache row per key, page
size 1; here the identity, `rows`) and the scores and values are multiplied by the KV cache's dequantization scales
(1.0 for bf16): the table read puts a dependent load at the head of each serial iteration, and without it this kernel
ran in 0.54-0.65x the engine kernel's time at the same tiles (docs/FINDINGS.md, 2026-12-05). Both loops run to bounds
known only at run time, as the engine's do: with the tree loop's bound a compile-time D (one iteration, unrolled into
the code after the prefix loop) ptxas gave the kernel 32-40 registers and 4 KB of stack at 32 x 32 tiles, and it ran
5x slower than the engine's kernel on them. The engine's natural exp, -1e20 floor and mask-first tree loop (a tile no
query sees skipped) made this kernel faster still, further from the engine's time (docs/FINDINGS.md §9): not taken.
Semantics, checks and the reference: api.py, which calls `launch` with checked inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from verifybench.kernels.common import pdl as _pdl


@triton.jit
def _extend_kernel(q, cache, rows, starts, lens, mask, out, stride_qh, stride_qt, stride_c, stride_oh, stride_ot,
                   scale_log2, kv_scale, tree_keys, D: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, MASK_WORDS: tl.constexpr,
                   PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    i = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # tree token
    row_ok = i < D
    t = b * D + i
    q_row = head * stride_qh + t.to(tl.int64) * stride_qt
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    q_lat = tl.load(q + q_row[:, None] + dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    if BLOCK_DR > 0:
        dr = DV + tl.arange(0, BLOCK_DR)
        dr_ok = dr < DK
        q_rope = tl.load(q + q_row[:, None] + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    start = tl.load(starts + b).to(tl.int64)
    prefix = tl.load(lens + b).to(tl.int32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, prefix, BLOCK_N):  # the prefix, serially: every query sees every key
        key = s0 + tl.arange(0, BLOCK_N)
        key_ok = key < prefix
        loc = tl.load(rows + start + key, mask=key_ok, other=0)  # the page table: the key's cache row
        rows_at = cache + loc * stride_c
        k_t = tl.load(rows_at[None, :] + dv[:, None], mask=dv_ok[:, None] & key_ok[None, :], other=0.0)
        s = tl.dot(q_lat, k_t)
        if BLOCK_DR > 0:
            kr_t = tl.load(rows_at[None, :] + dr[:, None], mask=dr_ok[:, None] & key_ok[None, :], other=0.0)
            s += tl.dot(q_rope, kr_t)
        s = tl.where(key_ok[None, :], s * (scale_log2 * kv_scale), float("-inf"))  # a tile holds a key: finite max
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(rows_at[:, None] + dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v) * kv_scale
        m = m_new
    if MASK_WORDS:
        word = tl.load(mask + t, mask=row_ok, other=0).to(tl.int64)
    for s0 in range(0, tree_keys, BLOCK_N):  # the tree keys (tree_keys = D, a run-time bound), masked
        key = s0 + tl.arange(0, BLOCK_N)
        key_ok = key < D
        rows_at = cache + (start + prefix + key) * stride_c
        k_t = tl.load(rows_at[None, :] + dv[:, None], mask=dv_ok[:, None] & key_ok[None, :], other=0.0)
        s = tl.dot(q_lat, k_t)
        if BLOCK_DR > 0:
            kr_t = tl.load(rows_at[None, :] + dr[:, None], mask=dr_ok[:, None] & key_ok[None, :], other=0.0)
            s += tl.dot(q_rope, kr_t)
        if MASK_WORDS:
            seen = ((word[:, None] >> tl.minimum(key, 63)[None, :]) & 1) != 0
        else:
            seen = tl.load(mask + t[:, None].to(tl.int64) * D + key[None, :],
                           mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
        s = tl.where(key_ok[None, :] & seen, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet (L_b = 0): no NaN
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(rows_at[:, None] + dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(out + head * stride_oh + t[:, None].to(tl.int64) * stride_ot + dv[None, :],
             (acc / tl.where(row_ok, l, 1.0)[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


def launches(heads: int, b: int, consts: dict, opts: dict) -> list[tuple]:
    """[(kernel, grid, constexprs, launch options)] of one call: one program per (request, head, BLOCK_M tree
    tokens). consts: the head dims, tiles and mask kind (mla_verify._launches)."""
    return [(_extend_kernel, (b, heads, triton.cdiv(consts["D"], consts["BLOCK_M"])), consts, opts)]


def launch(plan: list[tuple], q, cache, starts, prefix_lens, mask, out, scale_log2: float, pdl: bool):
    """Run `plan` (launches(...)) into out [heads, T, kv_lora]; the page table is the identity over the cache's rows
    and the KV scale 1.0 (a bf16 cache)."""
    kernel, grid, consts, opts = plan[0]
    kernel[grid](q, cache, identity_rows(cache.shape[0], cache.device), starts, prefix_lens, mask, out, q.stride(0),
                 q.stride(1), cache.stride(0), out.stride(0), out.stride(1), scale_log2, 1.0, consts["D"], PDL=pdl,
                 **consts, **opts, **_pdl.launch_kwargs(pdl))
    return out


_IDENTITY: dict = {}


def identity_rows(n: int, device) -> torch.Tensor:
    """int64 [n] = 0..n-1 on `device`: the page table of a cache whose rows are laid out in order. One tensor per
    (device, n), built on the first call at that size and kept for the process: a CUDA graph captured with it reads
    it at every replay, so it is never freed or replaced (built inside a capture, it lives in the graph's pool and
    this dict keeps it there)."""
    key = (str(torch.device(device)), int(n))
    if key not in _IDENTITY:
        _IDENTITY[key] = torch.arange(n, dtype=torch.int64, device=device)
    return _IDENTITY[key]
