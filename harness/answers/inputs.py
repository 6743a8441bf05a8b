"""The result files advise reads, checked before anything is costed: a named file's kind from what it holds (a name
of the user's, a pipe), the fields each kind must hold, one GPU model across them, accept lengths that name a shape."""
from __future__ import annotations

from pathlib import Path

from verifybench.harness.answers import plan
from verifybench.harness.measure.results import result_cases, result_files, store


def file_kind(p: Path, kinds: tuple[str, ...]) -> str:
    """The kind of a file named on the command line, from what it holds (a run's component, a trace summary's
    schema), so a name of the user's (or a pipe, <(cat cycle.json)) is read as what it is; a file no kind of
    advise's is refused, naming what advise reads."""
    data = store.read_json(p)
    if data.get("schema") == "verifybench.trace":
        kind = "trace"
    elif isinstance(data.get("component"), str):
        kind = data["component"]
    elif "rows" in data and "gpu" in data:
        kind = "defaults_vs_tuned"
    else:
        kind = result_files.kind_of(p)
    if kind not in kinds + ("trace",):
        raise ValueError(f"{p}: a {kind!r} file; advise reads {', '.join(kinds)} results and a trace summary "
                         "(verifybench trace --json)")
    _READ[str(p)] = data  # a pipe reads once
    return kind


_READ: dict[str, dict] = {}


def read(path: Path) -> dict:
    return _READ.pop(str(path), None) or store.read_json(path)


def load(found: dict[str, Path], kinds: tuple[str, ...]) -> dict[str, dict]:
    """Each file checked for what advise reads (plan's fields of a cycle and a verify result, a comparison's rows),
    so a short or mislabelled file is refused naming the file and field; one GPU model across them all."""
    out = {}
    for kind in kinds:
        if kind in found and found[kind] is not None:
            data = read(found[kind])
            if kind == "defaults_vs_tuned":
                rows = data.get("rows")
                if not rows or not isinstance(rows, list) or not all(
                        isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) and not isinstance(
                            r.get(k), bool) for k in ("n", "forward_default_us", "forward_tuned_us")) for r in rows):
                    raise store.ResultsError(f"{found[kind]}: not a defaults_vs_tuned comparison (rows of n, "
                                               "forward_default_us, forward_tuned_us)")
                out[kind] = data
                continue
            run = store.validate_run(data, str(found[kind]))
            if run["component"] != kind:
                raise store.ResultsError(f"{found[kind]}: a {run['component']!r} result where a {kind} result is due")
            out[kind] = result_cases.read(run, str(found[kind]), plan.NEEDS.get(kind, ()))
    models = {}
    for kind, run in out.items():
        if isinstance(run.get("fingerprint"), dict):
            models.setdefault(run["fingerprint"].get("gpu_model"), []).append(str(found[kind]))
    if len(models) > 1:
        raise ValueError("the results come from different GPU models (" + "; ".join(
            f"{m}: {', '.join(fs)}" for m, fs in models.items()) + "): give one machine's results")
    return out


def match_shapes(given: dict, runs: dict) -> list[str]:
    """--accept-len keys against the shapes of the cycle result (D or steps,topk,D): refused where none matches (the
    acceptance would be dropped without a word); a note line naming the keys that match none where others do (a
    README flow gives 3:2.4,6:3.1 to a CPU cycle that ran D = 3 only)."""
    for key, tau in given.items():  # as plan refuses it: past the most a shape can accept, whatever the file holds
        top = plan.max_accept_len(key) if isinstance(key, tuple) else key
        if tau > top:
            raise ValueError(f"--accept-len: accept length {tau:g} for {key} outside 1..{top} (min(steps, D-1) + "
                             "bonus: at most D)")
    if "cycle" not in runs:
        return []
    shapes = {plan.case_config(c) for c in plan.passing_cases(runs["cycle"])}
    if not shapes:  # the answer says the cycle has no passing case; the accept length is not to blame
        return []
    for key, tau in given.items():
        for shape in shapes:
            if key in (shape, shape[2]) and tau > plan.max_accept_len(shape):
                raise ValueError(f"--accept-len: accept length {tau:g} for {shape} outside 1.."
                                 f"{plan.max_accept_len(shape)} (min(steps, D-1) + bonus)")
    unmatched = [k for k in given if not any(k == s or k == s[2] for s in shapes)]
    held = f"the cycle result holds {', '.join(map(str, sorted(shapes)))}"
    if unmatched and len(unmatched) == len(given):
        raise ValueError(f"--accept-len: {', '.join(map(str, unmatched))} matches no shape of the cycle result "
                         f"({held}): give D or steps,topk,D of those")
    return [f"note: --accept-len {', '.join(map(str, unmatched))} matches no shape ({held}): not used"] if unmatched \
        else []
