# Over 400 lines: one kernel family's public API with every argument check before a launch.
"""EAGLE draft-tree construction and greedy verification (SGLang's semantics): organize the draft,
build the tree (mask, positions, child/sibling lists), verify greedily, write the KV slots, full-vocabulary argmax.

Each step has backend="reference" (plain torch, any device; an invalid tree raises ValueError naming the request)
and backend="kernel" (Triton, kernels.py: one launch per call; an invalid request is flagged).
Kernel flags: pass `flags`, an int32 [B] tensor (zeros), and the kernel ORs the FLAG_* bits of each bad request into
it; in-band, a flagged build_tree request has positions -1 and no children, a flagged verify request
accept_token_num -1 and predicts / accept_index -1.
Both backends first check what the host knows without reading a tensor (dtypes, shapes, devices, int arguments and
their ranges) and raise ValueError naming the argument. The kernel path reads a tensor on the host (a device sync)
in three places only, and never while a CUDA graph is being captured: organize_draft_results without `flags` (to
raise on NaN scores), build_tree without `flags` (to raise for a flagged request) and build_tree's seq_lens_sum (to
size the full mask, and to check a given one).

Tree masks (row = query node, column = key; a node sees the root, itself and its ancestors): "full", per request a
D x (seq_lens[b] + D) bool block with the prefix columns all True, the blocks concatenated flat; "qlen_only", D x D
per request, flat; "qlen_only_bitpacking", one little-endian word per row (bit c = column c) in the narrowest
integer type that holds D bits.
"""
from __future__ import annotations

import os
from collections import Counter

import torch

from verifybench.kernels.common import interpret
from verifybench.kernels.tree import kernels as _tt
from verifybench.kernels.tree.kernels import (FLAG_CYCLE, FLAG_DUPLICATE_INDEX,  # noqa: F401 (re-exported)
                                             FLAG_ID_RANGE, FLAG_MISSING_PARENT, FLAG_NAN_SCORE, FLAG_UNSORTED,
                                             MASK_MODES)
from verifybench.kernels.common.devices import total_memory_bytes
from verifybench.kernels.common.validators import check_int

BACKENDS = ("reference", "kernel")
FLAG_NAMES = {"missing parent": FLAG_MISSING_PARENT, "cycle": FLAG_CYCLE, "id out of range": FLAG_ID_RANGE,
              "NaN score": FLAG_NAN_SCORE, "duplicate or unsorted top_scores_index": FLAG_UNSORTED,
              "duplicate retrieve_index": FLAG_DUPLICATE_INDEX}
INT32 = torch.iinfo(torch.int32)
KERNEL_SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the kernel ranks scores as fp32 keys


def _resolve(backend: str, like: torch.Tensor) -> str:
    if backend == "auto":
        return "kernel" if like.is_cuda else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    if backend == "kernel" and not like.is_cuda and not interpret.active():
        raise ValueError("backend 'kernel' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    return backend


def _tensor(name: str, t, kind: str = "index", shape: tuple | None = None) -> torch.Tensor:
    """A tensor of the expected kind ("index": int32 or int64; "float": floating point) and, if given, shape."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not (t.dtype in (torch.int32, torch.int64) if kind == "index" else t.is_floating_point()):
        want = "an int32 or int64" if kind == "index" else "a floating-point"
        raise ValueError(f"{name} must be {want} tensor, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.is_meta:  # no values to read: every entry point reads some (a check, the reference, the flags)
        raise ValueError(f"{name} is on the meta device (shapes only, no data); give cpu or cuda tensors")
    return t


def _same_device(flags, batch: int, **named) -> None:
    """All tensors on one device; flags (if given) an int32 [batch] contiguous tensor there (the kernel writes it)."""
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {({n: str(t.device) for n, t in named.items()})}")
    dev = devices.pop()
    if flags is not None and not (isinstance(flags, torch.Tensor) and flags.dtype == torch.int32
                                  and tuple(flags.shape) == (batch,) and flags.is_contiguous() and flags.device == dev):
        got = (f"{flags.dtype} {tuple(flags.shape)} on {flags.device}" if isinstance(flags, torch.Tensor)
               else type(flags).__name__)
        raise ValueError(f"flags must be a contiguous int32 tensor of shape ({batch},) on {dev}, got {got}")


def _capturing(like: torch.Tensor) -> bool:
    return like.is_cuda and torch.cuda.is_current_stream_capturing()


def _own_flags(flags, like: torch.Tensor, batch: int) -> tuple[torch.Tensor | None, bool]:
    """The flags to launch with: the caller's, else (outside capture) our own, read back after the launch (a sync)."""
    own = flags is None and not _capturing(like)
    return (torch.zeros(batch, dtype=torch.int32, device=like.device) if own else flags), own


def _raise_flagged(out_flags: torch.Tensor, what: str, tail: str = "") -> None:
    bad = out_flags.nonzero().flatten().tolist()
    if bad:
        names = [n for n, f in FLAG_NAMES.items() if int(out_flags[bad[0]]) & f]
        raise ValueError(f"request {bad[0]}: {what} ({', '.join(names)}){tail}")


def num_candidates(topk: int, spec_steps: int) -> int:
    """Length of the flattened score list: topk from the first step, topk^2 from each later one."""
    topk, spec_steps = check_int("topk", topk, 1), check_int("spec_steps", spec_steps, 1)
    return topk + (spec_steps - 1) * topk * topk


def bitpack_dtype(num_verify_tokens: int) -> torch.dtype:
    """Narrowest integer type holding one bit per tree node (signed for 16/32 bits: torch's uint16/uint32 lack
    most ops; the bit pattern is what counts)."""
    num_verify_tokens = check_int("num_verify_tokens", num_verify_tokens, 1)
    for bits, dtype in ((8, torch.uint8), (16, torch.int16), (32, torch.int32)):
        if num_verify_tokens <= bits:
            return dtype
    raise ValueError(f"qlen_only_bitpacking holds at most 32 tree nodes per row, got num_verify_tokens="
                     f"{num_verify_tokens}")


def tree_mask_numel(mask_mode: str, batch: int, num_verify_tokens: int, seq_lens_sum: int) -> int:
    if mask_mode not in MASK_MODES:
        raise ValueError(f"unknown mask_mode {mask_mode!r}; choose one of {', '.join(MASK_MODES)}")
    batch, seq_lens_sum = check_int("batch", batch, 0), check_int("seq_lens_sum", seq_lens_sum, 0)
    d = check_int("num_verify_tokens", num_verify_tokens, 1)
    if mask_mode == "full":
        return d * seq_lens_sum + batch * d * d
    return batch * d * d if mask_mode == "qlen_only" else batch * d


def _check_mask_bytes(mask_mode: str, batch: int, d: int, seq_lens_sum: int, dtype, device) -> None:
    """Refuses, before allocating, a tree mask larger than the device's whole memory (a huge seq_lens)."""
    need = tree_mask_numel(mask_mode, batch, d, seq_lens_sum) * torch.empty(0, dtype=dtype).element_size()
    have = total_memory_bytes(device) or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ValueError(f"seq_lens: the {mask_mode} tree mask needs {need:,} bytes (num_verify_tokens={d} x "
                         f"(seq_lens sum {seq_lens_sum:,} + B*D)); {device} has {have:,} bytes in all")


def _check_draft(score_list, token_list, parents_list) -> tuple[int, int]:
    """organize_draft_results' lists: one tensor per draft step each, batch-first, with the entries per row that
    topk (score_list[0]'s width) implies. Returns (batch, topk)."""
    lists = {"score_list": score_list, "token_list": token_list, "parents_list": parents_list}
    lengths = {n: len(v) if isinstance(v, (list, tuple)) else None for n, v in lists.items()}
    steps = lengths["score_list"]
    if not steps or len(set(lengths.values())) != 1:
        raise ValueError(f"score_list, token_list and parents_list must be non-empty lists of one tensor per draft "
                         f"step each, got lengths {lengths}")
    first = _tensor("score_list[0]", score_list[0], "float")
    if first.dim() < 2 or first.flatten(1).shape[1] < 1:
        raise ValueError(f"score_list[0] must be [B, 1, topk] with topk >= 1, got shape {tuple(first.shape)}")
    batch, topk = first.shape[0], first.flatten(1).shape[1]
    for i in range(steps):
        widths = (topk, topk, topk + 1) if i == 0 else (topk * topk, topk * topk, topk)
        for (name, items), width in zip(lists.items(), widths):
            t = _tensor(f"{name}[{i}]", items[i], "float" if name == "score_list" else "index")
            if t.dim() < 2 or t.shape[0] != batch or t.flatten(1).shape[1] != width:
                raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, expected {batch} rows of {width} entries "
                                 f"(topk={topk} from score_list[0])")
    return batch, topk


def organize_draft_results(score_list, token_list, parents_list, num_verify_tokens: int, backend: str = "auto",
                           flags: torch.Tensor | None = None):
    """-> (parent_list [B, topk*(steps-1)+1], top_scores_index [B, D-1] ascending, draft_tokens [B, D-1]).

    top_scores_index holds the D-1 largest scores' indices; ties go to the lower index (torch.topk leaves them
    unspecified). NaN scores: the reference raises. The kernel ranks NaN as -inf and flags FLAG_NAN_SCORE in
    `flags`; without `flags` it checks its own flags after the launch and raises (a device sync), except while a
    CUDA graph is being captured, where NaN scores then pass unreported: pass `flags` to see them there."""
    batch, _ = _check_draft(score_list, token_list, parents_list)
    scores = torch.cat([s.flatten(1) for s in score_list], dim=1)
    tokens = torch.cat([t.flatten(1) for t in token_list], dim=1)
    parent_list = (torch.cat(list(parents_list[:-1]), dim=1) if len(parents_list) > 1
                   else torch.empty(batch, 0, dtype=torch.int64, device=scores.device))
    keep = check_int("num_verify_tokens", num_verify_tokens, 2) - 1
    if keep > scores.shape[1]:
        raise ValueError(f"num_verify_tokens={keep + 1} needs {keep} drafted nodes, but the draft has only "
                         f"{scores.shape[1]} candidates")
    _same_device(flags, batch, scores=scores, tokens=tokens, parent_list=parent_list)
    if _resolve(backend, scores) == "kernel":
        if scores.dtype not in KERNEL_SCORE_DTYPES:
            raise ValueError(f"the kernel ranks fp16, bf16 or fp32 scores, got {scores.dtype}; use the reference")
        own = flags is None and not _capturing(scores)
        out_flags = torch.zeros(batch, dtype=torch.int32, device=scores.device) if own else flags
        top, draft = _tt.organize(scores.contiguous(), tokens.contiguous(), keep, out_flags)
        if own:
            bad = out_flags.nonzero().flatten().tolist()  # a device sync, outside capture only
            if bad:
                raise ValueError(f"request {bad[0]}: NaN among the draft scores")
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
    retrieve_next_sibling [B, D], draft_tokens [B*D]); int64 indices, the mask as the module docstring lays it out.

    top_scores_index rows must be strictly ascending (no duplicate, no unsorted candidate): the reference raises,
    the kernel flags FLAG_UNSORTED in-kernel (no sync) into `flags`; without `flags`, outside graph capture, the
    kernel path reads its own flags after the launch (a sync) and raises for a flagged request. `seq_lens_sum` (the host's sum of seq_lens) sizes the full
    mask. Outside CUDA-graph capture the kernel path reads seq_lens.sum() (a device sync) when the mask is full or
    seq_lens_sum is given, and raises if a given one differs; inside capture it trusts seq_lens_sum, which the full
    mask then requires (a wrong one gives a wrong mask, never a store outside it)."""
    d = check_int("num_verify_tokens", num_verify_tokens, 2)
    topk, spec_steps = check_int("topk", topk, 1), check_int("spec_steps", spec_steps, 1)
    if mask_mode not in MASK_MODES:
        raise ValueError(f"unknown mask_mode {mask_mode!r}; choose one of {', '.join(MASK_MODES)}")
    n_cand = num_candidates(topk, spec_steps)
    if d - 1 > n_cand:
        raise ValueError(f"num_verify_tokens={d} needs {d - 1} drafted nodes, but topk={topk}, spec_steps="
                         f"{spec_steps} draft only {n_cand} candidates")
    if _tensor("verified_id", verified_id).dim() != 1:
        raise ValueError(f"verified_id must be [B], got shape {tuple(verified_id.shape)}")
    batch = verified_id.shape[0]
    for name, t, shape in (("top_scores_index", top_scores_index, (batch, d - 1)),
                           ("draft_tokens", draft_tokens, (batch, d - 1)), ("seq_lens", seq_lens, (batch,))):
        _tensor(name, t, shape=shape)
    width = topk * (spec_steps - 1) + 1  # spec_steps 1 never reads it: organize's empty [B, 0] is fine too
    if _tensor("parent_list", parent_list).dim() != 2 or parent_list.shape[0] != batch \
            or parent_list.shape[1] not in ((0, 1) if spec_steps == 1 else (width,)):
        raise ValueError(f"parent_list has shape {tuple(parent_list.shape)}, expected ({batch}, {width}) = "
                         "[B, topk*(spec_steps-1)+1]")
    seq_lens_sum = None if seq_lens_sum is None else check_int("seq_lens_sum", seq_lens_sum, 0)
    _same_device(flags, batch, verified_id=verified_id, parent_list=parent_list, top_scores_index=top_scores_index,
                 draft_tokens=draft_tokens, seq_lens=seq_lens)
    mask_dtype = bitpack_dtype(d) if mask_mode == "qlen_only_bitpacking" else torch.bool
    if _resolve(backend, verified_id) == "reference":
        return _build_tree_reference(verified_id, parent_list, top_scores_index, draft_tokens, seq_lens, topk,
                                     spec_steps, d, mask_mode, mask_dtype, seq_lens_sum)
    if d > 64:
        raise ValueError(f"the build_tree kernel handles num_verify_tokens <= 64, got {d}; use the reference")
    if not _capturing(seq_lens) and (mask_mode == "full" or seq_lens_sum is not None):
        total, laid_out = torch.stack([seq_lens.sum(), seq_lens.clamp(min=0).sum()]).tolist()  # one device sync
        if seq_lens_sum is not None and seq_lens_sum != total:
            raise ValueError(f"seq_lens_sum={seq_lens_sum} but seq_lens sums to {total}")
        seq_lens_sum = laid_out  # a (flagged) negative seq_len takes no prefix columns in the kernel's layout
    elif seq_lens_sum is None:
        if mask_mode == "full":
            raise ValueError("mask_mode 'full' inside CUDA graph capture needs seq_lens_sum (it sizes the mask)")
        seq_lens_sum = 0  # the qlen masks do not depend on it
    _check_mask_bytes(mask_mode, batch, d, seq_lens_sum, mask_dtype, verified_id.device)
    out_flags, own = _own_flags(flags, verified_id, batch)
    out = _tt.build_tree(verified_id.contiguous(), parent_list.contiguous(), top_scores_index.contiguous(),
                         draft_tokens.contiguous(), seq_lens.contiguous(), topk, spec_steps, d, mask_mode,
                         tree_mask_numel(mask_mode, batch, d, seq_lens_sum), mask_dtype, seq_lens_sum, out_flags)
    if own:
        _raise_flagged(out_flags, "invalid tree input", ": check top_scores_index (strictly ascending, in range), "
                       "parent_list and seq_lens")
    return out


def _tree_parents(b: int, top: list[int], parent_list: list[int], topk: int, spec_steps: int) -> list[int]:
    """Parent node of every node of request b (root: -1), read literally off the semantics above."""
    n_cand = num_candidates(topk, spec_steps)
    for j in range(1, len(top)):
        if top[j] <= top[j - 1]:
            raise ValueError(f"request {b}: top_scores_index[{j}] = {top[j]} follows {top[j - 1]}: the row must be "
                             "strictly ascending (a duplicate or unsorted candidate)")
    parents = [-1]
    for j, s in enumerate(top, start=1):
        if not 0 <= s < n_cand:
            raise ValueError(f"request {b}: top_scores_index[{b}, {j - 1}] = {s} (node {j}) is outside [0, {n_cand}) "
                             "(id out of range)")
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
    _check_mask_bytes(mask_mode, batch, d, sum(max(x, 0) for x in seq), mask_dtype, dev)
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
        tree_mask = torch.cat(blocks) if blocks else torch.empty(0, dtype=torch.bool, device=dev)
    tokens = torch.cat([verified_id.view(batch, 1).to(draft_tokens.dtype), draft_tokens], dim=1).flatten()
    index = torch.arange(batch * d, device=dev).view(batch, d)
    as_long = dict(dtype=torch.int64, device=dev)
    return (tree_mask, torch.tensor(positions, **as_long), index, torch.tensor(next_token, **as_long).view(batch, d),
            torch.tensor(next_sibling, **as_long).view(batch, d), tokens)


def verify_tree_greedy(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict,
                       num_spec_steps: int, backend: str = "auto", flags: torch.Tensor | None = None):
    """-> (predicts [B*D] int32, accept_index [B, num_spec_steps] int32, accept_token_num [B] int32).

    Up to num_spec_steps - 1 draft tokens are accepted per request (pass spec_steps + 1 for a whole path). Each
    node's retrieve_index must be in its request's rows and distinct (reference: ValueError; kernel: flagged)."""
    if _tensor("candidates", candidates).dim() != 2 or candidates.shape[1] < 1:
        raise ValueError(f"candidates must be [B, D] with D >= 1, got shape {tuple(candidates.shape)}")
    batch, d = candidates.shape
    named = {"candidates": candidates, "retrieve_index": retrieve_index, "retrieve_next_token": retrieve_next_token,
             "retrieve_next_sibling": retrieve_next_sibling}
    for name, t in list(named.items())[1:]:
        _tensor(name, t, shape=(batch, d))
    if _tensor("target_predict", target_predict).numel() != batch * d:
        raise ValueError(f"target_predict has {target_predict.numel()} entries, expected B*D = {batch * d}")
    num_spec_steps = check_int("num_spec_steps", num_spec_steps, 1)
    _same_device(flags, batch, target_predict=target_predict, **named)
    if _resolve(backend, candidates) == "kernel":
        if d > 1024:
            raise ValueError(f"the verify kernel handles D <= 1024 (a [D, D] tile), got {d}; use the reference")
        return _tt.verify_tree_greedy(candidates.contiguous(), retrieve_index.contiguous(),
                                      retrieve_next_token.contiguous(), retrieve_next_sibling.contiguous(),
                                      target_predict.contiguous().view(-1), num_spec_steps, flags)
    cand, index = candidates.tolist(), retrieve_index.tolist()
    nxt, sib, target = retrieve_next_token.tolist(), retrieve_next_sibling.tolist(), target_predict.reshape(-1).tolist()
    for x in (x for x in target + [c for row in cand for c in row] if not INT32.min <= x <= INT32.max):  # predicts: int32
        raise ValueError(f"token id {x} is outside int32 (id out of range): predicts would hold it truncated")
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
    return (torch.tensor(predicts, **as_int), torch.tensor(accept_index, **as_int).view(batch, num_spec_steps),
            torch.tensor(accept_num, **as_int))


def _check_lists(b: int, index: list[int], nxt: list[int], sib: list[int]) -> None:
    """The walk's preconditions: every index in range and in request b's own rows, and a tree (each non-root node
    listed once, the root never: a node listed twice is how a cycle shows)."""
    d = len(index)
    for j, i in enumerate(index):
        if not b * d <= i < (b + 1) * d:
            raise ValueError(f"request {b}: retrieve_index[{j}] = {i} is outside its rows [{b * d}, {b * d + d})")
    for i in (i for i, c in Counter(index).items() if c > 1):
        raise ValueError(f"request {b}: retrieve_index holds {i} twice (duplicate retrieve_index): two nodes would "
                         "share one predicts slot")
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
    A request whose slots fall outside the table, or whose out_cache_loc the table's dtype cannot hold, is not
    written (reference: ValueError; kernel: FLAG_ID_RANGE)."""
    d = check_int("num_verify_tokens", num_verify_tokens, 1)
    if _tensor("req_to_token", req_to_token).dim() != 2 or not req_to_token.is_contiguous():
        got = f"{tuple(req_to_token.shape)}{'' if req_to_token.is_contiguous() else ' (not contiguous)'}"
        raise ValueError(f"req_to_token must be a contiguous [rows, max_len] table, got {got}")
    if _tensor("req_pool_indices", req_pool_indices).dim() != 1:
        raise ValueError(f"req_pool_indices must be [B], got shape {tuple(req_pool_indices.shape)}")
    batch = req_pool_indices.shape[0]
    _tensor("seq_lens", seq_lens, shape=(batch,))
    if _tensor("out_cache_loc", out_cache_loc).numel() != batch * d:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} entries, expected B*D = {batch * d}")
    _same_device(flags, batch, req_to_token=req_to_token, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
                 out_cache_loc=out_cache_loc)
    if _resolve(backend, req_to_token) == "kernel":
        out_flags, own = _own_flags(flags, req_to_token, batch)
        _tt.assign_req_to_token(req_to_token, req_pool_indices.contiguous(), seq_lens.contiguous(),
                                out_cache_loc.contiguous().view(-1), d, out_flags)
        if own:
            _raise_flagged(out_flags, "not written", f": slots outside the {tuple(req_to_token.shape)} table or an "
                           f"out_cache_loc {req_to_token.dtype} cannot hold")
        return req_to_token
    rows, max_len = req_to_token.shape
    pools, seq = req_pool_indices.tolist(), seq_lens.tolist()
    for b in range(batch):
        if not (0 <= pools[b] < rows and 0 <= seq[b] and seq[b] + d <= max_len):
            raise ValueError(f"request {b}: slots [{seq[b]}, {seq[b] + d}) of row {pools[b]} are outside the "
                             f"[{rows}, {max_len}] table (id out of range)")
    top = torch.iinfo(req_to_token.dtype).max
    for b, row in enumerate(out_cache_loc.reshape(batch, d).tolist()):
        for x in (x for x in row if not 0 <= x <= top):
            raise ValueError(f"request {b}: out_cache_loc slot {x} does not fit the {req_to_token.dtype} table "
                             f"[0, {top}] (id out of range): it would be stored truncated")
    slots = out_cache_loc.reshape(batch, d).to(req_to_token.dtype)
    for b in range(batch):
        req_to_token[pools[b], seq[b]:seq[b] + d] = slots[b]
    return req_to_token


def argmax(logits: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Index of each row's largest logit (first one on ties) over the full vocabulary -> [rows] int64.
    The kernel ignores NaN (torch.argmax returns a NaN's index)."""
    if _tensor("logits", logits, "float").dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be [rows, vocab] with vocab >= 1, got shape {tuple(logits.shape)}")
    if _resolve(backend, logits) == "kernel":
        return _tt.argmax(logits.contiguous())
    return torch.argmax(logits, dim=-1)
