"""One declaration per backend (harness/engines/backends.py): every backend carries its fields, the components list
their engine rows from the declarations, and an engine of another release skips its rows in one line while ours, the
result file and the rest of the run go on (issue 54)."""
import dataclasses
import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from verifybench.harness import engines
from verifybench.harness.engines import backends

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                   reason="the kernels need a GPU or the interpreter")


def test_every_declared_backend_has_its_fields_and_names_a_known_part_component_and_stand_in():
    assert len(backends.BY_NAME) == len(backends.DECLARED)  # no name declared twice
    for b in backends.DECLARED:
        for f in dataclasses.fields(backends.Backend):
            if f.default is dataclasses.MISSING:
                assert getattr(b, f.name) not in (None, "") or f.name in ("engine", "setup"), (b.name, f.name)
        assert b.part in backends.PARTS and b.component in backends.ROW_KEY, b.name
        assert b.name.startswith(f"{b.engine or 'ours'}."), b.name
        if b.stand_in:
            ours = backends.get(b.stand_in)
            assert ours.engine is None and ours.part == b.part and ours.component == b.component, b.name
        runs, why = b.enabled("cpu")
        assert isinstance(runs, bool) and why and "\n" not in why, (b.name, why)
    for name, (why, verify, decode) in backends.NOT_HERE.items():
        assert why and backends.get(verify).part == "verify_attention" and backends.get(decode).part == \
            "decode_attention", name


def test_the_engines_declared_backends_are_the_ones_the_brief_lists():
    engine_rows = {b.name for b in backends.DECLARED if b.engine}
    assert engine_rows == {"sglang.extend", "sglang.extend@sm120", "sglang.decode", "flashinfer.mla",
                           "flashinfer.decode", "sglang.triton", "sglang.marlin"}
    assert {b.name for b in backends.DECLARED if not b.engine} == {
        "ours.split_kv", "ours.extend", "ours.extend@sm120", "ours.decode", "ours.moe"}


def test_an_adapter_not_on_this_branch_or_a_missing_engine_says_so_in_one_line(monkeypatch):
    ghost = dataclasses.replace(backends.get("sglang.marlin"), module="verifybench.harness.engines.not_written_yet")
    monkeypatch.setattr(engines, "version", lambda engine: "0.5.10.post1")  # installed or not (a fresh clone: not)
    assert ghost.enabled("cuda") == (False, "sglang.marlin: its adapter verifybench.harness.engines.not_written_yet "
                                            "is not on this branch")
    monkeypatch.setattr(engines, "version", lambda engine: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert backends.get("flashinfer.mla").enabled("cuda") == \
        (False, "flashinfer is not installed (pip show flashinfer-python: not found)")


def test_a_gpu_only_backend_says_so_on_cpu():
    runs, why = backends.get("flashinfer.decode").enabled("cpu")
    assert not runs and ("needs a CUDA GPU" in why or "not installed" in why)


def test_the_components_list_their_engine_rows_and_stand_in_pairs_from_the_declarations():
    from verifybench.harness.answers import stand_ins
    from verifybench.harness.components import mla_decode, mla_verify

    assert mla_verify.VARIANTS == tuple(b.row for b in backends.of("mla_verify", tiles_cc=None))
    assert set(mla_verify.VARIANTS) >= {"extend", "split_kv", "sglang.extend", "flashinfer.mla"}
    assert mla_verify.SM120_VARIANTS == ("extend@sm120", "sglang.extend@sm120")
    assert mla_decode.ENGINE_IMPLS == tuple(b.row for b in backends.of("mla_decode", engines_only=True))
    assert stand_ins.PAIRS == backends.stand_in_pairs()
    assert stand_ins.PAIRS["mla_decode"] == ("impl", (("triton", "sglang.decode"), ("triton", "flashinfer.decode")))
    assert ("triton", "sglang.marlin") in stand_ins.PAIRS["moe_int4"][1]
    for path in ("harness/components/mla_verify.py", "harness/components/mla_decode.py"):
        text = (Path(__file__).resolve().parents[2] / path).read_text()
        assert 'impl == "sglang' not in text and 'variant == "sglang' not in text and 'startswith("sglang.' \
            not in text and '== "flashinfer.' not in text, path


# ---- an engine of another release (issue 54) ----

def _another_release(monkeypatch, release="0.5.11"):
    """The installed SGLang read as another release: its version, and what the test breaks in its code."""
    real = engines.version
    monkeypatch.setattr(engines, "version", lambda engine: release if engine == "sglang" else real(engine))


def _sglang_module(module: str):
    try:
        return engines.import_kernel_module("sglang", module)
    except engines.EngineMissing as e:
        pytest.skip(f"SGLang's kernels cannot be imported here: {e}")


@needs_kernels
def test_an_sglang_whose_tile_picker_takes_another_argument_skips_its_rows_and_mla_verify_writes_its_file(
        monkeypatch, tmp_path, capsys):
    """An SGLang whose _get_block_sizes_for_extend_attention takes another argument ended `verifybench mla_verify
    --tokens 3` with exit 1 and a TypeError, no result file, our rows lost too."""
    from verifybench.harness.cli import main
    from verifybench.harness.measure.results import store
    from verifybench.harness.engines import sglang

    module = _sglang_module(sglang.EXTEND_MODULE)

    def picker(lq, lv, sliding_window):  # a release that wants one more argument
        raise AssertionError("never reached")

    monkeypatch.setattr(module, "_get_block_sizes_for_extend_attention", picker)
    _another_release(monkeypatch)
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.05")
    assert main(["mla_verify", "--tokens", "3", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    [path] = tmp_path.glob("mla_verify-*.json")
    cases = {c["params"]["variant"]: c for c in store.read_json(path)["cases"]}
    assert cases["extend"]["check"]["ok"] and cases["split_kv"]["check"]["ok"]
    why = cases["sglang.extend"]["skipped"]
    assert why.startswith("the engine's rows: sglang 0.5.11: ") and "\n" not in why, why
    assert "TypeError" in why and "sliding_window" in why and "follows sglang 0.5.10.post1" in why, why


@needs_kernels
def test_an_sglang_whose_decode_kernel_takes_other_arguments_skips_its_row_and_ours_runs(monkeypatch):
    from verifybench.harness.components import mla_decode as bench
    from verifybench.harness.engines import sglang

    module = _sglang_module(sglang.DECODE_MODULE)

    def decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse,
                             num_kv_splits, max_kv_splits, sm_scale, k_scale, v_scale, page_size, logit_cap=0.0):
        raise AssertionError("never reached")

    monkeypatch.setattr(module, "decode_attention_fwd", decode_attention_fwd)
    _another_release(monkeypatch)
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.05")
    a = bench.attn_shape("tiny", 1)
    ours, engine = (bench.make_case(a, 1, 64, impl, "cpu", {"max_time_s": 0.05}, "tiny", 1).run().as_dict()
                    for impl in ("triton", "sglang.decode"))
    assert ours["check"]["ok"] and "summary" in ours
    assert engine["skipped"].startswith("the engine's rows: sglang 0.5.11: ") and "\n" not in engine["skipped"]
    assert "TypeError" in engine["skipped"] and "follows sglang 0.5.10.post1" in engine["skipped"]


@needs_kernels
def test_an_sglang_whose_moe_config_lookup_takes_other_arguments_skips_the_moe_engine_row(monkeypatch):
    from verifybench.harness.components import moe_int4
    from verifybench.harness.engines import sglang

    try:
        _, config = sglang.moe_modules()
    except engines.EngineMissing as e:
        pytest.skip(f"SGLang's MoE modules cannot be imported here: {e}")

    def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, m, is_marlin):
        raise AssertionError("never reached")

    monkeypatch.setattr(config, "try_get_optimal_moe_config", try_get_optimal_moe_config)
    _another_release(monkeypatch)
    spec = moe_int4.make_case("tiny", 1, moe_int4.SGLANG, 1, "uniform", "cpu", "graph", {})
    why = spec.run().skipped
    assert why.startswith("the engine's rows: sglang 0.5.11: ") and "\n" not in why, why
    assert "TypeError" in why and "follows sglang 0.5.10.post1" in why, why
