"""SGLang's own Triton kernels, called as its attention backend calls them: the extend (prefill) kernel that its
Triton backend runs for target verify with MLA, with the tiles its launcher picks for a given compute capability.

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
    d = t // b
    device = q.device
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
