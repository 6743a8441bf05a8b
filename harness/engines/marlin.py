"""SGLang's Marlin W4A16 MoE (what it serves compressed-tensors INT4 experts with on CUDA), called the way
fused_marlin_moe calls it, from the installed SGLang's JIT kernels (tvm-ffi + nvcc: built on first use, CUDA only).

SGLang 0.5.10.post1's CompressedTensorsConfig.get_moe_scheme returns CompressedTensorsWNA16MoE on CUDA ("Using
CompressedTensorsWNA16MarlinMoEMethod"): its process_weights_after_loading repacks the loaded checkpoint for Marlin
and its apply_weights calls fused_marlin_moe. The moe_int4 row: SGLang's own process_weights_after_loading repacks our
weights once, outside the timed call, and run() makes fused_marlin_moe's calls. The forward (forward_moe): the same
calls over its own random weights viewed in Marlin's layout (forward_view), the block alignment inside each call.
sgl-kernel's ops on that path (the block alignment, silu_and_mul, moe_sum_reduce) are not in the pure-Python wheel:
the alignment runs as one Triton launch of ours on its contract (sync-free: harness/engines/sglang.py,
kernels/common/moe_align.py), the other two in torch unless a real sgl-kernel is importable. No vLLM fallback.
"""
from __future__ import annotations

import functools
import math
import types

import torch

from verifybench.harness.engines import EngineMissing, engine_call, import_kernel_module, label
from verifybench.harness.measure.timing.runner import say_once

GEMM_MODULE = "sglang.jit_kernel.moe_wna16_marlin"
REPACK_MODULE = "sglang.jit_kernel.gptq_marlin_repack"
SCHEME_MODULE = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe"
# the release whose fused_marlin_moe run() follows call by call (tests hold the installed one to it)
MARLIN_MIRRORS = "sglang 0.5.10.post1"
NUM_BITS = 4
BLOCK_SIZES_M = (8, 16, 32, 48, 64)  # fused_marlin_moe's candidates, in its order
CPU_REASON = "its Marlin MoE needs a CUDA GPU: the JIT kernels build with nvcc"
# Marlin's error against the fp32 reference is its own numerics, not the adapter's: it multiplies each INT4 weight by
# its scale in bf16 (7 mantissa bits; our kernel dequantizes in fp16) and, with atomic add (sm_90 and later), adds
# its split-K partial sums into the bf16 output. Emulated in torch (bf16 dequant, 1-16 bf16 partial sums, bf16
# intermediates) that gives 5e-3 to 1e-2 at K2.5's shape and n = 1; measured on an H100, 6e-3 to 1.08e-2 (the most at
# n = 1, where it splits K the most). A wrong routing (experts shifted by one) gives 1.34: 2e-2 still tells them apart.
TOLERANCE = 2e-2


def block_size_m(tokens: int, topk: int, experts: int) -> int:
    """fused_marlin_moe's block_size_m: the first of 8/16/32/48/64 with tokens * topk / experts / bm < 0.9 (64
    when none is): 8 for Kimi-K2.5 TP8 (384 experts, top-8) up to 345 tokens."""
    for bm in BLOCK_SIZES_M:
        if tokens * topk / experts / bm < 0.9:
            break
    return bm


def use_atomic_add(dtype: torch.dtype, device) -> bool:
    """fused_marlin_moe's choice: atomic adds for fp16 activations or a GPU of capability major >= 9."""
    return dtype == torch.half or torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def uint4b8() -> object:
    """The weight type fused_marlin_moe passes (get_scalar_type(4, has_zp=False)): sgl-kernel's scalar_types.uint4b8
    where a real sgl-kernel imports; otherwise an object with the one field the JIT wrapper reads, .id, computed as
    jit_kernel/include/sgl_kernel/scalar_type.hpp's ScalarType::uint(4, 8).id() packs it (fields in constructor order:
    exponent 8 bits, mantissa 8, signed 1, bias 32, finite_values_only 1, nan_repr 8; nan_repr = NAN_IEEE_754 = 1)."""
    try:
        from sgl_kernel.scalar_type import scalar_types

        return scalar_types.uint4b8
    except ImportError:
        pass
    fields = ((0, 8), (NUM_BITS, 8), (0, 1), (8, 32), (0, 1), (1, 8))  # (value, width): uint(4, bias 8)
    uid, offset = 0, 0
    for value, width in fields:
        uid |= (value & ((1 << width) - 1)) << offset
        offset += width
    return types.SimpleNamespace(id=uid, name="uint4b8")


def checkpoint_layout(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our INT4 experts (packed int32 [E, N, K/8], nibble i of word w = q(k = 8w + i) + 8; scales [E, N, K/group])
    in the layout SGLang's loader holds a compressed-tensors pack-quantized checkpoint in before the Marlin repack:
    weight_packed int32 [E, K/8, N] and weight_scale [E, K/group, N] (CompressedTensorsWNA16MoE.create_weights, the
    loader transposing each expert's [N, K/8] tensor). The checkpoint packs q + 8 eight to a word along K, low
    nibble first, as ours does (compressed_tensors' pack_to_int32; tests/engines/test_marlin.py holds both)."""
    if packed.dtype != torch.int32 or packed.dim() != 3:
        raise ValueError(f"packed must be int32 [E, N, K/8], got {packed.dtype} {tuple(packed.shape)}")
    if scales.dim() != 3 or scales.shape[:2] != packed.shape[:2]:
        raise ValueError(f"scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}")
    return packed.transpose(1, 2).contiguous(), scales.transpose(1, 2).contiguous()


def _scheme(group_size: int):
    """A CompressedTensorsWNA16MoE as the Kimi-K2.5 config builds it (4 bits, group strategy, symmetric, no act
    order), without its config object: only the fields process_weights_after_loading reads."""
    module = import_kernel_module("sglang", SCHEME_MODULE)
    scheme = object.__new__(module.CompressedTensorsWNA16MoE)
    scheme.num_bits, scheme.packed_factor = NUM_BITS, 32 // NUM_BITS
    scheme.strategy, scheme.group_size, scheme.actorder, scheme.is_k_full = "group", group_size, None, True
    return scheme


def loaded_layer(w13p, w13s, w2p, w2s, dtype: torch.dtype) -> torch.nn.Module:
    """A layer holding our weights as SGLang's loader leaves them (checkpoint_layout; scales in the activations'
    dtype, params_dtype in SGLang), before process_weights_after_loading: the parameters create_weights registers."""
    layer = torch.nn.Module()
    (w13, s13), (w2, s2) = checkpoint_layout(w13p, w13s), checkpoint_layout(w2p, w2s)
    e = w13.shape[0]
    tensors = {"w13_weight_packed": w13, "w2_weight_packed": w2, "w13_weight_scale": s13.to(dtype),
               "w2_weight_scale": s2.to(dtype),
               "w13_weight_g_idx": torch.empty(e, 0, dtype=torch.int32, device=w13.device),
               "w2_weight_g_idx": torch.empty(e, 0, dtype=torch.int32, device=w13.device)}
    for name, t in tensors.items():
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return layer


@engine_call("sglang")
def marlin_layer(w13p, w13s, w2p, w2s, group_size: int, dtype: torch.dtype) -> torch.nn.Module:
    """Our layer repacked for Marlin by SGLang's own CompressedTensorsWNA16MoE.process_weights_after_loading
    (gptq_marlin_moe_repack over the JIT gptq_marlin_repack, marlin_moe_permute_scales): the module apply_weights
    reads (w13/w2_weight_packed in Marlin tiles, permuted scales, empty g_idx / sort indices)."""
    _need_cuda(w13p)
    import_kernel_module("sglang", REPACK_MODULE)
    layer = loaded_layer(w13p, w13s, w2p, w2s, dtype)
    _scheme(group_size).process_weights_after_loading(layer)
    return layer


def _need_cuda(t: torch.Tensor) -> None:
    """The one-line skip where the tensors are not on a GPU (the JIT build and its kernels need CUDA)."""
    if not t.is_cuda:
        raise EngineMissing(f"{label('sglang')}: {CPU_REASON}")


@functools.cache  # a failed import is not cached by Python: looked up once, not once per layer of a forward
def _sgl_kernel_op(name: str):
    """sgl-kernel's `name` where a real sgl-kernel is installed (its op registered with torch), else None."""
    try:
        import sgl_kernel

        return getattr(sgl_kernel, name) if hasattr(torch.ops.sgl_kernel, name) else None
    except (ImportError, AttributeError, RuntimeError):
        return None


def torch_ops() -> list[str]:
    """The steps of fused_marlin_moe that run in torch here because sgl-kernel is not installed."""
    return [name for name in ("silu_and_mul", "moe_sum_reduce") if _sgl_kernel_op(name) is None]


@engine_call("sglang")
def moe_marlin(x, layer, topk_weights, topk_ids, align_in_call: bool = False):
    """The calls SGLang's fused_marlin_moe makes for one layer under plain TP (every expert local: no expert map, EP
    off; routed scaling 1), its per-input setup done once here: returns run() -> [M, H] in x's dtype, run.info
    (block_size_m, use_atomic_add, the steps run in torch, where the alignment ran) and run.gemms() (each GEMM
    alone).

    layer: marlin_layer's, or forward_view's (anything with the attributes apply_weights reads). Setup:
    block_size_m by fused_marlin_moe's rule; the block alignment for it (align_block_size: SGLang's
    moe_align_block_size contract in one Triton launch of ours, where SGLang runs an sgl-kernel op), here, outside
    the timed call (the moe_int4 row), or with align_in_call inside run() on the ids as they are then (the forward:
    its router computes them inside the graph). run(), as fused_marlin_moe: the zeroed workspace and the
    intermediate caches; the gate_up GEMM (moe_wna16_marlin_gemm, uint4b8, fp32 reduce, no topk weights);
    silu_and_mul; the down GEMM over M * topk rows with the topk weights multiplied in; moe_sum_reduce over top-k
    into the output."""
    from verifybench.harness.engines.sglang import align_block_size, align_capacity

    _need_cuda(x)
    gemm = import_kernel_module("sglang", GEMM_MODULE).moe_wna16_marlin_gemm
    w1, w2 = layer.w13_weight_packed, layer.w2_weight_packed
    m, k = x.shape
    e, n = w1.shape[0], w2.shape[1] * 16  # n: the intermediate size per expert, as fused_marlin_moe reads it
    topk = topk_ids.shape[1]
    if k != w1.shape[1] * 16 or k != w2.shape[2] // (NUM_BITS // 2):
        raise ValueError(f"x's hidden size {k} does not match the Marlin weights {tuple(w1.shape)}, {tuple(w2.shape)}")
    bm = block_size_m(m, topk, e)
    aligned = None if align_in_call else align_block_size(topk_ids, bm, e)
    workspace_size = min((max(2 * n, k) // 64) * (align_capacity(m * topk, bm, e) // bm),
                         torch.cuda.get_device_properties(x.device).multi_processor_count * 4)
    atomic = use_atomic_add(x.dtype, x.device)
    wtype = uint4b8()
    silu_and_mul, moe_sum_reduce = _sgl_kernel_op("silu_and_mul"), _sgl_kernel_op("moe_sum_reduce")

    def ids_aligned():  # made once here, or in the call on the ids as they are then (align_in_call)
        return aligned if aligned is not None else align_block_size(topk_ids, bm, e)

    def buffers():  # fused_marlin_moe's per-call state: the zeroed workspace and the intermediate caches
        cache13 = torch.empty(m * topk * max(2 * n, k), device=x.device, dtype=x.dtype)
        return (torch.zeros(workspace_size, dtype=torch.int, device=x.device),
                torch.empty(m * topk, n, device=x.device, dtype=x.dtype), cache13)

    def gate_up(aligned_ids, workspace, cache13):
        cache1 = cache13[:m * topk * 2 * n].view(-1, 2 * n)
        return gemm(x, cache1, w1, None, layer.w13_weight_scale, None, None, layer.w13_weight_g_idx,
                    layer.w13_g_idx_sort_indices, top_k=topk, mul_topk_weights=False, size_m=m, size_n=2 * n,
                    size_k=k, **common(aligned_ids, workspace))

    def down(aligned_ids, workspace, cache2, cache13):
        cache3 = cache13[:m * topk * k].view(-1, k)  # aliases cache1, as in SGLang: read before written
        return gemm(cache2, cache3, w2, None, layer.w2_weight_scale, None, None, layer.w2_weight_g_idx,
                    layer.w2_g_idx_sort_indices, top_k=1, mul_topk_weights=True, size_m=m * topk, size_n=k,
                    size_k=n, **common(aligned_ids, workspace)).view(-1, topk, k)

    def common(aligned_ids, workspace) -> dict:
        sorted_ids, expert_ids, post_padded = aligned_ids
        return dict(workspace=workspace, sorted_token_ids=sorted_ids, expert_ids=expert_ids,
                    num_tokens_post_padded=post_padded, topk_weights=topk_weights, moe_block_size=bm, is_ep=False,
                    b_q_type=wtype, is_k_full=True, use_atomic_add=atomic, use_fp32_reduce=True, is_zp_float=False)

    def run():
        aligned_ids = ids_aligned()
        workspace, cache2, cache13 = buffers()
        cache1 = gate_up(aligned_ids, workspace, cache13)
        if silu_and_mul is not None:
            silu_and_mul(cache1.view(-1, 2 * n), cache2)
        else:
            cache2.copy_(torch.nn.functional.silu(cache1[:, :n]) * cache1[:, n:])
        cache3 = down(aligned_ids, workspace, cache2, cache13)
        out = torch.empty_like(x)
        if moe_sum_reduce is not None:
            moe_sum_reduce(cache3, out, 1.0)
        else:
            torch.sum(cache3, dim=1, out=out)
        return out

    def gemms() -> dict:
        """Each Marlin GEMM alone on state made once here (the alignment of the ids as they are now): what the
        layer costs without the steps around them, which SGLang runs as sgl-kernel ops (timed by marlin_check)."""
        aligned_ids = ids_aligned()
        workspace, cache2, cache13 = buffers()  # the GEMMs leave the workspace zeroed, as SGLang's two calls share it
        return {"gate_up": lambda: gate_up(aligned_ids, workspace, cache13),
                "down": lambda: down(aligned_ids, workspace, cache2, cache13)}

    run.gemms = gemms
    run.info = {"block_size_m": bm, "use_atomic_add": atomic, "torch_ops": torch_ops(),
                "alignment": "in the call" if align_in_call else "outside the timed call"}
    return run


def forward_view(w13p, w13s, w2p, w2s) -> types.SimpleNamespace:
    """The forward's INT4 experts (ours: w13p int32 [E, 2I, H/8], w13s [E, 2I, H/group], w2p [E, H, I/8], w2s [E, H,
    I/group]) viewed, without a copy, as the tensors a Marlin layer holds after process_weights_after_loading:
    w13_weight_packed [E, H/16, 2 * 2I] and w2_weight_packed [E, I/16, 2H] (gptq_marlin_repack's [K/16, N * 16/8] per
    expert for 4 bits), w13_weight_scale [E, H/group, 2I] and w2_weight_scale [E, I/group, H]
    (marlin_moe_permute_scales keeps [E, K/group, N]), empty int32 [E, 0] g_idx and sort indices (no act order).

    Valid for timing, not for values: the forward's nibbles are random and its scales constant, so read in Marlin's
    tiles they are as random a layer as in ours: the same bytes, read by the same loads (Marlin's loads and
    dequantisation do not depend on the values). What these views compute has no reference; Marlin is checked on a
    layer of its own that SGLang's loader step repacked (check_against_reference)."""
    e, two_i, h8 = w13p.shape
    h, inter = h8 * 8, two_i // 2
    if h % 16 or inter % 16:
        raise ValueError(f"Marlin tiles K by 16: hidden {h} and intermediate {inter} must be multiples of 16")
    empty = torch.empty(e, 0, dtype=torch.int32, device=w13p.device)
    return types.SimpleNamespace(
        w13_weight_packed=w13p.view(e, h // 16, 2 * two_i), w2_weight_packed=w2p.view(e, inter // 16, 2 * h),
        w13_weight_scale=w13s.view(e, -1, two_i), w2_weight_scale=w2s.view(e, -1, h), w13_weight_g_idx=empty,
        w2_weight_g_idx=empty, w13_g_idx_sort_indices=empty, w2_g_idx_sort_indices=empty)


def forward_moe(x, w13p, w13s, w2p, w2s, topk_weights, topk_ids):
    """The forward's moe_fn: fused_marlin_moe's calls over forward_view's views, the block alignment in the call
    (sync-free, so the forward stays one CUDA graph with its router's ids computed inside it)."""
    return moe_marlin(x, forward_view(w13p, w13s, w2p, w2s), topk_weights, topk_ids, align_in_call=True)()


BUILD_LINE = "building SGLang's Marlin MoE JIT kernels (first use: several minutes of nvcc; cached after)"


@engine_call("sglang")
def build(dtype: torch.dtype) -> None:
    """SGLang's JIT modules the Marlin path calls (gptq_marlin_repack, moe_wna16_marlin for `dtype`) built now, with
    a line first: a first use builds them with nvcc (~6 minutes for the GEMM on one core; tvm-ffi caches the build),
    which would otherwise look like a hang inside a case's setup or check. EngineMissing where they cannot be."""
    if not torch.cuda.is_available():
        raise EngineMissing(f"{label('sglang')}: {CPU_REASON}")
    say_once(BUILD_LINE)
    import_kernel_module("sglang", REPACK_MODULE)._jit_gptq_marlin_repack_module()
    import_kernel_module("sglang", GEMM_MODULE)._jit_moe_wna16_marlin_module(dtype)


CHECK_MIN_EXPERTS = 16


def check_experts(tokens: int, topk: int, experts: int) -> int:
    """The fewest experts (at least CHECK_MIN_EXPERTS, at most `experts`) at which fused_marlin_moe picks the
    block_size_m it picks for `experts` at `tokens`: a check layer small enough to fit beside a whole forward that
    still runs the forward's kernel instance."""
    want = block_size_m(tokens, topk, experts)
    return next(e for e in range(min(max(CHECK_MIN_EXPERTS, topk), experts), experts + 1)
                if block_size_m(tokens, topk, e) == want)


def random_layer(e: int, h: int, inter: int, group: int, device, seed: int = 0) -> tuple:
    """Random INT4 experts in our layout (uniform nibbles; scales that keep each projection at unit variance):
    (w13_packed, w13_scales, w2_packed, w2_scales)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def linear(n, k):
        packed = torch.randint(-(1 << 31), (1 << 31) - 1, (e, n, k // 8), dtype=torch.int32, device=device,
                               generator=gen)
        std = 1.0 / (4.6 * math.sqrt(k))  # (nibble - 8) has std 4.6
        return packed, (std * (0.5 + torch.rand(e, n, k // group, device=device, generator=gen))).to(torch.bfloat16)

    return (*linear(2 * inter, h), *linear(h, inter))


@engine_call("sglang")
def check_against_reference(h: int, inter: int, group: int, topk: int, experts: int, tokens, dtype: torch.dtype,
                            device) -> tuple[bool, str]:
    """The Marlin path the forward runs (align_in_call) against our fp32 reference at the forward's layer shape and
    token counts, on fresh random weights repacked by SGLang's own loader step (marlin_layer), with
    check_experts(...) experts in place of the forward's `experts` (one more layer, small, beside the whole forward).
    (ok, the detail in one line)."""
    from verifybench.harness.measure.timing.runner import rel_error
    from verifybench.kernels.moe_int4 import reference as moe

    e = max(check_experts(m, topk, experts) for m in tokens)
    ours = random_layer(e, h, inter, group, device)
    layer = marlin_layer(*ours, group, dtype)
    errs = []
    for m in tokens:
        x = torch.randn(m, h, device=device).to(dtype)
        tw, ids = moe.route_uniform(m, e, topk, seed=m, device=device)
        run = moe_marlin(x, layer, tw, ids, align_in_call=True)
        errs.append((m, run.info["block_size_m"], rel_error(run().float(), moe.reference_moe_w4a16(x.float(), *ours,
                                                                                                  tw, ids))))
    ok = all(err <= TOLERANCE for *_, err in errs)
    said = ", ".join(f"n {m} (block_size_m {bm}) rel_err {err:.2e}" for m, bm, err in errs)
    return ok, (f"sglang.marlin vs fp32 reference at H {h}, I {inter}, group {group}, top-{topk}, {e} experts "
                f"repacked by SGLang's loader step: {said}")


def describe(info: dict) -> str:
    """A Marlin row's label: 'sglang 0.5.10.post1 Marlin MoE (JIT moe_wna16_marlin, block_size_m 8, atomic add on,
    fp32 reduce; alignment (ours, one launch) outside the timed call; in torch: silu_and_mul, moe_sum_reduce)'."""
    ops = info.get("torch_ops") or []
    return (f"{label('sglang')} Marlin MoE (JIT moe_wna16_marlin, block_size_m {info['block_size_m']}, atomic add "
            f"{'on' if info['use_atomic_add'] else 'off'}, fp32 reduce; alignment (ours, one launch) "
            f"{info.get('alignment', 'outside the timed call')}"
            + (f"; in torch: {', '.join(ops)}" if ops else "; sgl-kernel silu_and_mul, moe_sum_reduce") + ")")
