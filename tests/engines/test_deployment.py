"""The engine as deployed (harness/engines/deployment.py) against the released SGLang in .ci/engines: its own parser
reads the flags, its own code picks the attention backend for the target capability and the MoE scheme for the
checkpoint; a bad flag, a refused combination or an absent engine is one line."""
import argparse

import pytest

from verifybench.harness import engines
from verifybench.harness.engines import deployment


@pytest.fixture(scope="module")
def server_args():
    """SGLang's server_args module, or the tests skip where it cannot be imported here."""
    try:
        return engines.import_kernel_module("sglang", "sglang.srt.server_args")
    except engines.EngineMissing as e:
        pytest.skip(f"SGLang's server args cannot be imported here: {e}")


def _parts(d):
    return {part: kernel for part, kernel, _ in d.rows}


def test_the_default_deployment_on_sm120_is_triton_with_8_kv_splits_and_marlin(server_args):
    d = deployment.resolve("sglang")
    assert (d.engine, d.version, d.cc) == ("sglang", engines.version("sglang"), 120)
    assert d.attention_backend == "triton" and d.attention_how == "default on sm_120"
    assert (d.decode_attention, d.verify_attention, d.extend_tiles_cc) == ("sglang.decode", "sglang.extend", 120)
    assert d.kv_splits == 8 and d.moe == "sglang.marlin" and d.draft is None
    assert d.line() == (f"the engine as deployed: sglang {engines.version('sglang')}, attention triton (default on "
                        "sm_120), decode kv splits 8, MoE Marlin (sglang.marlin)")
    assert list(_parts(d)) == ["decode attention", "verify attention", "MoE", "kv splits", "rest"]
    moe_how = dict((p, how) for p, _, how in d.rows)["MoE"]
    assert "CompressedTensorsWNA16MoE" in moe_how


def test_the_default_follows_sglangs_own_choice_per_capability(server_args):
    hopper = deployment.resolve("sglang", None, 90)
    assert hopper.attention_backend == "fa3" and hopper.verify_attention == "ours.split_kv"
    assert "FA3" in dict((p, how) for p, _, how in hopper.rows)["verify attention"]
    blackwell = deployment.resolve("sglang", None, 100)  # Kimi-K2.5's model-specific choice there
    assert blackwell.attention_backend == "trtllm_mla" and blackwell.moe == "ours.moe"
    assert blackwell.moe_method == "FlashInfer TRT-LLM MxInt4"


def test_the_flashinfer_backend_runs_flashinfers_kernels(server_args):
    d = deployment.resolve("sglang", "--attention-backend flashinfer")
    assert (d.attention_backend, d.attention_how) == ("flashinfer", "given")
    assert (d.decode_attention, d.verify_attention, d.extend_tiles_cc) == ("flashinfer.decode", "flashinfer.mla", None)


def test_a_parts_own_backend_flag_decides_that_part_as_sglangs_hybrid_backend_does(server_args):
    d = deployment.resolve("sglang", "--prefill-attention-backend flashinfer --decode-attention-backend triton")
    assert (d.decode_attention, d.verify_attention) == ("sglang.decode", "flashinfer.mla")
    assert "verify flashinfer (--prefill-attention-backend)" in d.line()
    decode_mode = d.with_args("--speculative-attention-mode decode")  # verify then runs the decode backend
    assert decode_mode.verify_attention == "sglang.extend"


def test_a_kv_split_flag_reaches_the_deployment_and_a_lever_changes_one_flag(server_args):
    d = deployment.resolve("sglang", "--triton-attention-num-kv-splits 64")
    assert d.kv_splits == 64 and "(given)" in dict((p, how) for p, _, how in d.rows)["kv splits"]
    flipped = d.with_args("--attention-backend flashinfer")
    assert flipped.kv_splits == 64 and flipped.verify_attention == "flashinfer.mla" and flipped.cc == d.cc


def test_the_draft_shape_is_read_from_the_speculative_flags(server_args):
    d = deployment.resolve("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 3 "
                                     "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
    assert d.draft == (3, 1, 4) and _parts(d)["draft"] == "steps 3, topk 1, D 4"


def test_the_moe_runner_flag_that_picks_trtllm_mxint4_gets_our_stand_in(server_args):
    d = deployment.resolve("sglang", "--moe-runner-backend flashinfer_trtllm")
    assert d.moe == "ours.moe" and "our stand-in" in dict((p, how) for p, _, how in d.rows)["MoE"]


@pytest.mark.parametrize("flags, says", [
    ("--no-such-flag 1", "unrecognized arguments: --no-such-flag"),
    ("--attention-backend nope", "invalid choice: 'nope'"),
    ("--triton-attention-num-kv-splits eight", "invalid int value: 'eight'"),
    ("--attention-backend flashinfer --speculative-eagle-topk 4", "only supports topk=1"),
    ("--attention-backend 'unclosed", "No closing quotation")])
def test_a_flag_or_combination_sglang_refuses_is_one_line(server_args, flags, says):
    with pytest.raises(ValueError) as e:
        deployment.resolve("sglang", flags)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_engine_not_installed_is_one_line(monkeypatch):
    monkeypatch.setattr(engines, "version", lambda engine: None)
    with pytest.raises(ValueError) as e:
        deployment.resolve("sglang", "--attention-backend triton")
    assert str(e.value) == ("--engine sglang: sglang is not installed here (pip show sglang: not found); its flags "
                            "and dispatch are read from it")


def test_no_engine_is_the_suites_kernels_and_vllm_is_its_syntax_only():
    assert deployment.resolve(None) == deployment.Deployment(None, None)
    assert deployment.resolve(None).line().startswith("the suite's kernels")
    vllm = deployment.resolve("vllm", "--max-num-seqs 8")
    assert "no dispatch" in vllm.line() and vllm.verify_attention == "ours.split_kv"
    with pytest.raises(ValueError, match="--engine-args needs --engine"):
        deployment.resolve(None, "--attention-backend triton")
    with pytest.raises(ValueError, match="--deploy-cc takes"):
        deployment.resolve("sglang", None, 12)


def test_one_declaration_of_the_options_reads_back_into_a_deployment(server_args):
    p = argparse.ArgumentParser()
    deployment.add_arguments(p)
    ns = p.parse_args(["--engine", "sglang", "--engine-args", "--attention-backend flashinfer", "--deploy-cc", "sm_90"])
    d = deployment.from_namespace(ns)
    assert (d.cc, d.verify_attention) == (90, "flashinfer.mla")
    assert deployment.from_namespace(p.parse_args([])).engine is None
    assert p.parse_args(["--engine-args=--enable-torch-compile"]).engine_args == "--enable-torch-compile"
    with pytest.raises(SystemExit):
        p.parse_args(["--deploy-cc", "hopper"])
