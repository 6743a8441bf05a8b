"""`verifybench trace` on hand-built PyTorch profiler traces: kernels named as the engines name them, known
durations and gaps, graph launches and ranges; the decomposition must return the known numbers exactly."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from verifybench.harness.answers import trace
from verifybench.harness.answers.trace_read import TraceError
from verifybench.harness.answers.trace_rules import Classifier, RulesError

from trace_builders import (ARGMAX, DATA, DECODE, ENGINE_CYCLE, GATE, GEMM, MARLIN, MLA, MYSTERY, NCCL,
                            NORM, NVJET, Builder, engine_trace, suite_result)


def test_graph_launches_give_the_cycles_and_exact_parts(tmp_path):
    r = trace.decompose([engine_trace().write(tmp_path / "t.json")])
    assert r["cycles"] == 3 and r["found_by"].startswith("CUDA graph launches: 3 launches")
    assert r["per_cycle_us"] == ENGINE_CYCLE
    assert r["per_cycle_min_us"] == r["per_cycle_max_us"] == ENGINE_CYCLE
    parts = sum(v for k, v in ENGINE_CYCLE.items() if k not in trace.ACCOUNTS)
    assert parts + ENGINE_CYCLE["gpu_idle"] - ENGINE_CYCLE["overlap"] == ENGINE_CYCLE["total"]
    assert r["period_us"] == 100.0
    # host: each cycle's window runs to the next graph launch (the last to the end of its last call), syncs 70 us
    assert r["host_us"] == {"window": (100 + 100 + 83) / 3, "runtime": 75.0, "sync": 70.0}
    assert r["other_kernels"] == [{"name": MYSTERY, "calls": 3, "total_us": 6.0, "per_cycle_us": 2.0}]


def test_graph_cycles_drop_a_last_cycle_cut_short(tmp_path):
    b = engine_trace(cycles=3)
    draft = [("draft_only_kernel", 0.0, 1.0)]
    for k in range(3):  # a second, cheaper graph per cycle: the draft
        b.graph(560.0 + 100 * k, [(n, 1085.0 + 100 * k, d) for n, _, d in draft])
    b.graph(800.0, [(NCCL, 1300.0, 10.0), (MLA, 1310.0, 20.0), (MARLIN, 1330.0, 30.0), (GATE, 1330.0, 4.0, 9),
                    (GEMM, 1360.0, 5.0)])  # a 4th verify graph, and the trace ends before its draft
    r = trace.decompose([b.write(tmp_path / "t.json")])
    assert r["cycles"] == 3 and "dropped" in r["found_by"]


def test_cycle_and_verify_ranges(tmp_path):
    r = trace.decompose([engine_trace(ranges=True).write(tmp_path / "t.json")], cycle_range="step",
                        verify_range="verify_forward")
    assert r["cycles"] == 3 and r["found_by"].startswith("CPU ranges 'step' (3 found)")
    assert r["per_cycle_us"] == ENGINE_CYCLE
    assert r["host_us"] == {"window": 100.0, "runtime": 75.0, "sync": 70.0}
    v = r["verify"]
    assert v["cycles"] == 3
    assert v["per_cycle_us"] == {**ENGINE_CYCLE, "tree_sampling": 0.0, "other": 0.0, "memcpy": 0.0,
                                 "gpu_idle": 0.0, "total": 65.0}
    # the verify range alone: each one is a cycle
    r = trace.decompose([tmp_path / "t.json"], verify_range="verify_forward")
    assert r["cycles"] == 3 and r["per_cycle_us"]["total"] == 65.0 and r["verify"] is None


def test_gpu_side_ranges_when_the_cpu_has_none(tmp_path):
    b = engine_trace()
    for k in range(3):
        b.range("cycle", 1000.0 + 100 * k, 90, cat="gpu_user_annotation", pid=0, tid=7)
    r = trace.decompose([b.write(tmp_path / "t.json")], cycle_range="cycle")
    assert r["cycles"] == 3 and r["found_by"].startswith("GPU ranges 'cycle'")
    assert r["per_cycle_us"] == ENGINE_CYCLE


def periodic_trace(cycles: int = 5, skip: int = 3) -> Builder:
    """GPU events only (no CPU activity recorded): a cycle is two layers (RMSNorm 2, GEMM 5, attention 7, GEMM 5)
    and an argmax 3, 1 us apart, cycles 20 us apart; the trace starts `skip` kernels into the first cycle."""
    b, t = Builder(), 0.0
    layer = [(NORM, 2.0), (NVJET, 5.0), (DECODE, 7.0), (NVJET, 5.0)]
    for k in range(cycles):
        for i, (name, dur) in enumerate(layer * 2 + [(ARGMAX, 3.0)]):
            if k or i >= skip:
                b.gpu(name, t, dur, None)
            t += dur + 1
        t += 19
    return b


def test_periodic_kernel_sequence_finds_cycles_not_layers(tmp_path):
    r = trace.decompose([periodic_trace().write(tmp_path / "t.json.gz")])
    assert r["cycles"] == 4 and r["found_by"].startswith("periodic kernel sequence: 9 kernels per cycle")
    cyc = r["per_cycle_us"]
    assert (cyc["misc"], cyc["projections"], cyc["attention"], cyc["tree_sampling"]) == (4.0, 20.0, 14.0, 3.0)
    assert (cyc["gpu_idle"], cyc["overlap"], cyc["total"]) == (8.0, 0.0, 49.0)
    assert r["period_us"] == 69.0 and r["host_us"] is None


def test_ranks_from_file_names_and_the_max_over_ranks(tmp_path):
    engine_trace(moe_us=30.0).write(tmp_path / "1700-TP-0.trace.json.gz")
    engine_trace(moe_us=40.0, device=1).write(tmp_path / "1700-TP-1.trace.json.gz")
    r = trace.decompose([tmp_path / "1700-TP-1.trace.json.gz", tmp_path / "1700-TP-0.trace.json.gz"])
    assert r["ranks"] == [0, 1] and r["rank_source"] == "file names"
    assert [p["per_cycle_us"]["moe"] for p in r["per_rank"]] == [30.0, 40.0]
    assert r["per_cycle_us"]["moe"] == 40.0 and r["per_cycle_us"]["total"] == 98.0
    assert r["per_cycle_us"]["allreduce"] == 10.0 and r["cycles"] == 3


def test_a_missing_rank_file_is_an_error(tmp_path):
    for rank in (0, 2):
        engine_trace().write(tmp_path / f"worker_rank{rank}.123.pt.trace.json")
    with pytest.raises(TraceError, match=r"rank 1 not among the files"):
        trace.decompose(sorted(tmp_path.iterdir()))


def test_torch_profiler_schema_with_gpu_events_added(tmp_path):
    """The CPU side as torch 2.13 writes it (record_function ranges, cpu_op, metadata), GPU events added by hand
    (no GPU here) with correlation ids of cuda_runtime calls placed inside the ranges."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("spec_cycle"):
                (x @ x).sum()
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    data = json.loads(path.read_text())
    ranges = [e for e in data["traceEvents"] if e.get("cat") == "user_annotation" and e["name"] == "spec_cycle"]
    assert len(ranges) == 2 and all(isinstance(e["ts"], float) for e in ranges)
    with pytest.raises(TraceError, match="no GPU events"):
        trace.decompose([path])
    for i, e in enumerate(ranges):
        corr = 10_000 + i
        data["traceEvents"].append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": e["pid"],
                                    "tid": e["tid"], "ts": e["ts"], "dur": 0.5, "args": {"correlation": corr}})
        data["traceEvents"].append({"ph": "X", "cat": "kernel", "name": GEMM, "pid": 0, "tid": 7,
                                    "ts": e["ts"] + 1000.0, "dur": 6.0, "args": {"device": 0, "stream": 7,
                                                                                 "correlation": corr}})
    path.write_text(json.dumps(data))
    r = trace.decompose([path], cycle_range="spec_cycle")
    assert r["cycles"] == 2 and r["per_cycle_us"]["projections"] == 6.0


@pytest.mark.parametrize("content, error", [
    (b"", "empty file"),
    (b'{"traceEvents": [', "not valid JSON"),
    (b'{"schemaVersion": 1}', "no traceEvents"),
    (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2}]}', "no GPU events"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "soon", "dur": 2}]}', "no numeric ts"),
])
def test_malformed_traces_name_the_file_and_the_fault(tmp_path, content, error):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=error) as e:
        trace.decompose([path])
    assert str(path) in str(e.value)


def test_truncated_gzip_and_merged_devices_are_errors(tmp_path):
    good = engine_trace().write(tmp_path / "t.json.gz")
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(good.read_bytes()[:-40])
    with pytest.raises(TraceError, match="truncated or corrupt gzip"):
        trace.decompose([cut])
    b = engine_trace()
    b.device = 1
    b.gpu(GEMM, 5000.0, 1.0, None)
    with pytest.raises(TraceError, match="2 devices"):
        trace.decompose([b.write(tmp_path / "merged.json")])


def test_no_cycles_and_unknown_range_are_errors(tmp_path):
    b = Builder()
    for i, name in enumerate(["a", "b", "c", "d"]):
        b.gpu(name, 10.0 * i, 1.0, None)
    with pytest.raises(TraceError, match="no cycles found"):
        trace.decompose([b.write(tmp_path / "t.json")])
    with pytest.raises(TraceError, match="no range named or containing 'nope'"):
        trace.decompose([engine_trace(ranges=True).write(tmp_path / "r.json")], cycle_range="nope")


def test_user_rules_extend_and_override_the_table(tmp_path):
    path = engine_trace().write(tmp_path / "t.json")
    r = trace.decompose([path], [["^mystery_", "misc"], ["VerifyTree", "draft_bookkeeping"]])
    assert r["per_cycle_us"]["misc"] == 2.0 and r["per_cycle_us"]["other"] == 0.0
    assert r["per_cycle_us"]["draft_bookkeeping"] == 4.0 and r["per_cycle_us"]["tree_sampling"] == 0.0
    assert r["other_kernels"] == []
    rules = tmp_path / "rules.json"
    rules.write_text('[["^mystery_", "misc"]]')
    assert trace.decompose([path], rules)["per_cycle_us"]["misc"] == 2.0


@pytest.mark.parametrize("text, error", [
    ('{"a": "b"}', "expected a JSON list"),
    ('[["ok", "misc"], ["x"]]', "rule 1"),
    ('[["(unclosed", "misc"]]', "bad regex"),
    ('[["x", "not a name"]]', "is not a name"),
    ("[[", "not JSON"),
])
def test_malformed_rules_files(tmp_path, text, error):
    rules = tmp_path / "rules.json"
    rules.write_text(text)
    with pytest.raises(RulesError, match=error):
        trace.decompose([engine_trace().write(tmp_path / "t.json")], rules)


@pytest.mark.parametrize("name, component", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allreduce"),
    ("void vllm::cross_device_reduce_2stage<__nv_bfloat16, 8>(...)", "allreduce"),
    ("void at::cuda::(anonymous namespace)::spin_kernel(long)", "allreduce"),
    ("fused_moe_kernel_gptq_awq", "moe"), ("void moe_align_block_size_kernel<int>(...)", "moe"),
    ("void moe_sum_reduce_kernel<__nv_bfloat16, 8>(...)", "moe"), ("moe_wna16_gemm_kernel<...>", "moe"),
    ("void topk_softmax<256, 8>(...)", "router"), ("_softmax_topk_kernel", "router"),
    ("_fwd_kernel_stage2", "attention"), ("_fwd_kernel", "attention"), ("_split_kernel", "attention"),
    ("void flash::flash_fwd_splitkv_kernel<...>", "attention"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(...)", "misc"),
    ("void flashinfer::activation::act_and_mul_kernel<...>", "misc"), ("_mla_prep_kernel", "misc"),
    ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<...>", "misc"), ("_rmsnorm_kernel", "misc"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "projections"), ("_dot_kernel", "projections"),
    ("_reduce_kernel", "projections"), ("_q_absorb_kernel", "projections"), ("gemv2T_kernel_val<...>", "projections"),
    ("_gate_up_split_kernel", "moe"), ("_down_split_kernel", "moe"),
    ("build_tree_efficient", "tree_sampling"), ("void TreeSpeculativeSamplingTargetOnly<...>", "tree_sampling"),
    (ARGMAX, "tree_sampling"), ("_verify_kernel", "tree_sampling"),
    ("void at::native::vectorized_elementwise_kernel<4, FillFunctor>", "other"),
])
def test_default_rules_name_engine_and_suite_kernels(name, component):
    assert Classifier()(name) == component


def test_against_puts_engine_parts_beside_the_suite_at_n(tmp_path):
    r = trace.decompose([engine_trace(ranges=True).write(tmp_path / "t.json")], cycle_range="step",
                        verify_range="verify_forward")
    run = trace.load_against(suite_result(tmp_path / "verify.json"))
    rows, note = trace.against_table(r, run, tokens=4)
    got = {row[0].split("  [")[0]: row[1:] for row in rows}
    assert got["allreduce"] == [10.0, 5.0, 2.0]
    assert got["attention core"] == [20.0, 10.0, 2.0]
    assert got["routed experts"] == [30.0, 15.0, 2.0]
    assert got["GEMMs + router + head"] == [9.0, 6.0, 1.5]  # 5 GEMM + 4 gate | 2 + 1 + 1 + 2
    assert got["forward"] == [65.0, 40.0, 65.0 / 40.0]
    assert "n = 4 (--tokens)" in note and "verify part" in note
    rows, note = trace.against_table(r, run, tokens=None)
    assert rows[0][2] == 10.0 and "n = 8: the largest" in note
    with pytest.raises(TraceError, match="no cases at n=3"):
        trace.against_table(r, run, tokens=3)


def test_cli_prints_writes_json_and_chart(tmp_path, capsys):
    path = engine_trace(ranges=True).write(tmp_path / "t.json")
    out_json, chart = tmp_path / "out" / "d.json", tmp_path / "d.png"
    code = trace.main([str(path), "--cycle-range", "scheduler_step", "--verify-range", "verify_forward",
                       "--against", str(suite_result(tmp_path / "v.json")), "--tokens", "4",
                       "--json", str(out_json), "--chart", str(chart)])
    out = capsys.readouterr().out
    assert code == 0
    assert "3 cycle(s), found by CPU ranges 'scheduler_step'" in out and MYSTERY in out
    assert "routed experts" in out and "engine/suite" in out
    data = json.loads(out_json.read_text())
    assert data == json.loads(json.dumps(trace.decompose([path], None, "scheduler_step", "verify_forward")))
    assert {"cycles", "found_by", "per_cycle_us", "per_rank", "other_kernels"} <= data.keys()
    assert data["per_cycle_us"]["gpu_idle"] == 14.0 and data["per_cycle_us"]["total"] == 88.0
    assert stat.S_IMODE(os.stat(out_json).st_mode) == 0o644
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out_json.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("args, error", [
    (["missing.json"], "no such file"),
    (["t.json", "--rules", "bad_rules.json"], "bad regex"),
    (["t.json", "--against", "t.json"], "not a verifybench result"),
    (["t.json", "--cycle-range", "nope"], "no range named"),
    (["t.json", "--tokens", "4"], "give --against too"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, error):
    monkeypatch.chdir(tmp_path)
    engine_trace().write(tmp_path / "t.json")
    (tmp_path / "bad_rules.json").write_text('[["(", "misc"]]')
    assert trace.main(args) == 2
    err = capsys.readouterr().err
    assert error in err and err.count("\n") == 1 and "Traceback" not in err


def test_fixture_traces_give_their_expected_decomposition():
    """tests/data/traces: each NAME.expect.json names its trace files (one per rank), the decompose() keyword
    arguments, and the cycle count and per-cycle parts they must give; a trace no expect file names must at
    least decompose by the automatic cycle finding."""
    expects = sorted((DATA / "traces").glob("*.expect.json"))
    assert expects, "tests/data/traces holds no expected decomposition"
    named = set()
    for path in expects:
        want = json.loads(path.read_text())
        files = [DATA / "traces" / f for f in want["traces"]]
        named.update(f.name for f in files)
        r = trace.decompose(files, **want.get("decompose", {}))
        assert r["cycles"] == want["cycles"], path
        assert r["per_cycle_us"] == pytest.approx(want["per_cycle_us"], rel=1e-9), path
        if "verify_per_cycle_us" in want:
            assert r["verify"]["per_cycle_us"] == pytest.approx(want["verify_per_cycle_us"], rel=1e-9), path
    for path in sorted((DATA / "traces").glob("*.json*")):
        if not path.name.endswith((".expect.json", ".direct.json")) and path.name not in named:
            r = trace.decompose([path])
            assert r["cycles"] >= 1 and r["per_cycle_us"]["total"] > 0, path


def test_docs_list_every_default_rule():
    from verifybench.harness.answers.trace_rules import DEFAULT_RULES

    docs = (Path(__file__).parents[2] / "docs" / "trace.md").read_text()
    for pattern, component in DEFAULT_RULES:
        assert f"`{pattern.replace('|', chr(92) + '|')}` | {component} |" in docs, pattern


# Traces the suite recorded of itself on an H200 (`verifybench record`: K2.5 TP8 shapes, 3 layers, 3 replays), with
# the engine's direct measurement of the same graph or cycle in the same process beside each.
SUITE = Path(__file__).parents[1] / "data" / "traces"


def _suite(name: str):
    direct = json.loads((SUITE / f"suite-{name}-k2.5-L3.direct.json").read_text())
    return SUITE / f"suite-{name}-k2.5-L3-TP-0.trace.json.gz", direct


def test_suite_forward_trace_matches_its_direct_measurement():
    path, direct = _suite("forward")
    out = trace.decompose([path], cycle_range="verify_forward")
    parts = out["per_cycle_us"]
    assert out["cycles"] == direct["replays"] == 3
    assert abs(parts["total"] / direct["direct_median_us"] - 1) < 0.05
    # every kernel of the suite's forward is named by a rule but the allocator's 32-bit copy
    assert parts["other"] < 0.01 * parts["total"]
    for comp in ("allreduce", "attention", "projections", "moe", "router", "misc", "tree_sampling"):
        assert parts[comp] > 0, comp
    busy = sum(v for k, v in parts.items() if k not in trace.ACCOUNTS)
    assert busy + parts["gpu_idle"] - parts["overlap"] == pytest.approx(parts["total"], rel=1e-9)


def test_suite_cycle_trace_finds_every_cycle_and_its_verify():
    path, direct = _suite("cycle")
    out = trace.decompose([path], cycle_range="spec_cycle", verify_range="verify")
    assert out["cycles"] == direct["replays"] == 3
    assert out["verify"]["cycles"] == 3
    parts, verify = out["per_cycle_us"], out["verify"]["per_cycle_us"]
    # the tree-masked attention (the engine-style extend kernel) is most of the verify; the cycle syncs on the host
    assert verify["attention"] > 0.5 * verify["total"]
    assert parts["gpu_idle"] > 0 and out["host_us"]["sync"] > 0
    assert verify["total"] < parts["total"]
