"""The timing modes: how one sample is taken in each (CUDA events, L2 flush, captured graph, host clock, cycle stamps),
on a GPU and on a CPU; a sampler's batch(count) returns per-call microseconds. timer.measure runs them."""
from __future__ import annotations

import time
from typing import Sequence

import torch

from verifybench.harness.measure.timing.capture import graph_capture
from verifybench.kernels.common import devices

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
# samples that include host time (host clock, or back-to-back launches the host may not keep up with)
HOST_TIMED_MODES = ("host_call", "host_sync", "hot", "cycle")
# device spin before the start event, so launch latency stays outside the sample: the host must record the start
# event, replay and record the end event within it. 20 us was too short while the host CPU ran slow (~1.7x):
# 1-node graphs read 7.1 us in one run and 3.1 us in the next
ISOLATED_PAD_US = 100.0


def host_timed(mode: str, device: str) -> bool:
    """Samples that include host time: host-clock modes, hot launches, and anything timed on the CPU."""
    return mode in HOST_TIMED_MODES or device == "cpu"


def l2_bytes(device: int | None = None) -> int:
    """L2 size of the current CUDA device in bytes."""
    size = devices.properties(torch.cuda.current_device() if device is None else device)["l2"]
    if not size:
        raise RuntimeError("this torch build does not report the L2 size; cannot size the cold-mode flush")
    return int(size)


def cache_bytes(device: str) -> int:
    """The last-level cache a cold sample must defeat: the GPU's L2, or CPU_CACHE_BYTES on a CPU."""
    return l2_bytes() if device == "cuda" else CPU_CACHE_BYTES


class Sampler:
    """Produces batches of per-call samples for one mode. CUDA and CPU variants below."""

    timer = ""

    def _rotate(self, fns, mode, calls, barrier):
        """The state of a sampler over callables: the input sets rotated call by call, K calls per sample in graph
        and hot mode (one otherwise), the barrier before an isolated sample."""
        self.fns, self.mode, self.barrier = fns, mode, barrier
        self.calls = calls if mode in ("graph", "hot") else 1
        self.i = 0

    def _call(self):
        self.fns[self.i % len(self.fns)]()
        self.i += 1

    def batch(self, count: int) -> list[float]:
        raise NotImplementedError


class CudaSampler(Sampler):
    timer = "cuda_event"

    def __init__(self, fns, mode, calls, barrier, flush_bytes):
        self._rotate(fns, mode, calls, barrier)
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


class CpuSampler(Sampler):
    """perf_counter fallback: same modes, CPU meaning (graph = K calls in a loop; cold = 64 MiB written first)."""

    timer = "perf_counter"

    def __init__(self, fns, mode, calls, barrier, flush_bytes):
        self._rotate(fns, mode, calls, barrier)
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
                self._call()
            out.append((time.perf_counter() - t0) * 1e6 / self.calls)
        return out


def no_mark(phase: str) -> None:
    pass


class CycleSampler(Sampler):
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
            self.step(no_mark)
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

