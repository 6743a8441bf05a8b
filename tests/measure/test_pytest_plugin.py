"""The pytest-benchmark adapter end to end: pytest -> saved JSON holding device samples -> compare.

Runs pytest-benchmark in a subprocess, once with the installed release and once with every other supported
release that .ci/install placed under .ci/pytest-benchmark-<version>/ (PYTHONPATH first, so it wins).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import early_jobs
from verifybench.harness.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
ALT_RELEASES = sorted((REPO / ".ci").glob("pytest-benchmark-*"))


RELEASES = ["installed", *[p.name for p in ALT_RELEASES]]
HAS_PYGAL = importlib.util.find_spec("pygal") is not None


def _pytest(tmp_path, *args, pythonpath=None) -> subprocess.CompletedProcess:
    # not an xdist worker's variables: pytest-benchmark refuses to time inside one (the parent may run under -n)
    env = {k: v for k, v in early_jobs.ENVIRON.items() if not k.startswith("PYTEST_XDIST")}
    env["VERIFYBENCH_MAX_TIME_S"] = "0.3"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", "--benchmark-only", "-q", "-p", "no:cacheprovider",
           "microbench/bench_baseline.py", "-k", "sync and add",
           f"--benchmark-storage=file://{tmp_path / 'storage'}", *args]
    return early_jobs.run(cmd, 600, cwd=REPO, env=env)


def _ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _child_runs() -> dict:
    """Per release: the run that saves, then one run against its save that compares and (with pygal) draws the
    histogram."""
    runs = {}
    for release in RELEASES:
        tmp = early_jobs.scratch("pb")
        alt = REPO / ".ci" / release if release != "installed" else None
        saved = _pytest(tmp, f"--benchmark-json={tmp / 'out.json'}", "--benchmark-save=first", pythonpath=alt)
        histogram = [f"--benchmark-histogram={tmp / 'hist'}"] if HAS_PYGAL else []
        compare = (_pytest(tmp, "--benchmark-compare=0001", *histogram, pythonpath=alt) if saved.returncode == 0
                   else saved)
        runs[release] = tmp, alt, saved, compare
    return runs


EARLY_JOBS = {"child_runs": _child_runs}  # started at collection (tests/early_jobs.py)


@pytest.fixture(scope="module")
def child_runs() -> dict:
    return early_jobs.job_result(f"{__name__}::child_runs", _child_runs)


@pytest.fixture(scope="module", params=RELEASES)
def saved(request, child_runs):
    tmp, alt, r, _ = child_runs[request.param]
    _ok(r)
    return tmp, json.loads((tmp / "out.json").read_text()), alt, r


def test_saved_stats_are_the_engines_device_samples(saved):
    _, data, _, _ = saved
    assert len(data["benchmarks"]) == 3
    for b in data["benchmarks"]:
        extra, st = b["extra_info"], b["stats"]
        assert extra["mode"] in (("cpu-hot", "cpu-loop") if extra["device"] == "cpu" else ("hot", "graph", "host_sync"))
        assert st["rounds"] == extra["summary"]["n"] and st["iterations"] == 1
        assert st["median"] * 1e6 == pytest.approx(extra["summary"]["median_us"], rel=1e-9)
        assert min(st["data"]) * 1e6 == pytest.approx(extra["summary"]["min_us"], rel=1e-9)


def test_fingerprint_is_in_machine_info(saved):
    _, data, _, _ = saved
    fp = data["machine_info"]["verifybench"]
    assert fp["gpu_model"] and "env" in fp and "versions" in fp


@pytest.mark.parametrize("release", RELEASES)
def test_save_and_compare_work_on_device_samples(child_runs, release):
    _, _, _, compare = child_runs[release]
    r = _ok(compare)
    assert "0001_first" in r.stdout + r.stderr


@pytest.mark.skipif(not HAS_PYGAL, reason="pytest-benchmark's histogram needs pygal (.ci/run installs it when it can)")
@pytest.mark.parametrize("release", RELEASES)
def test_histogram_works_on_device_samples(child_runs, release):
    tmp, _, _, compare = child_runs[release]
    r = _ok(compare)
    assert "0001_first" in r.stdout + r.stderr
    assert list(tmp.glob("hist*.svg"))


def test_saved_file_compares_same_against_itself(saved, capsys):
    tmp, _, _, _ = saved
    path = next((tmp / "storage").rglob("0001_first.json"))
    assert cli_main(["compare", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert ("no verdict" in out) if "cpu-" in out else ("SAME" in out)  # CPU numbers: no verdict (stance.py)


def test_saved_file_without_raw_data_compares_by_intervals(saved, capsys, tmp_path):
    _, data, _, _ = saved
    for b in data["benchmarks"]:
        del b["stats"]["data"]
    path = tmp_path / "nodata.json"
    path.write_text(json.dumps(data))
    assert cli_main(["compare", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert ("q1..q3" in out) if "cpu-" in out else ("intervals overlap" in out)  # CPU: the intervals, no verdict


def test_release_under_test_is_reported(saved):
    """The saved JSON names the pytest-benchmark release that wrote it: the installed one, or the alternative
    release put first on PYTHONPATH."""
    _, data, alt, _ = saved
    from importlib.metadata import version

    want = alt.name.removeprefix("pytest-benchmark-") if alt is not None else version("pytest-benchmark")
    assert data["version"] == want


@pytest.mark.skipif(not ALT_RELEASES, reason="no second pytest-benchmark release under .ci/ (.ci/install places "
                    "one for CI): the adapter is checked against the installed release only")
def test_a_second_release_is_under_test():
    assert all(p.is_dir() and p.name.startswith("pytest-benchmark-") for p in ALT_RELEASES)


def test_pytest_and_cli_results_of_a_case_line_up_in_compare(saved, tmp_path, capsys):
    _, data, _, _ = saved
    names = {b["extra_info"]["case"] for b in data["benchmarks"]}
    from verifybench.harness.components import baseline
    from verifybench.harness.measure.host import fingerprint
    from verifybench.harness.measure.results import store

    specs = [s for s in baseline.cases("tiny", 1, 64) if s.name in names]
    # this machine's fingerprint, as the pytest run's: a GPU run is never compared with a CPU smoke run
    run = store.make_run("baseline", [s.run(max_time_s=0.3) for s in specs], fingerprint.collect())
    suite = store.save_run(run, tmp_path)
    pb = tmp_path / "pb.json"
    pb.write_text(json.dumps(data))
    cli_main(["compare", str(suite), str(pb), "--allow-different-hardware"])
    out = capsys.readouterr().out
    assert all(name in out for name in names) and "only in" not in out


def test_the_benchmark_session_checks_settings_and_times_with_one_cpu_thread(monkeypatch):
    import torch

    from verifybench.harness.measure.timing import pytest_plugin

    threads = torch.get_num_threads()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        pytest_plugin.pytest_sessionstart(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    for name, value in (("VERIFYBENCH_MAX_TIME_S", "nan"), ("VERIFYBENCH_HOST_GATE", "maybe"),
                        ("VERIFYBENCH_MEMORY_CAP_GIB", "-1")):
        monkeypatch.setenv(name, value)
        with pytest.raises(pytest.UsageError, match=name):
            pytest_plugin.pytest_sessionstart(None)
        monkeypatch.delenv(name)


def test_cpu_benchmark_table_prints_no_ratio_to_the_best_case(monkeypatch):
    import torch
    from pytest_benchmark import table

    from verifybench.harness.measure.timing import pytest_plugin

    monkeypatch.setattr(table, "compute_baseline_scale", table.compute_baseline_scale)  # restored afterwards
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pytest_plugin.pytest_configure(type("Config", (), {"getoption": lambda self, name, default=None: None})())
    assert table.compute_baseline_scale(1.0, 2000.0, 10) == " " * 10  # was " (>1000.0)"


def test_cpu_child_run_table_shows_no_ratio_and_no_verdict(saved):
    import re

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU run's table keeps pytest-benchmark's ratios")
    _, data, _, r = saved
    assert not re.search(r"\((>1000\.0|\d+\.\d\d|inf)\)", r.stdout), r.stdout[-2000:]
    assert all(b["extra_info"]["mode"].startswith("cpu-") for b in data["benchmarks"])
