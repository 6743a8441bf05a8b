"""The one timing engine: device-timed samples of a callable in a named mode, with warm-up and adaptive stopping.
Every number the suite reports comes from `measure`, in per-call microseconds; how each mode samples: modes.py."""
from __future__ import annotations

import gc
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from verifybench.harness.measure import stance
from verifybench.harness.measure.host import fingerprint, hostprobe
from verifybench.harness.measure.timing import modes
from verifybench.harness.measure.timing.modes import MODES, cache_bytes, host_timed
from verifybench.harness.measure.timing.stats import Summary, summarize
from verifybench.kernels.common import settings
from verifybench.kernels.common.settings import positive_float

# The measuring method's version, stored in every result; compare warns when two files differ in it.
# 1: graph mode sized K from eager host calls. 2: K from the device time of one call, samples start with the op
# queued behind a 100 us device spin.
METHOD_VERSION = 2

# cold rotation: a graph-mode case that streams weights rotates over sets whose total is >= this many caches
ROTATION_CACHE_MULTIPLE = 4
ROTATION_MIN_SETS = 4
TARGET_SAMPLE_US = 500.0  # auto K aims for samples this long, so event resolution (~0.5 us) is < 0.1%
MAX_CALLS_PER_SAMPLE = 1024
DEFAULT_MAX_TIME_S = 2.0  # per case; VERIFYBENCH_MAX_TIME_S overrides (quick CPU runs)
MAX_TIME_ENV = settings.MAX_TIME_S
PHASE_PASS_CYCLES = 200  # cycles of the per-phase pass (at most as many as sampled; at least min_samples)
GATE_BATCH_S = 0.02  # gated batches stay this short, so one rarely spans a change of host state


@dataclass
class Measurement:
    """Samples of one callable in one mode. `timer` says what clock produced them."""

    mode: str
    device: str
    timer: str
    samples_us: list[float]
    calls_per_sample: int
    warmup_calls: int
    stop_reason: str
    wall_s: float
    clocks_before: dict | None = None
    clocks_after: dict | None = None
    host_probe_us: list[float] = field(default_factory=list)  # hostprobe reads before, between batches and after
    host_gate: dict | None = None  # batches kept/dropped by the host-speed gate; None when no gate ran
    process_state: dict | None = None  # process_state() when sampling began
    # cycle mode: per phase, {"device_us": [...], "host_us": [...]}, one entry per cycle of the phase pass
    phases: dict | None = None
    summary: Summary = field(init=False)

    def __post_init__(self) -> None:
        self.summary = summarize(self.samples_us)

    @property
    def median_us(self) -> float:
        return self.summary.median_us

    @property
    def host_timed(self) -> bool:
        return host_timed(self.mode, self.device)

    @property
    def throttled(self) -> bool:
        return any(c and c.get("throttled") for c in (self.clocks_before, self.clocks_after))

    def as_dict(self) -> dict:
        return {
            # a CPU record says what a person reads in its tables (cpu-loop, never `graph`: no graph ran)
            "mode": stance.cpu_mode(self.mode) if self.device == "cpu" else self.mode,
            "device": self.device,
            "timer": self.timer,
            "calls_per_sample": self.calls_per_sample,
            "warmup_calls": self.warmup_calls,
            "stop_reason": self.stop_reason,
            "wall_s": self.wall_s,
            "clocks_before": self.clocks_before,
            "clocks_after": self.clocks_after,
            "throttled": self.throttled,
            "host_probe_us": list(self.host_probe_us),
            "host_gate": self.host_gate,
            "process_state": self.process_state,
            "summary": self.summary.as_dict(),
            "samples_us": list(self.samples_us),
            **({"phases": self.phases} if self.phases is not None else {}),
        }


def max_time_from_env() -> float:
    """VERIFYBENCH_MAX_TIME_S (seconds per case, > 0), else DEFAULT_MAX_TIME_S; ValueError naming it."""
    text = settings.read(MAX_TIME_ENV)
    if text is None:
        return DEFAULT_MAX_TIME_S
    return positive_float(MAX_TIME_ENV, text, "seconds")


def process_state() -> dict:
    """What in this process moved the device cost of tiny graph nodes on an H200 (scripts/node_cost_probe.py, in
    one process: 0.857 us per node fresh, 1.035 after `import cupy`, 1.119 after a torch NCCL allreduce)."""
    dist = sys.modules.get("torch.distributed")
    group = str(dist.get_backend()) if dist is not None and dist.is_available() and dist.is_initialized() else None
    return {"cupy_imported": "cupy" in sys.modules, "process_group": group}


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cold_rotation_sets(bytes_per_set: int, device: str, max_sets: int = 64) -> int:
    """How many input/weight sets a cold case rotates over: at least ROTATION_MIN_SETS, and enough that their
    total is ROTATION_CACHE_MULTIPLE x the cache (a real forward never re-reads a layer's weights), at most
    `max_sets`."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    want = math.ceil(ROTATION_CACHE_MULTIPLE * cache_bytes(device) / bytes_per_set)
    return min(max_sets, max(ROTATION_MIN_SETS, want))


def measure(
    fn: Callable[[], object] | Sequence[Callable[[], object]],
    *,
    mode: str = "hot",
    device: str | None = None,
    calls_per_sample: int | None = None,
    barrier: Callable[[], object] | None = None,
    min_samples: int = 10,
    max_samples: int = 2000,
    rel_ci_target: float = 0.01,
    max_time_s: float | None = None,
    warmup_s: float = 0.05,
    warmup_calls: int | None = None,
    samples: int | None = None,
    flush_bytes: int | None = None,
    host_gate: "hostprobe.HostGate | None | bool" = True,
    phases: Sequence[str] | None = None,
) -> Measurement:
    """Time `fn` (or rotate over a list of callables, one per input set) and return per-call samples in us.

    Returns a Measurement: per-call samples in microseconds, with the mode, device and clock that produced them.
    mode: one of modes.MODES (modes.MODE_HELP says what each means). device: "cuda" or "cpu" (default: cuda when
    available; on CPU the timer is perf_counter and the result says so).
    L2 policy: cold writes a 2x-L2 buffer (`flush_bytes` to change it; 64 MiB on a CPU) before each sample, enqueued
    before the start event; every other mode leaves the cache as the previous call left it (a list of callables
    rotates over input sets, cold_rotation_sets says how many defeat the cache).
    Warm-up: at least 3 calls and one pass over every input set, until `warmup_s` of wall time has passed (this
    absorbs compile, autotune, lazy init and first touch); a fixed `warmup_calls` replaces that rule.
    Stopping: after `min_samples`, stop when the 95% CI of the median is within `rel_ci_target` of it, or at
    `max_samples`, or when `max_time_s` of wall time is spent (default DEFAULT_MAX_TIME_S, or the
    VERIFYBENCH_MAX_TIME_S environment variable). A fixed `samples` replaces the rule (collectives:
    every rank must run the same count). graph and hot modes: a sample is K = `calls_per_sample` calls (one
    replay of a graph of K calls, or K calls back to back between two events) / K; by default K gives a sample
    of about TARGET_SAMPLE_US (graph: from the device time of a call; see _auto_calls). Other modes: K = 1.
    The garbage collector is off while sampling.
    Host gate (hostprobe.py): on a GPU machine, with adaptive stopping, host-timed samples (`host_timed`) come in
    batches of at most GATE_BATCH_S, and a batch is kept only when the host-speed probe read the fast state before
    and after it; if the time cap comes with fewer than `min_samples` kept, the dropped samples are kept too and the
    stop reason says so. host_gate=False (or VERIFYBENCH_HOST_GATE=off) keeps every batch; a HostGate object forces
    that gate.
    cycle mode: `fn(mark)` runs one whole cycle and calls mark(phase) after each of `phases`, in order; a sample
    is one cycle (CUDA events at cycle boundaries only), and a second pass of up to PHASE_PASS_CYCLES cycles stamps
    every phase (Measurement.phases).
    """
    if max_time_s is None:
        max_time_s = max_time_from_env()
    for arg, value, low in (("max_time_s", max_time_s, 0), ("rel_ci_target", rel_ci_target, 0)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > low):
            raise ValueError(f"{arg} must be a finite number > {low}, got {value!r}")
    if not (isinstance(warmup_s, (int, float)) and math.isfinite(warmup_s) and warmup_s >= 0):
        raise ValueError(f"warmup_s must be a finite number >= 0, got {warmup_s!r}")
    for arg, value in (("samples", samples), ("warmup_calls", warmup_calls)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{arg} must be an integer >= 1 (or None), got {value!r}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    if not fns or not all(callable(f) for f in fns):
        raise TypeError("fn must be a callable or a non-empty sequence of callables")
    if (mode == "cycle") != (phases is not None):
        raise ValueError("cycle mode takes the phase names (phases=...), and only cycle mode does")
    if mode == "cycle":
        if len(fns) != 1 or not phases or len(set(phases)) != len(phases):
            raise ValueError("cycle mode times one step(mark) callable over distinct, non-empty phase names")
        step = fns[0]
        fns = [lambda: step(modes.no_mark)]
    device = device or ("cuda" if cuda_available() else "cpu")
    if device == "cuda" and not cuda_available():
        raise RuntimeError("device='cuda' asked for, but torch sees no CUDA device")
    if device == "cpu" and mode in ("host_sync", "host_call"):
        mode_used = "hot"  # without a device there is nothing to synchronize or enqueue; identical to hot
    else:
        mode_used = mode
    if min_samples < 2 or max_samples < min_samples:
        raise ValueError("need 2 <= min_samples <= max_samples")
    if calls_per_sample is not None and not 1 <= calls_per_sample <= 1 << 16:
        raise ValueError("calls_per_sample must be in 1..65536")
    if samples is not None and mode in ("graph", "hot") and calls_per_sample is None:
        raise ValueError("a fixed sample count needs a fixed calls_per_sample too (every rank must run the same)")

    t_start = time.perf_counter()
    # Warm-up, eager; on CUDA synchronized per call so warmup_s is device time too and no queue builds up.
    n_warm = 0
    while True:
        fns[n_warm % len(fns)]()
        if device == "cuda":
            torch.cuda.synchronize()
        n_warm += 1
        if warmup_calls is not None:
            if n_warm >= warmup_calls:
                break
        elif n_warm >= max(3, len(fns)) and time.perf_counter() - t_start >= warmup_s:
            break
    if mode_used in ("graph", "hot") and calls_per_sample is None:
        calls_per_sample = _auto_calls(fns, device, mode_used)

    if mode_used == "cycle":
        sampler = modes.CycleSampler(step, phases, device)
    else:
        sampler_cls = modes.CudaSampler if device == "cuda" else modes.CpuSampler
        sampler = sampler_cls(fns, mode_used, calls_per_sample or 1, barrier, flush_bytes)
    if host_gate is True:  # the default rule: on a GPU machine, every host-timed measurement with adaptive stopping
        gate_default = cuda_available() and samples is None and host_timed(mode_used, device)
        host_gate = hostprobe.process_gate() if gate_default else None
    gate = host_gate or None
    clocks_before = fingerprint.clock_snapshot() if device == "cuda" else None
    state = process_state()
    probes = [hostprobe.probe_us()]
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside a sample is the host's noise, not the op's cost
    try:
        out, stop_reason, gate_record = _sample(sampler, samples, min_samples, max_samples, rel_ci_target,
                                                max_time_s, t_start, gate, probes)
        phase_samples = (sampler.phase_pass(max(min_samples, min(len(out), PHASE_PASS_CYCLES)))
                         if mode_used == "cycle" else None)
    finally:
        if gc_was_enabled:
            gc.enable()
    clocks_after = fingerprint.clock_snapshot() if device == "cuda" else None
    probes.append(hostprobe.probe_us())
    return Measurement(
        mode=mode_used,
        device=device,
        timer=sampler.timer,
        samples_us=out,
        calls_per_sample=sampler.calls,
        warmup_calls=n_warm,
        stop_reason=stop_reason,
        wall_s=time.perf_counter() - t_start,
        clocks_before=clocks_before,
        clocks_after=clocks_after,
        host_probe_us=probes,
        host_gate=gate_record,
        process_state=state,
        phases=phase_samples,
    )


def _sample(sampler, samples, min_samples, max_samples, rel_ci_target, max_time_s, t_start, gate=None, probes=None):
    """Batches of samples until the stopping rule holds; returns (samples, stop reason, gate record or None).

    With a gate, a batch counts only when the probe read the host's fast state before and after it."""
    out: list[float] = []
    dropped: list[float] = []
    kept_batches = dropped_batches = 0
    target = samples if samples is not None else max_samples
    t_sampling = time.perf_counter()
    fast_before = gate.read()[1] if gate else True

    def record(reason, samples_out):
        if not gate:
            return samples_out, reason, None
        return samples_out, reason, {"ref_us": gate.ref_us, "slow_factor": gate.factor, "kept_batches": kept_batches,
                                     "dropped_batches": dropped_batches, "dropped_samples": len(dropped)}

    while len(out) < target:
        want = min_samples if not out else max(min_samples, len(out) // 2)
        taken = len(out) + len(dropped)
        if samples is None and taken:
            # size the batch so it stays inside the time cap (and, gated, inside one host state)
            per_sample_s = max((time.perf_counter() - t_sampling) / taken, 1e-9)
            left_s = max_time_s - (time.perf_counter() - t_start)
            want = max(1, min(want, int(left_s / per_sample_s), *([int(GATE_BATCH_S / per_sample_s)] if gate else [])))
        batch = sampler.batch(min(want, target - len(out)))
        if gate:
            probe, fast = gate.read()
            probes.append(probe)
            keep, fast_before = fast_before and fast, fast
            kept_batches += keep
            dropped_batches += not keep
            (out if keep else dropped).extend(batch)
        else:
            out.extend(batch)
        if samples is not None:
            continue
        if len(out) >= min_samples and summarize(out).rel_ci_halfwidth <= rel_ci_target:
            return record("ci_target", out)
        if time.perf_counter() - t_start >= max_time_s:
            if len(out) < min_samples and dropped:
                return record("time_cap_host_slow_kept_all", out + dropped)
            return record("time_cap", out)
    return record("fixed_samples" if samples is not None else "max_samples", out)


def _auto_calls(fns, device: str, mode: str) -> int:
    """K for graph and hot modes: enough calls that one sample lasts about TARGET_SAMPLE_US, rounded up to a power
    of two (so small changes of the probe do not change K between runs) and to a multiple of the input sets.

    graph: K comes from the *device* time of a call (one replay of a probe graph over the input sets). Sizing it
    from eager calls, as before, made K follow the host's speed (K = 3 in one run, 14 in the next for a 2 us
    kernel) and the graph's fixed launch cost, divided by K, moved tiny kernels' per-call times by up to 70%.
    hot: K comes from eager back-to-back calls, which is what a hot sample is made of."""
    n_sets = len(fns)
    if mode == "graph" and device == "cuda":
        probe = modes.CudaSampler(fns, "graph", n_sets, None, None)
        per_call_us = sorted(probe.batch(5))[2]
        del probe  # frees the probe graph before the real one is captured
    else:
        probe = (modes.CudaSampler if device == "cuda" else modes.CpuSampler)(fns, "hot", 1, None, None)
        per_call_us = sorted(probe.batch(5))[2]
    want = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(TARGET_SAMPLE_US / max(per_call_us, 1e-3))))
    k = 1 << (want - 1).bit_length()
    return max(n_sets, math.ceil(min(k, MAX_CALLS_PER_SAMPLE) / n_sets) * n_sets)  # every input set equally often
