import pytest

from verifybench.harness.analysis import decompose
from verifybench.harness.cli import main as cli_main


def _parts():
    iso = {"moe": {1: 100.0, 2: 150.0, 3: 200.0}, "attn": {1: 300.0, 2: 300.0, 3: 300.0}}
    full = {1: 410.0, 2: 440.0, 3: 520.0}
    without = {"moe": {1: 305.0, 2: 300.0, 3: 310.0}}
    return full, iso, without


def test_parts_add_up_and_error_is_relative_to_measured():
    full, iso, without = _parts()
    without["allreduce"] = {3: 480.0}
    rows = decompose.table(full, iso, without, {1: 200.0, 2: 200.0, 3: 250.0})
    assert [r["sum_of_parts_us"] for r in rows] == [400.0, 450.0, 500.0]
    assert rows[0]["parts_error_%"] == pytest.approx(100 * (400 / 410 - 1))
    assert rows[1]["moe_marginal_us"] == pytest.approx(140.0)
    assert "attn_marginal_us" not in rows[1]
    # the roofline has no communication term: it is held against the forward without the allreduce
    assert rows[2]["no_comm/roofline"] == pytest.approx(480 / 250)
    assert rows[1]["no_comm/roofline"] is None


def test_token_fit_matches_its_points_and_fixed_share():
    full = {n: 20_000 + 700 * n for n in range(1, 9)}
    f = decompose.token_fit(full)
    assert (f["a"], f["b"]) == pytest.approx((20_000, 700))
    assert f["fixed_share"] == pytest.approx(20_000 / (20_000 + 5600))


def test_batch_fits_give_each_batch_its_line_and_one_over_every_row():
    slope = {1: 600, 2: 550, 4: 400}  # us per token in the forward, falling with B

    def us(b, n):  # 5 ms per forward plus 100 us per request
        return 5000 + 100 * b + slope[b] * b * n

    rows = [{"B": b, "tokens_per_forward": b * n, "forward_us": us(b, n)} for b in (1, 2, 4) for n in (1, 2, 3, 4)]
    rows.append({"B": 8, "tokens_per_forward": 8, "forward_us": 9000.0})  # one row: no line of its own
    fits = {f["B"]: f for f in decompose.batch_fits(rows)}
    assert set(fits) == {1, 2, 4, "all"}
    for b in (1, 2, 4):
        assert (fits[b]["a_us"], fits[b]["b_us_per_token"], fits[b]["r2"]) == pytest.approx((5000 + 100 * b, slope[b], 1))
    assert fits[4]["tokens"] == "4-16" and fits["all"]["tokens"] == "1-16"
    assert fits["all"]["b_us_per_token"] < 600 and 0.9 < fits["all"]["r2"] < 1
    assert decompose.batch_fits(rows[:2]) == []  # two rows: no line with an interval


def test_break_even_reproduces_the_kimi_deployment_figure():
    be = decompose.break_even(accept_len=3.0, decode_ms=11.1, verify_ms=25.6, draft_ms=1.0, overhead_ms=0.4)
    assert be.cycle_ms == pytest.approx(27.0)
    assert be.tau_star == pytest.approx(27.0 / 11.1) and round(be.tau_star, 2) == 2.43
    assert be.speedup == pytest.approx(3 * 11.1 / 27)


def test_break_even_rejects_nonsense():
    with pytest.raises(ValueError):
        decompose.break_even(0, 11.1, 25.6, 1, 0.4)
    with pytest.raises(ValueError):
        decompose.break_even(2, 11.1, -1, 1, 0.4)


def test_breakeven_cli_prints_tau_star(capsys):
    assert cli_main(["breakeven", "--accept-len", "2.0"]) == 0
    out = capsys.readouterr().out
    # the deployment's defaults: overhead = re-extend 0.3 + tree, sync, bookkeeping 0.1 (breakeven.ASSUMED_*)
    assert f"{(25.6 + 1.0 + 0.4) / 11.1:.4g}" in out and "NOT pay off" in out
    assert cli_main(["breakeven", "--accept-len", "-1"]) == 2


def test_breakeven_labels_each_time_not_given_as_assumed_and_no_other(capsys):
    assert cli_main(["breakeven", "--accept-len", "2.5", "--verify-ms", "14.36"]) == 0
    out = capsys.readouterr().out
    assumed = next(line for line in out.splitlines() if line.startswith("ASSUMED"))
    assert "decode_ms 11.1, draft_ms 1, overhead_ms 0.4" in assumed and "verify_ms" not in assumed
    assert cli_main(["breakeven", "--accept-len", "2.5", "--decode-ms", "11", "--verify-ms", "25", "--draft-ms", "1",
                     "--overhead-ms", "0.4"]) == 0
    assert "ASSUMED" not in capsys.readouterr().out


def test_breakeven_help_names_where_its_assumed_constants_are():
    from verifybench.harness.analysis import breakeven

    assert "constants below" not in breakeven.__doc__ and "harness/analysis/breakeven.py" in breakeven.__doc__


def test_projection_bounds_streaming_parts_and_replaces_the_allreduce():
    here, there = decompose.Gpu("H200", 4000, 7.7), decompose.Gpu("X", 8000, 4.0)
    # moe: 1000 us for 2 GB; at 4000 GB/s the ideal is 500 us, so high = 500 (overhead stays) + 250
    p = decompose.project({"moe": 1000.0, "allreduce": 2000.0, "misc": 50.0}, {"moe": 2_000_000_000}, here, there,
                          allreduces=122)
    assert p["moe"] == pytest.approx((500.0, 750.0))
    assert p["allreduce"] == pytest.approx((488.0, 488.0)) and p["misc"] == (50.0, 50.0)
    with pytest.raises(ValueError):
        decompose.project({}, {}, here, decompose.Gpu("bad", 0, 1.0), allreduces=1)


def test_project_command_reads_a_verify_result_and_labels_the_projection(tmp_path, capsys):
    import json
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1/verify.json"
    assert cli_main(["project", str(src), "--name", "X", "--copy-gbps", "8000", "--allreduce-us", "5"]) == 0
    out = capsys.readouterr().out
    assert "PROJECTION" in out and "X" in out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == len({c["params"]["tokens"] for c in json.loads(src.read_text())["cases"]})
    assert cli_main(["project", str(tmp_path / "missing.json"), "--copy-gbps", "1", "--allreduce-us", "1"]) == 2
