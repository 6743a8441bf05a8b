"""`verifybench plan` (answers/plan.py) and the verify report's break-even with a cycle result's measured costs."""
import json
import math
from pathlib import Path

import pytest

from verifybench.harness.answers import plan
from verifybench.harness.cli import main as cli_main
from verifybench.harness.components import verify as bench_verify
from verifybench.harness.measure.results import store

VERIFY_BASELINE = Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1/verify.json"
DEPLOYMENT = ["--decode-ms", "11.1", "--verify-ms", "3:25.6,6:28.7", "--draft-ms", "1", "--reextend-ms", "0.3"]


def _cycle_case(steps, topk, d, attention="extend", ok=True, draft=1.0, verify=20.0, reextend=0.3, other=0.2,
                decode=10.0, device="cuda"):
    """A cycle case record as `verifybench cycle` stores it."""
    cycle_ms = draft + verify + reextend + other
    case = {"name": f"cycle/{steps},{topk},{d}/{attention}",
            "params": {"preset": "kimi-k2.5", "tp": 8, "context": 4096, "steps": steps, "topk": topk,
                       "draft_tokens": d, "attention": attention},
            "check": {"ok": ok, "detail": "tree and accepts match the reference" if ok else "mismatch"},
            "derived": {"phases_ms": {"draft": draft, "tree": other / 2, "verify": verify, "sync": other / 4,
                                      "bookkeeping": other / 4, "reextend": reextend},
                        "table_ms": {"draft": draft, "verify": verify, "reextend": reextend, "other": other},
                        "cycle_ms": cycle_ms, "decode_ms": decode, "bare_forward_ms": verify - 1.0}}
    if ok:
        case.update(mode="isolated", device=device, samples_us=[cycle_ms * 1e3] * 3,
                    summary={"n": 3, "median_us": cycle_ms * 1e3})
    return case


def _cycle_run(cases, gpu="NVIDIA H200"):
    run = store.make_run("cycle", [], {"gpu_model": gpu, "cuda_available": gpu != "cpu", "slug": "x"})
    run["cases"] = cases
    return run


def _save(tmp_path, run, name="cycle-20261201T000000Z.json"):
    return store.save_run(run, tmp_path, name=name)


def _json_rows(path):
    return {tuple(r["config_tuple"]): r for r in json.loads(Path(path).read_text())["rows"]}


def test_tau_from_rates_is_one_plus_cumulative_products_up_to_the_depth():
    assert plan.tau_from_rates([0.8, 0.7], (2, 1, 3)) == pytest.approx(1 + 0.8 + 0.8 * 0.7)
    assert plan.tau_from_rates([0.8, 0.7, 0.6], (5, 1, 3)) == pytest.approx(1 + 0.8 + 0.56)  # D-1 = 2 limits it
    assert plan.tau_from_rates([0.5], (5, 4, 8)) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625 + 0.03125)
    with pytest.raises(ValueError, match="depth 5"):
        plan.tau_from_rates([0.8, 0.7], (5, 1, 6))


def test_configs_refuse_a_tree_too_small_for_its_draft_tokens():
    assert plan.parse_configs("2,1,3; 5,4,8") == [(2, 1, 3), (5, 4, 8)]
    for bad in ("2,1,4", "1,1,1", "0,1,2", "2,x,3", "2,1", "2,1,3;2,1,3", ";"):
        with pytest.raises(ValueError, match="--configs"):
            plan.parse_configs(bad)


def test_keyed_values_take_d_or_steps_topk_d_keys():
    assert plan.parse_keyed("3:2.4,6:3.1", "--accept-len", 1) == {3: 2.4, 6: 3.1}
    assert plan.parse_keyed("5,4,8:3.3;2,1,3:2.4", "--accept-len", 1) == {(5, 4, 8): 3.3, (2, 1, 3): 2.4}
    assert plan.parse_keyed("3:2.4,5,4,8:3.3", "--accept-len", 1) == {3: 2.4, (5, 4, 8): 3.3}
    for bad in ("3", "3:nan", "3:inf", "3:0.5", "1,2:2", "x:2", "3:2,3:2.5"):
        with pytest.raises(ValueError, match="--accept-len"):
            plan.parse_keyed(bad, "--accept-len", 1)


def test_plan_from_numbers_reproduces_the_deployment_break_even(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", *DEPLOYMENT, "--accept-len", "3:2.4,6:3.1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = _json_rows(out)
    assert set(rows) == {(2, 1, 3), (5, 1, 6)}  # no accept length for the other defaults: not ranked, said so
    assert "not ranked" in text and "(3,1,4)" in text
    three, six = rows[(2, 1, 3)], rows[(5, 1, 6)]
    assert three["cycle_ms"] == pytest.approx(1 + 25.6 + 0.3 + plan.ASSUMED_OTHER_MS)
    assert three["tau_star"] == pytest.approx(27.0 / 11.1) and three["pays"] == "no"
    assert three["tok_s"] == pytest.approx(1000 * 2.4 / 27.0)
    assert six["speedup"] == pytest.approx(3.1 * 11.1 / 30.1) and six["pays"] == "yes"
    assert "best: (5,1,6)" in text and "3 vs 6 draft tokens" in text and "other 0.1 ms (ASSUMED)" in text


def test_plan_draws_the_verify_line_for_d_not_given_and_ranks_best_first(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", *DEPLOYMENT, "--accept-rates", "0.8,0.7,0.6,0.5,0.4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    toks = [r["tok_s"] for r in data["rows"]]
    assert toks == sorted(toks, reverse=True) and len(toks) == 4
    rows = _json_rows(out)
    assert rows[(3, 1, 4)]["verify_ms"] == pytest.approx(25.6 + 3.1 / 3) and rows[(3, 1, 4)]["verify_from"] == \
        "interpolated"
    assert rows[(5, 4, 8)]["verify_from"] == "extrapolated" and "least-squares line" in text
    assert "APPROXIMATION" in text  # a topk > 1 tree from per-depth rates


def test_plan_draft_per_step_scales_with_steps(tmp_path):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", "--decode-ms", "11.1", "--verify-ms", "3:25.6,6:28.7", "--draft-step-ms", "0.4",
                     "--configs", "2,1,3;5,1,6", "--accept-rates", "0.7", "--json", str(out)]) == 0
    rows = _json_rows(out)
    assert rows[(2, 1, 3)]["draft_ms"] == pytest.approx(0.8) and rows[(5, 1, 6)]["draft_ms"] == pytest.approx(2.0)


def test_plan_reads_a_cycle_result_skipping_failed_checks_and_other_attention(tmp_path, capsys):
    path = _save(tmp_path, _cycle_run([
        _cycle_case(2, 1, 3, verify=20.0), _cycle_case(5, 1, 6, verify=23.0),
        _cycle_case(2, 1, 3, attention="split_kv", verify=19.0), _cycle_case(3, 1, 4, ok=False)]))
    out = tmp_path / "plan.json"
    assert cli_main(["plan", str(path), "--attention", "extend", "--accept-len", "3:2.4,6:3.1", "--json",
                     str(out)]) == 0
    rows = _json_rows(out)
    assert set(rows) == {(2, 1, 3), (5, 1, 6)}
    assert rows[(2, 1, 3)]["cycle_ms"] == pytest.approx(21.5) and rows[(2, 1, 3)]["verify_from"] == "measured"
    assert rows[(2, 1, 3)]["tau_star"] == pytest.approx(21.5 / 10.0)  # the cycle run's own plain decode
    out = tmp_path / "plan-all.json"  # a new file: plan never replaces one
    assert cli_main(["plan", str(path), "--attention", "all", "--accept-len", "3:2.4", "--json", str(out)]) == 0
    labels = [r["config"] for r in json.loads(out.read_text())["rows"]]
    assert labels == ["(2,1,3) split_kv", "(2,1,3) extend"]
    capsys.readouterr()
    assert cli_main(["plan", str(path), "--attention", "flash", "--accept-len", "3:2.4"]) == 2
    assert "split_kv" in capsys.readouterr().err


def test_plan_reads_the_cycle_tables_profiler_column_names(tmp_path):
    case = _cycle_case(2, 1, 3, draft=1.0, verify=20.0, reextend=0.3, other=0.2)
    case["derived"]["table_ms"] = {"draft": 1.0, "target verify": 20.0, "draft re-extend": 0.3, "other": 0.2}
    (cost,) = plan.cycle_costs(_cycle_run([case]), "extend")[0].values()
    assert (cost.draft_ms, cost.overhead_ms) == (1.0, pytest.approx(0.5))  # other = re-extend + other
    del case["derived"]["table_ms"]["other"]
    with pytest.raises(ValueError, match="no 'other'"):
        plan.cycle_costs(_cycle_run([case]))


def test_plan_refuses_cost_flags_and_unknown_configs_with_a_cycle_result(tmp_path, capsys):
    path = _save(tmp_path, _cycle_run([_cycle_case(2, 1, 3)]))
    assert cli_main(["plan", str(path), "--draft-ms", "1", "--accept-len", "3:2.4"]) == 2
    assert "--draft-ms" in capsys.readouterr().err
    assert cli_main(["plan", str(path), "--configs", "5,1,6", "--accept-len", "6:2.4"]) == 2
    assert "(5, 1, 6)" in capsys.readouterr().err


def test_plan_refuses_a_cpu_smoke_result(tmp_path, capsys):
    path = _save(tmp_path, _cycle_run([_cycle_case(2, 1, 3, device="cpu")], gpu="cpu"))
    assert cli_main(["plan", str(path), "--accept-len", "3:2.4"]) == 2
    assert "CPU" in capsys.readouterr().err


def test_plan_reads_a_verify_result_with_assumed_draft_costs(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", str(VERIFY_BASELINE), "--accept-rates", "0.7", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    full = {c["params"]["tokens"]: c["summary"]["median_us"] / 1e3 for c in store.load_run(VERIFY_BASELINE)["cases"]
            if c["check"]["ok"] and c["params"]["variant"] == "full"}
    row = _json_rows(out)[(5, 1, 6)]
    assert row["verify_ms"] == pytest.approx(full[6]) and row["verify_from"] == "measured"
    assert row["tau_star"] == pytest.approx(row["cycle_ms"] / full[1])
    assert row["draft_ms"] == pytest.approx(5 * plan.ASSUMED_DRAFT_STEP_MS) and "ASSUMED" in text
    assert cli_main(["plan", str(VERIFY_BASELINE), "--verify-ms", "3:1", "--accept-rates", "0.7"]) == 2


@pytest.mark.parametrize("argv, says", [
    (["--accept-rates", "1.2"], "--accept-rates"),
    (["--accept-rates", "nan"], "--accept-rates"),
    (["--accept-len", "3:3.5"], "outside 1..3"),
    (["--accept-len", "7:2"], "none of its keys"),
    (["--accept-len", "3:2", "--configs", "2,1,3;5,1,6"], "no accept length for"),
    (["--accept-len", "3:2", "--draft-step-ms", "1"], "give one"),
])
def test_plan_refuses_bad_input_in_one_line(argv, says, capsys):
    assert cli_main(["plan", *DEPLOYMENT, *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_plan_needs_costs_and_a_line_needs_two_points(capsys):
    assert cli_main(["plan", "--accept-len", "3:2"]) == 2
    assert "--decode-ms" in capsys.readouterr().err
    assert cli_main(["plan", "--decode-ms", "11", "--verify-ms", "3:25", "--accept-rates", "0.7"]) == 2
    assert "one point" in capsys.readouterr().err
    assert cli_main(["plan", "--decode-ms", "11", "--verify-ms", "3:25", "--configs", "2,1,3",
                     "--accept-rates", "0.7"]) == 0


CYCLE_BASELINE = VERIFY_BASELINE.with_name("cycle.json")


def test_plan_on_a_cycle_file_ranks_every_attention_variant_by_default(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", str(CYCLE_BASELINE), "--accept-len", "3:2.4,6:3.1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["attention"] for r in rows} == {"extend", "split_kv"} and rows[0]["attention"] == "split_kv"
    assert "every variant in the file ranked (extend, split_kv)" in capsys.readouterr().out


def test_plan_on_one_attention_variant_says_the_file_holds_the_other(capsys):
    assert cli_main(["plan", str(CYCLE_BASELINE), "--attention", "extend", "--accept-len", "3:2.4"]) == 0
    assert "extend only; the file also holds split_kv" in capsys.readouterr().out


def test_plan_t_decode_of_one_cycle_file_is_the_same_whatever_attention_is_planned(tmp_path):
    run = store.load_run(CYCLE_BASELINE)
    decodes = {plan.cycle_costs(run, a)[1] for a in ("all", "extend", "split_kv")}
    want = sorted(c["derived"]["decode_ms"] for c in run["cases"] if c["check"]["ok"])
    assert len(decodes) == 1 and decodes.pop() == pytest.approx((want[3] + want[4]) / 2)


def test_plan_never_prints_a_negative_overhead_and_names_the_cases_it_floored(tmp_path, capsys):
    path = _save(tmp_path, _cycle_run([_cycle_case(2, 1, 3, reextend=0.3, other=-0.5)]))
    out = tmp_path / "plan.json"
    assert cli_main(["plan", str(path), "--accept-len", "3:2.4", "--json", str(out)]) == 0
    row = _json_rows(out)[(2, 1, 3)]
    assert row["overhead_ms"] == pytest.approx(0.3) and row["cycle_ms"] == pytest.approx(20.8)  # the measured cycle
    assert "other shown as 0" in capsys.readouterr().out and "(2,1,3) extend -0.50 ms" in json.dumps(
        json.loads(out.read_text())["notes"])


def test_plan_breakeven_and_the_verify_report_assume_one_overhead():
    from verifybench.harness.analysis import breakeven
    from verifybench.harness.cli import build_parser
    args = build_parser().parse_args(["breakeven", "--accept-len", "2"])
    assert args.overhead_ms == pytest.approx(plan.ASSUMED_REEXTEND_MS + plan.ASSUMED_OTHER_MS)
    assert bench_verify.ASSUMED_OVERHEAD_MS is breakeven.ASSUMED_OVERHEAD_MS
    assert args.draft_ms == pytest.approx(2 * plan.ASSUMED_DRAFT_STEP_MS)


def test_plan_with_one_verify_point_names_only_the_draft_tokens_given(capsys):
    assert cli_main(["plan", "--decode-ms", "11", "--verify-ms", "3:25", "--accept-len", "3:2"]) == 2
    err = capsys.readouterr().err
    assert "one point (D=3)" in err and "whose D is 3" in err and "plan only" not in err


@pytest.mark.parametrize("verify_ms, configs", [("3:25,4:20", "5,1,6"), ("4:5,5:1", "4,1,5;5,1,6")])
def test_plan_refuses_to_draw_out_verify_times_that_fall_with_d(verify_ms, configs, capsys):
    # a line falling with D, drawn past the points, gives shrinking and then negative cycles and tok/s
    assert cli_main(["plan", "--decode-ms", "11", "--verify-ms", verify_ms, "--configs", configs,
                     "--accept-rates", "0.7"]) == 2
    assert "fall with D" in capsys.readouterr().err


def test_newest_cycle_is_the_latest_stamped_file(tmp_path):
    assert plan.newest_cycle(tmp_path) is None
    for stamp in ("20261201T000000Z", "20261202T000000Z"):
        _save(tmp_path, _cycle_run([_cycle_case(2, 1, 3)]), name=f"cycle-{stamp}.json")
    assert plan.newest_cycle(tmp_path).name == "cycle-20261202T000000Z.json"


def _verify_table():
    return [{"n": n, "measured_us": 10_000.0 + 1_000.0 * n} for n in range(1, 7)]


def test_verify_break_even_without_a_cycle_is_labelled_assumed_for_the_pcie_deployment():
    rows = bench_verify.break_even_rows(_verify_table())
    assert rows[2]["break-even accept len"] == pytest.approx((1.0 + 13.0 + 0.4) / 11.0)
    title = bench_verify.break_even_title()
    assert "ASSUMED" in title and "RTX PRO 6000" in title and "H200" not in title


def test_verify_break_even_shows_only_the_rows_the_cycle_measured_draft_and_overhead_for():
    cycle = _cycle_run([_cycle_case(2, 1, 3, draft=2.0, reextend=0.5, other=0.5),
                        _cycle_case(3, 2, 3, draft=3.0, reextend=0.5, other=0.5),  # dearer at the same D
                        _cycle_case(5, 1, 6, draft=4.0, reextend=0.5, other=1.0)])
    rows = {r["n"]: r for r in bench_verify.break_even_rows(_verify_table(), cycle)}
    # overhead: the cycle beyond its draft and its bare forward (here 1 ms below the cycle's verify phase)
    assert rows[3]["break-even accept len"] == pytest.approx((2.0 + 13.0 + 2.0) / 11.0)
    assert rows[3]["draft+overhead"] == "measured (2,1,3) extend"
    assert rows[6]["cycle_ms"] == pytest.approx(4.0 + 16.0 + 2.5)
    assert sorted(rows) == [3, 6]  # only the measured rows: never an ASSUMED row beside them
    title = bench_verify.break_even_title(cycle, "cycle-X.json")
    assert "(cycle result cycle-X.json, the cheapest case) at n = 3, 6" in title and "ASSUMED" not in title
    assert f"cycle-{store.stamp(cycle)}.json" in bench_verify.break_even_title(cycle)


def test_verify_break_even_ignores_a_cpu_cycle_result_and_says_so():
    cycle = _cycle_run([_cycle_case(2, 1, 3, draft=5.0, device="cpu")], gpu="cpu")
    rows = bench_verify.break_even_rows(_verify_table(), cycle)
    assert len(rows) == 6 and not any("draft+overhead" in r for r in rows)  # ASSUMED for all: in the title
    assert "CPU numbers, not used" in bench_verify.break_even_title(cycle)


# ---- B requests at once (cycle --batch): per batch, the largest B where a shape still pays ----

def _batch_case(b, context, steps, topk, d, attention, cycle_ms, decode_ms):
    case = _cycle_case(steps, topk, d, attention, draft=1.0, verify=cycle_ms - 1.5, reextend=0.3, other=0.2,
                       decode=decode_ms)
    case["name"] = f"cycle/kimi-k2.5-tp8/ctx{context}/" + (f"B{b}/" if b > 1 else "") + f"s{steps}k{topk}d{d}/{attention}"
    case["params"].update(batch=b, context=context)
    case["derived"].update(allreduce_bytes=b * d * 7168 * 2, beyond_bare_total_ms=1.0, beyond_bare_ms={"sync": 0.1},
                           attention_per_forward_ms={"tree": 0.5, "decode (forward's)": 0.4})
    return case


def _batch_folder(tmp_path):
    """A GPU cycle file at B = 1, 2, 4, 8 and two contexts. Plain decode grows slowly with B (weights dominate), the
    cycle faster (B * D tokens): at tau 2.4, (2,1,3) pays up to B 4 at context 1024 and up to B 2 at 8192; (5,1,6) at
    tau 3.1 pays up to B 2 at 1024, at no B at 8192."""
    cases = []
    for ctx, grow in ((1024, 1.0), (8192, 1.6)):
        for b in (1, 2, 4, 8):
            decode = 10.0 + 0.5 * b * grow
            for (steps, topk, d), cycle in (((2, 1, 3), decode * {1: 1.5, 2: 1.8, 4: 2.2, 8: 2.9}[b] * grow ** 0.5),
                                            ((5, 1, 6), decode * {1: 2.0, 2: 2.5, 4: 3.3, 8: 4.4}[b] * grow)):
                for att, f in (("extend", 1.0), ("split_kv", 0.95)):
                    cases.append(_batch_case(b, ctx, steps, topk, d, att, cycle * f, decode))
    _save(tmp_path, _cycle_run(cases))
    return tmp_path


def test_batches_name_the_largest_paying_b_per_shape_and_context(tmp_path):
    from verifybench.harness.analysis import batches

    run = store.load_run(next(_batch_folder(tmp_path).glob("cycle-*.json")))
    taus = {3: 2.4, 6: 3.1}
    table = batches.rows(run, lambda c: taus[c[2]])
    largest = {(e["context"], e["attention"], e["config"]): e["largest_B"] for e in batches.largest_paying(table)}
    for ctx in (1024, 8192):  # the largest B where tau * T_decode(B) > T_cycle(B), computed here from the rows
        for r in table:
            assert r["speedup"] == pytest.approx(r["tau"] * r["decode_ms"] / r["cycle_ms"])
            assert r["tok_s_total"] == pytest.approx(r["B"] * r["tok_s_request"])
    assert largest[(1024, "extend", (2, 1, 3))] == 4 and largest[(8192, "extend", (2, 1, 3))] == 2
    assert largest[(1024, "extend", (5, 1, 6))] == 2 and largest[(8192, "extend", (5, 1, 6))] is None
    best = {(r["context"], r["B"]): r for r in batches.best_per_batch(table)}
    assert best[(1024, 1)]["attention"] == "split_kv" and set(best) == {(c, b) for c in (1024, 8192)
                                                                        for b in (1, 2, 4, 8)}


def test_advise_per_batch_on_gpu_results_ranks_each_b_and_draws_the_chart(tmp_path, capsys):
    folder = _batch_folder(tmp_path)
    assert cli_main(["advise", str(folder), "--accept-len", "3:2.4,6:3.1"]) == 0
    out = capsys.readouterr().out
    assert "## Per batch" in out and "context 1024, B 8: best" in out
    assert "context 1024, (2,1,3) extend: B 4" in out and "context 8192, (5,1,6) extend: at no B measured" in out
    assert "B 8 x D 6 = 48 rows: 672 KiB per allreduce" in out
    assert list(folder.glob("cycle_batches-*.png")) and "chart: " in out


def test_advise_draws_no_chart_into_the_checkouts_results_but_where_it_is_told(tmp_path, capsys, monkeypatch):
    """A read of the curated baselines leaves them as committed: the chart goes to ./verifybench-results/ (here the
    working directory is tmp_path), or to --chart-dir."""
    folder = _batch_folder(tmp_path / "curated")
    monkeypatch.setattr(store, "CURATED", tmp_path / "curated")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["advise", str(folder), "--accept-len", "3:2.4,6:3.1"]) == 0
    assert not list(folder.glob("*.png")) and list((tmp_path / store.DEFAULT_OUT).glob("cycle_batches-*.png"))
    assert cli_main(["advise", str(folder), "--chart-dir", str(tmp_path / "mine")]) == 0
    assert list((tmp_path / "mine").glob("cycle_batches-*.png")) and not list(folder.glob("*.png"))
    capsys.readouterr()


def test_plan_on_a_batched_cycle_ranks_the_smallest_batch_then_each_b(tmp_path, capsys):
    folder = _batch_folder(tmp_path)
    assert cli_main(["plan", str(folder), "--context", "1024", "--accept-len", "3:2.4,6:3.1"]) == 0
    out = capsys.readouterr().out
    assert "at batch 1 (--batch picks another)" in out and "largest B where each shape still pays" in out
    assert cli_main(["plan", str(folder), "--context", "1024", "--batch", "4", "--accept-len", "3:2.4,6:3.1"]) == 0
    assert "at batch 4" in capsys.readouterr().out
    assert cli_main(["plan", str(folder), "--context", "1024", "--batch", "3", "--accept-len", "3:2.4"]) == 2
    assert "--batch 3: the cycle result holds batches [1, 2, 4, 8]" in capsys.readouterr().err


# ---- each B costed at its own allreduce message size (B * D rows x hidden x 2 bytes) ----

AR_TOKENS = (1, 2, 4, 8, 16, 32)  # measured sizes: 14 KiB .. 448 KiB; B 8 x D 6 = 48 rows lies beyond them
STAND_IN_US = 12.0


def _ar_us(size_bytes, factor=1.0):
    """A size-bound allreduce: its time grows with the message, so one size's time cannot stand for another's."""
    return factor * (10.0 + size_bytes / 1000.0)


def _ar_case(backend, size, us, setting=None, device="cuda", world_size=2):
    params = {"size_bytes": size, "count": size // 2, "dtype": "bf16", "backend": backend, "mode": "graph",
              "world_size": world_size, "origin": f"{size // (7168 * 2)} tok", "preset": "kimi-k2.5", "tp": 8,
              "hidden": 7168}
    if setting is not None:
        params.update(nccl_setting=setting, nccl_env={} if setting == "default" else {"NCCL_PROTO": "LL"})
    return {"name": f"{setting or ''}/allreduce/{backend}/{size}B/graph", "params": params,
            "check": {"ok": True, "detail": "#wrong 0"}, "mode": "graph", "device": device,
            "samples_us": [us] * 3, "summary": {"n": 3, "median_us": us}, "derived": {"time_us": us, "wrong": 0}}


def _sweep_file(folder, cpu=False):
    sizes = [t * 7168 * 2 for t in AR_TOKENS]
    cases = [_ar_case("gloo" if cpu else "nccl", s, _ar_us(s, f), setting, "cpu" if cpu else "cuda")
             for s in sizes for setting, f in (("default", 1.0), ("NCCL_PROTO=LL", 0.8))]
    run = store.make_run("allreduce_sweep", [], {"gpu_model": "cpu" if cpu else "NVIDIA H200",
                                                   "cuda_available": not cpu, "slug": "x"})
    run.update(cases=cases, extra={"nproc_per_node": 2})
    return store.save_run(run, folder, name="allreduce_sweep-20261201T000000Z.json")


def _with_stand_in(folder):
    path = next(folder.glob("cycle-*.json"))
    run = store.load_run(path)
    for c in run["cases"]:
        c["derived"].update(allreduce_stand_in_us=STAND_IN_US, layers_total=61, layers_run=61)
    store.write_json_atomic(path, run)  # in place: a second cycle file would be the folder's latest
    return run


def _log_interp(size):
    sizes = [t * 7168 * 2 for t in AR_TOKENS]
    if size in sizes:
        return _ar_us(size)
    lo, hi = max(s for s in sizes if s < size), min(s for s in sizes if s > size)
    return _ar_us(lo) + (_ar_us(hi) - _ar_us(lo)) * math.log(size / lo) / math.log(hi / lo)


def test_advise_costs_each_b_at_its_own_allreduce_size_not_at_one_requests(tmp_path, capsys):
    from verifybench.harness.analysis import batches

    folder = _batch_folder(tmp_path)
    one_gpu = _with_stand_in(folder)
    sweep = _sweep_file(folder)
    table = batches.rows(one_gpu, lambda c: {3: 2.4, 6: 3.1}[c[2]], batches.allreduce_costing(sweep))
    plain = {(r["context"], r["attention"], r["config"], r["B"]): r for r in batches.rows(one_gpu)}
    for r in table:
        if not r["costed"]:
            continue
        was = plain[(r["context"], r["attention"], r["config"], r["B"])]
        verify_us, decode_us = _log_interp(r["allreduce_bytes"]), _log_interp(r["B"] * 7168 * 2)
        assert r["cycle_ms"] == pytest.approx(was["cycle_ms"] + 122 * (verify_us - STAND_IN_US) / 1e3)
        assert r["decode_ms"] == pytest.approx(was["decode_ms"] + 122 * (decode_us - STAND_IN_US) / 1e3)
    at = {(r["B"], r["config"][2]): r for r in table}
    assert at[(8, 3)]["allreduce_at"][0] > 5 * at[(1, 3)]["allreduce_at"][0]  # B = 1's size would cost B 8 low
    assert at[(1, 3)]["allreduce_at"][1] == "interpolated on a log size scale between 28672 and 57344 B"
    assert at[(4, 3)]["allreduce_at"][1] == "interpolated on a log size scale between 114688 and 229376 B"
    assert at[(2, 6)]["allreduce_at"][1] == "interpolated on a log size scale between 114688 and 229376 B"

    assert cli_main(["advise", str(folder), "--accept-len", "3:2.4,6:3.1"]) == 0
    out = capsys.readouterr().out
    us = _log_interp(24 * 7168 * 2)
    assert (f"- B 8 x D 3 = 24 rows: 336 KiB per allreduce: {us:.4g} us per call (interpolated on a log size scale "
            f"between 229376 and 458752 B), {122 * us / 1e3:.4g} ms per forward (122 calls)") in out
    saved = 122 * (us - 0.8 * us) / 1e3
    assert f"lever: the sweep's winner NCCL_PROTO=LL {0.8 * us:.4g} us per call, saves {saved:.4g} ms per cycle" \
        in out
    us1 = _log_interp(3 * 7168 * 2)
    assert f"- B 1 x D 3 = 3 rows: 42 KiB per allreduce: {us1:.4g} us per call" in out and us1 != pytest.approx(us)
    assert "nccl, NCCL's default setting, graph mode, measured 14 KiB-448 KiB on NVIDIA H200 x2" in out


def test_advise_says_a_b_outside_the_measured_allreduce_sizes_is_not_costed(tmp_path, capsys):
    from verifybench.harness.analysis import batches

    folder = _batch_folder(tmp_path)
    one_gpu = _with_stand_in(folder)
    sweep = _sweep_file(folder)
    (far,) = [r for r in batches.rows(one_gpu, None, batches.allreduce_costing(sweep))
              if r["config"][2] == 6 and r["B"] == 8 and r["context"] == 1024 and r["attention"] == "extend"]
    assert far["allreduce_at"] is None and not far["costed"]
    assert far["cycle_ms"] == pytest.approx(_one_gpu_cycle_ms(one_gpu, 8, 6, 1024, "extend"))
    assert cli_main(["advise", str(folder)]) == 0
    out = capsys.readouterr().out
    assert ("- B 8 x D 6 = 48 rows: 672 KiB per allreduce: outside the measured sizes 14 KiB-448 KiB: not costed "
            "(no extrapolation; this B x D keeps the one-GPU stand-in of 12.0 us per call)") in out
    assert "(5,1,6) extend cycle" in out and "[stand-in]" in out


def _one_gpu_cycle_ms(run, b, d, context, attention):
    (case,) = [c for c in run["cases"] if c["params"]["batch"] == b and c["params"]["draft_tokens"] == d
               and c["params"]["context"] == context and c["params"]["attention"] == attention]
    return case["summary"]["median_us"] / 1e3


def test_advise_on_cpu_results_withholds_the_per_b_allreduce_times_but_names_each_bs_size(tmp_path, capsys):
    folder = _batch_folder(tmp_path)
    run = _with_stand_in(folder)
    for c in run["cases"]:
        c["device"] = "cpu"
    run["fingerprint"].update(gpu_model="cpu", cuda_available=False)
    store.write_json_atomic(next(folder.glob("cycle-*.json")), run)
    sweep = _sweep_file(folder, cpu=True)
    assert cli_main(["advise", str(folder), "--accept-len", "3:2.4,6:3.1"]) == 0
    out = capsys.readouterr().out
    assert "## Per batch, on a GPU (not ranked here" in out and "us per call" not in out
    assert (f"- B 4 x D 3 = 12 rows: 168 KiB per allreduce, would be costed interpolated on a log size scale between "
            f"114688 and 229376 B of {sweep}") in out
    assert f"- B 8 x D 6 = 48 rows: 672 KiB per allreduce, outside {sweep}'s measured sizes" in out


def test_advise_allreduce_from_costs_each_b_from_nccl_with_a_faster_backend_as_the_lever(tmp_path, capsys):
    folder = _batch_folder(tmp_path)
    _with_stand_in(folder)
    sizes = [t * 7168 * 2 for t in AR_TOKENS]
    run = store.make_run("allreduce", [], {"gpu_model": "NVIDIA H200", "cuda_available": True, "slug": "x"})
    run["cases"] = ([_ar_case("nccl", s, _ar_us(s)) for s in sizes]
                    + [_ar_case("symm-one-shot", s, _ar_us(s, 0.5)) for s in sizes]
                    + [_ar_case("gloo", s, 1.0, device="cpu") for s in sizes])  # host times: never the cost
    path = store.save_run(run, tmp_path / "elsewhere", name="allreduce-20261201T000000Z.json")
    assert cli_main(["advise", str(folder), "--allreduce-from", str(path)]) == 0
    out = capsys.readouterr().out
    us = _log_interp(12 * 7168 * 2)
    assert f"- B 4 x D 3 = 12 rows: 168 KiB per allreduce: {us:.4g} us per call" in out
    assert f"lever: symm-one-shot {0.5 * us:.4g} us per call, saves {122 * 0.5 * us / 1e3:.4g} ms per cycle" in out
    assert "(nccl, graph mode, measured 14 KiB-448 KiB on NVIDIA H200 x2" in out
    assert cli_main(["advise", str(folder), "--allreduce-from", str(sweep_path := _sweep_file(tmp_path))]) == 2
    assert f"--allreduce-from {sweep_path}: a allreduce_sweep result" in capsys.readouterr().err


def test_a_row_left_at_the_stand_in_is_not_ranked_against_rows_paying_the_measured_allreduce(tmp_path):
    from verifybench.harness.analysis import batches

    folder = _batch_folder(tmp_path)
    one_gpu = _with_stand_in(folder)
    table = batches.rows(one_gpu, lambda c: {3: 2.4, 6: 3.1}[c[2]], batches.allreduce_costing(_sweep_file(folder)))
    best = {(r["context"], r["B"]): r for r in batches.best_per_batch(table)}
    assert best[(1024, 8)]["config"] == (2, 1, 3) and best[(1024, 8)]["costed"]  # (5,1,6) at B 8: 48 rows, unmeasured
    (e,) = [e for e in batches.largest_paying(table) if e["context"] == 1024 and e["config"] == (5, 1, 6)
            and e["attention"] == "extend"]
    assert e["uncosted_B"] == [8] and 8 not in e["measured_B"]
