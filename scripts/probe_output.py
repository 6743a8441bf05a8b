"""Probes of the writes: unwritable --out targets, a write that fails or is killed midway, file modes, gzip."""
from __future__ import annotations

import gzip
import json
import os
import signal
import stat
from pathlib import Path

from probe_base import FAST, Case, api, cli, module_main


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
            from verifybench.harness.measure.results import store
            store.write_json_atomic(path, {"a": 1})
        return fn

    out.append(api(cls, "write_json_atomic under a file", write_into(blocker / "x.json"),
                   check=raises_oserror_without_temp(work)))
    out.append(api(cls, "write_json_atomic into /proc", write_into(Path("/proc/verifybench/x.json")),
                   check=lambda r: (r.kind == "raise" and "Error" in r.exc_type, f"{r.exc_type}: {r.message[:150]}")))
    fail_dir = work / "fail"
    fail_dir.mkdir()

    def failing_writer():
        from verifybench.harness.measure.results import store

        def write(f):
            f.write(b"half")
            raise OSError(28, "No space left on device")
        store.write_atomic(fail_dir / "r.json", write)

    out.append(api(cls, "a write that fails midway (ENOSPC) leaves no temp file", failing_writer,
                   check=raises_oserror_without_temp(fail_dir)))
    killed_dir = work / "killed"
    killed_dir.mkdir()

    def killed_then_rewritten():
        from verifybench.harness.measure.results import store
        pid = os.fork()
        if pid == 0:
            store.write_atomic(killed_dir / "r.json", lambda f: (f.write(b"half"), os.kill(os.getpid(),
                                                                                            signal.SIGKILL)))
            os._exit(0)
        os.waitpid(pid, 0)
        left = _no_temp(killed_dir)
        store.write_json_atomic(killed_dir / "r.json", {"a": 1})
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
        from verifybench.harness.measure.results import store
        return store.write_json_atomic(work / "mode" / "r.json", {"a": 1})

    def table_write():
        from verifybench.kernels.common import config_tables
        return config_tables.save({"a": {}}, work / "tables" / "t.json")

    for name, fn in (("result file", results_write), ("config table", table_write)):
        out.append(api(cls, f"{name} written under umask 077 is group-readable", mode_under_umask(fn), bad=False,
                       check=lambda r: (r.kind == "return" and r.value & 0o040 and r.value & 0o400,
                                        f"mode {oct(r.value) if isinstance(r.value, int) else r.value}")))
    tdir = work / "tables-killed"
    tdir.mkdir()

    def table_killed_then_saved():
        from verifybench.kernels.common import config_tables
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
        from verifybench.harness.measure.results import store
        p = store.write_json_atomic(work / "g" / "r.json.gz", {"a": [1.0, float("nan")]})
        return json.loads(gzip.open(p, "rt").read())

    out.append(api(cls, "gzip result with a NaN stores null", gz_round_trip, bad=False,
                   check=lambda r: (r.value == {"a": [1.0, None]}, str(r.value))))
    return out
