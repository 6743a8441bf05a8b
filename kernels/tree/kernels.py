"""Triton kernels of the EAGLE draft-tree component: one program per request, one launch per call.

Every loop is bounded (by spec_steps, D or the mask's size), so an invalid tree is flagged in `flags`, never
followed forever; a program indexes only its own request's rows. Host-side checks live in api.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bits OR-ed into the per-request `flags` output (0 = valid). api.py re-exports them.
FLAG_ID_RANGE = 1  # an index outside its range (candidate id, list entry, retrieve index, table slot)
FLAG_MISSING_PARENT = 2  # a node's parent candidate is not among the drafted nodes
FLAG_CYCLE = 4  # a parent chain that does not reach the root within spec_steps, or a node reached twice
FLAG_NAN_SCORE = 8  # NaN among a request's draft scores
FLAG_UNSORTED = 16  # a top_scores_index row not strictly ascending (a duplicate or unsorted candidate)
FLAG_DUPLICATE_INDEX = 32  # two nodes of a request with one retrieve_index (their predicts would overwrite)
# kernels may read only constexpr globals
_RANGE, _MISSING = tl.constexpr(FLAG_ID_RANGE), tl.constexpr(FLAG_MISSING_PARENT)
_CYCLE, _NAN, _UNSORTED = tl.constexpr(FLAG_CYCLE), tl.constexpr(FLAG_NAN_SCORE), tl.constexpr(FLAG_UNSORTED)
_DUPLICATE = tl.constexpr(FLAG_DUPLICATE_INDEX)
MASK_MODES = {"full": 0, "qlen_only": 1, "qlen_only_bitpacking": 2}
FILL_BLOCK = 4096  # bytes of the all-True context prefix one program writes per iteration
FILL_PROGRAMS = 512  # about four per SM on a 132-SM H200


def _warps(block: int) -> int:
    return 1 if block <= 16 else (2 if block <= 32 else 4)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _organize_kernel(scores, tokens, top_index, draft_tokens, flags, N: tl.constexpr, K: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_FLAGS: tl.constexpr):
    # Keep the K largest under the stable descending order (score, then lower index): find the K-th largest score
    # by building its order-preserving 32-bit key bit by bit, then admit ties at it by index; the output slot of a
    # kept candidate is the number of kept candidates before it (ascending order).
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    valid = i < N
    x = tl.load(scores + b * N + i, mask=valid, other=0.0).to(tl.float32)
    nan = (x != x) & valid
    x = tl.where(nan, float("-inf"), x) + 0.0  # + 0.0 turns -0.0 into +0.0, so equal floats get equal keys
    bits = x.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648  # float order as 0 .. 2^32 - 1
    key = tl.where(valid, key, -1)
    kth = tl.zeros([], dtype=tl.int64)
    for bit in tl.static_range(31, -1, -1):
        trial = kth | (1 << bit)
        kth = tl.where(tl.sum((key >= trial).to(tl.int32), axis=0) >= K, trial, kth)
    above = key > kth
    tie = (key == kth).to(tl.int32)
    keep = above | ((tie != 0) & (tl.cumsum(tie, axis=0) - tie < K - tl.sum(above.to(tl.int32), axis=0)))
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - keep.to(tl.int32)
    tl.store(top_index + b * K + slot, i.to(top_index.dtype.element_ty), mask=keep)
    tok = tl.load(tokens + b * N + i, mask=keep, other=0)
    tl.store(draft_tokens + b * K + slot, tok.to(draft_tokens.dtype.element_ty), mask=keep)
    if HAS_FLAGS:
        bad = tl.max(nan.to(tl.int32), axis=0)
        tl.store(flags + b, tl.load(flags + b) | (bad * _NAN))


@triton.jit
def _build_tree_kernel(verified_id, parent_list, top_index, draft_in, seq_lens, tree_mask, mask_words, positions,
                       retrieve_index, next_token, next_sibling, draft_out, flags, parent_width, mask_numel,
                       fill_programs, TOPK: tl.constexpr, STEPS: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, MASK_MODE: tl.constexpr, FILL: tl.constexpr,
                       HAS_FLAGS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    seq = tl.load(seq_lens + b).to(tl.int64)
    seq_c = tl.maximum(seq, 0)
    if MASK_MODE == 0:  # full: blocks of D x (seq_len + D) laid end to end; needs the earlier requests' lengths
        ob = tl.arange(0, BLOCK_B)
        prev = tl.load(seq_lens + ob, mask=ob < b, other=0).to(tl.int64)
        base = D * tl.sum(tl.maximum(prev, 0), axis=0) + b * D * D
        row_len = seq_c + D
        row_len32 = row_len.to(tl.int32)
        prefix = seq_c.to(tl.int32)
    else:
        base = b * D * D
        row_len32 = D
        prefix = 0
    room = mask_numel - base  # stores stay inside the mask even when seq_lens disagrees with the host's sum
    if p == 0:  # the tree: parents, depths, ancestor mask, child/sibling lists
        # Tiles are [k, j]: j (axis 1) is the node a result belongs to, k (axis 0) the node reduced over. With
        # Triton's layout here (lanes along axis 1) an axis-0 reduction is in-thread plus one cross-warp step.
        j = tl.arange(0, BLOCK_D)
        kk = j[:, None]
        node = (j >= 1) & (j < D)
        num_cand = TOPK + (STEPS - 1) * TOPK * TOPK
        s = tl.load(top_index + b * (D - 1) + j - 1, mask=node, other=-1).to(tl.int64)
        before = tl.load(top_index + b * (D - 1) + j - 2, mask=node & (j >= 2), other=-1).to(tl.int64)
        unsorted = node & (j >= 2) & (s <= before)  # node order must be candidate order: no duplicate either
        s_ok = (s >= 0) & (s < num_cand)
        s32 = tl.where(node & s_ok, s, -1).to(tl.int32)
        g = tl.maximum(s32, 0) // TOPK
        g_ok = (g == 0) | (g < parent_width)  # the first level's parent is the root: spec_steps 1 has no list
        need = node & s_ok & g_ok & (g > 0)
        target = tl.load(parent_list + b * parent_width + g, mask=need, other=-1).to(tl.int64)
        t32 = tl.where(need & (target >= 0) & (target < num_cand), target, -2).to(tl.int32)
        first = tl.min(tl.where((s32[:, None] == t32[None, :]) & node[:, None], kk, BLOCK_D), axis=0)
        missing = need & (first == BLOCK_D)
        par = tl.where(need & ~missing, first, 0)
        # pointer jumping: after STEPS jumps every node of a valid tree sits at the root. The ancestor set of node
        # j (itself and the root included) is an int64 bitmask, so no 2-D tile lives across the jumps (D <= 64).
        cur = tl.where(j < D, j, 0)
        depth = tl.zeros([BLOCK_D], dtype=tl.int32)
        one = tl.full([BLOCK_D], 1, tl.int64)
        anc = (one << cur.to(tl.int64)) | 1
        for _ in tl.static_range(STEPS):
            depth += (cur != 0).to(tl.int32)
            cur = tl.sum(tl.where(kk == cur[None, :], par[:, None], 0), axis=0)
            anc = anc | (one << cur.to(tl.int64))
        bits = tl.where(node & ~(s_ok & g_ok), _RANGE, 0) | tl.where(missing, _MISSING, 0) \
            | tl.where(cur != 0, _CYCLE, 0) | tl.where(unsorted, _UNSORTED, 0)
        code = tl.reduce(bits, 0, _or) | ((seq < 0).to(tl.int32) * _RANGE)
        first_child = tl.min(tl.where((par[:, None] == j[None, :]) & node[:, None], kk, BLOCK_D), axis=0)
        sib = (par[:, None] == par[None, :]) & (kk > j[None, :]) & node[:, None] & node[None, :]
        next_sib = tl.min(tl.where(sib, kk, BLOCK_D), axis=0)
        bad = code != 0
        rows = b * D + j
        out = j < D
        tl.store(positions + rows, tl.where(bad, -1, seq + depth), mask=out)
        tl.store(retrieve_index + rows, rows, mask=out)
        tl.store(next_token + rows, tl.where(bad | (first_child == BLOCK_D), -1, first_child), mask=out)
        tl.store(next_sibling + rows, tl.where(bad | (next_sib == BLOCK_D), -1, next_sib), mask=out)
        tok = tl.load(draft_in + b * (D - 1) + j - 1, mask=node, other=0)
        tok = tl.where(j == 0, tl.load(verified_id + b).to(tok.dtype), tok)
        tl.store(draft_out + rows, tok.to(draft_out.dtype.element_ty), mask=out)
        if MASK_MODE == 2:  # one little-endian bitmask per row: the ancestor set itself (D <= 32 here)
            tl.store(tree_mask + rows, anc.to(tree_mask.dtype.element_ty), mask=out)
        else:
            tile = (kk < D) & (j[None, :] < D)  # [row j, column k] here: contiguous along axis 1, like the tiles
            off = kk * row_len32 + prefix + j[None, :]
            room32 = tl.minimum(room, 2147483647).to(tl.int32)
            bit = ((anc[:, None] >> j[None, :].to(tl.int64)) & 1).to(tl.uint8)
            tl.store(tree_mask + base + off, bit, mask=tile & (off < room32))
        if HAS_FLAGS:
            tl.store(flags + b, tl.load(flags + b) | code)
    elif MASK_MODE == 0:  # fill programs share the all-True context prefixes
        # A row's prefix [start, end) is written as 16-byte-aligned int32 words of 0x01010101 (through `mask_words`,
        # an int32 view of the same storage) in chunks of FILL bytes, plus up to 15 bytes at each end.
        w = tl.arange(0, FILL // 4)
        h = tl.arange(0, 16)
        word_end = (mask_numel // 16) * 4  # whole words that lie inside the mask
        per_row = tl.maximum(tl.cdiv(seq_c, FILL), 1)  # the aligned part of a row is at most seq_c bytes
        chunk = (p - 1).to(tl.int64)
        while chunk < D * per_row:  # a while loop: triton 3.6's interpreter rejects run-time range() bounds
            r = chunk // per_row
            ci = chunk - r * per_row
            start = base + r * row_len
            end = tl.minimum(start + seq_c, mask_numel)
            a0 = (start + 15) // 16 * 16
            a1 = end // 16 * 16
            wo = tl.multiple_of(a0 // 4 + ci * (FILL // 4), 4) + w  # 16-byte aligned: st.global.v4
            w_end = tl.multiple_of(tl.minimum(a1 // 4, word_end), 4)
            tl.store(mask_words + wo, tl.full([FILL // 4], 0x01010101, tl.int32), mask=wo < w_end)
            if ci == 0:
                tl.store(tree_mask + start + h, tl.full([16], 1, tl.uint8), mask=start + h < tl.minimum(a0, end))
                tl.store(tree_mask + tl.maximum(a1, a0) + h, tl.full([16], 1, tl.uint8),
                         mask=tl.maximum(a1, a0) + h < end)
            chunk += fill_programs


@triton.jit
def _verify_kernel(candidates, retrieve_index, next_token, next_sibling, target_predict, predicts, accept_index,
                   accept_num, flags, D: tl.constexpr, S: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, HAS_FLAGS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = b * D
    j = tl.arange(0, BLOCK_D)
    js = tl.arange(0, BLOCK_S)
    inb = j < D
    ri = tl.load(retrieve_index + row + j, mask=inb, other=row).to(tl.int64)
    nt = tl.load(next_token + row + j, mask=inb, other=-1).to(tl.int64)
    ns = tl.load(next_sibling + row + j, mask=inb, other=-1).to(tl.int64)
    ok = (ri >= row) & (ri < row + D) & (nt >= -1) & (nt < D) & (ns >= -1) & (ns < D)
    # A tree reaches every non-root node from exactly one list entry and the root from none; a node reached twice is
    # how a cycle shows, so a walk over a tree that passes this visits each node at most once.
    refs = tl.sum(((nt[:, None] == j[None, :]) & inb[:, None]).to(tl.int32)
                  + ((ns[:, None] == j[None, :]) & inb[:, None]).to(tl.int32), axis=0)
    same = tl.sum(((ri[:, None] == ri[None, :]) & inb[:, None]).to(tl.int32), axis=0)
    code = tl.max((inb & ~ok).to(tl.int32), axis=0) * _RANGE \
        | tl.max((((refs > 1) | ((j == 0) & (refs > 0))) & inb).to(tl.int32), axis=0) * _CYCLE \
        | tl.max(((same > 1) & inb).to(tl.int32), axis=0) * _DUPLICATE
    done = (code != 0) | (S <= 1)
    last = tl.where(code != 0, row, tl.load(retrieve_index + row).to(tl.int64))
    cur = tl.where(code != 0, -1, tl.load(next_token + row).to(tl.int64))
    n = tl.full([], 0, tl.int32)
    it = tl.full([], 0, tl.int32)
    pred = tl.full([BLOCK_D], -1, tl.int32)
    acc = tl.where(js == 0, last.to(tl.int32), -1)
    # Each pass examines one node (accept it and descend, or move to its next sibling) or ends the walk.
    while (it < D) & (done == 0):
        active = cur >= 0
        c = row + tl.maximum(cur, 0)
        tok = tl.load(candidates + c).to(tl.int64)
        hit = active & (tok == tl.load(target_predict + last).to(tl.int64))
        gi = tl.load(retrieve_index + c).to(tl.int64)
        pred = tl.where(hit & (j == last - row), tok.to(tl.int32), pred)
        n += hit.to(tl.int32)
        acc = tl.where(hit & (js == n), gi.to(tl.int32), acc)
        last = tl.where(hit, gi, last)
        cur = tl.where(hit, tl.load(next_token + c).to(tl.int64), tl.load(next_sibling + c).to(tl.int64))
        done = ~active | (hit & (n >= S - 1))
        it += 1
    bad = code != 0
    pred = tl.where(j == last - row, tl.load(target_predict + last).to(tl.int32), pred)
    tl.store(predicts + row + j, tl.where(bad, -1, pred), mask=inb)
    tl.store(accept_index + b * S + js, tl.where(bad, -1, acc), mask=js < S)
    tl.store(accept_num + b, tl.where(bad, -1, n))
    if HAS_FLAGS:
        tl.store(flags + b, tl.load(flags + b) | code)


@triton.jit
def _assign_kernel(req_to_token, req_pool_indices, seq_lens, out_cache_loc, flags, rows, max_len, slot_max,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_FLAGS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pool = tl.load(req_pool_indices + b).to(tl.int64)
    seq = tl.load(seq_lens + b).to(tl.int64)
    j = tl.arange(0, BLOCK_D)
    slot = tl.load(out_cache_loc + b * D + j, mask=j < D, other=0)
    # a slot the table's dtype cannot hold would be stored truncated: another request's KV
    wide = tl.max(((slot.to(tl.int64) < 0) | (slot.to(tl.int64) > slot_max)).to(tl.int32), axis=0)
    ok = (pool >= 0) & (pool < rows) & (seq >= 0) & (seq + D <= max_len) & (wide == 0)
    tl.store(req_to_token + pool * max_len + seq + j, slot.to(req_to_token.dtype.element_ty), mask=(j < D) & ok)
    if HAS_FLAGS:
        tl.store(flags + b, tl.load(flags + b) | tl.where(ok, 0, _RANGE))


@triton.jit
def _argmax_kernel(logits, out, V: tl.constexpr, BLOCK_V: tl.constexpr):
    # Per lane: the largest value seen and its first index; then the smallest index among the lanes holding the
    # row maximum, which is torch.argmax's first-occurrence rule.
    r = tl.program_id(0).to(tl.int64)
    v = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_V], dtype=tl.int32)
    for start in tl.static_range(0, V, BLOCK_V):
        x = tl.load(logits + r * V + start + v, mask=start + v < V, other=float("-inf")).to(tl.float32)
        up = x > best
        best = tl.where(up, x, best)
        best_i = tl.where(up, start + v, best_i)
    top = tl.max(best, axis=0)
    tl.store(out + r, tl.min(tl.where(best == top, best_i, V), axis=0).to(out.dtype.element_ty))


def _flags_arg(flags, like):
    return (flags, True) if flags is not None else (like, False)  # a dummy pointer the kernel never touches


def organize(scores, tokens, num_keep, flags=None):
    """scores [B, N] (float), tokens [B, N] -> (top index [B, K] int64 ascending, draft tokens [B, K])."""
    batch, n = scores.shape
    top = torch.empty(batch, num_keep, dtype=torch.int64, device=scores.device)
    draft = torch.empty(batch, num_keep, dtype=tokens.dtype, device=scores.device)
    block = triton.next_power_of_2(n)
    f, has = _flags_arg(flags, top)
    _organize_kernel[(batch,)](scores, tokens, top, draft, f, N=n, K=num_keep, BLOCK_N=block, HAS_FLAGS=has,
                               num_warps=_warps(block // 4))
    return top, draft


def build_tree(verified_id, parent_list, top_index, draft_tokens, seq_lens, topk, spec_steps, d, mask_mode,
               mask_numel, mask_dtype, seq_lens_sum, flags=None):
    """Launch on inputs api.py has shape-checked; the mask's size comes from the host's seq_lens_sum (no device
    sync). Returns the tuple of tree.build_tree."""
    batch = verified_id.shape[0]
    dev = verified_id.device
    positions = torch.empty(batch * d, dtype=torch.int64, device=dev)
    retrieve_index = torch.empty(batch, d, dtype=torch.int64, device=dev)
    next_token = torch.empty(batch, d, dtype=torch.int64, device=dev)
    next_sibling = torch.empty(batch, d, dtype=torch.int64, device=dev)
    draft_out = torch.empty(batch * d, dtype=draft_tokens.dtype, device=dev)
    mode = MASK_MODES[mask_mode]
    if mode == 2:
        tree_mask = torch.empty(mask_numel, dtype=mask_dtype, device=dev)
        mask_bytes = mask_words = tree_mask
    else:  # bool mask in storage padded to 16 bytes, so that an int32 view of it exists for the prefix fill
        storage = torch.empty(triton.cdiv(mask_numel, 16) * 16, dtype=torch.uint8, device=dev)
        mask_bytes, mask_words = storage[:mask_numel], storage.view(torch.int32)
        tree_mask = mask_bytes.view(torch.bool)
    block_d = triton.next_power_of_2(d)
    f, has = _flags_arg(flags, positions)
    # full mask: about FILL_PROGRAMS fill programs in all, never more than a request has chunks of its prefix
    chunks = d * triton.cdiv(max(seq_lens_sum // max(batch, 1), 1), FILL_BLOCK)
    fill = min(chunks, triton.cdiv(FILL_PROGRAMS, max(batch, 1))) if mode == 0 else 0
    _build_tree_kernel[(batch, 1 + fill)](
        verified_id, parent_list, top_index, draft_tokens, seq_lens, mask_bytes, mask_words, positions,
        retrieve_index, next_token, next_sibling, draft_out, f, parent_list.shape[1], mask_numel, max(fill, 1),
        TOPK=topk, STEPS=spec_steps, D=d, BLOCK_D=block_d, BLOCK_B=max(16, triton.next_power_of_2(batch)),
        MASK_MODE=mode, FILL=FILL_BLOCK, HAS_FLAGS=has, num_warps=_warps(block_d))
    return tree_mask, positions, retrieve_index, next_token, next_sibling, draft_out


def verify_tree_greedy(candidates, retrieve_index, next_token, next_sibling, target_predict, num_spec_steps,
                       flags=None):
    batch, d = candidates.shape
    dev = candidates.device
    predicts = torch.empty(batch * d, dtype=torch.int32, device=dev)
    accept_index = torch.empty(batch, num_spec_steps, dtype=torch.int32, device=dev)
    accept_num = torch.empty(batch, dtype=torch.int32, device=dev)
    f, has = _flags_arg(flags, predicts)
    block_d = triton.next_power_of_2(d)
    _verify_kernel[(batch,)](candidates, retrieve_index, next_token, next_sibling, target_predict, predicts,
                             accept_index, accept_num, f, D=d, S=num_spec_steps, BLOCK_D=block_d,
                             BLOCK_S=triton.next_power_of_2(num_spec_steps), HAS_FLAGS=has,
                             num_warps=1 if block_d <= 32 else 2)
    return predicts, accept_index, accept_num


def assign_req_to_token(req_to_token, req_pool_indices, seq_lens, out_cache_loc, d, flags=None):
    f, has = _flags_arg(flags, req_pool_indices)
    _assign_kernel[(req_pool_indices.shape[0],)](req_to_token, req_pool_indices, seq_lens, out_cache_loc, f,
                                                  req_to_token.shape[0], req_to_token.shape[1],
                                                  torch.iinfo(req_to_token.dtype).max, D=d,
                                                  BLOCK_D=triton.next_power_of_2(d), HAS_FLAGS=has, num_warps=1)
    return req_to_token


def argmax(logits):
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    block = min(4096, triton.next_power_of_2(vocab))
    _argmax_kernel[(rows,)](logits, out, V=vocab, BLOCK_V=block, num_warps=8 if block >= 4096 else 4)
    return out
