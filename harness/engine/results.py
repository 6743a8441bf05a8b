"""Results store: one versioned JSON schema for every component, atomic writes, validated loads.

A file holds a run of one component: its fingerprint and a list of case records (parameters, mode, samples and
summary, derived figures, correctness outcome). A case whose check failed carries no time.
"""
from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from verifybench.harness.engine.timing import Measurement
from verifybench.kernels.config_tables import write_atomic  # noqa: F401 (the one atomic writer, for callers)

SCHEMA = "verifybench.result"
SCHEMA_VERSION = 1
# The measuring method's version, stored in every result; compare warns when two files differ in it.
# 1: graph mode sized K from eager host calls. 2: K from the device time of one call, samples start with the op
# queued behind a 100 us device spin.
METHOD_VERSION = 2
DEFAULT_OUT = Path("verifybench-results")  # relative to the working directory: never inside results/ by default


WITHHELD = "withheld: CPU numbers"  # in a table cell: a figure CPU timer noise cannot support


def cpu_numbers(records: list[dict]) -> bool:
    """Whether stored case records come from a CPU run (perf_counter samples of torch CPU code): their derived
    conclusions (fits, ratios, eta, break-even) are withheld in tables and reports."""
    return any(r.get("device") == "cpu" for r in records)


def withhold(rows: list[dict], keys) -> list[dict]:
    """Table rows with the cells under `keys` (a collection, or a predicate on the column name) replaced by
    WITHHELD where they hold a value."""
    hit = keys if callable(keys) else (lambda k: k in keys)
    return [{k: (WITHHELD if hit(k) and v is not None else v) for k, v in row.items()} for row in rows]


def withhold_on_cpu(records: list[dict], rows: list[dict], keys) -> list[dict]:
    """The one withholding rule: every derived figure (fit, ratio, eta, share, break-even, gain) of a table passes
    through here; from a CPU run (cpu_numbers) its cells read WITHHELD, from a GPU run they stay."""
    return withhold(rows, keys) if cpu_numbers(records) else rows


# What a mode means when the samples are perf_counter times of CPU code (engine/timing.py's CPU sampler)
CPU_MODE_LABELS = {"graph": "cpu-loop", "hot": "cpu-hot", "cold": "cpu-cold", "cycle": "cpu-cycle"}
CPU_TIMING = "CPU: perf_counter; cpu-loop = K calls in a Python loop (no CUDA graph), cpu-cold = 64 MiB written first"


def mode_label(record: dict) -> str:
    """The mode as a table shows it: a GPU record's own; a CPU record's says it was a CPU timing (never `graph`)."""
    mode = record.get("mode")
    return CPU_MODE_LABELS.get(mode, f"cpu-{mode}") if record.get("device") == "cpu" else mode


class ResultsError(ValueError):
    """A results file that is missing, corrupt, foreign or of an unsupported version."""


@dataclass
class Case:
    """One benchmark case. `measurement` is None when `check_ok` is False: a failed check reports no time."""

    name: str
    params: dict
    check_ok: bool
    check_detail: str = ""
    measurement: Measurement | None = None
    derived: dict = field(default_factory=dict)
    skipped: str | None = None  # why the case could not run here (no P2P, too little memory): not a failure

    def as_dict(self) -> dict:
        if self.check_ok and self.measurement is None:
            raise ValueError(f"case {self.name}: a passing case needs a measurement")
        d = {
            "name": self.name,
            "params": self.params,
            "check": {"ok": self.check_ok, "detail": self.check_detail},
            "derived": self.derived,
        }
        if self.skipped:
            d["skipped"] = self.skipped
        if self.measurement is not None and self.check_ok:
            d.update(self.measurement.as_dict())
        return d


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


def write_json_atomic(path: Path, data: dict) -> Path:
    """JSON (NaN/inf stored as null; gzip when the name ends in .gz) written through write_atomic."""
    text = (json.dumps(_finite(data), indent=1, allow_nan=False) + "\n").encode()
    if Path(path).suffix == ".gz":
        text = gzip.compress(text, mtime=0)
    return write_atomic(path, lambda f: f.write(text))


def check_writable(directory: Path) -> Path:
    """Fail before measuring, not after: `directory` exists or can be made, and a file can be written in it."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / ".verifybench-write-test", lambda f: f.write(b"ok"))
        (directory / ".verifybench-write-test").unlink()
    except OSError as e:
        raise ResultsError(f"output folder {directory} is not writable: {e.strerror or e}") from None
    return directory


def default_dir(fingerprint: dict) -> Path:
    """./verifybench-results/<machine-slug>/: outside the curated results/ of the checkout."""
    return DEFAULT_OUT / fingerprint.get("slug", "unknown")


def stamp(run: dict) -> str:
    """The run's UTC time as it appears in every file name of the run (JSON, report, charts)."""
    return datetime.fromisoformat(run["created_utc"]).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def save_run(run: dict, directory: Path | None = None, name: str | None = None) -> Path:
    """Store as <directory>/<component>-<UTC time>.json (default directory: default_dir)."""
    validate_run(run, "run to save")
    directory = Path(directory) if directory else default_dir(run["fingerprint"])
    return write_json_atomic(directory / (name or f"{run['component']}-{stamp(run)}.json"), run)


def read_json(path: Path) -> dict:
    """A JSON object from `path` (gzip-compressed when the name ends in .gz: full pytest-benchmark runs with raw
    samples are ~7 MB), or ResultsError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:  # gzip's BadGzipFile is an OSError
        raise ResultsError(f"{path}: cannot read: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON (corrupt or truncated?): {e}") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: expected a JSON object at the top level")
    return data


def validate_run(data: dict, where: str) -> dict:
    if data.get("schema") != SCHEMA:
        raise ResultsError(f"{where}: not a verifybench result file (schema={data.get('schema')!r})")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultsError(f"{where}: schema version {version!r}; this verifybench reads version {SCHEMA_VERSION}")
    for key, kind in (("component", str), ("fingerprint", dict), ("cases", list)):
        if not isinstance(data.get(key), kind):
            raise ResultsError(f"{where}: field {key!r} missing or not a {kind.__name__}")
    for i, case in enumerate(data["cases"]):
        if not isinstance(case, dict) or not isinstance(case.get("name"), str):
            raise ResultsError(f"{where}: case {i} has no name")
        check = case.get("check")
        if not isinstance(check, dict) or not isinstance(check.get("ok"), bool):
            raise ResultsError(f"{where}: case {case['name']!r} has no check outcome")
        if check["ok"]:
            samples = case.get("samples_us")
            if not isinstance(samples, list) or not samples or not isinstance(case.get("summary"), dict):
                raise ResultsError(f"{where}: case {case['name']!r} passed its check but has no samples")
            if not isinstance(case.get("mode"), str):
                raise ResultsError(f"{where}: case {case['name']!r} has no mode")
    return data


def load_run(path: Path) -> dict:
    """Load and validate one suite result file; raises ResultsError with the reason, never returns bad data."""
    return validate_run(read_json(path), str(path))
