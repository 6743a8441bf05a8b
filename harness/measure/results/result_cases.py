"""The one reader of a result file's cases: every field a command uses (batch, tokens, context, shape, plain decode,
the stored median against its own samples) checked where the file is read; a case with a bad field is left out."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from verifybench.harness.measure.limits import FORWARD_ROWS_MAX, MAX_CONTEXT, TOKEN_COUNT_MAX


class ResultsError(ValueError):
    """A results file that is missing, corrupt, foreign or of an unsupported version."""


# ---- what a command reads from a kind of result, checked when the file is read

def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_count(v) -> bool:
    return _is_number(v) and isinstance(v, int) and v >= 1


@dataclass(frozen=True)
class Check:
    """What a field must hold, in words (for the error) and as a test."""

    what: str
    ok: Callable[[object], bool]


COUNT = Check("an integer >= 1", _is_count)
COUNT_OR_NULL = Check("null or an integer >= 1", lambda v: v is None or _is_count(v))
POSITIVE = Check("a finite number > 0", lambda v: _is_number(v) and math.isfinite(v) and v > 0)
NONNEGATIVE = Check("a finite number >= 0", lambda v: _is_number(v) and math.isfinite(v) and v >= 0)
TEXT = Check("a non-empty string", lambda v: isinstance(v, str) and bool(v))
FINITE_TABLE = Check("an object of finite numbers", lambda v: isinstance(v, dict) and bool(v) and all(
    _is_number(x) and math.isfinite(x) for x in v.values()))
BYTES_TABLE = Check("an object of byte counts >= 0", lambda v: isinstance(v, dict) and bool(v) and all(
    _is_number(x) and math.isfinite(x) and x >= 0 for x in v.values()))


@dataclass(frozen=True)
class Need:
    """Fields (dotted paths, e.g. "derived.decode_ms") a command reads from each passing case `where` selects
    (default: every passing case), and what each must hold."""

    fields: dict[str, Check]
    where: Callable[[dict], bool] | None = None


_MISSING = object()


def _field(case: dict, path: str):
    value = case
    for key in path.split("."):
        value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
    return value


def check_needs(run: dict, needs, where: str) -> dict:
    """ResultsError naming the file, the case and the field when a passing case lacks what a Need asks."""
    for need in needs:
        for case in run["cases"]:
            if not case["check"]["ok"] or (need.where is not None and not need.where(case)):
                continue
            for path, check in need.fields.items():
                value = _field(case, path)
                if value is _MISSING or not check.ok(value):
                    got = "missing" if value is _MISSING else f"{value!r}"[:60]
                    raise ResultsError(f"{where}: case {case['name']!r}: field {path} must be {check.what}, got {got}")
    return run



BATCH = Check(f"an integer in 1..{FORWARD_ROWS_MAX}", lambda v: _is_count(v) and v <= FORWARD_ROWS_MAX)
TOKENS = Check(f"an integer in 1..{TOKEN_COUNT_MAX}", lambda v: _is_count(v) and v <= TOKEN_COUNT_MAX)
CONTEXT = Check(f"an integer in 1..{MAX_CONTEXT}", lambda v: _is_count(v) and v <= MAX_CONTEXT)

# What places a case (also one whose check failed: a command sorts every case by its batch and shape), per kind,
# and the field that times the batch to the rows of one forward (B x D at most FORWARD_ROWS_MAX everywhere).
PLACE: dict[str, dict[str, Check]] = {
    "cycle": {"params.batch": BATCH, "params.context": CONTEXT, "params.steps": TOKENS, "params.topk": TOKENS,
              "params.draft_tokens": TOKENS},
    "verify": {"params.batch": BATCH, "params.tokens": TOKENS},
    "mla_verify": {"params.batch": BATCH, "params.tokens": TOKENS, "params.context": CONTEXT},
    "mla_decode": {"params.batch": BATCH, "params.tokens": TOKENS, "params.context": CONTEXT},
}
ROWS = {"cycle": "params.draft_tokens", "verify": "params.tokens", "mla_verify": "params.tokens",
        "mla_decode": "params.tokens"}
MEDIAN_TOLERANCE = 1e-6  # relative: the writer stores the samples' own median, so only an edit moves it


def _median_problem(case: dict) -> str | None:
    """The stored median against the median of the case's own samples (None: they agree)."""
    samples = case.get("samples_us")
    if not isinstance(samples, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                and math.isfinite(x) for x in samples):
        return "field samples_us must be a list of finite numbers"
    stored, own = case["summary"]["median_us"], float(np.median(samples))
    if abs(stored - own) > MEDIAN_TOLERANCE * max(abs(own), 1e-12):
        return (f"field summary.median_us ({stored:.6g} us) disagrees with the median of its {len(samples)} samples "
                f"({own:.6g} us): an edited or corrupt file")
    return None


def case_problem(component: str, case: dict, needs=()) -> str | None:
    """What is wrong with one case for a command that reads `needs` (store.Need), as "field X must be ..., got Y";
    None when nothing is. A batch missing here is one missing from a file whose other cases carry it (an older
    file that never wrote it meant one request, and store.validate_run filled it in)."""
    checks = {}
    if case["check"]["ok"]:
        for need in needs:
            if need.where is None or need.where(case):
                checks.update(need.fields)
    checks.update(PLACE.get(component, {}))  # the stricter check of a field a command's Need names too
    for path, check in checks.items():
        value = _field(case, path)
        if value is _MISSING or not check.ok(value):
            return f"field {path} must be {check.what}, got " + ("missing" if value is _MISSING else f"{value!r}"[:60])
    rows = ROWS.get(component)
    if rows:
        b, d = case["params"]["batch"], _field(case, rows)
        if b * d > FORWARD_ROWS_MAX:
            return f"fields params.batch x {rows} = {b} x {d} = {b * d} rows; at most {FORWARD_ROWS_MAX} (B x D)"
    return _median_problem(case) if case["check"]["ok"] else None


def screen(run: dict, where: str, needs=()) -> dict:
    """`run` (validated by store.validate_run) with every case that has a bad field left out, and under
    "left_out" one message per case left out naming the case and the field; a run whose passing cases all had one
    is refused (ResultsError naming the file, the first case and its field)."""
    kept, left = [], []
    for case in run["cases"]:
        problem = case_problem(run["component"], case, needs)
        if problem:
            left.append(f"case {case['name']!r}: {problem}")
        else:
            kept.append(case)
    passing = [c for c in run["cases"] if c["check"]["ok"]]
    if passing and not any(c["check"]["ok"] for c in kept):
        raise ResultsError(f"{where}: {left[0]}" + (f" (and {len(left) - 1} more cases with a bad field: none is "
                                                     "left to read)" if len(left) > 1 else ""))
    return {**run, "cases": kept, "left_out": left}


def left_out_line(run: dict, where: str) -> str | None:
    """The one line counting the cases screen left out, naming each case and its field (the first three)."""
    left = run.get("left_out") or []
    if not left:
        return None
    more = f"; and {len(left) - 3} more" if len(left) > 3 else ""
    return (f"note: {where}: {len(left)} of {len(left) + len(run['cases'])} cases left out (a bad field, never "
            f"merged with the others): " + "; ".join(left[:3]) + more)


def read(run: dict, where: str, needs=()) -> dict:
    """screen, then its one line on stderr (so the command's own output stays as it was)."""
    run = screen(run, where, needs)
    line = left_out_line(run, where)
    if line:
        print(line, file=sys.stderr)
    return run
