"""`verifybench trace`, graph or eager: each GPU op is put under the CUDA call it correlates with (a graph launch,
or an op-by-op launch), never guessed; eager attention / MoE in the verify forward is warned about, by name."""
from __future__ import annotations

import json

import pytest

from verifybench.harness.answers import trace
from verifybench.harness.answers.trace_graphs import ALL

from trace_builders import DATA, EXTEND, verify_trace

RANGES = {"cycle_range": "scheduler_step", "verify_range": "verify_forward"}
SUITE_FORWARD = DATA / "traces" / "suite-forward-k2.5-L3-TP-0.trace.json.gz"
SUITE_CYCLE = DATA / "traces" / "suite-cycle-k2.5-L3-TP-0.trace.json.gz"


def _busy(part: dict) -> dict[str, float]:
    return {k: v for k, v in part["per_cycle_us"].items() if k not in trace.ACCOUNTS}


def _adds_up(part: dict) -> None:
    """graph + eager + unknown is each component's busy time, and ALL is their sum."""
    launch = part["launch"]
    for comp, us in _busy(part).items():
        split = launch["graph_us"][comp] + launch["eager_us"][comp] + launch["unknown_us"][comp]
        assert split == pytest.approx(us, rel=1e-9, abs=1e-9), comp
    total = sum(launch[f"{kind}_us"][ALL] for kind in ("graph", "eager", "unknown"))
    assert total == pytest.approx(sum(_busy(part).values()), rel=1e-9)


def test_eager_attention_between_graph_pieces_is_named_in_the_warning(tmp_path, capsys):
    path = verify_trace().write(tmp_path / "t.json")
    r = trace.decompose([path], **RANGES)
    verify = r["verify"]["launch"]
    assert verify["eager_us"]["attention"] == 60.0 and verify["graph_us"]["attention"] == 0.0
    assert verify["eager_share"]["attention"] == 1.0 and verify["eager_share"]["moe"] == 0.0
    assert verify["eager_share"][ALL] == 60.0 / 261.0
    # the whole cycle: the draft's attention ran in its graph, the tree verify eagerly
    cycle = r["launch"]
    assert cycle["graph_us"]["attention"] == 10.0 and cycle["eager_us"]["tree_sampling"] == 4.0
    _adds_up(r)
    _adds_up(r["verify"])
    assert r["eager_warnings"] == [{"component": "attention", "part": "verify", "calls_per_cycle": 3.0,
                                    "per_cycle_us": 60.0, "kernels": [{"name": EXTEND, "calls_per_cycle": 3.0,
                                                                       "per_cycle_us": 60.0}]}]
    assert trace.main([str(path), "--cycle-range", "scheduler_step", "--verify-range", "verify_forward"]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: attention of the verify forward ran outside CUDA graphs: 3 eager launches per "
                        "cycle taking 0.060 ms of GPU time per cycle (_fwd_kernel x3); a piecewise-graph "
                        "downgrade? run it in full CUDA graphs"]


def test_without_a_verify_range_the_warning_covers_the_cycle_and_says_so(tmp_path):
    path = verify_trace().write(tmp_path / "t.json")
    r = trace.decompose([path], cycle_range="scheduler_step")
    assert [(w["component"], w["part"], w["calls_per_cycle"]) for w in r["eager_warnings"]] == [
        ("attention", "cycle", 3.0)]
    assert "draft steps included" in trace.format_report(r)


def test_a_fully_graphed_verify_gives_no_warning_and_no_eager_time(tmp_path, capsys):
    path = verify_trace(eager_attention=False).write(tmp_path / "t.json")
    r = trace.decompose([path], **RANGES)
    verify = r["verify"]["launch"]
    assert verify["eager_us"][ALL] == 0.0 and verify["unknown_us"][ALL] == 0.0
    assert verify["eager_share"][ALL] == 0.0 and verify["eager_share"]["attention"] == 0.0
    assert r["eager_warnings"] == []
    assert trace.main([str(path), "--cycle-range", "scheduler_step", "--verify-range", "verify_forward"]) == 0
    assert "warning:" not in capsys.readouterr().out


def test_without_correlation_ids_the_launch_is_unknown_not_guessed(tmp_path, capsys):
    b = verify_trace(ranges=False)
    for e in b.events:
        if e["cat"] == "kernel":
            del e["args"]["correlation"]
    path = b.write(tmp_path / "t.json")
    r = trace.decompose([path])  # cycles by the periodic kernel sequence
    assert r["cycles"] == 3
    launch = r["launch"]
    assert launch["graph_us"][ALL] == launch["eager_us"][ALL] == 0.0
    assert launch["unknown_us"][ALL] == 280.0 and launch["eager_share"][ALL] is None
    assert r["eager_warnings"] == []
    _adds_up(r)
    assert trace.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "launch unknown for 280.0 us per cycle" in out and "warning:" not in out
    assert json.loads(json.dumps(r))["launch"]["eager_share"][ALL] is None


def test_a_graph_node_id_on_the_kernel_says_graph_without_the_launch_call(tmp_path):
    """Newer Kineto writes CUPTI's graph node id on a graph's kernels: graph, even when no call correlates."""
    b = verify_trace(ranges=False)
    for e in b.events:
        if e["cat"] == "kernel":
            del e["args"]["correlation"]
            if e["name"] != EXTEND:
                e["args"]["graph node id"] = 7
    r = trace.decompose([b.write(tmp_path / "t.json")])
    launch = r["launch"]
    assert launch["graph_us"]["moe"] == 90.0 and launch["unknown_us"]["attention"] == 60.0
    assert launch["eager_us"][ALL] == 0.0 and r["eager_warnings"] == []


def test_ranks_give_the_max_and_the_warning_of_the_eager_one(tmp_path):
    files = [verify_trace().write(tmp_path / "x-TP-0.json"),
             verify_trace(eager_attention=False).write(tmp_path / "x-TP-1.json")]
    r = trace.decompose(files, **RANGES)
    assert [p["verify"]["launch"]["eager_us"]["attention"] for p in r["per_rank"]] == [60.0, 0.0]
    assert r["verify"]["launch"]["eager_us"]["attention"] == 60.0
    assert [w["component"] for w in r["eager_warnings"]] == ["attention"]


def test_the_suite_forward_trace_ran_wholly_in_its_graph():
    """Recorded by `verifybench record` on an H200: the forward is one CUDA graph, replayed 3 times."""
    r = trace.decompose([SUITE_FORWARD], cycle_range="verify_forward")
    launch = r["launch"]
    assert launch["eager_us"][ALL] == 0.0 and launch["unknown_us"][ALL] == 0.0
    assert launch["eager_share"][ALL] == 0.0 and r["eager_warnings"] == []
    _adds_up(r)


def test_the_suite_cycle_trace_runs_its_forwards_in_graphs_and_the_tree_eagerly():
    """The suite's cycle: draft, verify and re-extend are graphs; the tree kernels (Triton, cuLaunchKernelEx), the
    torch bookkeeping (cudaLaunchKernel) and the copies (cudaMemcpyAsync) are eager: 44 launches per cycle."""
    r = trace.decompose([SUITE_CYCLE], cycle_range="spec_cycle", verify_range="verify")
    launch, verify = r["launch"], r["verify"]["launch"]
    assert launch["unknown_us"][ALL] == 0.0
    assert sum(k["calls_per_cycle"] for k in launch["eager_kernels"]) == 44.0
    assert {k["name"] for k in launch["eager_kernels"] if k["component"] == "tree_sampling"} == {
        "_build_tree_kernel", "_verify_kernel", "_argmax_kernel", "_assign_kernel"}
    for comp in ("attention", "moe", "projections", "allreduce"):
        assert launch["eager_us"][comp] == verify["eager_us"][comp] == 0.0, comp
        assert verify["graph_us"][comp] > 0, comp
    assert 0.0 < launch["eager_share"][ALL] < 0.05
    assert r["eager_warnings"] == []
    _adds_up(r)
    _adds_up(r["verify"])
