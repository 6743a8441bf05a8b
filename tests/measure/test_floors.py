"""Floors of our kernels' cases (harness/measure/timing/floors.py): the latency floor is the empty kernels of the case's grids
timed by the one engine as the case was, the bound is the larger of the two floors, x_floor the time over it, and the
table withholds them from a CPU run."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels modules are first imported (conftest too)

from verifybench.harness.measure.timing import floors  # noqa: E402
from verifybench.harness.measure.results.store import WITHHELD  # noqa: E402
from verifybench.harness.measure.results.tables import render  # noqa: E402
from verifybench.harness.measure.timing.timer import Measurement  # noqa: E402
from verifybench.kernels.common.empty import Launch  # noqa: E402

LAUNCHES = [Launch((2, 3), 4), Launch((6, 1), 4)]


def _measurement(median_us: float, device: str = "cpu", calls: int = 2) -> Measurement:
    return Measurement(mode="graph", device=device, timer="perf_counter", samples_us=[median_us, median_us],
                       calls_per_sample=calls, warmup_calls=1, stop_reason="fixed_samples", wall_s=0.01)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter and the CPU sampling rule")
def test_latency_floor_times_the_empty_kernels_through_run_case_as_the_case_was_and_once_per_grid(monkeypatch):
    calls = []
    real = floors.run_case

    def counted(name, params, fn, **kw):
        calls.append(kw)
        return real(name, params, fn, **kw)

    monkeypatch.setattr(floors, "run_case", counted)
    monkeypatch.setattr(floors, "_TIMED", {})
    m = _measurement(1000.0, calls=3)
    first = floors.latency_floor_us(LAUNCHES, m)
    assert first > 0 and floors.latency_floor_us(list(LAUNCHES), m) == first  # same grids: one timing
    assert calls == [{"check": floors._nothing_to_check, "mode": "graph", "device": "cpu", "calls_per_sample": 3,
                      "max_time_s": floors.MAX_TIME_S}]
    floors.latency_floor_us(LAUNCHES[:1], m)
    assert len(calls) == 2  # other grids: timed again


@pytest.mark.parametrize("memory_us, latency_us, bound, floor_us", [(2.0, 5.0, "latency", 5.0),
                                                                    (10.0, 5.0, "memory", 10.0)])
def test_the_bound_is_the_larger_floor_and_x_floor_the_time_over_it(monkeypatch, memory_us, latency_us, bound,
                                                                     floor_us):
    monkeypatch.setattr(floors, "latency_floor_us", lambda launches, m: latency_us)
    got = floors.figures(_measurement(40.0), memory_us, LAUNCHES)
    assert got["bound"] == bound and got["latency_floor_us"] == latency_us
    assert got["x_floor"] == pytest.approx(40.0 / floor_us) == pytest.approx(40.0 / max(memory_us, latency_us))
    assert got["latency_floor_launches"] == [one.as_dict() for one in LAUNCHES]


def _record(device: str, batch_launches: int = 1) -> dict:
    return {"name": "x/ours", "params": {"n": 3}, "device": device, "check": {"ok": True},
            "summary": {"median_us": 30.0},
            "derived": {"floor_us": 2.0, "latency_floor_us": 6.0, "bound": "latency", "x_floor": 5.0,
                        "latency_floor_launches": [one.as_dict() for one in LAUNCHES] * batch_launches}}


def test_the_table_shows_each_case_beside_its_floors_and_withholds_them_from_a_cpu_run():
    engine_row = {**_record("cuda"), "derived": {"floor_us": 2.0}}  # no latency floor: no row
    [gpu] = floors.table([_record("cuda", 2), engine_row], lambda r: {"n": r["params"]["n"]})
    assert gpu == {"n": 3, "grids": "2*(2x3+6x1)", "us": 30.0, "mem_floor_us": 2.0, "lat_floor_us": 6.0,
                   "bound": "latency", "x_floor": 5.0}
    [cpu] = floors.table([_record("cpu")], lambda r: {"n": r["params"]["n"]})
    assert cpu["grids"] == "2x3+6x1" and cpu["us"] == 30.0
    assert all(cpu[k] == WITHHELD for k in floors.COLUMNS)
    assert "withheld (CPU numbers): mem_floor_us, lat_floor_us, bound, x_floor" in render([cpu])
    assert "mem_floor_us" in floors.title("ours") and "x_floor" in floors.title("ours")
