"""One EAGLE-3 speculative cycle of one tensor-parallel rank, phase by phase as SGLang's EAGLE worker runs it (B
requests, each over its own context, page size 1): draft, tree, verify, sync, bookkeeping, re-extend; graph-captured
where the engine captures. B is the target forward's batch (VerifyForward.at_batch): the draft runs B * topk rows,
the verify B * D, the re-extend B * (steps + 1); accept lengths and slots are kept per request.

- draft: steps - 1 draft forwards on topk rows each, top-k expansion per step (the first step's top-k comes from the
  previous cycle's re-extend), then organize_draft_results; one graph.
- tree: build_tree (full mask, as the engine's Triton backend takes it: a seq_lens sum read on the host first) and the
  verify tokens' slots written into the request-to-token table (prepare_for_verify); eager.
- verify: one graph: the target's vocab-parallel embedding of the D tree tokens, the forward with tree-masked MLA
  attention (variant "extend", the engine's serial prefill kernel, or "split_kv", ours), the LM head over all D
  rows and the logits all-gather; then eager: full-vocabulary argmax and the greedy tree verify.
- sync: accept lengths, accepted indices and predictions to the host (the engine's three .tolist()).
- bookkeeping: eager: the rejected slots freed and the accepted ones kept (two boolean-mask indexings, each a device
  sync), their slots remapped, seq_lens advanced, the accepted rows' tokens and captured hidden states gathered.
- reextend: one graph: the draft over steps + 1 rows (the accepted path, padded) with the target's hidden states
  fused, and the next cycle's first top-k.
The benchmark keeps its context fixed: every cycle writes the same D cache rows. The draft's weights are random, so
it proposes tokens the target rejects; `draft_override` replaces its tokens (the correctness checks use the
target's own greedy continuation and a wrong one).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from verifybench.harness.model.draft import DraftModel
from verifybench.harness.model.forward import COMPONENTS, VerifyForward
from verifybench.kernels.tree import api as tree
from verifybench.kernels.mla_verify.api import VARIANTS, mla_verify, mla_verify_reference
from verifybench.harness.measure.timing.capture import graph_capture

PHASES = ("draft", "tree", "verify", "sync", "bookkeeping", "reextend")
# the deployment's per-phase table, with SGLang's placement: build_tree ends draft(); verify() prepares the slots,
# runs the target, verifies, syncs and does the bookkeeping
ENGINE_PHASES = {"draft": ("draft", "tree"), "target verify": ("verify", "sync", "bookkeeping"),
                 "draft re-extend": ("reextend",)}
ATTENTION = VARIANTS  # "split_kv" (ours), "extend" (the engine's)


@dataclass(frozen=True)
class SpecConfig:
    steps: int
    topk: int
    draft_tokens: int  # D, the root included

    def __post_init__(self):
        for name in ("steps", "topk", "draft_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.draft_tokens < 2:
            raise ValueError(f"draft_tokens must be >= 2 (the root and at least one drafted token), got "
                             f"{self.draft_tokens}")
        most = tree.num_candidates(self.topk, self.steps) + 1
        if self.draft_tokens > most:
            raise ValueError(f"draft_tokens={self.draft_tokens}: steps={self.steps}, topk={self.topk} draft at most "
                             f"{most - 1} tokens (+ the root)")

    @property
    def label(self) -> str:
        return f"s{self.steps}k{self.topk}d{self.draft_tokens}"


def aux_layers(layers: int) -> tuple[int, ...]:
    """The layers whose input hidden states EAGLE-3 captures: 2, L // 2 and L - 3 (distinct, within the layers)."""
    return tuple(sorted({min(max(i, 0), layers - 1) for i in (2, layers // 2, layers - 3)}))


# How far a row of verify logits may move between two runs of the forward and still count as the same row when its
# top token flips: the run-to-run numerics of 61 random layers (the engine's Marlin MoE adds split-K partial sums
# with atomics, and its split depends on the other rows' routing) move a row by a few percent (verify.py: ~5e-2 over
# 61 layers, an expert flipped at a near-tie in top-k); a row of another forward (a wrong mask, position or cache row)
# is an unrelated random vector, ~1.4 away.
DRIFT_LIMIT = 0.2


def judge_draft(greedy: list, draft: list, accepted: int, emitted: list, then: torch.Tensor,
                now: torch.Tensor) -> tuple[bool, str]:
    """One request's chain cycle with `draft` in place of the draft's tokens (accepted, emitted), against `now` [D, V],
    its verify logits, and `then` [D, V], the logits the target's greedy tokens `greedy` were read from: (ok, note).
    ok: the acceptance is the greedy one of its own logits (the drafted tokens up to the first that is not their
    row's argmax, then that row's argmax), and those argmaxes are the target's greedy tokens up to where it stopped,
    except at the row where it stopped when two runs of the forward flipped a near-tie there: the row moved less than
    DRIFT_LIMIT (the same row) and the two tokens' logits changed no more than twice the largest change of the row's
    other logits (the flip is the row's run-to-run noise, not a change aimed at those tokens; the note says where).
    Anything else fails."""
    own = now.argmax(-1).tolist()
    k = next((i for i, t in enumerate(draft) if t != own[i]), len(draft))
    if (accepted, list(emitted)) != (k, list(draft[:k]) + [own[k]]):
        return False, f"accepted {accepted}, emitted {emitted}: not the greedy acceptance of its own logits"
    j = next((i for i in range(k + 1) if own[i] != greedy[i]), None)
    if j is None:
        return True, ""
    computed = then[j] > -1e29  # this rank's vocabulary slice (the rest stands for the other ranks' and never moves)
    change = (now[j] - then[j]).double().where(computed, 0.0)
    moved = float(change.norm() / then[j][computed].double().norm())
    # own[j] tops `now`, greedy[j] tops `then`: the flip is exactly the difference of their changes
    flip = float(change[own[j]] - change[greedy[j]])
    others = change.clone()
    others[[own[j], greedy[j]]] = 0.0
    spread = 2 * float(others.abs().max())
    said = f"their logits changed {flip:.1e} against the row's spread {spread:.1e}; the row moved {moved:.1e}"
    if j == k and moved <= DRIFT_LIMIT and flip <= spread:
        return True, f"token {j} a near-tie two runs of the forward flipped: {said}"
    return False, f"token {j} is {own[j]} where the target's greedy token is {greedy[j]} ({said}): not a near-tie"


class Cycle:
    """The cycle over a built target forward `fwd` (shared, not modified: a shallow copy gets the tree attention and
    the cycle's head; its batch is the cycle's). gather(t) stands for an all-gather of logits into `t` (in place);
    `graphs`: capture draft, verify and re-extend (CUDA only); attention_config / attention_pdl: the tree
    attention's tiles and programmatic dependent launch (None: its defaults); deployed: a model/deployed.py
    Composition whose verify attention (tree) and draft-step attention replace ours where it has them."""

    def __init__(self, fwd: VerifyForward, cfg: SpecConfig, attention: str, gather: Callable, graphs: bool,
                 attention_config: dict | None = None, attention_pdl: bool | None = None, deployed=None):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
        d = cfg.draft_tokens
        if d > fwd.max_tokens:
            raise ValueError(f"draft_tokens={d}: the target forward holds at most {fwd.max_tokens} tokens")
        self.fwd, self.cfg, self.attention, self.gather = fwd, cfg, attention, gather
        self.graphs = graphs and fwd.device == "cuda"
        s, dev, self.d, b = fwd.s, fwd.device, d, fwd.batch
        self.batch = b
        self.cuda = dev == "cuda"
        self.backend = "kernel" if self.cuda else "reference"
        i64 = dict(device=dev, dtype=torch.int64)
        rows = max(cfg.topk, cfg.steps + 1)
        self.draft = DraftModel(s, fwd.context, dev, fwd.ops.rmsnorm, fwd.ops.add_rmsnorm, fwd.allreduce_fn,
                                gather, max_rows=rows, dtype=fwd.dtype, batch=b)
        # the target's logits: this rank's slice computed; the other ranks' slices stand for the all-gather's data,
        # set below any logit so that the greedy tokens follow this rank's computation
        self.full_logits = torch.full((b * d, s.vocab * s.tp), -1e30, device=dev, dtype=torch.float32)
        self.cand = torch.zeros(b * d, **i64)
        # request r's prefix and tree rows: [r * region, + context) and the D after (VerifyForward's layout)
        self.starts = torch.arange(b, device=dev, dtype=torch.int32) * fwd.region
        self.prefix = torch.full((b,), fwd.context, device=dev, dtype=torch.int32)
        self.mask = torch.ones(b, d, d, device=dev, dtype=torch.bool).tril_()
        self.seq_lens = torch.full((b,), fwd.context, **i64)
        self.seq_lens_next = self.seq_lens.clone()
        self.req_to_token = torch.zeros(b, fwd.context + max(2 * d, d + cfg.steps + 1), device=dev, dtype=torch.int32)
        self.req_pool = torch.arange(b, **i64)
        self.out_cache_loc = (torch.arange(b, **i64).view(b, 1) * fwd.region
                              + torch.arange(fwd.context, fwd.context + d, **i64)).flatten()
        self.free_slots = torch.zeros(b * d, **i64)
        self.root = torch.zeros(b, **i64)
        self.parents0 = torch.arange(-1, cfg.topk, **i64).view(1, -1).repeat(b, 1)
        self.flags = torch.zeros(b, device=dev, dtype=torch.int32)
        self.aux = torch.zeros(b * d, 3 * s.hidden, device=dev, dtype=fwd.dtype)
        self.re_ids = torch.zeros(b * (cfg.steps + 1), **i64)
        self.re_aux = torch.zeros(b * (cfg.steps + 1), 3 * s.hidden, device=dev, dtype=fwd.dtype)
        self.accept_num = torch.zeros(b, device=dev, dtype=torch.int32)
        self.step0_p = torch.full((b, cfg.topk), 1.0 / cfg.topk, device=dev, dtype=torch.float32)
        self.step0_i = torch.arange(cfg.topk, **i64).view(1, -1).repeat(b, 1)
        self.step0_h = torch.zeros(b, s.hidden, device=dev, dtype=fwd.dtype)
        # each request's first row among the draft's B * topk and the re-extend's B * (steps + 1)
        self.draft_rows = torch.arange(b, **i64).view(b, 1) * cfg.topk
        self.reextend_rows = torch.arange(b, **i64) * (cfg.steps + 1)
        self.draft_override: torch.Tensor | None = None  # [B * (D - 1)] tokens put in place of the draft's
        self.attention_config, self.attention_pdl = attention_config, attention_pdl
        # the target forward as the cycle runs it: tree-masked attention, the cycle's head, captured hidden states
        self.tree = deployed.tree if deployed is not None else None  # the engine's verify attention, or None: ours
        if deployed is not None and deployed.draft is not None:
            self.draft.attention = deployed.draft
        self.target = copy.copy(fwd)
        self.target.ops = dataclasses.replace(fwd.ops, mla=self._tree_attention, mla_batch=lambda q, cache, *rest:
                                              self._tree_attention(q, cache, None, *rest[-2:]))
        self.target.head_fn = self._head
        self.target.aux = (aux_layers(len(fwd.layers)), {d: self.aux})
        self._draft_run = self._replayable(self._draft_body)
        self._verify_run = self._replayable(self.verify_body)
        self._reextend_run = self._replayable(self._reextend_body)
        self.accepted = self.cycles = 0  # drafted tokens accepted (all requests), over cycles run
        self.full_vocab = s.vocab * s.tp

    # ------------------------------------------------------------------------------------------- graph bodies

    def _tree_attention(self, q, cache, length, kv_lora, scale):
        if self.tree is not None:
            return self.tree(q, cache, kv_lora, scale)
        if self.cuda:
            return mla_verify(q, cache, self.starts, self.prefix, self.mask, kv_lora, scale, variant=self.attention,
                              config=self.attention_config, pdl=self.attention_pdl)
        return mla_verify_reference(q, cache, self.starts, self.prefix, self.mask, kv_lora, scale)

    def _head(self, x):
        vocab = self.fwd.s.vocab
        self.full_logits[:, :vocab].copy_(self.fwd.ops.linear(x, self.fwd.lm_head))
        self.gather(self.full_logits)

    def verify_body(self):
        emb = self.draft.embed[self.cand.remainder(self.fwd.s.vocab)]
        self.fwd.allreduce_fn(emb)
        self.fwd.buf[self.d]["h0"].copy_(emb)
        if self.tree is not None:  # the engine's per-forward metadata (its tree mask copied in), shared by the layers
            self.tree.prepare(self.starts, self.prefix, self.mask)
        self.target.forward(self.d, frozenset(COMPONENTS))

    def _draft_body(self):
        k, steps = self.cfg.topk, self.cfg.steps
        scores = self.step0_p
        score_list, token_list, parents = [scores.unsqueeze(1)], [self.step0_i], [self.parents0]
        b = self.batch
        ids, hidden = self.step0_i.flatten(), self.step0_h.repeat_interleave(k, dim=0)
        for i in range(1, steps):
            probs, hid = self.draft.forward(ids, hidden, fuse=False)
            tp, ti = probs.topk(k, dim=-1)
            expand = scores.unsqueeze(2) * tp.view(b, k, k)
            scores, chosen = expand.flatten(1).topk(k, dim=-1)
            score_list.append(expand)
            token_list.append(ti.view(b, k * k))
            parents.append(chosen + k * k * (i - 1) + k)
            parent_rows = chosen.flatten() // k if b == 1 else (chosen // k + self.draft_rows).flatten()
            hidden = hid.index_select(0, parent_rows)
            ids = ti.view(b, k * k).gather(1, chosen).flatten()
        self._draft_out = tree.organize_draft_results(score_list, token_list, parents, self.d,
                                                      backend=self.backend, flags=self.flags)

    def _reextend_body(self):
        probs, hid = self.draft.forward(self.re_ids, self.re_aux, fuse=True)
        last = self.accept_num.long() if self.batch == 1 else self.accept_num.long() + self.reextend_rows
        p, i = probs.index_select(0, last).topk(self.cfg.topk, dim=-1)
        self.step0_p.copy_(p)
        self.step0_i.copy_(i)
        self.step0_h.copy_(hid.index_select(0, last))

    def _replayable(self, body: Callable) -> Callable:
        """`body` as the engine runs it: replayed from a CUDA graph (captured on first use), or eager."""
        if not self.graphs:
            return body
        state = {}

        def run():
            if "graph" not in state:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    body()  # lazy handles and compilation stay out of the capture
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
                state["graph"] = torch.cuda.CUDAGraph()
                with graph_capture(state["graph"]):
                    body()
            state["graph"].replay()

        return run

    # ------------------------------------------------------------------------------------------- the cycle

    def step(self, mark: Callable[[str], None]) -> list:
        """One cycle; mark(phase) after each phase. Returns the tokens it emitted (accepted drafts + the bonus): a
        list, or at batch > 1 one list per request."""
        cfg, d, b = self.cfg, self.d, self.batch
        self._draft_run()
        parent_list, top, dtoks = self._draft_out
        if self.draft_override is not None:
            dtoks = self.draft_override.view(b, d - 1)
        mark("draft")
        seq_sum = int(self.seq_lens.sum().item())  # the engine's torch.sum(seq_lens).item()
        mask_full, _, r_index, r_next, r_sib, cand = tree.build_tree(
            self.root, parent_list, top, dtoks, self.seq_lens, cfg.topk, cfg.steps, d, "full", backend=self.backend,
            seq_lens_sum=seq_sum, flags=self.flags if self.cuda else None)
        ctx = seq_sum // b  # every request's context is the forward's
        self.mask.copy_(mask_full.view(b, d, ctx + d)[:, :, ctx:])
        self.cand.copy_(cand)
        tree.assign_req_to_token(self.req_to_token, self.req_pool, self.seq_lens, self.out_cache_loc, d,
                                 backend=self.backend)
        mark("tree")
        if self.tree is not None and self.tree.plan is not None:  # FlashInfer: plan() on the host before the replay
            self.tree.plan()
        self._verify_run()
        predict = tree.argmax(self.full_logits, backend=self.backend)
        predicts, accept_index, accept_num = tree.verify_tree_greedy(
            cand.view(b, d), r_index, r_next, r_sib, predict, cfg.steps + 1, backend=self.backend)
        mark("verify")
        nums = accept_num.tolist()
        paths = [row[: n + 1] for row, n in zip(accept_index.tolist(), nums)]
        emitted = predicts.tolist()
        mark("sync")
        keep = torch.zeros(b * d, device=self.cand.device, dtype=torch.bool)
        # B = 1 keeps the ops the committed cycle baselines timed (so its cases compare with them); B > 1 generalizes
        if b == 1:
            keep[accept_index[0, : nums[0] + 1].long()] = True
        else:  # the engine's accept_index[accept_index != -1]: a boolean-mask indexing, a sync
            flat = accept_index.flatten()
            keep[flat[flat >= 0].long()] = True
        freed = self.out_cache_loc[~keep]
        self.free_slots[: freed.numel()].copy_(freed)
        rows = accept_index.long().clamp(min=0).flatten()
        if b == 1:
            kept = self.out_cache_loc[keep]
            tree.assign_req_to_token(self.req_to_token, self.req_pool, self.seq_lens, kept, nums[0] + 1,
                                     backend=self.backend)
            self.seq_lens_next.copy_(self.seq_lens).add_(nums[0] + 1)
        else:  # each request's accepted slots, padded to steps + 1 (the rows past its accept length go unread)
            tree.assign_req_to_token(self.req_to_token, self.req_pool, self.seq_lens,
                                     self.out_cache_loc.index_select(0, rows), cfg.steps + 1, backend=self.backend)
            self.seq_lens_next.copy_(self.seq_lens).add_(accept_num).add_(1)
        self.re_ids.copy_(predicts.long().index_select(0, rows))
        self.re_aux.copy_(self.aux.index_select(0, rows))
        self.accept_num.copy_(accept_num)
        if b == 1:
            self.root.copy_(predicts[paths[0][-1]: paths[0][-1] + 1])
        else:
            self.root.copy_(predicts.long().index_select(0, accept_index.long().gather(1, accept_num.long().view(b, 1))
                                                         .flatten()))
        mark("bookkeeping")
        self._reextend_run()
        mark("reextend")
        self.accepted += sum(nums)
        self.cycles += 1
        out = [[emitted[i] for i in path] for path in paths]
        return out[0] if b == 1 else out

    # ------------------------------------------------------------------------------------------- checks

    def greedy_continuation(self, root: int) -> list:
        """The target's own greedy tokens after `root`, D of them, by D chain-masked verify forwards (eager): a list,
        or at batch > 1 one per request (each request's own context gives its own continuation). The logits each
        token was read from stay in greedy_logits [B, D, vocab] for check_drafts."""
        d, b = self.d, self.batch
        tokens = [[root] + [0] * (d - 1) for _ in range(b)]
        self.mask.copy_(torch.ones(d, d, dtype=torch.bool).tril_().view(1, d, d).expand(b, d, d))
        self.greedy_logits = torch.empty(b, d, self.full_logits.shape[1], device=self.full_logits.device)
        out = [[] for _ in range(b)]
        for i in range(d):
            self.cand.copy_(torch.tensor(tokens).flatten())
            self.verify_body()
            for r in range(b):
                self.greedy_logits[r, i].copy_(self.full_logits[r * d + i])
                nxt = int(torch.argmax(self.full_logits[r * d + i]).item())
                out[r].append(nxt)
                if i + 1 < d:
                    tokens[r][i + 1] = nxt
        return out[0] if b == 1 else out

    def check_drafts(self, root: int, drafts: list, greedy: list) -> list:
        """One cycle from `root` with request r's draft tokens drafts[r] in place of the draft's (run_check), judged
        per request by judge_draft against that verify forward's own logits and against greedy[r], the target's
        greedy tokens from the greedy_continuation(root) just before: [(accepted, ok, note)] per request."""
        got = self.run_check(root, drafts if self.batch > 1 else drafts[0])
        got = [got] if self.batch == 1 else got
        now = self.full_logits.view(self.batch, self.d, -1)
        return [(n, *judge_draft(greedy[r], drafts[r], n, emitted, self.greedy_logits[r], now[r]))
                for r, (n, emitted) in enumerate(got)]

    def run_check(self, root: int, override: list) -> tuple:
        """One cycle from `root` with the draft's tokens replaced by `override` (D - 1 tokens; at batch > 1 one list
        per request): (accepted count, emitted), or at batch > 1 a list of them per request."""
        self.root.fill_(root)
        self.draft_override = torch.tensor(override, device=self.cand.device, dtype=torch.int64).flatten()
        try:
            emitted = self.step(lambda phase: None)
        finally:
            self.draft_override = None
        if self.batch == 1:
            return len(emitted) - 1, emitted
        return [(len(e) - 1, e) for e in emitted]

    def attention_error(self) -> float:
        """Relative error of the tree attention (this cycle's variant) against the plain-torch masked reference,
        on fresh random queries over layer 0's cache and a random tree mask."""
        s, d, dev, b = self.fwd.s, self.d, self.fwd.device, self.batch
        q = torch.randn(s.heads, b * d, s.latent, device=dev, dtype=self.fwd.dtype)
        saved = self.mask.clone()
        vis = torch.rand(b, d, d, device=dev) < 0.5
        if self.tree is not None and self.tree.chain_only:  # exact for chains only (FlashInfer ignores the mask)
            vis = torch.ones_like(vis)
        self.mask.copy_((vis | torch.eye(d, dtype=torch.bool, device=dev)).tril_())
        try:
            cache, scale = self.fwd.layers[0]["kv_cache"], (s.qk_nope + s.qk_rope) ** -0.5
            if self.tree is not None:
                self.tree.prepare(self.starts, self.prefix, self.mask)
            got = self._tree_attention(q, cache, None, s.kv_lora, scale)
            ref = mla_verify_reference(q, cache, self.starts, self.prefix, self.mask, s.kv_lora, scale)
        finally:
            self.mask.copy_(saved)
        return ((got.double() - ref.double()).norm() / ref.double().norm()).item()
