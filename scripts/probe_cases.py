"""The inputs of scripts/probe_bad_inputs.py, by class: each a Case (how to run it, whether it is bad, what its
refusal must name, or how to check a right answer). Uses only public entry points, so it runs on older checkouts."""
from __future__ import annotations

import gzip
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FP = {"gpu_model": "NVIDIA H200", "slug": "h200", "env": {}, "gpus": [{"name": "NVIDIA H200", "uuid": "GPU-1"}]}
FAST = {"VERIFYBENCH_MAX_TIME_S": "0.05"}


@dataclass
class Result:
    kind: str  # "return" | "raise" | "exit" (os._exit / a signal) | "timeout"
    value: object = None
    exc_type: str = ""
    message: str = ""
    out: str = ""
    err: str = ""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass
class Case:
    cls: str
    name: str
    fn: Callable | None = None  # run in a forked child; CLI cases return the exit code
    bad: bool = True
    needle: str = ""  # what the refusal must name
    check: Callable | None = None  # Result -> (ok | "hang", why): decides instead of the default rules
    cli: bool = False
    api: bool = False
    env: dict | None = None
    timeout_s: float | None = None
    runner: Callable | None = None  # timeout_s -> Result, for real subprocesses


def cli(cls, argv, needle="", **kw) -> Case:
    def fn():
        from verifybench.harness.cli import main
        return main([str(a) for a in argv])
    return Case(cls, "verifybench " + " ".join(map(str, argv)), fn, needle=needle, cli=True, **kw)


def api(cls, name, fn, needle="", **kw) -> Case:
    return Case(cls, name, fn, needle=needle, api=True, **kw)


def module_main(cls, module, argv, needle="", **kw) -> Case:
    """`python -m verifybench.harness.multigpu.<module> ARGV` (one rank, no torchrun) in the child."""
    def fn():
        import importlib
        return importlib.import_module(f"verifybench.harness.multigpu.{module}").main([str(a) for a in argv])
    return Case(cls, f"python -m ...dist.{module} " + " ".join(map(str, argv)), fn, needle=needle, cli=True, **kw)


# ------------------------------------------------------------------------------------------ result files

def _suite(path: Path, cases=None) -> Path:
    from verifybench.harness.engine import results
    from verifybench.harness.engine.results import Case as RCase
    from verifybench.harness.engine.timing import Measurement

    cases = cases or {"x": np.random.default_rng(1).normal(100, 0.5, 50)}
    recs = [RCase(n, {}, True, "", Measurement("graph", "cuda", "cuda_event", list(map(float, s)), 1, 3, "ci_target",
                                                1.0)) for n, s in cases.items()]
    return results.write_json_atomic(path, results.make_run("demo", recs, FP))


def _edited(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _c(d):
    return d["cases"][0]


def _pb(path: Path, stats: dict) -> Path:
    path.write_text(json.dumps({"machine_info": {}, "benchmarks": [{"name": "t", "stats": stats}]}))
    return path


BAD_FILES = {
    "missing": lambda p: p.parent / f"missing-{p.name}",
    "a folder": lambda p: (p.mkdir(exist_ok=True), p)[1],
    "empty": lambda p: (p.write_text(""), p)[1],
    "truncated": lambda p: (p.write_text(_suite(p).read_text()[:300]), p)[1],
    "a JSON list": lambda p: (p.write_text("[1, 2]"), p)[1],
    "foreign object": lambda p: (p.write_text('{"hello": 1}'), p)[1],
    "future schema": lambda p: _edited(_suite(p), lambda d: d.update(schema_version=99)),
    "cases not a list": lambda p: _edited(_suite(p), lambda d: d.update(cases={})),
    "case without name": lambda p: _edited(_suite(p), lambda d: _c(d).pop("name")),
    "case without check": lambda p: _edited(_suite(p), lambda d: _c(d).pop("check")),
    "passed without samples": lambda p: _edited(_suite(p), lambda d: _c(d).pop("samples_us")),
    "empty samples": lambda p: _edited(_suite(p), lambda d: _c(d).update(samples_us=[])),
    "all-null samples": lambda p: _edited(_suite(p), lambda d: _c(d).update(samples_us=[None] * 50)),
    "one null sample": lambda p: _edited(_suite(p), lambda d: _c(d)["samples_us"].__setitem__(0, None)),
    "a string sample": lambda p: _edited(_suite(p), lambda d: _c(d)["samples_us"].__setitem__(0, "1")),
    "a boolean sample": lambda p: _edited(_suite(p), lambda d: _c(d)["samples_us"].__setitem__(0, True)),
    "negative samples": lambda p: _edited(_suite(p), lambda d: _c(d).update(samples_us=[-v for v in _c(d)["samples_us"]])),
    "samples a dict": lambda p: _edited(_suite(p), lambda d: _c(d).update(samples_us={"a": 1})),
    "null median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(median_us=None)),
    "missing median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].pop("median_us")),
    "zero median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(median_us=0)),
    "negative median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(median_us=-4.0)),
    "string median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(median_us="100")),
    "samples 5% slower under a stale summary": lambda p: _edited(_suite(p), lambda d: _c(d).update(
        samples_us=[v * 1.05 for v in _c(d)["samples_us"]])),
    "stale sample count": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(n=7)),
    "stale min": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(min_us=1.0)),
    "summary not an object": lambda p: _edited(_suite(p), lambda d: _c(d).update(summary=[1])),
    "mode missing": lambda p: _edited(_suite(p), lambda d: _c(d).pop("mode")),
    "duplicate case": lambda p: _edited(_suite(p), lambda d: d["cases"].append(_c(d))),
    "gpu entry malformed": lambda p: _edited(_suite(p), lambda d: d["fingerprint"].update(gpus=[1])),
    "broken gzip": lambda p: (p.with_suffix(".gz").write_bytes(b"not gzip"), p.with_suffix(".gz"))[1],
    "pb: benchmarks not a list": lambda p: (p.write_text('{"machine_info": {}, "benchmarks": {}}'), p)[1],
    "pb: entry without stats": lambda p: (p.write_text('{"machine_info": {}, "benchmarks": [{"name": "t"}]}'), p)[1],
    "pb: zero median": lambda p: _pb(p, {"median": 0, "q1": 0, "q3": 0}),
    "pb: null median": lambda p: _pb(p, {"median": None, "q1": 1e-5, "q3": 1e-5}),
    "pb: null data": lambda p: _pb(p, {"median": 1e-5, "q1": 1e-5, "q3": 1e-5, "data": [None, None]}),
    "pb: data under a stale median": lambda p: _pb(p, {"median": 1e-5, "q1": 1e-5, "q3": 1e-5, "data": [2e-5] * 9}),
    "pb: q1 above the median": lambda p: _pb(p, {"median": 1e-5, "q1": 2e-5, "q3": 3e-5}),
    "pb: fingerprint not an object": lambda p: (p.write_text(json.dumps({"machine_info": {"verifybench": "x"},
                                                                          "benchmarks": []})), p)[1],
}


def _verdict(rc: int, word: str):
    def check(res):
        return res.value == rc and f"{word} 1" in res.out, f"exit {res.value}, wants {rc} with {word}"
    return check


def compare_cases(work: Path) -> list[Case]:
    d = work / "compare"
    d.mkdir()
    good = _suite(d / "good.json")
    out = []
    for i, (which, make) in enumerate(BAD_FILES.items()):
        bad = make(d / f"bad{i}.json")
        needle = str(bad) if which != "missing" else "no such file"
        out.append(cli("compare", ["compare", good, bad], needle))
        out[-1].name = f"compare GOOD <{which}>"
        out.append(cli("compare", ["compare", bad, good], needle))
        out[-1].name = f"compare <{which}> GOOD"
    rng = np.random.default_rng
    same = _suite(d / "same.json", {"x": rng(2).normal(100, 0.5, 50)})
    slow = _suite(d / "slow.json", {"x": rng(3).normal(105, 0.5, 50)})
    fast = _suite(d / "fast.json", {"x": rng(4).normal(95, 0.5, 50)})
    for name, new, rc, word in (("same", same, 0, "SAME"), ("5% slower", slow, 1, "SLOW"), ("5% faster", fast, 0,
                                                                                            "FAST")):
        out.append(cli("compare", ["compare", good, new], bad=False, check=_verdict(rc, word)))
        out[-1].name = f"compare GOOD <{name}>"
    for argv, needle in (([good, good, "--min-effect", "nan"], "--min-effect"),
                         ([good, good, "--min-effect", "inf"], "--min-effect"),
                         ([good, good, "--min-effect", "-0.1"], "--min-effect"),
                         ([good, good, "--alpha", "nan"], "--alpha"), ([good, good, "--alpha", "0"], "--alpha"),
                         ([good, good, "--alpha", "1"], "--alpha"), ([good], "new")):
        out.append(cli("compare", ["compare", *argv], needle))
    other = _edited(_suite(d / "h100.json"), lambda x: x["fingerprint"].update(gpus=[{"name": "H100"}]))
    out.append(cli("compare", ["compare", good, other], "different GPU models"))
    return out


# ------------------------------------------------------------------------------------------ arguments

def argument_cases(work: Path) -> list[Case]:
    from verifybench.harness import components

    cls = "arguments"
    out_dir = work / "args-out"
    run_args = [
        ([], "COMMAND"), (["nope"], "nope"), (["run", "--bogus"], "--bogus"), (["run", "--preset", "nope"], "nope"),
        (["run", "--preset", "kimi-k2.5"], "needs a GPU"), (["run", "--tp", "0"], "--tp"), (["run", "--tp", "-1"], "--tp"),
        (["run", "--tp", "7"], "TP 7"), (["run", "--tp", "abc"], "--tp"), (["run", "--tp", "1e3"], "--tp"),
        (["run", "--context", "0"], "--context"), (["run", "--context", "-5"], "--context"),
        (["run", "--context", "99999999"], "--context"), (["run", "--context", "1.5"], "--context"),
        (["run", "--tokens", "0"], "--tokens"), (["run", "--tokens", "1,-2"], "--tokens"),
        (["run", "--tokens", "1,1"], "--tokens"), (["run", "--tokens", "abc"], "--tokens"),
        (["run", "--tokens", "65"], "--tokens"), (["run", "--tokens", ""], "--tokens"),
        (["run", "--tokens", "8-1"], "--tokens"), (["run", "--tokens", "nan"], "--tokens"),
        (["run", "--components", "harness,harness"], "harness"), (["run", "--components", "verify,verify"], "verify"),
        (["run", "--components", ""], "--components"), (["run", "--components", "verify,,baseline"], "--components"),
        (["run", "--components", "verify,nope"], "nope"), (["run", "--components", "verify", "--tokens", "9"], "n = 1..8"),
        (["tune", "--components", "nope"], "--components"), (["tune", "--tp", "abc"], "--tp"),
        (["tune", "--budget-s", "1"], "--budget-s"), (["trace", "--tokens", "0", "x.json"], "--tokens"),
        (["trace", "/no/such/trace.json"], "no such file"), (["record", "o.json.gz", "--tokens", "0"], "--tokens"),
        (["record", "o.json.gz", "--replays", "x"], "--replays"), (["env", "extra"], "extra"),
        (["hostprobe", "--seconds", "0"], "--seconds"), (["hostprobe", "--seconds", "-1"], "--seconds"),
        (["hostprobe", "--seconds", "4000"], "--seconds"),
        (["project", "/no/such/result.json", "--copy-gbps", "100", "--allreduce-us", "10"], "no such file"),
        (["project", "x.json", "--target", "nope"], "--target"),
    ]
    out = [cli(cls, argv + (["--out", out_dir] if argv[:1] == ["run"] else []), needle) for argv, needle in run_args]
    for name in components.REGISTRY:
        for argv, needle in ((["--preset", "kimi-k2.5"], "GPU"), (["--preset", "nope"], "nope"), (["--tp", "0"], "--tp"),
                             (["--tp", "-1"], "--tp"), (["--context", "0"], "--context"),
                             (["--context", "-5"], "--context"), (["--tokens", "0"], "--tokens")):
            out.append(cli(cls, [name, *argv, "--out", out_dir], needle))
    for name, value in (("VERIFYBENCH_MAX_TIME_S", "abc"), ("VERIFYBENCH_MAX_TIME_S", "0"),
                        ("VERIFYBENCH_MAX_TIME_S", "-1"), ("VERIFYBENCH_ALLREDUCE_US", "-3"),
                        ("VERIFYBENCH_ALLREDUCE_US", "abc"), ("VERIFYBENCH_VERIFY_OPS", "fast"), ("VERIFYBENCH_PDL", "2"),
                        ("VERIFYBENCH_HOST_GATE", "maybe"), ("VERIFYBENCH_PIN_CPU", "abc"),
                        ("VERIFYBENCH_PIN_CPU", "99999"), ("VERIFYBENCH_MEMORY_CAP_GIB", "0"),
                        ("VERIFYBENCH_MEMORY_CAP_GIB", "-2"), ("VERIFYBENCH_MOE_TRACE", "/no/such/trace.json")):
        out.append(cli(cls, ["run", "--components", "baseline", "--out", out_dir], name, env={name: value}))
        out[-1].name = f"{name}={value} " + out[-1].name
    ar = ["--backend", "gloo", "--preset", "tiny", "--tokens", "1", "--warmup", "1", "--samples", "2",
          "--isolated-samples", "2", "--calls-per-sample", "1"]
    for i, (change, needle) in enumerate(((["--backend", "nope"], "nope"), (["--mode", "nope"], "nope"),
                                          (["--tokens", "0"], "--tokens"), (["--tokens", "abc"], "--tokens"),
                                          (["--samples", "0"], "--samples"), (["--samples", "-3"], "--samples"),
                                          (["--warmup", "-1"], "--warmup"), (["--isolated-samples", "0"], "--isolated"),
                                          (["--calls-per-sample", "0"], "--calls-per-sample"),
                                          (["--sizes", "7"], "16"), (["--pow2", "8:4:2"], "--pow2"),
                                          (["--preset", "nope"], "nope"), (["--tp", "0"], "--tp"),
                                          (["--hidden", "0"], "--hidden"), (["--batches", "0"], "--batches"))):
        folder = work / f"ar{i}"
        out.append(module_main(cls, "allreduce", [*ar, *change, "--out", folder, "--name", "r.json"], needle,
                               check=_refused_nothing_complete(folder, needle)))
    good = work / "ar-good"
    out.append(module_main(cls, "allreduce", [*ar, "--out", good, "--name", "r.json"], bad=False,
                           check=_complete(good), timeout_s=180))
    for change, needle in ((["--context", "0"], "--context"), (["--context", "-5"], "--context"),
                           (["--tokens", "0"], "--tokens"), (["--samples", "0"], "--samples"),
                           (["--warmup", "-1"], "--warmup"), (["--layers", "0"], "--layers"),
                           (["--preset", "nope"], "nope"), (["--allreduce", "nope"], "nope")):
        out.append(module_main(cls, "verify", ["--preset", "tiny", "--tp", "1", "--allreduce", "gloo", *change,
                                               "--out", work / "vd"], needle))
    out.append(cli(cls, ["breakeven", "--accept-len", "3.0"], bad=False, check=lambda r: (
        r.value == 0 and f"{(25.6 + 1.0 + 0.3) / 11.1:.4g}" in r.out, "tau* of the deployment's defaults")))
    return out


def _refused_nothing_complete(folder: Path, needle: str):
    def check(res):
        lines = [ln for ln in res.err.splitlines() if ln.strip() and "forced" not in ln]
        complete = [p.name for p in folder.glob("*.json") if json.loads(p.read_text())["extra"].get("complete")]
        if complete:
            return False, f"exit {res.value}; file marked complete: {complete}"
        named = bool(lines) and needle.lower() in lines[-1].lower() and "error" in lines[-1].lower()
        return res.value == 2 and named, f"exit {res.value}: {lines[-1][:200] if lines else ''}"
    return check


def _complete(folder: Path):
    def check(res):
        files = list(folder.glob("*.json"))
        ok = res.value == 0 and files and json.loads(files[0].read_text())["extra"].get("complete")
        return bool(ok), f"exit {res.value}, files {[p.name for p in files]}"
    return check


# ------------------------------------------------------------------------------------------ NaN and inf

def nan_cases(work: Path) -> list[Case]:
    cls = "nan-inf"
    out = []
    for flag in ("--accept-len", "--decode-ms", "--verify-ms", "--draft-ms", "--overhead-ms"):
        for value in ("nan", "inf", "-inf"):
            argv = ["breakeven", "--accept-len", "2.5", flag, value] if flag != "--accept-len" else \
                ["breakeven", flag, value]
            out.append(cli(cls, argv, flag))
    out.append(cli(cls, ["breakeven", "--accept-len", "2", "--decode-ms", "0"], "--decode-ms"))
    out.append(cli(cls, ["breakeven", "--accept-len", "0"], "--accept-len"))
    out.append(cli(cls, ["breakeven", "--accept-len", "1e400"], "--accept-len"))
    for flag in ("--copy-gbps", "--allreduce-us"):
        for value in ("nan", "inf", "-1"):
            other = "--allreduce-us" if flag == "--copy-gbps" else "--copy-gbps"
            out.append(cli(cls, ["project", "x.json", flag, value, other, "10"], flag))
    for flag, value in (("--seconds", "nan"), ("--seconds", "inf")):
        out.append(cli(cls, ["hostprobe", flag, value], flag))
    for value in ("nan", "inf"):
        out.append(cli(cls, ["tune", "--budget-s", value], "--budget-s"))
    for name in ("VERIFYBENCH_MAX_TIME_S", "VERIFYBENCH_ALLREDUCE_US", "VERIFYBENCH_MEMORY_CAP_GIB"):
        for value in ("nan", "inf"):
            out.append(cli(cls, ["run", "--components", "baseline", "--out", work / "nan-out"], name,
                           env={name: value}))
            out[-1].name = f"{name}={value} " + out[-1].name
    costs = ["--decode-ms", "10", "--verify-ms", "3:20,4:22", "--configs", "2,1,3;3,1,4"]
    for change, needle in ((["--accept-rates", "nan,0.5"], "--accept-rates"),
                           (["--accept-rates", "1.5,0.5"], "--accept-rates"),
                           (["--accept-len", "3:nan"], "--accept-len"), (["--accept-len", "3:inf"], "--accept-len"),
                           (["--accept-len", "3:0.5"], "--accept-len")):
        out.append(cli(cls, ["plan", *costs, *change], needle))
    acc = ["--accept-len", "3:2.0,4:2.4"]
    for change, needle in ((["--decode-ms", "inf"], "--decode-ms"), (["--decode-ms", "nan"], "--decode-ms"),
                           (["--verify-ms", "3:nan,4:22"], "--verify-ms"), (["--verify-ms", "3:inf,4:22"], "--verify-ms"),
                           (["--verify-ms", "3:0,4:22"], "--verify-ms"), (["--draft-ms", "nan"], "--draft-ms"),
                           (["--other-ms", "inf"], "--other-ms")):
        out.append(cli(cls, ["plan", *costs, *acc, *change], needle))
    out.append(cli(cls, ["plan", *costs, *acc], bad=False, check=lambda r: (
        r.value == 0 and "best: (3,1,4)" in r.out, "the 4-token config wins at these numbers")))
    return out


# ------------------------------------------------------------------------------------------ output

def _no_temp(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] if folder.is_dir() else []


def output_cases(work: Path) -> list[Case]:
    cls = "output"
    blocker = work / "a-file"
    blocker.write_text("x")
    long_name = work / ("x" * 300)
    out = []
    for target, needle in ((blocker, "not writable"), (blocker / "sub", "not writable"),
                           (Path("/proc/verifybench/out"), "not writable"), (long_name, "not writable")):
        for cmd in (["run"], ["baseline"], ["verify"]):
            out.append(cli(cls, [*cmd, "--out", target], needle, env=FAST))
    out.append(cli(cls, ["hostprobe", "--seconds", "0.2", "--json", "/proc/verifybench/x.json"], "not writable"))
    out.append(cli(cls, ["hostprobe", "--seconds", "0.2", "--json", blocker / "x.json"], str(blocker)))
    for target in (blocker / "sub", Path("/proc/verifybench/ar")):
        out.append(module_main(cls, "allreduce", ["--backend", "gloo", "--preset", "tiny", "--tokens", "1",
                                                  "--samples", "2", "--warmup", "1", "--isolated-samples", "2",
                                                  "--calls-per-sample", "1", "--out", target], "not writable",
                               timeout_s=120))
        out.append(module_main(cls, "verify", ["--preset", "tiny", "--tp", "1", "--allreduce", "gloo", "--tokens", "1",
                                               "--samples", "1", "--warmup", "1", "--out", target], "not writable",
                               timeout_s=120))

    def raises_oserror_without_temp(folder):
        def check(res):
            return (res.kind == "raise" and res.exc_type.endswith("Error") and not _no_temp(folder),
                    f"{res.kind} {res.exc_type}: {res.message[:150]}; temps {_no_temp(folder)}")
        return check

    def write_into(path):
        def fn():
            from verifybench.harness.engine import results
            results.write_json_atomic(path, {"a": 1})
        return fn

    out.append(api(cls, "write_json_atomic under a file", write_into(blocker / "x.json"),
                   check=raises_oserror_without_temp(work)))
    out.append(api(cls, "write_json_atomic into /proc", write_into(Path("/proc/verifybench/x.json")),
                   check=lambda r: (r.kind == "raise" and "Error" in r.exc_type, f"{r.exc_type}: {r.message[:150]}")))
    fail_dir = work / "fail"
    fail_dir.mkdir()

    def failing_writer():
        from verifybench.harness.engine import results

        def write(f):
            f.write(b"half")
            raise OSError(28, "No space left on device")
        results.write_atomic(fail_dir / "r.json", write)

    out.append(api(cls, "a write that fails midway (ENOSPC) leaves no temp file", failing_writer,
                   check=raises_oserror_without_temp(fail_dir)))
    killed_dir = work / "killed"
    killed_dir.mkdir()

    def killed_then_rewritten():
        from verifybench.harness.engine import results
        pid = os.fork()
        if pid == 0:
            results.write_atomic(killed_dir / "r.json", lambda f: (f.write(b"half"), os.kill(os.getpid(),
                                                                                            signal.SIGKILL)))
            os._exit(0)
        os.waitpid(pid, 0)
        left = _no_temp(killed_dir)
        results.write_json_atomic(killed_dir / "r.json", {"a": 1})
        return left, _no_temp(killed_dir)

    out.append(api(cls, "a writer SIGKILLed mid-write: the next write of that name removes its temp file",
                   killed_then_rewritten, bad=False, check=lambda r: (
                       r.kind == "return" and r.value[0] and not r.value[1], f"before/after: {r.value}")))

    def mode_under_umask(path_fn):
        def fn():
            old = os.umask(0o077)
            try:
                path = path_fn()
            finally:
                os.umask(old)
            return stat.S_IMODE(os.stat(path).st_mode)
        return fn

    def results_write():
        from verifybench.harness.engine import results
        return results.write_json_atomic(work / "mode" / "r.json", {"a": 1})

    def table_write():
        from verifybench.kernels import config_tables
        return config_tables.save({"a": {}}, work / "tables" / "t.json")

    for name, fn in (("result file", results_write), ("config table", table_write)):
        out.append(api(cls, f"{name} written under umask 077 is group-readable", mode_under_umask(fn), bad=False,
                       check=lambda r: (r.kind == "return" and r.value & 0o040 and r.value & 0o400,
                                        f"mode {oct(r.value) if isinstance(r.value, int) else r.value}")))
    tdir = work / "tables-killed"
    tdir.mkdir()

    def table_killed_then_saved():
        from verifybench.kernels import config_tables
        pid = os.fork()
        if pid == 0:
            import json as _json
            _json.dumps = lambda *a, **k: (os.kill(os.getpid(), signal.SIGKILL), "")[1]
            config_tables.save({"a": {}}, tdir / "t.json")
            os._exit(0)
        os.waitpid(pid, 0)
        left = _no_temp(tdir)
        config_tables.save({"a": {}}, tdir / "t.json")
        return left, _no_temp(tdir)

    out.append(api(cls, "config table: a save SIGKILLed midway leaves no temp file after the next save",
                   table_killed_then_saved, bad=False,
                   check=lambda r: (r.kind == "return" and not r.value[1], f"before/after: {r.value}")))

    def gz_round_trip():
        from verifybench.harness.engine import results
        p = results.write_json_atomic(work / "g" / "r.json.gz", {"a": [1.0, float("nan")]})
        return json.loads(gzip.open(p, "rt").read())

    out.append(api(cls, "gzip result with a NaN stores null", gz_round_trip, bad=False,
                   check=lambda r: (r.value == {"a": [1.0, None]}, str(r.value))))
    return out


# ------------------------------------------------------------------------------------------ tree API

def tree_cases() -> list[Case]:
    cls = "tree-api"
    out = []

    def tree_call(backend, change, **extra):
        def fn():
            import torch
            from verifybench.kernels import tree
            from verifybench.kernels.tree_inputs import random_tree
            inp = {**random_tree(2, 2, 3, 6, 50, seed=0, context=40), "mask_mode": "qlen_only"}
            key, new = change
            if key:
                inp[key] = new(inp[key]) if callable(new) else new
            inp.update(extra)
            got = tree.build_tree(**inp, backend=backend)
            return [t.shape for t in got] if isinstance(got, tuple) else got
        return fn

    def dup(t):
        t = t.clone()
        t[0, 1] = t[0, 0]
        return t

    def unsorted(t):  # request 0 only
        t = t.clone()
        t[0] = t[0].flip(0)
        return t

    import torch
    build = {
        "top_scores_index float": ("top_scores_index", lambda t: t.float(), "top_scores_index"),
        "parent_list float": ("parent_list", lambda t: t.float(), "parent_list"),
        "seq_lens float": ("seq_lens", lambda t: t.float(), "seq_lens"),
        "verified_id float": ("verified_id", lambda t: t.float(), "verified_id"),
        "draft_tokens float": ("draft_tokens", lambda t: t.float(), "draft_tokens"),
        "verified_id 2-D": ("verified_id", lambda t: t.view(2, 1), "verified_id"),
        "seq_lens short": ("seq_lens", lambda t: t[:1], "seq_lens"),
        "parent_list narrow": ("parent_list", lambda t: t[:, :2], "parent_list"),
        "topk float": ("topk", 2.0, "topk"), "topk 0": ("topk", 0, "topk"), "spec_steps 0": ("spec_steps", 0,
                                                                                            "spec_steps"),
        "one node": ("num_verify_tokens", 1, "num_verify_tokens"),
        "more nodes than candidates": ("num_verify_tokens", 12, "num_verify_tokens"),
        "seq_lens_sum negative": ("seq_lens_sum", -1, "seq_lens_sum"),
        "mask_mode unknown": ("mask_mode", "fulll", "mask_mode"),
        "duplicate top_scores_index": ("top_scores_index", dup, "top_scores_index"),
        "unsorted top_scores_index": ("top_scores_index", unsorted, "top_scores_index"),
        "top_scores_index out of range": ("top_scores_index", lambda t: t + 100, "top_scores_index"),
        "flags short": ("flags", torch.zeros(1, dtype=torch.int32), "flags"),
    }
    for backend in ("reference", "kernel"):
        for name, (key, change, needle) in build.items():
            if key in ("seq_lens_sum", "flags"):
                fn = tree_call(backend, (None, None), **{key: change})
            else:
                fn = tree_call(backend, (key, change))
            out.append(api(cls, f"build_tree[{backend}] {name}", fn, needle))

        if backend == "kernel":
            for name, change, bit in (("duplicate", dup, "FLAG_UNSORTED"), ("unsorted", unsorted, "FLAG_UNSORTED")):
                def flagged(change=change, bit=bit):
                    from verifybench.kernels import tree
                    flags = torch.zeros(2, dtype=torch.int32)
                    tree_call("kernel", ("top_scores_index", change), flags=flags)()
                    return [bool(f & getattr(tree, bit)) for f in flags.tolist()]
                out.append(api(cls, f"build_tree[kernel] {name} top_scores_index with flags: flagged", flagged,
                               bad=False, check=lambda r: (r.value == [True, False], f"flagged rows: {r.value}")))

        def wrong_sum(backend=backend):
            import torch  # noqa: F401
            from verifybench.kernels import tree
            from verifybench.kernels.tree_inputs import random_tree
            inp = random_tree(2, 2, 3, 6, 50, seed=0, context=40)
            return tree.build_tree(**inp, mask_mode="full", backend=backend, seq_lens_sum=int(inp["seq_lens"].sum()) + 1)
        out.append(api(cls, f"build_tree[{backend}] seq_lens_sum disagrees with seq_lens", wrong_sum, "seq_lens_sum"))

        def organize(change, backend=backend, **kw):
            def fn():
                from verifybench.kernels import tree
                from verifybench.kernels.tree_inputs import random_draft
                s, t, p = random_draft(2, 2, 3, 50)
                s, t, p, d = change(s, t, p, 6)
                return [x.shape for x in tree.organize_draft_results(s, t, p, d, backend=backend, **kw)]
            return fn

        def nan_scores(s, t, p, d):
            s[1][1, 1, 0] = float("nan")
            return s, t, p, d

        for name, change, needle in (
                ("empty lists", lambda s, t, p, d: ([], [], [], d), "lists"),
                ("lists of unequal length", lambda s, t, p, d: (s, t[:2], p, d), "token_list"),
                ("topk 0", lambda s, t, p, d: ([x[..., :0] for x in s], t, p, d), "topk"),
                ("float tokens", lambda s, t, p, d: (s, [x.float() for x in t], p, d), "token_list"),
                ("integer scores", lambda s, t, p, d: ([(x * 100).long() for x in s], t, p, d), "score_list"),
                ("float parents", lambda s, t, p, d: (s, t, [x.float() for x in p], d), "parents_list"),
                ("batch mismatch", lambda s, t, p, d: (s, [t[0][:1]] + t[1:], p, d), "token_list"),
                ("num_verify_tokens 1", lambda s, t, p, d: (s, t, p, 1), "num_verify_tokens"),
                ("more nodes than candidates", lambda s, t, p, d: (s, t, p, 12), "num_verify_tokens"),
                ("NaN draft score, no flags", nan_scores, "NaN")):
            out.append(api(cls, f"organize[{backend}] {name}", organize(change), needle))

        def verify_call(pos, change, backend=backend):
            def fn():
                import torch
                from verifybench.kernels import tree
                from verifybench.kernels.tree_inputs import random_tree
                _, _, index, nxt, sib, tokens = tree.build_tree(**random_tree(2, 2, 3, 6, 50, seed=0, context=40),
                                                                mask_mode="qlen_only", backend="reference")
                args = [tokens.view(2, 6), index, nxt, sib, torch.zeros(12, dtype=torch.int64), 4]
                args[pos] = change(args[pos]) if callable(change) else change
                return [x.shape for x in tree.verify_tree_greedy(*args, backend=backend)]
            return fn

        for name, pos, change, needle in (("candidates float", 0, lambda t: t.float(), "candidates"),
                                          ("candidates 1-D", 0, lambda t: t.flatten(), "candidates"),
                                          ("retrieve_index float", 1, lambda t: t.float(), "retrieve_index"),
                                          ("retrieve_next_sibling short", 3, lambda t: t[:, :5], "retrieve_next_sibling"),
                                          ("target_predict float", 4, lambda t: t.float() + 0.5, "target_predict"),
                                          ("target_predict short", 4, lambda t: t[:11], "target_predict"),
                                          ("num_spec_steps 0", 5, 0, "num_spec_steps")):
            out.append(api(cls, f"verify_tree_greedy[{backend}] {name}", verify_call(pos, change), needle))

        def argmax_call(logits_fn, backend=backend):
            def fn():
                from verifybench.kernels import tree
                return tree.argmax(logits_fn(), backend=backend).shape
            return fn

        out.append(api(cls, f"argmax[{backend}] vocab 0", argmax_call(lambda: torch.zeros(3, 0)), "vocab"))
        out.append(api(cls, f"argmax[{backend}] integer logits",
                       argmax_call(lambda: torch.zeros(3, 5, dtype=torch.int32)), "logits"))
    return out


# ------------------------------------------------------------------------------------------ MoE API

def moe_cases() -> list[Case]:
    cls = "moe-api"
    out = []

    def m(name, call, needle="", **kw):
        def fn():
            from verifybench.kernels import moe_int4 as moe
            return call(moe)
        out.append(api(cls, name, fn, needle, **kw))

    import torch

    def one_nan(shape, pos):
        def make():
            w = torch.randn(*shape)
            w[pos] = float("nan")
            return w
        return make

    m("quantize_w4a16 with one NaN weight", lambda moe: moe.quantize_w4a16(one_nan((3, 4, 64), (1, 2, 37))())[1].shape,
      "non-finite")
    m("quantize_w4a16 with one inf weight", lambda moe: moe.quantize_w4a16(one_nan((4, 32), (3, 5))().nan_to_num(
        posinf=1.0, neginf=-1.0, nan=float("inf")))[1].shape, "non-finite")
    m("quantize_w4a16 group 0", lambda moe: moe.quantize_w4a16(torch.randn(4, 32), group_size=0), "group_size")
    m("quantize_w4a16 group does not divide", lambda moe: moe.quantize_w4a16(torch.randn(4, 40), group_size=32),
      "group")
    for args, needle in (((1, 8, 16), "topk"), ((3, 8, 0), "topk"), ((-1, 8, 4), "n"), ((1, 0, 4), "num_experts"),
                         ((1.5, 8, 2), "n"), ((2, 8, float("nan")), "topk")):
        m(f"expected_distinct_experts{args}", lambda moe, a=args: moe.expected_distinct_experts(*a), needle)
    m("expected_distinct_experts stays within [0, E]", lambda moe: max(
        moe.expected_distinct_experts(n, e, k) / e for e in (1, 8, 384) for k in {1, min(8, e), e} for n in range(40)),
      bad=False, check=lambda r: (r.kind == "return" and r.value <= 1.0, f"max value / E = {r.value}"))

    def dense(pos, change):
        def call(moe):
            torch.manual_seed(0)
            x = torch.randn(3, 64)
            tw, ids = moe.route_uniform(3, 4, 2, seed=0)
            args = [x, torch.randn(4, 64, 64), torch.randn(4, 64, 32), tw, ids]
            args[pos] = change(args[pos])
            return moe.moe_dense_torch(*args).shape
        return call

    for name, pos, change, needle in (("ids float", 4, lambda t: t.float() + 0.5, "topk_ids"),
                                      ("ids out of range", 4, lambda t: t + 4, "out of range"),
                                      ("ids negative", 4, lambda t: t - 4, "out of range"),
                                      ("topk 0", 4, lambda t: t[:, :0], "topk"),
                                      ("weights shape", 3, lambda t: t[:, :1], "topk_weights"),
                                      ("w2 shape", 2, lambda t: t[:, :-1], "w2"),
                                      ("x int", 0, lambda t: t.int(), "x")):
        m(f"moe_dense_torch {name}", dense(pos, change), needle)

    def nan_token(moe):
        torch.manual_seed(0)
        x = torch.randn(3, 64)
        x[0, 5] = float("nan")
        tw, ids = moe.route_uniform(3, 4, 2, seed=0)
        y = moe.moe_dense_torch(x, torch.randn(4, 64, 64), torch.randn(4, 64, 32), tw, ids)
        return [bool(torch.isfinite(row).all()) for row in y]

    m("moe_dense_torch: a NaN activation stays in its own token", nan_token, bad=False,
      check=lambda r: (r.value == [False, True, True], f"finite rows: {r.value}"))
    ids = torch.tensor([[1, 2], [2, 1], [5, 1]])
    for name, call, needle in (
            ("route_uniform m -1", lambda moe: moe.route_uniform(-1, 8, 2), "m"),
            ("route_uniform topk > E", lambda moe: moe.route_uniform(4, 8, 9), "topk"),
            ("route_uniform topk 0", lambda moe: moe.route_uniform(4, 8, 0), "topk"),
            ("route_skewed hot_factor 0", lambda moe: moe.route_skewed(4, 8, 2, hot_factor=0), "hot_factor"),
            ("route_skewed hot_factor nan", lambda moe: moe.route_skewed(4, 8, 2, hot_factor=float("nan")), "hot_factor"),
            ("route_skewed hot_experts 9", lambda moe: moe.route_skewed(4, 8, 2, hot_experts=9), "hot_experts"),
            ("trace_windows float trace", lambda moe: moe.trace_windows(ids.float(), 1, 2), "trace"),
            ("trace_windows m 0", lambda moe: moe.trace_windows(ids, 0, 2), "m"),
            ("trace_windows count 0", lambda moe: moe.trace_windows(ids, 1, 0), "count"),
            ("moe_bytes float ids", lambda moe: moe.moe_bytes(ids.float(), 64, 100), "topk_ids"),
            ("moe_bytes 1-D ids", lambda moe: moe.moe_bytes(ids[0], 64, 100), "topk_ids"),
            ("expert_bytes_int4 group 0", lambda moe: moe.expert_bytes_int4(64, 32, 0), "group_size"),
            ("expert_bytes_int4 group 12", lambda moe: moe.expert_bytes_int4(64, 32, 12), "8"),
            ("load_routing_trace missing", lambda moe: moe.load_routing_trace("/no/such/trace.json"), "trace")):
        m(name, call, needle)
    return out


# ------------------------------------------------------------------------------------------ rank faults

def _ranks(tag: str) -> dict[int, tuple[int, dict]]:
    """rank -> (pid, environment) of the job's live workers: the tests' own finder (tests/torchrun_jobs.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from torchrun_jobs import rank_processes

    return rank_processes(tag)


def _step(env: dict, rank: int) -> str:
    from datetime import timedelta

    import torch.distributed as dist
    try:
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timedelta(seconds=5),
                              wait_for_workers=False)
        run_id = f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        s = dist.PrefixStore(f"verifybench/{run_id}/", store)
        key = f"progress/{rank}"
        return json.loads(s.get(key))["label"] if s.check([key]) else ""
    except Exception:
        return ""


def torchrun_case(work: Path, name: str, world: int, faulty: int, how: str, hang_timeout_s: float,
                  extra: tuple = ()) -> Case:
    """A real torchrun job of `world` gloo ranks; `how`: a signal name sent to rank `faulty` once it is in the timed
    loop, or 'inject' (the job's own --fault). Right: non-zero within hang timeout + 10 s of the fault, torchrun's
    root cause is the faulty rank, no healthy rank blamed, nothing marked complete."""
    margin_s = 10.0

    def runner(_timeout_s):
        folder = work / f"tr-{uuid.uuid4().hex[:6]}"
        tag = f"probe-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
               "verifybench.harness.multigpu.allreduce", "--backend", "gloo", "--preset", "tiny", "--tokens", "1",
               "--mode", "eager", "--warmup", "2", "--samples", "3000", "--calls-per-sample", "3", "--hang-timeout",
               str(hang_timeout_s), "--out", str(folder), "--name", "r.json", *extra, "--run-tag", tag]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        victim, fault_at = None, t0
        try:
            if how != "inject":
                while time.monotonic() - t0 < 240 and proc.poll() is None and victim is None:
                    ranks = _ranks(tag)
                    if faulty in ranks and ": eager" in _step(ranks[faulty][1], faulty):
                        victim = ranks[faulty][0]
                    time.sleep(0.2)
                if victim is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    out = proc.communicate()[0]
                    return Result("return", {"error": "never reached the loop", "out": out[-2000:]})
                time.sleep(0.3)
                os.kill(victim, getattr(signal, how))
                fault_at = time.monotonic()
            try:
                out = proc.communicate(timeout=hang_timeout_s + margin_s + (240 if how == "inject" else 30))[0]
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out = proc.communicate()[0]
                return Result("timeout", out=out[-3000:], wall_s=time.monotonic() - t0)
            ended_s = time.monotonic() - fault_at
            root = re.search(r"Root Cause \(first observed failure\):\s*\[0\]:.*?rank\s*:\s*(\d+)", out, re.S)
            complete = [p.name for p in folder.glob("*.json") if json.loads(p.read_text())["extra"].get("complete")]
            blamed = re.findall(rf"rank (?!{faulty}\b)\d+: failed|root cause: rank (?!{faulty}\b)\d+", out)
            return Result("return", {"rc": proc.returncode, "ended_s": round(ended_s, 1),
                                     "root_cause": int(root.group(1)) if root else None, "complete": complete,
                                     "healthy_blamed": blamed[:3], "out": out[-1500:]},
                          wall_s=time.monotonic() - t0)
        finally:
            if victim:
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()

    def check(res):
        v = res.value
        if not isinstance(v, dict) or "rc" not in v:
            return False, str(v)[:300]
        facts = {k: v[k] for k in ("rc", "ended_s", "root_cause", "complete", "healthy_blamed")}
        if v["rc"] == 0 or v["complete"] or v["root_cause"] != faulty or v["healthy_blamed"]:
            return False, f"{facts}"
        if how != "inject" and v["ended_s"] > hang_timeout_s + margin_s:
            return "hang", f"ended {v['ended_s']} s after the fault, past {hang_timeout_s} + {margin_s}: {facts}"
        return True, f"{facts}"

    return Case("rank-faults", name, bad=False, check=check, runner=runner)


def rank_fault_cases(work: Path, torchrun: bool) -> list[Case]:
    out = []
    if torchrun:
        out += [torchrun_case(work, "SIGKILL rank 1 of 2 mid-collective", 2, 1, "SIGKILL", 10.0),
                torchrun_case(work, "SIGSTOP rank 1 of 2 mid-collective", 2, 1, "SIGSTOP", 10.0),
                torchrun_case(work, "SIGKILL rank 3 of 4 mid-collective", 4, 3, "SIGKILL", 10.0),
                torchrun_case(work, "rank 1 of 2 exits early (injected)", 2, 1, "inject", 10.0,
                              ("--fault", "exit-early:1@0"))]
    for value in ("nan", "-1", "0", "inf", "-inf", "abc", "0.01"):
        for module in ("allreduce", "verify"):
            argv = ["--preset", "tiny", "--hang-timeout", value]
            argv += ["--backend", "gloo"] if module == "allreduce" else ["--tp", "1", "--allreduce", "gloo"]
            out.append(module_main("rank-faults", module, [*argv, "--out", work / "ht"], "--hang-timeout"))
    return out


def subprocess_cases(work: Path) -> list[Case]:
    """Two inputs through a real `python3 -m verifybench.harness.cli` process (exit code across the boundary)."""
    def real(argv, needle):
        def runner(timeout_s):
            t0 = time.monotonic()
            try:
                r = subprocess.run([sys.executable, "-m", "verifybench.harness.cli", *map(str, argv)], cwd=work,
                                   capture_output=True, text=True, timeout=max(timeout_s, 180))
            except subprocess.TimeoutExpired:
                return Result("timeout", wall_s=time.monotonic() - t0)
            return Result("return", r.returncode, out=r.stdout, err=r.stderr, wall_s=time.monotonic() - t0)
        c = Case("arguments", "subprocess: verifybench " + " ".join(map(str, argv)), needle=needle, cli=True,
                 runner=runner)
        return c

    return [real(["run", "--context", "0"], "--context"), real(["verify", "--tp", "7"], "TP 7")]


def all_cases(work: Path, torchrun: bool = True) -> list[Case]:
    return (argument_cases(work) + compare_cases(work) + nan_cases(work) + output_cases(work) + tree_cases()
            + moe_cases() + subprocess_cases(work) + rank_fault_cases(work, torchrun))
