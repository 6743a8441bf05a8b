"""The inputs the probe set (scripts/probe_*.py, docs/probes.md) found answered with a traceback, silently or
unclearly, or refused though valid: one test each, named for what must hold. Argument types have one home
(analysis/numbers.py) and exit codes another (measure/exits.py): the first tests keep it so."""
import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verifybench.harness.answers import advise, trace_against
from verifybench.harness.cli import main
from verifybench.harness.components import kv_tree
from verifybench.harness.measure.results import store
from verifybench.harness.measure.timing.runner import CaseSkipped
from verifybench.kernels.tree import api as tree

REPO = Path(__file__).resolve().parents[2]
H200 = REPO / "results" / "baselines" / "nvidia-h200-x1"
H100 = REPO / "results" / "baselines" / "nvidia-h100-80gb-hbm3-x1"
CYCLE = store.read_json(H200 / "cycle.json")


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def refused(capsys, *argv, needle: str) -> str:
    """Exit 2 with one line on stderr naming `needle`."""
    rc, _, err = cli(capsys, *argv)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], (rc, err)
    return lines[0]


def _sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for d in ("harness", "kernels") for p in (REPO / d).rglob("*.py")}


# ---- one home per rule ----

@pytest.mark.parametrize("name", ["EXIT_OK", "EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "TOKEN_COUNT_MAX",
                                  "FORWARD_MAX_TOKENS", "MAX_CONTEXT", "BATCH_MAX"])
def test_each_shared_limit_and_exit_code_is_defined_once(name):
    homes = [p for p, text in _sources().items() if re.search(rf"^{name}\s*=", text, re.M)]
    assert len(homes) == 1, homes


def test_one_parser_per_list_kind_and_no_other_reads_a_count_list():
    defs = {p: re.findall(r"^def (parse_int_list|token_counts|batch_counts|context_list|parse_contexts|"
                          r"parse_configs)\b", t, re.M) for p, t in _sources().items()}
    assert {p: d for p, d in defs.items() if d} == {
        "harness/analysis/numbers.py": ["token_counts", "batch_counts", "context_list", "parse_configs"],
        "harness/components/cycle.py": ["parse_contexts", "parse_configs"]}  # thin wrappers of numbers' readers
    assert not any("MAX_DRAFT_TOKENS" in t for t in _sources().values())


# ---- argument parsing ----

@pytest.mark.parametrize("text", ["1_0", "32,,64", "64,", ",", "1000000000000", "1-3"])
def test_cycle_contexts_refuses_underscores_empty_items_ranges_and_huge_values(capsys, text):
    refused(capsys, "cycle", "--contexts", text, needle="--contexts")


@pytest.mark.parametrize("option", ["--attention", "--configs"])
def test_cycle_refuses_an_empty_list_instead_of_running_the_defaults(capsys, option):
    refused(capsys, "cycle", option, "", needle=option)


def test_cycle_refuses_a_configuration_past_the_token_limit_before_sizing_anything(capsys):
    refused(capsys, "cycle", "--configs", "99999999999999999999,1,3", needle="at most 64")


def test_baseline_refuses_tokens_it_would_ignore(capsys):
    refused(capsys, "baseline", "--tokens", "5", needle="--tokens")


@pytest.mark.parametrize("argv, needle", [(["--tokens", "9"], "--tokens"), (["--tokens", "1,2"], "--tokens"),
                                          (["--tokens", "1_0"], "--tokens"), (["--context", "2000000"], "--context")])
def test_record_reads_tokens_and_context_with_the_shared_parsers(capsys, argv, needle):
    refused(capsys, "record", "t.json.gz", *argv, needle=needle)


@pytest.mark.parametrize("module, argv", [("allreduce", ["--tokens", "2,2"]), ("allreduce", ["--batches", ""]),
                                          ("allreduce", ["--tokens", "1_0"]), ("verify", ["--tokens", "1,,2"]),
                                          ("verify", ["--context", "2000000"])])
def test_torchrun_jobs_refuse_what_the_commands_refuse(capsys, module, argv):
    import importlib

    parser = importlib.import_module(f"verifybench.harness.multigpu.{module}").build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["bogus", "", "TINY"])
def test_an_unknown_preset_is_named_unknown_not_needing_a_gpu(capsys, preset):
    line = refused(capsys, "run", "--preset", preset, needle="unknown preset")
    assert "tiny" in line and "needs a GPU" not in line


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--decode-ms", "1e308", "--verify-ms", "3:25", "--accept-len", "3:2"], "--decode-ms"),
    (["plan", "--decode-ms", "20", "--verify-ms", "3:1e308", "--accept-len", "3:2"], "--verify-ms"),
    (["project", str(H200 / "verify.json"), "--allreduce-us", "1e308", "--copy-gbps", "3000"], "--allreduce-us")])
def test_absurd_times_are_refused_instead_of_printing_inf(capsys, argv, needle):
    refused(capsys, *argv, needle=needle)


def test_plan_refuses_a_huge_configuration_before_allocating(capsys):
    refused(capsys, "plan", "--decode-ms", "20", "--verify-ms", "3:25", "--accept-rates", "0.8",
            "--configs", "300000000,1,300000001", needle="at most 64")


def test_config_tables_variable_is_checked_before_a_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VERIFYBENCH_CONFIG_TABLES", "bogus")
    refused(capsys, "baseline", "--out", tmp_path, needle="VERIFYBENCH_CONFIG_TABLES")
    assert not list(tmp_path.iterdir())


# ---- advise ----

def _folder(tmp_path, cycle: dict | None = None, **files) -> Path:
    """A results folder holding the H200 cycle (or `cycle`) and any other files given as name=dict."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "cycle.json").write_text(json.dumps(CYCLE if cycle is None else cycle))
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("option", ["--accept-len", "--accept-rates"])
def test_advise_refuses_an_empty_acceptance_instead_of_ignoring_it(capsys, option):
    refused(capsys, "advise", H200, option, "", needle=option)


@pytest.mark.parametrize("given", ["6:3.1", "5,4,8:3.3"])
def test_advise_with_accept_lengths_only_for_other_shapes_says_which_is_missing(capsys, given):
    rc, out, err = cli(capsys, "advise", H200, "--accept-len", given)
    assert rc == 0 and not err
    assert "draft shape: not measured here" in out and "3:TAU" in out


def test_advise_refuses_an_accept_length_matching_no_shape(capsys):
    refused(capsys, "advise", H200, "--accept-len", "7:3", needle="7 matches no shape")


def test_advise_names_the_accept_lengths_matching_no_shape_beside_ones_that_match(capsys):
    rc, out, _ = cli(capsys, "advise", H200, "--accept-len", "3:2.4,7:3")
    assert rc == 0 and "note: --accept-len 7 matches no shape" in out and "tok/s" in out


def test_advise_refuses_results_of_two_gpu_models(capsys):
    refused(capsys, "advise", H200, H100, needle="different GPU models")


def _doctored(change) -> dict:
    run = copy.deepcopy(CYCLE)
    change(run)
    return run


@pytest.mark.parametrize("change, needle", [
    # in every case: one case lacking it is left out, in one line (tests/suite/test_bad_inputs_4.py)
    (lambda r: [c["derived"].pop("decode_ms") for c in r["cases"] if c["check"]["ok"]], "derived.decode_ms"),
    (lambda r: r.update(component="verify"), "'verify' result where a cycle result is due")])
def test_advise_refuses_a_cycle_file_lacking_what_it_reads(capsys, tmp_path, change, needle):
    refused(capsys, "advise", _folder(tmp_path, _doctored(change)), needle=needle)


def test_advise_refuses_an_empty_defaults_vs_tuned(capsys, tmp_path):
    refused(capsys, "advise", _folder(tmp_path, defaults_vs_tuned={}), needle="not a defaults_vs_tuned comparison")


def _all_failed(run):
    for c in run["cases"]:
        c["check"]["ok"] = False


def test_advise_and_the_run_report_say_every_cycle_check_failed(capsys, tmp_path):
    run = _doctored(_all_failed)
    rc, out, _ = cli(capsys, "advise", _folder(tmp_path, run))
    assert rc == 0 and "every check failed" in out
    lines = advise.report_lines({"cycle": store.validate_run(run, "cycle")}, tmp_path)
    assert any("every check failed" in x for x in lines)


def test_advise_names_the_shape_it_costs_against_without_the_engines(capsys, tmp_path):
    run = _doctored(lambda r: r.update(cases=[c for c in r["cases"] if (c["params"]["steps"], c["params"]["topk"],
                                                                          c["params"]["draft_tokens"]) == (5, 1, 6)]))
    rc, out, _ = cli(capsys, "advise", _folder(tmp_path, run))
    assert rc == 0 and "against the cycle at (5, 1, 6)" in out


SUMMARY = {"schema": "verifybench.trace", "schema_version": 1, "per_cycle_us": {"gpu_idle": 400.0}}


@pytest.mark.parametrize("name", ["trace-summary.json", "cycle.json", "mine.json"])
def test_advise_reads_a_trace_summary_under_any_name(capsys, tmp_path, name):
    (tmp_path / name).write_text(json.dumps(SUMMARY))
    rc, out, err = cli(capsys, "advise", H200 / "cycle.json", tmp_path / name)
    assert rc == 0, err
    assert "host gaps: hide the GPU idle" in out and "host gaps: not measured" not in out


def test_advise_says_a_trace_summary_lacks_the_idle_time(capsys, tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({**SUMMARY, "per_cycle_us": {}}))
    rc, out, _ = cli(capsys, "advise", H200 / "cycle.json", tmp_path / "s.json")
    assert rc == 0 and "holds no per_cycle_us.gpu_idle" in out


def test_advise_uses_a_cycle_file_under_a_users_name_or_through_a_pipe(capsys, tmp_path):
    mine = tmp_path / "my-run.json"
    mine.write_text(json.dumps(CYCLE))
    rc, out, _ = cli(capsys, "advise", mine)
    assert rc == 0 and "verify attention: extend -> split_kv" in out
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(w, json.dumps(CYCLE).encode()), os.close(w)))
    writer.start()
    try:
        rc, out, _ = cli(capsys, "advise", f"/dev/fd/{r}")
    finally:
        writer.join()
        os.close(r)
    assert rc == 0 and "verify attention: extend -> split_kv" in out


def test_advise_nccl_from_a_cycle_result_names_what_it_is(capsys):
    refused(capsys, "advise", H200, "--nccl-from", H200 / "cycle.json",
            needle="a cycle result, not an NCCL sweep result")


# ---- plan ----

def _contexts_run() -> dict:
    run = copy.deepcopy(CYCLE)
    cases = []
    for ctx in (1024, 4096):
        for c in copy.deepcopy(CYCLE["cases"]):
            c["params"]["context"], c["name"] = ctx, f"{c['name']}/ctx{ctx}"
            cases.append(c)
    run["cases"] = cases
    return run


def test_plan_picks_one_context_of_a_cycle_contexts_result(capsys, tmp_path):
    path = tmp_path / "cycle-20261205T000000Z.json"
    path.write_text(json.dumps(_contexts_run()))
    refused(capsys, "plan", path, "--accept-len", "3:2.4", needle="pick one with --context N")
    rc, out, err = cli(capsys, "plan", path, "--accept-len", "3:2.4,6:3.1", "--context", "1024")
    assert rc == 0 and "best:" in out, err
    refused(capsys, "plan", path, "--accept-len", "3:2.4", "--context", "2048", needle="holds contexts [1024, 4096]")


def test_plan_refuses_a_cycle_file_without_cases_in_one_line(capsys, tmp_path):
    path = tmp_path / "cycle-20261205T000000Z.json"
    path.write_text(json.dumps({**CYCLE, "cases": []}))
    refused(capsys, "plan", path, "--accept-len", "3:2.4", needle="no passing case")


# ---- compare, trace ----

def test_compare_refuses_a_method_version_that_is_not_an_integer(capsys, tmp_path):
    path = tmp_path / "cycle.json"
    path.write_text(json.dumps({**CYCLE, "method_version": "2"}))
    refused(capsys, "compare", H200 / "cycle.json", path, needle="method_version must be an integer")


def test_trace_against_counts_one_allreduce_kernel_per_cycle(tmp_path):
    _, note = trace_against._layers({"per_cycle_calls": {"allreduce": 1.0}}, 61, None, "t")
    assert "1 allreduce kernel per cycle" in note and "no allreduce kernels" not in note


def test_a_trace_event_lasting_1e300_us_is_refused_as_damage(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from trace_builders import MARLIN, engine_trace

    from verifybench.harness.answers import trace
    from verifybench.harness.answers.trace_read import TraceError

    b = engine_trace()
    next(e for e in b.events if e.get("name") == MARLIN)["dur"] = 1e300
    with pytest.raises(TraceError, match="absurd time.*longer than any profiled run"):
        trace.decompose([b.write(tmp_path / "t.json")])


# ---- kernels ----

def test_kernels_refuse_meta_tensors():
    m = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.int64)  # noqa: E731
    with pytest.raises(ValueError, match="meta device"):
        tree.build_tree(m(2), m(2, 1), m(2, 2), m(2, 2), m(2), 1, 3, 3, "full")


def test_verify_refuses_token_ids_beyond_int32():
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="outside int32"):
        tree.verify_tree_greedy(ids, torch.tensor([[0, 1]]), torch.tensor([[1, -1]]), torch.tensor([[-1, -1]]),
                                torch.tensor([2**40, 3]), 2)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("slot, seq", [(2**33 + 5, 0), (3, 20)])
def test_assign_refuses_a_slot_the_table_cannot_hold_or_past_it(backend, slot, seq):
    table = torch.zeros(2, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="id out of range|not written"):
        tree.assign_req_to_token(table, torch.tensor([0]), torch.tensor([seq]), torch.tensor([slot, 1, 2]), 3,
                                 backend=backend)
    assert not table.any()


def test_kv_tree_counts_kernels_it_did_not_run_as_skipped(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    specs = [s for s in kv_tree.cases("tiny", 1, 64) if s.params["backend"] == "kernel"]
    assert specs
    with pytest.raises(CaseSkipped, match="TRITON_INTERPRET='0'"):
        kv_tree._setup(specs[0].params)


# ---- the torchrun allreduce, Ctrl-C, full disks ----

def test_allreduce_progress_is_counted_per_collective():
    from verifybench.harness.multigpu import allreduce

    calls, ticks = [0], [0]
    op = SimpleNamespace(in_place=True, inp=torch.zeros(4), out=None, run=lambda: calls.__setitem__(0, calls[0] + 1))
    comm = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
    plan = {"warmup_calls": 2, "samples": 3, "isolated_samples": 5, "calls_per_sample": 2}
    allreduce._time_mode(op, comm, "isolated", plan, lambda: None, None, lambda: ticks.__setitem__(0, ticks[0] + 1))
    assert calls[0] > 0 and ticks[0] == calls[0]


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_while_torch_imports_exits_130_in_one_line():
    exe = Path(sys.executable).with_name("verifybench")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "verifybench.harness"]
    p = subprocess.Popen([*cmd, "run", "--out", "/nonexistent/never"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.4)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.strip().splitlines() == [
        "verifybench: interrupted; the files already saved are complete, nothing half-written is left"], err


def test_a_write_stopped_by_a_file_size_limit_names_the_file(tmp_path):
    import errno

    def write(f):
        raise OSError(errno.EFBIG, "File too large")

    with pytest.raises(OSError) as e:
        store.write_new(tmp_path / "run.md", write)
    assert e.value.filename == str(tmp_path / "run.md") and "ulimit -f" in e.value.strerror
    assert not list(tmp_path.iterdir())
