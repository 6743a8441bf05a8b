"""The one timing engine: device-timed samples of a callable in a named mode, with warm-up and adaptive stopping.

Every number the suite reports comes from `measure`. Samples are per-call microseconds.
"""
from __future__ import annotations

import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from verifybench.harness.engine import fingerprint
from verifybench.harness.engine import hostprobe
from verifybench.harness.engine.stats import Summary, summarize
from verifybench.harness.engine.capture import graph_capture

MODES = ("cold", "hot", "graph", "isolated", "host_sync", "host_call", "cycle")
MODE_HELP = {
    "cold": "L2 flushed before each sample (a 2x-L2 buffer written, enqueued before the start event); CUDA events",
    "hot": "K calls back to back between two CUDA events, / K (host-bound ops show the host's launch rate)",
    "graph": "K calls captured in one CUDA graph; per-call time = replay time / K; CUDA events",
    "isolated": "one call per sample after a barrier, GPU kept busy while it is enqueued; CUDA events",
    "host_sync": "host clock around call + torch.cuda.synchronize() (the distortion the suite exposes)",
    "host_call": "host clock around the call alone, device drained first: the CPU cost of enqueueing it",
    "cycle": "whole speculative cycles back to back, a CUDA event at each cycle boundary and no sync but the "
             "cycle's own; a second pass puts an event and a host stamp after every phase",
}
CPU_CACHE_BYTES = 64 << 20  # no portable LLC query; 64 MiB exceeds the LLC of the CPUs we run on
# cold rotation: a graph-mode case that streams weights rotates over sets whose total is >= this many caches
ROTATION_CACHE_MULTIPLE = 4
ROTATION_MIN_SETS = 4
TARGET_SAMPLE_US = 500.0  # auto K aims for samples this long, so event resolution (~0.5 us) is < 0.1%
MAX_CALLS_PER_SAMPLE = 1024
DEFAULT_MAX_TIME_S = 2.0  # per case; VERIFYBENCH_MAX_TIME_S overrides (quick CPU runs)
MAX_TIME_ENV = "VERIFYBENCH_MAX_TIME_S"
# samples that include host time (host clock, or back-to-back launches the host may not keep up with)
HOST_TIMED_MODES = ("host_call", "host_sync", "hot", "cycle")
PHASE_PASS_CYCLES = 200  # cycles of the per-phase pass (at most as many as sampled; at least min_samples)
GATE_BATCH_S = 0.02  # gated batches stay this short, so one rarely spans a change of host state
# device spin before the start event, so launch latency stays outside the sample: the host must record the start
# event, replay and record the end event within it. 20 us was too short while the host CPU ran slow (~1.7x):
# 1-node graphs read 7.1 us in one run and 3.1 us in the next
ISOLATED_PAD_US = 100.0


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
            "mode": self.mode,
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
    text = os.environ.get(MAX_TIME_ENV)
    if text is None:
        return DEFAULT_MAX_TIME_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{MAX_TIME_ENV} must be a number of seconds > 0, got {text!r}")
    return value


def process_state() -> dict:
    """What in this process moved the device cost of tiny graph nodes on an H200 (scripts/node_cost_probe.py, in
    one process: 0.857 us per node fresh, 1.035 after `import cupy`, 1.119 after a torch NCCL allreduce)."""
    dist = sys.modules.get("torch.distributed")
    group = str(dist.get_backend()) if dist is not None and dist.is_available() and dist.is_initialized() else None
    return {"cupy_imported": "cupy" in sys.modules, "process_group": group}


def host_timed(mode: str, device: str) -> bool:
    """Samples that include host time: host-clock modes, hot launches, and anything timed on the CPU."""
    return mode in HOST_TIMED_MODES or device == "cpu"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def l2_bytes(device: int | None = None) -> int:
    """L2 size of the current CUDA device in bytes."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    size = getattr(props, "L2_cache_size", 0)
    if not size:
        raise RuntimeError("this torch build does not report the L2 size; cannot size the cold-mode flush")
    return int(size)


def cache_bytes(device: str) -> int:
    """The last-level cache a cold sample must defeat: the GPU's L2, or CPU_CACHE_BYTES on a CPU."""
    return l2_bytes() if device == "cuda" else CPU_CACHE_BYTES


def cold_rotation_sets(bytes_per_set: int, device: str, max_sets: int = 64) -> int:
    """How many input/weight sets a cold case rotates over: at least ROTATION_MIN_SETS, and enough that their
    total is ROTATION_CACHE_MULTIPLE x the cache (a real forward never re-reads a layer's weights), at most
    `max_sets`."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    want = math.ceil(ROTATION_CACHE_MULTIPLE * cache_bytes(device) / bytes_per_set)
    return min(max_sets, max(ROTATION_MIN_SETS, want))


class _Sampler:
    """Produces batches of per-call samples for one mode. CUDA and CPU variants below."""

    timer = ""

    def batch(self, count: int) -> list[float]:
        raise NotImplementedError


class _CudaSampler(_Sampler):
    timer = "cuda_event"

    def __init__(self, fns, mode, calls, barrier, flush_bytes):
        self.fns, self.mode, self.barrier = fns, mode, barrier
        self.calls = calls if mode in ("graph", "hot") else 1
        self.i = 0
        if mode == "host_sync":
            self.timer = "perf_counter+synchronize"
        elif mode == "host_call":
            self.timer = "perf_counter"
        if mode == "cold":
            self.flush = torch.empty(flush_bytes or 2 * l2_bytes(), dtype=torch.uint8, device="cuda")
        # cycles of the SM clock for ISOLATED_PAD_US; torch reports clock_rate in kHz
        khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 1_980_000)
        self.pad_cycles = int(ISOLATED_PAD_US * khz / 1e3)
        if mode == "graph":
            self.graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fns[0]()  # cuBLAS/cuDNN lazily create handles on a new stream: keep that out of the capture
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            with graph_capture(self.graph):
                for k in range(calls):
                    fns[k % len(fns)]()
            self.graph.replay()
            torch.cuda.synchronize()

    def _call(self):
        self.fns[self.i % len(self.fns)]()
        self.i += 1

    def batch(self, count: int) -> list[float]:
        if self.mode in ("host_sync", "host_call"):
            out = []
            for _ in range(count):
                torch.cuda.synchronize()  # an empty queue: the call never waits for a full launch queue
                t0 = time.perf_counter()
                self._call()
                if self.mode == "host_sync":
                    torch.cuda.synchronize()
                out.append((time.perf_counter() - t0) * 1e6)
            return out
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
        for start, end in events:
            if self.mode == "cold":
                self.flush.zero_()  # also keeps the GPU busy while the timed call is enqueued
            elif self.mode == "isolated":
                (self.barrier or torch.cuda.synchronize)()
            if self.mode in ("isolated", "graph"):
                # a short device spin: the sample then starts with the op already queued, so the host's
                # launch latency stays outside it (hot mode keeps it: that is eager reality)
                torch.cuda._sleep(self.pad_cycles)
            start.record()
            if self.mode == "graph":
                self.graph.replay()
            else:
                for _ in range(self.calls):
                    self._call()
            end.record()
            if self.mode == "isolated":
                end.synchronize()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 / self.calls for s, e in events]


class _CpuSampler(_Sampler):
    """perf_counter fallback: same modes, CPU meaning (graph = K calls in a loop; cold = 64 MiB written first)."""

    timer = "perf_counter"

    def __init__(self, fns, mode, calls, barrier, flush_bytes):
        self.fns, self.mode, self.barrier = fns, mode, barrier
        self.calls = calls if mode in ("graph", "hot") else 1
        self.i = 0
        if mode == "cold":
            self.flush = torch.empty(flush_bytes or CPU_CACHE_BYTES, dtype=torch.uint8)

    def batch(self, count: int) -> list[float]:
        out = []
        for _ in range(count):
            if self.mode == "cold":
                self.flush.zero_()
            elif self.mode == "isolated" and self.barrier:
                self.barrier()
            t0 = time.perf_counter()
            for _ in range(self.calls):
                self.fns[self.i % len(self.fns)]()
                self.i += 1
            out.append((time.perf_counter() - t0) * 1e6 / self.calls)
        return out


def _no_mark(phase: str) -> None:
    pass


class _CycleSampler(_Sampler):
    """Whole cycles of `step(mark)` back to back, stamped (a CUDA event, or the host clock on a CPU) at each cycle
    boundary: nothing waits for the device but what the cycle itself syncs, as an engine runs it. `phase_pass`
    stamps after every `mark(phase)` too: the per-phase split, device and host, the way a per-phase profiler
    without syncs sees it."""

    def __init__(self, step, phases: Sequence[str], device: str):
        self.step, self.phases, self.cuda = step, tuple(phases), device == "cuda"
        self.timer = "cuda_event" if self.cuda else "perf_counter"
        self.calls = 1

    def _stamp(self):
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return event, time.perf_counter()

    def _device_us(self, a, b) -> float:
        return a[0].elapsed_time(b[0]) * 1e3 if self.cuda else (b[1] - a[1]) * 1e6

    def batch(self, count: int) -> list[float]:
        stamps = [self._stamp()]
        for _ in range(count):
            self.step(_no_mark)
            stamps.append(self._stamp())
        if self.cuda:
            torch.cuda.synchronize()
        return [self._device_us(a, b) for a, b in zip(stamps, stamps[1:])]

    def phase_pass(self, cycles: int) -> dict:
        rows = []
        for _ in range(cycles):
            marks = [(None, self._stamp())]
            self.step(lambda phase: marks.append((phase, self._stamp())))
            rows.append(marks)
        if self.cuda:
            torch.cuda.synchronize()
        out = {p: {"device_us": [], "host_us": []} for p in self.phases}
        for marks in rows:
            names = tuple(m[0] for m in marks[1:])
            if names != self.phases:
                raise RuntimeError(f"a cycle marked phases {names}, expected {self.phases}")
            for (_, a), (phase, b) in zip(marks, marks[1:]):
                out[phase]["device_us"].append(self._device_us(a, b))
                out[phase]["host_us"].append((b[1] - a[1]) * 1e6)
        return out


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

    mode: one of MODES (MODE_HELP says what each means). device: "cuda" or "cpu" (default: cuda when available;
    on CPU the timer is perf_counter and the result says so).
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
        fns = [lambda: step(_no_mark)]
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
        sampler = _CycleSampler(step, phases, device)
    else:
        sampler_cls = _CudaSampler if device == "cuda" else _CpuSampler
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
        probe = _CudaSampler(fns, "graph", n_sets, None, None)
        per_call_us = sorted(probe.batch(5))[2]
        del probe  # frees the probe graph before the real one is captured
    else:
        probe = (_CudaSampler if device == "cuda" else _CpuSampler)(fns, "hot", 1, None, None)
        per_call_us = sorted(probe.batch(5))[2]
    want = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(TARGET_SAMPLE_US / max(per_call_us, 1e-3))))
    k = 1 << (want - 1).bit_length()
    return max(n_sets, math.ceil(min(k, MAX_CALLS_PER_SAMPLE) / n_sets) * n_sets)  # every input set equally often
