"""Finds the speculative cycles in one rank's trace: by named ranges (record_function / NVTX), else by repeated
launches of one CUDA graph, else by a periodic kernel-name sequence; each cycle is the GPU work it launched.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass
from statistics import median

import numpy as np

from verifybench.harness.answers.trace_read import GpuOp, HostOp, Trace, TraceError

MAX_PERIOD_CANDIDATE_NAMES = 16  # the rarest repeated kernel names propose the periods tried


@dataclass
class Cycle:
    ops: list[GpuOp]  # its GPU work, sorted by start
    host_t0_us: float | None  # the CPU window the cycle was launched in (None: no CPU events for it)
    host_t1_us: float | None
    threads: frozenset  # (pid, tid) of the calls that launched its work
    verify_ops: list[GpuOp] | None = None  # the part launched inside a --verify-range range


class _Launched:
    """GPU ops ordered by the start of the CPU call that launched them, for window queries."""

    def __init__(self, trace: Trace):
        pairs = [(trace.launch_of(op), op) for op in trace.gpu]
        self.items = sorted(((c, op) for c, op in pairs if c is not None), key=lambda p: (p[0].start_us,
                                                                                          p[1].start_us))
        self.starts = [c.start_us for c, _ in self.items]
        self.gpu_starts = [op.start_us for op in trace.gpu]

    def between(self, t0_us: float, t1_us: float, thread=None, closed: bool = True) -> list[tuple[HostOp, GpuOp]]:
        hi = bisect_right(self.starts, t1_us) if closed else bisect_left(self.starts, t1_us)
        got = self.items[bisect_left(self.starts, t0_us): hi]
        return [p for p in got if thread is None or (p[0].pid, p[0].tid) == thread]


def _cycle(pairs: list[tuple[HostOp, GpuOp]], t0_us=None, t1_us=None) -> Cycle:
    calls = [c for c, _ in pairs]
    if t0_us is None and calls:
        t0_us, t1_us = min(c.start_us for c in calls), max(c.end_us for c in calls)
    ops = sorted({id(op): op for _, op in pairs}.values(), key=lambda o: o.start_us)
    return Cycle(ops, t0_us, t1_us, frozenset((c.pid, c.tid) for c in calls))


def _named(trace: Trace, name: str) -> tuple[list[HostOp], bool]:
    """The outermost ranges named `name` (exact matches if any, else names containing it), on the CPU if any
    there, else on the GPU timeline; and whether they are CPU ranges."""
    for pool, on_cpu in ((trace.ranges, True), (trace.gpu_ranges, False)):
        hits = [r for r in pool if r.name == name] or [r for r in pool if name in r.name]
        if hits:
            outer, reach = [], {}
            for r in hits:  # sorted by start: a range inside a kept one of the same thread is nested, not a cycle
                key = (r.pid, r.tid)
                if r.end_us > reach.get(key, float("-inf")):
                    outer.append(r)
                    reach[key] = r.end_us
            return outer, on_cpu
    seen = sorted({r.name for r in trace.ranges + trace.gpu_ranges})
    listed = ", ".join(repr(s) for s in seen[:12]) + (" ..." if len(seen) > 12 else "") if seen else "none"
    raise TraceError(f"{trace.path}: no range named or containing {name!r} (ranges in the trace: {listed})")


def _range_pairs(trace: Trace, launched: _Launched, r: HostOp, on_cpu: bool) -> list[tuple[HostOp, GpuOp]]:
    if on_cpu:
        return launched.between(r.start_us, r.end_us, thread=(r.pid, r.tid))
    ops = [op for op in trace.gpu[bisect_left(launched.gpu_starts, r.start_us):
                                  bisect_right(launched.gpu_starts, r.end_us)]
           if op.end_us <= r.end_us]
    return [(trace.launch_of(op), op) for op in ops]


def _starts_inside(r: HostOp, c: Cycle, on_cpu: bool) -> bool:
    """Whether range `r` opens inside cycle `c`: in its CPU window on one of its threads, or in its GPU window."""
    if on_cpu:
        return c.host_t0_us is not None and c.host_t0_us <= r.start_us <= c.host_t1_us and (r.pid, r.tid) in c.threads
    return c.ops[0].start_us <= r.start_us <= max(op.end_us for op in c.ops)


def by_ranges(trace: Trace, cycle_range: str | None, verify_range: str | None) -> tuple[list[Cycle], str]:
    launched = _Launched(trace)
    name = cycle_range or verify_range
    ranges, on_cpu = _named(trace, name)
    where = "CPU" if on_cpu else "GPU"
    cycles, empty = [], 0
    for r in ranges:
        pairs = _range_pairs(trace, launched, r, on_cpu)
        if not pairs:
            empty += 1
            continue
        host = [p for p in pairs if p[0] is not None]
        c = _cycle(host, r.start_us, r.end_us) if on_cpu else _cycle(host)
        c.ops = sorted((op for _, op in pairs), key=lambda o: o.start_us)
        cycles.append(c)
    if not cycles:
        raise TraceError(f"{trace.path}: {len(ranges)} {where} range(s) {name!r} found, but none launched GPU work")
    found = f"{where} ranges {name!r} ({len(ranges)} found" + (f", {empty} without GPU work skipped)" if empty
                                                                 else ")")
    if cycle_range and verify_range:
        verify, v_on_cpu = _named(trace, verify_range)
        for c in cycles:
            inside = [v for v in verify if _starts_inside(v, c, v_on_cpu)]
            mine = {id(op) for op in c.ops}
            ops = {id(op): op for v in inside for _, op in _range_pairs(trace, launched, v, v_on_cpu)
                   if id(op) in mine}
            c.verify_ops = sorted(ops.values(), key=lambda o: o.start_us)
        found += f"; verify part: ranges {verify_range!r} inside each"
    return cycles, found


def by_graph_launches(trace: Trace) -> tuple[list[Cycle], str] | None:
    """Cycles between successive launches of the costliest CUDA graph launched more than once (a graph's kernels
    carry its launch's correlation id); None when no graph repeats."""
    ops_of = defaultdict(list)
    for op in trace.gpu:
        if op.correlation is not None:
            ops_of[op.correlation].append(op)
    groups = defaultdict(list)
    for call in trace.calls:
        if "GraphLaunch" in call.name and ops_of.get(call.correlation):
            ops = ops_of[call.correlation]
            groups[tuple(op.name for op in ops)].append(call)
    repeated = {sig: calls for sig, calls in groups.items() if len(calls) >= 2}
    if not repeated:
        return None

    def cost(sig):
        return sum(op.dur_us for c in repeated[sig] for op in ops_of[c.correlation])

    sig = max(repeated, key=cost)
    anchors = repeated[sig]
    launched = _Launched(trace)
    graph_calls = [c.start_us for sig_calls in groups.values() for c in sig_calls]
    cycles, graphs_in = [], []
    for i, a in enumerate(anchors):
        last = i + 1 == len(anchors)
        t1 = float("inf") if last else anchors[i + 1].start_us
        pairs = launched.between(a.start_us, t1, closed=False)
        c = _cycle(pairs, a.start_us, None if last else t1)
        if last:  # to the end of the last CUDA call its threads made (the host's waits at the cycle's end)
            c.host_t1_us = max(k.end_us for k in trace.calls_between(a.start_us, t1) if (k.pid, k.tid) in c.threads)
        cycles.append(c)
        graphs_in.append(sum(a.start_us <= t < t1 for t in graph_calls))
    dropped = ""
    if len(cycles) > 1 and graphs_in[-1] != median(graphs_in[:-1]):
        cycles.pop()  # the trace stopped inside the last cycle
        dropped = "; the last, cut short by the trace's end, dropped"
    return cycles, (f"CUDA graph launches: {len(anchors)} launches of one graph ({len(sig)} kernels each), a cycle "
                    f"from one launch to the next{dropped}")


def _longest_run(eq: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True in `eq`."""
    edges = np.diff(np.concatenate(([0], eq.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if not len(starts):
        return 0, 0
    j = int(np.argmax(ends - starts))
    return int(starts[j]), int(ends[j] - starts[j])


def by_period(trace: Trace) -> tuple[list[Cycle], str] | None:
    """Cycles as repetitions of a periodic kernel-name sequence (kernels in launch order). Periods tried: the
    spacings of the rarest repeated names; the one whose periodic stretch covers the most kernels wins (the
    shortest on ties), so that the layers repeating inside one cycle do not pass for cycles."""
    launched = _Launched(trace)
    kernels = [op for op in trace.gpu if op.cat == "kernel"]
    order = {id(op): i for i, (_, op) in enumerate(launched.items)}
    kernels.sort(key=lambda op: (order.get(id(op), -1), op.start_us))
    names = [op.name for op in kernels]
    codes: dict[str, int] = {}
    ids = np.array([codes.setdefault(n, len(codes)) for n in names], dtype=np.int64)
    where = defaultdict(list)
    for i, n in enumerate(names):
        where[n].append(i)
    rare = sorted((len(v), n) for n, v in where.items() if len(v) >= 2)[:MAX_PERIOD_CANDIDATE_NAMES]
    periods = sorted({int(g) for _, n in rare for g in np.diff(where[n]) if 0 < g <= len(names) // 2})
    best = None  # (covered, -period, start)
    for p in periods:
        s, run = _longest_run(ids[:-p] == ids[p:])
        covered = run + p
        if covered >= 2 * p and (best is None or (covered, -p) > best[:2]):
            best = (covered, -p, s)
    if best is None:
        return None
    covered, p, s = best[0], -best[1], best[2]
    # start each cycle after the longest GPU gap of the period (the host's turn between cycles)
    starts = np.array([op.start_us for op in kernels])
    ends_before = np.maximum.accumulate(np.array([op.end_us for op in kernels]))
    gaps = np.concatenate(([0.0], starts[1:] - ends_before[:-1]))
    reps = covered // p
    offset = int(np.argmax(gaps[s: s + reps * p].reshape(reps, p).mean(axis=0)))
    s, reps = s + offset, (covered - offset) // p
    chunks = [kernels[s + k * p: s + (k + 1) * p] for k in range(reps)]
    others = [op for op in trace.gpu if op.cat != "kernel"]
    firsts = [min(op.start_us for op in chunk) for chunk in chunks]
    # the last cycle spans one period too (its copies after its last kernel are its own): the median spacing, else
    # to the end of the trace
    last_hi = firsts[-1] + float(median(np.diff(firsts))) if reps > 1 else float("inf")
    cycles = []
    for k, chunk in enumerate(chunks):
        lo = firsts[k]
        hi = firsts[k + 1] if k + 1 < reps else max(last_hi, max(op.end_us for op in chunk))
        ops = chunk + [op for op in others if lo <= op.start_us < hi]
        c = _cycle([(trace.launch_of(op), op) for op in ops if trace.launch_of(op) is not None])
        c.ops = sorted(ops, key=lambda o: o.start_us)
        cycles.append(c)
    share = 100 * reps * p / len(kernels)
    return cycles, f"periodic kernel sequence: {p} kernels per cycle, {reps} repetitions ({share:.0f}% of the kernels)"


def find_cycles(trace: Trace, cycle_range: str | None = None, verify_range: str | None = None
                ) -> tuple[list[Cycle], str]:
    """The cycles of one rank and how they were found (ranges if named, else graph launches, else a period)."""
    if cycle_range or verify_range:
        found = by_ranges(trace, cycle_range, verify_range)
    else:
        found = by_graph_launches(trace) or by_period(trace)
    if not found or not found[0]:
        raise TraceError(f"{trace.path}: no cycles found: no repeated CUDA graph launch and no periodic kernel "
                         "sequence; name the cycle's range with --cycle-range")
    return found
