"""SGLang's own Triton kernels, called as its attention backend calls them: the extend (prefill) kernel that its
Triton backend runs for target verify with MLA, with the tiles its launcher picks for a given compute capability;
the split-KV decode kernel that backend runs for decode with MLA.

Imported from the installed `sglang` package (its Triton kernels ship in the pure-Python wheel); nothing is copied.
"""
from __future__ import annotations

import contextlib

import torch

from verifybench.harness.engines import EngineMissing, import_kernel_module

EXTEND_MODULE = "sglang.srt.layers.attention.triton_ops.extend_attention"


def extend_module():
    return import_kernel_module("sglang", EXTEND_MODULE)


@contextlib.contextmanager
def capability(module, cc: int | None):
    """Inside the block the module's launcher picks its tiles as on sm_<cc> (None: as on this machine). SGLang reads
    the capability once at import into module globals; the kernel still compiles for the GPU it runs on, so an H100
    runs the tiles an sm_120 card would get."""
    if cc is None:
        yield
        return
    saved = {k: getattr(module, k) for k in ("_is_cuda", "CUDA_CAPABILITY") if hasattr(module, k)}
    module._is_cuda, module.CUDA_CAPABILITY = True, divmod(cc, 10)
    try:
        yield
    finally:
        for k in ("_is_cuda", "CUDA_CAPABILITY"):
            if k in saved:
                setattr(module, k, saved[k])
            else:
                delattr(module, k)


def extend_tiles(cc: int | None, lq: int = 576, lv: int = 512) -> dict:
    """The installed SGLang's extend tiles for a head of Lq / Lv on sm_<cc>, as its launcher picks them:
    {block_rows, block_keys, num_warps}."""
    module = extend_module()
    pick = getattr(module, "_get_block_sizes_for_extend_attention", None)
    if pick is None:
        raise EngineMissing(f"{EXTEND_MODULE} has no _get_block_sizes_for_extend_attention: its tiles cannot be read")
    with capability(module, cc):
        *_, block_m, block_n, num_warps = pick(lq, lv)
    return {"block_rows": block_m, "block_keys": block_n, "num_warps": num_warps}


def extend_verify(q, cache, starts, prefix_lens, mask, kv_lora: int, scale: float, cc: int | None = None):
    """The call SGLang's Triton backend makes for target verify with MLA (absorbed), its inputs built from ours once,
    outside the timed call: returns run() -> out [heads, T, kv_lora] (a view of the engine's [T, heads, kv_lora]).

    Ours: q [heads, T, DK]; cache [rows, DK], one latent row per token; request b's prefix rows
    [start_b, start_b + L_b), its D tree rows right after; mask bool [B, D, D]. The engine's: q [T, heads, DK]; k/v
    buffers [rows, 1, DK] and their first kv_lora values (one view); kv_indptr = cumsum(L_b) with kv_indices the
    prefix rows (int64); the tree tokens' own k/v passed apart; a flat custom mask of D x (L_b + D) per request
    (prefix columns all set) with mask_indptr = cumsum(D * (L_b + D)); max_len_extend = D; causal (the custom mask
    decides). cc: the tiles as SGLang picks them on sm_<cc> (None: for this GPU)."""
    module = extend_module()
    heads, t, dk = q.shape
    b = starts.numel()
    d, device = t // b, q.device
    lens, firsts = prefix_lens.tolist(), starts.tolist()
    kv_indices = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(firsts, lens)]).to(torch.int64)
    tree_rows = torch.cat([torch.arange(s + n, s + n + d, device=device) for s, n in zip(firsts, lens)])
    k_extend = cache[tree_rows].view(t, 1, dk).contiguous()
    v_extend = k_extend[..., :kv_lora].contiguous()
    k_buffer = cache.view(-1, 1, dk)
    v_buffer = k_buffer[..., :kv_lora]

    def indptr(sizes):
        return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=device)

    qo_indptr, kv_indptr, mask_indptr = indptr([d] * b), indptr(lens), indptr([d * (n + d) for n in lens])
    tree = mask.reshape(b, d, d).to(torch.bool)
    custom_mask = torch.cat([torch.cat([torch.ones(d, n, dtype=torch.bool, device=device), tree[i]], 1).flatten()
                             for i, n in enumerate(lens)])
    q_engine = q.transpose(0, 1).contiguous()
    out = torch.empty(t, heads, kv_lora, dtype=q.dtype, device=device)

    def run():
        with capability(module, cc):
            module.extend_attention_fwd(q_engine, k_extend, v_extend, out, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                        kv_indices, custom_mask, True, mask_indptr, d, 1.0, 1.0, sm_scale=scale)
        return out.transpose(0, 1)

    return run


DECODE_MODULE = "sglang.srt.layers.attention.triton_ops.decode_attention"
# the backend's max_kv_splits: ServerArgs.triton_attention_num_kv_splits of 0.5.10.post1 (server_args.py; 16 on ROCm)
MAX_KV_SPLITS = 8


def decode_module():
    return import_kernel_module("sglang", DECODE_MODULE)


def decode_metadata(starts, lens, tokens_per_request: int, heads: int, kv_lora: int,
                    max_kv_splits: int = MAX_KV_SPLITS) -> dict:
    """What the Triton backend's init_forward_metadata builds once per decode forward and every layer shares: per query
    row kv_indptr (int32) and kv_indices (int64, the cache rows it reads), the attn_logits [rows, heads, splits,
    kv_lora] / attn_lse [rows, heads, splits] fp32 workspace, num_kv_splits [rows] int32.

    Request b (starts/lens: [B] tensors) reads rows [start_b, start_b + len_b); its g = tokens_per_request query
    tokens are g rows over the same indices, as the backend lays out the topk tokens of one sequence in draft decode.
    num_kv_splits = max_kv_splits on every row: the backend's get_num_kv_splits fills that where the device reports
    no SMs (the CPU) or SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS is set, and its dynamic rule gives it too for one
    sequence at our GPU shapes (>= 4k keys, <= 8 tokens, <= 16 heads: cdiv(SMs * log2(L / 64), tokens) >= 8 on any
    GPU of >= 64 SMs). That rule lives in triton_backend.py, whose import needs transformers (absent in CI's
    .ci/engines), so it is not called here."""
    device = starts.device
    row_starts = starts.repeat_interleave(tokens_per_request).tolist()
    row_lens = lens.repeat_interleave(tokens_per_request).tolist()
    rows = len(row_lens)
    kv_indices = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(row_starts, row_lens)])
    kv_indptr = torch.tensor([0, *torch.tensor(row_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return {"kv_indptr": kv_indptr, "kv_indices": kv_indices.to(torch.int64), "max_kv_splits": max_kv_splits,
            "attn_logits": torch.empty(rows, heads, max_kv_splits, kv_lora, dtype=torch.float32, device=device),
            "attn_lse": torch.empty(rows, heads, max_kv_splits, dtype=torch.float32, device=device),
            "num_kv_splits": torch.full((rows,), max_kv_splits, dtype=torch.int32, device=device)}


def mla_decode(q, cache, starts, lens, kv_lora: int, scale: float, metadata: dict | None = None):
    """The call SGLang's Triton backend makes for decode with MLA (forward_decode -> decode_attention_fwd), its inputs
    built from ours once, outside the timed call: returns run() -> out [heads, T, kv_lora] (a view of the engine's
    [T, heads, kv_lora]).

    Ours: q [heads, T, DK], T = B * g: request b's g tokens each attend all its rows [start_b, start_b + len_b) of
    cache [rows, DK] (no causal mask, as kernels/mla_decode/). The engine's: q [T, heads, DK]; k_buffer [rows, 1,
    DK] and v_buffer its first kv_lora values (one view, as MLATokenToKVPool.get_value_buffer gives it); o [T,
    heads, kv_lora]; the forward's metadata (decode_metadata; pass one to share it across layers, as the backend
    does); sm_scale = scale, k_scale = v_scale = 1 (no quantized cache), logit_cap 0."""
    module = decode_module()
    heads, t, dk = q.shape
    if t % starts.numel():
        raise ValueError(f"q's {t} tokens are not a whole number per request for {starts.numel()} requests")
    if metadata is None:
        metadata = decode_metadata(starts, lens, t // starts.numel(), heads, kv_lora)
    m = metadata
    q_engine = q.transpose(0, 1).contiguous()
    k_buffer = cache.view(-1, 1, dk)
    v_buffer = k_buffer[..., :kv_lora]
    out = torch.empty(t, heads, kv_lora, dtype=q.dtype, device=q.device)

    def run():
        module.decode_attention_fwd(q_engine, k_buffer, v_buffer, out, m["kv_indptr"], m["kv_indices"],
                                    m["attn_logits"], m["attn_lse"], m["num_kv_splits"], m["max_kv_splits"],
                                    scale, 1.0, 1.0, logit_cap=0.0)
        return out.transpose(0, 1)

    return run
