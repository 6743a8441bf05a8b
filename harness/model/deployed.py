"""The forward and cycle as an engine deployment runs them: each part (plain decode and draft-step attention, verify
attention, routed experts) runs the Deployment's kernel where it runs here, else ours in its place, recorded.

Per part: SGLang's Triton decode with the deployment's KV-split cap and its metadata built once per forward shape and
shared by every layer (as the backend's init_forward_metadata); SGLang's extend with its tiles for extend_tiles_cc, the
metadata shared too and the tree mask copied in once per forward (inside the verify graph, as the backend's replay
prep); FlashInfer's MLA wrapper (verify: chains only) with its plan() run on the host before each forward, as SGLang
plans before each graph replay (counted in the cycle's eager part; added to the plain decode step's graph time);
SGLang's Marlin MoE over the forward's own experts viewed in its layout (harness/engines/marlin.py forward_view).
Where a part cannot run (engine missing, a GPU-only kernel on CPU, a build that fails), ours runs and the
composition records (part, engine kernel, stand-in, reason). On CPU the engine's Triton kernels run in the
interpreter on fp32 copies (bf16 arithmetic is wrong there).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from verifybench.harness.engines import EngineMissing
from verifybench.harness.engines.deployment import Deployment

PARTS = ("decode attention", "draft attention", "verify attention", "moe")


@dataclass
class Composition:
    """What each part runs for one deployment on one forward. decode(q, cache, length, kv_lora, scale) and
    decode_batch(q, cache, starts, prefix_lens, mask, kv_lora, scale): the forward's ops.mla / ops.mla_batch (None:
    ours); draft(q [rows, heads, hd], k, v, end, per) -> [rows, heads, hd] (None: ours); tree: a TreeAttention (None:
    ours); moe: the routed experts, the forward's moe_fn (None: ours); host: per forward kind ("decode", "verify")
    the host work run before each replay (FlashInfer's plan())."""
    deployment: Deployment
    ran: dict = field(default_factory=dict)         # part -> the kernel that ran
    stand_ins: list = field(default_factory=list)   # (part, engine kernel, stand-in, reason)
    decode: Callable | None = None
    decode_batch: Callable | None = None
    draft: Callable | None = None
    tree: "TreeAttention | None" = None
    moe: Callable | None = None
    host: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)      # part -> how the engine's kernel runs here, where it needs saying

    def stand_in(self, part: str, engine: str, ours: str, reason: str) -> None:
        self.ran[part] = ours
        self.stand_ins.append((part, engine, ours, reason))

    def params(self) -> dict:
        """What a case records of the deployment: engine, version, args, the kernel per part, the stand-ins."""
        d = self.deployment
        return {"engine": d.engine, "engine_version": d.version, "engine_args": " ".join(d.engine_args),
                "deployment": d.line(), "kernels": dict(self.ran),
                "stand_ins": [list(s) for s in self.stand_ins], "notes": dict(self.notes)}


def _interp(t: torch.Tensor) -> torch.Tensor:
    """On CPU the engine's Triton kernels run in the interpreter, whose bf16 arithmetic is wrong: fp32 there."""
    return t.float() if t.device.type == "cpu" and t.dtype == torch.bfloat16 else t


# ------------------------------------------------------------------------------------------- SGLang's Triton decode

class _SglangDecode:
    """SGLang's decode_attention_fwd, the backend's metadata built once per forward shape (every layer shares it)."""

    def __init__(self, kv_splits: int):
        from verifybench.harness.engines import sglang

        self.sglang, self.module, self.kv_splits, self.meta = sglang, sglang.decode_module(), kv_splits, {}

    def _metadata(self, key, rows, per, heads, dv):
        """rows() -> (starts, lens): called once per key, eagerly (a host read), never inside a capture (warm-up
        calls come first); later calls launch nothing for it."""
        if key not in self.meta:
            starts, lens = rows()
            self.meta[key] = self.sglang.decode_metadata(starts, lens, per, heads, dv, self.kv_splits)
        return self.meta[key]

    def run(self, q_engine, k_buffer, v_buffer, m, scale):
        """q_engine [T, heads, dk] (contiguous, as the backend passes it) -> o [T, heads, dv]."""
        dtype = q_engine.dtype
        q_engine, k_buffer, v_buffer = _interp(q_engine), _interp(k_buffer), _interp(v_buffer)
        o = torch.empty(*q_engine.shape[:2], v_buffer.shape[-1], dtype=q_engine.dtype, device=q_engine.device)
        self.module.decode_attention_fwd(q_engine, k_buffer, v_buffer, o, m["kv_indptr"], m["kv_indices"],
                                         m["attn_logits"], m["attn_lse"], m["num_kv_splits"], m["max_kv_splits"],
                                         scale, 1.0, 1.0, logit_cap=0.0)
        return o.to(dtype)

    def mla(self, q, cache, rows, requests, kv_lora, scale, key):
        """Our MLA layout (q [heads, T, DK], cache [rows, DK]) through the engine's call -> [heads, T, kv_lora]."""
        heads, t, dk = q.shape
        m = self._metadata(key, rows, t // requests, heads, kv_lora)
        k_buffer = cache.view(-1, 1, dk)
        return self.run(q.transpose(0, 1).contiguous(), k_buffer, k_buffer[..., :kv_lora], m, scale).transpose(0, 1)

    def ops(self, device: str):
        def one(q, cache, length, kv_lora, scale):  # one request over rows [0, length)
            rows = lambda: (torch.zeros(1, dtype=torch.int32, device=device),  # noqa: E731
                            torch.full((1,), length, dtype=torch.int32, device=device))
            return self.mla(q, cache, rows, 1, kv_lora, scale, ("one", q.shape[1], length))

        def batch(q, cache, starts, prefix_lens, mask, kv_lora, scale):  # each request over its prefix and its n rows
            b = starts.numel()
            return self.mla(q, cache, lambda: (starts, prefix_lens + q.shape[1] // b), b, kv_lora, scale,
                            ("batch", q.shape[1], b))

        return one, batch

    def draft(self, q, k, v, end, per):
        """The draft's grouped decode: q [rows, heads, hd]; k/v [B, region, kv_heads, hd] (its caches); each
        request's per rows over its first `end` rows."""
        b, region = k.shape[:2]
        rows = lambda: (torch.arange(b, dtype=torch.int32, device=q.device) * region,  # noqa: E731
                        torch.full((b,), end, dtype=torch.int32, device=q.device))
        m = self._metadata(("draft", q.shape[0], end), rows, per, q.shape[1], v.shape[-1])
        return self.run(q.contiguous(), k.view(b * region, *k.shape[2:]), v.view(b * region, *v.shape[2:]), m,
                        q.shape[-1] ** -0.5)


# ------------------------------------------------------------------------------------------- verify attention

class TreeAttention:
    """The verify attention of a deployment: prepare(starts, prefix, mask) once per forward (inside the verify graph:
    device copies only), then __call__(q, cache, kv_lora, scale) per layer. chain_only: exact for chains only
    (FlashInfer ignores the tree mask); plan: host work before each forward (None: none)."""
    chain_only = False
    plan: Callable | None = None

    def prepare(self, starts, prefix, mask) -> None:
        raise NotImplementedError

    def __call__(self, q, cache, kv_lora, scale):
        raise NotImplementedError


class SglangExtend(TreeAttention):
    """SGLang's extend for target verify: its metadata (page table, flat custom mask, offsets) built once, the tree
    part of the custom mask refreshed from the cycle's mask each forward; the tree tokens' k/v read from their cache
    rows (the view itself at one request)."""

    def __init__(self, cc: int | None):
        from verifybench.harness.engines import sglang

        self.sglang, self.module, self.cc, self.m = sglang, sglang.extend_module(), cc, None

    def prepare(self, starts, prefix, mask):
        if self.m is None:  # built eagerly on the first (uncaptured) forward
            self.m = self.sglang.extend_metadata(starts, prefix, mask)
            b, d = starts.numel(), self.m["d"]
            offs = self.m["mask_indptr"][:-1].long().view(b, 1, 1)
            lens = prefix.long().view(b, 1, 1)
            r = torch.arange(d, device=starts.device).view(1, d, 1)
            c = torch.arange(d, device=starts.device).view(1, 1, d)
            self.tree_pos = (offs + r * (lens + d) + lens + c).flatten()  # the tree columns of each row
            self.first = int(starts[0]) + int(prefix[0]) if b == 1 else None
        self.m["custom_mask"][self.tree_pos] = mask.reshape(-1)

    def __call__(self, q, cache, kv_lora, scale):
        heads, t, dk = q.shape
        m = self.m
        rows = cache[self.first: self.first + t] if self.first is not None else cache.index_select(0, m["tree_rows"])
        k_buffer = _interp(cache).view(-1, 1, dk)
        k_extend = _interp(rows).view(t, 1, dk)
        q_engine = _interp(q.transpose(0, 1).contiguous())
        out = torch.empty(t, heads, kv_lora, dtype=q_engine.dtype, device=q.device)
        with self.sglang.capability(self.module, self.cc):
            self.module.extend_attention_fwd(q_engine, k_extend, k_extend[..., :kv_lora], out, k_buffer,
                                             k_buffer[..., :kv_lora], m["qo_indptr"], m["kv_indptr"],
                                             m["kv_indices"], m["custom_mask"], True, m["mask_indptr"], m["d"],
                                             1.0, 1.0, sm_scale=scale)
        return out.to(q.dtype).transpose(0, 1)


def _flashinfer_run(wrapper, q, cache, kv_lora):
    heads, t, dk = q.shape
    q_engine = q.transpose(0, 1).contiguous()
    pages = cache.view(-1, 1, dk)
    out = torch.empty(t, heads, kv_lora, dtype=q.dtype, device=q.device)
    wrapper.run(q_engine[..., :kv_lora], q_engine[..., kv_lora:], pages[..., :kv_lora], pages[..., kv_lora:], out=out)
    return out.transpose(0, 1)


class FlashinferMla(TreeAttention):
    """FlashInfer's MLA wrapper planned as SGLang plans target verify (causal over prefix + tree: chains only)."""
    chain_only = True

    def __init__(self, s, dtype):
        from verifybench.harness.engines import flashinfer

        flashinfer.mla_module()  # EngineMissing where it cannot be imported
        self.flashinfer, self.s, self.dtype, self.wrapper = flashinfer, s, dtype, None

    def prepare(self, starts, prefix, mask):
        if self.wrapper is None:
            s = self.s
            d = mask.shape[-1]
            self.wrapper, self.plan = self.flashinfer.verify_planner(
                starts, prefix, d, s.heads, s.kv_lora, s.qk_rope, (s.qk_nope + s.qk_rope) ** -0.5, self.dtype)

    def __call__(self, q, cache, kv_lora, scale):
        return _flashinfer_run(self.wrapper, q, cache, kv_lora)


# ------------------------------------------------------------------------------------------- composing

def _flashinfer_decode(comp: Composition, fwd):
    """FlashInfer's MLA decode planned as SGLang's flashinfer_mla backend plans decode; its plan() is the decode
    forward's host work (comp.host["decode"])."""
    from verifybench.harness.engines import flashinfer

    flashinfer.mla_module()
    if fwd.device != "cuda":
        raise EngineMissing("FlashInfer's MLA kernels need a CUDA GPU (they compile with nvcc)")
    s, plans = fwd.s, {}

    def planned(key, rows, per):
        if key not in plans:
            starts, lens = rows()
            plans[key] = flashinfer.decode_planner(starts, lens, per, s.heads, s.kv_lora, s.qk_rope,
                                                   (s.qk_nope + s.qk_rope) ** -0.5, fwd.dtype)
            if per == 1:  # the plain decode step's plan: its host work before each replay
                comp.host["decode"] = plans[key][1]
        return plans[key][0]

    def one(q, cache, length, kv_lora, scale):
        rows = lambda: (torch.zeros(1, dtype=torch.int32, device=fwd.device),  # noqa: E731
                        torch.full((1,), length, dtype=torch.int32, device=fwd.device))
        return _flashinfer_run(planned(("one", q.shape[1], length), rows, q.shape[1]), q, cache, kv_lora)

    def batch(q, cache, starts, prefix_lens, mask, kv_lora, scale):
        n = q.shape[1] // starts.numel()
        return _flashinfer_run(planned(("batch", q.shape[1], starts.numel()), lambda: (starts, prefix_lens + n), n),
                               q, cache, kv_lora)

    return one, batch


def _try(comp: Composition, part: str, engine_kernel: str, ours: str, build: Callable):
    """build() -> what runs the engine's kernel; on EngineMissing ours stands in, the reason recorded."""
    try:
        out = build()
    except EngineMissing as e:
        comp.stand_in(part, engine_kernel, ours, str(e))
        return None
    comp.ran[part] = engine_kernel
    return out


def compose(dep: Deployment, fwd) -> Composition:
    """The deployment's kernel per part on `fwd` (a VerifyForward), ours where the engine's cannot run here."""
    comp = Composition(dep)
    gpu = fwd.device == "cuda"
    ours_decode = "ours.decode" if fwd.ops.name == "fused" else "torch reference (decode)"
    # decode attention: the plain decode step; the draft steps use the same backend
    if dep.decode_attention == "sglang.decode":
        dec = _try(comp, "decode attention", "sglang.decode", ours_decode,
                   lambda: _SglangDecode(dep.kv_splits or 8))
        if dec is not None:
            comp.decode, comp.decode_batch = dec.ops(fwd.device)
            comp.draft = dec.draft
            comp.ran["draft attention"] = "sglang.decode (grouped)"
        else:
            comp.stand_in("draft attention", "sglang.decode (grouped)", "torch SDPA", "the engine's decode is absent")
    elif dep.decode_attention == "flashinfer.decode":
        fns = _try(comp, "decode attention", "flashinfer.decode", ours_decode, lambda: _flashinfer_decode(comp, fwd))
        if fns is not None:
            comp.decode, comp.decode_batch = fns
        comp.stand_in("draft attention", "flashinfer (GQA decode)", "torch SDPA",
                      "FlashInfer's GQA decode for the draft model is not wired here")
    else:
        comp.ran["decode attention"], comp.ran["draft attention"] = ours_decode, "torch SDPA"
    # verify attention: the target verify forward of the cycle
    if dep.verify_attention == "sglang.extend":
        comp.tree = _try(comp, "verify attention", "sglang.extend", "ours.extend" if gpu else "torch reference",
                         lambda: SglangExtend(dep.extend_tiles_cc))
    elif dep.verify_attention == "flashinfer.mla":
        def build():
            if fwd.device != "cuda":
                raise EngineMissing("FlashInfer's MLA kernels need a CUDA GPU (they compile with nvcc)")
            return FlashinferMla(fwd.s, fwd.dtype)
        comp.tree = _try(comp, "verify attention", "flashinfer.mla", "ours.split_kv" if gpu else "torch reference",
                         build)
    else:
        comp.ran["verify attention"] = dep.verify_attention if gpu else "torch reference"
    # routed experts
    comp.moe = deployed_moe(comp, fwd.device, fwd.dtype)
    return comp


def check(comp: Composition, fwd, draft=None, tokens: tuple[int, ...] | None = None) -> tuple[bool, str]:
    """The engine's decode (plain decode step) and draft-step attention against plain torch on fresh queries over
    layer 0's cache and the draft's caches (the verify attention: Cycle.attention_error); the engine's MoE against our
    fp32 reference at the forward's layer shape and `tokens` (the forward's token counts; default its batch), on a
    layer of its own (marlin.check_against_reference: the forward's views have no reference)."""
    from verifybench.kernels.mla_verify.api import mla_verify_reference

    ok, detail, s, b, dev = True, [], fwd.s, fwd.batch, fwd.device
    scale = (s.qk_nope + s.qk_rope) ** -0.5
    if comp.decode is not None:
        cache = fwd.layers[0]["kv_cache"]
        q = torch.randn(s.heads, b, s.latent, device=dev, dtype=fwd.dtype)
        starts = torch.arange(b, device=dev, dtype=torch.int32) * fwd.region
        prefix = torch.full((b,), fwd.context, device=dev, dtype=torch.int32)
        got = (comp.decode(q, cache, fwd.context + 1, s.kv_lora, scale) if b == 1 else
               comp.decode_batch(q, cache, starts, prefix, None, s.kv_lora, scale))
        ref = mla_verify_reference(q, cache, starts, prefix, torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
                                   s.kv_lora, scale)
        err = _rel(got, ref)
        ok = ok and err <= 1e-2
        detail.append(f"{comp.ran['decode attention']} decode vs torch rel_err {err:.2e}")
    if comp.draft is not None and draft is not None:
        dm = draft.d
        end, per = draft.context + 1, 1
        q = torch.randn(b * per, dm.heads, dm.head_dim, device=dev, dtype=fwd.dtype)
        got = comp.draft(q, draft.k_cache, draft.v_cache, end, per)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.view(b, per, dm.heads, dm.head_dim).transpose(1, 2), draft.k_cache[:, :end].transpose(1, 2),
            draft.v_cache[:, :end].transpose(1, 2), enable_gqa=dm.kv_heads != dm.heads).transpose(1, 2)
        err = _rel(got, ref.reshape(got.shape))
        ok = ok and err <= 1e-2
        detail.append(f"{comp.ran['draft attention']} draft attention vs SDPA rel_err {err:.2e}")
    if comp.moe is not None and comp.ran.get("moe") == "sglang.marlin":
        from verifybench.harness.engines import marlin

        try:
            good, said = marlin.check_against_reference(s.hidden, s.expert_intermediate, s.expert_group_size, s.topk,
                                                        s.experts, tokens or (b,), fwd.dtype, dev)
        except EngineMissing as e:
            good, said = False, f"sglang.marlin check: {e}"
        ok = ok and good
        detail.append(said)
    return ok, "; ".join(detail)


def _rel(got, ref) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


# why the forward's own weights may stand for a Marlin layer (the composition's note on its MoE row)
MARLIN_VIEW_NOTE = ("SGLang's Marlin over the forward's random INT4 experts viewed in its layout (no copy, no repack: "
                    "random nibbles are as random in Marlin's tiles as in ours, the same bytes by the same loads); "
                    "its values are checked on a layer of its own that SGLang's loader step repacked; the block "
                    "alignment inside the forward's graph as one Triton launch of ours (one sgl-kernel op in SGLang)")


def deployed_moe(comp: Composition, device: str, dtype: torch.dtype):
    """The deployment's routed experts: SGLang's Marlin over the forward's own weights (marlin.forward_moe) where it
    runs here, its JIT kernels built first; else None (ours) with the reason recorded (no CUDA, SGLang absent or its
    build failed: the reason names which)."""
    want, ours = comp.deployment.moe, "ours.moe" if device == "cuda" else "torch reference (moe)"
    if want == "sglang.marlin":
        from verifybench.harness.engines import label, marlin

        def build():
            if device != "cuda":
                raise EngineMissing(f"{label('sglang')}: {marlin.CPU_REASON}")
            marlin.build(dtype)
            return marlin.forward_moe
        moe = _try(comp, "moe", "sglang.marlin", ours, build)
        if moe is not None:
            ops = marlin.torch_ops()
            comp.notes["moe"] = MARLIN_VIEW_NOTE + (f"; in torch too: {', '.join(ops)}" if ops else "")
        return moe
    if want == "sglang.triton":
        comp.stand_in("moe", "sglang.triton", ours, "SGLang's Triton W4A16 (the method it picks on ROCm, not on CUDA) "
                      "is not wired into the forward; moe_int4 times it beside ours per n")
        return None
    comp.ran["moe"] = ours
    return None


def apply(fwd, comp: Composition):
    """`fwd` (not modified) as the deployment runs it: a shallow copy whose decode attention and experts are the
    composition's (what the plain decode step and the bare forward run)."""
    out = copy.copy(fwd)
    if comp.decode is not None:
        out.ops = dataclasses.replace(fwd.ops, mla=comp.decode, mla_batch=comp.decode_batch)
    if comp.moe is not None:
        out.moe_fn = comp.moe
    return out


def derived(comp: Composition, out: dict) -> dict:
    """A cycle case's figures as the deployment runs them: what ran per part and the stand-ins; the plain decode step
    with the host work the backend does before each decode replay (FlashInfer's plan()) added, said so."""
    extra = {"deployment": comp.params(), "attention_ran": comp.ran.get("verify attention", out.get("attention_ran"))}
    plan = comp.host.get("decode")
    if plan is not None:
        from verifybench.harness.engines import flashinfer

        host_ms = flashinfer.plan_host_us(plan) / 1e3
        extra.update(decode_ms=out["decode_ms"] + host_ms, decode_graph_ms=out["decode_ms"], decode_plan_host_ms=host_ms)
    return extra
