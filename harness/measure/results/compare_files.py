"""The two kinds of result file compare reads (the suite's and pytest-benchmark's JSON), as per-case samples: the
samples are the truth, a stored summary that disagrees with them or a null, non-finite or non-positive figure is
refused (ResultsError naming the file)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verifybench.harness.measure import stance
from verifybench.harness.measure.results import store
from verifybench.harness.measure.timing.modes import host_timed
from verifybench.harness.measure.timing.stats import Summary, summarize


@dataclass
class CaseData:
    name: str
    mode: str | None
    ok: bool
    median_us: float | None = None
    samples_us: np.ndarray | None = None
    interval_us: tuple[float, float] | None = None  # median CI, or q1..q3 when that is all a file has
    throttled: bool = False
    host_probe_us: float | None = None  # mean of the engine's host-speed probes around the case (hostprobe.py)
    host_timed: bool = False  # its samples include host time (modes.host_timed)
    process_state: dict | None = None  # timer.process_state() when the case was sampled
    skipped: str | None = None  # why it could not run (no P2P, too little memory): kept out of the verdicts
    device: str | None = None  # "cpu": perf_counter times of CPU code (stance.py: no verdict from them)


@dataclass
class RunData:
    path: Path
    kind: str  # "suite" | "pytest-benchmark"
    fingerprint: dict
    cases: dict[str, CaseData]
    method_version: int | None = None  # None: a file from before results carried it


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v))


def _probe(values) -> float | None:
    finite = [float(v) for v in values if _number(v)] if isinstance(values, list) else []
    return float(np.mean(finite)) if finite else None


def _samples(raw, where: str) -> np.ndarray | None:
    """The samples as an array, or ResultsError: all null (NaN/inf when stored), non-numbers, negatives."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise store.ResultsError(f"{where}: samples are not a non-empty list")
    if all(v is None for v in raw):
        raise store.ResultsError(f"{where}: every sample is null (NaN or inf when measured)")
    bad = sum(not _number(v) for v in raw)
    if bad:
        raise store.ResultsError(f"{where}: {bad} of {len(raw)} samples are null, non-finite or not numbers")
    x = np.asarray(raw, dtype=float)
    if (x < 0).any():
        raise store.ResultsError(f"{where}: {int((x < 0).sum())} samples are negative")
    return x


def _positive(value, what: str, where: str) -> float:
    if value is None:
        raise store.ResultsError(f"{where}: {what} is null or missing")
    if not _number(value):
        raise store.ResultsError(f"{where}: {what} is not a finite number ({value!r})")
    if value <= 0:
        raise store.ResultsError(f"{where}: {what} must be > 0, got {value!r}")
    return float(value)


def _consistent(samples: np.ndarray, stored: dict, scale: float, where: str) -> Summary:
    """The summary recomputed from the samples; ResultsError when a stored figure disagrees with it (a file edited,
    or samples replaced under a stale summary). `stored`: stat -> stored value (times in us / `scale`)."""
    summary = summarize(samples)
    for key, value in stored.items():
        if value is None:
            continue
        got = float(summary.n) if key == "n" else getattr(summary, f"{key}_us")
        want = float(value) * (1 if key == "n" else scale) if _number(value) else None
        if want is None or abs(want - got) > 1e-6 * max(abs(got), 1e-12):
            raise store.ResultsError(f"{where}: the stored {key} ({value!r}) disagrees with its {summary.n} "
                                       f"samples' ({got:.6g}{'' if key == 'n' else ' us'}): an edited or corrupt file")
    return summary


def _from_suite(path: Path, data: dict) -> RunData:
    run = store.validate_run(data, str(path))
    cases = {}
    cpu_run = stance.is_cpu_run(run)
    for c in run["cases"]:
        if cpu_run or c.get("device") == "cpu":  # an older file's .../graph is this version's .../cpu-loop
            c = {**c, "name": stance.cpu_case_name(c["name"])}
        where = f"{path}: case {c['name']!r}"
        if c["name"] in cases:
            raise store.ResultsError(f"{where} appears twice")
        mode = stance.mode_label(c)  # a CPU record's as its tables say it (old files stored `graph`)
        if c.get("skipped"):
            cases[c["name"]] = CaseData(c["name"], mode, ok=False, skipped=str(c["skipped"]), device=c.get("device"))
            continue
        if not c["check"]["ok"]:
            cases[c["name"]] = CaseData(c["name"], mode, ok=False, device=c.get("device"))
            continue
        s = c["summary"]  # its median was checked by validate_run
        samples = _samples(c["samples_us"], where)
        summary = _consistent(samples, {"n": s.get("n"), "median": s.get("median_us"), "min": s.get("min_us"),
                                        "max": s.get("max_us")}, 1.0, where)
        _positive(summary.median_us, "the median of the samples", where)
        bounded = np.isfinite(summary.ci_low_us) and np.isfinite(summary.ci_high_us)
        cases[c["name"]] = CaseData(c["name"], mode, True, summary.median_us, samples,
                                    (summary.ci_low_us, summary.ci_high_us) if bounded else (summary.q1_us,
                                                                                           summary.q3_us),
                                    bool(c.get("throttled")), _probe(c.get("host_probe_us")),
                                    host_timed(c["mode"], c.get("device", "cuda")), c.get("process_state"),
                                    device=c.get("device"))
    version = run.get("method_version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):  # "2" is not 2
        raise store.ResultsError(f"{path}: method_version must be an integer, got {version!r}")
    return RunData(path, "suite", run["fingerprint"], cases, version)


def _from_pytest_benchmark(path: Path, data: dict) -> RunData:
    if not isinstance(data.get("benchmarks"), list):
        raise store.ResultsError(f"{path}: pytest-benchmark JSON without a 'benchmarks' list")
    cases = {}
    for b in data["benchmarks"]:
        try:
            st = b["stats"]
            extra = b.get("extra_info") or {}
            # the suite's case name when our adapter ran it: pytest and CLI results of a case then line up
            name = extra.get("case") or b.get("fullname") or b["name"]
            name = stance.cpu_case_name(name) if extra.get("device") == "cpu" else name  # as _from_suite
            where = f"{path}: benchmark {name!r}"
            if name in cases:
                raise store.ResultsError(f"{where} appears twice")
            median_us = _positive(st.get("median"), "the stored median", where) * 1e6
            samples = _samples(st.get("data"), where)
            if samples is not None:
                samples = samples * 1e6
                summary = _consistent(samples, {"n": st.get("rounds"), "median": st.get("median"),
                                                "min": st.get("min"), "max": st.get("max")}, 1e6, where)
                median_us = _positive(summary.median_us, "the median of the samples", where)
                interval = (summary.q1_us, summary.q3_us)
            else:
                q1, q3 = (_positive(st.get(k), f"the stored {k}", where) * 1e6 for k in ("q1", "q3"))
                if not q1 <= median_us <= q3:
                    raise store.ResultsError(f"{where}: the stored q1 <= median <= q3 does not hold")
                interval = (q1, q3)
            cases[name] = CaseData(name, stance.mode_label(extra), True, median_us, samples, interval,
                                   bool(extra.get("throttled")), _probe(extra.get("host_probe_us")),
                                   host_timed(extra.get("mode") or "", extra.get("device") or "cuda"),
                                   extra.get("process_state"), device=extra.get("device"))
        except (KeyError, TypeError, AttributeError) as e:
            raise store.ResultsError(f"{path}: malformed benchmark entry ({e!r})") from None
    machine = data.get("machine_info")
    machine = machine if isinstance(machine, dict) else {}
    fp = machine.get("verifybench")
    if fp is not None and not isinstance(fp, dict):
        raise store.ResultsError(f"{path}: machine_info.verifybench is not an object")
    version = machine.get("verifybench_method_version")
    return RunData(path, "pytest-benchmark", fp or {}, cases, version if isinstance(version, int) else None)


def load(path: Path) -> RunData:
    """Either format; anything else raises ResultsError naming the file and the reason. Samples, when present, are
    the truth: the summary is recomputed from them, and a stored one that disagrees is refused."""
    data = store.read_json(path)
    try:
        if "schema" in data:
            return _from_suite(Path(path), data)
        if "benchmarks" in data and "machine_info" in data:
            return _from_pytest_benchmark(Path(path), data)
    except (KeyError, TypeError, AttributeError) as e:
        raise store.ResultsError(f"{path}: malformed result file ({e!r})") from None
    raise store.ResultsError(f"{path}: neither a verifybench result nor a pytest-benchmark JSON file")
