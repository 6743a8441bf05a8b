"""Probes of the kernels' APIs: the draft tree (organize, build, verify, the KV table, argmax) and the INT4 MoE
(quantize, the dense reference, routing, bytes), on both backends."""
from __future__ import annotations

from probe_base import Case, api


def tree_cases() -> list[Case]:
    cls = "tree-api"
    out = []

    def tree_call(backend, change, **extra):
        def fn():
            import torch
            from verifybench.kernels.tree import api as tree
            from verifybench.kernels.tree.inputs import random_tree
            inp = {**random_tree(2, 2, 3, 6, 50, seed=0, context=40), "mask_mode": "qlen_only"}
            key, new = change
            if key:
                inp[key] = new(inp[key]) if callable(new) else new
            inp.update(extra)
            got = tree.build_tree(**inp, backend=backend)
            return [t.shape for t in got] if isinstance(got, tuple) else got
        return fn

    def dup(t):
        t = t.clone()
        t[0, 1] = t[0, 0]
        return t

    def unsorted(t):  # request 0 only
        t = t.clone()
        t[0] = t[0].flip(0)
        return t

    import torch
    build = {
        "top_scores_index float": ("top_scores_index", lambda t: t.float(), "top_scores_index"),
        "parent_list float": ("parent_list", lambda t: t.float(), "parent_list"),
        "seq_lens float": ("seq_lens", lambda t: t.float(), "seq_lens"),
        "verified_id float": ("verified_id", lambda t: t.float(), "verified_id"),
        "draft_tokens float": ("draft_tokens", lambda t: t.float(), "draft_tokens"),
        "verified_id 2-D": ("verified_id", lambda t: t.view(2, 1), "verified_id"),
        "seq_lens short": ("seq_lens", lambda t: t[:1], "seq_lens"),
        "parent_list narrow": ("parent_list", lambda t: t[:, :2], "parent_list"),
        "topk float": ("topk", 2.0, "topk"), "topk 0": ("topk", 0, "topk"), "spec_steps 0": ("spec_steps", 0,
                                                                                            "spec_steps"),
        "one node": ("num_verify_tokens", 1, "num_verify_tokens"),
        "more nodes than candidates": ("num_verify_tokens", 12, "num_verify_tokens"),
        "seq_lens_sum negative": ("seq_lens_sum", -1, "seq_lens_sum"),
        "mask_mode unknown": ("mask_mode", "fulll", "mask_mode"),
        "duplicate top_scores_index": ("top_scores_index", dup, "top_scores_index"),
        "unsorted top_scores_index": ("top_scores_index", unsorted, "top_scores_index"),
        "top_scores_index out of range": ("top_scores_index", lambda t: t + 100, "top_scores_index"),
        "flags short": ("flags", torch.zeros(1, dtype=torch.int32), "flags"),
    }
    for backend in ("reference", "kernel"):
        for name, (key, change, needle) in build.items():
            if key in ("seq_lens_sum", "flags"):
                fn = tree_call(backend, (None, None), **{key: change})
            else:
                fn = tree_call(backend, (key, change))
            out.append(api(cls, f"build_tree[{backend}] {name}", fn, needle))

        if backend == "kernel":
            for name, change, bit in (("duplicate", dup, "FLAG_UNSORTED"), ("unsorted", unsorted, "FLAG_UNSORTED")):
                def flagged(change=change, bit=bit):
                    from verifybench.kernels.tree import api as tree
                    flags = torch.zeros(2, dtype=torch.int32)
                    tree_call("kernel", ("top_scores_index", change), flags=flags)()
                    return [bool(f & getattr(tree, bit)) for f in flags.tolist()]
                out.append(api(cls, f"build_tree[kernel] {name} top_scores_index with flags: flagged", flagged,
                               bad=False, check=lambda r: (r.value == [True, False], f"flagged rows: {r.value}")))

        def wrong_sum(backend=backend):
            import torch  # noqa: F401
            from verifybench.kernels.tree import api as tree
            from verifybench.kernels.tree.inputs import random_tree
            inp = random_tree(2, 2, 3, 6, 50, seed=0, context=40)
            return tree.build_tree(**inp, mask_mode="full", backend=backend, seq_lens_sum=int(inp["seq_lens"].sum()) + 1)
        out.append(api(cls, f"build_tree[{backend}] seq_lens_sum disagrees with seq_lens", wrong_sum, "seq_lens_sum"))

        def organize(change, backend=backend, **kw):
            def fn():
                from verifybench.kernels.tree import api as tree
                from verifybench.kernels.tree.inputs import random_draft
                s, t, p = random_draft(2, 2, 3, 50)
                s, t, p, d = change(s, t, p, 6)
                return [x.shape for x in tree.organize_draft_results(s, t, p, d, backend=backend, **kw)]
            return fn

        def nan_scores(s, t, p, d):
            s[1][1, 1, 0] = float("nan")
            return s, t, p, d

        for name, change, needle in (
                ("empty lists", lambda s, t, p, d: ([], [], [], d), "lists"),
                ("lists of unequal length", lambda s, t, p, d: (s, t[:2], p, d), "token_list"),
                ("topk 0", lambda s, t, p, d: ([x[..., :0] for x in s], t, p, d), "topk"),
                ("float tokens", lambda s, t, p, d: (s, [x.float() for x in t], p, d), "token_list"),
                ("integer scores", lambda s, t, p, d: ([(x * 100).long() for x in s], t, p, d), "score_list"),
                ("float parents", lambda s, t, p, d: (s, t, [x.float() for x in p], d), "parents_list"),
                ("batch mismatch", lambda s, t, p, d: (s, [t[0][:1]] + t[1:], p, d), "token_list"),
                ("num_verify_tokens 1", lambda s, t, p, d: (s, t, p, 1), "num_verify_tokens"),
                ("more nodes than candidates", lambda s, t, p, d: (s, t, p, 12), "num_verify_tokens"),
                ("NaN draft score, no flags", nan_scores, "NaN")):
            out.append(api(cls, f"organize[{backend}] {name}", organize(change), needle))

        def verify_call(pos, change, backend=backend):
            def fn():
                import torch
                from verifybench.kernels.tree import api as tree
                from verifybench.kernels.tree.inputs import random_tree
                _, _, index, nxt, sib, tokens = tree.build_tree(**random_tree(2, 2, 3, 6, 50, seed=0, context=40),
                                                                mask_mode="qlen_only", backend="reference")
                args = [tokens.view(2, 6), index, nxt, sib, torch.zeros(12, dtype=torch.int64), 4]
                args[pos] = change(args[pos]) if callable(change) else change
                return [x.shape for x in tree.verify_tree_greedy(*args, backend=backend)]
            return fn

        for name, pos, change, needle in (("candidates float", 0, lambda t: t.float(), "candidates"),
                                          ("candidates 1-D", 0, lambda t: t.flatten(), "candidates"),
                                          ("retrieve_index float", 1, lambda t: t.float(), "retrieve_index"),
                                          ("retrieve_next_sibling short", 3, lambda t: t[:, :5], "retrieve_next_sibling"),
                                          ("target_predict float", 4, lambda t: t.float() + 0.5, "target_predict"),
                                          ("target_predict short", 4, lambda t: t[:11], "target_predict"),
                                          ("num_spec_steps 0", 5, 0, "num_spec_steps")):
            out.append(api(cls, f"verify_tree_greedy[{backend}] {name}", verify_call(pos, change), needle))

        def argmax_call(logits_fn, backend=backend):
            def fn():
                from verifybench.kernels.tree import api as tree
                return tree.argmax(logits_fn(), backend=backend).shape
            return fn

        out.append(api(cls, f"argmax[{backend}] vocab 0", argmax_call(lambda: torch.zeros(3, 0)), "vocab"))
        out.append(api(cls, f"argmax[{backend}] integer logits",
                       argmax_call(lambda: torch.zeros(3, 5, dtype=torch.int32)), "logits"))
    return out


def moe_cases() -> list[Case]:
    cls = "moe-api"
    out = []

    def m(name, call, needle="", **kw):
        def fn():
            from verifybench.kernels.moe_int4 import reference as moe
            return call(moe)
        out.append(api(cls, name, fn, needle, **kw))

    import torch

    def one_nan(shape, pos):
        def make():
            w = torch.randn(*shape)
            w[pos] = float("nan")
            return w
        return make

    m("quantize_w4a16 with one NaN weight", lambda moe: moe.quantize_w4a16(one_nan((3, 4, 64), (1, 2, 37))())[1].shape,
      "non-finite")
    m("quantize_w4a16 with one inf weight", lambda moe: moe.quantize_w4a16(one_nan((4, 32), (3, 5))().nan_to_num(
        posinf=1.0, neginf=-1.0, nan=float("inf")))[1].shape, "non-finite")
    m("quantize_w4a16 group 0", lambda moe: moe.quantize_w4a16(torch.randn(4, 32), group_size=0), "group_size")
    m("quantize_w4a16 group does not divide", lambda moe: moe.quantize_w4a16(torch.randn(4, 40), group_size=32),
      "group")
    for args, needle in (((1, 8, 16), "topk"), ((3, 8, 0), "topk"), ((-1, 8, 4), "n"), ((1, 0, 4), "num_experts"),
                         ((1.5, 8, 2), "n"), ((2, 8, float("nan")), "topk")):
        m(f"expected_distinct_experts{args}", lambda moe, a=args: moe.expected_distinct_experts(*a), needle)
    m("expected_distinct_experts stays within [0, E]", lambda moe: max(
        moe.expected_distinct_experts(n, e, k) / e for e in (1, 8, 384) for k in {1, min(8, e), e} for n in range(40)),
      bad=False, check=lambda r: (r.kind == "return" and r.value <= 1.0, f"max value / E = {r.value}"))

    def dense(pos, change):
        def call(moe):
            torch.manual_seed(0)
            x = torch.randn(3, 64)
            tw, ids = moe.route_uniform(3, 4, 2, seed=0)
            args = [x, torch.randn(4, 64, 64), torch.randn(4, 64, 32), tw, ids]
            args[pos] = change(args[pos])
            return moe.moe_dense_torch(*args).shape
        return call

    for name, pos, change, needle in (("ids float", 4, lambda t: t.float() + 0.5, "topk_ids"),
                                      ("ids out of range", 4, lambda t: t + 4, "out of range"),
                                      ("ids negative", 4, lambda t: t - 4, "out of range"),
                                      ("topk 0", 4, lambda t: t[:, :0], "topk"),
                                      ("weights shape", 3, lambda t: t[:, :1], "topk_weights"),
                                      ("w2 shape", 2, lambda t: t[:, :-1], "w2"),
                                      ("x int", 0, lambda t: t.int(), "x")):
        m(f"moe_dense_torch {name}", dense(pos, change), needle)

    def nan_token(moe):
        torch.manual_seed(0)
        x = torch.randn(3, 64)
        x[0, 5] = float("nan")
        tw, ids = moe.route_uniform(3, 4, 2, seed=0)
        y = moe.moe_dense_torch(x, torch.randn(4, 64, 64), torch.randn(4, 64, 32), tw, ids)
        return [bool(torch.isfinite(row).all()) for row in y]

    m("moe_dense_torch: a NaN activation stays in its own token", nan_token, bad=False,
      check=lambda r: (r.value == [False, True, True], f"finite rows: {r.value}"))
    ids = torch.tensor([[1, 2], [2, 1], [5, 1]])
    for name, call, needle in (
            ("route_uniform m -1", lambda moe: moe.route_uniform(-1, 8, 2), "m"),
            ("route_uniform topk > E", lambda moe: moe.route_uniform(4, 8, 9), "topk"),
            ("route_uniform topk 0", lambda moe: moe.route_uniform(4, 8, 0), "topk"),
            ("route_skewed hot_factor 0", lambda moe: moe.route_skewed(4, 8, 2, hot_factor=0), "hot_factor"),
            ("route_skewed hot_factor nan", lambda moe: moe.route_skewed(4, 8, 2, hot_factor=float("nan")), "hot_factor"),
            ("route_skewed hot_experts 9", lambda moe: moe.route_skewed(4, 8, 2, hot_experts=9), "hot_experts"),
            ("trace_windows float trace", lambda moe: moe.trace_windows(ids.float(), 1, 2), "trace"),
            ("trace_windows m 0", lambda moe: moe.trace_windows(ids, 0, 2), "m"),
            ("trace_windows count 0", lambda moe: moe.trace_windows(ids, 1, 0), "count"),
            ("moe_bytes float ids", lambda moe: moe.moe_bytes(ids.float(), 64, 100), "topk_ids"),
            ("moe_bytes 1-D ids", lambda moe: moe.moe_bytes(ids[0], 64, 100), "topk_ids"),
            ("expert_bytes_int4 group 0", lambda moe: moe.expert_bytes_int4(64, 32, 0), "group_size"),
            ("expert_bytes_int4 group 12", lambda moe: moe.expert_bytes_int4(64, 32, 12), "8"),
            ("load_routing_trace missing", lambda moe: moe.load_routing_trace("/no/such/trace.json"), "trace")):
        m(name, call, needle)
    return out
