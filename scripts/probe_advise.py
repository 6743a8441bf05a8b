"""Probes of advise and results folders, the list arguments (tokens, batches, contexts, configs) of every command and
torchrun job, plan's inputs, limits on numbers and the environment, the tree kernels' edges, and signals and full
disks through a real process: the classes added to the probe set last.

Each is written to pass once its fault is fixed: a bad input refused in one line naming it (exit 2), or a valid one
answered with what it asks (a check on the output).
"""
from __future__ import annotations

import copy
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from probe_base import REPO, Case, Result, api, cli, module_main

H200 = REPO / "results" / "baselines" / "nvidia-h200-x1"
H100 = REPO / "results" / "baselines" / "nvidia-h100-80gb-hbm3-x1"
TRACE_SUMMARY = {"schema": "verifybench.trace", "schema_version": 1, "per_cycle_us": {"gpu_idle": 400.0}}


def _cycle() -> dict:
    return json.loads((H200 / "cycle.json").read_text())


def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _says(*needles, rc: int = 0):
    """A check: exit `rc` and every needle in stdout, no traceback."""
    def check(res):
        ok = res.value == rc and "Traceback" not in res.err and all(n in res.out for n in needles)
        return ok, f"exit {res.value}: {'found' if ok else 'missing'} {needles}"
    return check


def _noted(*needles):
    """A check: exit 0, one line on stderr holding every needle, no traceback."""
    def check(res):
        lines = [line for line in res.err.splitlines() if line.strip()]
        ok = res.value == 0 and len(lines) == 1 and all(n in lines[0] for n in needles)
        return ok, f"exit {res.value}: {'noted' if ok else 'not noted'} {needles}"
    return check


def advise_cases(work: Path) -> list[Case]:
    cls, d = "advise", work / "advise"
    d.mkdir()
    out = [cli(cls, ["advise", H200, "--accept-len", a], bad=False, check=_says("3:TAU"))
           for a in ("6:3.1", "5,4,8:3.3")]
    out += [cli(cls, ["advise", H200, "--accept-len", "7:3"], "7 matches no shape"),
            cli(cls, ["advise", H200, "--accept-len", ""], "--accept-len"),
            cli(cls, ["advise", H200, "--accept-rates", ""], "--accept-rates"),
            cli(cls, ["advise", H200, H100], "different GPU models"),
            cli(cls, ["advise", H200, "--nccl-from", H200 / "cycle.json"], "cycle")]
    both = d / "both"  # two GPU models in one folder
    _write(both / "cycle.json", _cycle())
    (both / "verify.json.gz").write_bytes((H100 / "verify.json.gz").read_bytes())
    out.append(cli(cls, ["advise", both], "different GPU models"))
    for name, edit, needle in (
            ("no-decode-ms", lambda r: r["cases"][0]["derived"].pop("decode_ms"), "decode_ms"),
            ("verify-as-cycle", lambda r: r.update(component="verify"), "'verify' result"),
            ("all-failed", lambda r: [c["check"].update(ok=False) for c in r["cases"]], None),
            ("only-516", lambda r: r.update(cases=[c for c in r["cases"] if c["params"]["draft_tokens"] == 6]),
             None)):
        run = _cycle()
        edit(run)
        folder = d / name
        _write(folder / "cycle.json", run)
        if name == "no-decode-ms":  # the one reader leaves the case out, in one line naming the case and field
            out.append(cli(cls, ["advise", folder], bad=False, check=_noted("left out", "derived.decode_ms")))
        elif needle:
            out.append(cli(cls, ["advise", folder], needle))
        elif name == "all-failed":
            out.append(cli(cls, ["advise", folder], bad=False, check=_says("every check failed")))
        else:
            out.append(cli(cls, ["advise", folder], bad=False, check=_says("against the cycle at (5, 1, 6)")))
        out[-1].name = f"advise <folder: cycle {name}>"
    dvt = d / "dvt"
    _write(dvt / "cycle.json", _cycle())
    _write(dvt / "defaults_vs_tuned.json", {})
    out.append(cli(cls, ["advise", dvt], "defaults_vs_tuned"))
    out[-1].name = "advise <folder: defaults_vs_tuned {}>"
    for name in ("trace-summary.json", "cycle.json", "summary-of-mine.json"):
        s = _write(d / "summaries" / name, TRACE_SUMMARY)
        out.append(cli(cls, ["advise", H200 / "cycle.json", s], bad=False, check=_says("host gaps: hide the GPU idle")))
    s = _write(d / "no-per-cycle.json", {**TRACE_SUMMARY, "per_cycle_us": {}})
    out.append(cli(cls, ["advise", H200 / "cycle.json", s], bad=False, check=_says("holds no per_cycle_us.gpu_idle")))
    mine = _write(d / "my-cycle.json", _cycle())
    out.append(cli(cls, ["advise", mine], bad=False, check=_says("verify attention: extend -> split_kv")))

    def piped():
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(r)
            os.write(w, (H200 / "cycle.json").read_bytes())
            os._exit(0)
        os.close(w)
        from verifybench.harness.cli import main
        return main(["advise", f"/dev/fd/{r}"])
    out.append(Case(cls, "advise <(cat cycle.json)", piped, bad=False, cli=True,
                    check=_says("verify attention: extend -> split_kv")))
    return out


def list_cases(work: Path) -> list[Case]:
    cls, d = "lists", work / "lists"
    out = [cli(cls, ["cycle", "--contexts", t, "--out", d], "--contexts")
           for t in ("1_0", "32,,64", "64,", ",", "1000000000000", "1-4", "64,64", "0")]
    out += [cli(cls, ["cycle", o, "", "--out", d], o) for o in ("--attention", "--configs")]
    out += [cli(cls, ["cycle", "--configs", "99999999999999999999,1,3", "--out", d], "--configs"),
            cli(cls, ["baseline", "--tokens", "5", "--out", d], "--tokens"),
            cli(cls, ["record", d / "t.json.gz", "--tokens", "9"], "--tokens"),
            cli(cls, ["record", d / "t.json.gz", "--tokens", "1,2"], "--tokens"),
            cli(cls, ["record", d / "t.json.gz", "--context", "2000000"], "--context"),
            cli(cls, ["run", "--tokens", "1,,2", "--out", d], "--tokens")]
    for module, argv in (("allreduce", ["--tokens", "2,2"]), ("allreduce", ["--tokens", "1_0"]),
                         ("allreduce", ["--batches", ""]), ("allreduce", ["--batches", "0"]),
                         ("verify", ["--tokens", "1,,2"]), ("verify", ["--context", "2000000"])):
        out.append(module_main(cls, module, [*argv, "--out", d / module], argv[0]))
    multi = _cycle()
    cases = []
    for ctx in (1024, 4096):
        for c in copy.deepcopy(multi["cases"]):
            c["params"]["context"], c["name"] = ctx, f"{c['name']}/ctx{ctx}"
            cases.append(c)
    multi["cases"] = cases
    path = _write(d / "contexts" / "cycle-20261205T000000Z.json", multi)
    out += [cli(cls, ["plan", path, "--accept-len", "3:2.4"], "--context"),
            cli(cls, ["plan", path, "--accept-len", "3:2.4,6:3.1", "--context", "1024"], bad=False,
                check=_says("best:")),
            cli(cls, ["plan", path, "--accept-len", "3:2.4", "--context", "2048"], "--context")]
    empty = _write(d / "empty" / "cycle-20261205T000000Z.json", {**_cycle(), "cases": []})
    out.append(Case(cls, "plan <cycle result without cases>", cli=True, needle="no passing case",
                    fn=cli(cls, ["plan", empty, "--accept-len", "3:2"]).fn,
                    check=lambda r: (r.value == 2 and "RuntimeWarning" not in r.err and "no passing case" in r.err,
                                     f"exit {r.value}: {r.err.strip()[-160:]}")))
    return out


def limit_cases(work: Path) -> list[Case]:
    cls, d = "limits", work / "limits"
    out = [cli(cls, ["run", "--preset", p, "--out", d], "unknown preset") for p in ("bogus", "", "TINY")]
    out += [cli(cls, ["plan", "--configs", "300000000,1,300000001", "--decode-ms", "20", "--verify-ms", "3:25",
                      "--accept-rates", "0.8"], "--configs"),
            cli(cls, ["plan", "--decode-ms", "1e308", "--verify-ms", "3:25", "--accept-len", "3:2"], "--decode-ms"),
            cli(cls, ["plan", "--decode-ms", "20", "--verify-ms", "3:1e308", "--accept-len", "3:2"], "--verify-ms"),
            cli(cls, ["project", H200 / "verify.json", "--allreduce-us", "1e308", "--copy-gbps", "3000"],
                "--allreduce-us"),
            cli(cls, ["project", H200 / "verify.json", "--allreduce-us", "10", "--copy-gbps", "1e308"], "--copy-gbps"),
            cli(cls, ["baseline", "--out", d], "VERIFYBENCH_CONFIG_TABLES",
                env={"VERIFYBENCH_CONFIG_TABLES": "bogus"})]
    bad_version = _write(d / "cycle.json", {**_cycle(), "method_version": "2"})
    out.append(cli(cls, ["compare", H200 / "cycle.json", bad_version], "method_version"))

    def one_allreduce():
        from verifybench.harness.answers import trace_against
        return trace_against._layers({"per_cycle_calls": {"allreduce": 1.0}}, 61, None, "t")[1]
    out.append(api(cls, "trace --against <one allreduce kernel per cycle>", one_allreduce, bad=False,
                   check=lambda r: ("1 allreduce kernel per cycle" in str(r.value), str(r.value))))

    def kv_tree_off():
        from verifybench.harness.components import kv_tree
        from verifybench.harness.measure.timing.runner import CaseSkipped
        spec = next(s for s in kv_tree.cases("tiny", 1, 64) if s.params["backend"] == "kernel")
        try:
            kv_tree._setup(spec.params)
        except CaseSkipped as e:
            return f"skipped: {e}"
        return "ran"
    out.append(api(cls, "kv_tree with TRITON_INTERPRET=0 exported", kv_tree_off, bad=False,
                   env={"TRITON_INTERPRET": "0"}, check=lambda r: (str(r.value).startswith("skipped"), str(r.value))))
    return out


def kernel_edge_cases() -> list[Case]:
    cls = "kernel-edges"

    def meta():
        import torch
        from verifybench.kernels.tree import api as tree
        m = lambda *s: torch.empty(*s, device="meta", dtype=torch.int64)  # noqa: E731
        return tree.build_tree(m(2), m(2, 1), m(2, 2), m(2, 2), m(2), 1, 3, 3, "full")

    def beyond_int32():
        import torch
        from verifybench.kernels.tree import api as tree
        return tree.verify_tree_greedy(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), torch.tensor([[1, -1]]),
                                       torch.tensor([[-1, -1]]), torch.tensor([2**40, 3]), 2)

    def assign(slot, seq, backend):
        def fn():
            import torch
            from verifybench.kernels.tree import api as tree
            t = torch.zeros(2, 16, dtype=torch.int32)
            tree.assign_req_to_token(t, torch.tensor([0]), torch.tensor([seq]), torch.tensor([slot, 1, 2]), 3,
                                     backend=backend)
            return f"written: {int(t.count_nonzero())} nonzero"
        return fn

    out = [api(cls, "build_tree on meta tensors", meta, "meta"),
           api(cls, "verify_tree_greedy with target ids beyond int32", beyond_int32, "int32")]
    for slot, seq in ((2**33 + 5, 0), (3, 20)):
        for backend in ("kernel", "reference"):
            out.append(api(cls, f"assign_req_to_token int32 table, slot {slot}, seq {seq}, {backend}",
                           assign(slot, seq, backend), "out of range" if backend == "reference" else "not written"))
    return out


def _process(argv, delay_s: float | None = None, limit_bytes: int | None = None, cwd: Path | None = None):
    """A runner: verifybench with `argv` as a real process; SIGINT after delay_s, or writes capped at limit_bytes."""
    def runner(timeout_s):
        def child():
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell's children start with it ignored
            if limit_bytes is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "verifybench.harness.cli", *map(str, argv)], cwd=cwd, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=child)
        if delay_s is not None:
            time.sleep(delay_s)
            p.send_signal(signal.SIGINT)
        try:
            o, e = p.communicate(timeout=max(timeout_s, 120))
        except subprocess.TimeoutExpired:
            p.kill()
            return Result("timeout", wall_s=time.monotonic() - t0)
        return Result("return", p.returncode, out=o, err=e, wall_s=time.monotonic() - t0)
    return runner


def _one_line(rc: int, needle: str):
    def check(res):
        lines = [x for x in res.err.splitlines() if x.strip() and "━" not in x]
        ok = res.value == rc and len(lines) == 1 and needle in lines[0] and "Traceback" not in res.err
        return ok, f"exit {res.value}: {lines[-3:]}"
    return check


def process_cases(work: Path, torchrun: bool = True) -> list[Case]:
    cls, d = "signals", work / "signals"
    d.mkdir()
    out = []
    for delay in (0.3, 0.9, 2.0):
        out.append(Case(cls, f"Ctrl-C {delay} s into verifybench run (torch importing)", bad=False, cli=True,
                        runner=_process(["run", "--out", d / "int"], delay_s=delay, cwd=work),
                        check=_one_line(130, "interrupted")))
    out.append(Case(cls, "Ctrl-C 2.5 s into verifybench advise", bad=False, cli=True,
                    runner=_process(["advise", H200], delay_s=2.5, cwd=work),
                    check=lambda r: (r.value in (0, 130) and "Traceback" not in r.err,
                                     f"exit {r.value}: {r.err.strip()[-200:]}")))
    out.append(Case(cls, "verifybench run under ulimit -f 20 (blocks)", cli=True,
                    runner=_process(["run", "--out", d / "full"], limit_bytes=20 * 512, cwd=work),
                    check=_one_line(2, "ulimit -f")))
    if torchrun:
        def healthy(timeout_s):
            t0 = time.monotonic()
            try:
                r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                                    "verifybench.harness.multigpu.allreduce", "--backend", "gloo", "--tokens", "1",
                                    "--samples", "20", "--isolated-samples", "4000", "--hang-timeout", "3", "--out",
                                    str(d / "ar")], cwd=work, capture_output=True, text=True,
                                   timeout=max(timeout_s, 300))
            except subprocess.TimeoutExpired:
                return Result("timeout", wall_s=time.monotonic() - t0)
            return Result("return", r.returncode, out=r.stdout, err=r.stderr, wall_s=time.monotonic() - t0)
        out.append(Case(cls, "torchrun allreduce gloo, 4000 isolated samples, --hang-timeout 3", bad=False, cli=True,
                        runner=healthy, check=lambda r: (r.value == 0, f"exit {r.value}: {r.err.strip()[-200:]}")))
    return out


def new_cases(work: Path, torchrun: bool = True) -> list[Case]:
    return advise_cases(work) + list_cases(work) + limit_cases(work) + kernel_edge_cases() \
        + process_cases(work, torchrun)
