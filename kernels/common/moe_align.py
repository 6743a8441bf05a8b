"""SGLang's moe_align_block_size contract (harness/engines/sglang.py: align_block_size says it) in one Triton launch:
where the engine runs it as one sgl-kernel CUDA op and that op is not installed, the same work in one kernel, so the
forward does not carry ~20 small torch kernels a MoE layer in its place (42 us a layer on an H100, 2.5 ms a forward of
60 MoE layers: scripts/marlin_check.py times it).

One program (the pairs of a forward are few: M x topk <= 512 at 64 tokens, top-8): the experts' counts by histogram,
their padded starts by cumulative sums, the pairs sorted by (expert, pair) so that each pair's place in its expert's
group is its sorted place less the group's start. The fill values go out first, then a barrier, then the pairs and
the block experts over them: one block, so the barrier orders the program's own global stores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ptr, post_ptr, scratch_ptr, numel, num_experts, capacity, num_blocks,
                  max_blocks_per_expert, BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_FILL: tl.constexpr):
    fill = tl.arange(0, BLOCK_FILL)
    for start in range(0, capacity, BLOCK_FILL):
        tl.store(sorted_ptr + start + fill, numel, mask=start + fill < capacity)
    for start in range(0, num_blocks, BLOCK_FILL):
        tl.store(expert_ptr + start + fill, -1, mask=start + fill < num_blocks)
    p = tl.arange(0, BLOCK_P)
    # past the pairs: expert num_experts (a bin of its own, never counted) sorting after every real pair
    ids = tl.load(ids_ptr + p, mask=p < numel, other=num_experts).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    counts = tl.where(e < num_experts, tl.histogram(ids, BLOCK_E), 0)
    blocks = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_starts = tl.cumsum(blocks, 0) - blocks
    pair_starts = tl.cumsum(counts, 0) - counts  # where each expert's pairs start among the sorted ones
    tl.store(post_ptr, tl.sum(blocks, 0) * BLOCK_SIZE)
    # sorted pair s of expert x goes to x's first slot, s - pair_starts[x] places on: the offset per expert, read back
    # per pair from scratch (a register vector cannot be indexed by value)
    tl.store(scratch_ptr + e, block_starts * BLOCK_SIZE - pair_starts)
    tl.debug_barrier()
    keys = tl.sort(ids * BLOCK_P + p)  # by expert, then by pair number: SGLang's order within an expert
    expert_of, pair = keys // BLOCK_P, keys % BLOCK_P
    real = expert_of < num_experts
    slot = tl.load(scratch_ptr + expert_of, mask=real, other=0) + p
    tl.store(sorted_ptr + slot, pair, mask=real)
    for j in range(0, max_blocks_per_expert):  # block j of each expert with that many
        tl.store(expert_ptr + block_starts + j, e, mask=(e < num_experts) & (j < blocks))


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int, capacity: int):
    """(sorted_token_ids int32 [capacity], expert_ids int32 [cdiv(capacity, block_size)], num_tokens_post_padded int32
    [1]) for `topk_ids` [M, topk] (any integer dtype), as harness/engines/sglang.py's align_block_size defines them;
    `capacity` its align_capacity. One launch, no host read: it runs inside a CUDA graph on ids computed there.
    reference() is the same in torch."""
    numel = topk_ids.numel()
    if numel == 0 or block_size < 1 or num_experts < 1 or capacity < numel:
        raise ValueError(f"moe_align_block_size: {numel} pairs, block {block_size}, {num_experts} experts, capacity "
                         f"{capacity}: each must be >= 1 and the capacity hold the pairs")
    device = topk_ids.device
    num_blocks = triton.cdiv(capacity, block_size)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    post = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts + 1)
    scratch = torch.empty(block_e, dtype=torch.int32, device=device)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, expert_ids, post, scratch, numel, num_experts, capacity,
                        num_blocks, triton.cdiv(numel, block_size), BLOCK_SIZE=block_size,
                        BLOCK_P=triton.next_power_of_2(numel), BLOCK_E=block_e, BLOCK_FILL=1024, num_warps=NUM_WARPS)
    return sorted_ids, expert_ids, post


def reference(topk_ids: torch.Tensor, block_size: int, num_experts: int, capacity: int):
    """moe_align_block_size in torch, no host read (meta tensors run it too): the pairs sorted by expert, each
    expert's count by searchsorted over them, each pair's slot scattered, and the expert of block j by searchsorted
    over the cumulative block counts; ~20 small kernels (42 us a MoE layer in a CUDA graph on an H100)."""
    flat = topk_ids.reshape(-1)
    numel, device = flat.numel(), topk_ids.device
    experts, order = torch.sort(flat, stable=True)  # pairs by expert, in increasing i within one
    # bounds[x]: where expert x's pairs start among the sorted ones (bounds[E] = M * topk), no value read on the host
    bounds = torch.searchsorted(experts, torch.arange(num_experts + 1, device=device, dtype=experts.dtype))
    blocks = (bounds.diff() + (block_size - 1)) // block_size
    block_ends = blocks.cumsum(0)
    # sorted pair p of expert x goes to its expert's first block, p - bounds[x] places on
    slot = ((block_ends - blocks) * block_size - bounds[:-1])[experts] + torch.arange(numel, device=device)
    sorted_ids = torch.full((capacity,), numel, dtype=torch.int32, device=device).scatter_(0, slot,
                                                                                           order.to(torch.int32))
    j = torch.arange((capacity + block_size - 1) // block_size, device=device)
    # the experts whose blocks end at or before block j are those before j's expert: their count is its id
    expert_ids = torch.where(j < block_ends[-1], torch.searchsorted(block_ends, j, right=True, out_int32=True), -1)
    return sorted_ids, expert_ids, (block_ends[-1:] * block_size).to(torch.int32)
