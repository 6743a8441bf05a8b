"""The forward and cycle composed from a Deployment (tiny preset, CPU; SGLang's Triton kernels in the interpreter):
each part runs the deployment's kernel (recorded calls prove which, with which KV splits, tiles and shared metadata),
ours stands in with the reason where the engine cannot run, the A/B runs one case set per variant, advise ranks the
variants by measured ms, and the tables open with the deployment's line."""
import json
import shlex

import numpy as np
import pytest
import torch

from verifybench.harness import engines
from verifybench.harness.engines import deployment as deployment_module
from verifybench.harness.engines.deployment import Deployment
from verifybench.harness.model import deployed, deployments
from verifybench.harness.model.build import build_forward
from verifybench.harness.model.cycle import Cycle, SpecConfig


def _dep(splits=8, backend="triton", cc=None, moe="ours.moe", args=()):
    fi = backend == "flashinfer"
    return Deployment("sglang", "0.5.10.post1", tuple(args), backend, "flashinfer.decode" if fi else "sglang.decode",
                      "flashinfer.mla" if fi else "sglang.extend", cc, splits, moe)


def fake_resolve(engine, engine_args=None, cc=None):
    """The deploy work's resolve() as far as these tests need it: the backend and the KV-split cap from the flags."""
    if engine is None:
        return Deployment(None, None)
    words = shlex.split(engine_args or "")

    def flag(name, default):
        return words[words.index(name) + 1] if name in words else default
    return _dep(int(flag("--triton-attention-num-kv-splits", 8)), flag("--attention-backend", "triton"),
                args=tuple(words))


@pytest.fixture
def resolved(monkeypatch):
    monkeypatch.setattr(deployment_module, "resolve", fake_resolve)


@pytest.fixture(scope="module")
def fwd():
    torch.set_num_threads(1)
    return build_forward("tiny", 1, None, 64, 0.0)


def _sglang_or_skip():
    from verifybench.harness.engines import sglang

    try:
        return sglang, sglang.decode_module(), sglang.extend_module()
    except engines.EngineMissing as e:
        pytest.skip(f"SGLang's kernels cannot be imported here: {e}")


def _record(monkeypatch, module, name, seen):
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append((args, kwargs, getattr(module, "CUDA_CAPABILITY", None)))
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)


def test_the_plain_decode_step_runs_the_engines_decode_with_the_deployments_kv_splits_and_one_metadata(fwd,
                                                                                                     monkeypatch):
    _, decode, _ = _sglang_or_skip()
    seen = []
    _record(monkeypatch, decode, "decode_attention_fwd", seen)
    comp = deployed.compose(_dep(splits=16), fwd)
    assert comp.ran["decode attention"] == "sglang.decode" and not comp.stand_ins
    deployed.apply(fwd, comp).forward(1)
    assert len(seen) == len(fwd.layers)  # every layer's attention is the engine's
    assert {args[9] for args, _, _ in seen} == {16}  # max_kv_splits, as --triton-attention-num-kv-splits 16
    assert len({id(args[6]) for args, _, _ in seen}) == 1  # one attn_logits workspace: the metadata is shared
    ok, detail = deployed.check(comp, fwd)
    assert ok, detail


def test_the_verify_forward_runs_the_engines_extend_with_its_tiles_and_the_cycle_still_accepts_the_oracle(
        fwd, monkeypatch):
    _, _, extend = _sglang_or_skip()
    seen = []
    _record(monkeypatch, extend, "extend_attention_fwd", seen)
    comp = deployed.compose(_dep(cc=120), fwd)
    cyc = Cycle(deployed.apply(fwd, comp), SpecConfig(2, 1, 3), "extend", lambda t: None, graphs=False,
                deployed=comp)
    assert cyc.attention_error() <= 1e-2
    seen.clear()
    cyc.verify_body()
    assert len(seen) == len(fwd.layers)
    assert {cap for _, _, cap in seen} == {(12, 0)}  # launched with the tiles SGLang picks on sm_120
    assert len({id(args[9]) for args, _, _ in seen}) == 1  # one custom mask for every layer
    greedy = cyc.greedy_continuation(7)
    assert cyc.run_check(7, greedy[:2]) == (2, greedy)


def test_the_draft_steps_run_the_engines_grouped_decode(fwd, monkeypatch):
    _, decode, _ = _sglang_or_skip()
    seen = []
    _record(monkeypatch, decode, "decode_attention_fwd", seen)
    comp = deployed.compose(_dep(), fwd)
    cyc = Cycle(deployed.apply(fwd, comp), SpecConfig(3, 1, 4), "extend", lambda t: None, graphs=False,
                deployed=comp)
    ok, detail = deployed.check(comp, fwd, cyc.draft)
    assert ok and "draft attention vs SDPA" in detail, detail
    seen.clear()
    cyc._draft_body()
    heads = {args[0].shape[1] for args, _, _ in seen}
    assert len(seen) == 2 and heads == {cyc.draft.d.heads}  # steps - 1 draft forwards, at the draft's heads


def test_stand_ins_are_recorded_with_the_reason_where_the_engine_cannot_run(fwd, monkeypatch):
    from verifybench.harness.engines import sglang

    def missing():
        raise engines.EngineMissing("sglang is not installed (pip show sglang: not found)")
    monkeypatch.setattr(sglang, "decode_module", missing)
    monkeypatch.setattr(sglang, "extend_module", missing)
    comp = deployed.compose(_dep(moe="sglang.triton"), fwd)
    parts = {part: (engine, ours, why) for part, engine, ours, why in comp.stand_ins}
    assert parts["decode attention"][0] == "sglang.decode" and "not installed" in parts["decode attention"][2]
    assert parts["verify attention"][:2] == ("sglang.extend", "torch reference")
    assert "not wired into the forward" in parts["moe"][2]
    assert comp.decode is None and comp.tree is None  # ours runs: the forward is unchanged
    flash = deployed.compose(_dep(backend="flashinfer"), fwd)
    assert {p for p, *_ in flash.stand_ins} >= {"decode attention", "verify attention", "draft attention"}
    assert all("CUDA" in why or "not installed" in why for p, _, _, why in flash.stand_ins if p != "draft attention")
    assert deployed.compose(Deployment(None, None), fwd).stand_ins == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_on_cpu_ours_stands_in_for_marlin_with_the_release_and_the_reason(fwd):
    comp = deployed.compose(_dep(moe="sglang.marlin"), fwd)
    (part, engine, ours, why), = [s for s in comp.stand_ins if s[0] == "moe"]
    assert (engine, ours) == ("sglang.marlin", "torch reference (moe)") and comp.moe is None
    assert why.startswith(engines.label("sglang")) and "needs a CUDA GPU" in why and "\n" not in why
    assert deployed.apply(fwd, comp).moe_fn is fwd.moe_fn and "moe" not in comp.notes


def test_where_marlin_builds_the_forward_runs_it_on_its_own_weights_and_the_row_says_why_that_is_valid(fwd,
                                                                                                    monkeypatch):
    from verifybench.harness.engines import marlin

    built = []
    monkeypatch.setattr(marlin, "build", built.append)
    comp = deployed.Composition(_dep(moe="sglang.marlin"))
    moe = deployed.deployed_moe(comp, "cuda", torch.bfloat16)
    assert moe is marlin.forward_moe and built == [torch.bfloat16] and comp.ran["moe"] == "sglang.marlin"
    assert comp.stand_ins == [] and "no copy, no repack" in comp.notes["moe"]
    comp.moe = moe
    assert deployed.apply(fwd, comp).moe_fn is marlin.forward_moe
    assert comp.params()["notes"]["moe"].startswith(deployed.MARLIN_VIEW_NOTE)
    _, rows = deployments.table([{"params": {"deployment": "deployed", "engine_args": "", "deployment_line": "x"},
                                  "derived": {"deployment": comp.params()}}])
    assert rows[0]["moe"] == "sglang.marlin" and rows[0]["notes"].startswith("moe: SGLang's Marlin over the forward")


def test_a_marlin_build_that_fails_leaves_ours_in_its_place_with_the_failure(monkeypatch):
    from verifybench.harness.engines import marlin

    def broken(dtype):
        raise engines.EngineMissing("sglang 0.5.10.post1: build failed here: RuntimeError: Ninja build failed")
    monkeypatch.setattr(marlin, "build", broken)
    comp = deployed.Composition(_dep(moe="sglang.marlin"))
    assert deployed.deployed_moe(comp, "cuda", torch.bfloat16) is None
    assert comp.stand_ins == [("moe", "sglang.marlin", "ours.moe",
                               "sglang 0.5.10.post1: build failed here: RuntimeError: Ninja build failed")]


def test_the_check_holds_the_engines_moe_to_the_reference_at_the_forwards_shape_and_token_counts(fwd, monkeypatch):
    from verifybench.harness.engines import marlin

    seen = []

    def check(*args):
        seen.append(args)
        return seen[0] is args, "sglang.marlin vs fp32 reference: rel_err 1e-3"
    monkeypatch.setattr(marlin, "check_against_reference", check)
    comp = deployed.Composition(_dep(moe="ours.moe"))
    assert deployed.check(comp, fwd) == (True, "")  # ours: the forward's own check covers it
    comp.moe, comp.ran["moe"] = marlin.forward_moe, "sglang.marlin"
    ok, detail = deployed.check(comp, fwd, tokens=(1, 3))
    s = fwd.s
    assert ok and detail == "sglang.marlin vs fp32 reference: rel_err 1e-3"
    assert seen[0] == (s.hidden, s.expert_intermediate, s.expert_group_size, s.topk, s.experts, (1, 3), fwd.dtype,
                       fwd.device)
    assert deployed.check(comp, fwd)[0] is False and seen[1][5] == (fwd.batch,)  # a failure fails the case

    def missing(*args):
        raise engines.EngineMissing("sglang 0.5.10.post1: check_against_reference failed here: RuntimeError: x")
    monkeypatch.setattr(marlin, "check_against_reference", missing)
    ok, detail = deployed.check(comp, fwd)
    assert not ok and "check_against_reference failed here" in detail


def test_the_ab_runs_one_case_set_per_variant_and_records_each_deployment(resolved):
    from verifybench.harness.components import cycle

    specs = cycle.cases("tiny", 1, 64, configs="2,1,3;2,2,3", engine="sglang",
                        ab="--triton-attention-num-kv-splits 64;--attention-backend flashinfer")
    by = {}
    for s in specs:
        by.setdefault(s.params["deployment"], []).append(s)
    assert list(by) == ["deployed", "triton-attention-num-kv-splits=64", "attention-backend=flashinfer"]
    assert len(by["deployed"]) == len(by["triton-attention-num-kv-splits=64"]) == 2
    assert [s.params["topk"] for s in by["attention-backend=flashinfer"]] == [1]  # FlashInfer: chains only
    assert by["triton-attention-num-kv-splits=64"][0].params["kernels"]["decode kv splits"] == 64
    assert by["deployed"][0].params["attention"] == "sglang.extend"
    assert by["attention-backend=flashinfer"][0].params["engine_args"] == "--attention-backend flashinfer"
    assert len({s.name for s in specs}) == len(specs)
    assert cycle.cases("tiny", 1, 64, configs="2,1,3", engine="sglang", beside_ours=True)[-1].params[
        "deployment"] == "ours"


def test_the_ab_flags_are_checked_in_one_line():
    for bad in ("", ";", "--a 1;;--b", "x 1", "--a 1;--a 1"):
        with pytest.raises(ValueError, match="--ab"):
            deployments.parse_ab(bad)
    assert deployments.parse_ab("levers") == list(deployments.LEVERS_AB)
    with pytest.raises(ValueError, match="need --engine"):
        deployments.variants(None, None, "--a 1")


def test_a_variant_that_sets_the_draft_shape_runs_that_shape():
    dep = _dep(args=("--speculative-num-steps", "5", "--speculative-eagle-topk=1", "--speculative-num-draft-tokens",
                     "6"))
    assert deployments.spec_shape(dep) == (5, 1, 6)
    assert deployments.spec_shape(_dep()) is None


def test_a_deployed_cycle_case_checks_the_engines_kernels_then_times_and_its_tables_open_with_the_line(resolved):
    _sglang_or_skip()
    from verifybench.harness.components import cycle

    (spec,) = cycle.cases("tiny", 1, 64, configs="2,1,3", engine="sglang",
                          engine_args="--triton-attention-num-kv-splits 4")
    case = spec.run(max_time_s=0.1)
    assert case.check_ok, case.check_detail
    assert "sglang.decode decode vs torch" in case.check_detail and "oracle draft accepted 2 of 2" in case.check_detail
    ran = case.derived["deployment"]
    assert ran["kernels"]["decode attention"] == "sglang.decode" and ran["kernels"]["verify attention"] == \
        "sglang.extend"
    assert ran["stand_ins"] == [] and case.derived["attention_ran"] == "sglang.extend"
    (title, rows), *_ = cycle.tables([{**case.as_dict(), "device": "cpu"}])
    assert title.startswith(_dep(splits=4).line()) and rows[0]["variant"] == "deployed"
    assert cycle.tables([])[0][0] == Deployment(None, None).line()  # without --engine: the suite's kernels


def _ab_cycle(tmp_path, device="cuda"):
    """The committed H200 cycle's (2,1,3) extend case as three deployment variants of known cycle and decode ms; the
    flashinfer variant's verify attention stood in for (no mla_verify beside it to project with)."""
    import copy
    from pathlib import Path

    from verifybench.harness.measure.results import store

    h200 = Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1"
    run = store.read_json(h200 / "cycle.json")
    (base,) = [c for c in run["cases"] if c["check"]["ok"] and c["params"]["attention"] == "extend"
               and (c["params"]["steps"], c["params"]["topk"], c["params"]["draft_tokens"]) == (2, 1, 3)]
    cases = []
    for tag, flags, cycle_ms, decode_ms, stood in (
            ("deployed", "", 30.0, 20.0, []),
            ("triton-attention-num-kv-splits=64", "--triton-attention-num-kv-splits 64", 26.0, 16.0, []),
            ("attention-backend=flashinfer", "--attention-backend flashinfer", 24.0, 15.0,
             [["verify attention", "flashinfer.mla", "ours.split_kv", "flashinfer is not installed"]])):
        c = copy.deepcopy(base)
        c["name"] = f"cycle/kimi/{tag}/s2k1d3/x"
        c["device"] = device
        c["params"].update(deployment=tag, engine="sglang", engine_version="0.5.10.post1", engine_args=flags,
                           deployment_line="the engine as deployed: sglang 0.5.10.post1, attention triton",
                           kernels={})
        c["summary"]["median_us"] = cycle_ms * 1e3
        c["samples_us"] = [cycle_ms * 1e3] * len(c["samples_us"])  # a median its samples bear out (the reader checks)
        c["derived"].update(cycle_ms=cycle_ms, decode_ms=decode_ms,
                            deployment={"kernels": {}, "stand_ins": stood})
        cases.append(c)
    run["cases"] = cases
    store.write_json_atomic(tmp_path / "cycle.json", run)
    return tmp_path / "cycle.json"


def test_advise_ranks_the_ab_variants_by_measured_ms_with_each_variants_own_decode(tmp_path, capsys):
    from verifybench.harness.cli import main as cli_main

    assert cli_main(["advise", str(_ab_cycle(tmp_path))]) == 0
    text = capsys.readouterr().out
    assert text.split("## The answer\n")[1].startswith("(for the engine as deployed: sglang 0.5.10.post1")
    section = text.split("## The engine's flags, measured A/B")[1].split("\n## ")[0]
    ranked = [x for x in section.splitlines() if x[:3] in ("1. ", "2. ")]
    assert ranked[0].startswith("1. triton-attention-num-kv-splits=64") and "26 ms per cycle" in ranked[0]
    assert "saves 4 ms against the deployed" in ranked[0] and "tau* 1.62" in ranked[0]  # 26 / its own 16
    assert ranked[1].startswith("2. deployed") and "tau* 1.5" in ranked[1]  # 30 / 20
    assert "- attention-backend=flashinfer (--attention-backend flashinfer): not ranked" in section
    assert "no mla_verify result to project with" in section


def test_ab_says_a_variant_within_compares_minimum_effect_changed_nothing(tmp_path, capsys):
    """64 KV splits at 30.5 ms against the deployed 30 ms (1.7%, under compare's 3%): no saving is claimed."""
    from verifybench.harness.cli import main as cli_main
    from verifybench.harness.measure.results import store

    path = _ab_cycle(tmp_path)
    run = json.loads(path.read_text())
    for c in run["cases"]:
        if c["params"]["deployment"].startswith("triton-attention"):
            c["derived"]["cycle_ms"] = 30.5
            c["summary"]["median_us"] = 30.5e3
            c["samples_us"] = [30.5e3] * len(c["samples_us"])
    store.write_json_atomic(path, run)
    assert cli_main(["advise", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "triton-attention-num-kv-splits=64 (" in x)
    assert "within 3% of the deployed (+0.5 ms): no change" in line and "saves" not in line


@pytest.mark.parametrize("case", ["slower", "not significant"])
def test_ab_judges_a_variant_by_compares_verdict_on_the_samples(tmp_path, capsys, case):
    """64 KV splits slower than the deployed 30 ms (33 ms every sample): a cost, never a negative saving; at a median
    of 31 ms (3.3%) from samples on both sides of the deployed's 30 ms: not significant, no change claimed."""
    from verifybench.harness.cli import main as cli_main
    from verifybench.harness.measure.results import store

    path = _ab_cycle(tmp_path)
    run = json.loads(path.read_text())
    for c in run["cases"]:
        if c["params"]["deployment"].startswith("triton-attention"):
            n = len(c["samples_us"])
            samples = [33e3] * n if case == "slower" else [29e3] * (n // 2) + [33e3] * (n // 2) + [31e3] * (n % 2)
            c["samples_us"] = samples
            c["summary"]["median_us"] = float(np.median(samples))
            c["derived"]["cycle_ms"] = c["summary"]["median_us"] / 1e3
    store.write_json_atomic(path, run)
    assert cli_main(["advise", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "triton-attention-num-kv-splits=64 (" in x)
    assert "saves" not in line and "each variant ran once" in out
    if case == "slower":
        assert "costs 3 ms more than the deployed (U p=" in line
    else:
        assert "+1 ms against the deployed, not significant (U p=" in line and "no change the samples show" in line


def test_advise_on_a_cpu_ab_withholds_its_figures_and_still_names_the_stand_ins(tmp_path, capsys):
    from verifybench.harness.cli import main as cli_main

    assert cli_main(["advise", str(_ab_cycle(tmp_path, "cpu"))]) == 0
    section = capsys.readouterr().out.split("## The engine's flags, measured A/B")[1].split("\n## ")[0]
    assert "26" not in section and "flashinfer.mla" in section and "withheld" in section


def test_verify_with_an_engine_runs_the_forward_with_its_decode_and_checks_it_first(resolved):
    _sglang_or_skip()
    from verifybench.harness.components import verify

    specs = verify.cases("tiny", 1, 64, (1,), engine="sglang")
    full = next(s for s in specs if s.params["variant"] == "full")
    assert "/deployed/full/n1" in full.name and full.params["engine"] == "sglang"
    case = full.run(max_time_s=0.05)
    assert case.check_ok, case.check_detail
    assert "sglang.decode decode vs torch" in case.check_detail
    assert case.derived["deployment"]["kernels"]["decode attention"] == "sglang.decode"


def test_run_with_an_engine_gives_the_cycle_the_deployment_and_ours_beside_it(resolved):
    from verifybench.harness import run

    scope = {"preset": "tiny", "tp": 1, "context": 64, "tokens": None, "batch": None, "options": {},
             "engine": "sglang", "engine_args": "--triton-attention-num-kv-splits 32"}
    tags = {s.params["deployment"] for s in run._cases("cycle", scope)}
    assert tags == {"deployed", "ours"}
    assert {s.params.get("deployment") for s in run._cases("verify", scope)} == {"deployed"}
    assert "deployment" not in run._cases("cycle", {**scope, "engine": None, "engine_args": None})[0].params


def test_plan_on_an_ab_cycle_plans_one_variant_with_its_own_decode(tmp_path, capsys):
    from verifybench.harness.cli import main as cli_main

    path = _ab_cycle(tmp_path)
    assert cli_main(["plan", str(path), "--accept-len", "3:2.4", "--deployment",
                     "triton-attention-num-kv-splits=64"]) == 0
    out = capsys.readouterr().out
    assert "planning the deployment variant 'triton-attention-num-kv-splits=64'" in out
    assert "26" in out and "1.62" in out  # its cycle, and tau* against its own 16 ms decode
    assert cli_main(["plan", str(path), "--accept-len", "3:2.4", "--deployment", "nope"]) == 2
    assert "holds attention-backend=flashinfer, deployed, triton" in capsys.readouterr().err


def test_advise_projects_a_variant_whose_kernel_stood_in_from_the_engine_rows_of_mla_verify(tmp_path, capsys):
    """The flashinfer variant ran our split-KV in FlashInfer's place: its cycle is the measured one with split_kv's
    per-forward attention swapped for FlashInfer's from mla_verify (here 2 ms more), marked projected."""
    import copy
    from pathlib import Path

    from verifybench.harness.cli import main as cli_main
    from verifybench.harness.measure.results import store

    cycle = _ab_cycle(tmp_path)
    mv = store.read_json(Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1/mla_verify.json")
    split = [c for c in mv["cases"] if c["params"]["variant"] == "split_kv" and c["check"]["ok"]]
    for c in split:
        f = copy.deepcopy(c)
        f["name"] = c["name"].replace("split_kv", "flashinfer.mla")
        f["params"]["variant"] = "flashinfer.mla"
        f["derived"]["per_forward_us"] = c["derived"]["per_forward_us"] + 2000.0
        mv["cases"].append(f)
    store.write_json_atomic(tmp_path / "mla_verify.json", mv)
    assert cli_main(["advise", str(cycle), str(tmp_path / "mla_verify.json")]) == 0
    section = capsys.readouterr().out.split("## The engine's flags, measured A/B")[1].split("\n## ")[0]
    line = next(x for x in section.splitlines() if "attention-backend=flashinfer (" in x)
    assert line.startswith("2. ") and "26 ms per cycle" in line and "[projected]" in line  # 24 + 2
    assert "verify attention flashinfer.mla" in section and "(mla_verify)" in section


def test_at_two_requests_the_engines_decode_and_draft_read_each_requests_own_rows(monkeypatch):
    _, decode, _ = _sglang_or_skip()
    seen = []
    _record(monkeypatch, decode, "decode_attention_fwd", seen)
    fwd2 = build_forward("tiny", 1, None, 32, 0.0, batch=2).at_batch(2)
    comp = deployed.compose(_dep(), fwd2)
    cyc = Cycle(deployed.apply(fwd2, comp), SpecConfig(2, 1, 3), "extend", lambda t: None, graphs=False,
                deployed=comp)
    ok, detail = deployed.check(comp, deployed.apply(fwd2, comp), cyc.draft)
    assert ok, detail
    assert {args[0].shape[0] for args, _, _ in seen} == {2}  # B rows: one query per request
    assert cyc.attention_error() <= 1e-2
