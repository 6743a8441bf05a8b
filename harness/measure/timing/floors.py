"""How near one of our kernels runs to its limit: its memory floor (the bytes it must move at the copy bandwidth
measured in the same run, ceiling.py) and its latency floor (empty kernels of its own grids, timed as the case was).

The larger floor binds; the case's time over it (x_floor) says what is left to gain. Engine rows get no floors.
"""
from __future__ import annotations

from typing import Callable

from verifybench.harness.measure.timing.runner import run_case
from verifybench.harness.measure.stance import withhold_on_cpu
from verifybench.harness.measure.timing.timer import Measurement
from verifybench.kernels.common import empty

COLUMNS = ("mem_floor_us", "lat_floor_us", "bound", "x_floor")  # what a CPU run withholds: figures of CPU times
NOTE = ("mem_floor_us: bytes_moved at the copy bandwidth measured in this run (ceiling.py); lat_floor_us: empty "
        "kernels of the same grids and warps, timed the same way; bound: the larger floor; x_floor: time / it")

MAX_TIME_S = 0.5  # per floor: empty kernels in a graph meet the 1% target in a few samples; this bounds the rest
_TIMED: dict[tuple, float] = {}  # (launches, mode, device, calls per sample) -> median us, once per process


def _nothing_to_check() -> tuple[bool, str]:
    return True, "empty kernels: nothing to check"


def latency_floor_us(launches: list[empty.Launch], m: Measurement) -> float:
    """Median per-call time of empty kernels launched as `launches` (grids, warps, PDL), timed as the case `m` was:
    through runner.run_case (the one engine, the CPU rule on a CPU), in its mode, on its device, with as many calls per
    sample (in graph mode, a graph of as many calls as the case's), for at most MAX_TIME_S. Cases of the same grids
    share one timing."""
    key = (tuple(launches), m.mode, m.device, m.calls_per_sample)
    if key not in _TIMED:
        case = run_case("latency_floor", {}, lambda: empty.launch(launches), check=_nothing_to_check, mode=m.mode,
                        device=m.device, calls_per_sample=m.calls_per_sample, max_time_s=MAX_TIME_S)
        _TIMED[key] = case.measurement.median_us
    return _TIMED[key]


def figures(m: Measurement, memory_floor_us: float, launches: list[empty.Launch]) -> dict:
    """A case's floor figures beside its memory floor: latency_floor_us, the launches it stands for, bound ("memory"
    or "latency": the larger floor) and x_floor (the case's median / that floor)."""
    latency_us = latency_floor_us(launches, m)
    return {"latency_floor_us": latency_us, "latency_floor_launches": [one.as_dict() for one in launches],
            "bound": "memory" if memory_floor_us >= latency_us else "latency",
            "x_floor": m.median_us / max(memory_floor_us, latency_us)}


def table(records: list[dict], label: Callable[[dict], dict]) -> list[dict]:
    """One row per passing record with floors: label(record)'s columns, its launches' grids, its median (us) and
    COLUMNS; from a CPU run the floors are withheld (figures of CPU times say nothing of a GPU's limits)."""
    rows = [{**label(r), "grids": grids(r["derived"]["latency_floor_launches"]), "us": r["summary"]["median_us"],
             "mem_floor_us": r["derived"]["floor_us"], "lat_floor_us": r["derived"]["latency_floor_us"],
             "bound": r["derived"]["bound"], "x_floor": r["derived"]["x_floor"]}
            for r in records if r["check"]["ok"] and "summary" in r and "latency_floor_us" in r.get("derived", {})]
    return withhold_on_cpu(records, rows, COLUMNS)


def grids(launches: list[dict]) -> str:
    """The launches' grids as a table cell: "64x8+96x4" (programs per axis, one term per launch); a sequence that
    repeats (one launch per request) as "4*(64x8+96x4)"."""
    terms = ["x".join(map(str, one["grid"])) for one in launches]
    period = next((p for p in range(1, len(terms)) if terms == terms[:p] * (len(terms) // p)), len(terms))
    text = "+".join(terms[:period])
    return text if period == len(terms) else f"{len(terms) // period}*({text})"


def title(what: str) -> str:
    """The floors table's title: what it holds and how each column is made."""
    return f"{what}, near the limit ({NOTE})"
