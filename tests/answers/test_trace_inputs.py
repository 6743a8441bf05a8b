"""`verifybench trace` on damaged traces, reserved rule names and unlike comparisons: each is refused in one line
naming the fault, or compared like with like and said so; never a wrong figure without a word."""
from __future__ import annotations

import json
import math

import pytest

from verifybench.harness.answers import trace
from verifybench.harness.answers.trace_against import RESULT_COMMAND
from verifybench.harness.answers.trace_read import TraceError
from verifybench.harness.answers.trace_rules import RulesError

from trace_builders import DATA, ENGINE_CYCLE, MARLIN, engine_trace, suite_result

SUITE_FORWARD = DATA / "traces" / "suite-forward-k2.5-L3-TP-0.trace.json.gz"  # 3 layers, 6 allreduces per forward


def _first(b, name):
    return next(e for e in b.events if e.get("name") == name)


@pytest.mark.parametrize("dur", [-20.0, None, math.nan, math.inf])
def test_a_kernel_with_a_negative_missing_nan_or_inf_duration_is_refused(tmp_path, dur):
    b = engine_trace()
    event = _first(b, MARLIN)
    if dur is None:
        del event["dur"]
    else:
        event["dur"] = dur
    with pytest.raises(TraceError, match=r"1 event\(s\) with a missing, negative, non-finite or absurd time"):
        trace.decompose([b.write(tmp_path / "t.json")])


def test_a_trace_with_every_event_present_twice_is_refused(tmp_path):
    b = engine_trace()
    b.events += [dict(e) for e in b.events]
    with pytest.raises(TraceError, match="present twice"):
        trace.decompose([b.write(tmp_path / "t.json")])


@pytest.mark.parametrize("name", ["total", "gpu_idle", "overlap"])
def test_rules_refuse_the_reports_reserved_names(tmp_path, name):
    with pytest.raises(RulesError, match=f"component '{name}' is reserved"):
        trace.decompose([engine_trace().write(tmp_path / "t.json")], [["^mystery_", name]])


def test_timestamps_near_1e18_us_are_rebased_exactly(tmp_path):
    b = engine_trace()
    for e in b.events:
        e["ts"] = 10**18 + int(e["ts"])  # exact integers in the file: a float64 would keep 128 us steps
    r = trace.decompose([b.write(tmp_path / "t.json")])
    assert r["per_cycle_us"] == ENGINE_CYCLE and r["period_us"] == 100.0


def test_against_refuses_a_cpu_verify_result(tmp_path):
    with pytest.raises(TraceError, match="CPU smoke run"):
        trace.load_against(suite_result(tmp_path / "v.json", device="cpu"))


def test_against_a_non_verify_result_names_a_command_that_parses(tmp_path):
    from verifybench.harness.cli import build_parser

    path = suite_result(tmp_path / "v.json")
    path.write_text(path.read_text().replace('"component": "verify"', '"component": "cycle"'))
    with pytest.raises(TraceError, match=RESULT_COMMAND):
        trace.load_against(path)
    parser = build_parser()
    for command in RESULT_COMMAND.split(", or "):
        parser.parse_args(command.split()[1:])  # exits 2 if the command no longer parses
    assert "run verify" not in (DATA.parent.parent / "docs" / "trace.md").read_text()


def test_against_refuses_a_3_layer_trace_beside_a_61_layer_result_unless_layers_scale_it(tmp_path):
    r = trace.decompose([SUITE_FORWARD], cycle_range="verify_forward")
    with pytest.raises(TraceError, match=r"the suite ran 61 layers, the trace about 3 .*--layers"):
        trace.against_table(r, trace.load_against(suite_result(tmp_path / "v61.json", layers=61)), 4)
    rows, note = trace.against_table(r, trace.load_against(suite_result(tmp_path / "v.json", layers=61)), 4,
                                     layers=3)
    got = {row[0].split("  [")[0]: row[2] for row in rows}
    assert got["allreduce"] == pytest.approx(5.0 * 3 / 61)
    assert got["forward"] == pytest.approx((40.0 - 2.0) * 3 / 61 + 2.0)  # the lm_head runs once per forward
    assert "scaled per layer from 61 to 3 layers" in note
    rows, note = trace.against_table(r, trace.load_against(suite_result(tmp_path / "v3.json", layers=3)), 4)
    assert rows[0][2] == 5.0 and "suite 3 layers, trace about 3" in note


def test_cli_layer_mismatch_is_one_line_and_exit_2(tmp_path, capsys):
    args = [str(SUITE_FORWARD), "--cycle-range", "verify_forward", "--against",
            str(suite_result(tmp_path / "v.json", layers=61))]
    assert trace.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "--layers" in captured.err
    assert trace.main([*args, "--layers", "3"]) == 0
    assert "scaled per layer from 61 to 3" in capsys.readouterr().out


def test_against_with_the_verify_range_alone_says_the_verify_step(tmp_path):
    path = engine_trace(ranges=True).write(tmp_path / "t.json")
    r = trace.decompose([path], verify_range="verify_forward")
    _, note = trace.against_table(r, trace.load_against(suite_result(tmp_path / "v.json")), 4)
    assert "the verify step alone" in note and "whole cycle" not in note
    r = trace.decompose([path])
    assert "the whole cycle (draft steps included" in trace.against_table(r, trace.load_against(
        suite_result(tmp_path / "w.json")), 4)[1]


LONG = ("void at::native::(anonymous namespace)::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
        + "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float>>" * 4
        + ">(at::TensorIteratorBase&, at::native::BinaryFunctor<float, float, float> const&)::{lambda(int)#1}>"
        "(int, at::native::BinaryFunctor<float, float, float> const&)")


@pytest.mark.parametrize("name, short", [
    (LONG, "at::native::{anonymous}::elementwise_kernel<...>"),
    ("_ZN7cutlass7Kernel2I75cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8EEvNT_6ParamsE",
     "cutlass::Kernel2<...>"),
    ("_Z9my_kernelPfi", "my_kernel"), ("mystery_kernel_xyz", "mystery_kernel_xyz"),
])
def test_unmatched_kernels_print_a_short_name(name, short):
    assert trace.short_name(name) == short


def test_report_prints_short_names_and_the_json_keeps_the_full_one(tmp_path, capsys):
    b = engine_trace()
    for e in b.events:
        if e.get("name") == "mystery_kernel_xyz":
            e["name"] = LONG
    out_json = tmp_path / "d.json"
    assert trace.main([str(b.write(tmp_path / "t.json")), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert LONG not in out and "at::native::{anonymous}::elementwise_kernel<...>" in out
    assert [len(line) < 100 for line in out.splitlines() if "elementwise_kernel" in line] == [True]
    assert json.loads(out_json.read_text())["other_kernels"][0]["name"] == LONG


def test_against_reads_a_results_layers_from_its_preset_when_it_ran_them_all():
    r = trace.decompose([SUITE_FORWARD], cycle_range="verify_forward")
    h200 = DATA.parent.parent / "results" / "baselines" / "nvidia-h200-x1" / "verify.json"  # layers: None (all 61)
    with pytest.raises(TraceError, match="the suite ran 61 layers, the trace about 3"):
        trace.against_table(r, trace.load_against(h200), 4)
