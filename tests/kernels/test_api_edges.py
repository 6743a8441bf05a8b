"""The edges of the tree and MoE APIs: an input they cannot compute is refused up front with an error naming the
argument (tree: ValueError on both backends; MoE: ValueError, or TypeError for a dtype), never a wrong result.

Without CUDA the tree kernels run in the interpreter (tests/conftest.py); most cases here fail before any launch.
"""
import math

import pytest
import torch

from verifybench.kernels.moe_int4 import reference as moe
from verifybench.kernels.tree import api as tree
from verifybench.kernels.tree.inputs import random_draft, random_tree

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("reference", "kernel")


def _tree_inputs() -> dict:
    """Two requests of a topk 2, 3-step draft, 6 tree nodes: 10 candidates, parent_list [2, 5]."""
    return random_tree(2, 2, 3, 6, 50, seed=0, context=40, device=DEV)


def _flags(n: int, dtype=torch.int32):
    return torch.zeros(n, dtype=dtype, device=DEV)


def _float(t):
    return t.float()


BUILD_TREE_CASES = {  # build_tree keyword -> (new value or a function of the old one, message)
    "top_scores_index float": ("top_scores_index", _float, "top_scores_index must be an int32 or int64 tensor"),
    "parent_list float": ("parent_list", _float, "parent_list must be an int32 or int64 tensor"),
    "seq_lens float": ("seq_lens", _float, "seq_lens must be an int32 or int64 tensor"),
    "verified_id float": ("verified_id", _float, "verified_id must be an int32 or int64 tensor"),
    "draft_tokens float": ("draft_tokens", _float, "draft_tokens must be an int32 or int64 tensor"),
    "verified_id 2-D": ("verified_id", lambda t: t.view(2, 1), r"verified_id must be \[B\]"),
    "seq_lens short": ("seq_lens", lambda t: t[:1], r"seq_lens has shape \(1,\), expected \(2,\)"),
    "parent_list narrow": ("parent_list", lambda t: t[:, :2], r"parent_list has shape \(2, 2\), expected \(2, 5\)"),
    "topk float": ("topk", 2.0, "topk must be an int"),
    "topk 0": ("topk", 0, r"topk must be in \[1, inf\]"),
    "spec_steps 0": ("spec_steps", 0, r"spec_steps must be in \[1, inf\]"),
    "one node": ("num_verify_tokens", 1, r"num_verify_tokens must be in \[2, inf\]"),
    "more nodes than candidates": ("num_verify_tokens", 12, "needs 11 drafted nodes, but topk=2, spec_steps=3 "
                                   "draft only 10 candidates"),
    "seq_lens_sum negative": ("seq_lens_sum", -1, r"seq_lens_sum must be in \[0, inf\]"),
    "seq_lens_sum float": ("seq_lens_sum", 80.0, "seq_lens_sum must be an int"),
    "flags short": ("flags", _flags(1), r"flags must be a contiguous int32 tensor of shape \(2,\)"),
    "flags int64": ("flags", _flags(2, torch.int64), "flags must be a contiguous int32 tensor"),
    "mask_mode unknown": ("mask_mode", "fulll", "unknown mask_mode 'fulll'"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BUILD_TREE_CASES), ids=list(BUILD_TREE_CASES))
def test_build_tree_refuses_bad_arguments_naming_them(case, backend):
    key, change, match = BUILD_TREE_CASES[case]
    inp = {**_tree_inputs(), "mask_mode": "qlen_only"}
    inp[key] = change(inp[key]) if callable(change) else change
    with pytest.raises(ValueError, match=match):
        tree.build_tree(**inp, backend=backend)


def test_build_tree_kernel_checks_a_given_seq_lens_sum_outside_capture():
    inp = _tree_inputs()
    total = int(inp["seq_lens"].sum())
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=f"seq_lens_sum={total + 1} but seq_lens sums to {total}"):
            tree.build_tree(**inp, mask_mode="full", backend=backend, seq_lens_sum=total + 1)
    kernel = tree.build_tree(**inp, mask_mode="full", backend="kernel", seq_lens_sum=total)
    assert kernel[0].numel() == tree.tree_mask_numel("full", 2, 6, total)
    assert torch.equal(kernel[0].cpu(), tree.build_tree(**inp, mask_mode="full", backend="reference")[0].cpu())


def test_build_tree_kernel_inside_capture_needs_seq_lens_sum_for_the_full_mask(monkeypatch):
    monkeypatch.setattr(tree, "_capturing", lambda like: True)  # what the kernel path sees inside a CUDA graph
    inp = _tree_inputs()
    with pytest.raises(ValueError, match="inside CUDA graph capture needs seq_lens_sum"):
        tree.build_tree(**inp, mask_mode="full", backend="kernel")
    total = int(inp["seq_lens"].sum())
    got = tree.build_tree(**inp, mask_mode="full", backend="kernel", seq_lens_sum=total)
    assert torch.equal(got[0].cpu(), tree.build_tree(**inp, mask_mode="full", backend="reference")[0].cpu())


def test_organize_kernel_without_flags_raises_on_nan_scores_outside_capture(monkeypatch):
    scores, tokens, parents = random_draft(3, 2, 3, 50, seed=1, device=DEV)
    scores[1][2, 1, 0] = float("nan")
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="request 2: NaN among the draft scores"):
            tree.organize_draft_results(scores, tokens, parents, 6, backend=backend)
    flags = _flags(3)  # with flags: the kernel reports and returns, the FLAG_* contract unchanged
    tree.organize_draft_results(scores, tokens, parents, 6, backend="kernel", flags=flags)
    assert flags.tolist() == [0, 0, tree.FLAG_NAN_SCORE]
    monkeypatch.setattr(tree, "_capturing", lambda like: True)  # inside capture no sync: unreported without flags
    _, top, _ = tree.organize_draft_results(scores, tokens, parents, 6, backend="kernel")
    assert (top.diff(dim=1) > 0).all()


ORGANIZE_CASES = {  # (score_list, token_list, parents_list, num_verify_tokens) -> changed inputs, message
    "empty lists": (lambda s, t, p, d: ([], [], [], d), "non-empty lists of one tensor per draft step"),
    "lists of unequal length": (lambda s, t, p, d: (s, t[:2], p, d), "'token_list': 2"),
    "no candidates (topk 0)": (lambda s, t, p, d: ([x[..., :0] for x in s], t, p, d), "topk >= 1"),
    "float tokens": (lambda s, t, p, d: (s, [x.float() for x in t], p, d), r"token_list\[0\] must be an int32"),
    "integer scores": (lambda s, t, p, d: ([(x * 100).long() for x in s], t, p, d),
                       r"score_list\[0\] must be a floating-point tensor"),
    "float parents": (lambda s, t, p, d: (s, t, [x.float() for x in p], d), r"parents_list\[0\] must be an int32"),
    "batch mismatch": (lambda s, t, p, d: (s, [t[0][:1]] + t[1:], p, d), r"token_list\[0\] has shape \(1, 2\)"),
    "num_verify_tokens float": (lambda s, t, p, d: (s, t, p, 6.0), "num_verify_tokens must be an int"),
    "num_verify_tokens 1": (lambda s, t, p, d: (s, t, p, 1), r"num_verify_tokens must be in \[2"),
    "more nodes than candidates": (lambda s, t, p, d: (s, t, p, 12), "needs 11 drafted nodes, but the draft has only "
                                   "10 candidates"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(ORGANIZE_CASES), ids=list(ORGANIZE_CASES))
def test_organize_refuses_bad_arguments_naming_them(case, backend):
    change, match = ORGANIZE_CASES[case]
    scores, tokens, parents = random_draft(2, 2, 3, 50, device=DEV)
    with pytest.raises(ValueError, match=match):
        tree.organize_draft_results(*change(scores, tokens, parents, 6), backend=backend)


def test_organize_kernel_refuses_float64_scores_it_would_round():
    scores, tokens, parents = random_draft(2, 2, 3, 50, device=DEV)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32 scores, got torch.float64"):
        tree.organize_draft_results([s.double() for s in scores], tokens, parents, 6, backend="kernel")


def _verify_args():
    _, _, index, nxt, sib, tokens = tree.build_tree(**_tree_inputs(), mask_mode="qlen_only", backend="reference")
    return [tokens.view(2, 6), index, nxt, sib, torch.zeros(12, dtype=torch.int64, device=DEV), 4]


VERIFY_CASES = {  # argument position -> (change, message)
    "candidates float": (0, _float, "candidates must be an int32 or int64 tensor"),
    "candidates 1-D": (0, lambda t: t.flatten(), r"candidates must be \[B, D\]"),
    "retrieve_index float": (1, _float, "retrieve_index must be an int32 or int64 tensor"),
    "retrieve_next_token float": (2, _float, "retrieve_next_token must be an int32 or int64 tensor"),
    "retrieve_next_sibling short": (3, lambda t: t[:, :5], r"retrieve_next_sibling has shape \(2, 5\)"),
    "target_predict float": (4, lambda t: t.float() + 0.5, "target_predict must be an int32 or int64 tensor"),
    "target_predict short": (4, lambda t: t[:11], "target_predict has 11 entries, expected B"),
    "num_spec_steps float": (5, 2.0, "num_spec_steps must be an int"),
    "num_spec_steps 0": (5, 0, r"num_spec_steps must be in \[1"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=list(VERIFY_CASES))
def test_verify_refuses_bad_arguments_naming_them(case, backend):
    pos, change, match = VERIFY_CASES[case]
    args = _verify_args()
    args[pos] = change(args[pos]) if callable(change) else change
    with pytest.raises(ValueError, match=match):
        tree.verify_tree_greedy(*args, backend=backend)


def _assign_args():
    table = torch.zeros(4, 20, dtype=torch.int32, device=DEV)
    return [table, torch.tensor([2, 0], device=DEV), torch.tensor([3, 5], device=DEV),
            torch.arange(1, 9, device=DEV), 4]


ASSIGN_CASES = {
    "req_pool_indices float": (1, _float, "req_pool_indices must be an int32 or int64 tensor"),
    "req_to_token float": (0, _float, "req_to_token must be an int32 or int64 tensor"),
    "req_to_token not contiguous": (0, lambda t: t.t(), "not contiguous"),
    "seq_lens short": (2, lambda t: t[:1], r"seq_lens has shape \(1,\), expected \(2,\)"),
    "out_cache_loc float": (3, _float, "out_cache_loc must be an int32 or int64 tensor"),
    "out_cache_loc short": (3, lambda t: t[:7], "out_cache_loc has 7 entries, expected B"),
    "num_verify_tokens 0": (4, 0, r"num_verify_tokens must be in \[1"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(ASSIGN_CASES), ids=list(ASSIGN_CASES))
def test_assign_req_to_token_refuses_bad_arguments_naming_them(case, backend):
    pos, change, match = ASSIGN_CASES[case]
    args = _assign_args()
    args[pos] = change(args[pos]) if callable(change) else change
    with pytest.raises(ValueError, match=match):
        tree.assign_req_to_token(*args, backend=backend)
    with pytest.raises(ValueError, match="flags must be"):  # the kernel would write past a short flags tensor
        tree.assign_req_to_token(*_assign_args(), backend=backend, flags=_flags(1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_refuses_an_empty_vocabulary_and_integer_logits(backend):
    with pytest.raises(ValueError, match=r"vocab >= 1, got shape \(3, 0\)"):
        tree.argmax(torch.zeros(3, 0, device=DEV), backend=backend)
    with pytest.raises(ValueError, match="logits must be a floating-point tensor"):
        tree.argmax(torch.zeros(3, 5, dtype=torch.int32, device=DEV), backend=backend)
    assert tree.argmax(torch.zeros(0, 5, device=DEV), backend=backend).shape == (0,)


@pytest.mark.parametrize("mode", ["full", "qlen_only", "qlen_only_bitpacking"])
def test_empty_batch_gives_the_same_empty_outputs_on_both_backends(mode):
    inp = {k: (v[:0] if torch.is_tensor(v) else v) for k, v in _tree_inputs().items()}
    built = [tree.build_tree(**inp, mask_mode=mode, backend=backend) for backend in BACKENDS]
    assert [tuple(t.shape) for t in built[0]] == [tuple(t.shape) for t in built[1]]
    assert tuple(built[0][3].shape) == (0, 6)
    args = [built[0][5].view(0, 6), *built[0][2:5], torch.zeros(0, dtype=torch.int64, device=DEV), 4]
    verified = [tree.verify_tree_greedy(*args, backend=backend) for backend in BACKENDS]
    assert [tuple(t.shape) for t in verified[0]] == [tuple(t.shape) for t in verified[1]] == [(0,), (0, 4), (0,)]


def test_tree_helpers_refuse_out_of_range_sizes():
    for call, match in ((lambda: tree.num_candidates(0, 3), "topk must be in"),
                        (lambda: tree.bitpack_dtype(0), "num_verify_tokens must be in"),
                        (lambda: tree.tree_mask_numel("fulll", 2, 4, 10), "unknown mask_mode"),
                        (lambda: tree.tree_mask_numel("full", 2, 4, -1), "seq_lens_sum must be in"),
                        (lambda: random_tree(2, 2, 3, 6, 50, context=10, spread=11), r"spread must be in \[0, 10\]"),
                        (lambda: random_draft(2, 0, 3, 50), "topk must be in")):
        with pytest.raises(ValueError, match=match):
            call()


# ---------------------------------------------------------------------------------------------------- MoE

def test_quantize_refuses_non_finite_weights_naming_the_first_position():
    w = torch.randn(3, 4, 64)
    w[1, 2, 37] = float("nan")
    w[2, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite weight \(nan\) at expert 1, row 2, column 37"):
        moe.quantize_w4a16(w)
    w2 = torch.randn(4, 32)
    w2[3, 5] = -float("inf")
    with pytest.raises(ValueError, match=r"non-finite weight \(-inf\) at row 3, column 5"):
        moe.quantize_w4a16(w2)


def test_expected_distinct_experts_stays_within_zero_and_e_and_refuses_bad_arguments():
    for e in (1, 8, 384):
        for k in {1, min(8, e), e}:
            values = [moe.expected_distinct_experts(n, e, k) for n in range(0, 40)]
            assert values[0] == 0.0 and all(0.0 <= v <= e for v in values)
            assert all(a <= b for a, b in zip(values, values[1:]))  # more tokens never touch fewer experts
    assert moe.expected_distinct_experts(3, 8, 8) == 8.0
    assert math.isclose(moe.expected_distinct_experts(2, 4, 1), 4 * (1 - 0.75 ** 2))
    for args, match in (((1, 8, 16), r"topk must be in \[1, 8\]"), ((-1, 8, 4), r"n must be in \[0"),
                        ((1, 0, 4), r"num_experts must be in \[1"), ((1.5, 8, 2), "n must be an int"),
                        ((3, 8, 0), r"topk must be in \[1, 8\]")):
        with pytest.raises(ValueError, match=match):
            moe.expected_distinct_experts(*args)


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    e, h, i = 4, 64, 32
    x = torch.randn(3, h)
    tw, ids = moe.route_uniform(3, e, 2, seed=0)
    return x, torch.randn(e, 2 * i, h), torch.randn(e, h, i), tw, ids


DENSE_CASES = {  # argument position -> (change, exception, message)
    "ids float": (4, lambda t: t.float() + 0.5, TypeError, "topk_ids must be an int32 or int64 tensor"),
    "ids out of range": (4, lambda t: t + 4, ValueError, r"expert ids out of range: found \d+\.\.\d+, valid 0\.\.3"),
    "ids negative": (4, lambda t: t - 4, ValueError, "expert ids out of range"),
    "topk 0": (4, lambda t: t[:, :0], ValueError, r"topk >= 1, got \(3, 0\)"),
    "weights shape": (3, lambda t: t[:, :1], ValueError, "topk_weights .* must match topk_ids"),
    "w2 shape": (2, lambda t: t[:, :-1], ValueError, r"w2 must be \[E, H, I\]"),
    "x int": (0, lambda t: t.int(), TypeError, "x must be a floating-point tensor"),
}


def test_repeated_expert_ids_add_their_terms_so_topk_may_exceed_e(dense):
    # topk > E is computable once ids repeat: every pair adds w * expert(x). Callers rely on it (all pairs on one
    # expert keeps a check small), so it is accepted; only the distinct-expert helpers require topk <= E.
    x, w13, w2, _, _ = dense
    ids, tw = torch.zeros(3, 5, dtype=torch.int32), torch.rand(3, 5)  # E = 1 below, topk = 5
    merged = (tw.sum(1, keepdim=True), ids[:, :1])

    def close(a, b):
        return float((a - b).norm() / b.norm()) < 1e-5

    assert close(moe.moe_dense_torch(x, w13[:1], w2[:1], tw, ids), moe.moe_dense_torch(x, w13[:1], w2[:1], *merged))
    q = (*moe.quantize_w4a16(w13[:1]), *moe.quantize_w4a16(w2[:1]))
    assert close(moe.reference_moe_w4a16(x, *q, tw, ids), moe.reference_moe_w4a16(x, *q, *merged))


@pytest.mark.parametrize("case", list(DENSE_CASES), ids=list(DENSE_CASES))
def test_dense_torch_path_refuses_bad_inputs(dense, case):
    pos, change, exc, match = DENSE_CASES[case]
    args = list(dense)
    args[pos] = change(args[pos])
    with pytest.raises(exc, match=match):
        moe.moe_dense_torch(*args)


def test_routing_and_byte_helpers_refuse_bad_arguments():
    ids = torch.tensor([[1, 2], [2, 1], [5, 1]])
    cases = ((lambda: moe.route_uniform(-1, 8, 2), ValueError, r"m must be in \[0"),
             (lambda: moe.route_uniform(4, 8, 9), ValueError, r"topk must be in \[1, 8\]"),
             (lambda: moe.route_skewed(4, 8, 2, hot_factor=0), ValueError, "hot_factor must be a finite number > 0"),
             (lambda: moe.route_skewed(4, 8, 2, hot_factor=float("nan")), ValueError, "hot_factor must be"),
             (lambda: moe.route_skewed(4, 8, 2, hot_experts=9), ValueError, r"hot_experts must be in \[0, 8\]"),
             (lambda: moe.trace_windows(ids.float(), 1, 2), TypeError, "trace must be an int32 or int64 tensor"),
             (lambda: moe.trace_windows(ids, 0, 2), ValueError, r"m must be in \[1"),
             (lambda: moe.trace_windows(ids, 1, 0), ValueError, r"count must be in \[1"),
             (lambda: moe.moe_bytes(ids.float(), 64, 100), TypeError, "topk_ids must be an int32 or int64 tensor"),
             (lambda: moe.moe_bytes(ids[0], 64, 100), ValueError, r"topk_ids must be \[tokens, topk\]"),
             (lambda: moe.expert_bytes_int4(64, 32, 0), ValueError, "group_size must be a positive multiple of 8"),
             (lambda: moe.expert_bytes_int4(64, 32, 12), ValueError, "positive multiple of 8"))
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
