"""Synthetic verify forward of one tensor-parallel rank: random weights, the real kernels, shapes,
bytes and order of a Kimi-K2.5-style MLA + MoE model, with every component switchable for the decomposition.

Components: misc (norms, residuals, activations, and the verify tokens' KV-slot write, which rides in the q/kv norm
kernel as engines fuse it), attn_proj (MLA projections, with the per-head kv_b absorption), attn_core (attention over
the latent cache), allreduce (2 per layer), router (router GEMM + top-k), moe (routed INT4 experts), dense (layer-0
dense MLP and the shared experts; the shared down projection adds the routed output in its epilogue), head (final
norm, lm_head, argmax, tree verification).
A switched-off component's consumers read static buffers of the right shape, so the rest still does its real work.

The small ops come from an `Ops` set: `TORCH_OPS` is plain torch (one kernel per torch op: an RMSNorm is ~8 kernels);
`fused_ops()` is what serving engines run: one kernel each for add+RMSNorm, SiLU*up, softmax+top-k, the q/kv norms
with the KV write, the kv_b absorption on each side of attention, MLA decode attention (split + combine), and a
weight-streaming GEMM for the n <= 16 projections (the router and the shared expert's gate_up share one, as both
read the same x); 18 launches per MoE layer (19 where a tuned GEMM reduces its split-K in a second launch), chained
with programmatic dependent launch (kernels/common/pdl.py) so that each kernel's launch and weight loads overlap the one
before. On a GPU the kernel count costs milliseconds, so the report says which set ran.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from verifybench.harness.model.presets import Preset

FORWARD_MAX_TOKENS = 8  # tokens per verify forward: its buffers hold n = 1..8, as the engine's verify step
COMPONENTS = ("misc", "attn_proj", "attn_core", "allreduce", "router", "moe", "dense", "head")


@dataclass(frozen=True)
class Ops:
    """The forward's small ops. add_rmsnorm(h, delta, w) adds delta into h in place and returns rmsnorm(h);
    linear_add(x, w, r) = x @ w.T + r; softmax_topk(logits, k) -> (fp32 weights, int32 ids);
    mla_prep(qkv, q_ln, kv_ln, cache, pos, q_lora, kv_lora) -> rmsnorm(q_a), and writes the n tokens' cache rows
    pos.. with rmsnorm(kv latent) and the rope part; q_absorb(qh [n, heads, nope + rope], w_uk, rope) -> q [heads,
    n, kv_lora + rope]; mla(q, cache, length, kv_lora, scale) -> [heads, n, kv_lora]; v_up(o_lat, w_uv) -> [n,
    heads * v_head]; act_linear(gate_up, w, r) = silu(gate) * up @ w.T (+ r unless None). Several requests:
    mla_prep(..., per_request=D, request_stride=R) writes request b's rows at pos + b * R; mla_batch(q, cache, starts,
    prefix_lens, mask, kv_lora, scale) is kernels.mla_verify's call (B requests, each over its own rows)."""

    name: str
    linear: Callable
    linear_add: Callable
    rmsnorm: Callable
    add_rmsnorm: Callable
    softmax_topk: Callable
    mla_prep: Callable
    q_absorb: Callable
    mla: Callable
    v_up: Callable
    act_linear: Callable
    mla_batch: Callable = None


def _rmsnorm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _add_rmsnorm(h, delta, w):
    h.add_(delta)
    return _rmsnorm(h, w)


def _act_linear(gate_up, w, r):
    g, u = gate_up.chunk(2, dim=-1)
    y = F.linear(F.silu(g) * u, w)
    return y if r is None else y + r


def _softmax_topk(logits, k):
    weights, ids = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1)
    return weights, ids.to(torch.int32)


def _mla(q, cache, length, kv_lora, scale):
    keys = cache[:length]
    # scores in fp32: rounded to bf16 (~3 significant digits) the output missed 1e-2 on some draws (1.11e-2 at n=8)
    scores = torch.matmul(q.float(), keys.float().t()) * scale
    return torch.matmul(torch.softmax(scores, -1).to(q.dtype), keys[:, :kv_lora])


def _mla_prep(qkv, q_ln, kv_ln, cache, pos, q_lora, kv_lora, per_request=None, request_stride=0):
    per = per_request or qkv.shape[0]
    for b in range(0, qkv.shape[0], per):  # one request's rows after its own prefix
        slots = cache[pos + b // per * request_stride: pos + b // per * request_stride + per]
        slots[:, :kv_lora].copy_(_rmsnorm(qkv[b: b + per, q_lora: q_lora + kv_lora], kv_ln))
        slots[:, kv_lora:].copy_(qkv[b: b + per, q_lora + kv_lora:])
    return _rmsnorm(qkv[:, :q_lora], q_ln)


def _q_absorb(qh, w_uk, rope):
    qh = qh.transpose(0, 1)  # [heads, n, nope + rope]
    return torch.cat([torch.bmm(qh[:, :, : qh.shape[2] - rope], w_uk), qh[:, :, qh.shape[2] - rope:]], dim=-1)


def _v_up(o_lat, w_uv):
    return torch.bmm(o_lat, w_uv).transpose(0, 1).reshape(o_lat.shape[1], -1)


def _mla_batch(q, cache, starts, prefix_lens, mask, kv_lora, scale):
    from verifybench.kernels.mla_verify.api import mla_verify_reference

    return mla_verify_reference(q, cache, starts, prefix_lens, mask, kv_lora, scale)


TORCH_OPS = Ops("torch", F.linear, lambda x, w, r: F.linear(x, w) + r, _rmsnorm, _add_rmsnorm, _softmax_topk,
                _mla_prep, _q_absorb, _mla, _v_up, _act_linear, _mla_batch)


def fused_ops() -> Ops:
    """The engine-style fused kernels (Triton; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); each launches
    with programmatic dependent launch where pdl.enabled."""
    from verifybench.kernels.fused_ops import api as fo
    from verifybench.kernels.mla_glue import api as mla_glue
    from verifybench.kernels.mla_decode.api import mla_decode
    from verifybench.kernels.mla_verify.api import mla_verify
    from verifybench.kernels.skinny_gemm.api import MAX_TOKENS
    from verifybench.kernels.skinny_gemm.api import linear as skinny

    def linear(x, w, add=None, act=None):
        """The weight-streaming GEMM up to its MAX_TOKENS rows; past them (B requests' B * D tokens) torch's GEMM,
        as engines switch to a tiled GEMM at larger row counts."""
        if x.shape[0] <= MAX_TOKENS:
            return skinny(x, w, add=add) if act is None else skinny(x, w, add=add, act=act)
        if act == "silu_mul":
            g, u = x.chunk(2, dim=-1)
            x = F.silu(g) * u
        y = F.linear(x, w)
        return y if add is None else y + add

    return Ops("fused", linear, lambda x, w, r: linear(x, w, add=r), fo.rmsnorm, fo.add_rmsnorm, fo.softmax_topk,
               mla_glue.mla_prep, mla_glue.q_absorb,
               lambda q, cache, length, kv_lora, scale: mla_decode(q, cache, length, kv_lora=kv_lora, scale=scale),
               mla_glue.v_up,
               # silu_mul in the down projection's x loads: no launch of its own
               lambda gate_up, w, r: linear(gate_up, w, add=r, act="silu_mul"),
               # B requests at once: our split-KV kernel over each request's own rows (one launch for all)
               lambda q, cache, starts, lens, mask, kv_lora, scale: mla_verify(q, cache, starts, lens, mask, kv_lora,
                                                                               scale, variant="split_kv"))


def _rand(*shape, device, dtype, fan_in=None):
    return torch.randn(*shape, device=device, dtype=dtype) / (fan_in or shape[-1]) ** 0.5


class VerifyForward:
    """Weights of every layer, a latent KV cache of `context` tokens per layer and request, and forward(n, active)
    for n = 1..max_tokens tokens of each of `batch` requests (at_batch(b): the same weights at b <= batch
    requests; request b's rows start at b * (context + max_tokens)). `moe_fn(x, w13p, w13s, w2p, w2s, topk_w,
    topk_ids)` runs the routed experts; `allreduce_fn(t)` reduces a tensor in place (a real collective, or a
    calibrated device wait on one GPU); `verify_fn(candidates, target_predict)` walks the draft chain; `ops` the
    small ops (TORCH_OPS by default)."""

    def __init__(self, s: Preset, context: int, device: str, moe_fn: Callable, allreduce_fn: Callable,
                 verify_fn: Callable, max_tokens: int = 8, seed: int = 0, ops: Ops = TORCH_OPS,
                 dtype: torch.dtype = torch.bfloat16, batch: int = 1):
        torch.manual_seed(seed)
        self.s, self.context, self.device, self.max_tokens, self.dtype = s, context, device, max_tokens, dtype
        self.max_batch, self.batch, self.region = batch, 1, context + max_tokens  # rows per request in each cache
        self.moe_fn, self.allreduce_fn, self.verify_fn, self.ops = moe_fn, allreduce_fn, verify_fn, ops
        self._recording = False  # routing is copied out only in an eager forward, never inside a timed graph
        # speculative-cycle hooks: head_fn(x) replaces the head's lm_head + argmax + chain verify; aux = (layer
        # indices, [n, len * hidden] buffer per n) copies the residual stream entering those layers (EAGLE-3's
        # captured hidden states)
        self.head_fn: Callable | None = None
        self.aux: tuple[tuple[int, ...], dict] | None = None
        d, h, dt = device, s.hidden, dtype
        qk_head = s.qk_nope + s.qk_rope
        self.layers = []
        for i in range(s.layers):
            L = {"ln1": torch.ones(h, device=d, dtype=dt), "ln2": torch.ones(h, device=d, dtype=dt),
                 "q_a_kv_a": _rand(s.q_lora + s.latent, h, device=d, dtype=dt),
                 "q_b": _rand(s.heads * qk_head, s.q_lora, device=d, dtype=dt),
                 "q_ln": torch.ones(s.q_lora, device=d, dtype=dt),
                 "kv_ln": torch.ones(s.kv_lora, device=d, dtype=dt),
                 "w_uk": _rand(s.heads, s.qk_nope, s.kv_lora, device=d, dtype=dt),  # kv_b absorbed: query side
                 "w_uv": _rand(s.heads, s.kv_lora, s.v_head, device=d, dtype=dt),  # ... and output side
                 "o_proj": _rand(h, s.heads * s.v_head, device=d, dtype=dt),
                 "kv_cache": _rand(batch * (context + max_tokens), s.latent, device=d, dtype=dt, fan_in=1)}
            if i < s.dense_layers:
                L["gate_up"] = _rand(2 * s.dense_intermediate, h, device=d, dtype=dt)
                L["down"] = _rand(h, s.dense_intermediate, device=d, dtype=dt)
            else:
                e, inter, g = s.experts, s.expert_intermediate, s.expert_group_size
                # router and shared gate_up read the same x: one [E + 2I, H] weight, one GEMM when both run; the
                # component-wise views are its row slices (contiguous, no copy)
                L["router_gate_up"] = _rand(e + 2 * inter, h, device=d, dtype=dt)
                L["router"], L["shared_gate_up"] = L["router_gate_up"][:e], L["router_gate_up"][e:]
                L["shared_down"] = _rand(h, inter, device=d, dtype=dt)
                # random nibbles are random int4 weights; scales ~ 1/(8 sqrt(K)) keep activations O(1)
                L["w13p"] = torch.randint(-2**31, 2**31 - 1, (e, 2 * inter, h // 8), device=d, dtype=torch.int32)
                L["w13s"] = torch.full((e, 2 * inter, h // g), 1 / (8 * h**0.5), device=d, dtype=torch.bfloat16)
                L["w2p"] = torch.randint(-2**31, 2**31 - 1, (e, h, inter // 8), device=d, dtype=torch.int32)
                L["w2s"] = torch.full((e, h, inter // g), 1 / (8 * inter**0.5), device=d, dtype=torch.bfloat16)
            self.layers.append(L)
        self.final_ln = torch.ones(h, device=d, dtype=dt)
        self.lm_head = _rand(s.vocab, h, device=d, dtype=dt)
        # per batch, per n: the residual stream, static stand-ins for switched-off producers, the routing of every layer
        self._bufs = {1: {n: self._buffers(n) for n in range(1, max_tokens + 1)}}

    @property
    def buf(self) -> dict:
        """{n: buffers} at this forward's batch (B * n rows each)."""
        return self._bufs[self.batch]

    @buf.setter
    def buf(self, bufs: dict) -> None:
        """Replace the buffers at this forward's batch (multigpu.verify_setup redraws them identically per rank)."""
        self._bufs[self.batch] = bufs

    def at_batch(self, batch: int) -> "VerifyForward":
        """This forward (the same weights and caches) at `batch` requests of their own contexts; its buffers are made
        here, never inside a graph capture."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch}: this forward holds 1..{self.max_batch} requests")
        if batch not in self._bufs:
            self._bufs[batch] = {n: self._buffers(n, batch) for n in range(1, self.max_tokens + 1)}
        out = copy.copy(self)
        out.batch = batch
        return out

    def _buffers(self, n: int, batch: int = 1) -> dict:
        s, d, dt = self.s, self.device, self.dtype
        gen = torch.Generator(device="cpu").manual_seed(n if batch == 1 else n * 1000 + batch)
        per, n = n, n * batch  # every buffer holds all B requests' tokens (per each), request-major
        ids = torch.stack([torch.randperm(s.experts, generator=gen)[: s.topk] for _ in range(n)]).to(d)
        requests = {} if batch == 1 else {  # each request over its own rows, seeing every one of its tokens
            "starts": torch.arange(batch, device=d, dtype=torch.int32) * self.region,
            "prefix_lens": torch.full((batch,), self.context, device=d, dtype=torch.int32),
            "visible": torch.ones(batch, per, per, device=d, dtype=torch.bool)}
        return {**requests, "h0": torch.randn(n, s.hidden, device=d, dtype=dt),
                "h": torch.empty(n, s.hidden, device=d, dtype=dt),
                "x": torch.randn(n, s.hidden, device=d, dtype=dt),
                "q_a": torch.randn(n, s.q_lora, device=d, dtype=dt),
                "qkv": torch.randn(n, s.q_lora + s.latent, device=d, dtype=dt),
                "q": torch.randn(s.heads, n, s.latent, device=d, dtype=dt),
                "o_lat": torch.randn(s.heads, n, s.kv_lora, device=d, dtype=dt),
                "attn_out": torch.randn(n, s.hidden, device=d, dtype=dt),
                "mlp_act": torch.randn(n, max(s.dense_intermediate, s.expert_intermediate), device=d, dtype=dt),
                "topk_w": torch.full((n, s.topk), 1 / s.topk, device=d, dtype=torch.float32),
                "topk_ids": ids.to(torch.int32),
                "ids_seen": torch.zeros(s.layers, n, s.topk, device=d, dtype=torch.int32),
                "candidates": torch.randint(0, s.vocab, (batch, per), device=d),
                "predict": torch.zeros(n, device=d, dtype=torch.int64)}

    def forward(self, n: int, active: frozenset = frozenset(COMPONENTS)):
        """One verify forward of n tokens of each of the batch's requests with the `active` components;
        graph-capturable (no host syncs). With misc on, each residual add is fused into the next RMSNorm, as engines
        do."""
        s, b, on, ops = self.s, self.buf[n], active.__contains__, self.ops
        h = b["h"]
        h.copy_(b["h0"])
        x = ops.rmsnorm(h, self.layers[0]["ln1"]) if on("misc") else b["x"]
        for i, L in enumerate(self.layers):
            if self.aux is not None and i in self.aux[0]:
                k = self.aux[0].index(i)
                self.aux[1][n][:, k * s.hidden:(k + 1) * s.hidden].copy_(h)
            # --- attention (MLA, weight-absorbed as engines run it at decode/verify sizes)
            q_a, qkv = b["q_a"], b["qkv"]
            if on("attn_proj"):
                qkv = ops.linear(x, L["q_a_kv_a"])
            if on("misc"):  # both norms and the verify tokens' KV-slot write, one kernel when fused
                q_a = (ops.mla_prep(qkv, L["q_ln"], L["kv_ln"], L["kv_cache"], self.context, s.q_lora, s.kv_lora)
                       if self.batch == 1 else
                       ops.mla_prep(qkv, L["q_ln"], L["kv_ln"], L["kv_cache"], self.context, s.q_lora, s.kv_lora,
                                    per_request=n, request_stride=self.region))
            q = b["q"]
            if on("attn_proj"):
                qh = ops.linear(q_a, L["q_b"]).view(n * self.batch, s.heads, s.qk_nope + s.qk_rope)
                q = ops.q_absorb(qh, L["w_uk"], s.qk_rope)  # [heads, n, kv_lora + rope]
            o_lat = b["o_lat"]
            if on("attn_core"):
                scale = (s.qk_nope + s.qk_rope) ** -0.5
                o_lat = (ops.mla(q, L["kv_cache"], self.context + n, s.kv_lora, scale) if self.batch == 1 else
                         ops.mla_batch(q, L["kv_cache"], b["starts"], b["prefix_lens"], b["visible"], s.kv_lora, scale))
            attn_out = b["attn_out"]
            if on("attn_proj"):
                attn_out = ops.linear(ops.v_up(o_lat, L["w_uv"]), L["o_proj"])
            if on("allreduce"):
                self.allreduce_fn(attn_out)
            if on("misc"):
                x = ops.add_rmsnorm(h, attn_out, L["ln2"])
            # --- MLP: dense for the first layers, routed INT4 experts + shared expert after
            mlp_out = b["attn_out"]
            if i < s.dense_layers:
                if on("dense"):
                    mlp_out = self._down(ops.linear(x, L["gate_up"]), L["down"], None, b, on)
            else:
                topk_w, topk_ids = b["topk_w"], b["topk_ids"]
                both = ops.linear(x, L["router_gate_up"]) if on("router") and on("dense") else None
                if on("router"):
                    logits = both[:, : s.experts] if both is not None else ops.linear(x, L["router"])
                    topk_w, topk_ids = ops.softmax_topk(logits, s.topk)
                    if self._recording:
                        b["ids_seen"][i].copy_(topk_ids)
                if on("moe"):
                    mlp_out = self.moe_fn(x, L["w13p"], L["w13s"], L["w2p"], L["w2s"], topk_w, topk_ids)
                if on("dense"):  # the shared expert; its down projection adds the routed output in its epilogue
                    gate_up = both[:, s.experts:] if both is not None else ops.linear(x, L["shared_gate_up"])
                    mlp_out = self._down(gate_up, L["shared_down"], mlp_out if on("moe") else None, b, on)
            if on("allreduce"):
                self.allreduce_fn(mlp_out)
            if on("misc"):
                last = i + 1 == len(self.layers)
                x = ops.add_rmsnorm(h, mlp_out, self.final_ln if last else self.layers[i + 1]["ln1"])
        if on("head") and self.head_fn is not None:
            return self.head_fn(x if on("misc") else b["x"])
        if on("head"):
            logits = ops.linear(x if on("misc") else b["x"], self.lm_head)
            b["predict"].copy_(torch.argmax(logits, dim=-1))
            return self.verify_fn(b["candidates"], b["predict"])
        return h

    def _down(self, gate_up, w, add, b, on):
        """The MLP's down projection (+ add): of silu(gate) * up with misc on (the activation is a misc op), of a
        static activation without it."""
        if on("misc"):
            return self.ops.act_linear(gate_up, w, add)
        act = b["mlp_act"][:, : gate_up.shape[1] // 2]
        return self.ops.linear(act, w) if add is None else self.ops.linear_add(act, w, add)

    def component_bytes(self, n: int, distinct_experts_per_layer: list[int]) -> dict[str, int]:
        """Bytes each component must read in one forward: its weights (the routed experts actually touched) and,
        for attn_core, the KV cache. misc and allreduce move no weights."""
        s, first, moe_l = self.s, self.layers[0], self.layers[-1]

        def nbytes(layer, keys):
            return sum(layer[k].numel() * layer[k].element_size() for k in keys)

        moe_layers = s.layers - s.dense_layers
        expert = sum(moe_l[k][0].numel() * moe_l[k].element_size() for k in ("w13p", "w13s", "w2p", "w2s"))
        return {"attn_proj": s.layers * nbytes(first, ("q_a_kv_a", "q_b", "w_uk", "w_uv", "o_proj")),
                "attn_core": s.layers * self.batch * (self.context + n) * s.latent * 2,
                "router": moe_layers * nbytes(moe_l, ("router",)),
                "moe": expert * sum(distinct_experts_per_layer),
                "dense": (s.dense_layers * nbytes(first, ("gate_up", "down")) if s.dense_layers else 0)
                + moe_layers * nbytes(moe_l, ("shared_gate_up", "shared_down")),
                "head": self.lm_head.numel() * self.lm_head.element_size()}

    def weight_bytes(self, n: int, distinct_experts_per_layer: list[int]) -> dict:
        """Bytes one forward must read: bf16 weights, the routed experts actually touched, and the KV cache."""
        parts = self.component_bytes(n, distinct_experts_per_layer)
        return {"total": sum(parts.values()), "routed_experts": parts["moe"], "kv": parts["attn_core"],
                "by_component": parts}

    def distinct_experts(self, n: int) -> list[int]:
        """Distinct experts each MoE layer's routing touches in a forward of n tokens (one eager forward that copies
        the routing out; the timed graphs do not carry that copy)."""
        self._recording = True
        try:
            self.forward(n)
        finally:
            self._recording = False
        seen = self.buf[n]["ids_seen"][self.s.dense_layers:]
        return [int(torch.unique(layer).numel()) for layer in seen]


def allocated_bytes(s: Preset, context: int, max_tokens: int, batch: int = 1) -> int:
    """Weight + KV-cache bytes VerifyForward allocates on one rank (what must fit the GPU), `batch` requests'
    caches."""
    h, qk = s.hidden, s.qk_nope + s.qk_rope
    attn = 2 * ((s.q_lora + s.latent) * h + s.heads * qk * s.q_lora + s.heads * s.qk_nope * s.kv_lora
                + s.heads * s.kv_lora * s.v_head + h * s.heads * s.v_head + batch * (context + max_tokens) * s.latent)
    dense = 2 * 3 * s.dense_intermediate * h
    e, i, g = s.experts, s.expert_intermediate, s.expert_group_size
    experts = 4 * e * 2 * i * h // 8 + 2 * e * 2 * i * h // g + 4 * e * h * i // 8 + 2 * e * h * i // g  # int4 + scales
    moe = 2 * (e * h + 3 * i * h) + experts  # router, shared expert, routed experts
    return s.layers * attn + s.dense_layers * dense + (s.layers - s.dense_layers) * moe + 2 * s.vocab * h
