import json
from pathlib import Path

import pytest

from verifybench.harness.measure.results import result_files, store
from verifybench.harness.measure.results.store import ResultsError
from verifybench.harness.measure.timing.runner import Case
from verifybench.harness.measure.timing.timer import Measurement


def _measurement(samples):
    return Measurement(mode="graph", device="cpu", timer="perf_counter", samples_us=list(samples), calls_per_sample=4,
                       warmup_calls=3, stop_reason="ci_target", wall_s=0.1)


def _run(samples=(10.0, 11.0, 12.0)):
    cases = [Case("a", {"n": 1}, True, "rel_err=0", _measurement(samples), {"bytes_moved": 1000, "eta": 0.5}),
             Case("b", {"n": 2}, False, "rel_err=0.3 > 1e-2")]
    return store.make_run("demo", cases, {"gpu_model": "cpu", "slug": "cpu", "env": {}})


def test_round_trip_keeps_samples_summary_and_check(tmp_path):
    path = store.save_run(_run(), tmp_path)
    loaded = store.load_run(path)
    a, b = loaded["cases"]
    assert loaded["schema_version"] == store.SCHEMA_VERSION
    assert a["samples_us"] == [10.0, 11.0, 12.0] and a["summary"]["median_us"] == 11.0
    assert a["derived"] == {"bytes_moved": 1000, "eta": 0.5} and a["mode"] == "cpu-loop"  # a CPU record says so
    assert b["check"] == {"ok": False, "detail": "rel_err=0.3 > 1e-2"} and "samples_us" not in b


def test_failed_check_carries_no_time(tmp_path):
    path = store.save_run(_run(), tmp_path)
    failed = store.load_run(path)["cases"][1]
    assert "summary" not in failed and "median_us" not in json.dumps(failed)


def test_a_second_save_of_a_taken_name_gets_a_fresh_name_and_the_first_stays(tmp_path):
    path = store.save_run(_run(), tmp_path, name="r.json")
    second = store.save_run(_run((20.0, 21.0, 22.0)), tmp_path, name="r.json")
    assert second.name == "r-2.json" and sorted(p.name for p in tmp_path.iterdir()) == ["r-2.json", "r.json"]
    assert store.load_run(path)["cases"][0]["summary"]["median_us"] == 11.0
    assert store.load_run(second)["cases"][0]["summary"]["median_us"] == 21.0


def test_a_run_updating_its_own_file_replaces_it_whole(tmp_path):
    path = store.save_run(_run(), tmp_path, name="r.json")
    assert store.save_run(_run((20.0, 21.0, 22.0)), tmp_path, name="r.json", update=path) == path
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert store.load_run(path)["cases"][0]["summary"]["median_us"] == 21.0


def test_two_runs_saving_in_the_same_second_keep_both_results(tmp_path, monkeypatch):
    # the clock make_run stamps with, pinned: on a loaded host two real saves can fall in different seconds
    from datetime import datetime, timezone

    class Pinned(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 3, 17, 32, 47, 900_000, tzinfo=timezone.utc).astimezone(tz)

    monkeypatch.setattr(store, "datetime", Pinned)
    run = _run()
    first, second = store.save_run(run, tmp_path), store.save_run(_run((5.0, 6.0, 7.0)), tmp_path)
    assert first.name == "demo-20261203T173247Z.json" and second.name == "demo-20261203T173247Z-2.json"
    assert result_files.kind_of(second) == "demo" and result_files.latest_of_kind(tmp_path, "demo") == second
    assert [store.load_run(p)["cases"][0]["summary"]["median_us"] for p in (first, second)] == [11.0, 6.0]


def test_writers_racing_for_one_name_each_get_their_own_file(tmp_path):
    import threading

    paths, barrier = [], threading.Barrier(6)

    def write(i):
        barrier.wait()
        paths.append(store.write_new(tmp_path / "r.json", f"{i}".encode()))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 6 and sorted(p.read_text() for p in paths) == [str(i) for i in range(6)]
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_write_onto_an_input_is_refused_by_any_name(tmp_path):
    src = store.save_run(_run(), tmp_path, name="r.json")
    before = src.read_bytes()
    (tmp_path / "link.json").symlink_to(src)
    for target in (src, tmp_path / "link.json", tmp_path / "." / "r.json"):
        with pytest.raises(ResultsError, match="that is an input of this command"):
            store.write_json_new(target, {"a": 1}, inputs=[src], option="--json")
    assert src.read_bytes() == before


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = store.save_run(_run(), tmp_path, name="r.json")
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    for update in (None, path):  # a new file and an update of the run's own file alike
        with pytest.raises(OSError):
            store.save_run(_run((1.0, 2.0, 3.0)), tmp_path, name="r.json", update=update)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_an_interrupt_mid_write_leaves_no_file_and_no_temp(tmp_path):
    def interrupted(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.write_new(tmp_path / "r.json", interrupted)
    assert not list(tmp_path.iterdir())


def test_corrupt_file_fails_clearly_and_is_left_unchanged(tmp_path):
    path = store.save_run(_run(), tmp_path, name="r.json")
    truncated = path.read_bytes()[:200]
    path.write_bytes(truncated)
    with pytest.raises(ResultsError, match="not valid JSON"):
        store.load_run(path)
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
        store.load_run(path)


def test_passing_case_without_samples_is_refused(tmp_path):
    run = _run()
    del run["cases"][0]["samples_us"]
    path = tmp_path / "x.json"
    path.write_text(json.dumps(run))
    with pytest.raises(ResultsError, match="no samples"):
        store.load_run(path)


def test_missing_file_is_a_results_error(tmp_path):
    with pytest.raises(ResultsError, match="no such file"):
        store.load_run(tmp_path / "nope.json")


def test_non_finite_numbers_are_stored_as_null(tmp_path):
    run = _run()
    run["cases"][0]["derived"]["eta"] = float("inf")
    path = store.save_run(run, tmp_path)
    assert store.load_run(path)["cases"][0]["derived"]["eta"] is None


def test_default_folder_is_outside_the_checkout_under_the_machine_slug(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = store.save_run(_run())
    assert path.resolve().parent == tmp_path / store.DEFAULT_OUT / "cpu" and path.name.startswith("demo-")
    assert store.load_run(path)["method_version"] == store.METHOD_VERSION


def test_a_gzip_with_a_corrupt_stream_is_a_results_error_not_a_zlib_traceback(tmp_path):
    import gzip

    packed = bytearray(gzip.compress(store.save_run(_run(), tmp_path, name="r.json").read_bytes()))
    packed[20:40] = b"\xff" * 20  # the header stays valid: only the deflate stream is broken (zlib.error)
    (tmp_path / "z.json.gz").write_bytes(bytes(packed))
    with pytest.raises(ResultsError, match="z.json.gz: cannot read"):
        store.load_run(tmp_path / "z.json.gz")


def test_gzipped_results_load_and_a_broken_gzip_fails_clearly(tmp_path):
    import gzip

    path = store.save_run(_run(), tmp_path, name="r.json")
    gz = tmp_path / "r.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert store.load_run(gz) == store.load_run(path)
    gz.write_bytes(gzip.compress(path.read_bytes())[:100])
    with pytest.raises(ResultsError, match="cannot read"):
        store.load_run(gz)
    (tmp_path / "x.json.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ResultsError, match="cannot read"):
        store.load_run(tmp_path / "x.json.gz")


def test_results_are_group_readable_whatever_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0o077)
    try:
        path = store.save_run(_run(), tmp_path, name="r.json")
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
    store.save_run(_run(), tmp_path, name="r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.json.notapid.tmp", "r.json"]


def test_check_writable_refuses_impossible_and_unwritable_folders(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ResultsError, match="output folder .*file/sub is not writable"):
        store.check_writable(a_file / "sub")

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)  # a read-only folder, also when tests run as root
    with pytest.raises(ResultsError, match="is not writable: Permission denied"):
        store.check_writable(tmp_path / "ro")


def test_cpu_records_withhold_derived_cells():
    rows = [{"n": 1, "eta": 0.5, "fit": None}]
    assert store.withhold(rows, ("eta", "fit")) == [{"n": 1, "eta": store.WITHHELD, "fit": None}]
    assert store.cpu_numbers([{"device": "cpu"}]) and not store.cpu_numbers([{"device": "cuda"}, {}])


def _stamped(folder, name, component="demo"):
    return store.save_run(store.make_run(component, [], {"gpu_model": "cpu"}), folder, name=name)


def test_file_names_say_the_kind_before_the_utc_stamp_or_as_a_curated_stem():
    assert result_files.kind_of(Path("verify-20261202T101010Z.json")) == "verify"
    assert result_files.kind_of(Path("allreduce_ranks-20261202T101010Z-3.json.gz")) == "allreduce_ranks"
    assert result_files.kind_of(Path("results/baselines/nvidia-h200-x1/verify.json")) == "verify"
    assert result_files.kind_of(Path("run-tiny-tp1-20261202T101010Z.md")) is None


def test_latest_of_kind_orders_by_stamp_then_number_never_by_listing(tmp_path):
    for name in ("verify-20261202T111010Z.json", "verify-20261202T101010Z-2.json", "verify.json",
                 "verify-20261202T111010Z-2.json", "cycle-20261203T000000Z.json", "verify_dist-20261204T0000Z.json"):
        _stamped(tmp_path, name)
    assert result_files.latest_of_kind(tmp_path, "verify").name == "verify-20261202T111010Z-2.json"
    assert result_files.latest_of_kind(tmp_path, "cycle").name == "cycle-20261203T000000Z.json"
    assert result_files.latest_of_kind(tmp_path, "moe_int4") is None


def test_pick_input_takes_a_folders_latest_of_the_first_kind_it_holds(tmp_path):
    _stamped(tmp_path, "verify-20261202T111010Z.json")
    _stamped(tmp_path, "cycle-20261201T000000Z.json")
    path, note = result_files.pick_input(tmp_path, ("cycle", "verify"), "RESULT")
    assert path.name == "cycle-20261201T000000Z.json" and "the latest cycle result" in note
    with pytest.raises(ResultsError, match=r"no moe_int4 result in this folder \(it holds: cycle, verify\)"):
        result_files.pick_input(tmp_path, ("moe_int4",), "RESULT")


def test_pick_input_of_several_files_takes_the_latest_or_refuses_naming_why(tmp_path):
    a, b = _stamped(tmp_path, "verify-20261202T111010Z.json"), _stamped(tmp_path, "verify-20261202T101010Z.json")
    assert result_files.pick_input([a, b], ("verify",), "NEW") == (a, f"NEW: {a} (the latest of the 2 files given)")
    c = _stamped(tmp_path, "cycle-20261203T000000Z.json")
    with pytest.raises(ResultsError, match="files of different kinds"):
        result_files.pick_input([a, c], ("verify",), "NEW")
    with pytest.raises(ResultsError, match="carry no UTC time"):
        result_files.pick_input([_stamped(tmp_path, "x.json"), _stamped(tmp_path, "x.json.gz")], (), "NEW")
    with pytest.raises(ResultsError, match="2 cycle files; this needs a verify result"):
        result_files.pick_input([c, _stamped(tmp_path, "cycle-20261204T000000Z.json")], ("verify",), "NEW")


def test_a_field_a_command_reads_is_checked_when_the_file_is_read(tmp_path):
    run = _run()
    run["cases"][0]["derived"]["decode_ms"] = "fast"
    path = tmp_path / "x.json"
    path.write_text(json.dumps(run))
    needs = {"demo": (store.Need({"derived.decode_ms": store.POSITIVE, "params.n": store.COUNT}),)}
    with pytest.raises(ResultsError, match="x.json: case 'a': field derived.decode_ms must be a finite number > 0, "
                                           "got 'fast'"):
        store.load_run(path, needs, "plan")
    with pytest.raises(ResultsError, match="a 'demo' result; plan needs a cycle or verify result"):
        store.load_run(path, {"cycle": (), "verify": ()}, "plan")
    run["cases"][0]["derived"]["decode_ms"] = 5.0
    path.write_text(json.dumps(run))
    assert store.load_run(path, needs, "plan")["cases"][0]["derived"]["decode_ms"] == 5.0
    with pytest.raises(ResultsError, match="a CPU smoke run"):
        store.load_run(path, needs, "plan", gpu_only=True)


def test_a_fingerprint_whose_gpu_model_was_edited_is_refused_as_contradicting_itself(tmp_path):
    run = store.make_run("demo", [], {"gpu_model": "NVIDIA H100", "gpus": [{"name": "NVIDIA H200"}]})
    path = tmp_path / "x.json"
    path.write_text(json.dumps(run))
    with pytest.raises(ResultsError, match="contradicts itself: gpu_model 'NVIDIA H100' but its GPU is 'NVIDIA H200'"):
        store.load_run(path)


def test_plan_project_and_trace_against_refuse_cpu_results_through_the_one_stance(tmp_path, monkeypatch, capsys):
    """Every command that only draws conclusions asks stance.refusal: change its answer and all three follow."""
    from verifybench.harness.answers import trace_against
    from verifybench.harness.answers.trace_read import TraceError
    from verifybench.harness.cli import main
    from verifybench.harness.measure import stance

    baseline = Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1/verify.json"
    run = json.loads(baseline.read_text())
    for c in run["cases"]:
        c["device"] = "cpu"
    path = store.write_json_atomic(tmp_path / "verify.json", run)
    monkeypatch.setattr(stance, "refusal",
                        lambda run, where: f"{where}: THE STANCE" if stance.is_cpu_run(run) else None)
    assert main(["plan", str(path), "--accept-len", "3:2.4"]) == 2 and "THE STANCE" in capsys.readouterr().err
    assert main(["project", str(path), "--target", "rtx-pro-6000-pcie-tp8"]) == 2
    assert "THE STANCE" in capsys.readouterr().err
    with pytest.raises(TraceError, match="THE STANCE"):
        trace_against.load_against(path)
