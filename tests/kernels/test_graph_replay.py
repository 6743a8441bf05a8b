import pytest
import torch

from verifybench.harness.analysis.fit import linear_fit
from verifybench.kernels.graph_replay.api import LayerShapes, ModelStack, straight_line
from verifybench.harness.components import graph_replay as gr

GPU_MODE = {"cpu-loop": "graph", "cpu-hot": "hot", "cpu-cold": "cold"}  # a CPU record read as a GPU run would store it


def _record(name, median_us, calls=1, **derived):
    return {"name": name, "check": {"ok": True}, "mode": "graph", "device": "cuda", "wall_s": 0.1,
            "summary": {"median_us": median_us}, "derived": derived, "calls_per_sample": calls}


def test_straight_line_runs_exactly_n_kernels():
    x = torch.zeros(1, dtype=torch.int64)
    straight_line(x, 37)
    assert x.item() == 37


def test_fit_recovers_fixed_and_per_node_cost_from_replay_times():
    recs = [_record(f"graph/straight/N{n}", (2.3 + 1.01 * n) / n, kernels=n, replay_us=2.3 + 1.01 * n)
            for n in (1, 2, 4, 8, 16, 32)]
    f = gr.replay_fit(recs)
    assert (f.a, f.b) == pytest.approx((2.3, 1.01))
    assert gr.launch_floor_us(1000, f) == pytest.approx(2.3 + 1010)


def test_kimi_tp8_layer_shapes_match_design_bytes():
    from verifybench.harness.model import presets

    p = presets.get("kimi-k2.5", 8)
    s = LayerShapes(p.projections())
    mb = {name: k * n * 2 / 1e6 for name, k, n in s.projections}
    assert mb["q_a_kv_a"] == pytest.approx(30.3, abs=0.05)
    assert mb["q_b"] == pytest.approx(4.7, abs=0.05)
    assert mb["kv_b"] == pytest.approx(2.1, abs=0.05)
    assert mb["o_proj"] == pytest.approx(14.7, abs=0.05)


def test_model_stack_last_layer_matches_float64_reference():
    from verifybench.harness.model import presets

    s = LayerShapes(presets.get("tiny", 1).projections())
    stack = ModelStack(s, layers=3, device="cpu", dtype=torch.float32)
    xs = stack.inputs(3)
    for out, ref in zip(stack.forward(xs), stack.reference_last_layer(xs)):
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert stack.kernels_per_forward == 3 * 7


def test_every_cpu_case_passes_its_check_and_tables_are_consistent(monkeypatch):
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.1")
    monkeypatch.setattr(gr, "STRAIGHT_MAX_TIME_S", 0.1)
    recs = []
    for spec in gr.cases("tiny", 1, 64):
        spec.measure_kw["max_time_s"] = 0.1
        case = spec.run()
        assert case.check_ok, (spec.name, case.check_detail)
        recs.append(case.as_dict())
    tables = dict(gr.tables(recs))
    straight = next(rows for title, rows in tables.items() if title.startswith("straight-line"))
    counts = gr.NODE_COUNTS_CUDA if torch.cuda.is_available() else gr.NODE_COUNTS_CPU  # the cases ran there
    assert [r["nodes"] for r in straight] == list(counts)
    for r in straight:
        assert r["replay_us"] == pytest.approx(r["per_node_us"] * r["nodes"])
    # the fit's arithmetic, as a GPU run shows it (a CPU run withholds it)
    as_gpu = dict(gr.tables([{**r, "device": "cuda", "mode": GPU_MODE.get(r["mode"], r["mode"])} for r in recs]))
    fit_rows = next(rows for title, rows in as_gpu.items() if title.startswith("fit"))
    direct = linear_fit([r["nodes"] for r in straight], [r["replay_us"] for r in straight])
    assert fit_rows[0]["per_node_us"] == pytest.approx(direct.b)
    model = next(rows for title, rows in as_gpu.items() if title.startswith("model-shaped"))
    assert sorted(r["tokens"] for r in model if r["mode"] == "graph") == list(range(1, 9))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run's fit is shown")
def test_cpu_replay_fit_is_withheld_and_cpu_modes_never_read_graph(monkeypatch):
    from verifybench.harness.measure.results.store import WITHHELD

    monkeypatch.setattr(gr, "STRAIGHT_MAX_TIME_S", 0.05)
    recs = [spec.run(max_time_s=0.05).as_dict() for spec in gr.cases("tiny", 1, 64, (1, 2))]
    tables = dict(gr.tables(recs))
    (fit,) = next(rows for title, rows in tables.items() if title.startswith("fit"))
    assert fit["fixed_us"] == WITHHELD and fit["r2"] == WITHHELD and "measured_in_s" not in fit  # alone it says nothing
    model = next(rows for title, rows in tables.items() if title.startswith("model-shaped"))
    assert model and not any(r["mode"] == "graph" for r in model)
