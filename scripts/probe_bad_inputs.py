"""Bad inputs and real faults, tried as a careful user would on a CPU box: the CLI, compare with doctored files, the
result writes, torchrun rank faults, the tree and MoE APIs. Each outcome is classified; counts per class are printed
and every input with its outcome is written as JSON.

  python3 scripts/probe_bad_inputs.py OUT.json [--only CLASS,...] [--timeout-s 60] [--no-torchrun]

Exit 0 when every input was answered clear or right, 1 otherwise (docs/probes.md: the classes and how to read them).

Outcomes: clear (exit 2, or ValueError/TypeError, with a one-line message naming the input), right (a valid input
gave the right answer), traceback (a Python traceback or another exception type), hang (past its timeout), silent
(exit 0/1 or a return value where a refusal was due), unclear (refused, but the message does not name the input),
refused-valid (a valid input was refused). Each input runs in a forked child of this process (torch is imported
once), with its own stdout/stderr and a timeout; the torchrun faults and two CLI calls run as real subprocesses.
Not part of the pytest suite: the regression tests in tests/ hold one case per bug this probe found.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import probe_cases  # noqa: E402  (scripts/probe_cases.py: the inputs, by class)
from probe_base import Case, Result  # noqa: E402
from verifybench.harness.measure.exits import EXIT_FAILED, EXIT_OK  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUTCOMES = ("clear", "right", "traceback", "hang", "silent", "unclear", "refused-valid")
CLEAN_ENV = ("VERIFYBENCH_MAX_TIME_S", "VERIFYBENCH_ALLREDUCE_US", "VERIFYBENCH_VERIFY_OPS", "VERIFYBENCH_PDL",
             "VERIFYBENCH_HOST_GATE", "VERIFYBENCH_PIN_CPU", "VERIFYBENCH_MEMORY_CAP_GIB", "VERIFYBENCH_MOE_TRACE")


def forked(fn, timeout_s: float, env: dict | None = None) -> Result:
    """fn() in a forked child with its own stdout/stderr files, under a timeout (then SIGKILL: a hang)."""
    with tempfile.TemporaryDirectory(prefix="vb-probe-") as tmp:
        paths = {k: Path(tmp) / k for k in ("out", "err", "res")}
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                for fd, name in ((1, "out"), (2, "err")):
                    f = os.open(paths[name], os.O_WRONLY | os.O_CREAT, 0o600)
                    os.dup2(f, fd)
                for k in CLEAN_ENV:
                    os.environ.pop(k, None)
                os.environ.update(env or {})
                try:
                    res = Result("return", fn())
                except SystemExit as e:
                    res = Result("exit", e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
                except BaseException as e:  # noqa: BLE001  what the probe is looking for
                    traceback.print_exc()
                    res = Result("raise", exc_type=type(e).__name__, message=str(e))
                try:
                    pickle.dumps(res.value)
                except Exception:
                    res.value = repr(res.value)[:500]
                sys.stdout.flush()
                sys.stderr.flush()
                paths["res"].write_bytes(pickle.dumps(res))
            except BaseException:  # noqa: BLE001
                code = 99
            os._exit(code)
        deadline = t0 + timeout_s
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = None
        wall = time.monotonic() - t0
        out, err = (paths[k].read_text(errors="replace") if paths[k].exists() else "" for k in ("out", "err"))
        if status is None:
            return Result("timeout", out=out, err=err, wall_s=wall)
        if paths["res"].exists() and paths["res"].stat().st_size:
            res = pickle.loads(paths["res"].read_bytes())
        else:  # the child left through os._exit or a signal: its exit status is the answer
            code = os.waitstatus_to_exitcode(status)
            res = Result("exit", code)
        res.out, res.err, res.wall_s = out, err, wall
        return res


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip() and "forced NCCL_NVLS_ENABLE" not in ln]


def classify(case: Case, res: Result) -> tuple[str, str]:
    """(outcome, one-line detail)."""
    if res.kind == "timeout":
        return "hang", f"still running after {res.wall_s:.0f} s"
    if case.check is not None:
        try:
            ok, why = case.check(res)
        except Exception as e:  # noqa: BLE001
            ok, why = False, f"checker: {type(e).__name__}: {e}"
        if ok == "hang":
            return "hang", why
        if ok:
            return ("clear" if case.bad else "right"), why
        if res.kind == "raise" and res.exc_type not in ("ValueError", "TypeError", "ResultsError") \
                and not res.exc_type.endswith("Error") or "Traceback (most recent call last)" in res.err and case.cli:
            return "traceback", why
        if not case.bad and res.value == 2:
            return "refused-valid", why
        return ("silent" if res.value in (0, 1, None) or not case.cli else "unclear"), why
    if res.kind == "raise":
        one_line = "\n" not in res.message.strip()
        if case.api and res.exc_type in ("ValueError", "TypeError", "ResultsError") and one_line:
            if not case.bad:
                return "refused-valid", f"{res.exc_type}: {res.message}"
            return ("clear" if case.needle.lower() in res.message.lower() else "unclear"), \
                f"{res.exc_type}: {res.message}"
        return "traceback", f"{res.exc_type}: {res.message}"[:300]
    if "Traceback (most recent call last)" in res.err and case.cli:
        return "traceback", _lines(res.err)[-1][:300] if _lines(res.err) else "traceback"
    if case.cli:
        rc = res.value
        lines = _lines(res.err)
        last = lines[-1] if lines else ""
        if rc == 2:
            if not case.bad:
                return "refused-valid", last[:300]
            named = case.needle.lower() in last.lower() and "error" in last.lower()
            return ("clear" if named else "unclear"), last[:300]
        if isinstance(rc, int) and rc not in (0, 1):
            return "unclear", f"exit {rc}: {last[:250]}"
        return ("silent" if case.bad else "right"), f"exit {rc}: {(last or _lines(res.out)[-1:] or [''])[0][:250]}"
    if case.bad:
        return "silent", f"returned {str(res.value)[:200]}"
    return "right", f"returned {str(res.value)[:200]}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="JSON with every input and its outcome")
    p.add_argument("--only", help="comma list of classes to run")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per input (default 60)")
    p.add_argument("--no-torchrun", action="store_true", help="skip the torchrun rank faults")
    args = p.parse_args()
    t_start = time.monotonic()
    import torch

    torch.set_num_threads(1)
    from verifybench.harness.cli import build_parser

    build_parser()  # imports every command's module once, before the forks
    work = Path(tempfile.mkdtemp(prefix="vb-probe-work-"))
    os.chdir(work)  # an input that writes into the working directory (--out '') writes here, not into the checkout
    cases = probe_cases.all_cases(work, torchrun=not args.no_torchrun)
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c.cls in keep]
    records = []
    for i, case in enumerate(cases):
        if case.runner is not None:  # a real subprocess or a torchrun job
            res = case.runner(args.timeout_s)
        else:
            res = forked(case.fn, case.timeout_s or args.timeout_s, case.env)
        outcome, detail = classify(case, res)
        records.append({"class": case.cls, "input": case.name, "bad": case.bad, "outcome": outcome,
                        "detail": detail, "wall_s": round(res.wall_s, 2)})
        if outcome not in ("clear", "right"):
            print(f"[{i + 1}/{len(cases)}] {case.cls}: {case.name}: {outcome.upper()}: {detail}", flush=True)
    counts = {}
    for r in records:
        counts.setdefault(r["class"], {o: 0 for o in OUTCOMES})[r["outcome"]] += 1
    total = {o: sum(c[o] for c in counts.values()) for o in OUTCOMES}
    header = f"{'class':<14}{'tried':>6}" + "".join(f"{o:>14}" for o in OUTCOMES)
    print("\n" + header)
    for cls, c in sorted(counts.items()):
        print(f"{cls:<14}{sum(c.values()):>6}" + "".join(f"{c[o]:>14}" for o in OUTCOMES))
    print(f"{'all':<14}{len(records):>6}" + "".join(f"{total[o]:>14}" for o in OUTCOMES))
    print(f"\n{time.monotonic() - t_start:.0f} s")
    args.out.write_text(json.dumps({"counts": counts, "total": total, "tried": len(records),
                                    "wall_s": round(time.monotonic() - t_start, 1), "records": records}, indent=1))
    return EXIT_OK if total["clear"] + total["right"] == len(records) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
