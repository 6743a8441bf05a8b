"""The mla_verify component on CPU (the interpreter, fp16, tiny preset): its cases, one case of each variant checked
and timed end to end, its table and chart, --tokens reaching the cases and bad token counts refused.
"""
import argparse
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported (conftest too)

from verifybench.harness import components, run  # noqa: E402
from verifybench.harness.components import mla_verify  # noqa: E402
from verifybench.harness.measure.results.store import WITHHELD  # noqa: E402

NAME = "mla_verify"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke profile's shapes and timings")


@pytest.fixture(scope="module")
def all_records():
    """One chain case of each variant, run through CaseSpec.run() (check, then time); the engine's row is skipped
    where SGLang cannot be imported (CI fetches it into .ci/engines)."""
    specs = mla_verify.cases("tiny", 1, 64, None)
    try:
        yield [spec.run().as_dict() for spec in specs if spec.params["tokens"] == 3]
    finally:
        mla_verify.release()


@pytest.fixture(scope="module")
def records(all_records):
    """Our two kernels' records."""
    return [r for r in all_records if r["params"]["variant"] in ("extend", "split_kv")]


def _sglang_importable() -> bool:
    from verifybench.harness import engines
    from verifybench.harness.engines import sglang

    try:
        sglang.extend_module()
    except engines.EngineMissing:
        return False
    return True


def test_component_is_registered_after_mla_decode_and_keeps_the_protocol():
    assert components.REGISTRY.index("mla_verify") == components.REGISTRY.index("mla_decode") + 1
    assert components.load("mla_verify") is mla_verify


@cpu_only
def test_cpu_cases_are_both_variants_of_a_chain_at_the_tiny_shapes():
    specs = mla_verify.cases("tiny", 1, 64, None)
    assert [(s.params["variant"], s.params["tokens"], s.params["tree"], s.params["context"]) for s in specs] == [
        ("extend", 3, "chain", 64), ("split_kv", 3, "chain", 64), ("sglang.extend", 3, "chain", 64),
        ("flashinfer.mla", 3, "chain", 64)]
    assert {s.mode for s in specs} == {"graph"} and {s.params["dtype"] for s in specs} == {"float16"}
    assert specs[0].params["heads"] == 4 and specs[0].params["DK"] == 40 and specs[0].params["layers"] == 3
    assert all(mla_verify.runs_here(s) for s in specs)


@cpu_only
def test_each_variant_checks_against_the_reference_then_is_timed(records):
    assert [r["params"]["variant"] for r in records] == ["extend", "split_kv"]
    for r in records:
        assert r["check"]["ok"], r["check"]["detail"]
        assert r["mode"] == "cpu-loop" and r["summary"]["median_us"] > 0
        d = r["derived"]
        assert d["per_forward_us"] == pytest.approx(r["summary"]["median_us"] * 3)
        assert d["bytes_moved"] == ((64 + 3) * 40 + 4 * 3 * (2 * 32 + 8)) * 2
        assert d["rotation"] == mla_verify.CPU_COPIES and d["config"] and d["config_source"]
        assert d["pdl"] is False  # off in the interpreter
        assert d["kernel"] == "ours"
    assert records[1]["derived"]["splits_launched"] == 2 and records[1]["derived"]["splits_used"] == 2


@cpu_only
def test_the_engines_extend_runs_beside_ours_checked_the_same_way_or_says_why_not(all_records):
    [r] = [r for r in all_records if r["params"]["variant"] == "sglang.extend"]
    if not _sglang_importable():
        assert r.get("skipped", "").startswith("the engine's rows: sglang") and "\n" not in r["skipped"]
        return
    assert r["check"]["ok"], r["check"]["detail"]
    assert r["derived"]["kernel"].startswith("sglang 0.5.10") and "launcher" in r["derived"]["config_source"]
    [(title, [row])] = [t for t in mla_verify.tables(all_records) if "near the limit" not in t[0]]
    assert row["sglang.extend_us"] > 0 and row["extend/sglang.extend"] == WITHHELD
    assert "sglang 0.5.10" in title


@cpu_only
def test_flashinfer_rows_say_in_one_line_why_they_cannot_run_on_cpu(all_records):
    [r] = [r for r in all_records if r["params"]["variant"] == "flashinfer.mla"]
    assert r["skipped"].startswith("the engine's rows: ") and "\n" not in r["skipped"]
    assert "CUDA GPU" in r["skipped"] or "not installed" in r["skipped"]


@cpu_only
def test_table_sets_the_variants_side_by_side_and_withholds_cpu_ratios(records):
    (title, rows), _ = mla_verify.tables(records)
    assert "extend" in title and "3 layers" in title
    [row] = rows
    assert (row["context"], row["n"], row["tree"]) == (64, 3, "chain")
    assert row["extend_us"] > 0 and row["split_kv_us"] > 0
    assert row["extend_per_forward_ms"] == pytest.approx(row["extend_us"] * 3 / 1e3)
    assert row["extend/split_kv"] == WITHHELD and row["extend_minus_split_kv_per_forward_ms"] == WITHHELD
    assert row["extend_eta"] == WITHHELD


@cpu_only
def test_our_kernels_carry_their_floors_and_the_engines_rows_none(all_records):
    ours = [r for r in all_records if r["params"]["variant"] in ("extend", "split_kv")]
    for r in ours:  # the interpreter's empty kernels, timed as the case was (cpu-loop)
        d = r["derived"]
        assert d["latency_floor_us"] > 0 and d["floor_us"] > 0
        assert d["bound"] == ("memory" if d["floor_us"] >= d["latency_floor_us"] else "latency")
        assert d["x_floor"] == pytest.approx(r["summary"]["median_us"] / max(d["floor_us"], d["latency_floor_us"]))
    split = next(r for r in ours if r["params"]["variant"] == "split_kv")["derived"]["latency_floor_launches"]
    assert [one["grid"] for one in split] == [[1, 2], [12, 1]]  # 12 rows in one block x 2 splits, then the combine
    assert not any("latency_floor_us" in r["derived"] for r in all_records if r not in ours)


@cpu_only
def test_the_floors_table_names_each_of_our_kernels_and_withholds_cpu_floors(records):
    _, (title, rows) = mla_verify.tables(records)
    assert title.startswith("MLA verify, our kernels, near the limit") and "empty kernels" in title
    assert [(r["variant"], r["grids"]) for r in rows] == [("extend", "1x4x1"), ("split_kv", "1x2+12x1")]
    assert all(r["us"] > 0 and r["lat_floor_us"] == r["bound"] == r["x_floor"] == WITHHELD for r in rows)
    gpu = mla_verify.tables([{**r, "device": "cuda"} for r in records])[1][1]
    assert [r["bound"] for r in gpu] == [r["derived"]["bound"] for r in records]


@cpu_only
def test_chart_is_one_png_named_with_the_stamp(records, tmp_path):
    [path] = mla_verify.charts(records, tmp_path, "20260101T000000Z")
    assert path.name == "mla_verify-20260101T000000Z.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert mla_verify.charts([], tmp_path, "x") == []


def _chart_axes(records, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    mla_verify.charts(records, tmp_path, "x")
    return figs[0].axes[0]


def test_chart_has_log_axes_where_contexts_span_and_split_kv_sits_10x_below_extend(tmp_path, monkeypatch):
    records = [{"name": f"mla_verify/{v}/{c}", "check": {"ok": True}, "summary": {"median_us": t * c / 1024},
                "params": {"variant": v, "tree": "chain", "tokens": 3, "context": c}}
               for v, t in (("extend", 500.0), ("split_kv", 20.0)) for c in (1024, 8192, 65536)]
    ax = _chart_axes(records, tmp_path, monkeypatch)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


@cpu_only
def test_cpu_chart_of_one_point_per_series_has_linear_axes_and_a_color_and_marker_per_series(records, tmp_path,
                                                                                             monkeypatch):
    ax = _chart_axes(records, tmp_path, monkeypatch)
    assert ax.get_xscale() == "linear" and ax.get_yscale() == "linear"  # one context: no log-log of single points
    lines = ax.get_lines()
    assert len(lines) == 2 and lines[0].get_color() != lines[1].get_color()
    assert lines[0].get_marker() != lines[1].get_marker()


@cpu_only
def test_cli_tokens_reach_the_cases_and_the_tree_joins_at_its_draft_count():
    parser = argparse.ArgumentParser()
    run.add_scope_arguments(parser)
    args = parser.parse_args(["--tokens", "2,5"])
    args.command = NAME
    scope = run.resolve_scope(args)
    specs = mla_verify.cases(scope["preset"], scope["tp"], scope["context"], scope["tokens"])
    assert sorted({s.params["tokens"] for s in specs}) == [2, 5] and {s.params["tree"] for s in specs} == {"chain"}
    specs = mla_verify.cases("tiny", 1, 64, (8,))
    assert [(s.params["tree"], s.params["variant"]) for s in specs] == [
        ("chain", "extend"), ("chain", "split_kv"), ("chain", "sglang.extend"), ("chain", "flashinfer.mla"),
        ("5,4,8", "extend"), ("5,4,8", "split_kv"), ("5,4,8", "sglang.extend"), ("5,4,8", "flashinfer.mla")]


@cpu_only
def test_the_branching_tree_case_passes_its_check():
    [spec] = [s for s in mla_verify.cases("tiny", 1, 64, (8,)) if s.params["tree"] != "chain"
              and s.params["variant"] == "extend"]
    try:
        _, check, _ = spec.prepare()
        ok, detail = check()
    finally:
        mla_verify.release()
    assert ok, detail


@pytest.mark.parametrize("tokens", [(0,), (3, 65), (True,)])
def test_a_bad_token_count_is_a_value_error(tokens):
    with pytest.raises(ValueError, match="--tokens"):
        mla_verify.cases("tiny", 1, 64, tokens)


@cpu_only
def test_a_full_size_preset_on_cpu_is_a_value_error():
    with pytest.raises(ValueError, match="needs a GPU"):
        mla_verify.cases("kimi-k2.5", 8, 4096, None)


def test_mla_verify_benchmark_without_a_case_here_skips_saying_why(monkeypatch):
    import importlib.util
    from pathlib import Path

    from verifybench.harness.components import mla_verify as component

    monkeypatch.setattr(component, "runs_here", lambda spec: False)  # a CPU without TRITON_INTERPRET=1
    path = Path(__file__).resolve().parents[2] / "microbench" / "bench_mla_verify.py"
    spec = importlib.util.spec_from_file_location("bench_mla_verify_here", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (param,) = module.PARAMS  # not an empty set, which pytest reports as "got empty parameter set"
    (mark,) = param.marks
    assert mark.name == "skip" and "TRITON_INTERPRET=1" in mark.kwargs["reason"]


# ---- B requests at once (--batch) ----

def _requests(batch: int, tree: bool, seed: int = 3):
    """B requests of unequal contexts in one cache, at the tiny shapes (4 heads, DK 40 = 32 + 8), fp16: starts,
    prefix lengths, a chain or a random tree per request, q [heads, B * D, DK]."""
    from verifybench.kernels.tree import api as tree_api
    from verifybench.kernels.tree.inputs import random_tree

    lens, d, dk = [41, 6, 23][:batch], (8 if tree else 3), 40
    firsts = [2 + sum(lens[:b]) + b * (d + 3) for b in range(batch)]  # gaps between the regions
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(firsts[-1] + lens[-1] + d + 2, dk, generator=gen).half()
    q = torch.randn(4, batch * d, dk, generator=gen).half()
    if tree:
        inp = random_tree(batch, 4, 5, d, 100, seed=seed, context=8, spread=0)
        mask = tree_api.build_tree(**inp, mask_mode="qlen_only", backend="reference")[0].contiguous()
    else:
        mask = torch.ones(d, d, dtype=torch.bool).tril().expand(batch, d, d).contiguous()
    return (q, cache, torch.tensor(firsts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), mask)


@cpu_only
@pytest.mark.parametrize("batch, tree", [(2, False), (3, True)], ids=["B2-chain", "B3-tree"])
def test_b_requests_of_unequal_contexts_equal_each_request_run_alone_and_the_reference(batch, tree):
    q, cache, starts, lens, mask = _requests(batch, tree)
    d = q.shape[1] // batch
    variants = ["extend", "split_kv"] + (["sglang.extend"] if _sglang_importable() else [])
    for variant in variants:
        cfg = mla_verify.variant_config(variant, "cpu")[0] if not variant.startswith("sglang.") else None

        def calls(starts, lens, mask):
            return mla_verify._calls(variant, cfg, False, starts, lens, mask, 32, 0.2, (4, 8), q.dtype)

        out = calls(starts, lens, mask)(q, cache)
        for b in range(batch):
            one = calls(starts[b:b + 1], lens[b:b + 1], mla_verify.request_mask(mask, batch, d, b))
            rows = slice(b * d, (b + 1) * d)
            torch.testing.assert_close(out[:, rows], one(q[:, rows].contiguous(), cache), msg=variant)
        ok, detail = mla_verify.check_requests(
            calls(starts, lens, mask), lambda b: calls(starts[b:b + 1], lens[b:b + 1],
                                                       mla_verify.request_mask(mask, batch, d, b)),
            q, cache, starts, lens, mask, 32, 0.2)
        assert ok and f"each of {batch} requests run alone" in detail, (variant, detail)


@cpu_only
def test_batch_cases_carry_it_keep_the_one_request_names_and_name_the_others():
    one = mla_verify.cases("tiny", 1, 64, None)
    both = mla_verify.cases("tiny", 1, 64, None, batch=(1, 2))
    assert [s.name for s in both[:len(one)]] == [s.name for s in one]  # B = 1: the baselines' names
    assert {s.params["batch"] for s in one} == {1}
    assert [s.name for s in both[len(one):]] == [s.name.replace("/ctx64/", "/ctx64/B2/") for s in one]
    assert {s.params["batch"] for s in both[len(one):]} == {2}


@cpu_only
def test_a_b2_case_checks_each_request_and_counts_both_requests_bytes():
    [spec] = [s for s in mla_verify.cases("tiny", 1, 64, None, batch=(2,)) if s.params["variant"] == "split_kv"]
    try:
        rec = spec.run().as_dict()
    finally:
        mla_verify.release()
    assert rec["name"] == "mla_verify/tiny-tp1/ctx64/B2/chain/split_kv/n3" and rec["params"]["batch"] == 2
    assert rec["check"]["ok"] and "each of 2 requests run alone" in rec["check"]["detail"]
    assert rec["derived"]["bytes_moved"] == 2 * ((64 + 3) * 40 + 4 * 3 * (2 * 32 + 8)) * 2
    assert rec["derived"]["cache_bytes"] == 2 * (64 + 3) * 40 * 2
    (_, [row]), (_, [near]) = mla_verify.tables([rec])
    assert "B" not in row and "B requests per call" in mla_verify.tables([rec])[0][0]
    # one launch of each kernel for both requests: the split kernel over 2 requests x 1 row block x 2 splits
    assert near["grids"] == "2x2+24x1" and near["bound"] == WITHHELD


def test_the_table_keys_rows_by_batch_and_takes_ratios_within_one():
    recs = [{"name": f"mla_verify/x/B{b}/{v}", "check": {"ok": True}, "device": "cuda",
             "summary": {"median_us": t * b},
             "params": {"preset": "tiny", "tp": 1, "context": 64, "tokens": 3, "tree": "chain", "batch": b, "layers": 3,
                        "variant": v},
             "derived": {"bytes_moved": 1e6 * b, "floor_us": 1.0, "eta": 0.5, "per_forward_us": 3 * t * b,
                         "kernel": "ours"}}
            for b in (1, 4) for v, t in (("extend", 30.0), ("split_kv", 10.0))]
    [(_, rows)] = mla_verify.tables(recs)
    assert [(r["B"], r["MB"]) for r in rows] == [(1, 1.0), (4, 4.0)]
    assert all(r["extend/split_kv"] == pytest.approx(3.0) for r in rows)


@cpu_only
def _missing():
    from verifybench.harness import engines

    raise engines.EngineMissing("sglang is not installed (pip show sglang: not found)")


def test_cli_batch_runs_both_batches_and_withholds_derived_figures(tmp_path, capsys, monkeypatch):
    from verifybench.harness.cli import main
    from verifybench.harness.engines import sglang

    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.05")  # the plumbing, not the figures
    monkeypatch.setattr(sglang, "extend_module", _missing)  # its B requests are checked above; the interpreter is slow
    assert main(["mla_verify", "--batch", "1,2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "withheld" in out and "B requests per call" in out
    [path] = tmp_path.glob("mla_verify-*.json")
    from verifybench.harness.measure.results import store

    run = store.read_json(path)
    ran = {(c["params"]["batch"], c["params"]["variant"]) for c in run["cases"] if c["check"]["ok"]}
    assert {(1, "extend"), (1, "split_kv"), (2, "extend"), (2, "split_kv")} <= ran
    assert run["extra"]["batch"] == [1, 2]


@pytest.mark.parametrize("given, says", [("0", "must be in 1..64"), ("1,1", "lists a batch size twice"),
                                         ("x", "takes positive integers"),
                                         ("32", "--batch 32 x --tokens 3 = 96 tokens per verify forward")])
def test_cli_refuses_a_bad_batch_in_one_line(given, says, tmp_path, capsys):
    from verifybench.harness.cli import main

    assert main(["mla_verify", "--batch", given, "--tokens", "3", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


# ---- B requests of spread contexts (--context-spread) ----

def test_the_spread_puts_the_requests_evenly_over_the_range_each_at_least_one_token():
    from verifybench.harness.analysis.numbers import spread_contexts

    assert spread_contexts(64, 4, 0.5) == (32, 53, 75, 96)  # 64 x (0.5, 0.833, 1.167, 1.5), rounded
    assert spread_contexts(64, 4, 0.0) == (64,) * 4 and spread_contexts(64, 1, 0.5) == (64,)
    assert spread_contexts(1, 3, 0.9) == (1, 1, 2)  # 0.1 rounds to 0: at least one token
    assert spread_contexts(1000, 5, 0.2) == spread_contexts(1000, 5, 0.2)  # no RNG: a rerun compares
    with pytest.raises(ValueError, match="passes 1048576"):
        spread_contexts(1 << 20, 2, 0.5)


@cpu_only
def test_a_spread_case_names_its_spread_records_its_contexts_and_lays_them_end_to_end():
    plain = mla_verify.cases("tiny", 1, 64, None, batch=(1, 4))
    spread = mla_verify.cases("tiny", 1, 64, None, batch=(1, 4), context_spread=0.5)
    assert [s.name for s in mla_verify.cases("tiny", 1, 64, None, batch=(1, 4), context_spread=0.0)] == \
        [s.name for s in plain]  # S = 0: the names compare keeps
    ones = [s for s in spread if s.params["batch"] == 1]
    assert [s.name for s in ones] == [s.name for s in plain if s.params["batch"] == 1]
    assert {(s.params["context_spread"], tuple(s.params["contexts"])) for s in ones} == {(0.0, (64,))}
    fours = [s for s in spread if s.params["batch"] == 4]
    assert all("/ctx64/B4/spread0.5/" in s.name and s.params["context"] == 64 for s in fours)
    assert {(s.params["context_spread"], tuple(s.params["contexts"])) for s in fours} == {(0.5, (32, 53, 75, 96))}
    starts, lens = mla_verify.layout((32, 53, 75, 96), "cpu")
    region = mla_verify.SPARE_ROWS
    assert starts.tolist() == [0, 32 + region, 32 + 53 + 2 * region, 32 + 53 + 75 + 3 * region]
    assert lens.tolist() == [32, 53, 75, 96]
    assert mla_verify.layout((64,) * 3, "cpu")[0].tolist() == [0, 64 + region, 2 * (64 + region)]  # as before


@cpu_only
def test_a_spread_case_checks_each_request_alone_and_counts_the_real_total():
    [spec] = [s for s in mla_verify.cases("tiny", 1, 64, None, batch=(3,), context_spread=0.5)
              if s.params["variant"] == "split_kv"]
    try:
        rec = spec.run().as_dict()
    finally:
        mla_verify.release()
    assert rec["name"] == "mla_verify/tiny-tp1/ctx64/B3/spread0.5/chain/split_kv/n3"
    assert rec["params"]["contexts"] == [32, 64, 96]
    assert rec["check"]["ok"] and "each of 3 requests run alone" in rec["check"]["detail"]
    total = 32 + 64 + 96
    assert rec["derived"]["bytes_moved"] == ((total + 3 * 3) * 40 + 4 * 3 * 3 * (2 * 32 + 8)) * 2
    assert rec["derived"]["cache_bytes"] == (total + 3 * 3) * 40 * 2
    (title, [row]), (_, [near]) = mla_verify.tables([rec])
    assert row["spread"] == 0.5 and "[c(1-S), c(1+S)]" in title
    assert near["spread"] == 0.5 and near["variant"] == "split_kv"


@cpu_only
def test_requests_of_a_spread_equal_each_request_run_alone_and_the_reference():
    """Both kernels over three requests laid out as the spread lays them: each request alone gives its rows."""
    contexts, d, dk, kv_lora = (20, 41, 62), 3, 40, 32
    starts, lens = mla_verify.layout(contexts, "cpu")
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(sum(contexts) + len(contexts) * mla_verify.SPARE_ROWS, dk, generator=gen).half()
    q = torch.randn(4, len(contexts) * d, dk, generator=gen).half()
    mask = torch.ones(d, d, dtype=torch.bool).tril().expand(len(contexts), d, d).contiguous()
    for variant in ("extend", "split_kv"):
        cfg, _ = mla_verify.variant_config(variant, "cpu")

        def calls(s, n, m, cfg=cfg, variant=variant):
            return mla_verify._calls(variant, cfg, None, s, n, m, kv_lora, 0.2)

        ok, detail = mla_verify.check_requests(
            calls(starts, lens, mask), lambda b: calls(starts[b:b + 1], lens[b:b + 1],
                                                       mla_verify.request_mask(mask, len(contexts), d, b)),
            q, cache, starts, lens, mask, kv_lora, 0.2)
        assert ok and "each of 3 requests run alone" in detail, (variant, detail)


@cpu_only
def test_a_spread_past_the_interpreters_context_is_refused_naming_the_longest_request():
    with pytest.raises(ValueError, match=r"--context 6144 \(the longest request's, --context-spread 0.5\)"):
        mla_verify.cases("tiny", 1, 4096, None, batch=(2,), context_spread=0.5)


@pytest.mark.parametrize("argv, says", [
    (["--context-spread", "-0.1", "--batch", "2"], "takes 0 <= S < 1"),
    (["--context-spread", "1", "--batch", "2"], "takes 0 <= S < 1"),
    (["--context-spread", "nan", "--batch", "2"], "takes 0 <= S < 1"),
    (["--context-spread", "x", "--batch", "2"], "not a number"),
    (["--context-spread", "0.5"], "with --batch 1 it changes nothing"),
    (["--context-spread", "0.5", "--batch", "1"], "with --batch 1 it changes nothing")])
def test_cli_refuses_a_bad_spread_in_one_line(argv, says, tmp_path, capsys):
    from verifybench.harness.cli import main

    assert main(["mla_verify", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "--context-spread" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_cli_spread_reaches_the_cases(tmp_path, capsys, monkeypatch):
    from verifybench.harness.cli import main
    from verifybench.harness.measure.results import store
    from verifybench.harness.engines import sglang

    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.05")  # the plumbing, not the figures
    monkeypatch.setattr(sglang, "extend_module", _missing)
    argv = ["mla_verify", "--batch", "2", "--context-spread", "0.25", "--tokens", "3", "--out", str(tmp_path)]
    if torch.cuda.is_available():
        argv += ["--context", "1024"]
    assert main(argv) == 0
    [path] = tmp_path.glob("mla_verify-*.json")
    run = store.read_json(path)
    ok = [c for c in run["cases"] if c["check"]["ok"]]
    assert ok and all(c["params"]["context_spread"] == 0.25 and "/B2/spread0.25/" in c["name"] for c in ok)
    assert run["extra"]["options"]["context_spread"] == 0.25
