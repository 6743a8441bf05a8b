"""EAGLE-3 draft model of one tensor-parallel rank: one Llama-style decoder layer at the target's hidden size, its own
lm_head over a draft vocabulary, random weights; the target's three captured hidden states are fused on entry.

Per rank (TP t): attention of heads/t query heads and max(1, heads/8/t) KV heads of 128 (GQA) over the draft's own KV
cache, a dense MLP of the target's dense intermediate / t, a vocab-parallel lm_head over DRAFT_VOCAB / t rows whose
logits are gathered across ranks (a device wait of the allreduce stand-in's latency on one GPU), softmax and top-k.
The attention lets every query see the prefix and every row written this forward (no tree mask): the same bytes and
FLOPs as the engine's masked draft attention at these sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from verifybench.harness.model.presets import Preset

DRAFT_VOCAB = {"tiny": 512}  # draft vocabulary of the whole model; every other preset: EAGLE-3's 32,000
DEFAULT_DRAFT_VOCAB = 32000
HEAD_DIM = {"tiny": 16}  # per attention head; every other preset: 128


@dataclass(frozen=True)
class DraftShape:
    hidden: int
    heads: int  # query heads on this rank
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP, this rank's share
    vocab: int  # draft vocabulary rows on this rank
    vocab_full: int
    target_vocab: int  # the target's vocabulary rows on this rank (its embedding)


def draft_shape(s: Preset) -> DraftShape:
    """The draft of the per-rank preset `s` (heads, intermediates and vocab already divided by its TP degree)."""
    full = DRAFT_VOCAB.get(s.name, DEFAULT_DRAFT_VOCAB)
    heads_full = s.heads * s.tp
    return DraftShape(hidden=s.hidden, heads=s.heads, kv_heads=max(1, heads_full // 8 // s.tp),
                      head_dim=HEAD_DIM.get(s.name, 128), intermediate=s.dense_intermediate,
                      vocab=math.ceil(full / s.tp), vocab_full=math.ceil(full / s.tp) * s.tp, target_vocab=s.vocab)


def weight_bytes(d: DraftShape, context: int, max_rows: int, itemsize: int = 2, batch: int = 1) -> int:
    """What DraftModel allocates: weights, the target embedding slice it reads ids from, its KV cache (one per
    request)."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    weights = (3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * d.intermediate * h + d.vocab * h
               + d.target_vocab * h + 5 * h)
    return itemsize * (weights + 2 * batch * (context + max_rows) * kv)


def _rand(*shape, device, dtype):
    return torch.randn(*shape, device=device, dtype=dtype) / shape[-1] ** 0.5


class DraftModel:
    """forward(ids, hidden, fuse) -> (probs [rows, vocab_full] fp32, hidden_out [rows, H]) for up to `max_rows`
    rows of each of `batch` requests (request-major, each over its own KV cache), graph-capturable. fuse: `hidden` holds the target's three captured states [rows, 3H] (fused by fc);
    otherwise the draft's own last hidden state [rows, H]. rmsnorm / add_rmsnorm are the target's small ops;
    gather(t) stands for the logits all-gather (in place into the full-vocabulary buffer) and allreduce(t) for the
    layer's two allreduces."""

    def __init__(self, s: Preset, context: int, device: str, rmsnorm: Callable, add_rmsnorm: Callable,
                 allreduce: Callable, gather: Callable, max_rows: int = 16, seed: int = 1,
                 dtype: torch.dtype = torch.bfloat16, batch: int = 1):
        torch.manual_seed(seed)
        self.d = d = draft_shape(s)
        self.context, self.max_rows, self.device, self.batch = context, max_rows, device, batch
        self.rmsnorm, self.add_rmsnorm, self.allreduce, self.gather = rmsnorm, add_rmsnorm, allreduce, gather
        h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
        w = dict(device=device, dtype=dtype)
        self.embed = _rand(d.target_vocab, h, **w)
        self.fc = _rand(h, 3 * h, **w)
        self.qkv = _rand(q + 2 * kv, 2 * h, **w)
        self.o = _rand(h, q, **w)
        self.gate_up = _rand(2 * d.intermediate, h, **w)
        self.down = _rand(h, d.intermediate, **w)
        self.lm_head = _rand(d.vocab, h, **w)
        self.norms = {k: torch.ones(h, **w) for k in ("embed", "hidden", "post", "final")}
        self.k_cache = torch.randn(batch, context + max_rows, d.kv_heads, d.head_dim, **w)
        self.v_cache = torch.randn(batch, context + max_rows, d.kv_heads, d.head_dim, **w)
        self.logits = torch.zeros(batch * max_rows, d.vocab_full, device=device, dtype=torch.float32)
        # the draft steps' attention as a deployment runs it (model/deployed.py): attention(q [rows, heads, hd], k, v
        # caches, end, rows per request) -> [rows, heads, hd]; None: SDPA. The re-extend keeps SDPA (the engine runs
        # its extend kernel there, not its decode)
        self.attention: Callable | None = None

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, fuse: bool):
        d, rows, b = self.d, ids.shape[0], self.batch
        per = rows // b
        if per > self.max_rows or per * b != rows:
            raise ValueError(f"the draft holds {self.max_rows} rows of each of {b} requests per forward, got {rows}")
        # the vocab-parallel embedding: this rank's rows (ids folded onto them), summed across ranks
        emb = self.embed[ids.remainder(d.target_vocab)]
        self.allreduce(emb)
        if fuse:
            hidden = F.linear(hidden, self.fc)
        x = torch.cat([self.rmsnorm(emb, self.norms["embed"]), self.rmsnorm(hidden, self.norms["hidden"])], dim=-1)
        q, k, v = F.linear(x, self.qkv).split([d.heads * d.head_dim, d.kv_heads * d.head_dim,
                                               d.kv_heads * d.head_dim], dim=-1)
        end = self.context + per
        self.k_cache[:, self.context:end].copy_(k.view(b, per, d.kv_heads, d.head_dim))
        self.v_cache[:, self.context:end].copy_(v.view(b, per, d.kv_heads, d.head_dim))
        if self.attention is not None and not fuse:
            attn = self.attention(q.view(rows, d.heads, d.head_dim), self.k_cache, self.v_cache, end, per)
        else:
            attn = F.scaled_dot_product_attention(q.view(b, per, d.heads, d.head_dim).transpose(1, 2),
                                                  self.k_cache[:, :end].transpose(1, 2),
                                                  self.v_cache[:, :end].transpose(1, 2),
                                                  enable_gqa=d.kv_heads != d.heads).transpose(1, 2)
        out = F.linear(attn.reshape(rows, d.heads * d.head_dim), self.o)
        self.allreduce(out)
        h = hidden.clone()
        y = self.add_rmsnorm(h, out, self.norms["post"])
        gate, up = F.linear(y, self.gate_up).chunk(2, dim=-1)
        mlp = F.linear(F.silu(gate) * up, self.down)
        self.allreduce(mlp)
        y = self.add_rmsnorm(h, mlp, self.norms["final"])
        logits = self.logits[:rows]
        logits[:, :d.vocab].copy_(F.linear(y, self.lm_head))
        self.gather(logits)
        return torch.softmax(logits, dim=-1), h
