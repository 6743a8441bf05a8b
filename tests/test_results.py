import json

import pytest

from verifybench.harness.engine import results
from verifybench.harness.engine.results import Case, ResultsError
from verifybench.harness.engine.timing import Measurement


def _measurement(samples):
    return Measurement(mode="graph", device="cpu", timer="perf_counter", samples_us=list(samples), calls_per_sample=4,
                       warmup_calls=3, stop_reason="ci_target", wall_s=0.1)


def _run(samples=(10.0, 11.0, 12.0)):
    cases = [Case("a", {"n": 1}, True, "rel_err=0", _measurement(samples), {"bytes_moved": 1000, "eta": 0.5}),
             Case("b", {"n": 2}, False, "rel_err=0.3 > 1e-2")]
    return results.make_run("demo", cases, {"gpu_model": "cpu", "slug": "cpu", "env": {}})


def test_round_trip_keeps_samples_summary_and_check(tmp_path):
    path = results.save_run(_run(), tmp_path)
    loaded = results.load_run(path)
    a, b = loaded["cases"]
    assert loaded["schema_version"] == results.SCHEMA_VERSION
    assert a["samples_us"] == [10.0, 11.0, 12.0] and a["summary"]["median_us"] == 11.0
    assert a["derived"] == {"bytes_moved": 1000, "eta": 0.5} and a["mode"] == "graph"
    assert b["check"] == {"ok": False, "detail": "rel_err=0.3 > 1e-2"} and "samples_us" not in b


def test_failed_check_carries_no_time(tmp_path):
    path = results.save_run(_run(), tmp_path)
    failed = results.load_run(path)["cases"][1]
    assert "summary" not in failed and "median_us" not in json.dumps(failed)


def test_atomic_write_leaves_no_temp_files_and_replaces_whole_file(tmp_path):
    path = results.save_run(_run(), tmp_path, name="r.json")
    results.save_run(_run((20.0, 21.0, 22.0)), tmp_path, name="r.json")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert results.load_run(path)["cases"][0]["summary"]["median_us"] == 21.0


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = results.save_run(_run(), tmp_path, name="r.json")
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError):
        results.save_run(_run((1.0, 2.0, 3.0)), tmp_path, name="r.json")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_corrupt_file_fails_clearly_and_is_left_unchanged(tmp_path):
    path = results.save_run(_run(), tmp_path, name="r.json")
    truncated = path.read_bytes()[:200]
    path.write_bytes(truncated)
    with pytest.raises(ResultsError, match="not valid JSON"):
        results.load_run(path)
    assert path.read_bytes() == truncated


@pytest.mark.parametrize("content, message", [
    ({"benchmarks": []}, "not a verifybench result"),
    ({"schema": "verifybench.result", "schema_version": 99}, "schema version 99"),
    ([1, 2], "JSON object"),
])
def test_foreign_or_future_files_are_refused(tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ResultsError, match=message):
        results.load_run(path)


def test_passing_case_without_samples_is_refused(tmp_path):
    run = _run()
    del run["cases"][0]["samples_us"]
    path = tmp_path / "x.json"
    path.write_text(json.dumps(run))
    with pytest.raises(ResultsError, match="no samples"):
        results.load_run(path)


def test_missing_file_is_a_results_error(tmp_path):
    with pytest.raises(ResultsError, match="no such file"):
        results.load_run(tmp_path / "nope.json")


def test_non_finite_numbers_are_stored_as_null(tmp_path):
    run = _run()
    run["cases"][0]["derived"]["eta"] = float("inf")
    path = results.save_run(run, tmp_path)
    assert results.load_run(path)["cases"][0]["derived"]["eta"] is None


def test_default_folder_is_outside_the_checkout_under_the_machine_slug(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = results.save_run(_run())
    assert path.resolve().parent == tmp_path / results.DEFAULT_OUT / "cpu" and path.name.startswith("demo-")
    assert results.load_run(path)["method_version"] == results.METHOD_VERSION


def test_gzipped_results_load_and_a_broken_gzip_fails_clearly(tmp_path):
    import gzip

    path = results.save_run(_run(), tmp_path, name="r.json")
    gz = tmp_path / "r.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert results.load_run(gz) == results.load_run(path)
    gz.write_bytes(gzip.compress(path.read_bytes())[:100])
    with pytest.raises(ResultsError, match="cannot read"):
        results.load_run(gz)
    (tmp_path / "x.json.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ResultsError, match="cannot read"):
        results.load_run(tmp_path / "x.json.gz")


def test_results_are_group_readable_whatever_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0o077)
    try:
        path = results.save_run(_run(), tmp_path, name="r.json")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode & 0o640 == 0o640 and not mode & 0o007


def test_a_temp_file_left_by_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".r.json.{dead.stdout.strip()}.abc123.tmp"  # what write_atomic names its temp files
    stale.write_bytes(b"half a file")
    foreign = tmp_path / ".r.json.notapid.tmp"
    foreign.write_bytes(b"not ours")
    results.save_run(_run(), tmp_path, name="r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.json.notapid.tmp", "r.json"]


def test_check_writable_refuses_impossible_and_unwritable_folders(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ResultsError, match="output folder .*file/sub is not writable"):
        results.check_writable(a_file / "sub")

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)  # a read-only folder, also when tests run as root
    with pytest.raises(ResultsError, match="is not writable: Permission denied"):
        results.check_writable(tmp_path / "ro")


def test_cpu_records_withhold_derived_cells():
    rows = [{"n": 1, "eta": 0.5, "fit": None}]
    assert results.withhold(rows, ("eta", "fit")) == [{"n": 1, "eta": results.WITHHELD, "fit": None}]
    assert results.cpu_numbers([{"device": "cpu"}]) and not results.cpu_numbers([{"device": "cuda"}, {}])
