"""Results store: one versioned JSON schema for every component, atomic writes, validated loads.

A file holds a run of one component: its fingerprint and a list of case records (parameters, mode, samples and
summary, derived figures, correctness outcome). A case whose check failed carries no time.
"""
from __future__ import annotations

import errno
import gzip
import json
import math
import os
import secrets
import zlib
from datetime import datetime, timezone
from pathlib import Path

from verifybench.harness.measure.results import result_cases
# the error, and what a command reads from a kind of result, live with the one reader of a file's cases
from verifybench.harness.measure.results.result_cases import (  # noqa: F401
    BYTES_TABLE, COUNT, COUNT_OR_NULL, FINITE_TABLE, NONNEGATIVE, POSITIVE, TEXT, Check, Need, ResultsError,
    _field, _is_count, _is_number, _MISSING, check_needs)
from verifybench.harness.measure import stance
# the stance on figures that carry no conclusion lives in stance.py; re-exported for the importers of results
from verifybench.harness.measure.stance import (  # noqa: F401
    CPU_MODE_LABELS, CPU_TIMING, WITHHELD, cpu_numbers, is_cpu_run, mode_label, withhold, withhold_on_cpu)
from verifybench.harness.measure.timing.runner import Case
from verifybench.harness.measure.timing.timer import METHOD_VERSION
from verifybench.kernels.common.atomic_files import remove_stale_temps, write_atomic  # the one atomic writer

SCHEMA = "verifybench.result"
SCHEMA_VERSION = 1
DEFAULT_OUT = Path("verifybench-results")  # relative to the working directory: never inside results/ by default


def make_run(component: str, cases: list[Case], fingerprint: dict, extra: dict | None = None) -> dict:
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "method_version": METHOD_VERSION,
        "component": component,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": fingerprint,
        "extra": extra or {},
        "cases": [c.as_dict() for c in cases],
    }


def _finite(obj):
    """JSON has no NaN/inf: store them as null so files stay loadable by any JSON reader."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json_bytes(data: dict, gz: bool = False) -> bytes:
    text = (json.dumps(_finite(data), indent=1, allow_nan=False) + "\n").encode()
    return gzip.compress(text, mtime=0) if gz else text


def write_json_atomic(path: Path, data: dict) -> Path:
    """JSON (NaN/inf stored as null; gzip when the name ends in .gz) written through write_atomic: it replaces
    `path` (a table meant to be rewritten); a result or an output a user named goes through write_new."""
    text = _json_bytes(data, Path(path).suffix == ".gz")
    return write_atomic(path, lambda f: f.write(text))


def write_json_new(path: Path, data: dict, inputs=(), option: str = "output") -> Path:
    """JSON as write_json_atomic stores it, written through write_new (never onto an input or another file)."""
    return write_new(path, _json_bytes(data, Path(path).suffix == ".gz"), inputs, option)


def check_writable(directory: Path) -> Path:
    """Fail before measuring, not after: `directory` exists or can be made, and a file can be written in it."""
    directory = Path(directory)
    probe = directory / f".verifybench-write-test.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(probe, lambda f: f.write(b"ok"))
    except OSError as e:
        raise ResultsError(f"output folder {directory} is not writable: {e.strerror or e}") from None
    finally:
        try:
            probe.unlink(missing_ok=True)  # also when interrupted: only complete results stay behind
        except OSError:
            pass  # the folder was never made
    return directory


CURATED = Path(__file__).resolve().parents[3] / "results"  # the checkout's committed baselines (absent installed)


def chart_dir(beside: Path) -> Path:
    """Where a command that reads results draws its chart: beside them, unless they are the checkout's curated
    results/ (a read leaves them as committed) or that folder cannot be written: then ./verifybench-results/
    (made when the chart is written)."""
    beside = Path(beside).resolve()
    if not beside.is_relative_to(CURATED) and os.access(beside, os.W_OK):
        return beside
    return DEFAULT_OUT


def default_dir(fingerprint: dict) -> Path:
    """./verifybench-results/<machine-slug>/: outside the curated results/ of the checkout."""
    return DEFAULT_OUT / fingerprint.get("slug", "unknown")


def stamp(run: dict) -> str:
    """The run's UTC time as it appears in every file name of the run (JSON, report, charts)."""
    return datetime.fromisoformat(run["created_utc"]).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def save_run(run: dict, directory: Path | None = None, name: str | None = None, update: Path | None = None) -> Path:
    """Store as <directory>/<component>-<UTC time>.json (default directory: default_dir) through write_new: never
    over another run's file. `update`: the path an earlier save of this same run returned, replaced in place (a
    job that saves as it goes)."""
    validate_run(run, "run to save")
    if update is not None:
        return write_json_atomic(update, run)
    directory = Path(directory) if directory else default_dir(run["fingerprint"])
    return write_new(directory / (name or f"{run['component']}-{stamp(run)}.json"), _json_bytes(run))


# ---- writing: never onto an input, never over a file another run wrote

def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def refuse_inputs(path: Path, inputs=(), option: str = "output") -> None:
    """ResultsError when `path` is one of this command's inputs (the same file by any name)."""
    for given in inputs:
        if given is not None and (_same_file(Path(path), Path(given))
                                  or Path(path).resolve() == Path(given).resolve()):
            raise ResultsError(f"{option} {path}: that is an input of this command; name another file")


def numbered(path: Path, i: int) -> Path:
    """`path` with -<i> before its suffix (r.json -> r-2.json, t.json.gz -> t-2.json.gz); i = 1: `path` itself."""
    if i == 1:
        return path
    suffix = "".join(path.suffixes[-2:]) if path.name.endswith((".json.gz", ".tar.gz")) else path.suffix
    return path.with_name(f"{path.name[:len(path.name) - len(suffix)]}-{i}{suffix}")


def write_new(path: Path, data, inputs=(), option: str = "output") -> Path:
    """Write `data` (bytes, or write(file)) as a new file: `path`, or when a file of that name exists (another
    run's, or one written in the same second) the first free numbered(path, i). The whole file is written and
    synced under a temp name first, then linked to the free name, which fails if a concurrent writer took it:
    a reader never sees half a file and no writer replaces another's. Returns the path written."""
    path = Path(path)
    refuse_inputs(path, inputs, option)
    write = data if callable(data) else (lambda f: f.write(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)  # what a killed writer of this name left
    staging = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # write_atomic's temp name
    try:
        write_atomic(staging, write)
    except OSError as e:  # name the file the user asked for, not its staging name
        if e.filename == str(staging):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    try:
        for i in range(1, 10_000):
            target = numbered(path, i)
            try:
                os.link(staging, target)
                return target
            except FileExistsError:
                continue
            except OSError as e:  # a file system without hard links: claim the name, then fill it
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                try:
                    os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    continue
                os.replace(staging, target)
                return target
        raise ResultsError(f"{path}: 10000 files of this name already exist")
    finally:
        staging.unlink(missing_ok=True)


# ---- reading: the one loader

def read_json(path: Path) -> dict:
    """A JSON object from `path` (gzip-compressed when the name ends in .gz: full pytest-benchmark runs with raw
    samples are ~7 MB), or ResultsError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file") from None
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:  # gzip's BadGzipFile is an OSError
        raise ResultsError(f"{path}: cannot read: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON (corrupt or truncated?): {e}") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: expected a JSON object at the top level")
    return data


# ---- params keys: one key per quantity in every component (docs/measuring.md, "Params keys")

# Keys older files wrote, per component, and the key each quantity has now. Per component, because one old key
# meant two quantities: kv_tree's D was the draft tokens, mla_decode's D the latent+rope head width.
OLD_PARAMS_KEYS: dict[str, dict[str, str]] = {
    "kv_tree": {"spec_steps": "steps", "D": "draft_tokens", "B": "batch"},
    "mla_decode": {"n": "tokens", "D": "DK"},
    "mla_verify": {"n": "tokens"},
    "moe_int4": {"n": "tokens", "topk": "experts_per_token"},  # topk is the draft tree's width elsewhere
    "skinny_gemm": {"n": "tokens"},
}
# Keys older files lacked, with the value they meant: a run from before --batch verified one request, and one from
# before --context-spread gave each request the same context.
MISSING_PARAMS_KEYS: dict[str, dict[str, object]] = {
    "verify": {"batch": 1},
    "cycle": {"batch": 1},
    "mla_verify": {"batch": 1, "context_spread": 0.0},
    "mla_decode": {"batch": 1},
}


def batch_of(record: dict) -> int:
    """A case's requests per call (a record built before --batch, never read through current_params, ran one)."""
    return record["params"].get("batch", 1)


def current_params(component: str, params: dict, where: str = "params", fill: bool = True) -> dict:
    """`params` of a case of `component` under today's keys: an older file's keys renamed, the keys it lacked added
    with the value they meant. A new copy; ResultsError when an old and a new key both hold, and disagree."""
    out = dict(params)
    for old, new in OLD_PARAMS_KEYS.get(component, {}).items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise ResultsError(f"{where}: both {old!r} ({value!r}) and {new!r} ({out[new]!r}), which name one "
                               "quantity")
        out[new] = value
    for key, value in MISSING_PARAMS_KEYS.get(component, {}).items() if fill else ():
        out.setdefault(key, value)
    return out


def _current_keys(data: dict, where: str) -> None:
    """Every case's params under today's keys, so no reader needs to know an older file's (in place: the cases of a
    file just read; a case's params dict is replaced, never edited, since a component's spec may share it)."""
    component = data["component"]
    for case in data["cases"]:
        if isinstance(case.get("params"), dict):
            case["params"] = current_params(component, case["params"], f"{where}: case {case['name']!r}",
                                            fill=False)
    # a key no case carries is an older file's (filled with what it meant); one that some cases carry and others
    # lack is a fault of those others, left missing for the reader to name (result_cases.py), never filled
    carried = {k for c in data["cases"] if isinstance(c.get("params"), dict) for k in c["params"]}
    for case in data["cases"]:
        if isinstance(case.get("params"), dict):
            for key, value in MISSING_PARAMS_KEYS.get(component, {}).items():
                if key not in carried:
                    case["params"][key] = value


def _median_problem(value) -> str | None:
    if value is None:
        return "is null or missing"
    if not _is_number(value) or not math.isfinite(value):
        return f"is not a finite number ({value!r})"
    return f"must be > 0, got {value!r}" if value <= 0 else None


def validate_run(data: dict, where: str) -> dict:
    """The schema every reader relies on: version, component, a self-consistent fingerprint, and per case a
    name, params and derived objects, a check outcome, and for a passing case samples, a mode and a positive
    stored median. ResultsError naming `where`, the case and the field. The params come back under today's keys
    (current_params), so an older file reads as a new one."""
    from verifybench.harness.measure.host.fingerprint import gpu_model

    if data.get("schema") != SCHEMA:
        raise ResultsError(f"{where}: not a verifybench result file (schema={data.get('schema')!r})")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultsError(f"{where}: schema version {version!r}; this verifybench reads version {SCHEMA_VERSION}")
    for key, kind in (("component", str), ("fingerprint", dict), ("cases", list)):
        if not isinstance(data.get(key), kind):
            raise ResultsError(f"{where}: field {key!r} missing or not a {kind.__name__}")
    try:
        gpu_model(data["fingerprint"])
    except ValueError as e:
        raise ResultsError(f"{where}: {e}") from None
    except (KeyError, TypeError, IndexError, AttributeError):
        raise ResultsError(f"{where}: the fingerprint's GPU entry is malformed") from None
    for i, case in enumerate(data["cases"]):
        if not isinstance(case, dict) or not isinstance(case.get("name"), str):
            raise ResultsError(f"{where}: case {i} has no name")
        check = case.get("check")
        if not isinstance(check, dict) or not isinstance(check.get("ok"), bool):
            raise ResultsError(f"{where}: case {case['name']!r} has no check outcome")
        for key in ("params", "derived"):
            if not isinstance(case.get(key, {}), dict):
                raise ResultsError(f"{where}: case {case['name']!r}: field {key!r} is not an object")
        if check["ok"]:
            samples = case.get("samples_us")
            if not isinstance(samples, list) or not samples or not isinstance(case.get("summary"), dict):
                raise ResultsError(f"{where}: case {case['name']!r} passed its check but has no samples")
            if not isinstance(case.get("mode"), str):
                raise ResultsError(f"{where}: case {case['name']!r} has no mode")
            problem = _median_problem(case["summary"].get("median_us"))
            if problem:
                raise ResultsError(f"{where}: case {case['name']!r}: the stored median {problem}")
    _current_keys(data, where)
    return data


def load_run(path: Path, needs: dict[str, tuple[Need, ...]] | None = None, reader: str = "this command",
             gpu_only: bool = False) -> dict:
    """Load and validate one suite result file; raises ResultsError with the reason, never returns bad data (a
    case with a bad field is left out, counted on stderr: result_cases.py). `needs`: the kinds (components) `reader` takes, each with the fields it reads; `gpu_only`: a CPU smoke run
    is refused (its numbers support no conclusion)."""
    run = validate_run(read_json(path), str(path))
    if needs is not None and run["component"] not in needs:
        raise ResultsError(f"{path}: a {run['component']!r} result; {reader} needs a {' or '.join(needs)} result")
    # every field a command reads, checked in the one reader: a case with a bad one left out and counted
    run = result_cases.read(run, str(path), needs[run["component"]] if needs is not None else ())
    refused = stance.refusal(run, path) if gpu_only else None
    if refused:
        raise ResultsError(refused)
    return run
