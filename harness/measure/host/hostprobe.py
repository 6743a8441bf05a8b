"""Host CPU speed probe: a fixed pure-interpreter workload, timed with perf_counter beside the real samples.

Eager launch rate, `replay()` cost and sync round trips are CPU work. On the lent H200 VMs the CPU runs in two
states, fast and about 1.7x slower, flipping every 0.05-4 s with load we cannot see (other guests on the same
cores); host-timed figures follow the probe (Spearman rho ~0.7), so a run's host-timed medians were a mix of the
two states in proportions that differed run to run.

HostGate keeps a batch of samples only when the probe read the fast state before and after it: host-timed figures
are then the host's cost at full speed, reproducible between runs, and each case records how many batches it
dropped (VERIFYBENCH_HOST_GATE=off keeps every batch). `compare` also shows how far the probe moved (host_%).

`verifybench hostprobe` (harness/measure/hostnoise.py) samples the probe over time and shows how much the host's
speed wanders.
"""
from __future__ import annotations

import math
import statistics
import time

from verifybench.kernels.common import settings

PROBE_ITERS = 2000  # about 40-80 us of interpreter work on the CPUs we run on


def _work(iters: int) -> int:
    acc = 0
    for i in range(iters):
        acc += i * i
    return acc


def probe_us(reps: int = 5) -> float:
    """Median microseconds of `reps` runs of the fixed loop: the host's current speed for interpreter work."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _work(PROBE_ITERS)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


SLOW_FACTOR = 1.4  # fast state ~85-105 us, slow ~130-170 us on the lent VMs: 1.4x the fastest read splits them
CALIBRATE_S = 0.3  # first read of a process: probe this long for the fast-state reference (fast spells: ~0.2 s)
GATE_ENV = settings.HOST_GATE


class HostGate:
    """Says whether the host is in its fast state: probe <= SLOW_FACTOR x the fastest probe this process has read."""

    def __init__(self, probe=probe_us, factor: float = SLOW_FACTOR, calibrate_s: float = CALIBRATE_S):
        self.probe, self.factor, self.calibrate_s = probe, factor, calibrate_s
        self.ref_us = math.inf

    def read(self) -> tuple[float, bool]:
        """(probe us, fast?). The first read probes for calibrate_s to find the fast state's level."""
        if self.ref_us == math.inf:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < self.calibrate_s or self.ref_us == math.inf:
                self.ref_us = min(self.ref_us, self.probe())
        p = self.probe()
        self.ref_us = min(self.ref_us, p)
        return p, p <= self.factor * self.ref_us


_process_gate: HostGate | None = None


def process_gate() -> HostGate | None:
    """The process-wide gate (one fast-state reference per process), or None when VERIFYBENCH_HOST_GATE=off."""
    global _process_gate
    setting = settings.read(GATE_ENV, "on").strip().lower()
    if setting not in ("on", "off"):
        raise ValueError(f"{GATE_ENV} must be on or off, got {setting!r}")
    if setting == "off":
        return None
    if _process_gate is None:
        _process_gate = HostGate()
    return _process_gate
