"""Reader of PyTorch profiler Chrome traces (torch.profiler export_chrome_trace / tensorboard_trace_handler, plain
or gzip): GPU activities, the CPU calls that launched them, annotated ranges; one file per rank, ranks from names.
"""
from __future__ import annotations

import gzip
import json
import math
import re
import zlib
from bisect import bisect_left
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API (cuLaunchKernel)
# file-name rank patterns: SGLang "{id}-TP-{rank}[...].trace.json.gz", vLLM / tensorboard "..rank{r}..",
# vLLM's per-worker "profiler_out_{rank}"
RANK_PATTERNS = (r"-TP-(\d+)", r"rank[_-]?(\d+)", r"profiler_out_(\d+)")
# the categories of older Kineto releases, read as today's
OLD_CATS = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset", "Runtime": "cuda_runtime",
            "Driver": "cuda_driver", "Operator": "cpu_op"}
KEPT_CATS = (*GPU_CATS, *LAUNCH_CATS, "cpu_op", "user_annotation", "gpu_user_annotation")
# above this many microseconds a float64 no longer holds a nanosecond: the timestamps are rebased, exactly, first
EXACT_TS_US = 2.0 ** 53 / 1e3


class TraceError(ValueError):
    """A trace file that cannot be read or decomposed; the message names the file and what is wrong."""


@dataclass(frozen=True)
class GpuOp:
    """A kernel, copy or fill on the GPU; times in microseconds on the trace's clock."""

    name: str
    cat: str
    start_us: float
    end_us: float
    stream: object
    correlation: int | None
    external_id: int | None
    graph_node: int | None = None  # CUPTI's graph node id, which newer Kineto writes on a graph's kernels

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


@dataclass(frozen=True)
class HostOp:
    """A CPU-side event: a CUDA runtime/driver call, an operator or an annotated range."""

    name: str
    start_us: float
    end_us: float
    pid: object
    tid: object
    correlation: int | None = None


@dataclass
class Trace:
    path: Path
    gpu: list[GpuOp]  # sorted by start
    calls: list[HostOp]  # CUDA runtime / driver calls, sorted by start
    ranges: list[HostOp]  # record_function / user annotations on the CPU
    gpu_ranges: list[HostOp]  # their projections onto the GPU timeline
    dist_rank: int | None = None  # from the trace's distributedInfo, when torch.distributed was up
    _launch: dict = field(default_factory=dict, repr=False)
    _by_external: dict = field(default_factory=dict, repr=False)
    _call_starts: list = field(default_factory=list, repr=False)

    def launch_of(self, op: GpuOp) -> HostOp | None:
        """The CPU call that launched `op`: by CUPTI correlation id (a graph's kernels carry the cudaGraphLaunch's),
        else the operator with its External id."""
        call = self.call_of(op)
        if call is None and op.external_id is not None:
            call = self._by_external.get(op.external_id)
        return call

    def call_of(self, op: GpuOp) -> HostOp | None:
        """The CUDA runtime / driver call with `op`'s correlation id (a graph's kernels: its cudaGraphLaunch)."""
        return self._launch.get(op.correlation) if op.correlation is not None else None

    def calls_between(self, t0_us: float, t1_us: float) -> list[HostOp]:
        """The CUDA runtime / driver calls that start in [t0_us, t1_us)."""
        return self.calls[bisect_left(self._call_starts, t0_us): bisect_left(self._call_starts, t1_us)]


def _load_json(path: Path, parse_float=float):
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:
            raise TraceError(f"{path}: truncated or corrupt gzip file ({e})") from None
    if not raw.strip():
        raise TraceError(f"{path}: empty file")
    try:
        return json.loads(raw, parse_float=parse_float)
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not JSON text (binary content)") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not valid JSON (truncated or not a trace?): {e}") from None


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float, Decimal)) and not isinstance(x, bool) else None


def _kept(events: list) -> list[tuple[int, dict, str]]:
    """(index, event, category) of the complete events the decomposition reads."""
    out = []
    for i, e in enumerate(events):
        if isinstance(e, dict) and e.get("ph") == "X":
            cat = OLD_CATS.get(e.get("cat"), e.get("cat"))
            if cat in KEPT_CATS:
                out.append((i, e, cat))
    return out


def _events(path: Path) -> tuple[object, list]:
    """The trace's JSON and its event list, timestamps rebased to the earliest one when they are too large for a
    float64 to keep nanoseconds (parsed as exact decimals, then shifted, then converted)."""
    data = _load_json(path)
    events = data if isinstance(data, list) else data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise TraceError(f"{path}: no traceEvents list: not a PyTorch profiler Chrome trace")
    big = [e["ts"] for _, e, _ in _kept(events) if isinstance(e.get("ts"), (int, float))
           and not isinstance(e["ts"], bool) and math.isfinite(e["ts"]) and abs(e["ts"]) > EXACT_TS_US]
    if not big:
        return data, events
    data = _load_json(path, parse_float=Decimal)
    events = data if isinstance(data, list) else data["traceEvents"]
    stamps = [e["ts"] for _, e, _ in _kept(events) if _exact(e.get("ts"))]
    base = min(stamps)
    for _, e, _ in _kept(events):
        if _exact(e.get("ts")):
            e["ts"] = float(e["ts"] - base)
    return data, events


def _exact(x) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, Decimal) and x.is_finite())


MAX_DURATION_US = 24 * 3.6e9  # one event longer than a day is a damaged trace, not a slow kernel


def _duration_fault(e: dict) -> str | None:
    """Why an event's duration cannot be used, or None: it must be there, finite and not negative."""
    if "dur" not in e:
        return "no duration"
    dur = _number(e["dur"])
    if dur is None:
        return f"duration {e['dur']!r}"
    if not math.isfinite(dur) or dur < 0:
        return f"duration {dur}"
    if dur > MAX_DURATION_US:  # summed, 1e300 would swamp every figure of its cycle without a word
        return f"duration {dur:g} us, longer than any profiled run ({MAX_DURATION_US / 3.6e9:g} h)"
    return None


def _int(x) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str) and x.lstrip("-").isdigit():
        return int(x)
    return None


def read_trace(path: Path | str) -> Trace:
    """One PyTorch profiler Chrome trace; TraceError for anything that is not one, or has no GPU activity."""
    path = Path(path)
    data, events = _events(path)
    gpu, calls, ranges, gpu_ranges, ops = [], [], [], [], []
    devices, seen, bad, twice = set(), set(), [], []
    for i, e, cat in _kept(events):
        name = e.get("name")
        ts = _number(e.get("ts"))
        if ts is None or not isinstance(name, str):
            raise TraceError(f"{path}: event {i} ({cat}) has no numeric ts/dur or no name")
        fault = "timestamp " + str(ts) if not math.isfinite(ts) else _duration_fault(e)
        if fault:
            bad.append(f"event {i} ({cat} {name[:40]!r}): {fault}")
            continue
        dur = _number(e["dur"])
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        corr, ext = _int(args.get("correlation")), _int(args.get("External id"))
        if cat in GPU_CATS:
            device = args.get("device", e.get("pid"))
            key = (name, cat, ts, dur, str(device), str(args.get("stream", e.get("tid"))), corr)
            if key in seen:
                twice.append(i)
                continue
            seen.add(key)
            devices.add(device)
            gpu.append(GpuOp(name, cat, ts, ts + dur, args.get("stream", e.get("tid")), corr, ext,
                             _int(args.get("graph node id"))))
            continue
        host = HostOp(name, ts, ts + dur, e.get("pid"), e.get("tid"), corr)
        if cat in LAUNCH_CATS:
            calls.append(host)
        elif cat == "cpu_op":
            if ext is not None:
                ops.append((ext, host))
        elif cat == "user_annotation":
            ranges.append(host)
        else:
            gpu_ranges.append(host)
    # one rule for a damaged trace: refuse it whole (a part dropped would make every figure of its cycle wrong)
    if bad:
        raise TraceError(f"{path}: {len(bad)} event(s) with a missing, negative, non-finite or absurd time, e.g. "
                         f"{bad[0]}; a damaged trace: record it again")
    if twice:
        raise TraceError(f"{path}: {len(twice)} GPU event(s) present twice (same name, start, duration and "
                         f"stream; first: event {twice[0]}): a trace merged with itself? pass the profiler's file")
    if not gpu:
        raise TraceError(f"{path}: no GPU events (kernel / gpu_memcpy / gpu_memset): record it with the CUDA "
                         "activity on (torch.profiler activities CPU and CUDA; the engines' 'GPU')")
    if len(devices) > 1:
        raise TraceError(f"{path}: GPU events of {len(devices)} devices ({sorted(map(str, devices))}): a merged "
                         "trace? pass the per-rank files, one device each")
    info = data.get("distributedInfo") if isinstance(data, dict) else None
    key = lambda x: x.start_us  # noqa: E731
    trace = Trace(path, sorted(gpu, key=key), sorted(calls, key=key), sorted(ranges, key=key),
                  sorted(gpu_ranges, key=key), _int(info.get("rank")) if isinstance(info, dict) else None)
    trace._launch = {c.correlation: c for c in calls if c.correlation is not None}
    trace._by_external = dict(ops)
    trace._call_starts = [c.start_us for c in trace.calls]
    return trace


def rank_from_name(path: Path) -> int | None:
    for pattern in RANK_PATTERNS:
        m = re.search(pattern, Path(path).name, re.IGNORECASE)
        if m:
            return int(m.group(1))
    return None


def read_ranks(paths: list[Path | str]) -> tuple[list[tuple[int, Trace]], str]:
    """Every file as (rank, trace), sorted by rank, and where the ranks came from: the file names (-TP-<r>,
    rank<r>, profiler_out_<r>), else each trace's distributedInfo, else the order given. Ranks must not repeat
    and must be a gap-free run: a missing file of a numbered set is an error, not a smaller max."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise TraceError("no trace files given")
    traces = [read_trace(p) for p in paths]
    by_name = [rank_from_name(p) for p in paths]
    by_info = [t.dist_rank for t in traces]
    if all(r is not None for r in by_name):
        ranks, source = by_name, "file names"
    elif all(r is not None for r in by_info):
        ranks, source = by_info, "distributedInfo in the traces"
    else:
        ranks, source = list(range(len(paths))), "order given" if len(paths) > 1 else "single file"
    seen: dict[int, Path] = {}
    for r, p in zip(ranks, paths):
        if r in seen:
            raise TraceError(f"{p}: rank {r} again ({seen[r]} is rank {r} too, from the {source}): pass one file "
                             "per rank (of one DP/PP group)")
        seen[r] = p
    missing = sorted(set(range(min(ranks), max(ranks) + 1)) - set(ranks))
    if missing:
        raise TraceError(f"rank file(s) missing: rank {', '.join(map(str, missing))} not among the files given "
                         f"(ranks {', '.join(map(str, sorted(ranks)))}, from the {source})")
    return sorted(zip(ranks, traces), key=lambda rt: rt[0]), source
