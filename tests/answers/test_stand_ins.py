"""Our stand-ins against the engine's own kernels (answers/stand_ins.py): paired at the same shape and one request,
only kernels that passed their check, ratios from GPU runs only."""
from verifybench.harness.answers import stand_ins
from verifybench.harness.measure.results.store import WITHHELD


def _case(variant, context, median_us, ok=True, batch=1, device="cuda", floor_us=10.0):
    return {"params": {"variant": variant, "context": context, "tokens": 3, "tree": "chain", "batch": batch},
            "check": {"ok": ok}, "summary": {"median_us": median_us}, "derived": {"floor_us": floor_us},
            "device": device}


def _run(cases, gpu="NVIDIA H100 80GB HBM3"):
    return {"component": "mla_verify", "cases": cases, "fingerprint": {"gpu_model": gpu, "cuda_available": True}}


def test_pairs_each_engine_row_with_ours_at_its_shape_and_one_request():
    run = _run([_case("extend", 1024, 90.0), _case("sglang.extend", 1024, 100.0),
                _case("extend", 4096, 300.0), _case("sglang.extend", 4096, 400.0, ok=False),
                _case("extend", 1024, 50.0, batch=2), _case("sglang.extend", 1024, 500.0, batch=2),
                _case("split_kv", 1024, 20.0)])
    rows = stand_ins.rows({"mla_verify": run})
    assert [(r["shape"], r["engine_us"], r["ours_us"]) for r in rows] == [("context 1024, tokens 3, tree chain",
                                                                           100.0, 90.0)]
    assert rows[0]["ours/engine"] == 0.9 and rows[0]["roofline_us"] == 10.0


def test_the_section_states_the_ratio_on_a_gpu_and_withholds_every_figure_on_cpu():
    pair = [_case("extend", 1024, 90.0), _case("sglang.extend", 1024, 100.0)]
    gpu = "\n".join(stand_ins.lines({"mla_verify": _run(pair)}))
    assert "0.9" in gpu and WITHHELD not in gpu
    cpu_cases = [dict(c, device="cpu") for c in pair]
    cpu = "\n".join(stand_ins.lines({"mla_verify": _run(cpu_cases, gpu="cpu")}))
    assert WITHHELD in cpu and "0.9" not in cpu and "90" not in cpu


def test_no_engine_rows_no_section():
    assert stand_ins.lines({"mla_verify": _run([_case("extend", 1024, 90.0), _case("split_kv", 1024, 20.0)])}) == []
