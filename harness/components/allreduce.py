"""Allreduce in one process: a 1-rank process group, so each number is a backend's call floor (launch plus the
collective's fixed cost with no peer to wait for) at the preset's verify sizes.

At one rank torch's NCCL group has nothing to do for an in-place allreduce: its graph capture is empty, so it has
eager cases only (an empty graph's replay / K read 0.003-0.1 us, noise around nothing); pynccl's out-of-place op
still runs a kernel. Multi-GPU numbers come from
`torchrun --nproc-per-node=N -m verifybench.harness.multigpu.allreduce`; under a multi-rank launch this module skips.
CPU: gloo, perf_counter, tiny preset.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from verifybench.harness.measure import stance
from verifybench.harness.measure.results.store import CPU_TIMING, cpu_numbers
from verifybench.harness.model import presets
from verifybench.harness.collectives.allreduce_results import ENGINE_MODE, busbw_factor, table_rows
from verifybench.harness.collectives.backends import (ELEMENT_BYTES, Comm, check_eager, check_graph, expected_sum, make_backend,
                                        prepare_for_timing, unavailable_reason)
from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec
from verifybench.harness.measure.timing.timer import cuda_available

NAME = "allreduce"
HELP = ("allreduce call floor of each backend in a 1-rank group (several GPUs: torchrun -m "
        "verifybench.harness.multigpu.allreduce)")
TOKENS = (1, 4, 8)
_state: dict = {}  # the 1-rank group, its store and one communicator per backend, made on first use


def _comm(device: str) -> Comm:
    if "store" not in _state:
        if dist.is_initialized():
            raise RuntimeError("a process group already exists in this process; the 1-rank cases need their own")
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)
        gpu = cuda_available()
        dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo", store=dist.PrefixStore("pg/", store),
                                rank=0, world_size=1, device_id=torch.device("cuda", torch.cuda.current_device())
                                if gpu else None)
        _state["store"] = store
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return Comm(0, 1, 1, dev, _state["store"])


def _backend(name: str, comm: Comm, max_numel: int):
    key = (name, max_numel)
    if key not in _state:
        _state[key] = make_backend(name, comm, max_numel)
    return _state[key]


def _case(backend: str, size: int, max_size: int, mode: str, device: str) -> CaseSpec:
    numel = size // ELEMENT_BYTES

    def setup():
        comm = _comm(device)
        reason = unavailable_reason(backend, comm)
        if reason:
            raise CaseSkipped(f"{backend}: {reason}")
        op = _backend(backend, comm, max_size // ELEMENT_BYTES)(numel)
        expected = expected_sum(numel, 1, comm.device)

        def check():
            wrong = check_eager(op, comm, expected)
            graphed = comm.device.type == "cuda"
            if graphed:
                wrong += check_graph(op, comm, expected)
            prepare_for_timing(op, comm)
            return wrong == 0, f"#wrong {wrong} of {numel} (eager{', graph replay x2' if graphed else ''})"

        def derive(m):
            t = m.median_us
            algbw = size / t / 1e3
            return {"time_us": t, "algbw_gbps": algbw, "busbw_gbps": algbw * busbw_factor(1), "wrong": 0,
                    "p99_us": sorted(m.samples_us)[int(0.99 * (len(m.samples_us) - 1))], "slowest_rank": 0}

        return op.run, check, derive

    params = {"size_bytes": size, "count": numel, "dtype": "bf16", "backend": backend, "mode": mode,
              "world_size": 1}
    return CaseSpec(name=f"allreduce1/{backend}/{size}B/{stance.case_mode(mode, device)}", params=params,
                    mode=ENGINE_MODE[mode],
                    setup=setup, measure_kw={"device": device})


def cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None = None) -> list[CaseSpec]:
    """Per backend and verify size (hidden x tokens x 2 B): graph and eager. CPU: gloo at the tiny preset."""
    gpu = cuda_available()
    hidden = presets.get(preset if gpu else "tiny").hidden
    sizes = [hidden * t * ELEMENT_BYTES for t in (tokens or TOKENS)]
    backends = [("nccl", "cuda"), ("pynccl", "cuda"), ("gloo", "cpu")] if gpu else [("gloo", "cpu")]
    return [_case(b, s, max(sizes), mode, dev) for b, dev in backends for s in sizes for mode in ("graph", "eager")
            if not (b == "nccl" and mode == "graph")]


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    # one rank: busbw (algbw x 2(n-1)/n) is 0 and the slowest rank is rank 0, always: columns with nothing to say;
    # on CPU table_rows gives CPU mode labels and no GB/s
    rows = [{k: v for k, v in row.items() if k not in ("busbw(GB/s)", "slowest rank")} for row in table_rows(records)]
    return [("allreduce, 1 rank: the call floor of each backend (no busbw nor slowest rank: one rank)"
             + (f" ({CPU_TIMING})" if cpu_numbers(records) else ""), rows)]


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    return []


def release() -> None:
    """Tear down the 1-rank group (no peer to wait for, so teardown cannot hang) and drop the communicators."""
    if "store" in _state and dist.is_initialized():
        if cuda_available():
            torch.cuda.synchronize()
        dist.destroy_process_group()
    _state.clear()
