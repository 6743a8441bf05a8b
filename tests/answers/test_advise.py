"""`verifybench advise` (answers/advise.py): each lever's figures recomputed by hand from the committed H200
results, CPU results withheld, lost NCCL settings, the report's opening, and `cycle --contexts`."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from verifybench.harness.answers import advise
from verifybench.harness.cli import main as cli_main
from verifybench.harness.components import cycle as bench_cycle
from verifybench.harness.measure import env
from verifybench.harness.measure.results import result_files, store

ROOT = Path(__file__).resolve().parents[2] / "results/baselines"
H200, H200X2 = ROOT / "nvidia-h200-x1", ROOT / "nvidia-h200-x2"


def _advise(capsys, *argv):
    assert cli_main(["advise", str(H200), str(H200X2), *argv]) == 0
    return capsys.readouterr().out


def _cycle_ms(config, attention):
    run = store.load_run(H200 / "cycle.json")
    (case,) = [c for c in run["cases"] if c["check"]["ok"] and c["params"]["attention"] == attention
               and (c["params"]["steps"], c["params"]["topk"], c["params"]["draft_tokens"]) == config]
    return case["summary"]["median_us"] / 1e3


def _decode_ms():
    run = store.load_run(H200 / "cycle.json")
    return float(np.median([c["derived"]["decode_ms"] for c in run["cases"] if c["check"]["ok"]]))


def test_advise_attention_lever_is_the_cycles_extend_minus_split_kv(capsys):
    text = _advise(capsys)
    ext, spl = _cycle_ms((2, 1, 3), "extend"), _cycle_ms((2, 1, 3), "split_kv")
    assert f"1. verify attention: extend -> split_kv: {ext:.4g} -> {spl:.4g} ms per cycle (saves {ext - spl:.4g} ms)" \
        in text
    assert f"break-even tau* {spl / _decode_ms():.3g}" in text and "FlashInfer MLA ignores the tree mask" in text


def test_advise_allreduce_lever_is_the_sweep_winners_saving_per_call_times_calls(capsys):
    text = _advise(capsys)
    sweep = store.load_run(H200X2 / "allreduce_sweep.json.gz")
    at = {c["params"]["nccl_setting"]: c["summary"]["median_us"] for c in sweep["cases"] if c["check"]["ok"]
          and c["params"]["backend"] == "nccl" and c["params"]["size_bytes"] == 7168 * 2 * 3}
    per_call = at["default"] - at["NCCL_GRAPH_MIXING_SUPPORT=0"]
    saved = per_call * 122 / 1e3
    ext = _cycle_ms((2, 1, 3), "extend")
    assert f"allreduce: NCCL_GRAPH_MIXING_SUPPORT=0 (the NCCL sweep's winner): {ext:.4g} -> {ext - saved:.4g} ms" in text
    assert "NCCL NCCL" not in text  # the setting named once, not after a doubled word
    assert f"(saves {saved:.4g} ms)" in text and "NCCL_GRAPH_MIXING_SUPPORT=0" in text and "projected" in text


def test_advise_kernel_config_lever_is_the_forwards_default_minus_tuned_at_d(capsys):
    text = _advise(capsys)
    row = next(r for r in store.read_json(H200 / "defaults_vs_tuned.json")["rows"] if r["n"] == 3)
    gap = (row["forward_default_us"] - row["forward_tuned_us"]) / 1e3
    ext = _cycle_ms((2, 1, 3), "extend")
    assert f"kernel configs: defaults -> tuned: {ext + gap:.4g} -> {ext:.4g} ms per cycle (saves {gap:.4g} ms)" in text


def test_advise_graph_lever_is_the_model_graphs_eager_minus_graph_scaled_to_the_cycles_layers(capsys):
    text = _advise(capsys)
    run = store.load_run(H200 / "graph_replay.json.gz")
    t = {c["mode"]: c["summary"]["median_us"] for c in run["cases"] if c["params"].get("tokens") == 1}
    gap = (t["hot"] - t["graph"]) / 1e3 * 61 / 60
    ext = _cycle_ms((2, 1, 3), "extend")
    assert f"CUDA graphs: eager -> graph: {ext + gap:.4g} -> {ext:.4g} ms per cycle (saves {gap:.4g} ms)" in text


def test_advise_levers_are_ranked_by_ms_saved():
    found = advise.resolve([H200, H200X2])
    rows = [r for r in advise.levers(advise.load(found), found, None, None, "sglang") if "missing" not in r]
    saved = [r["saved_ms"] for r in rows]
    assert len(rows) >= 4 and saved == sorted(saved, reverse=True)


def test_advise_with_accept_lengths_gives_tok_s_per_lever_and_the_best_draft_shape(capsys):
    text = _advise(capsys, "--accept-len", "3:2.4,6:3.1")
    spl = _cycle_ms((2, 1, 3), "split_kv")
    assert f"; {1000 * 2.4 / spl:.4g} tok/s" in text
    six = _cycle_ms((5, 1, 6), "extend")
    ext = _cycle_ms((2, 1, 3), "extend")
    assert f"draft shape: (2, 1, 3) -> (5, 1, 6): {ext:.4g} -> {six * 2.4 / 3.1:.4g} ms per cycle" in text
    assert f"break-even tau* {six / _decode_ms():.3g}; {1000 * 3.1 / six:.4g} tok/s" in text
    assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6" in text


def test_advise_answer_carries_the_forward_fit_and_fits_fifteen_lines(capsys):
    text = _advise(capsys)
    run = store.load_run(H200 / "verify.json")
    full = {c["params"]["tokens"]: c["summary"]["median_us"] / 1e3 for c in run["cases"]
            if c["check"]["ok"] and c["params"]["variant"] == "full"}
    b, a = np.polyfit(list(full), list(full.values()), 1)
    answer = text.split("## The answer\n")[1].split("\n\n")[0].splitlines()
    assert answer[0].startswith("(for the suite's kernels")  # no --engine: the answer says whose it is
    assert len(answer) <= 16 and f"T(n) = {a:.3g} +-" in answer[1] and f"{b:.3g} +-" in answer[1]


def test_advise_at_a_context_between_measured_ones_interpolates_mla_verify_and_says_so(capsys):
    text = _advise(capsys, "--context", "2048")
    run = store.load_run(H200 / "mla_verify.json")

    def per_forward_ms(variant, ctx):
        pts = sorted((c["params"]["context"], c["derived"]["per_forward_us"] / 1e3) for c in run["cases"]
                     if c["check"]["ok"] and c["params"]["variant"] == variant and c["params"]["tokens"] == 3
                     and c["params"]["tree"] == "chain")
        return float(np.interp(ctx, [p[0] for p in pts], [p[1] for p in pts]))

    before = _cycle_ms((2, 1, 3), "extend") + per_forward_ms("extend", 2048) - per_forward_ms("extend", 4096)
    after = _cycle_ms((2, 1, 3), "split_kv") + per_forward_ms("split_kv", 2048) - per_forward_ms("split_kv", 4096)
    assert f"extend -> split_kv: {before:.4g} -> {after:.4g} ms" in text
    assert "interpolated between contexts 1024 and 4096" in text and "projected" in text


def test_advise_outside_the_measured_contexts_is_refused_in_one_line(capsys):
    assert cli_main(["advise", str(H200), "--context", "100000"]) == 2
    assert "outside" in capsys.readouterr().err


def test_advise_refuses_an_accept_length_past_the_shapes_depth_in_one_line(capsys):
    assert cli_main(["advise", str(H200), "--accept-len", "3:3.5"]) == 2
    err = capsys.readouterr().err
    assert "outside 1..3" in err and err.count("\n") == 1


def test_advise_names_the_command_for_a_lever_it_cannot_cost(capsys):
    assert cli_main(["advise", str(H200 / "cycle.json")]) == 0
    text = capsys.readouterr().out
    assert "allreduce: not measured here; measure it with `python3 -m verifybench.harness.multigpu.allreduce" in text
    assert "CUDA graphs: not measured here; measure it with `verifybench graph_replay`" in text


def _as_cpu(src: Path, dst: Path) -> Path:
    run = store.read_json(src)
    for c in run.get("cases", []):
        c["device"] = "cpu"
    fp = run.get("fingerprint", {})
    fp.update(gpu_model="cpu", gpus=[], torch_device=None)  # a CPU machine's fingerprint names no GPU
    return store.write_json_atomic(dst / src.name, run)


def test_advise_on_cpu_results_withholds_every_figure(tmp_path, capsys):
    for name in ("cycle.json", "verify.json", "graph_replay.json.gz", "mla_verify.json"):
        _as_cpu(H200 / name, tmp_path)
    assert cli_main(["advise", str(tmp_path), "--accept-len", "3:2.4"]) == 0
    text = capsys.readouterr().out
    ext = _cycle_ms((2, 1, 3), "extend")
    assert store.WITHHELD in text and f"{ext:.4g}" not in text and "tok/s" not in text
    assert not any(ch.isdigit() for line in text.split("## Levers")[0].splitlines()[2:] for ch in line)


def test_advise_on_cpu_results_ranks_nothing_prints_no_engine_flag_and_lists_what_it_would_rank(tmp_path, capsys):
    for name in ("cycle.json", "verify.json", "graph_replay.json.gz", "mla_verify.json"):
        _as_cpu(H200 / name, tmp_path)
    assert cli_main(["advise", str(tmp_path), "--accept-len", "3:2.4"]) == 0
    levers = capsys.readouterr().out.split("## Levers", 1)[1]
    assert "would rank on a GPU" in levers and "1." not in levers and "--speculative" not in levers
    assert "--attention-backend" not in levers and "[measured" not in levers
    assert all(f"- {name}: on a GPU, `{cmd}`" in levers for name, cmd in advise.MEASURE.items())


def test_advise_attention_lever_on_torch_reference_rows_is_not_measured(tmp_path, capsys):
    """A cycle whose split_kv and extend rows ran the torch reference (as on CPU) costs no attention lever."""
    run = store.read_json(H200 / "cycle.json")
    for c in run["cases"]:
        c.setdefault("derived", {})["attention_ran"] = "torch reference"
    store.write_json_atomic(tmp_path / "cycle.json", run)
    assert cli_main(["advise", str(tmp_path / "cycle.json")]) == 0
    text = capsys.readouterr().out
    assert "extend -> split_kv" not in text
    assert "verify attention: not measured here" in text and "torch reference standing in" in text


def test_advise_on_a_cpu_cycle_names_the_torch_reference_that_stood_in(tmp_path, capsys):
    run = store.read_json(H200 / "cycle.json")
    for c in run["cases"]:
        c["device"] = "cpu"
        c.setdefault("derived", {})["attention_ran"] = "torch reference"
    store.write_json_atomic(tmp_path / "cycle.json", run)
    assert cli_main(["advise", str(tmp_path / "cycle.json")]) == 0
    assert "ran a torch reference in place of extend and split_kv: no attention kernel ran" in capsys.readouterr().out


def test_advise_help_explains_the_answer_levers_and_withholding(capsys):
    assert cli_main(["advise", "--help"]) == 0
    text = capsys.readouterr().out
    assert "ranked by ms saved" in text and "withheld" in text and "--nccl-from" in text


def test_advise_and_env_warn_about_each_nccl_variable_that_differs_from_the_sweeps_winner(monkeypatch, capsys):
    sweep = H200X2 / "allreduce_sweep.json.gz"
    lines = env.nccl_warnings(sweep, {"NCCL_PROTO": "LL", "NCCL_DEBUG": "INFO"})
    assert "winner 'NCCL_GRAPH_MIXING_SUPPORT=0'" in lines[0] and len(lines) == 3
    assert any("NCCL_GRAPH_MIXING_SUPPORT: here unset, the sweep's winner 0" in x for x in lines)
    assert any("NCCL_PROTO: here LL" in x for x in lines)
    assert env.nccl_warnings(sweep, {"NCCL_GRAPH_MIXING_SUPPORT": "0"})[0].endswith("matches it")
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    assert cli_main(["advise", str(H200), "--nccl-from", str(sweep)]) == 0
    assert "WARNING NCCL_PROTO: here Simple" in capsys.readouterr().out


def test_nccl_from_refuses_a_result_that_is_not_a_sweep_naming_it(capsys):
    assert cli_main(["env", "--nccl-from", str(H200 / "cycle.json")]) == 2
    err = capsys.readouterr().err
    assert "cycle.json: a cycle result" in err and "allreduce_sweep" in err and err.count("\n") == 1


def test_advise_nccl_from_a_cycle_result_says_it_is_not_a_sweep_result(capsys):
    assert cli_main(["advise", str(H200 / "cycle.json"), "--nccl-from", str(H200 / "cycle.json")]) == 2
    err = capsys.readouterr().err
    assert "a cycle result, not an NCCL sweep result" in err and "no passing default" not in err
    assert err.count("\n") == 1


def _cpu_sweep(dst: Path) -> Path:
    """The GPU sweep as a CPU sweep stores it: gloo cases, a CPU fingerprint."""
    run = store.read_json(H200X2 / "allreduce_sweep.json.gz")
    for c in run["cases"]:
        c["device"], c["params"]["backend"] = "cpu", "gloo"
    run["fingerprint"].update(gpu_model="cpu", gpus=[], torch_device=None, cuda_available=False)
    return store.write_json_atomic(dst / "allreduce_sweep-20261205T000000Z.json", run)


def test_nccl_from_a_cpu_sweep_says_in_one_line_it_gives_no_recommendation(tmp_path, capsys):
    sweep = _cpu_sweep(tmp_path)
    assert cli_main(["env", "--nccl-from", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert out.count("CPU sweep results give no NCCL recommendation") == 1 and "winner" not in out
    _as_cpu(H200 / "cycle.json", tmp_path)
    assert cli_main(["advise", str(tmp_path / "cycle.json"), "--nccl-from", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "CPU sweep results give no NCCL recommendation" in out and "export" not in out


def test_nccl_from_a_gpu_sweep_file_names_its_winner(capsys):
    assert cli_main(["env", "--nccl-from", str(H200X2 / "allreduce_sweep.json.gz")]) == 0
    assert "winner 'NCCL_GRAPH_MIXING_SUPPORT=0'" in capsys.readouterr().out


def test_result_kind_is_the_name_before_the_stamp_or_the_baselines_stem(tmp_path):
    assert result_files.kind_of(Path("verify-20261202T101010Z.json")) == "verify"
    assert result_files.kind_of(Path("allreduce_sweep.json.gz")) == "allreduce_sweep"
    for stamp in ("20261201T000000Z", "20261202T000000Z"):
        (tmp_path / f"cycle-{stamp}.json").write_text("{}")
    (tmp_path / "cycle_contexts-20261203T000000Z.png").write_text("")
    assert result_files.latest_of_kind(tmp_path, "cycle").name == "cycle-20261202T000000Z.json"
    assert result_files.latest_of_kind(tmp_path, "verify") is None


def test_report_opening_is_the_answer_and_levers_within_one_screen():
    runs = {k: store.load_run(H200 / f) for k, f in (("verify", "verify.json"), ("cycle", "cycle.json"),
                                                         ("graph_replay", "graph_replay.json.gz"))}
    lines = advise.report_lines(runs, Path("out"))
    assert lines[0] == "### The answer" and len(lines) <= 40
    assert any("verify attention: extend -> split_kv" in x for x in lines)
    assert any(f"cycle-{store.stamp(runs['cycle'])}.json" in x for x in lines)


def test_cycle_contexts_gives_one_case_per_context_with_the_context_in_its_name():
    cases = bench_cycle.cases("tiny", 1, 64, None, configs="2,1,3", attention="split_kv", contexts="32,128")
    assert [c.params["context"] for c in cases] == [32, 128]
    assert len({c.name for c in cases}) == 2 and "ctx32" in cases[0].name


@pytest.mark.parametrize("text", ["", "0,64", "64,64", "1k"])
def test_cycle_contexts_refuses_a_bad_list_naming_it(text):
    with pytest.raises(ValueError, match="--contexts"):
        bench_cycle.parse_contexts(text)


def test_cycle_contexts_chart_plots_cycle_ms_against_context_per_variant(tmp_path):
    run = store.load_run(H200 / "cycle.json")
    records = []
    for ctx, scale in ((1024, 0.5), (4096, 1.0)):
        for c in run["cases"]:
            r = json.loads(json.dumps(c))
            r["params"]["context"] = ctx
            r["derived"]["cycle_ms"] *= scale
            records.append(r)
    pngs = bench_cycle.charts(records, tmp_path, "20261202T000000Z")
    assert [p.name for p in pngs] == ["cycle_phases-20261202T000000Z.png", "cycle_contexts-20261202T000000Z.png"]
    assert all(p.stat().st_size > 0 for p in pngs)


def _at_two_contexts(device: str) -> list[dict]:
    run = store.load_run(H200 / "cycle.json")
    records = []
    for ctx, scale in ((1024, 0.5), (4096, 1.0)):
        for c in run["cases"]:
            r = json.loads(json.dumps(c))
            r["params"]["context"], r["device"] = ctx, device
            r["derived"]["cycle_ms"] *= scale
            records.append(r)
    return records


def test_cycle_contexts_command_writes_the_chart_its_help_promises(tmp_path):
    line = bench_cycle.context_chart_line(_at_two_contexts("cuda"), tmp_path, "20261202T000000Z")
    png = tmp_path / "cycle_contexts-20261202T000000Z.png"
    assert line == f"chart: {png}" and png.stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke profile's cycle")
def test_cycle_contexts_on_cpu_writes_no_chart_and_says_why_in_one_line(tmp_path, capsys):
    assert bench_cycle.context_chart_line(_at_two_contexts("cpu"), tmp_path, "x").startswith("no chart")
    assert cli_main(["cycle", "--contexts", "32,64", "--configs", "2,1,3", "--out", str(tmp_path)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "chart of cycle ms against context" in line]
    assert len(said) == 1 and said[0].startswith("no chart") and not list(tmp_path.glob("cycle_contexts-*.png"))


def test_advise_at_a_context_the_cycle_lacks_says_so_and_prints_the_attention_it_projects_with(capsys):
    text = _advise(capsys, "--context", "1024")
    answer = text.split("## The answer\n")[1].split("\n\n")[0]
    assert "cycle at context 1024: not measured (the cycle file ran at context 4096" in answer
    run = store.load_run(H200 / "mla_verify.json")
    (ext,) = [c["derived"]["per_forward_us"] for c in run["cases"] if c["check"]["ok"] and c["params"]["context"] ==
              1024 and c["params"]["tokens"] == 3 and c["params"]["variant"] == "extend"
              and c["params"]["tree"] == "chain"]
    assert f"extend {ext / 1e3:.4g} ms" in text and f"{ext / 1e3:.4g}" == "11.41"  # docs/deployment-example.md's B


def test_advise_says_why_the_draft_shape_lever_is_absent(capsys):
    text = _advise(capsys, "--accept-len", "3:2.4")
    assert "- draft shape: (2, 1, 3) stays: the only shape given an accept length; the cycle also ran (3, 1, 4)" in text


@pytest.mark.parametrize("command", ["advise", "plan"])
def test_accept_rates_help_says_how_many_rates(command, capsys):
    assert cli_main([command, "--help"]) == 0
    assert "as many rates as the deepest shape reaches" in " ".join(capsys.readouterr().out.split())


def test_advise_for_vllm_gives_vllms_cuda_graph_caveat_not_sglangs(capsys):
    text = _advise(capsys, "--engine", "vllm")
    graphs = text.split("CUDA graphs: eager -> graph")[1].split("\n", 3)[2]
    assert graphs.startswith("   vllm:") and "SGLang" not in graphs and "capture sizes" in graphs


def _with_engine_rows(tmp_path, engine_scale: float, flash_scale: float, plan_us: float) -> Path:
    """The H200 folder's verify and cycle, and its mla_verify with engine rows added beside ours: SGLang's extend at
    engine_scale x ours, FlashInfer at flash_scale x our split_kv plus a plan (the arithmetic, not measurements)."""
    for name in ("verify.json", "cycle.json"):
        (tmp_path / name).write_bytes((H200 / name).read_bytes())
    run = store.read_json(H200 / "mla_verify.json")
    added = []
    for c in run["cases"]:
        variant, scale = {"extend": ("sglang.extend", engine_scale), "split_kv": ("flashinfer.mla", flash_scale)}.get(
            c["params"]["variant"], (None, None))
        if variant is None or c["params"]["tree"] != "chain":
            continue
        e = json.loads(json.dumps(c))
        e["name"] = c["name"].replace(f"/{c['params']['variant']}/", f"/{variant}/")
        e["params"]["variant"] = variant
        e["derived"]["per_forward_us"] = c["derived"]["per_forward_us"] * scale + (plan_us if "flash" in variant else 0)
        added.append(e)
    run["cases"] += added
    (tmp_path / "mla_verify.json").write_text(json.dumps(run))
    return tmp_path


def _pf_ms(variant, d, context):
    run = store.load_run(H200 / "mla_verify.json")
    (c,) = [c for c in run["cases"] if c["check"]["ok"] and c["params"]["variant"] == variant
            and c["params"]["tokens"] == d and c["params"]["context"] == context and c["params"]["tree"] == "chain"]
    return c["derived"]["per_forward_us"] / 1e3


def test_advise_costs_the_attention_levers_on_the_engines_own_kernels_where_mla_verify_timed_them(tmp_path, capsys):
    folder = _with_engine_rows(tmp_path, engine_scale=0.5, flash_scale=3.0, plan_us=150.0)
    assert cli_main(["advise", str(folder)]) == 0
    text = capsys.readouterr().out
    ext, spl = _cycle_ms((2, 1, 3), "extend"), _cycle_ms((2, 1, 3), "split_kv")
    ours, split_pf = _pf_ms("extend", 3, 4096), _pf_ms("split_kv", 3, 4096)
    engine_cycle = ext - ours + 0.5 * ours  # the cycle with SGLang's own extend in place of our stand-in
    flash_cycle = spl - split_pf + (3.0 * split_pf + 0.15)
    assert (f"verify attention: SGLang's Triton extend -> split-KV (ours: what the engine could reach): "
            f"{engine_cycle:.4g} -> {spl:.4g} ms per cycle") in text
    assert (f"verify attention: SGLang's Triton extend -> FlashInfer MLA (topk 1 only): {engine_cycle:.4g} -> "
            f"{flash_cycle:.4g} ms per cycle") in text
    assert "its plan() on the host included" in text and "extend -> split_kv:" not in text
    assert "not measured here; measure it with `verifybench mla_verify on a GPU with SGLang and FlashInfer" \
        not in text


def test_advise_without_engine_rows_says_its_extend_is_our_stand_in_and_names_the_flashinfer_measurement(capsys):
    text = _advise(capsys)
    assert "extend is our stand-in for the engine's kernel" in text
    assert "verify attention -> FlashInfer MLA: not measured here" in text


def _with_batch_rows(tmp_path, scale: float, engine: bool = False) -> Path:
    """The H200 folder with its mla_verify's chains added again at B = 2 (named B2, `scale` x the time; with
    `engine`, SGLang's extend too, at B = 2 only): rows a one-request lever must not read."""
    for name in ("verify.json", "cycle.json", "graph_replay.json.gz"):
        (tmp_path / name).write_bytes((H200 / name).read_bytes())
    run = store.read_json(H200 / "mla_verify.json")
    added = []
    for c in run["cases"]:
        if c["params"]["tree"] != "chain" or c["params"]["variant"] not in ("extend", "split_kv"):
            continue
        for variant in ("extend", "sglang.extend") if engine and c["params"]["variant"] == "extend" else \
                (c["params"]["variant"],):
            e = json.loads(json.dumps(c))
            e["name"] = c["name"].replace("/chain/", "/B2/chain/").replace("/extend/", f"/{variant}/")
            e["params"].update(batch=2, variant=variant)
            e["derived"]["per_forward_us"] = c["derived"]["per_forward_us"] * scale
            added.append(e)
    run["cases"] += added
    (tmp_path / "mla_verify.json").write_text(json.dumps(run))
    return tmp_path


@pytest.mark.parametrize("engine", [False, True], ids=["ours", "engine-at-B2-only"])
def test_advise_reads_mla_verify_at_one_request_where_the_file_holds_several_batches(tmp_path, capsys, engine):
    folder = _with_batch_rows(tmp_path, scale=10.0, engine=engine)
    assert cli_main(["advise", str(H200), "--context", "2048"]) == 0
    alone = capsys.readouterr().out
    assert cli_main(["advise", str(folder), "--context", "2048"]) == 0
    mixed = capsys.readouterr().out
    lever = next(line for line in alone.splitlines() if "extend -> split_kv:" in line)
    assert lever.split(" ms per cycle")[0] in mixed  # the one-request figures, untouched by the B = 2 rows
    assert "SGLang's Triton extend" not in mixed  # its rows at B = 2 are no lever of one request


def test_the_levers_leave_out_mla_verify_cases_of_spread_contexts():
    from verifybench.harness.answers.levers import attention_per_forward_ms

    def case(context, spread, per_forward_us):
        return {"check": {"ok": True}, "derived": {"per_forward_us": per_forward_us},
                "params": {"context": context, "batch": 2, "variant": "split_kv", "tokens": 3, "tree": "chain",
                           **({"context_spread": spread} if spread is not None else {})}}

    runs = {"mla_verify": {"cases": [case(1024, 0.0, 100.0), case(4096, None, 400.0), case(1024, 0.5, 900.0)]}}
    assert attention_per_forward_ms(runs, "split_kv", 3, 1024, batch=2) == (0.1, "measured")
    runs["mla_verify"]["cases"] = [case(1024, 0.5, 900.0)]
    with pytest.raises(ValueError, match="for contexts \\[\\]"):
        attention_per_forward_ms(runs, "split_kv", 3, 1024, batch=2)


@pytest.mark.parametrize("context", [None, 1024])
def test_advise_costs_the_levers_with_the_decode_step_of_their_own_context(capsys, context):
    """The committed H100 A/B ran at 1k and 8k, where the engine's decode step differs 2x (its Triton decode at 8 KV
    splits): the draft shape's tau* is its cycle over the decode at the levers' context, never a median of both."""
    folder = ROOT / "nvidia-h100-80gb-hbm3-x1/engine-ab-marlin-20261207"
    argv = ["advise", str(folder), "--accept-len", "3:2.4,6:3.1"] + (["--context", str(context)] if context else [])
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    want = context or 8192  # the middle of the contexts held, as the heading says
    assert f"(at context {want} of the cycle's 1024, 8192: --context picks)" in out
    run = store.load_run(folder / "cycle.json.gz")
    (case,) = [c for c in run["cases"] if c["check"]["ok"] and c["params"]["deployment"] == "deployed"
               and c["params"]["context"] == want and c["params"]["draft_tokens"] == 6]
    line = next(x for x in out.splitlines() if "draft shape: (2, 1, 3) -> (5, 1, 6)" in x)
    tau_star = case["summary"]["median_us"] / 1e3 / case["derived"]["decode_ms"]
    assert f"break-even tau* {tau_star:.3g};" in line
