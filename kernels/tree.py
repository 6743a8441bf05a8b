"""EAGLE draft-tree construction and greedy verification (DESIGN.md 4.4, SGLang's semantics): organize the draft,
build the tree (mask, positions, child/sibling lists), verify greedily, write the KV slots, full-vocabulary argmax.

Each step has backend="reference" (plain torch, any device; an invalid tree raises ValueError naming the request)
and backend="kernel" (Triton, tree_triton.py: one launch per call, no host sync; an invalid request is flagged).
Kernel flags: pass `flags`, an int32 [B] tensor (zeros), and the kernel ORs the FLAG_* bits of each bad request into
it; in-band, a flagged build_tree request has positions -1 and no children, a flagged verify request
accept_token_num -1 and predicts / accept_index -1.
"""
from __future__ import annotations

from collections import Counter

import torch

from verifybench.kernels import tree_triton as _tt
from verifybench.kernels.tree_triton import (FLAG_CYCLE, FLAG_ID_RANGE, FLAG_MISSING_PARENT,  # noqa: F401 (re-exported)
                                 FLAG_NAN_SCORE, MASK_MODES)

BACKENDS = ("reference", "kernel")


def _resolve(backend: str, like: torch.Tensor) -> str:
    if backend == "auto":
        return "kernel" if like.is_cuda else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    return backend


def num_candidates(topk: int, spec_steps: int) -> int:
    """Length of the flattened score list: topk from the first step, topk^2 from each later one."""
    return topk + (spec_steps - 1) * topk * topk


def bitpack_dtype(num_verify_tokens: int) -> torch.dtype:
    """Narrowest integer type holding one bit per tree node (signed for 16/32 bits: torch's uint16/uint32 lack
    most ops; the bit pattern is what counts)."""
    for bits, dtype in ((8, torch.uint8), (16, torch.int16), (32, torch.int32)):
        if num_verify_tokens <= bits:
            return dtype
    raise ValueError(f"qlen_only_bitpacking holds at most 32 tree nodes per row, got num_verify_tokens="
                     f"{num_verify_tokens}")


def tree_mask_numel(mask_mode: str, batch: int, num_verify_tokens: int, seq_lens_sum: int) -> int:
    d = num_verify_tokens
    if mask_mode == "full":
        return d * seq_lens_sum + batch * d * d
    return batch * d * d if mask_mode == "qlen_only" else batch * d


def organize_draft_results(score_list, token_list, parents_list, num_verify_tokens: int, backend: str = "auto",
                           flags: torch.Tensor | None = None):
    """-> (parent_list [B, topk*(steps-1)+1], top_scores_index [B, D-1] ascending, draft_tokens [B, D-1]).

    top_scores_index holds the D-1 largest scores' indices; ties go to the lower index (torch.topk leaves them
    unspecified). The kernel treats NaN as -inf and flags FLAG_NAN_SCORE; the reference raises."""
    scores = torch.cat([s.flatten(1) for s in score_list], dim=1)
    tokens = torch.cat([t.flatten(1) for t in token_list], dim=1)
    batch = scores.shape[0]
    parent_list = (torch.cat(list(parents_list[:-1]), dim=1) if len(parents_list) > 1
                   else torch.empty(batch, 0, dtype=torch.int64, device=scores.device))
    keep = num_verify_tokens - 1
    if tokens.shape != scores.shape:
        raise ValueError(f"token_list flattens to {tuple(tokens.shape)}, score_list to {tuple(scores.shape)}")
    if not 1 <= keep <= scores.shape[1]:
        raise ValueError(f"num_verify_tokens={num_verify_tokens} needs 1..{scores.shape[1]} draft candidates")
    if _resolve(backend, scores) == "kernel":
        top, draft = _tt.organize(scores.contiguous(), tokens.contiguous(), keep, flags)
        return parent_list, top, draft
    nan_rows = torch.isnan(scores).any(dim=1).nonzero().flatten().tolist()
    if nan_rows:
        raise ValueError(f"request {nan_rows[0]}: NaN among the draft scores")
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :keep]
    top = torch.sort(order, dim=1).values
    return parent_list, top, torch.gather(tokens, 1, top)


def build_tree(verified_id, parent_list, top_scores_index, draft_tokens, seq_lens, topk: int, spec_steps: int,
               num_verify_tokens: int, mask_mode: str, backend: str = "auto", seq_lens_sum: int | None = None,
               flags: torch.Tensor | None = None):
    """-> (tree_mask, positions [B*D], retrieve_index [B, D], retrieve_next_token [B, D],
    retrieve_next_sibling [B, D], draft_tokens [B*D]); int64 indices, mask as DESIGN.md 4.4 lays it out.

    `seq_lens_sum` (the host's sum of seq_lens) sizes the full mask; without it the kernel path syncs to read it."""
    d, batch = num_verify_tokens, verified_id.shape[0]
    if mask_mode not in MASK_MODES:
        raise ValueError(f"unknown mask_mode {mask_mode!r}; choose one of {', '.join(MASK_MODES)}")
    if d < 2 or topk < 1 or spec_steps < 1:
        raise ValueError(f"need num_verify_tokens >= 2, topk >= 1, spec_steps >= 1 (got {d}, {topk}, {spec_steps})")
    for name, t, shape in (("top_scores_index", top_scores_index, (batch, d - 1)),
                           ("draft_tokens", draft_tokens, (batch, d - 1)), ("seq_lens", seq_lens, (batch,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if parent_list.dim() != 2 or parent_list.shape[0] != batch:
        raise ValueError(f"parent_list has shape {tuple(parent_list.shape)}, expected [{batch}, P]")
    mask_dtype = bitpack_dtype(d) if mask_mode == "qlen_only_bitpacking" else torch.bool
    if _resolve(backend, verified_id) == "reference":
        return _build_tree_reference(verified_id, parent_list, top_scores_index, draft_tokens, seq_lens, topk,
                                     spec_steps, d, mask_mode, mask_dtype, seq_lens_sum)
    if d > 64:
        raise ValueError(f"the build_tree kernel handles num_verify_tokens <= 64, got {d}; use the reference")
    if seq_lens_sum is None:
        seq_lens_sum = int(seq_lens.sum())  # a device sync: callers inside a CUDA graph pass it
    return _tt.build_tree(verified_id.contiguous(), parent_list.contiguous(), top_scores_index.contiguous(),
                          draft_tokens.contiguous(), seq_lens.contiguous(), topk, spec_steps, d, mask_mode,
                          tree_mask_numel(mask_mode, batch, d, seq_lens_sum), mask_dtype, seq_lens_sum, flags)


def _tree_parents(b: int, top: list[int], parent_list: list[int], topk: int, spec_steps: int) -> list[int]:
    """Parent node of every node of request b (root: -1), read literally off DESIGN.md 4.4."""
    n_cand = num_candidates(topk, spec_steps)
    parents = [-1]
    for j, s in enumerate(top, start=1):
        if not 0 <= s < n_cand:
            raise ValueError(f"request {b}: node {j} is candidate {s}, outside [0, {n_cand}) (id out of range)")
        g = s // topk
        if g == 0:
            parents.append(0)
            continue
        if g >= len(parent_list):
            raise ValueError(f"request {b}: node {j} needs parent_list[{g}], which has {len(parent_list)} "
                             "entries (id out of range)")
        if parent_list[g] not in top:
            raise ValueError(f"request {b}: node {j} (candidate {s}) has parent candidate {parent_list[g]}, which "
                             "is not among the drafted nodes (missing parent)")
        parents.append(top.index(parent_list[g]) + 1)
    return parents


def _tree_chains(b: int, parents: list[int], spec_steps: int) -> list[list[int]]:
    """Per node: itself and its ancestors up to the root. Raises on a cycle or a depth beyond spec_steps."""
    chains = [[0]]
    for j in range(1, len(parents)):
        chain = [j]
        while chain[-1] != 0:
            nxt = parents[chain[-1]]
            if nxt in chain:
                raise ValueError(f"request {b}: the parent chain of node {j} has a cycle: {chain + [nxt]}")
            chain.append(nxt)
        if len(chain) - 1 > spec_steps:
            raise ValueError(f"request {b}: node {j} has depth {len(chain) - 1} > spec_steps={spec_steps}")
        chains.append(chain)
    return chains


def _build_tree_reference(verified_id, parent_list, top_scores_index, draft_tokens, seq_lens, topk, spec_steps,
                          d, mask_mode, mask_dtype, seq_lens_sum):
    dev, batch = verified_id.device, verified_id.shape[0]
    seq, tops, plist = seq_lens.tolist(), top_scores_index.tolist(), parent_list.tolist()
    if seq_lens_sum is not None and seq_lens_sum != sum(seq):
        raise ValueError(f"seq_lens_sum={seq_lens_sum} but seq_lens sums to {sum(seq)}")
    positions, next_token, next_sibling, masks = [], [], [], []
    for b in range(batch):
        if seq[b] < 0:
            raise ValueError(f"request {b}: seq_len {seq[b]} < 0 (id out of range)")
        parents = _tree_parents(b, tops[b], plist[b], topk, spec_steps)
        chains = _tree_chains(b, parents, spec_steps)
        positions += [seq[b] + len(c) - 1 for c in chains]
        children = [[k for k in range(1, d) if parents[k] == j] for j in range(d)]  # ascending node index
        next_token.append([c[0] if c else -1 for c in children])
        sibling = [-1] * d
        for c in children:
            for a, z in zip(c, c[1:]):
                sibling[a] = z
        next_sibling.append(sibling)
        masks.append([[c in chain for c in range(d)] for chain in chains])
    qlen = torch.tensor(masks, dtype=torch.bool).view(batch, d, d)
    if mask_mode == "qlen_only_bitpacking":
        words = (qlen.long() << torch.arange(d)).sum(-1).flatten()
        bits = torch.iinfo(mask_dtype).bits
        words = torch.where(words >= 1 << (bits - 1), words - (1 << bits), words) if mask_dtype.is_signed else words
        tree_mask = words.to(mask_dtype).to(dev)
    elif mask_mode == "qlen_only":
        tree_mask = qlen.flatten().to(dev)
    else:
        blocks = [torch.cat([torch.ones(d, seq[b], dtype=torch.bool, device=dev), qlen[b].to(dev)], 1).flatten()
                  for b in range(batch)]
        tree_mask = torch.cat(blocks)
    tokens = torch.cat([verified_id.view(batch, 1).to(draft_tokens.dtype), draft_tokens], dim=1).flatten()
    index = torch.arange(batch * d, device=dev).view(batch, d)
    as_long = dict(dtype=torch.int64, device=dev)
    return (tree_mask, torch.tensor(positions, **as_long), index, torch.tensor(next_token, **as_long),
            torch.tensor(next_sibling, **as_long), tokens)


def verify_tree_greedy(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict,
                       num_spec_steps: int, backend: str = "auto", flags: torch.Tensor | None = None):
    """-> (predicts [B*D] int32, accept_index [B, num_spec_steps] int32, accept_token_num [B] int32).

    Up to num_spec_steps - 1 draft tokens are accepted per request (pass spec_steps + 1 for a whole path)."""
    batch, d = candidates.shape
    for name, t in (("retrieve_index", retrieve_index), ("retrieve_next_token", retrieve_next_token),
                    ("retrieve_next_sibling", retrieve_next_sibling)):
        if tuple(t.shape) != (batch, d):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(batch, d)}")
    if target_predict.numel() != batch * d or num_spec_steps < 1:
        raise ValueError(f"need target_predict of {batch * d} entries and num_spec_steps >= 1")
    if _resolve(backend, candidates) == "kernel":
        return _tt.verify_tree_greedy(candidates.contiguous(), retrieve_index.contiguous(),
                                      retrieve_next_token.contiguous(), retrieve_next_sibling.contiguous(),
                                      target_predict.contiguous().view(-1), num_spec_steps, flags)
    cand, index = candidates.tolist(), retrieve_index.tolist()
    nxt, sib, target = retrieve_next_token.tolist(), retrieve_next_sibling.tolist(), target_predict.view(-1).tolist()
    for b in range(batch):
        _check_lists(b, index[b], nxt[b], sib[b])
    predicts = [-1] * (batch * d)
    accept_index = [[-1] * num_spec_steps for _ in range(batch)]
    accept_num = [0] * batch
    for b in range(batch):
        last, cur, n = index[b][0], 0, 0
        accept_index[b][0] = last
        for _ in range(1, num_spec_steps):
            cur = nxt[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    predicts[last] = cand[b][cur]
                    n += 1
                    accept_index[b][n] = last = index[b][cur]
                    break
                cur = sib[b][cur]
            else:
                break  # no child of the last accepted node matches
        accept_num[b] = n
        predicts[last] = target[last]  # the bonus token
    as_int = dict(dtype=torch.int32, device=candidates.device)
    return torch.tensor(predicts, **as_int), torch.tensor(accept_index, **as_int), torch.tensor(accept_num, **as_int)


def _check_lists(b: int, index: list[int], nxt: list[int], sib: list[int]) -> None:
    """The walk's preconditions: every index in range and in request b's own rows, and a tree (each non-root node
    listed once, the root never: a node listed twice is how a cycle shows)."""
    d = len(index)
    for j, i in enumerate(index):
        if not b * d <= i < (b + 1) * d:
            raise ValueError(f"request {b}: retrieve_index[{j}] = {i} is outside its rows [{b * d}, {b * d + d})")
    for name, lst in (("retrieve_next_token", nxt), ("retrieve_next_sibling", sib)):
        for j, v in enumerate(lst):
            if not -1 <= v < d:
                raise ValueError(f"request {b}: {name}[{j}] = {v} is outside [-1, {d}) (id out of range)")
    refs = Counter(v for v in nxt + sib if v != -1)
    twice = sorted(v for v, c in refs.items() if c > 1 or v == 0)
    if twice:
        raise ValueError(f"request {b}: node {twice[0]} is listed {refs[twice[0]]} times as a child or sibling "
                         "(a cycle, or not a tree)")


def assign_req_to_token(req_to_token, req_pool_indices, seq_lens, out_cache_loc, num_verify_tokens: int,
                        backend: str = "auto", flags: torch.Tensor | None = None):
    """req_to_token[req_pool_indices[b], seq_lens[b] + j] = out_cache_loc[b*D + j] for j < D; returns the table.
    A request whose slots fall outside the table is not written (reference: ValueError; kernel: FLAG_ID_RANGE)."""
    d, batch = num_verify_tokens, req_pool_indices.shape[0]
    if out_cache_loc.numel() != batch * d or req_to_token.dim() != 2 or not req_to_token.is_contiguous():
        raise ValueError(f"need out_cache_loc of {batch * d} entries and a contiguous 2-D req_to_token")
    if _resolve(backend, req_to_token) == "kernel":
        return _tt.assign_req_to_token(req_to_token, req_pool_indices.contiguous(), seq_lens.contiguous(),
                                       out_cache_loc.contiguous().view(-1), d, flags)
    rows, max_len = req_to_token.shape
    pools, seq = req_pool_indices.tolist(), seq_lens.tolist()
    for b in range(batch):
        if not (0 <= pools[b] < rows and 0 <= seq[b] and seq[b] + d <= max_len):
            raise ValueError(f"request {b}: slots [{seq[b]}, {seq[b] + d}) of row {pools[b]} are outside the "
                             f"[{rows}, {max_len}] table (id out of range)")
    slots = out_cache_loc.view(batch, d).to(req_to_token.dtype)
    for b in range(batch):
        req_to_token[pools[b], seq[b]:seq[b] + d] = slots[b]
    return req_to_token


def argmax(logits: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Index of each row's largest logit (first one on ties) over the full vocabulary -> [rows] int64.
    The kernel ignores NaN (torch.argmax returns a NaN's index)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    if _resolve(backend, logits) == "kernel":
        return _tt.argmax(logits.contiguous())
    return torch.argmax(logits, dim=-1)
