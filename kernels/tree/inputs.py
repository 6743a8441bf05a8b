"""Random valid EAGLE drafts and target predictions, for the tree component's checks, tests and benchmarks.

The draft is simulated the way EAGLE grows it: topk beams, each expanded into topk children whose path score is
the beam's score times a probability < 1, so a drafted node's parent always outranks it.
"""
from __future__ import annotations

import torch

from verifybench.kernels.tree.api import organize_draft_results
from verifybench.kernels.common.validators import check_int


def random_draft(batch: int, topk: int, spec_steps: int, vocab: int, *, seed: int = 0, device="cpu"):
    """-> (score_list, token_list, parents_list) as organize_draft_results takes them."""
    batch, topk, vocab = check_int("batch", batch, 0), check_int("topk", topk, 1), check_int("vocab", vocab, 1)
    spec_steps = check_int("spec_steps", spec_steps, 1)
    g = torch.Generator().manual_seed(seed)

    def prob(*shape):
        return torch.rand(*shape, generator=g) * 0.9 + 0.05

    beam = prob(batch, topk)
    scores, tokens = [beam.view(batch, 1, topk)], [torch.randint(vocab, (batch, topk), generator=g)]
    parents = [torch.arange(-1, topk).expand(batch, topk + 1)]
    for step in range(1, spec_steps):
        path = beam[:, :, None] * prob(batch, topk, topk)
        scores.append(path)
        tokens.append(torch.randint(vocab, (batch, topk * topk), generator=g))
        best = path.flatten(1).topk(topk, dim=1)
        beam = best.values
        parents.append(topk + (step - 1) * topk * topk + best.indices)  # the beams' indices in the score list
    return ([s.to(device) for s in scores], [t.to(device) for t in tokens],
            [p.contiguous().to(device) for p in parents])


def children(next_token: list[int], next_sibling: list[int], node: int) -> list[int]:
    """The children of `node` in list order (bounded by the row length, so a bad list cannot loop)."""
    out, cur = [], next_token[node]
    while cur != -1 and len(out) < len(next_token):
        out.append(cur)
        cur = next_sibling[cur]
    return out


def random_target_predict(candidates, next_token, next_sibling, vocab: int, *, accept_prob: float = 0.7,
                          last_child: bool = False, seed: int = 0) -> torch.Tensor:
    """Target predictions [B*D] (int64) for a built tree: at each node, with probability `accept_prob` the token of
    one of its children (a random one; the last one in list order with `last_child`, which makes verification scan
    every sibling), else a random token. last_child with accept_prob=1 is the longest verification walk."""
    if not 0.0 <= accept_prob <= 1.0:
        raise ValueError(f"accept_prob must be in [0, 1], got {accept_prob!r}")
    vocab = check_int("vocab", vocab, 1)
    g = torch.Generator().manual_seed(seed)
    batch, d = candidates.shape
    cand, nxt, sib = candidates.tolist(), next_token.tolist(), next_sibling.tolist()
    target = torch.randint(vocab, (batch * d,), generator=g).tolist()
    draws = torch.rand(batch * d, generator=g).tolist()
    for b in range(batch):
        for j in range(d):
            kids = children(nxt[b], sib[b], j)
            if kids and draws[b * d + j] < accept_prob:
                pick = kids[-1] if last_child else kids[int(draws[b * d + j] / accept_prob * len(kids))]
                target[b * d + j] = cand[b][pick]
    return torch.tensor(target, dtype=torch.int64, device=candidates.device)


def random_tree(batch: int, topk: int, spec_steps: int, num_verify_tokens: int, vocab: int, *, seed: int = 0,
                context: int = 1024, spread: int | None = None, device="cpu") -> dict:
    """build_tree's inputs for a random valid draft, organized by the reference; seq_lens are drawn from
    [context - spread, context] (spread defaults to context // 8)."""
    draft = random_draft(batch, topk, spec_steps, vocab, seed=seed, device=device)
    parent_list, top, draft_tokens = organize_draft_results(*draft, num_verify_tokens, backend="reference")
    g = torch.Generator().manual_seed(seed + 1)
    context = check_int("context", context, 0)
    spread = check_int("spread", context // 8 if spread is None else spread, 0, context)  # seq_lens stay >= 0
    seq_lens = context - torch.randint(0, spread + 1, (batch,), generator=g)
    return {"verified_id": torch.randint(vocab, (batch,), generator=g).to(device), "parent_list": parent_list,
            "top_scores_index": top, "draft_tokens": draft_tokens, "seq_lens": seq_lens.to(device),
            "topk": topk, "spec_steps": spec_steps, "num_verify_tokens": num_verify_tokens}
