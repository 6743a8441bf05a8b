"""Probes of the command line: every command's options and environment variables, out of range, malformed, NaN
and inf, through the CLI in this process and through a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from probe_base import Case, Result, cli, module_main


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
        r.value == 0 and f"{(25.6 + 1.0 + 0.4) / 11.1:.4g}" in r.out, "tau* of the deployment's defaults")))
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
