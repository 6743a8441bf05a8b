"""Fused W4A16 MoE for few tokens (n <= 32) in Triton: `fused_moe_w4a16`, the reference's signature in two CUDA-graph
capturable launches (kernels.py), and the planar weight layout its kernels read.

Weight layout: the kernels read the "planar" nibble order, made once per weight tensor by a repack
(`kernel_weights`, cached; or `repack_planar` at load with prepacked=True): inside each group nibble i of word w
holds k = 32 g + 4 i + w (checkpoint: 32 g + 8 w + i), so each of the 8 nibble planes multiplies 4 consecutive
activations, one vector load. Same shapes and bytes as the checkpoint. Configs and their selection:
configs.py; the int4 products: kernels_dequant.py.
"""
from __future__ import annotations

import weakref

import torch

from verifybench.kernels.common import empty
from verifybench.kernels.common import pdl as _pdl
from verifybench.kernels.moe_int4.reference import PACK, check_moe_inputs, pack_nibbles, unpack_nibbles
from verifybench.kernels.moe_int4.kernels import check_config, interpreting, launches
from verifybench.kernels.moe_int4.configs import default_config, select_config


# ---------------------------------------------------------------------------------------------------- layout

def repack_planar(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """Checkpoint nibble order -> planar: in each group, nibble i of word w holds k = group_size*g + (group/8)*i + w.
    Same shape and dtype; done in chunks of the leading dimension to bound the temporary memory."""
    wpg = group_size // PACK
    out = torch.empty_like(packed)
    flat_in, flat_out = packed.reshape(-1, packed.shape[-1]), out.view(-1, packed.shape[-1])
    step = max(1, (64 << 20) // (packed.shape[-1] * PACK * 4))
    for r in range(0, flat_in.shape[0], step):
        q = unpack_nibbles(flat_in[r:r + step])  # [rows, K] in k order
        rows, k = q.shape
        q = q.reshape(rows, k // group_size, PACK, wpg).transpose(-1, -2)  # [.., g, w, i] = k of plane i, word w
        flat_out[r:r + step] = pack_nibbles(q.reshape(rows, k))
    return out


def checkpoint_from_planar(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of repack_planar: planar nibble order -> checkpoint order (for checking prepacked weights)."""
    wpg = group_size // PACK
    q = unpack_nibbles(packed.reshape(-1, packed.shape[-1]))
    rows, k = q.shape
    q = q.reshape(rows, k // group_size, wpg, PACK).transpose(-1, -2)
    return pack_nibbles(q.reshape(rows, k)).view(packed.shape)


_CACHE: dict[tuple, tuple] = {}


def kernel_weights(packed: torch.Tensor, scales: torch.Tensor,
                   prepacked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors the kernels read: (packed in planar order, scales as int16 bits), contiguous. The planar repack
    runs once per (tensor, version) and is cached until the source tensor is freed (it doubles that tensor's memory
    meanwhile); call it outside any timed region or graph capture (the bench's check and warm-up do). prepacked:
    `packed` is planar already."""
    scale_bits = scales.contiguous().view(torch.int16)
    if prepacked:
        return packed.contiguous(), scale_bits
    key = (id(packed), packed._version)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is packed:
        return hit[1], scale_bits
    repacked = repack_planar(packed.contiguous(), packed.shape[-1] * PACK // scales.shape[-1])
    _CACHE[key] = (weakref.ref(packed), repacked)
    weakref.finalize(packed, _CACHE.pop, key, None)
    return repacked, scale_bits


# ---------------------------------------------------------------------------------------------------- wrapper

def fused_moe_w4a16(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids, *,
                    config: dict | None = None, check_ids: bool = True, prepacked: bool = False) -> torch.Tensor:
    """The reference's signature and result ([M, H] in x's dtype, fp16 or bf16 x), in two Triton launches.

    config (default: select_config(M, device)), completed from default_config(device, M): {"dequant": "half2" |
    "denormal", "gate_up": {"BLOCK_N", "num_warps", "num_stages", "SPLIT_K" (divides H / group; default 1),
    "PREFETCH" (0/1, default 1), "BLOCK_W" (words per step, default min(128 * num_warps, words per split))},
    "down": {"BLOCK_N", "ROW_ITERS", "num_stages", "num_warps" (default topk * I/256)}, "pdl"}. Kernel 1 writes fp32
    partial gate and up sums per split, kernel 2 adds them (fixed order: deterministic, no atomics, no memset) and
    applies SiLU. "pdl": True (sm_90+) lets kernel 2 start and load its first weight tile while kernel 1 finishes
    (programmatic dependent launch; off in the interpreter); where pdl.enabled, kernel 1 is launched with
    PDL too (it waits for the kernel before it first) and kernel 2 lets the kernel after the MoE start early. A
    config the shapes cannot run raises ValueError.
    "denormal" is exact for fp16 x, and for bf16 x with |x| in [2^-41, 2^64] (smaller values lose bits; larger
    overflow). "half2" (group 32, CUDA only) multiplies in fp16 pairs and sums runs of 16 products in fp16
    (relative error ~1e-3 of each run): activations must stay well inside fp16's range (|x| and |SiLU(g) * u *
    topk_weight| below ~500, so a run of 16 products of |n - 8| <= 8 cannot overflow). check_ids=False skips the
    host-side id range check (a device sync) for graph capture; ids are then clamped in the kernels.
    prepacked=True: the packed weights are planar already (repack_planar once at load, drop the checkpoint copy):
    nothing is repacked or cached, so a whole model's experts fit without a second copy.
    """
    s, pdl, chain, plan = _plan(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids, config,
                                check_ids)
    w13, s13 = kernel_weights(w13_packed, w13_scales, prepacked)
    w2, s2 = kernel_weights(w2_packed, w2_scales, prepacked)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.contiguous()  # before kernel 1: nothing may run between the two launches (PDL)
    pairs = s.tokens * s.topk
    out = torch.empty(s.tokens, s.hidden, dtype=x.dtype, device=x.device)
    (k1, grid1, consts1, opts1), (k2, grid2, consts2, opts2) = plan
    partials = torch.empty(consts1["SPLIT_K"], pairs, 2, s.inter, dtype=torch.float32, device=x.device)
    k1[grid1](x, w13, s13, ids, partials, tw, pairs, s.experts, x.stride(0), **consts1, **opts1,
              **_pdl.launch_kwargs(chain))
    k2[grid2](partials, tw, w2, s2, ids, out, pairs, s.experts, s.hidden, out.stride(0), s.tokens, **consts2,
              **opts2, **({"launch_pdl": True} if pdl else {}))
    return out


def _plan(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids, config, check_ids):
    """(shapes, pdl, chain, launch plan) of a call, its inputs checked and its config picked (fused_moe_w4a16's
    docstring): the one home of its grids."""
    s = check_moe_inputs(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids,
                         check_ids=check_ids)
    interpret = interpreting()
    if x.device.type != "cuda" and not interpret:
        raise RuntimeError("fused_moe_w4a16 needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors)")
    wpg = s.group_size // PACK
    if wpg & (wpg - 1):
        raise ValueError(f"the kernel needs a power-of-two group size (8, 16, 32, ...), got {s.group_size}")
    cfg = {**default_config(x.device, s.tokens), **(config or select_config(s.tokens, x.device))}
    check_config(cfg, s, x.device)
    if cfg["dequant"] == "half2" and interpret:
        raise ValueError("dequant 'half2' runs inline PTX, which the Triton interpreter cannot: it needs a CUDA GPU")
    pdl = bool(cfg.get("pdl")) and not interpret  # the interpreter has no inline asm; same result without
    chain = pdl and _pdl.enabled(x.device)  # kernel 1 also overlaps the kernel before the MoE
    return s, pdl, chain, launches(cfg, s, pdl, chain)


def launch_grids(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids, *,
                 config: dict | None = None) -> list[empty.Launch]:
    """The two launches fused_moe_w4a16 makes with these arguments (grids, warps, PDL), for their empty stand-ins
    (kernels/common/empty.py). No id check (no device sync) and no repack: only shapes and the config matter."""
    _, pdl, chain, plan = _plan(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids, config,
                                False)
    (_, grid1, _, opts1), (_, grid2, _, opts2) = plan
    # kernel 1 waits only when launched with PDL itself (chain) and releases kernel 2 under pdl; kernel 2 does both
    return [empty.Launch(tuple(grid1), opts1["num_warps"], chain, pdl),
            empty.Launch(tuple(grid2), opts2["num_warps"], pdl, pdl)]
