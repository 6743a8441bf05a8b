"""The suite's own scheduling (tests/early_jobs.py, conftest.py): the tiny run starts at collection and its readers
run last, serial compiles split in order, fault jobs run at once."""
import os
import sys
import time

import early_jobs
from torchrun_jobs import run_jobs_at_once


def test_the_tiny_run_starts_at_collection_and_its_readers_run_last(request):
    reads = ["run_dir" in getattr(item, "fixturenames", ()) for item in request.session.items]
    assert reads == sorted(reads)  # every reader after every other test
    assert early_jobs.started_at_collection == ({"run"} if any(reads) else set())


def test_in_halves_returns_the_results_in_order_from_two_calls_at_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    calls = []

    def double(items):
        calls.append(list(items))
        time.sleep(0.5)
        return [2 * i for i in items]

    t0 = time.monotonic()
    assert early_jobs.in_halves(double, [1, 2, 3, 4, 5]) == [2, 4, 6, 8, 10]
    assert time.monotonic() - t0 < 0.9 and sorted(calls) == [[1, 2], [3, 4, 5]]
    monkeypatch.delenv("TRITON_INTERPRET")  # compiles in this process: one call, no threads
    calls.clear()
    assert early_jobs.in_halves(double, [1, 2]) == [2, 4] and calls == [[1, 2]]


def test_jobs_run_at_once_each_with_its_own_outcome():
    sleep = [sys.executable, "-c", "import sys, time; time.sleep(2); print(sys.argv[1:]); sys.exit(3)"]
    t0 = time.monotonic()
    done = run_jobs_at_once([sleep, sleep + ["x"]], 60)
    assert time.monotonic() - t0 < 3.8  # not one after the other
    (rc0, out0, _, tag0), (rc1, out1, _, tag1) = done
    assert rc0 == rc1 == 3 and tag0 != tag1 and tag0 in out0 and "'x'" in out1 and tag1 in out1
