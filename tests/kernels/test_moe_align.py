"""The one-launch block alignment (kernels/common/moe_align.py), SGLang's moe_align_block_size contract: equal, value
for value, to the torch version the contract test holds to SGLang's docstring example (harness/engines/sglang.py), at
the forward's shapes and at small ones, and a graph-capturable call on a GPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels modules are first imported (conftest too)

from verifybench.harness.engines.sglang import align_capacity  # noqa: E402
from verifybench.kernels.common.moe_align import moe_align_block_size, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(m: int, topk: int, experts: int, seed: int, dtype=torch.int32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(m, experts, generator=gen).topk(topk, -1).indices.to(dtype)


@pytest.mark.parametrize("m,topk,experts,block", [
    # K2.5 TP8: decode, verify, B x D
    (1, 8, 384, 8), (3, 8, 384, 8), (8, 8, 384, 8), (64, 8, 384, 8), (48, 8, 384, 16),
    (1, 1, 1, 4), (5, 2, 16, 16), (32, 8, 16, 64), (7, 3, 4, 4), (4, 3, 5, 4)])
def test_one_launch_alignment_equals_the_torch_one(m, topk, experts, block):
    for seed, dtype in ((m, torch.int32), (m + 1, torch.int64)):
        ids = _ids(m, topk, experts, seed, dtype)
        want = reference(ids, block, experts, align_capacity(ids.numel(), block, experts))
        got = moe_align_block_size(ids.to(DEVICE), block, experts, align_capacity(ids.numel(), block, experts))
        for name, a, b in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
            assert a.dtype == torch.int32 and torch.equal(a.cpu(), b), name


def test_skewed_routing_fills_one_experts_blocks_in_pair_order():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3], [0, 1]], dtype=torch.int32)  # expert 0 in every token
    want = reference(ids, 2, 6, align_capacity(ids.numel(), 2, 6))
    got = moe_align_block_size(ids.to(DEVICE), 2, 6, align_capacity(ids.numel(), 2, 6))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    assert got[0][:6].tolist() == [0, 2, 4, 6, 8, 10]  # expert 0's pairs, then its padding


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(num_experts=0), dict(capacity=3)])
def test_refuses_what_cannot_hold_the_pairs(bad):
    args = dict(block_size=4, num_experts=8, capacity=32) | bad
    with pytest.raises(ValueError, match="moe_align_block_size"):
        moe_align_block_size(_ids(2, 2, 8, 0), **args)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_runs_inside_a_cuda_graph_on_ids_rewritten_in_place():
    ids = _ids(6, 8, 384, 1).cuda()
    cap = align_capacity(ids.numel(), 8, 384)
    moe_align_block_size(ids, 8, 384, cap)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_align_block_size(ids, 8, 384, cap)
    new = _ids(6, 8, 384, 2)
    ids.copy_(new)
    graph.replay()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(out, reference(new, 8, 384, cap)))
