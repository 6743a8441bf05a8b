import json
from types import SimpleNamespace

import numpy as np
import pytest

from verifybench.harness.measure.results import compare, store
from verifybench.harness.cli import main as cli_main
from verifybench.harness.measure.timing.runner import Case
from verifybench.harness.measure.timing.timer import Measurement

FP = {"gpu_model": "NVIDIA H200", "slug": "nvidia-h200-x1", "env": {"NCCL_PROTO": "Simple"},
      "gpus": [{"name": "NVIDIA H200", "uuid": "GPU-1"}]}


def _write(path, cases: dict, fp=FP, ok=True, mode="graph", probe_us=(), device="cuda"):
    recs = [Case(name, {}, ok, "", Measurement(mode, device, "cuda_event", list(s), 1, 3, "ci_target", 1.0,
                                               host_probe_us=list(probe_us)))
            if ok else Case(name, {}, False, "bad") for name, s in cases.items()]
    store.write_json_atomic(path, store.make_run("demo", recs, fp))
    return path


def _samples(seed, median=100.0, n=200, noise=0.005):
    return np.random.default_rng(seed).normal(median, median * noise, n)


def _cli(*args):
    return cli_main(["compare", *map(str, args)])


def test_identical_distributions_are_same_and_exit_0(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1), "y": _samples(2, 50)})
    new = _write(tmp_path / "b.json", {"x": _samples(3), "y": _samples(4, 50)})
    assert _cli(base, new) == 0
    out = capsys.readouterr().out
    assert out.count("SAME") >= 2 and "SLOW" not in out.split("summary")[0]


def test_one_case_5pct_slower_is_slow_and_exit_1(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1), "y": _samples(2)})
    new = _write(tmp_path / "b.json", {"x": _samples(3, 105), "y": _samples(4)})
    assert _cli(base, new) == 1
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines() if line[:2] in ("x ", "y ")}
    assert rows == {"x": "SLOW", "y": "SAME"}


def test_5pct_faster_is_fast_and_exit_0(tmp_path):
    base = _write(tmp_path / "a.json", {"x": _samples(1)})
    new = _write(tmp_path / "b.json", {"x": _samples(3, 95)})
    assert _cli(base, new) == 0
    b, n = compare.load(base), compare.load(new)
    assert compare.verdict(b.cases["x"], n.cases["x"])[0] == "FAST"


def test_large_change_in_tiny_noisy_sample_is_ambiguous():
    b = compare.CaseData("x", "hot", True, 100.0, _samples(1, 100, n=6, noise=0.3), (70, 130))
    n = compare.CaseData("x", "hot", True, 106.0, _samples(2, 106, n=6, noise=0.3), (75, 140))
    assert compare.verdict(b, n)[0] == "AMBG"


def test_min_effect_flag_changes_the_verdict(tmp_path):
    base = _write(tmp_path / "a.json", {"x": _samples(1)})
    new = _write(tmp_path / "b.json", {"x": _samples(3, 105)})
    assert _cli(base, new, "--min-effect", "0.10") == 0


def test_summaries_only_use_interval_overlap(tmp_path):
    def pb(path, median):
        data = {"machine_info": {"verifybench": FP}, "benchmarks": [
            {"name": "t", "fullname": "bench.py::t", "extra_info": {"mode": "graph"},
             "stats": {"median": median, "q1": median * 0.99, "q3": median * 1.01}}]}
        path.write_text(json.dumps(data))
        return path

    base = pb(tmp_path / "a.json", 10e-6)
    assert _cli(base, pb(tmp_path / "b.json", 10.1e-6)) == 0
    assert _cli(base, pb(tmp_path / "c.json", 11e-6)) == 1


def test_different_gpu_models_refused_unless_allowed(tmp_path, capsys):
    other = dict(FP, gpu_model="NVIDIA H100", gpus=[{"name": "NVIDIA H100", "uuid": "GPU-2"}])
    base = _write(tmp_path / "a.json", {"x": _samples(1)})
    new = _write(tmp_path / "b.json", {"x": _samples(2)}, fp=other)
    assert _cli(base, new) == 2
    assert "different GPU models" in capsys.readouterr().err
    assert _cli(base, new, "--allow-different-hardware") == 0


def test_changed_or_missing_nccl_variables_are_named(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1)}, fp=dict(FP, env={"NCCL_PROTO": "Simple", "CUDA_X": "1"}))
    new = _write(tmp_path / "b.json", {"x": _samples(2)}, fp=dict(FP, env={"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}))
    assert _cli(base, new) == 0
    out = capsys.readouterr().out
    assert "NCCL_PROTO changed: Simple -> LL" in out
    assert "CUDA_X is missing in NEW" in out
    assert "NCCL_ALGO=Ring is set in NEW" in out


def test_bad_input_exits_2(tmp_path, capsys):
    good = _write(tmp_path / "a.json", {"x": _samples(1)})
    corrupt = tmp_path / "c.json"
    corrupt.write_text('{"schema": "verifybench.result", "cases": [')
    foreign = tmp_path / "f.json"
    foreign.write_text('{"hello": 1}')
    assert _cli(good, corrupt) == 2
    assert _cli(good, foreign) == 2
    assert _cli(good, tmp_path / "missing.json") == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_check_failure_in_new_fails_the_comparison(tmp_path):
    base = _write(tmp_path / "a.json", {"x": _samples(1)})
    new = _write(tmp_path / "b.json", {"x": _samples(1)}, ok=False)
    assert _cli(base, new) == 1


def test_fingerprint_diff_ignores_clock_readings_only():
    a = {"gpus": [{"name": "H200", "now": {"sm_clock_mhz": 1980}}], "driver": "580.1", "created_utc": "t0"}
    b = {"gpus": [{"name": "H200", "now": {"sm_clock_mhz": 1755}}], "driver": "580.2", "created_utc": "t1"}
    assert compare.fingerprint_diff(a, b) == [("driver", "580.1", "580.2")]


@pytest.mark.parametrize("effect, alpha", [(-0.1, 0.01), (0.03, 0)])
def test_bad_thresholds_exit_2(tmp_path, effect, alpha):
    base = _write(tmp_path / "a.json", {"x": _samples(1)})
    args = SimpleNamespace(base=base, new=base, min_effect=effect, alpha=alpha, allow_different_hardware=False)
    assert compare.run(args) == 2


def test_a_slow_host_timed_case_is_still_slow_but_named_as_host_bound(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1)}, mode="host_call")
    new = _write(tmp_path / "b.json", {"x": _samples(3, 150)}, mode="host_call")
    assert _cli(base, new) == 1  # the verdict stands: the host really was slower
    assert "NOTE: 1 of the SLOW/FAST cases are host-timed" in capsys.readouterr().out
    assert _cli(_write(tmp_path / "c.json", {"x": _samples(1)}), _write(tmp_path / "d.json", {"x": _samples(3, 150)})) == 1
    assert "host-timed" not in capsys.readouterr().out  # graph mode: no such note


def test_host_probe_change_is_shown_and_named_when_the_case_moved_with_it(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1)}, mode="hot", probe_us=(50, 50))
    new = _write(tmp_path / "b.json", {"x": _samples(3, 150)}, mode="hot", probe_us=(70, 80))
    assert _cli(base, new) == 1  # still SLOW: the probe explains, it does not excuse
    out = capsys.readouterr().out
    assert "host_%" in out and "the host-speed probe moved the same way" in out
    row = next(line for line in out.splitlines() if line.startswith("x "))
    assert " 50 " in f" {row} "  # (70+80)/2 / 50 - 1 = +50%
    # probe steady: no such note; files without probes: no host_% column at all
    assert _cli(base, _write(tmp_path / "c.json", {"x": _samples(3, 150)}, mode="hot", probe_us=(50, 51))) == 1
    assert "probe moved" not in capsys.readouterr().out
    _cli(_write(tmp_path / "d.json", {"x": _samples(1)}), _write(tmp_path / "e.json", {"x": _samples(2)}))
    assert "host_%" not in capsys.readouterr().out


def test_summary_splits_device_timed_from_host_timed_cases(tmp_path, capsys):
    """A CPU-timed case counts as host-timed whatever its mode (gloo in 'graph' mode is a host loop)."""
    base = {"dev": _samples(1), "cpu": _samples(2)}
    new = {"dev": _samples(3), "cpu": _samples(4, 150)}
    for name in base:
        _write(tmp_path / f"a_{name}.json", {name: base[name]}, device="cuda" if name == "dev" else "cpu")
        _write(tmp_path / f"b_{name}.json", {name: new[name]}, device="cuda" if name == "dev" else "cpu")
    assert _cli(tmp_path / "a_dev.json", tmp_path / "b_dev.json") == 0
    assert "device-timed: 1 of 1 SAME" in capsys.readouterr().out
    assert _cli(tmp_path / "a_cpu.json", tmp_path / "b_cpu.json") == 0  # CPU-timed: no verdict (stance.py)
    assert "SLOW" not in capsys.readouterr().out


def test_a_case_sampled_in_another_process_state_is_named(tmp_path, capsys):
    def write(path, samples, state):
        m = Measurement("graph", "cuda", "cuda_event", list(samples), 1, 3, "ci_target", 1.0, process_state=state)
        return store.write_json_atomic(path, store.make_run("demo", [Case("x", {}, True, "", m)], FP))

    plain = {"cupy_imported": False, "process_group": None}
    base = write(tmp_path / "a.json", _samples(1), plain)
    assert _cli(base, write(tmp_path / "b.json", _samples(3, 110), {**plain, "cupy_imported": True})) == 1
    assert "ran in a different process state" in capsys.readouterr().out
    assert _cli(base, write(tmp_path / "c.json", _samples(3, 110), plain)) == 1
    assert "process state" not in capsys.readouterr().out


def _edit(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def test_samples_edited_under_a_stale_summary_are_refused_not_same(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1)})
    new = _write(tmp_path / "b.json", {"x": _samples(1)})
    _edit(new, lambda d: d["cases"][0].update(samples_us=[v * 1.05 for v in d["cases"][0]["samples_us"]]))
    assert _cli(base, new) == 2
    err = capsys.readouterr().err
    assert "b.json: case 'x': the stored median" in err and "disagrees with its 200 samples" in err


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(samples_us=[None] * 5), "every sample is null"),
    (lambda c: c["samples_us"].__setitem__(3, None), "1 of 200 samples are null"),
    (lambda c: c["samples_us"].__setitem__(3, "fast"), "1 of 200 samples are null, non-finite or not numbers"),
    (lambda c: c["summary"].update(median_us=None), "the stored median is null or missing"),
    (lambda c: c["summary"].pop("median_us"), "the stored median is null or missing"),
    (lambda c: c["summary"].update(median_us=0), "the stored median must be > 0"),
    (lambda c: c["summary"].update(median_us="12"), "the stored median is not a finite number"),
    (lambda c: c.update(samples_us=[-1.0] * 200), "200 samples are negative"),
])
def test_inconsistent_or_empty_figures_exit_2_naming_file_and_case(tmp_path, capsys, edit, message):
    base = _write(tmp_path / "a.json", {"x": _samples(1)})
    new = _edit(_write(tmp_path / "b.json", {"x": _samples(2)}), lambda d: edit(d["cases"][0]))
    assert _cli(base, new) == 2
    err = capsys.readouterr().err
    assert message in err and "b.json: case 'x'" in err and "Traceback" not in err


def test_a_duplicated_case_name_is_refused(tmp_path, capsys):
    path = _edit(_write(tmp_path / "a.json", {"x": _samples(1)}), lambda d: d["cases"].append(d["cases"][0]))
    assert _cli(path, path) == 2
    assert "case 'x' appears twice" in capsys.readouterr().err


def test_skipped_cases_get_no_verdict_and_are_listed(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1), "y": _samples(2)})
    run = store.make_run("demo", [Case("x", {}, True, "", Measurement("graph", "cuda", "cuda_event",
                                                                      list(_samples(3)), 1, 3, "ci_target", 1.0)),
                                    Case("y", {}, False, "skipped: no P2P", skipped="no P2P")], FP)
    new = store.write_json_atomic(tmp_path / "b.json", run)
    assert _cli(base, new) == 0  # a case that could not run is not a failure
    out = capsys.readouterr().out
    assert "skipped in NEW (no P2P): y" in out and "FAIL" not in out
    only_skipped = store.write_json_atomic(tmp_path / "c.json", store.make_run(
        "demo", [Case("x", {}, False, "skipped: memory", skipped="memory")], FP))
    assert _cli(base, only_skipped) == 2
    assert "no case ran in both" in capsys.readouterr().err


def test_different_method_versions_warn_and_old_files_say_unknown(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1)})
    new = _write(tmp_path / "b.json", {"x": _samples(2)})
    assert _cli(base, new) == 0
    assert "method version" not in capsys.readouterr().out
    _edit(base, lambda d: d.pop("method_version"))
    assert _cli(base, new) == 0
    out = capsys.readouterr().out
    assert (f"WARNING: BASE was measured by method version unknown (a file from before the field), NEW by "
            f"{store.METHOD_VERSION}") in out


def test_pytest_benchmark_figures_are_checked_against_their_data(tmp_path, capsys):
    def pb(path, data, **stats):
        real = [v for v in data if v is not None] or [1e-5]
        st = {"median": float(np.median(real)), "min": min(real), "max": max(real), "rounds": len(data),
              "q1": float(np.percentile(real, 25)), "q3": float(np.percentile(real, 75)), "data": data, **stats}
        path.write_text(json.dumps({"machine_info": {"verifybench": FP}, "benchmarks": [
            {"name": "t", "fullname": "b.py::t", "extra_info": {"mode": "graph"}, "stats": st}]}))
        return path

    data = [float(v) * 1e-6 for v in _samples(1)]
    good = pb(tmp_path / "a.json", data)
    assert _cli(good, good) == 0
    assert _cli(good, pb(tmp_path / "b.json", [v * 1.05 for v in data], median=float(np.median(data)))) == 2
    assert "disagrees with its 200 samples" in capsys.readouterr().err
    assert _cli(good, pb(tmp_path / "c.json", data, median=0.0)) == 2
    assert "must be > 0" in capsys.readouterr().err
    assert _cli(good, pb(tmp_path / "d.json", [None] * 3)) == 2
    assert "every sample is null" in capsys.readouterr().err


def test_the_host_timed_note_cites_a_measuring_section_that_exists(tmp_path, capsys):
    from pathlib import Path

    base = _write(tmp_path / "a.json", {"x": _samples(1)}, mode="host_call")
    assert _cli(base, _write(tmp_path / "b.json", {"x": _samples(3, 150)}, mode="host_call")) == 1
    out = capsys.readouterr().out
    cited = "Host-timed figures do not repeat across processes"
    assert f"(docs/measuring.md, '{cited}')" in out and "README, 'Measured" not in out
    assert cited in (Path(__file__).resolve().parents[2] / "docs" / "measuring.md").read_text()


def test_identical_samples_are_same_even_at_min_effect_zero():
    same = compare.CaseData("x", "graph", True, 100.0, _samples(1), (99, 101))
    assert compare.verdict(same, same, min_effect=0.0)[0] == "SAME"
    other = compare.CaseData("x", "graph", True, 100.5, _samples(2, 100.5), (99.5, 101.5))
    assert compare.verdict(same, other, min_effect=0.0)[0] in ("SLOW", "AMBG")  # a real change still counts


def test_a_cpu_smoke_run_against_a_gpu_run_is_refused_at_once(tmp_path, capsys):
    gpu = _write(tmp_path / "a.json", {"x": _samples(1)})
    cpu = _write(tmp_path / "b.json", {"x": _samples(2)}, fp={"gpu_model": "cpu", "slug": "cpu", "env": {}},
                 device="cpu")
    assert _cli(gpu, cpu, "--allow-different-hardware") == 2
    err = capsys.readouterr().err
    assert "is a CPU smoke run" in err and "measure different cases and cannot be compared" in err


@pytest.mark.parametrize("missing_side", ["BASE", "NEW"])
def test_a_missing_file_is_blamed_on_its_own_side_beside_a_folder(missing_side, tmp_path, capsys):
    from pathlib import Path

    from verifybench.harness.cli import main

    folder = str(Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1")
    gone = str(tmp_path / "nothere.json")
    argv = ["compare", gone, folder] if missing_side == "BASE" else ["compare", folder, gone]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {missing_side} {gone}: no such file or folder\n"


CPU_FP = {"gpu_model": "cpu", "slug": "cpu", "env": {}}


def test_compare_of_cpu_runs_gives_no_verdict_and_exits_0(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1), "y": _samples(2, 50)}, fp=CPU_FP, device="cpu")
    new = _write(tmp_path / "b.json", {"x": _samples(3, 150), "y": _samples(4, 25)}, fp=CPU_FP, device="cpu")
    assert _cli(base, new) == 0
    out = capsys.readouterr().out
    table = out.split("CPU numbers", 1)[1]
    assert not any(v in table for v in ("SAME", "FAST", "SLOW", "AMBG", "regression", "change_%"))
    assert "median_us" in out and "q1..q3" in out and "no verdict" in out


def test_compare_of_cpu_runs_still_fails_a_check_that_failed_in_new(tmp_path, capsys):
    base = _write(tmp_path / "a.json", {"x": _samples(1)}, fp=CPU_FP, device="cpu")
    new = _write(tmp_path / "b.json", {"x": _samples(2)}, fp=CPU_FP, device="cpu", ok=False)
    assert _cli(base, new) == 1
    assert "check failed in NEW: x" in capsys.readouterr().out


def test_compare_shows_a_cpu_records_mode_as_its_tables_do_old_files_too(tmp_path, capsys):
    """A CPU record stores cpu-loop; a file from before stored `graph`: both read cpu-loop and line up."""
    new = _write(tmp_path / "b.json", {"x": _samples(2)}, fp=CPU_FP, device="cpu")
    assert json.loads(new.read_text())["cases"][0]["mode"] == "cpu-loop"
    old = json.loads(new.read_text())
    old["cases"][0]["mode"] = "graph"
    (tmp_path / "a.json").write_text(json.dumps(old))
    assert _cli(tmp_path / "a.json", new) == 0
    out = capsys.readouterr().out
    assert "cpu-loop" in out and "graph" not in out.split("NEW")[-1]


def test_compare_lines_up_an_old_cpu_file_whose_case_names_say_graph(tmp_path, capsys):
    """Older CPU files named cases .../graph; this version names them .../cpu-loop (its pytest-benchmark IDs too)."""
    new = _write(tmp_path / "b.json", {"copy/1B/cpu-loop": _samples(2)}, fp=CPU_FP, device="cpu")
    old = json.loads(new.read_text())
    old["cases"][0].update(name="copy/1B/graph", mode="graph")
    (tmp_path / "a.json").write_text(json.dumps(old))
    assert _cli(tmp_path / "a.json", new) == 0
    out = capsys.readouterr().out
    assert "only in" not in out and "copy/1B/cpu-loop" in out and "1 timed in both" in out
