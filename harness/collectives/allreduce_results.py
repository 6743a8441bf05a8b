"""Allreduce results across ranks: per-rank records -> one Case per (size, mode) with the max over ranks, the
nccl-tests style table, and the measured figure a one-GPU verify stands in for its allreduces, read back from an
allreduce result or a sweep summary."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from verifybench.harness.measure import stance
from verifybench.harness.measure.results import store
from verifybench.harness.collectives.backends import ALL_BACKENDS, ELEMENT_BYTES, GPU_BACKENDS
from verifybench.harness.measure.timing.runner import Case
from verifybench.harness.measure.timing.timer import Measurement

COMPONENT = "allreduce"
MODES = ("graph", "eager", "isolated")
ENGINE_MODE = {"graph": "graph", "eager": "hot", "isolated": "isolated"}


def measurement_from_dict(d: dict) -> Measurement:
    keys = ("mode", "device", "timer", "samples_us", "calls_per_sample", "warmup_calls", "stop_reason", "wall_s",
            "clocks_before", "clocks_after")
    return Measurement(**{k: d[k] for k in keys}, host_probe_us=d.get("host_probe_us") or [])


def busbw_factor(world_size: int) -> float:
    """nccl-tests: allreduce busbw = algbw x 2(n-1)/n."""
    return 2 * (world_size - 1) / world_size


def build_cases(backend: str, per_rank: list[list[dict]], plan: dict, world_size: int) -> list[Case]:
    """One Case per (size, mode): time = max over ranks of each rank's median, samples of that slowest rank."""
    cases = []
    for i, (size, origin) in enumerate(plan["sizes"]):
        recs = [r[i] for r in per_rank]
        checks = recs[0]["checks"]
        errors = [f"rank {r}: {c['error']}" for r, c in enumerate(checks) if c["error"]]
        wrong_check = sum((c["wrong_eager"] or 0) + (c["wrong_graph"] or 0) for c in checks)
        count = size // ELEMENT_BYTES
        for mode in plan["modes"]:
            params = {"size_bytes": size, "count": count, "dtype": "bf16", "backend": backend, "mode": mode,
                      "engine_mode": ENGINE_MODE[mode], "world_size": world_size, "origin": origin,
                      "preset": plan["preset"], "tp": plan["tp"], "hidden": plan["hidden"]}
            name = f"allreduce/{backend}/{size}B/{stance.case_mode(mode, 'cpu' if backend == 'gloo' else 'cuda')}"
            timed = [r["modes"].get(mode) for r in recs]
            if errors or wrong_check or not all(timed):
                detail = "; ".join(errors) or f"#wrong {wrong_check} (eager + graph-replay checks, all ranks)"
                cases.append(Case(name, params, False, detail, derived={"wrong": wrong_check}))
                continue
            meds = [t["measurement"]["summary"]["median_us"] for t in timed]
            p99s = [float(np.percentile(t["measurement"]["samples_us"], 99)) for t in timed]
            slowest = int(np.argmax(meds))
            wrong_after = sum(t["wrong_after"] or 0 for t in timed)
            time_us = meds[slowest]
            algbw = size / time_us / 1e3
            derived = {"time_us": time_us, "algbw_gbps": algbw, "busbw_gbps": algbw * busbw_factor(world_size),
                       "wrong": wrong_check + wrong_after, "p50_us": time_us, "p99_us": max(p99s),
                       "rank_medians_us": meds, "rank_p99_us": p99s, "slowest_rank": slowest,
                       "calls_per_sample": timed[slowest]["measurement"]["calls_per_sample"]}
            checked = "eager" + (", graph replay x2" if checks[0]["wrong_graph"] is not None else "")
            checked += "" if timed[0]["wrong_after"] is None else ", output after the timed calls"
            ok = wrong_after == 0
            detail = f"#wrong {wrong_check + wrong_after} of {count} x {world_size} ranks ({checked})"
            cases.append(Case(name, params, ok, detail, measurement_from_dict(timed[slowest]["measurement"]),
                              derived) if ok else Case(name, params, False, detail, derived=derived))
    return cases


def table_rows(case_records: list[dict]) -> list[dict]:
    """nccl-tests columns from stored case records; a failed check shows FAIL, never a time."""
    rows = []
    for c in case_records:
        p, d = c["params"], c["derived"]
        row = {"size(B)": p["size_bytes"], "count": p["count"], "type": p["dtype"], "backend": p["backend"],
               "mode": p["mode"]}
        if c["check"]["ok"]:
            row.update({"time(us)": d["time_us"], "algbw(GB/s)": d["algbw_gbps"], "busbw(GB/s)": d["busbw_gbps"],
                        "#wrong": d["wrong"], "p99(us)": d["p99_us"], "slowest rank": d["slowest_rank"]})
        else:
            row.update({"time(us)": "FAIL", "algbw(GB/s)": "", "busbw(GB/s)": "", "#wrong": d.get("wrong", "?"),
                        "p99(us)": "", "slowest rank": ""})
        if c.get("device") == "cpu":  # gloo timed on the CPU: a CPU loop's label, no bandwidth from a CPU time
            row = stance.withhold([{**row, "mode": stance.cpu_mode(row["mode"])}], stance.rate)[0]
        rows.append(row)
    return rows


def best_rows(case_records: list[dict], mode: str = "graph") -> list[dict]:
    """Per size, the fastest backend in `mode` and its margin over the runner-up."""
    by_size: dict[int, list[tuple[float, str]]] = {}
    for c in case_records:
        if c["check"]["ok"] and c["params"]["mode"] == mode:
            by_size.setdefault(c["params"]["size_bytes"], []).append((c["derived"]["time_us"], c["params"]["backend"]))
    rows = []
    for size, entries in sorted(by_size.items()):
        entries.sort()
        row = {"size(B)": size, f"best ({mode})": entries[0][1], "time(us)": entries[0][0]}
        if len(entries) > 1:
            row.update({"runner-up": entries[1][1], "x faster": entries[1][0] / entries[0][0]})
        rows.append(row)
    return rows


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """The component's tables over stored records (the verifybench CLI's component interface)."""
    out = [("allreduce (time = max over ranks of the per-rank median)", table_rows(records))]
    if any(c.get("device") == "cuda" for c in records):  # only CPU-timed backends: no ranking (stance.py)
        out.append(("fastest backend per size, graph mode", best_rows(records)))
    return out


# ---- a measured figure for the one-GPU stand-in ----

STAND_IN_MODES = ("graph", "eager", "isolated")  # engines replay their allreduces inside CUDA graphs: graph first
STAND_IN_DECIMALS = 2  # 0.01 us: finer than any allreduce median can be told apart


def _split_spec(spec: str) -> tuple[Path, str | None]:
    """'PATH' or 'PATH:BACKEND' (BACKEND one of ALL_BACKENDS; any other colon belongs to the path)."""
    head, sep, tail = spec.rpartition(":")
    return (Path(head), tail) if sep and tail in ALL_BACKENDS else (Path(spec), None)


def stand_in_from_result(spec: str, size_bytes: int | None = None) -> tuple[float, str]:
    """(latency us, source) from an allreduce result or a sweep summary: the time (max over ranks of the per-rank
    median) of the named backend, else the fastest one (in a sweep: under its fastest setting), in graph mode where
    measured. At `size_bytes` (the forward's hidden x n x 2 B): the nearest measured size; without it, the median
    over the file's verify sizes (hidden x n tokens x 2 B). Only the GPU backends' cases where the file has any;
    gloo's (CPU numbers, labelled so) only where it has none and no GPU is here. Rounded to STAND_IN_DECIMALS.
    Raises ValueError, naming the file, when it has none."""
    path, backend = _split_spec(spec)
    run = store.load_run(path)
    if run["component"] not in (COMPONENT, "allreduce_sweep"):
        raise ValueError(f"{path}: an allreduce result or NCCL sweep summary is needed, got {run['component']!r}")
    cases = [c for c in run["cases"] if c["check"]["ok"] and (backend is None or c["params"]["backend"] == backend)]
    on_gpu = torch.cuda.is_available()
    # the job's default backend set includes gloo: its host times sit beside the GPU backends' in most files and
    # never stand in for them
    gpu_cases = [c for c in cases if c["params"]["backend"] in GPU_BACKENDS and c.get("device") != "cpu"]
    if gpu_cases:
        cases = gpu_cases
    elif on_gpu and cases:
        raise ValueError(f"{path}: a CPU (gloo) run: its times are not a GPU allreduce latency (no case of "
                         f"{', '.join(GPU_BACKENDS)})")
    mode = next((m for m in STAND_IN_MODES if any(c["params"]["mode"] == m for c in cases)), None)
    if mode is None:
        raise ValueError(f"{path}: no passing allreduce case" + (f" of backend {backend}" if backend else ""))
    if not gpu_cases:
        label = " (CPU numbers: gloo)"
    elif not on_gpu:
        label = f" (a GPU figure, measured on {run['fingerprint'].get('gpu_model') or 'a GPU'})"
    else:
        label = ""
    series: dict[str, dict[int, float]] = {}  # who -> size -> time
    origin: dict[int, str] = {}
    for c in cases:
        if c["params"]["mode"] == mode:
            p = c["params"]
            who = p["backend"] + (f" under NCCL setting {p['nccl_setting']}" if "nccl_setting" in p else "")
            series.setdefault(who, {})[p["size_bytes"]] = c["derived"]["time_us"]
            origin[p["size_bytes"]] = p.get("origin", "")
    if size_bytes is not None:
        sizes = sorted({s for times in series.values() for s in times})
        size = min(sizes, key=lambda s: (abs(math.log(s / size_bytes)), s))
        picks = {who: times[size] for who, times in series.items() if size in times}
        where = f"at {size} B" + ("" if size == size_bytes else f" (the size nearest {size_bytes} B)")
    else:
        verify = sorted(s for s, o in origin.items() if re.fullmatch(r"\d+ tok", o))
        if not verify:
            raise ValueError(f"{path}: no verify sizes (hidden x n tokens x 2 B) measured; give the forward's size")
        picks = {who: _median([times[s] for s in verify if s in times]) for who, times in series.items()
                 if all(s in times for s in verify)}
        where = f"median over its {len(verify)} verify sizes {verify[0]}-{verify[-1]} B"
    if not picks:
        raise ValueError(f"{path}: no backend measured every size asked for")
    who = min(picks, key=picks.get)
    chosen = "" if backend else (", the fastest" if len(picks) > 1 else "")
    source = f"{path}: {who}{chosen}, {mode} mode, {where}{label}"
    return round(picks[who], STAND_IN_DECIMALS), source


def _median(values: list[float]) -> float:
    return float(np.median(values))


# ---- a measured time at any message size, for costing B requests at once ----

def size_series(run: dict) -> tuple[dict[tuple[str, str | None], dict[int, float]], str]:
    """{(backend, NCCL setting or None): {size bytes: time us}} of an allreduce result or sweep summary's passing
    cases, in the first of STAND_IN_MODES it measured, and that mode. Only the GPU backends' cases where it has any
    (a multi-GPU job's gloo rows are host times beside them); gloo's where it has nothing else."""
    cases = [c for c in run["cases"] if c["check"]["ok"]]
    gpu = [c for c in cases if c["params"]["backend"] in GPU_BACKENDS and c.get("device") != "cpu"]
    cases = gpu or cases
    mode = next((m for m in STAND_IN_MODES if any(c["params"]["mode"] == m for c in cases)), None)
    series: dict[tuple[str, str | None], dict[int, float]] = {}
    for c in cases:
        if c["params"]["mode"] == mode:
            p = c["params"]
            series.setdefault((p["backend"], p.get("nccl_setting")), {})[p["size_bytes"]] = c["derived"]["time_us"]
    return series, mode


def time_at_size(times: dict[int, float], size_bytes: int) -> tuple[float, str] | None:
    """(us per call, how) at `size_bytes` from measured {size: us}: the measured time where that size ran, else
    linear in log(size) between the two measured sizes around it (an allreduce's time grows with the log of its
    size far more evenly than with the size over the latency-bound range the verify sits in); None outside the
    measured sizes, where a guess would rest on no measurement."""
    sizes = sorted(times)
    if not sizes or not sizes[0] <= size_bytes <= sizes[-1]:
        return None
    if size_bytes in times:
        return times[size_bytes], f"measured at {size_bytes} B"
    lo = max(s for s in sizes if s < size_bytes)
    hi = min(s for s in sizes if s > size_bytes)
    us = float(np.interp(math.log(size_bytes), [math.log(lo), math.log(hi)], [times[lo], times[hi]]))
    return us, f"interpolated on a log size scale between {lo} and {hi} B"
