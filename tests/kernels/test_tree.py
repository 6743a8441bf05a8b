"""EAGLE draft tree (kernels/tree/): hand-worked trees, kernel == reference on random valid trees, invalid trees.

Without CUDA the Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first).
"""
import pytest
import torch

from verifybench.kernels.tree import api as tree
from verifybench.kernels.tree.inputs import random_draft, random_target_predict, random_tree

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MODES = ("full", "qlen_only", "qlen_only_bitpacking")
T = dict(dtype=torch.int64, device=DEV)


def _t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype, device=DEV)


def _equal(got, want):
    return all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))


def _chain_draft(batch=1):
    """topk 1, 3 steps, scores 0.9 > 0.8 > 0.7: tokens 10 -> 11 -> 12 under the root."""
    scores = [_t([[[0.9]]] * batch, torch.float32), _t([[[0.8]]] * batch, torch.float32),
              _t([[[0.7]]] * batch, torch.float32)]
    tokens = [_t([[10]] * batch), _t([[11]] * batch), _t([[12]] * batch)]
    parents = [_t([[-1, 0]] * batch), _t([[1]] * batch), _t([[2]] * batch)]
    return scores, tokens, parents


def _topk2_draft(batch=1):
    """topk 2, 2 steps; scores [0.6, 0.3 | 0.35, 0.25, 0.20, 0.05]: the 4 best are candidates 0, 1, 2, 3, so nodes
    1, 2 (tokens 20, 21) hang off the root and nodes 3, 4 (tokens 30, 31) off node 1."""
    scores = [_t([[[0.6, 0.3]]] * batch, torch.float32), _t([[[0.35, 0.25], [0.20, 0.05]]] * batch, torch.float32)]
    tokens = [_t([[20, 21]] * batch), _t([[30, 31, 32, 33]] * batch)]
    parents = [_t([[-1, 0, 1]] * batch), _t([[2, 3]] * batch)]
    return scores, tokens, parents


def _rows_to_words(rows):
    return [sum(1 << c for c in r) for r in rows]


def _full_mask(seq_lens, rows, d):
    out = []
    for seq in seq_lens:
        for r in rows:
            out += [True] * seq + [c in r for c in range(d)]
    return out


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_chain_tree_matches_hand_worked_answer(backend):
    parent_list, top, draft = tree.organize_draft_results(*_chain_draft(), 4, backend=backend)
    assert parent_list.tolist() == [[-1, 0, 1]] and top.tolist() == [[0, 1, 2]] and draft.tolist() == [[10, 11, 12]]
    rows = [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]
    args = (_t([5]), parent_list, top, draft, _t([7]), 1, 3, 4)
    for mode, want_mask in (("full", _full_mask([7], rows, 4)), ("qlen_only", _full_mask([0], rows, 4)),
                            ("qlen_only_bitpacking", _rows_to_words(rows))):
        mask, pos, index, nxt, sib, tokens = tree.build_tree(*args, mode, backend=backend)
        assert mask.tolist() == want_mask
        assert mask.dtype == (torch.uint8 if mode.endswith("bitpacking") else torch.bool)
        assert pos.tolist() == [7, 8, 9, 10] and index.tolist() == [[0, 1, 2, 3]]
        assert nxt.tolist() == [[1, 2, 3, -1]] and sib.tolist() == [[-1] * 4] and tokens.tolist() == [5, 10, 11, 12]
    # accepts 10 (= target at the root) and 11, rejects 12 (target 99): bonus 99
    predicts, accept, num = tree.verify_tree_greedy(tokens.view(1, 4), index, nxt, sib, _t([10, 11, 99, 42]), 4,
                                                    backend=backend)
    assert predicts.tolist() == [10, 11, 99, -1] and accept.tolist() == [[0, 1, 2, -1]] and num.tolist() == [2]


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_topk2_tree_matches_hand_worked_answer(backend):
    parent_list, top, draft = tree.organize_draft_results(*_topk2_draft(2), 5, backend=backend)
    assert parent_list.tolist() == [[-1, 0, 1]] * 2 and top.tolist() == [[0, 1, 2, 3]] * 2
    assert draft.tolist() == [[20, 21, 30, 31]] * 2
    rows = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}]
    args = (_t([7, 8]), parent_list, top, draft, _t([10, 3]), 2, 2, 5)
    for mode, want_mask in (("full", _full_mask([10, 3], rows, 5)), ("qlen_only", _full_mask([0, 0], rows, 5)),
                            ("qlen_only_bitpacking", _rows_to_words(rows) * 2)):
        mask, pos, index, nxt, sib, tokens = tree.build_tree(*args, mode, backend=backend)
        assert mask.tolist() == want_mask
        assert pos.tolist() == [10, 11, 11, 12, 12, 3, 4, 4, 5, 5]
        assert index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        assert nxt.tolist() == [[1, 3, -1, -1, -1]] * 2 and sib.tolist() == [[-1, 2, -1, 4, -1]] * 2
        assert tokens.tolist() == [7, 20, 21, 30, 31, 8, 20, 21, 30, 31]
    # request 0: the root's target 21 is its second child (node 2), a leaf: bonus 55.
    # request 1: target 20 -> node 1, then 31 -> node 4 (node 1's second child): bonus 95.
    target = _t([21, 99, 55, 98, 97, 20, 31, 77, 96, 95])
    predicts, accept, num = tree.verify_tree_greedy(tokens.view(2, 5), index, nxt, sib, target, 3, backend=backend)
    assert predicts.tolist() == [21, -1, 55, -1, -1, 20, 31, -1, -1, 95]
    assert accept.tolist() == [[0, 2, -1], [5, 6, 9]] and num.tolist() == [1, 2]


@pytest.mark.parametrize("steps,topk,d", [(3, 1, 4), (5, 4, 8), (6, 10, 60), (31, 1, 32), (1, 1, 2), (1, 4, 5)])
def test_kernel_equals_reference_on_random_valid_trees(steps, topk, d):
    for seed in (0, 1):
        draft = random_draft(3, topk, steps, 50, seed=seed, device=DEV)
        flags = torch.zeros(3, dtype=torch.int32, device=DEV)
        organized = tree.organize_draft_results(*draft, d, backend="kernel", flags=flags)
        assert _equal(organized, tree.organize_draft_results(*draft, d, backend="reference"))
        inp = random_tree(3, topk, steps, d, 50, seed=seed, device=DEV)
        inp["seq_lens"] = _t([[0, 17, 4100], [1, 16, 9001]][seed])  # prefix rows: empty, unaligned, several chunks
        for mode in MODES if d <= 32 else MODES[:2]:
            built = tree.build_tree(**inp, mask_mode=mode, backend="kernel", flags=flags)
            assert _equal(built, tree.build_tree(**inp, mask_mode=mode, backend="reference")), mode
        _, _, index, nxt, sib, tokens = built
        for last_child in (False, True):
            target = random_target_predict(tokens.view(3, d), nxt, sib, 50, last_child=last_child, seed=seed)
            args = (tokens.view(3, d), index, nxt, sib, target, steps + 1)
            verified = tree.verify_tree_greedy(*args, backend="kernel", flags=flags)
            assert _equal(verified, tree.verify_tree_greedy(*args, backend="reference"))
        assert flags.tolist() == [0, 0, 0]


def _chain_batch():
    """Three copies of the chain tree (topk 1, 3 steps, D 4) as build_tree's keyword inputs."""
    parent_list, top, draft = tree.organize_draft_results(*_chain_draft(3), 4, backend="reference")
    return dict(verified_id=_t([5, 6, 7]), parent_list=parent_list, top_scores_index=top, draft_tokens=draft,
                seq_lens=_t([7, 8, 9]), topk=1, spec_steps=3, num_verify_tokens=4)


def _topk2_batch():
    parent_list, top, draft = tree.organize_draft_results(*_topk2_draft(3), 5, backend="reference")
    return dict(verified_id=_t([5, 6, 7]), parent_list=parent_list, top_scores_index=top, draft_tokens=draft,
                seq_lens=_t([7, 8, 9]), topk=2, spec_steps=2, num_verify_tokens=5)


def _assert_flagged_build(inp, changes, flag, message):
    """Request 1 broken by `changes` ({input: its new row}): the reference raises naming it; the kernel flags only
    it, marks it in-band, and leaves requests 0 and 2 exactly as on the intact batch."""
    good = tree.build_tree(**inp, mask_mode="qlen_only", backend="reference")
    for field, row in changes.items():
        inp[field] = inp[field].clone()
        inp[field][1] = _t(row)
    with pytest.raises(ValueError, match=f"request 1: .*{message}"):
        tree.build_tree(**inp, mask_mode="qlen_only", backend="reference")
    flags = torch.zeros(3, dtype=torch.int32, device=DEV)
    got = tree.build_tree(**inp, mask_mode="qlen_only", backend="kernel", flags=flags)
    assert flags[0] == 0 and flags[2] == 0 and flags[1] & flag  # one fault may show as more than one bit
    d = inp["num_verify_tokens"]
    for g, w in zip(got, good):
        g, w = g.cpu().view(3, -1), w.cpu().view(3, -1)
        assert torch.equal(g[[0, 2]], w[[0, 2]])
    assert got[1].view(3, d)[1].tolist() == [-1] * d and got[3][1].tolist() == [-1] * d  # positions, children


@pytest.mark.parametrize("case", [
    ({"parent_list": [-1, 0, 7]}, tree.FLAG_MISSING_PARENT, "missing parent"),  # node 3's parent never drafted
    ({"parent_list": [-1, 2, 1]}, tree.FLAG_CYCLE, "cycle"),  # node 2 -> node 3 -> node 2
    ({"parent_list": [-1, 1, 1]}, tree.FLAG_CYCLE, "cycle"),  # node 2 is its own parent
    ({"top_scores_index": [0, 1, 3]}, tree.FLAG_ID_RANGE, "out of range"),  # 3 candidates: ids 0..2
    ({"top_scores_index": [-1, 1, 2]}, tree.FLAG_ID_RANGE, "out of range"),
    ({"seq_lens": -1}, tree.FLAG_ID_RANGE, "seq_len"),
    ({"top_scores_index": [0, 1, 1]}, tree.FLAG_UNSORTED, "strictly ascending"),  # node 3 duplicates node 2
    ({"top_scores_index": [0, 2, 1]}, tree.FLAG_UNSORTED, "strictly ascending"),  # a valid tree, nodes out of order
], ids=["missing-parent", "two-cycle", "self-loop", "id-too-large", "id-negative", "negative-seq-len",
        "duplicate-candidate", "unsorted-candidates"])
def test_invalid_chain_tree_raises_in_reference_and_is_flagged_by_kernel(case):
    _assert_flagged_build(_chain_batch(), *case)


def test_negative_seq_len_in_full_mode_leaves_the_other_requests_masks_intact():
    inp = _chain_batch()
    inp["seq_lens"] = _t([7, -1, 9])
    flags = torch.zeros(3, dtype=torch.int32, device=DEV)
    mask = tree.build_tree(**inp, mask_mode="full", backend="kernel", flags=flags)[0].cpu()
    want = tree.build_tree(**{**inp, "seq_lens": _t([7, 0, 9])}, mask_mode="full", backend="reference")[0].cpu()
    assert flags.tolist() == [0, tree.FLAG_ID_RANGE, 0] and mask.numel() == want.numel()
    first, last = 4 * (7 + 4), 4 * (9 + 4)  # request 1's block in between is not checked: it is flagged
    assert torch.equal(mask[:first], want[:first]) and torch.equal(mask[-last:], want[-last:])


def test_tree_deeper_than_spec_steps_is_flagged():
    # drafted candidates 0, 1, 2, 4; node 3 (candidate 2) -> candidate 4 = node 4 -> candidate 0 = node 1 -> root:
    # depth 3 with spec_steps 2, and no cycle
    _assert_flagged_build(_topk2_batch(), {"top_scores_index": [0, 1, 2, 4], "parent_list": [-1, 4, 0]},
                          tree.FLAG_CYCLE, "depth 3 > spec_steps=2")


def test_missing_parent_in_topk2_tree_is_flagged():
    # candidate 4 was not among the 4 drafted nodes, so nodes 3 and 4 have no parent
    _assert_flagged_build(_topk2_batch(), {"parent_list": [-1, 4, 1]}, tree.FLAG_MISSING_PARENT, "missing parent")


def test_nan_scores_raise_in_reference_and_are_flagged_by_kernel():
    scores, tokens, parents = random_draft(3, 4, 5, 50, seed=3, device=DEV)
    good = tree.organize_draft_results(scores, tokens, parents, 8, backend="reference")
    scores[2][1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="request 1: NaN"):
        tree.organize_draft_results(scores, tokens, parents, 8, backend="reference")
    flags = torch.zeros(3, dtype=torch.int32, device=DEV)
    _, top, draft = tree.organize_draft_results(scores, tokens, parents, 8, backend="kernel", flags=flags)
    assert flags.tolist() == [0, tree.FLAG_NAN_SCORE, 0]
    assert torch.equal(top[[0, 2]].cpu(), good[1][[0, 2]].cpu()) and torch.equal(draft[[0, 2]].cpu(),
                                                                                  good[2][[0, 2]].cpu())
    assert (top[1].diff() > 0).all() and 0 <= int(top[1].min()) and int(top[1].max()) < tree.num_candidates(4, 5)


def _verify_batch():
    _, _, index, nxt, sib, tokens = tree.build_tree(**_topk2_batch(), mask_mode="qlen_only", backend="reference")
    # no child of any root matches its target, so a walk that followed a cycle among the root's children would spin
    target = _t([99] * 15)
    return [tokens.view(3, 5), index, nxt, sib, target, 3]


@pytest.mark.parametrize("case", [
    (1, (1, 2), 2, tree.FLAG_ID_RANGE, "outside its rows"),  # retrieve_index into request 0's row
    (2, (1, 0), 5, tree.FLAG_ID_RANGE, "out of range"),  # next_token past the row
    (3, (1, 2), 1, tree.FLAG_CYCLE, "cycle"),  # sibling list 1 -> 2 -> 1
    (2, (1, 3), 0, tree.FLAG_CYCLE, "cycle"),  # node 3's first child is the root
], ids=["retrieve-index-other-request", "next-token-out-of-range", "sibling-cycle", "child-is-root"])
def test_invalid_lists_raise_in_reference_and_are_flagged_by_kernel(case):
    field, where, value, flag, message = case
    args = _verify_batch()
    good = tree.verify_tree_greedy(*args, backend="reference")
    args[field] = args[field].clone()
    args[field][where] = value
    with pytest.raises(ValueError, match=f"request 1: .*{message}"):
        tree.verify_tree_greedy(*args, backend="reference")
    flags = torch.zeros(3, dtype=torch.int32, device=DEV)
    predicts, accept, num = tree.verify_tree_greedy(*args, backend="kernel", flags=flags)
    assert flags.tolist() == [0, flag, 0]
    assert num.tolist() == [good[2][0].item(), -1, good[2][2].item()]
    assert accept[1].tolist() == [-1] * 3 and predicts.view(3, 5)[1].tolist() == [-1] * 5
    assert torch.equal(predicts.view(3, 5)[[0, 2]].cpu(), good[0].view(3, 5)[[0, 2]].cpu())
    assert torch.equal(accept[[0, 2]].cpu(), good[1][[0, 2]].cpu())


def test_bitpacking_rejects_more_than_32_nodes_on_both_backends():
    inp = random_tree(1, 1, 32, 33, 50, device=DEV)
    for backend in ("reference", "kernel"):
        with pytest.raises(ValueError, match="at most 32"):
            tree.build_tree(**inp, mask_mode="qlen_only_bitpacking", backend=backend)
    assert [tree.bitpack_dtype(d) for d in (8, 9, 16, 17, 32)] == [torch.uint8, torch.int16, torch.int16,
                                                                   torch.int32, torch.int32]


def test_assign_req_to_token_writes_own_slots_and_flags_overflow():
    table = torch.zeros(4, 20, dtype=torch.int32, device=DEV)
    pools, seq, loc = _t([2, 0, 3]), _t([3, 17, 16]), torch.arange(1, 13, **T)
    want = table.clone()
    for b, (p, s) in enumerate(zip([2, 0, 3], [3, 17, 16])):
        if b != 1:
            want[p, s:s + 4] = loc[4 * b:4 * b + 4].int()
    with pytest.raises(ValueError, match="request 1: slots"):  # 17 + 4 > 20
        tree.assign_req_to_token(table.clone(), pools, seq, loc, 4, backend="reference")
    flags = torch.zeros(3, dtype=torch.int32, device=DEV)
    got = tree.assign_req_to_token(table.clone(), pools, seq, loc, 4, backend="kernel", flags=flags)
    assert flags.tolist() == [0, tree.FLAG_ID_RANGE, 0] and torch.equal(got.cpu(), want.cpu())
    seq[1] = 5
    ok = tree.assign_req_to_token(table.clone(), pools, seq, loc, 4, backend="reference")
    assert torch.equal(tree.assign_req_to_token(table.clone(), pools, seq, loc, 4, backend="kernel").cpu(), ok.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_kernel_returns_first_maximum_like_torch(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (6, 5000), generator=g).to(dtype).to(DEV)  # many ties at the maximum
    logits[2] = float("-inf")
    assert torch.equal(tree.argmax(logits, backend="kernel").cpu(), torch.argmax(logits, dim=-1).cpu())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke profile")
def test_kv_tree_on_cpu_checks_its_kernels_in_the_interpreter_and_withholds_eta_speedup_and_targets():
    from verifybench.harness.components import kv_tree
    from verifybench.harness.measure.results.store import WITHHELD

    specs = [s for s in kv_tree.cases("tiny", 1, 64) if s.params["tree"] == "d4t1s3" and s.params["batch"] == 1
             and s.params["step"] in ("verify", "build_tree") and s.params["variant"] in ("", "full-ctx1024")]
    assert {s.params["backend"] for s in specs} == {"kernel", "reference"}
    records = [s.run(max_time_s=0.05).as_dict() for s in specs]
    assert all(r["check"]["ok"] for r in records) and any("kernel == reference" in r["check"]["detail"]
                                                          for r in records)
    tables = dict(kv_tree.tables(records))
    rows = next(rows for title, rows in tables.items() if title.startswith("draft tree"))
    assert all(r["speedup"] == WITHHELD and r["kernel_mode"] == "cpu-hot" for r in rows)
    fill = next(rows for title, rows in tables.items() if title.startswith("full tree mask"))
    assert fill and all(r["eta"] == WITHHELD for r in fill)
    assert next(rows for title, rows in tables.items() if title.startswith("targets")) == []


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_build_tree_refuses_a_huge_seq_lens_with_the_bytes_before_allocating(backend, monkeypatch):
    inp = random_tree(2, 2, 3, 6, 50, device=DEV)
    inp["seq_lens"] = _t([2**40, 2**40])
    allocated = []
    real = tree._tt.build_tree
    monkeypatch.setattr(tree._tt, "build_tree", lambda *a, **k: allocated.append(1) or real(*a, **k))
    with pytest.raises(ValueError, match=r"seq_lens: the full tree mask needs 13,194,139,533,384 bytes"):
        tree.build_tree(**inp, mask_mode="full", backend=backend)
    assert not allocated
    positions = tree.build_tree(**inp, mask_mode="qlen_only", backend=backend)[1]  # no prefix columns: it fits
    assert positions.min().item() == 2**40


def test_a_duplicated_retrieve_index_raises_in_reference_and_is_flagged_by_kernel():
    args = _verify_batch()
    args[1] = args[1].clone()
    args[1][1, 2] = args[1][1, 1]
    with pytest.raises(ValueError, match="request 1: retrieve_index holds 6 twice"):
        tree.verify_tree_greedy(*args, backend="reference")
    flags = torch.zeros(3, dtype=torch.int32, device=DEV)
    num = tree.verify_tree_greedy(*args, backend="kernel", flags=flags)[2]
    assert flags.tolist() == [0, tree.FLAG_DUPLICATE_INDEX, 0] and num.tolist()[1] == -1


@pytest.mark.parametrize("slot", [2**33 + 5, -1])
def test_assign_req_to_token_refuses_a_slot_its_table_cannot_hold(slot):
    table = torch.zeros(4, 20, dtype=torch.int32, device=DEV)
    pools, seq, loc = _t([2, 0]), _t([3, 5]), torch.arange(1, 9, **T)
    loc[5] = slot
    with pytest.raises(ValueError, match=f"request 1: out_cache_loc slot {slot} does not fit the torch.int32"):
        tree.assign_req_to_token(table.clone(), pools, seq, loc, 4, backend="reference")
    flags = torch.zeros(2, dtype=torch.int32, device=DEV)
    got = tree.assign_req_to_token(table.clone(), pools, seq, loc, 4, backend="kernel", flags=flags)
    assert flags.tolist() == [0, tree.FLAG_ID_RANGE] and not got[0].any() and got[2, 3:7].tolist() == [1, 2, 3, 4]
