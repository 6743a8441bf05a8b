"""Probes of the bad-input classes that cut across commands: data lost (a write onto an input, two runs in one second),
tracebacks (corrupt or doctored results given to plan and project, Ctrl-C, bad faults), silent or misleading answers
(plan, breakeven, compare, trace on damaged traces, the tree and MoE inputs) and the README's flows.

Each is written to pass once its fault is fixed; the report names the branch that holds each fix.
"""
from __future__ import annotations

import gzip
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from probe_base import REPO, Case, Result, _edited, _suite, api, cli, module_main

BASELINES = REPO / "results" / "baselines" / "nvidia-h200-x1"
TRACE = REPO / "tests" / "data" / "traces" / "handbuilt-engine-TP-0.trace.json.gz"
SUITE_FORWARD = REPO / "tests" / "data" / "traces" / "suite-forward-k2.5-L3-TP-0.trace.json.gz"
ACCEPT = ["--accept-len", "3:2.0,4:2.4,6:2.8,8:3.0"]


def _unchanged(path: Path, rc: int = 2):
    """Right when the command refused (exit `rc`) and left `path` byte for byte as it was."""
    before = path.read_bytes()

    def check(res):
        same = path.exists() and path.read_bytes() == before
        return res.value == rc and same, f"exit {res.value}; input {'unchanged' if same else 'CHANGED'}"
    return check


def _no_negative(res):
    negative = re.findall(r"(?<![\w.:-])-\d+\.?\d*", res.out)
    return res.value == 2 or (res.value == 0 and not negative), f"exit {res.value}, negative figures {negative[:3]}"


def _trace_file(work: Path, name: str, edit) -> Path:
    data = json.loads(gzip.decompress(TRACE.read_bytes()))
    edit(data["traceEvents"])
    path = work / name
    path.write_text(json.dumps(data))
    return path


def _first_kernel(events) -> dict:
    return next(e for e in events if e.get("cat") == "kernel")


def _verify_result(path: Path, **change) -> Path:
    """The committed H200 verify baseline, with `change` applied to its first case's summary."""
    data = json.loads((BASELINES / "verify.json").read_text())
    for key, value in change.items():
        if value is KeyError:
            data["cases"][0]["summary"].pop(key, None)
        else:
            data["cases"][0]["summary"][key] = value
    path.write_text(json.dumps(data))
    return path


def data_lost_cases(work: Path) -> list[Case]:
    cls, d = "data-lost", work / "lost"
    d.mkdir()
    out = []
    cycle = shutil.copy(BASELINES / "cycle.json", d / "cycle.json")
    out.append(cli(cls, ["plan", cycle, *ACCEPT, "--json", cycle], bad=False, check=_unchanged(Path(cycle))))
    for flag in ("--json", "--chart"):
        t = shutil.copy(TRACE, d / f"t{flag}.trace.json.gz")
        out.append(cli(cls, ["trace", t, flag, t], bad=False, check=_unchanged(Path(t))))

    def two_saves_in_one_second():
        from verifybench.harness.measure.results import store
        run = json.loads(_suite(d / "r.json").read_text())
        a, b = store.save_run(run, d / "same"), store.save_run(run, d / "same")
        return [str(a) != str(b), Path(a).exists() and Path(b).exists()]

    out.append(api(cls, "two saves of one component into one --out in the same second keep both", two_saves_in_one_second,
                   bad=False, check=lambda r: (r.value == [True, True], f"distinct, both kept: {r.value}")))
    return out


def traceback_cases(work: Path) -> list[Case]:
    cls, d = "tracebacks", work / "tb"
    d.mkdir()
    out = []
    broken = d / "broken.json.gz"
    broken.write_bytes(b"\x1f\x8b" + b"not gzip at all")
    out.append(cli(cls, ["plan", broken, *ACCEPT], str(broken)))
    out.append(cli(cls, ["project", broken, "--copy-gbps", "100", "--allreduce-us", "10"], str(broken)))
    for which, value in (("null", None), ("zero", 0), ("string", "x"), ("missing", KeyError)):
        path = _verify_result(d / f"verify-{which}.json", median_us=value)
        out.append(cli(cls, ["project", path, "--target", "rtx-pro-6000-pcie-tp8"], str(path)))
        out[-1].name = f"project <verify result, {which} median>"
        cyc = _edited(Path(shutil.copy(BASELINES / "cycle.json", d / f"cycle-{which}.json")),
                      lambda data, v=value: data["cases"][0]["summary"].pop("median_us") if v is KeyError
                      else data["cases"][0]["summary"].update(median_us=v))
        out.append(cli(cls, ["plan", cyc, *ACCEPT], str(cyc)))
        out[-1].name = f"plan <cycle result, {which} median>"
    out.append(module_main(cls, "allreduce", ["--backend", "gloo", "--preset", "tiny", "--fault", "bogus", "--out",
                                              d / "ar"], "--fault"))

    def ctrl_c(timeout_s):
        t0 = time.monotonic()
        # every component at the default time budget: still running when the signal comes
        proc = subprocess.Popen([sys.executable, "-m", "verifybench.harness.cli", "run", "--out", str(d / "int")],
                                cwd=work, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(6)
        proc.send_signal(signal.SIGINT)
        try:
            o, e = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return Result("timeout", out="", err="", wall_s=time.monotonic() - t0)
        return Result("return", proc.returncode, out=o, err=e, wall_s=time.monotonic() - t0)

    def interrupted(res):
        lines = [ln for ln in res.err.splitlines() if ln.strip()]
        temps = [p.name for p in (d / "int").rglob("*.tmp")] if (d / "int").exists() else []
        ok = res.value == 130 and len(lines) <= 2 and "Traceback" not in res.err and not temps
        return ok, f"exit {res.value}, stderr {lines[-1:] if lines else ''}, temps {temps}"

    out.append(Case(cls, "Ctrl-C during verifybench run", bad=False, check=interrupted, runner=ctrl_c))
    return out


def silent_cases(work: Path) -> list[Case]:
    cls, d = "silent", work / "silent"
    d.mkdir()
    out = [cli(cls, ["plan", "--decode-ms", "10", "--verify-ms", "3:25,6:20", "--configs", "2,1,3;5,1,6;7,1,8",
                     *ACCEPT], bad=False, check=_no_negative),
           cli(cls, ["plan", "--decode-ms", "10", "--verify-ms", "3:20,4:22", "--configs", "", *ACCEPT], "--configs"),
           cli(cls, ["run", "--tokens", "1_0", "--out", d], "--tokens"),
           cli(cls, ["run", "--tokens", "1-", "--out", d], "--tokens"),
           cli(cls, ["baseline", "--out", ""], "--out"),
           cli(cls, ["breakeven", "--accept-len", "0.5"], "--accept-len"),
           cli(cls, ["breakeven", "--accept-len", "1e308"], "--accept-len"),
           module_main(cls, "allreduce", ["--backend", "nccl", "--preset", "tiny", "--out", d / "nccl"], "nccl")]
    good = _suite(d / "good.json")
    out.append(cli(cls, ["compare", good, good, "--min-effect", "0"], bad=False, check=lambda r: (
        r.value == 0 and "SAME 1" in r.out, f"exit {r.value}: identical files must be SAME")))
    edited = _edited(_suite(d / "edited.json"), lambda x: x["fingerprint"].update(gpu_model="NVIDIA H100"))
    out.append(cli(cls, ["compare", good, edited], str(edited)))
    out[-1].name = "compare GOOD <fingerprint gpu_model edited, gpus not>"
    # trace: damaged traces and reserved rule names are refused naming the fault (this branch)
    for name, edit, needle in (
            ("negative", lambda ev: _first_kernel(ev).update(dur=-20.0), "negative"),
            ("missing", lambda ev: _first_kernel(ev).pop("dur"), "missing"),
            ("nan", lambda ev: _first_kernel(ev).update(dur=float("nan")), "non-finite"),
            ("inf", lambda ev: _first_kernel(ev).update(dur=float("inf")), "non-finite"),
            ("twice", lambda ev: ev.extend([dict(e) for e in ev]), "present twice")):
        out.append(cli(cls, ["trace", _trace_file(d, f"{name}.json", edit)], needle))
        out[-1].name = f"trace <a kernel duration {name}>" if name != "twice" else "trace <every event twice>"
    for reserved in ("total", "gpu_idle", "overlap"):
        rules = d / f"rules-{reserved}.json"
        rules.write_text(json.dumps([["Marlin", reserved]]))
        out.append(cli(cls, ["trace", TRACE, "--rules", rules], reserved))
    big = _trace_file(d, "1e18.json", lambda ev: [e.update(ts=10**18 + int(e["ts"])) for e in ev if "ts" in e])
    want = json.loads((REPO / "tests" / "data" / "traces" / "handbuilt-engine.expect.json").read_text())
    out.append(cli(cls, ["trace", big, "--cycle-range", "scheduler_step", "--verify-range", "verify_forward",
                         "--json", d / "big-out.json"], bad=False, check=lambda r: (
        r.value == 0 and json.loads((d / "big-out.json").read_text())["per_cycle_us"] == want["per_cycle_us"],
        f"exit {r.value}: timestamps near 1e18 us decompose as at 0")))
    cpu = _edited(_verify_result(d / "verify-cpu.json"), lambda x: [c.update(device="cpu") for c in x["cases"]])
    out.append(cli(cls, ["trace", TRACE, "--against", cpu], "CPU"))
    out.append(cli(cls, ["trace", SUITE_FORWARD, "--cycle-range", "verify_forward", "--against",
                         BASELINES / "verify.json"], "--layers"))
    out[-1].name = "trace <3-layer trace> --against <61-layer result>"
    return out + kernel_input_cases()


def kernel_input_cases() -> list[Case]:
    """Kernel inputs that gave a wrong answer or a 6.6 TB allocation: refused naming the input, on both backends."""
    out = []

    def tree_input(backend, what):
        def fn():
            import torch
            from verifybench.kernels.moe_int4 import reference as moe_int4
            from verifybench.kernels.tree import api as tree
            from verifybench.kernels.tree.inputs import random_tree
            inp = random_tree(2, 2, 3, 6, 50, seed=0, context=40)
            if what == "huge seq_lens":
                inp["seq_lens"] = torch.full((2,), 2**38 * 3, dtype=torch.int64)
                return [t.shape for t in tree.build_tree(**inp, mask_mode="full", backend=backend)]
            _, _, index, nxt, sib, tokens = tree.build_tree(**inp, mask_mode="qlen_only", backend="reference")
            if what == "duplicated retrieve_index":
                index[1, 2] = index[1, 1]
                got = tree.verify_tree_greedy(tokens.view(2, 6), index, nxt, sib, torch.zeros(12, dtype=torch.int64),
                                              4, backend=backend)
                if backend == "kernel" and got[2].tolist()[1] == -1:
                    raise ValueError("retrieve_index: request 1 flagged in-band (accept_token_num -1)")
                return got[2].tolist()
            if what == "slot 2**33+5 in an int32 table":
                loc = torch.arange(12, dtype=torch.int64)
                loc[7] = 2**33 + 5
                flags = torch.zeros(2, dtype=torch.int32) if backend == "kernel" else None
                table = tree.assign_req_to_token(torch.zeros(4, 64, dtype=torch.int32), torch.tensor([0, 1]),
                                                 torch.tensor([3, 5]), loc, 6, backend=backend, flags=flags)
                if flags is not None and flags.tolist()[1]:
                    raise ValueError("out_cache_loc: request 1 flagged (FLAG_ID_RANGE), not written")
                return table[1].tolist()[:12]
            w = torch.randn(4, 64)
            w[2, 32:] = 1e-40
            return moe_int4.quantize_w4a16(w)[1].tolist()
        return fn

    for what, needle in (("huge seq_lens", "bytes"), ("duplicated retrieve_index", "retrieve_index"),
                         ("slot 2**33+5 in an int32 table", "out_cache_loc")):
        for backend in ("reference", "kernel"):
            out.append(api("silent", f"{what} [{backend}]", tree_input(backend, what), needle))
    out.append(api("silent", "quantize_w4a16 scales below bf16's range", tree_input("reference", "tiny"), "scale"))
    return out


def flow_cases(work: Path) -> list[Case]:
    """The README's flows, then every class above."""
    d = work / "flows"
    d.mkdir()
    runs = d / "runs"
    runs.mkdir()
    for stamp in ("20261201T000000Z", "20261202T000000Z"):
        shutil.copy(BASELINES / "verify.json", runs / f"verify-{stamp}.json")
    out = [cli("flows", ["compare", BASELINES / "verify.json", runs], bad=False, check=lambda r: (
               r.value == 0, f"exit {r.value}: a results folder names its latest verify result")),
           cli("flows", ["trace", SUITE_FORWARD, "--cycle-range", "verify_forward", "--layers", "3", "--against",
                         runs], bad=False, check=lambda r: (r.value == 0 and "scaled per layer" in r.out,
                                                             f"exit {r.value}")),
           cli("flows", ["verify", "--help"], bad=False, check=lambda r: (r.value == 0, "docs/trace.md's command"))]
    return out + data_lost_cases(work) + traceback_cases(work) + silent_cases(work)
