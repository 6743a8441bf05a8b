"""The memory rule (measure/timing/memory.py) on CPU with a fake free-memory figure: components run what fits (fewer
layers, fewer rotation sets, said in the case) or skip naming the bytes needed and free; never a raw out-of-memory
error."""
import pytest
import torch

from verifybench.harness.components import graph_replay, mla_decode, moe_int4, skinny_gemm, verify
from verifybench.harness.measure.timing import ceiling, memory
from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec
from verifybench.harness.measure.timing.timer import cold_rotation_sets
from verifybench.harness.model import presets
from verifybench.harness.model.forward import FORWARD_MAX_TOKENS, allocated_bytes

GIB = 1 << 30
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where verify and graph_replay plan (the others: "cpu")


@pytest.fixture
def free(monkeypatch):
    """free(bytes): every component now sees that much free memory."""
    def set_free(nbytes):
        monkeypatch.setattr(memory, "free_bytes", lambda device: int(nbytes))
    monkeypatch.setitem(ceiling._CEILING, "cpu", (50.0, "a copy measured earlier in this run"))
    yield set_free
    for module in (verify, skinny_gemm, mla_decode, moe_int4):
        module.release()


def _fits_exactly(need: int, device: str = "cpu") -> int:
    """The least free figure at which `need` bytes of tensors fit on `device` under the rule."""
    return memory.budget(need, device)


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", "1e400"])
def test_a_bad_cap_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(memory.CAP_ENV, value)
    with pytest.raises(ValueError, match="VERIFYBENCH_MEMORY_CAP_GIB must be a number of GiB > 0"):
        memory.cap_bytes()


def test_the_cap_is_read_in_gib_and_limits_free_memory_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never cap this test process's GPU
    monkeypatch.delenv(memory.CAP_ENV, raising=False)
    assert memory.cap_bytes() is None
    uncapped = memory.free_bytes("cpu")
    monkeypatch.setenv(memory.CAP_ENV, "94")
    assert memory.cap_bytes() == 94 * GIB
    monkeypatch.setenv(memory.CAP_ENV, "0.25")  # below this process's own size: nothing is free under it
    assert memory.free_bytes("cpu") < min(uncapped, GIB // 4)
    assert memory.apply_cap()["cap_bytes"] == GIB // 4


def test_plan_runs_what_fits_and_says_so():
    need = lambda units: units * GIB  # noqa: E731
    whole = memory.plan(need, 4, 1, "four sets", "sets", "cpu", free=_fits_exactly(4 * GIB))
    assert (whole.units, whole.reduced, whole.note) == (4, False, "")
    part = memory.plan(need, 4, 1, "four sets", "sets", "cpu", free=_fits_exactly(4 * GIB) - 1)
    assert (part.units, part.reduced) == (3, True)
    assert "3 of 4 sets" in part.note and "four sets needs" in part.note and "is free" in part.note
    none = memory.plan(need, 4, 2, "four sets", "sets", "cpu", free=GIB)
    assert none.units == 0 and "2 sets, the least it can run" in none.skip
    assert f"{GIB} B) is free" in none.skip and str(2 * GIB) in none.skip  # the bytes needed and free, named
    with pytest.raises(ValueError, match="least"):
        memory.plan(need, 2, 3, "x", "sets", "cpu")


def test_require_raises_case_skipped_naming_bytes(free):
    free(memory.RESERVE_BYTES["cpu"])
    with pytest.raises(CaseSkipped, match=r"a 1048576 B copy .*needs .* GiB .* but .* is free"):
        memory.require(1 << 20, "a 1048576 B copy", "cpu")


def test_verify_plans_all_layers_when_they_fit_and_fewer_when_short(free):
    full = presets.get("kimi-k2.5", 8)
    need_all = allocated_bytes(full, 4096, FORWARD_MAX_TOKENS)
    free(_fits_exactly(need_all, DEVICE))  # a 94 GiB cap on an H200, empty: the whole forward fits
    specs = verify.cases("kimi-k2.5", 8, 4096, (1,))
    assert specs[0].name == "verify/kimi-k2.5-tp8/full/n1" and specs[0].params["layers"] is None
    free(64 * GIB)
    specs = verify.cases("kimi-k2.5", 8, 4096, (1,))
    plan = verify.plan_layers("kimi-k2.5", 8, None, 4096)
    assert 2 <= plan.units < full.layers and plan.reduced
    assert memory.budget(allocated_bytes(presets.get("kimi-k2.5", 8, plan.units), 4096, 8), DEVICE) <= 64 * GIB
    assert memory.budget(allocated_bytes(presets.get("kimi-k2.5", 8, plan.units + 1), 4096, 8), DEVICE) > 64 * GIB
    assert specs[0].name == f"verify/kimi-k2.5-tp8-L{plan.units}/full/n1"  # never compared with a whole forward
    assert specs[0].params["layers"] == plan.units and f"{plan.units} of 61 layers" in plan.note


def test_verify_skips_every_case_when_not_even_two_layers_fit(free):
    free(GIB)  # two K2.5 TP8 layers and the head take 1.6 GiB
    specs = verify.cases("kimi-k2.5", 8, 4096, (1, 2))
    cases = [s.run() for s in specs]  # the setup raises before it allocates anything
    assert all(c.skipped and not c.check_ok for c in cases)
    assert "2 layers, the least it can run" in cases[0].skipped and "is free" in cases[0].skipped


def test_verify_runs_fewer_layers_and_says_it_in_derived_and_tables(free):
    need = {n: allocated_bytes(presets.get("tiny", 1, n), 64, FORWARD_MAX_TOKENS) for n in (2, 3)}
    free(_fits_exactly(need[2], DEVICE))  # two of the tiny preset's three layers fit
    spec = next(s for s in verify.cases("tiny", 1, 64, (1,)) if s.params["variant"] == "full")
    case = spec.run(max_time_s=0.05)
    assert case.check_ok, case.check_detail
    d = case.derived
    assert (d["layers_run"], d["layers_total"]) == (2, 3) and "2 of 3 layers" in d["memory_note"]
    assert d["all_layers_scale"] == pytest.approx(need[3] / need[2])
    tables = dict(verify.tables([case.as_dict()]))
    setup = next(rows for title, rows in tables.items() if title.startswith("setup"))[0]
    assert setup["layers"] == "2 of 3" and "memory" in setup
    assert any("all_layers_estimate" in title for title in tables)


def test_skinny_gemm_rotates_over_fewer_copies_when_short(free):
    shape = skinny_gemm.shapes("tiny", 1)[0]
    per_copy = shape.N * shape.K * 4
    free(_fits_exactly(per_copy))
    quick = {"max_time_s": 0.05}  # run_case adds the CPU rule
    case = skinny_gemm.make_case(shape, 1, "torch", "cpu", quick, "tiny", 1).run()
    want = cold_rotation_sets(per_copy, "cpu", skinny_gemm.max_copies("cpu"))
    assert case.check_ok and case.derived["rotation"] == 1 and f"1 of {want} copies" in case.derived["memory_note"]
    skinny_gemm.release()
    free(0)
    skipped = skinny_gemm.make_case(shape, 1, "torch", "cpu", quick, "tiny", 1).run()
    assert skipped.skipped and "is free" in skipped.skipped and "needs" in skipped.skipped


def test_mla_decode_rotates_over_fewer_caches_when_short(free):
    a = mla_decode.attn_shape("tiny", 1)
    per_cache = (64 + mla_decode.MAX_N) * a.d * 4
    free(_fits_exactly(per_cache))
    quick = {"max_time_s": 0.05}  # run_case adds the CPU rule
    case = mla_decode.make_case(a, 1, 64, "torch", "cpu", quick, "tiny", 1).run()
    want = cold_rotation_sets(per_cache, "cpu", mla_decode.max_copies("cpu"))
    assert case.check_ok and case.derived["rotation"] == 1 and f"1 of {want} copies" in case.derived["memory_note"]


def test_moe_uses_fewer_layer_sets_when_short(free):
    p = presets.get("tiny", 1)
    int4_set = p.experts * moe_int4.moe.expert_bytes_int4(p.hidden, p.expert_intermediate, p.expert_group_size)
    free(_fits_exactly(2 * 2 * int4_set))  # two sets, each counted with the kernel's repacked copy
    quick = {"max_time_s": 0.05}  # run_case adds the CPU rule
    case = moe_int4.make_case("tiny", 1, "reference", 1, "uniform", "cpu", "hot", quick).run()
    assert case.check_ok, case.check_detail
    assert case.derived["layer_sets"] == 2 and "2 of 4 layer sets" in case.derived["memory_note"]
    moe_int4.release()
    free(0)
    skipped = moe_int4.make_case("tiny", 1, "reference", 1, "uniform", "cpu", "hot", quick).run()
    assert skipped.skipped and "INT4 expert layers" in skipped.skipped


def test_graph_replay_model_stack_shrinks_to_what_fits(free):
    p = presets.get("tiny", 1)
    from verifybench.kernels.graph_replay.api import LayerShapes

    per_layer = LayerShapes(p.projections()).weight_bytes * (1 if DEVICE == "cuda" else 2)  # bf16; fp32 on CPU
    free(_fits_exactly(per_layer, DEVICE))
    names = [s.name for s in graph_replay.cases("tiny", 1, 64, (1,)) if s.name.startswith("graph/model/")]
    assert names and all("-L1/" in n for n in names)


def test_an_out_of_memory_error_becomes_a_skipped_case_not_a_crash():
    def setup():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 336.00 MiB\nmore detail")

    case = CaseSpec("x", {}, "hot", setup).run()
    assert case.skipped.startswith("out of memory despite the memory plan: CUDA out of memory. Tried to allocate")
    assert "more detail" not in case.skipped and not case.check_ok


def test_out_of_memory_is_tried_again_after_collecting_what_earlier_cases_left_in_cycles():
    """A case's objects in a reference cycle (as a cycle case's state is) outlive it until the collector runs: the
    retry runs after collecting them, so the memory they held is the next case's again."""
    import gc
    import weakref

    class State:  # refers to itself, as a captured graph and the buffers it reads can
        def __init__(self):
            self.me = self

    freed, calls = [], []
    gc.disable()  # only the runner's collection may free the cycle
    try:
        def earlier_case():
            weakref.finalize(State(), freed.append, True)  # unreferenced at once, in a cycle: not freed yet

        earlier_case()
        assert not freed

        def setup():
            calls.append(bool(freed))
            if len(calls) == 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 294.00 MiB")
            return (lambda: None), (lambda: (True, "ok")), None

        case = CaseSpec("x", {}, "hot", setup).run(device="cpu", min_samples=2, max_time_s=0.05)
    finally:
        gc.enable()
    assert calls == [False, True] and case.check_ok and case.measurement is not None and not case.skipped


def test_out_of_memory_twice_skips_the_case_saying_so():
    calls = []

    def setup():
        calls.append(1)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 294.00 MiB\nmore detail")

    case = CaseSpec("x", {}, "hot", setup).run()
    assert len(calls) == 2 and not case.check_ok
    assert case.skipped.startswith("out of memory despite the memory plan: CUDA out of memory. Tried to allocate "
                                   "294.00 MiB (twice") and "more detail" not in case.skipped


def test_each_component_is_released_even_when_a_case_raises(monkeypatch, tmp_path):
    from verifybench.harness import components, run

    released = []
    module = components.load("baseline")
    monkeypatch.setattr(module, "release", lambda: released.append(True))

    def boom(*a, **k):
        raise RuntimeError("case failed")

    monkeypatch.setattr(module, "cases", lambda *a: [CaseSpec("x", {}, "hot", boom)])
    with pytest.raises(RuntimeError):
        run.run_component("baseline", {"preset": "tiny", "tp": 1, "context": 64, "tokens": None}, tmp_path)
    assert released == [True]


def test_eta_without_memory_for_the_copy_ceiling_skips_the_case_naming_why(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 0)
    monkeypatch.delitem(ceiling._CEILING, "cpu", raising=False)
    with pytest.raises(CaseSkipped, match="the copy ceiling that eta needs cannot be measured: .* is free"):
        ceiling.copy_gbps("cpu")


def test_record_refuses_a_forward_that_does_not_fit_and_names_the_layers_that_do(free, monkeypatch, tmp_path, capsys):
    from verifybench.harness import record as trace_record
    from verifybench.harness.cli import main

    monkeypatch.setattr(trace_record, "cuda_available", lambda: True)
    free(64 * GIB)
    layers = verify.plan_layers("kimi-k2.5", 8, None, 4096).units
    assert main(["record", str(tmp_path / "t.json.gz")]) == 2
    err = capsys.readouterr().err
    assert f"memory: {layers} of 61 layers" in err and f"pass --layers {layers}" in err
    free(GIB)
    assert main(["record", str(tmp_path / "t.json.gz")]) == 2
    assert "the least it can run) needs" in capsys.readouterr().err
