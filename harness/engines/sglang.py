"""SGLang's own Triton kernels, called as its attention backend calls them: the extend (prefill) kernel that its
Triton backend runs for target verify with MLA, with the tiles its launcher picks for a given compute capability;
the split-KV decode kernel that backend runs for decode with MLA.

Imported from the installed `sglang` package (its Triton kernels ship in the pure-Python wheel); nothing is copied.
"""
from __future__ import annotations

import contextlib
import math

import torch

from verifybench.harness.engines import EngineMissing, engine_call, import_kernel_module

FOLLOWS = "sglang 0.5.10.post1"  # the release whose calls this adapter makes (an engine skip line names it)
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


@engine_call("sglang")
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


@engine_call("sglang")
def extend_compile(cc: int, heads: int = 8, lq: int = 576, lv: int = 512) -> tuple:
    """(kernel, argument types, constexprs, options) of the installed SGLang's extend kernel as extend_verify launches
    it on sm_<cc> (its tiles for that capability; a custom mask, causal, the prefix's mask skipped as the launcher's
    default has it; no sliding window, logit cap, sinks or temperature), for compiling it without a GPU
    (kernels/common/compiler). Types as that launch gives them: q [T, heads, lq], k/v of the tree tokens [T, 1, lq /
    lv], out [T, heads, lv], the cache's k/v buffer [rows, 1, lq] and its first lv values."""
    module = extend_module()
    pick = getattr(module, "_get_block_sizes_for_extend_attention", None)
    kernel = getattr(module, "_fwd_kernel", None)
    if pick is None or kernel is None:
        raise EngineMissing(f"{EXTEND_MODULE} lacks _get_block_sizes_for_extend_attention or _fwd_kernel")
    with capability(module, cc):
        dmodel, dpe, dv, block_m, block_n, num_warps = pick(lq, lv)
    types = {name: "*bf16" for name in ("Q_Extend", "K_Extend", "V_Extend", "O_Extend", "K_Buffer", "V_Buffer")}
    types |= {"qo_indptr": "*i32", "kv_indptr": "*i32", "kv_indices": "*i64", "mask_ptr": "*i1", "mask_indptr": "*i32",
              "sm_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32", "kv_group_num": "i32"}
    strides = dict(stride_qbs=heads * lq, stride_qh=lq, stride_kbs=lq, stride_kh=lq, stride_vbs=lv, stride_vh=lv,
                   stride_obs=heads * lv, stride_oh=lv, stride_buf_kbs=lq, stride_buf_kh=lq, stride_buf_vbs=lq,
                   stride_buf_vh=lq)
    types |= {name: "16:i32" if v % 16 == 0 else "i32" for name, v in strides.items()}
    consts = dict(sink_ptr=None, window_kv_offset_ptr=None, SLIDING_WINDOW_SIZE=-1, logit_cap=0.0,
                  xai_temperature_len=-1, Lq=lq, Lv=lv, BLOCK_DMODEL=dmodel, BLOCK_DPE=dpe, BLOCK_DV=dv,
                  BLOCK_M=block_m, BLOCK_N=block_n, USE_CUSTOM_MASK=True, IS_CAUSAL=True, SKIP_PREFIX_CUSTOM_MASK=True,
                  STORE_TRANSPOSE=False, HAS_SINK=False)
    return kernel, types, consts, {"num_warps": num_warps, "num_stages": 1}


def extend_compiled(cc: int) -> dict:
    """compiler.compiled_resources of SGLang's extend kernel as extend_compile gives it for sm_<cc> (registers,
    stack, shared memory, its loops), compiled without a GPU, in a Python without the interpreter where this one
    runs it (its kernels cannot be compiled)."""
    from triton.runtime.jit import JITFunction

    from verifybench.kernels.common import compiler

    kernel, types, consts, options = extend_compile(cc)
    if not isinstance(kernel, JITFunction):
        return compiler.uninterpreted(__name__, "extend_compiled", cc)
    return compiler.compiled_resources(kernel, types, consts, options, cc)


@engine_call("sglang")
def extend_metadata(starts, prefix_lens, mask) -> dict:
    """What the Triton backend's init_forward_metadata builds once per target-verify forward and every layer shares:
    qo_indptr = cumsum(D) and kv_indptr = cumsum(L_b) (int32), kv_indices the prefix rows (int64), a flat custom mask
    of D x (L_b + D) per request (prefix columns all set) with mask_indptr = cumsum(D * (L_b + D)); and the tree
    tokens' cache rows (each layer's k/v of those tokens are gathered from them). mask: bool [B, D, D] or flat."""
    b = starts.numel()
    d, device = math.isqrt(mask.numel() // b), starts.device
    lens, firsts = prefix_lens.tolist(), starts.tolist()
    kv_indices = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(firsts, lens)]).to(torch.int64)
    tree_rows = torch.cat([torch.arange(s + n, s + n + d, device=device) for s, n in zip(firsts, lens)])

    def indptr(sizes):
        return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=device)

    tree = mask.reshape(b, d, d).to(torch.bool)
    custom_mask = torch.cat([torch.cat([torch.ones(d, n, dtype=torch.bool, device=device), tree[i]], 1).flatten()
                             for i, n in enumerate(lens)])
    return {"d": d, "qo_indptr": indptr([d] * b), "kv_indptr": indptr(lens), "kv_indices": kv_indices,
            "custom_mask": custom_mask, "mask_indptr": indptr([d * (n + d) for n in lens]), "tree_rows": tree_rows}


@engine_call("sglang")
def extend_verify(q, cache, starts, prefix_lens, mask, kv_lora: int, scale: float, cc: int | None = None,
                  metadata: dict | None = None):
    """The call SGLang's Triton backend makes for target verify with MLA (absorbed), its inputs built from ours once,
    outside the timed call: returns run() -> out [heads, T, kv_lora] (a view of the engine's [T, heads, kv_lora]).

    Ours: q [heads, T, DK]; cache [rows, DK], one latent row per token; request b's prefix rows
    [start_b, start_b + L_b), its D tree rows right after; mask bool [B, D, D]. The engine's: q [T, heads, DK]; k/v
    buffers [rows, 1, DK] and their first kv_lora values (one view); the tree tokens' own k/v passed apart; the
    forward's metadata (extend_metadata; pass one to share it across layers, as the backend does: a layer's kernel
    then finds the page table in L2, where the previous layer left it); max_len_extend = D; causal (the custom mask
    decides). cc: the tiles as SGLang picks them on sm_<cc> (None: for this GPU)."""
    module = extend_module()
    heads, t, dk = q.shape
    m = extend_metadata(starts, prefix_lens, mask) if metadata is None else metadata
    k_extend = cache[m["tree_rows"]].view(t, 1, dk).contiguous()
    v_extend = k_extend[..., :kv_lora].contiguous()
    k_buffer = cache.view(-1, 1, dk)
    v_buffer = k_buffer[..., :kv_lora]
    q_engine = q.transpose(0, 1).contiguous()
    out = torch.empty(t, heads, kv_lora, dtype=q.dtype, device=q.device)

    def run():
        with capability(module, cc):
            module.extend_attention_fwd(q_engine, k_extend, v_extend, out, k_buffer, v_buffer, m["qo_indptr"],
                                        m["kv_indptr"], m["kv_indices"], m["custom_mask"], True, m["mask_indptr"],
                                        m["d"], 1.0, 1.0, sm_scale=scale)
        return out.transpose(0, 1)

    return run


DECODE_MODULE = "sglang.srt.layers.attention.triton_ops.decode_attention"
# the backend's max_kv_splits: ServerArgs.triton_attention_num_kv_splits of 0.5.10.post1 (server_args.py; 16 on ROCm)
MAX_KV_SPLITS = 8


def decode_module():
    return import_kernel_module("sglang", DECODE_MODULE)


@engine_call("sglang")
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


@engine_call("sglang")
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


# ---------------------------------------------------------------------------------------------------- MoE (W4A16)

MOE_KERNELS_MODULE = "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels"
MOE_CONFIG_MODULE = "sglang.srt.layers.moe.fused_moe_triton.fused_moe_triton_config"
MOE_SERVER_ARGS_MODULE = "sglang.srt.server_args"
# the release whose fused_experts_impl moe_w4a16 follows call by call (tests hold the installed one to it)
MOE_MIRRORS = "sglang 0.5.10.post1"


def moe_modules():
    """(kernels, config) modules of SGLang's fused-MoE Triton path; EngineMissing where they cannot be imported."""
    return import_kernel_module("sglang", MOE_KERNELS_MODULE), import_kernel_module("sglang", MOE_CONFIG_MODULE)


def w4a16_weights(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our INT4 expert weights (packed int32 [E, N, K/8], nibble i of a word = element 8w + i stored as q + 8;
    scales bf16 [E, N, K/group]) in the layout SGLang's Triton W4A16 MoE reads: uint8 [E, N, K/2] with element k in
    byte k // 2, the low nibble for even k, still q + 8 (the kernel subtracts 8 where no zero points are given);
    scales [E, N, K/group].

    SGLang loads a compressed-tensors checkpoint transposed ([E, K/8, N] int32, [E, K/group, N] scales) and its
    CompressedTensorsWNA16TritonMoE transposes both back and views the words as bytes (little-endian: a word's
    nibbles 0-1 are byte 0). Ours is that checkpoint layout untransposed, so the result is the same bytes: a view,
    no copy (tests/engines/test_engines.py holds it against SGLang's own conversion where that module imports)."""
    if packed.dtype != torch.int32 or packed.dim() != 3 or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous int32 [E, N, K/8], got {packed.dtype} {tuple(packed.shape)}")
    if scales.dim() != 3 or scales.shape[:2] != packed.shape[:2]:
        raise ValueError(f"scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}")
    return packed.view(torch.uint8), scales.contiguous()


def align_capacity(pairs: int, block_size: int, num_experts: int) -> int:
    """The length SGLang's moe_align_block_size wrapper gives sorted_token_ids for `pairs` (token, slot) pairs:
    pairs * block_size while pairs <= num_experts, else pairs + (num_experts + 1) * (block_size - 1)."""
    return pairs * block_size if pairs < num_experts + 1 else pairs + (num_experts + 1) * (block_size - 1)


def align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """SGLang's moe_align_block_size contract (its op is an sgl-kernel CUDA kernel, absent here): on a CUDA tensor one
    Triton launch (kernels/common/moe_align.py), elsewhere its torch reference. The M x topk
    (token, slot) pairs, numbered i = token * topk + slot, grouped by expert (experts in order, pairs of an expert in
    increasing i), each expert's group padded to a multiple of block_size with the fill value M * topk.
    Returns (sorted_token_ids int32 [cap], expert_ids int32 [cdiv(cap, block_size)], num_tokens_post_padded int32
    [1]): cap = align_capacity(M * topk, ...); expert_ids[b] is the expert of block b for the first
    num_tokens_post_padded / block_size blocks and -1 after them (the kernel stops at num_tokens_post_padded).

    No host sync and every shape fixed by M, topk, block_size and num_experts alone, so it runs inside a CUDA graph
    on ids the graph's router computes."""
    from verifybench.kernels.common import moe_align

    run = moe_align.moe_align_block_size if topk_ids.is_cuda else moe_align.reference
    return run(topk_ids, block_size, num_experts, align_capacity(topk_ids.numel(), block_size, num_experts))


def _default_server_args(server_args_module):
    """A ServerArgs holding every field's default, built without its __post_init__ (which resolves a model):
    SGLang's config lookup reads two of its flags (deterministic inference, fused sum-all-reduce), both off by
    default."""
    import dataclasses

    cls = server_args_module.ServerArgs
    args = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
    return args


@contextlib.contextmanager
def default_server_args():
    """Inside the block SGLang's global server args are the defaults (where none are set, as outside a server)."""
    module = import_kernel_module("sglang", MOE_SERVER_ARGS_MODULE)
    if module._global_server_args is not None:
        yield
        return
    module._global_server_args = _default_server_args(module)
    try:
        yield
    finally:
        module._global_server_args = None


@contextlib.contextmanager
def _device_name(config_module, name: str):
    """SGLang names its tuned-config files by the GPU's name and reads it from torch; without a GPU it has none, so
    the lookup is made under `name` (no such file: SGLang's default config, as on any GPU without a tuned file)."""
    saved = config_module.get_device_name
    config_module.get_device_name = lambda device_id=0: saved(device_id) or name
    try:
        yield
    finally:
        config_module.get_device_name = saved


@engine_call("sglang")
def moe_w4a16_config(tokens: int, experts: int, hidden: int, inter: int, topk: int, group_size: int) -> dict:
    """What fused_experts_impl gets from try_get_optimal_moe_config for a W4A16 layer of this shape and token count
    on this GPU: {"config", "down_config" (None: the up config serves both), "use_tma", "source"} (source: the file
    it read, or SGLang's default)."""
    kernels, config_module = moe_modules()
    w1_shape, w2_shape = (experts, 2 * inter, hidden // 2), (experts, hidden, inter // 2)
    dtype = config_module.get_config_dtype_str(torch.bfloat16, use_int4_w4a16=True)
    with default_server_args(), _device_name(config_module, "cpu"):
        cfg, (down, _) = config_module.try_get_optimal_moe_config(
            w1_shape, w2_shape, topk, dtype, tokens, block_shape=[0, group_size], per_channel_quant=False,
            return_down_config=True)
        name = config_module.get_config_file_name(experts, w2_shape[2], dtype, [0, group_size])
        found = config_module.get_moe_configs(experts, w2_shape[2], dtype, 0, group_size) is not None
    use_tma = bool(kernels.support_tensor_descriptor() and down is not None and down.pop("USE_TMA", False))
    return {"config": dict(cfg), "down_config": down, "use_tma": use_tma,
            "source": f"SGLang's {'tuned file ' + name if found else 'default config (no file ' + name + ')'}"}


@engine_call("sglang")
def moe_w4a16(x, w13, w13_scales, w2, w2_scales, topk_weights, topk_ids, group_size: int, picked: dict):
    """The calls SGLang's fused_experts_impl makes for a W4A16 layer with --moe-runner-backend triton and plain TP
    (every expert local, so no expert filtering, no combine fusion, routed scaling 1), its per-input setup done
    here once, outside the timed call: returns run() -> [M, H] in x's dtype.

    w13/w2, scales: SGLang's layout (w4a16_weights). picked: moe_w4a16_config's. Setup: the block alignment for the
    up config's BLOCK_SIZE_M (align_block_size: ours, where SGLang runs an sgl-kernel op, so its time is not in
    the row). run(): the gate_up GEMM (invoke_fused_moe_kernel -> fused_moe_kernel_gptq_awq) into SGLang's shared
    intermediate buffer; SiLU(gate) * up in torch (SGLang calls sgl-kernel's silu_and_mul there); the down GEMM with
    the routed weights; the sum over top-k as SGLang does it for <= 32 tokens (torch.sum, which SGLang wraps in
    torch.compile; topk 2: torch.add; topk 1: the down GEMM writes the output)."""
    import triton.language as tl

    kernels, _ = moe_modules()
    m, hidden = x.shape
    e, n, _ = w13.shape
    topk = topk_ids.shape[1]
    cfg, down, use_tma = picked["config"], picked["down_config"], picked["use_tma"]
    block_shape = [0, group_size]
    sorted_ids, expert_ids, post_padded = align_block_size(topk_ids, cfg["BLOCK_SIZE_M"], e)
    compute_type = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    padded = min(m * topk, e + 1) * (cfg["BLOCK_SIZE_M"] - 1) if use_tma else 0
    total = m * topk + padded

    def run():
        cache = torch.empty(total * max(n, hidden), device=x.device, dtype=x.dtype)
        cache3 = cache[:m * topk * hidden].view(m, topk, hidden)  # aliases cache1, as in SGLang: read before written
        cache1 = cache[:total * n].view(total, n)
        cache2 = torch.empty(total, n // 2, device=x.device, dtype=x.dtype)
        out = torch.empty_like(x)
        kernels.invoke_fused_moe_kernel(
            x, w13, None, cache1, None, w13_scales, None, topk_weights, topk_ids, sorted_ids, expert_ids,
            post_padded, False, topk, cfg, compute_type=compute_type, use_fp8_w8a8=False, use_int8_w8a8=False,
            use_int8_w8a16=False, use_int4_w4a16=True, per_channel_quant=False, block_shape=block_shape,
            c_sorted=use_tma, filter_expert=False)
        gate_up = cache1.view(-1, n)
        cache2.copy_(torch.nn.functional.silu(gate_up[..., :n // 2]) * gate_up[..., n // 2:])
        kernels.invoke_fused_moe_kernel(
            cache2, w2, None, cache3 if topk != 1 else out.unsqueeze(0), None, w2_scales, None, topk_weights,
            topk_ids, sorted_ids, expert_ids, post_padded, True, 1, down or cfg, compute_type=compute_type,
            use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=True,
            per_channel_quant=False, block_shape=block_shape, a_use_tma=use_tma, b_use_tma=use_tma,
            filter_expert=False, fuse_sum_all_reduce=False, router_topk=topk)
        if topk == 2:
            torch.add(cache3[:, 0], cache3[:, 1], out=out)
        elif topk > 2:
            torch.sum(cache3, dim=1, out=out)
        return out

    return run
