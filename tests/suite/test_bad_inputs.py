"""Bad inputs across the CLI (every command), compare, result loading and runs, as a careful user would try them:
each gives exit 2 and one line on stderr naming the input and what is allowed (no traceback, nothing measured),
or the right answer. Every probe runs in-process under an alarm, so a hang fails it instead of stalling CI."""
import ast
import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from verifybench.harness import components, run
from verifybench.harness.cli import main
from verifybench.harness.measure.results import compare, store
from verifybench.harness.measure.timing import memory, runner
from verifybench.harness.measure.results.store import ResultsError
from verifybench.harness.measure.timing.runner import Case, CaseSkipped, CaseSpec
from verifybench.harness.measure.timing.timer import Measurement, measure

PROBE_TIMEOUT_S = 60
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without a GPU (the CPU smoke profile)")
ENV = ("VERIFYBENCH_MAX_TIME_S", "VERIFYBENCH_ALLREDUCE_US", "VERIFYBENCH_VERIFY_OPS", "VERIFYBENCH_PDL",
       "VERIFYBENCH_HOST_GATE", "VERIFYBENCH_PIN_CPU", "VERIFYBENCH_MEMORY_CAP_GIB", "VERIFYBENCH_MOE_TRACE",
       "VERIFYBENCH_ALLREDUCE_FROM")
FP = {"gpu_model": "NVIDIA H200", "slug": "h200", "env": {}, "gpus": [{"name": "NVIDIA H200", "uuid": "GPU-1"}]}


@pytest.fixture(autouse=True)
def guarded(monkeypatch):
    """A clean VERIFYBENCH_* environment, torch's thread count restored, and an alarm: a hang is a failure."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()

    def hang(signum, frame):
        raise TimeoutError(f"probe still running after {PROBE_TIMEOUT_S} s: a hang")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(PROBE_TIMEOUT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
    torch.set_num_threads(threads)


@pytest.fixture
def nothing_measured(monkeypatch):
    """Fails the probe if anything is measured or any component runs."""
    def measured(*a, **k):
        raise AssertionError("measured although the input was bad")

    monkeypatch.setattr(run, "run_component", measured)
    monkeypatch.setattr(runner, "measure", measured)


def refused(argv, capsys, *needles) -> str:
    """main(argv) exits 2 with exactly one line on stderr, no traceback, holding every needle."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------------ command line, run

RUN_ARGS = [
    ([], "the following arguments are required: COMMAND"),
    (["nope"], "invalid choice: 'nope'"),
    (["run", "--bogus"], "unrecognized arguments: --bogus"),
    (["run", "--preset", "nope"], "preset 'nope'"),
    pytest.param(["run", "--preset", "kimi-k2.5"], "needs a GPU", marks=CPU_ONLY),
    (["run", "--tp", "0"], "argument --tp: must be >= 1, got '0'"),
    (["run", "--tp", "-1"], "argument --tp: must be >= 1, got '-1'"),
    (["run", "--tp", "7"], "TP 7 does not divide"),
    (["run", "--tp", "abc"], "argument --tp: not an integer: 'abc'"),
    (["run", "--tp", "1e3"], "argument --tp: not an integer"),
    (["run", "--tp", "1_0"], "argument --tp: not an integer: '1_0'"),
    (["run", "--context", "0"], "argument --context: must be in 1..1048576, got '0'"),
    (["run", "--context", "-5"], "argument --context: must be in 1..1048576, got '-5'"),
    (["run", "--context", "99999999"], "argument --context: must be in 1..1048576"),
    (["run", "--context", "1.5"], "argument --context: not an integer: '1.5'"),
    (["run", "--context", "6_4"], "argument --context: not an integer: '6_4'"),
    (["run", "--tokens", "0"], "argument --tokens: must be in 1..64"),
    (["run", "--tokens", "1,-2"], "--tokens"),
    (["run", "--tokens", "1,1"], "argument --tokens: lists a count twice"),
    (["run", "--tokens", "abc"], "argument --tokens: takes positive integers"),
    (["run", "--tokens", "65"], "argument --tokens: must be in 1..64"),
    (["run", "--tokens", ""], "--tokens"),
    (["run", "--tokens", "8-1"], "argument --tokens: the range '8-1' runs backwards"),
    (["run", "--tokens", "nan"], "argument --tokens: takes positive integers"),
    (["run", "--tokens", "1_0"], "argument --tokens: takes positive integers like 1,2,4,8 or 1-8, got '1_0'"),
    (["run", "--tokens", "1-"], "argument --tokens: takes positive integers like 1,2,4,8 or 1-8, got '1-'"),
    (["run", "--tokens", "1,"], "argument --tokens: takes positive integers"),
    (["run", "--tokens", "٣"], "argument --tokens: takes positive integers"),  # a digit int() reads, not ASCII
    (["run", "--out", ""], "argument --out: an empty path"),
    (["run", "--out", " "], "argument --out: an empty path"),
    (["run", "--components", "harness,harness"], "unknown --components harness"),
    (["run", "--components", "verify,verify"], "--components lists verify twice"),
    (["run", "--components", ""], "an empty item"),
    (["run", "--components", "verify,,baseline"], "an empty item"),
    (["run", "--components", "verify,nope"], "unknown --components nope"),
    (["run", "--components", "verify", "--tokens", "9"], "the verify forward runs n = 1..8"),
    (["run", "--components", "mla_decode", "--tokens", "16"], "the MLA decode caches hold n = 1..8"),
]


@pytest.mark.parametrize("argv, needle", RUN_ARGS)
def test_run_arguments(argv, needle, capsys, nothing_measured):
    refused(argv, capsys, needle)


@pytest.mark.parametrize("name", components.REGISTRY)
@pytest.mark.parametrize("argv, needle", [pytest.param(["--preset", "kimi-k2.5"], "needs a GPU", marks=CPU_ONLY),
                                          (["--tp", "0"], "--tp"),
                                          (["--context", "0"], "--context"), (["--tokens", "0"], "--tokens")])
def test_every_component_command_refuses_a_bad_scope(name, argv, needle, capsys, nothing_measured):
    refused([name, *argv], capsys, needle)


ENV_VALUES = [
    ("VERIFYBENCH_MAX_TIME_S", "abc"), ("VERIFYBENCH_MAX_TIME_S", "nan"), ("VERIFYBENCH_MAX_TIME_S", "0"),
    ("VERIFYBENCH_MAX_TIME_S", "-1"), ("VERIFYBENCH_MAX_TIME_S", "inf"),
    ("VERIFYBENCH_ALLREDUCE_US", "abc"), ("VERIFYBENCH_ALLREDUCE_US", "nan"), ("VERIFYBENCH_ALLREDUCE_US", "-3"),
    ("VERIFYBENCH_ALLREDUCE_US", "1e9"),
    ("VERIFYBENCH_VERIFY_OPS", "fast"), ("VERIFYBENCH_PDL", "2"), ("VERIFYBENCH_PDL", "yes"),
    ("VERIFYBENCH_HOST_GATE", "maybe"), ("VERIFYBENCH_PIN_CPU", "abc"), ("VERIFYBENCH_PIN_CPU", "99999"),
    ("VERIFYBENCH_PIN_CPU", "-1"),
    ("VERIFYBENCH_MEMORY_CAP_GIB", "0"), ("VERIFYBENCH_MEMORY_CAP_GIB", "abc"), ("VERIFYBENCH_MEMORY_CAP_GIB", "inf"),
    ("VERIFYBENCH_MEMORY_CAP_GIB", "-2"), ("VERIFYBENCH_MOE_TRACE", "/no/such/trace.json"),
]


@pytest.mark.parametrize("name, value", ENV_VALUES, ids=[f"{n}={v}" for n, v in ENV_VALUES])
def test_environment_values_are_checked_before_measuring(name, value, monkeypatch, capsys, nothing_measured,
                                                         tmp_path):
    monkeypatch.setenv(name, value)
    refused(["run", "--components", "baseline", "--out", tmp_path], capsys, name)


def test_unwritable_or_impossible_out_is_refused_before_measuring(tmp_path, monkeypatch, capsys, nothing_measured):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused(["run", "--out", blocker], capsys, "output folder", "not writable")
    refused(["baseline", "--out", blocker / "sub"], capsys, "output folder", "not writable")
    refused(["run", "--out", "/proc/verifybench/out"], capsys, "not writable")

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)  # read-only, also when the tests run as root
    refused(["run", "--out", tmp_path / "ro"], capsys, "Permission denied")


# ------------------------------------------------------------------------------------------ other commands

OTHER_ARGS = [
    (["compare", "only-one.json"], "the following arguments are required: new"),
    (["compare", "a.json", "b.json", "--min-effect", "nan"], "--min-effect must be in [0, 1), got nan"),
    (["compare", "a.json", "b.json", "--min-effect", "-0.1"], "--min-effect must be in [0, 1), got -0.1"),
    (["compare", "a.json", "b.json", "--min-effect", "1"], "--min-effect must be in [0, 1), got 1.0"),
    (["compare", "a.json", "b.json", "--min-effect", "abc"], "argument --min-effect: invalid float value"),
    (["compare", "a.json", "b.json", "--alpha", "0"], "--alpha must be in (0, 1), got 0.0"),
    (["compare", "a.json", "b.json", "--alpha", "1.5"], "--alpha must be in (0, 1), got 1.5"),
    (["compare", "a.json", "b.json", "--alpha", "inf"], "--alpha must be in (0, 1), got inf"),
    (["breakeven", "--accept-len", "nan"], "argument --accept-len: must be a finite number"),
    (["breakeven", "--accept-len", "0"], "argument --accept-len: must be >= 1"),
    (["breakeven", "--accept-len", "0.5"], "argument --accept-len: must be >= 1, got '0.5'"),
    (["breakeven", "--accept-len", "1e308"], "argument --accept-len: must be <= 64"),
    (["breakeven", "--accept-len", "65"], "argument --accept-len: must be <= 64"),
    (["breakeven", "--accept-len", "2_5"], "argument --accept-len: not a number: '2_5'"),
    (["breakeven", "--accept-len", "2", "--decode-ms", "1_1"], "argument --decode-ms: not a number"),
    (["breakeven", "--accept-len", "-1"], "argument --accept-len"),
    (["breakeven", "--accept-len", "2", "--decode-ms", "0"], "argument --decode-ms: must be > 0"),
    (["breakeven", "--accept-len", "2", "--verify-ms", "-1"], "argument --verify-ms: must be >= 0"),
    (["breakeven", "--accept-len", "2", "--draft-ms", "inf"], "argument --draft-ms"),
    (["breakeven"], "the following arguments are required: --accept-len"),
    (["project", "/no/such/result.json", "--copy-gbps", "100", "--allreduce-us", "10"], "no such file"),
    (["project", "x.json", "--copy-gbps", "nan", "--allreduce-us", "10"], "argument --copy-gbps"),
    (["project", "x.json", "--copy-gbps", "0", "--allreduce-us", "10"], "argument --copy-gbps: must be > 0"),
    (["project", "x.json", "--copy-gbps", "10", "--allreduce-us", "-1"], "argument --allreduce-us: must be >= 0"),
    (["project", "x.json", "--target", "nope"], "argument --target: invalid choice"),
    (["trace", "/no/such/trace.json"], "no such file"),
    (["trace", "--tokens", "0", "x.json"], "argument --tokens: must be in 1..64, got '0'"),
    (["trace", "--tokens", "1_0", "x.json"], "argument --tokens: takes positive integers like 1,2,4,8 or 1-8"),
    (["trace", "x.json", "--json", ""], "argument --json: an empty path"),
    (["trace", "x.json", "--chart", ""], "argument --chart: an empty path"),
    (["plan", "--decode-ms", "11", "--verify-ms", "3:25,6:28", "--configs", "", "--accept-rates", "0.7"],
     "--configs: empty"),
    (["plan", "--decode-ms", "11", "--verify-ms", "3:25,6:28", "--accept-rates", "0.7", "--json", ""],
     "argument --json: an empty path"),
    (["plan", "--decode-ms", "1_1", "--verify-ms", "3:25,6:28", "--accept-rates", "0.7"], "argument --decode-ms"),
    (["project", "x.json", "--copy-gbps", "4_000", "--allreduce-us", "10"], "argument --copy-gbps: not a number"),
    (["trace", "--rules", "/no/such/rules.json", "x.json"], "no such rules file"),
    (["hostprobe", "--seconds", "nan"], "--seconds must be in (0, 3600]"),
    (["hostprobe", "--seconds", "0"], "--seconds must be in (0, 3600]"),
    (["hostprobe", "--seconds", "-1"], "--seconds must be in (0, 3600]"),
    (["hostprobe", "--seconds", "4000"], "--seconds must be in (0, 3600]"),
    (["hostprobe", "--seconds", "abc"], "argument --seconds: invalid float value"),
    (["hostprobe", "--seconds", "1", "--json", "/proc/verifybench/x.json"], "not writable"),
    (["env", "extra"], "unrecognized arguments: extra"),
    pytest.param(["record", "out.json.gz"], "it needs a GPU", marks=CPU_ONLY),
    (["record", "out.json.gz", "--tokens", "0"], "argument --tokens: must be in 1..8"),
    (["record", "out.json.gz", "--replays", "x"], "argument --replays: not an integer"),
    (["tune", "--components", "nope"], "--components"),
    (["tune", "--components", ""], "--components"),
    (["tune", "--budget-s", "nan"], "argument --budget-s: must be a finite number"),
    (["tune", "--budget-s", "1"], "argument --budget-s: must be >= 30"),
    (["tune", "--tp", "abc"], "argument --tp: invalid int value"),
]


@pytest.mark.parametrize("argv, needle", OTHER_ARGS)
def test_other_commands_refuse_bad_arguments(argv, needle, capsys, nothing_measured):
    refused(argv, capsys, needle)


def test_project_refuses_a_result_that_is_not_a_gpu_verify_run(tmp_path, capsys):
    cpu_run = store.make_run("verify", [], {"gpu_model": "cpu", "slug": "cpu", "env": {}})
    path = store.write_json_atomic(tmp_path / "v.json", cpu_run)
    refused(["project", path, "--copy-gbps", "100", "--allreduce-us", "10"], capsys, str(path))
    other = store.write_json_atomic(tmp_path / "b.json", store.make_run("baseline", [], FP))
    refused(["project", other, "--copy-gbps", "100", "--allreduce-us", "10"], capsys, "project needs a verify result")


# ------------------------------------------------------------------------------------------ compare and result files

def _measurement(samples, mode="graph"):
    return Measurement(mode, "cuda", "cuda_event", list(samples), 1, 3, "ci_target", 1.0)


def _suite(path: Path, cases=None) -> Path:
    cases = cases or {"x": np.random.default_rng(1).normal(100, 0.5, 50)}
    run_ = store.make_run("demo", [Case(n, {}, True, "", _measurement(s)) for n, s in cases.items()], FP)
    return store.write_json_atomic(path, run_)


def _edited(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _case(d):
    return d["cases"][0]


BAD_FILES = {
    "missing": (lambda p: p.parent / "missing.json", "no such file"),
    "empty": (lambda p: (p.write_text(""), p)[1], "not valid JSON"),
    "truncated": (lambda p: (p.write_text(_suite(p).read_text()[:300]), p)[1], "not valid JSON"),
    "a JSON list": (lambda p: (p.write_text("[1, 2]"), p)[1], "expected a JSON object"),
    "foreign object": (lambda p: (p.write_text('{"hello": 1}'), p)[1], "neither a verifybench result"),
    "future schema": (lambda p: _edited(_suite(p), lambda d: d.update(schema_version=99)), "schema version 99"),
    "no cases list": (lambda p: _edited(_suite(p), lambda d: d.update(cases={})), "field 'cases'"),
    "case without name": (lambda p: _edited(_suite(p), lambda d: _case(d).pop("name")), "case 0 has no name"),
    "case without check": (lambda p: _edited(_suite(p), lambda d: _case(d).pop("check")), "no check outcome"),
    "passed without samples": (lambda p: _edited(_suite(p), lambda d: _case(d).pop("samples_us")), "no samples"),
    "empty samples": (lambda p: _edited(_suite(p), lambda d: _case(d).update(samples_us=[])), "no samples"),
    "all-null samples": (lambda p: _edited(_suite(p), lambda d: _case(d).update(samples_us=[None] * 50)),
                         "every sample is null"),
    "one null sample": (lambda p: _edited(_suite(p), lambda d: _case(d)["samples_us"].__setitem__(0, None)),
                        "1 of 50 samples are null"),
    "a string sample": (lambda p: _edited(_suite(p), lambda d: _case(d)["samples_us"].__setitem__(0, "1")),
                        "not numbers"),
    "a boolean sample": (lambda p: _edited(_suite(p), lambda d: _case(d)["samples_us"].__setitem__(0, True)),
                         "not numbers"),
    "negative samples": (lambda p: _edited(_suite(p), lambda d: _case(d).update(
        samples_us=[-v for v in _case(d)["samples_us"]])), "samples are negative"),
    "null median": (lambda p: _edited(_suite(p), lambda d: _case(d)["summary"].update(median_us=None)),
                    "the stored median is null or missing"),
    "missing median": (lambda p: _edited(_suite(p), lambda d: _case(d)["summary"].pop("median_us")),
                       "the stored median is null or missing"),
    "zero median": (lambda p: _edited(_suite(p), lambda d: _case(d)["summary"].update(median_us=0)),
                    "the stored median must be > 0"),
    "negative median": (lambda p: _edited(_suite(p), lambda d: _case(d)["summary"].update(median_us=-4.0)),
                        "the stored median must be > 0"),
    "string median": (lambda p: _edited(_suite(p), lambda d: _case(d)["summary"].update(median_us="100")),
                      "not a finite number"),
    "stale summary": (lambda p: _edited(_suite(p), lambda d: _case(d).update(
        samples_us=[v * 1.05 for v in _case(d)["samples_us"]])), "disagrees with its 50 samples"),
    "stale sample count": (lambda p: _edited(_suite(p), lambda d: _case(d)["summary"].update(n=7)),
                           "the stored n (7) disagrees"),
    "summary not an object": (lambda p: _edited(_suite(p), lambda d: _case(d).update(summary=[1])), "no samples"),
    "duplicate case": (lambda p: _edited(_suite(p), lambda d: d["cases"].append(_case(d))), "appears twice"),
    "gpu entry malformed": (lambda p: _edited(_suite(p), lambda d: d["fingerprint"].update(gpus=[1])),
                            "fingerprint's GPU entry is malformed"),
    "broken gzip": (lambda p: (p.with_suffix(".gz").write_bytes(b"not gzip"), p.with_suffix(".gz"))[1],
                    "cannot read"),
    "pb: benchmarks not a list": (lambda p: (p.write_text('{"machine_info": {}, "benchmarks": {}}'), p)[1],
                                  "without a 'benchmarks' list"),
    "pb: entry without stats": (lambda p: (p.write_text('{"machine_info": {}, "benchmarks": [{"name": "t"}]}'),
                                           p)[1], "malformed benchmark entry"),
    "pb: zero median": (lambda p: (p.write_text(json.dumps({"machine_info": {}, "benchmarks": [
        {"name": "t", "stats": {"median": 0, "q1": 0, "q3": 0}}]})), p)[1], "must be > 0"),
    "pb: null data": (lambda p: (p.write_text(json.dumps({"machine_info": {}, "benchmarks": [
        {"name": "t", "stats": {"median": 1e-5, "q1": 1e-5, "q3": 1e-5, "data": [None, None]}}]})), p)[1],
        "every sample is null"),
    "pb: data under a stale median": (lambda p: (p.write_text(json.dumps({"machine_info": {}, "benchmarks": [
        {"name": "t", "stats": {"median": 1e-5, "q1": 1e-5, "q3": 1e-5, "data": [2e-5] * 9}}]})), p)[1],
        "disagrees"),
    "pb: q1 above the median": (lambda p: (p.write_text(json.dumps({"machine_info": {}, "benchmarks": [
        {"name": "t", "stats": {"median": 1e-5, "q1": 2e-5, "q3": 3e-5}}]})), p)[1], "q1 <= median <= q3"),
    "pb: fingerprint not an object": (lambda p: (p.write_text(json.dumps({"machine_info": {"verifybench": "x"},
                                                                           "benchmarks": []})), p)[1],
                                      "machine_info.verifybench is not an object"),
}


@pytest.mark.parametrize("which", list(BAD_FILES))
def test_compare_refuses_a_bad_file_naming_it(which, tmp_path, capsys):
    make, needle = BAD_FILES[which]
    good = _suite(tmp_path / "good.json")
    bad = make(tmp_path / "bad.json")
    line = refused(["compare", good, bad], capsys, needle)
    assert str(bad) in line or which in ("missing",)
    line = refused(["compare", bad, good], capsys, needle)  # as BASE too


def test_compare_of_files_sharing_no_case_or_hardware_exits_2(tmp_path, capsys):
    a = _suite(tmp_path / "a.json", {"x": np.full(20, 10.0) + np.arange(20) * 0.01})
    b = _suite(tmp_path / "b.json", {"y": np.full(20, 10.0) + np.arange(20) * 0.01})
    refused(["compare", a, b], capsys, "share no case")
    other = _edited(_suite(tmp_path / "c.json"), lambda d: d["fingerprint"].update(gpus=[{"name": "H100"}],
                                                                                   gpu_model="H100"))
    refused(["compare", _suite(tmp_path / "d.json"), other], capsys, "different GPU models")


def test_compare_right_answers_on_skipped_and_older_files(tmp_path, capsys):
    base = _suite(tmp_path / "a.json", {"x": np.random.default_rng(1).normal(100, 0.5, 50)})
    new = store.write_json_atomic(tmp_path / "b.json", store.make_run("demo", [
        Case("x", {}, False, "skipped: too little memory", skipped="too little memory"),
        Case("y", {}, True, "", _measurement(np.random.default_rng(2).normal(100, 0.5, 50)))], FP))
    both = _suite(tmp_path / "c.json", {"x": np.random.default_rng(3).normal(100, 0.5, 50),
                                       "y": np.random.default_rng(4).normal(100, 0.5, 50)})
    assert main(["compare", str(both), str(new)]) == 0  # x skipped in NEW: listed, no FAIL; y SAME
    out = capsys.readouterr().out
    assert "skipped in NEW (too little memory): x" in out and "FAIL" not in out and "SAME 1" in out
    _edited(base, lambda d: d.pop("method_version"))
    assert main(["compare", str(base), str(both)]) == 0
    assert "method version unknown" in capsys.readouterr().out


def test_result_loading_refuses_what_it_cannot_use(tmp_path):
    for which in ("future schema", "case without check", "passed without samples", "a JSON list"):
        make, needle = BAD_FILES[which]
        with pytest.raises(ResultsError, match=needle):
            store.load_run(make(tmp_path / f"{which}.json"))
    with pytest.raises(ResultsError, match="field 'component'"):
        store.validate_run({"schema": store.SCHEMA, "schema_version": store.SCHEMA_VERSION}, "x")


def test_saving_a_run_with_a_non_finite_figure_stores_null_and_loads(tmp_path):
    run_ = store.make_run("demo", [Case("x", {}, True, "", _measurement([1.0, 2.0, 3.0]),
                                          {"eta": float("nan"), "gbps": float("inf")})], FP)
    loaded = store.load_run(store.save_run(run_, tmp_path))
    assert loaded["cases"][0]["derived"] == {"eta": None, "gbps": None}


def test_compare_module_reports_every_refusal_as_a_results_error(tmp_path):
    for which, (make, needle) in BAD_FILES.items():
        if which == "gpu entry malformed":  # refused when the two files' hardware is matched, after loading
            continue
        with pytest.raises(ResultsError, match=re.escape(needle)):
            compare.load(make(tmp_path / f"{which.replace(':', '')}.json"))


# ------------------------------------------------------------------------------------------ fields a command reads

BASELINES = Path(__file__).resolve().parents[2] / "results" / "baselines" / "nvidia-h200-x1"


def _first(data, variant=None):
    return next(c for c in data["cases"] if c["check"]["ok"] and variant in (None, c["params"].get("variant")))


FIELD_EDITS = {  # (baseline, the command's arguments after the file, edit of the loaded JSON, the field named)
    "plan: null decode_ms": ("cycle.json", ["plan"], lambda d: _first(d)["derived"].update(decode_ms=None),
                             "field derived.decode_ms must be a finite number > 0, got None"),
    "plan: zero decode_ms": ("cycle.json", ["plan"], lambda d: _first(d)["derived"].update(decode_ms=0),
                             "field derived.decode_ms must be a finite number > 0, got 0"),
    "plan: string steps": ("cycle.json", ["plan"], lambda d: _first(d)["params"].update(steps="2"),
                           "field params.steps must be an integer in 1..64, got '2'"),
    "plan: missing table_ms": ("cycle.json", ["plan"], lambda d: _first(d)["derived"].pop("table_ms"),
                               "field derived.table_ms must be an object of finite numbers, got missing"),
    "plan: null phase": ("cycle.json", ["plan"], lambda d: _first(d)["derived"]["table_ms"].update(other=None),
                         "field derived.table_ms must be an object of finite numbers"),
    "plan: zero median": ("cycle.json", ["plan"], lambda d: _first(d)["summary"].update(median_us=0),
                          "the stored median must be > 0, got 0"),
    "plan: missing tokens": ("verify.json", ["plan"], lambda d: [c for c in d["cases"] if c["check"]["ok"] and c[
        "params"].get("variant") == "full"][2]["params"].pop("tokens"),
                             "field params.tokens must be an integer in 1..64, got missing"),
    "plan: params a list": ("verify.json", ["plan"], lambda d: _first(d).update(params=[1]),
                            "field 'params' is not an object"),
    "project: null copy": ("verify.json", ["project"], lambda d: _first(d, "full")["derived"].update(copy_gbps=None),
                           "field derived.copy_gbps must be a finite number > 0, got None"),
    "project: zero copy": ("verify.json", ["project"], lambda d: _first(d, "full")["derived"].update(copy_gbps=0),
                           "field derived.copy_gbps must be a finite number > 0, got 0"),
    "project: string allreduce": ("verify.json", ["project"], lambda d: _first(d, "full")["derived"].update(
        allreduce_stand_in_us="7.7"), "field derived.allreduce_stand_in_us must be a finite number >= 0"),
    "project: missing bytes": ("verify.json", ["project"], lambda d: _first(d, "full")["derived"].pop(
        "component_bytes"), "field derived.component_bytes must be an object of byte counts >= 0, got missing"),
    "project: missing layers": ("verify.json", ["project"], lambda d: _first(d, "full")["params"].pop("layers"),
                                "field params.layers must be null or an integer >= 1, got missing"),
    "project: string median": ("verify.json", ["project"], lambda d: _first(d)["summary"].update(median_us="9"),
                               "the stored median is not a finite number"),
    "project: edited gpu": ("verify.json", ["project"], lambda d: d["fingerprint"].update(gpu_model="NVIDIA B200"),
                            "the fingerprint contradicts itself"),
}
COMMAND_TAIL = {"plan": ["--accept-len", "3:2.4,4:2.6,6:3,8:3.2"], "project": ["--target", "rtx-pro-6000-pcie-tp8"]}


@pytest.mark.parametrize("which", list(FIELD_EDITS))
def test_plan_and_project_name_the_file_and_the_field_a_result_lacks(which, tmp_path, capsys):
    """A file that is damaged as a whole is refused; a case with a bad field is left out by the one reader
    (measure/results/result_cases.py), in one line naming the file, the case and the field, and the rest is read."""
    baseline, (command,), edit, needle = FIELD_EDITS[which]
    data = json.loads((BASELINES / baseline).read_text())
    edit(data)
    path = tmp_path / baseline
    path.write_text(json.dumps(data))
    if not re.match(r"field [a-z]", needle):
        line = refused([command, path, *COMMAND_TAIL[command]], capsys, needle)
        assert line.startswith(f"error: {path}")
        return
    assert main([str(a) for a in (command, path, *COMMAND_TAIL[command])]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"note: {path}: 1 of ") and needle in err[0], err


def _corrupt_gzip(path: Path) -> Path:
    import gzip

    packed = bytearray(gzip.compress((BASELINES / "verify.json").read_bytes()))
    packed[40:80] = b"\xff" * 40  # a valid gzip header over a broken deflate stream: zlib.error when read
    path.write_bytes(bytes(packed))
    return path


@pytest.mark.parametrize("argv", [["plan", "{bad}", "--accept-len", "3:2"], ["compare", "{bad}", "{good}"],
                                  ["compare", "{good}", "{bad}"], ["project", "{bad}", "--target",
                                                                   "rtx-pro-6000-pcie-tp8"],
                                  ["trace", "{trace}", "--against", "{bad}"], ["run", "--components", "verify",
                                                                             "--allreduce-from", "{bad}"]])
def test_a_corrupt_gzip_result_is_one_line_naming_it_in_every_command(argv, tmp_path, capsys, nothing_measured):
    bad = _corrupt_gzip(tmp_path / "verify-20261202T000000Z.json.gz")
    names = {"bad": bad, "good": BASELINES / "verify.json", "trace": TRACE}
    refused([a.format(**names) for a in argv], capsys, str(bad))


# ------------------------------------------------------------------------------------------ writes

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "handbuilt-engine-TP-0.trace.json.gz"
TRACE_ARGS = ["--cycle-range", "scheduler_step", "--verify-range", "verify_forward"]


def test_plan_never_writes_onto_its_input_result(tmp_path, capsys):
    src = tmp_path / "cycle.json"
    src.write_bytes((BASELINES / "cycle.json").read_bytes())
    before = src.read_bytes()
    refused(["plan", src, "--accept-len", "3:2.4", "--json", src], capsys, "--json", "that is an input")
    refused(["plan", tmp_path, "--accept-len", "3:2.4", "--json", src], capsys, "that is an input")  # via a folder
    assert src.read_bytes() == before


def test_plan_json_onto_an_existing_file_writes_a_fresh_one_and_says_so(tmp_path, capsys):
    out = tmp_path / "plan.json"
    out.write_text("the user's file")
    argv = ["plan", "--decode-ms", "11", "--verify-ms", "3:25,6:28", "--accept-rates", "0.7", "--json", str(out)]
    assert main(argv) == 0
    assert f"wrote {tmp_path / 'plan-2.json'}" in capsys.readouterr().out
    assert out.read_text() == "the user's file" and json.loads((tmp_path / "plan-2.json").read_text())["rows"]


@pytest.mark.parametrize("option", ["--json", "--chart"])
def test_trace_never_replaces_the_users_trace(option, tmp_path, capsys):
    trace = tmp_path / "engine-TP-0.trace.json.gz"
    trace.write_bytes(TRACE.read_bytes())
    refused(["trace", trace, *TRACE_ARGS, option, trace], capsys, option, "that is an input")
    refused(["trace", trace, *TRACE_ARGS, option, tmp_path / "." / trace.name], capsys, "that is an input")
    assert trace.read_bytes() == TRACE.read_bytes() and sorted(p.name for p in tmp_path.iterdir()) == [trace.name]


def _quick_component(monkeypatch):
    """`verifybench baseline` with one trivial case and a frozen clock: two runs start in the same second."""
    from datetime import datetime, timezone

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 2, 10, 10, 10, tzinfo=timezone.utc)

    monkeypatch.setattr(store, "datetime", Frozen)
    module = components.load("baseline")
    monkeypatch.setattr(module, "cases", lambda *a, **k: [
        CaseSpec("x", {}, "hot", lambda: (lambda: None, lambda: (True, "ok"), None), {"device": "cpu"})])
    monkeypatch.setattr(module, "tables", lambda records, **k: [])


def test_two_runs_with_one_out_in_the_same_second_keep_both_results(tmp_path, monkeypatch, capsys):
    _quick_component(monkeypatch)
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.01")
    assert main(["baseline", "--out", str(tmp_path)]) == 0
    assert main(["baseline", "--out", str(tmp_path)]) == 0
    saved = [line.split()[-1] for line in capsys.readouterr().out.splitlines() if line.startswith("saved ")]
    assert [Path(p).name for p in saved] == ["baseline-20261202T101010Z.json", "baseline-20261202T101010Z-2.json"]
    assert all(store.load_run(p)["component"] == "baseline" for p in saved)


# ------------------------------------------------------------------------------------------ interrupted

def test_ctrl_c_during_a_run_exits_130_in_one_line_leaving_only_complete_files(tmp_path, monkeypatch, capsys):
    def interrupted(name, scope, out_dir):
        store.save_run(store.make_run(name, [], FP), out_dir)  # one component done, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run_component", interrupted)
    monkeypatch.delenv("VERIFYBENCH_MAX_TIME_S", raising=False)
    assert main(["run", "--components", "baseline,graph_replay", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err and "Traceback" not in err
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 1 and left[0].startswith("baseline-") and store.load_run(tmp_path / left[0])


def test_ctrl_c_in_any_command_exits_130(monkeypatch, capsys):
    from verifybench.harness.analysis import breakeven

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(breakeven, "run", interrupted)
    assert main(["breakeven", "--accept-len", "2"]) == 130
    assert "interrupted" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ folders and globs

def _folder(tmp_path, *names, source="verify.json") -> Path:
    folder = tmp_path / "machine"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_bytes((BASELINES / source).read_bytes())
    return folder


def test_compare_takes_a_folders_latest_file_of_the_base_kind(tmp_path, capsys):
    folder = _folder(tmp_path, "verify-20261201T000000Z.json", "verify-20261202T000000Z.json")
    _folder(tmp_path, "cycle-20261203T000000Z.json", source="cycle.json")
    assert main(["compare", str(BASELINES / "verify.json"), str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"NEW: {folder / 'verify-20261202T000000Z.json'} (the latest verify result in {folder})" in out
    assert "SAME 144" in out


def test_compare_of_the_readme_glob_uses_the_latest_of_the_files(tmp_path, capsys):
    folder = _folder(tmp_path, "verify-20261201T000000Z.json", "verify-20261202T000000Z.json")
    assert main(["compare", str(BASELINES / "verify.json"), *map(str, sorted(folder.glob("verify-*.json")))]) == 0
    assert "(the latest of the 2 files given)" in capsys.readouterr().out
    other = _folder(tmp_path, "cycle-20261203T000000Z.json", source="cycle.json")
    refused(["compare", BASELINES / "verify.json", folder / "verify-20261201T000000Z.json",
             other / "cycle-20261203T000000Z.json"], capsys, "files of different kinds")
    refused(["compare", folder, tmp_path], capsys, "both folders", "--kind")
    refused(["compare", BASELINES / "verify.json", tmp_path], capsys, "no verify result in this folder")


def test_plan_and_trace_against_take_a_folder(tmp_path, capsys):
    folder = _folder(tmp_path, "verify-20261201T000000Z.json")
    assert main(["plan", str(folder), "--accept-len", "3:2.4"]) == 0
    assert "the latest verify result" in capsys.readouterr().out  # no cycle result there: the verify one
    _folder(tmp_path, "cycle-20261202T000000Z.json", source="cycle.json")
    assert main(["plan", str(folder), "--accept-len", "3:2.4"]) == 0
    assert "the latest cycle result" in capsys.readouterr().out
    assert main(["trace", str(TRACE), *TRACE_ARGS, "--against", str(folder)]) == 0
    assert "--against: " in capsys.readouterr().out
    refused(["plan", tmp_path, "--accept-len", "3:2.4"], capsys, "no cycle or verify result in this folder")


# ------------------------------------------------------------------------------------------ compare's judgement

def test_compare_of_a_gpu_baseline_with_a_cpu_run_says_they_measure_different_cases(tmp_path, capsys):
    cpu = _suite(tmp_path / "cpu.json")
    _edited(cpu, lambda d: d.update(fingerprint={"gpu_model": "cpu", "slug": "cpu", "env": {}}))
    for argv in (["compare", BASELINES / "verify.json", cpu], ["compare", cpu, BASELINES / "verify.json"],
                 ["compare", BASELINES / "verify.json", cpu, "--allow-different-hardware"]):
        refused(argv, capsys, "CPU smoke run", "measure different cases and cannot be compared")


def test_identical_files_are_same_at_a_min_effect_of_zero(capsys):
    path = BASELINES / "verify.json"
    assert main(["compare", str(path), str(path), "--min-effect", "0"]) == 0
    assert "summary: SAME 144" in capsys.readouterr().out


def test_a_result_whose_gpu_was_edited_is_refused_not_same(tmp_path, capsys):
    for edit in (lambda d: d["fingerprint"].update(gpu_model="NVIDIA H100"),
                 lambda d: d["fingerprint"]["gpus"][0].update(name="NVIDIA H100")):
        data = json.loads((BASELINES / "verify.json").read_text())
        edit(data)
        (tmp_path / "e.json").write_text(json.dumps(data))
        refused(["compare", BASELINES / "verify.json", tmp_path / "e.json"], capsys, "contradicts itself")


@CPU_ONLY
def test_mla_verify_measures_the_context_given_or_refuses_it():
    mla_verify = components.load("mla_verify")
    assert {c.params["context"] for c in mla_verify.cases("tiny", 1, 1)} == {1}
    with pytest.raises(ValueError, match="--context 5000: without a GPU mla_verify runs contexts up to 4096"):
        mla_verify.cases("tiny", 1, 5000)


# ------------------------------------------------------------------------------------------ runs

@CPU_ONLY  # on a GPU the cap would stay on this test process's allocator
def test_a_run_of_one_component_under_a_tiny_memory_cap_skips_naming_bytes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERIFYBENCH_MEMORY_CAP_GIB", "0.01")
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.05")
    assert main(["baseline", "--out", str(tmp_path)]) == 0  # skipped is not failed
    out = capsys.readouterr().out
    assert "skipped (cannot run here): copy/" in out and "is free under VERIFYBENCH_MEMORY_CAP_GIB=0.01" in out
    saved = store.load_run(next(tmp_path.glob("baseline-*.json")))
    assert any(c.get("skipped") for c in saved["cases"]) and any(c["check"]["ok"] for c in saved["cases"])


def test_case_setup_that_cannot_run_is_skipped_and_a_raw_oom_is_caught():
    def skip():
        raise CaseSkipped("no P2P between GPU 0 and 1")

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 336.00 MiB")

    assert CaseSpec("a", {}, "hot", skip).run().skipped == "no P2P between GPU 0 and 1"
    assert "out of memory despite the memory plan" in CaseSpec("b", {}, "hot", oom).run().skipped


@pytest.mark.parametrize("kw", [{"mode": "warm"}, {"samples": 0, "calls_per_sample": 1}, {"max_time_s": -1},
                                {"min_samples": 1}, {"calls_per_sample": 10**6}, {"rel_ci_target": float("nan")}])
def test_measure_refuses_bad_arguments_naming_them(kw):
    with pytest.raises(ValueError):
        measure(lambda: None, device="cpu", **kw)


def test_memory_cap_values_on_their_own(monkeypatch):
    monkeypatch.setenv(memory.CAP_ENV, "1e-9")
    assert memory.cap_bytes() == 1  # tiny but valid: every planned case is then skipped, naming the bytes
    monkeypatch.setenv(memory.CAP_ENV, " ")
    assert memory.cap_bytes() is None


# ------------------------------------------------------------------------------------------ the tests themselves

def _asserting(fn: ast.FunctionDef, helpers: dict[str, ast.FunctionDef], seen=()) -> bool:
    """A test asserts when its body (or a module helper it calls, transitively) holds an assert, pytest.raises,
    pytest.fail, pytest.skip or pytest.approx."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pytest" \
                and node.attr in ("raises", "fail", "skip", "approx", "warns"):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers \
                and node.func.id not in seen and _asserting(helpers[node.func.id], helpers, (*seen, node.func.id)):
            return True
    return False


def test_no_test_in_the_suite_can_pass_without_asserting():
    lazy = []
    for path in sorted(Path(__file__).parents[1].rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for name, fn in funcs.items():
            if name.startswith("test_") and not _asserting(fn, funcs):
                lazy.append(f"{path.name}::{name}")
    assert not lazy, f"tests without an assertion: {lazy}"


def test_probe_counts_are_what_the_report_says():
    probes = (len(RUN_ARGS) + 4 * len(components.REGISTRY) + len(ENV_VALUES) + 4 + len(OTHER_ARGS) + 2
              + 2 * len(BAD_FILES) + 2 + len(FIELD_EDITS) + 6 + 16 + 14)
    assert probes >= 150, probes
    assert os.environ.get("VERIFYBENCH_MAX_TIME_S") is None  # the fixture keeps the environment clean
