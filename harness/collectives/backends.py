"""Allreduce backends as one-op callables on bf16 buffers, and the exact integer pattern that checks every size.

Each backend gives an ArOp whose `run()` does one sum-allreduce of `inp` into `out` (the same tensor when in
place) on the current stream, so the engine can time it eagerly or capture it in a CUDA graph. Nothing here uses
multicast (NVLS, multimem): the NCCL environment keeps it off and the symm-mem ops used are the P2P-load ones.

torch's symmetric-memory one-shot and two-shot stand for the engines' custom (PCIe-IPC) one-shot and two-shot
allreduces: like them, each rank maps its peers' buffers (CUDA IPC / cuMem handles) and loads them over P2P, with
no multicast. So they need P2P between every pair of the job's GPUs, and are skipped, saying so, where it is missing.
"""
from __future__ import annotations

import importlib
import itertools
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from verifybench.harness.measure.host.topology import missing_p2p_pairs
from verifybench.harness.measure.timing.capture import graph_capture

DTYPE = torch.bfloat16
ELEMENT_BYTES = 2
BF16_EXACT_MAX = 256  # bf16 has 8 significant bits: every integer up to 2**8 is exact
GPU_BACKENDS = ("nccl", "pynccl", "symm-one-shot", "symm-two-shot")
CPU_BACKENDS = ("gloo",)
ALL_BACKENDS = GPU_BACKENDS + CPU_BACKENDS
BACKEND_HELP = {
    "nccl": "torch.distributed.all_reduce on the NCCL process group (in place)",
    "pynccl": "raw ncclAllReduce through cupy.cuda.nccl on torch's buffers and current stream (out of place), "
              "as serving engines call it inside their graphs",
    "symm-one-shot": "torch.ops.symm_mem.one_shot_all_reduce_out: every rank loads all peers' buffers over P2P",
    "symm-two-shot": "torch.ops.symm_mem.two_shot_all_reduce_: reduce-scatter + all-gather over P2P loads (in place)",
    "gloo": "torch.distributed.all_reduce of a CPU tensor on gloo",
}
SYMM_OPS = {"symm-one-shot": "one_shot_all_reduce_out", "symm-two-shot": "two_shot_all_reduce_"}
_uid_counter = itertools.count()


@dataclass
class Comm:
    """What a backend needs to know about this rank. `store` is the job's rendezvous store (namespaced)."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    store: dist.Store


@dataclass
class ArOp:
    backend: str
    inp: torch.Tensor
    out: torch.Tensor
    run: Callable[[], object]

    @property
    def in_place(self) -> bool:
        return self.out.data_ptr() == self.inp.data_ptr()


# ---- the check: exact small integers, as nccl-tests counts #wrong ----

def pattern_modulus(world_size: int) -> int:
    """Values per rank lie in 1..M with world_size * M <= 256, so every partial sum is exact in bf16."""
    return max(1, min(64, BF16_EXACT_MAX // max(1, world_size)))


def _pattern_int(numel: int, rank: int, world_size: int, device) -> torch.Tensor:
    idx = torch.arange(numel, device=device, dtype=torch.int64)
    return (idx + 3 * rank) % pattern_modulus(world_size) + 1


def fill_pattern(t: torch.Tensor, rank: int, world_size: int) -> None:
    """Rank-dependent, index-dependent integers: a missing, doubled or shifted contribution changes the sum."""
    t.copy_(_pattern_int(t.numel(), rank, world_size, t.device).to(t.dtype))


def expected_sum(numel: int, world_size: int, device, dtype=DTYPE) -> torch.Tensor:
    total = sum(_pattern_int(numel, r, world_size, device) for r in range(world_size))
    return total.to(dtype)


def count_wrong(out: torch.Tensor, expected: torch.Tensor) -> int:
    return int((out != expected).sum().item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_eager(op: ArOp, comm: Comm, expected: torch.Tensor) -> int:
    """#wrong after one eager op on fresh pattern data (output cleared first, so a no-op cannot pass)."""
    fill_pattern(op.inp, comm.rank, comm.world_size)
    if not op.in_place:
        op.out.zero_()
    op.run()
    _sync(comm.device)
    return count_wrong(op.out, expected)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """One call of `fn` in a CUDA graph; a first call on a side stream keeps lazy init out of the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def check_graph(op: ArOp, comm: Comm, expected: torch.Tensor, replays: int = 2) -> int:
    """#wrong over `replays` replays of a captured op, re-filling the input before each (CUDA only)."""
    graph = capture_graph(op.run)
    wrong = 0
    for _ in range(replays):
        fill_pattern(op.inp, comm.rank, comm.world_size)
        if not op.in_place:
            op.out.zero_()
        graph.replay()
        _sync(comm.device)
        wrong += count_wrong(op.out, expected)
    return wrong


def prepare_for_timing(op: ArOp, comm: Comm) -> None:
    """In place, repeated ops multiply the data by the world size: time on zeros (they stay zero, never inf).
    Out of place, time on the pattern: the output can be checked after all timed calls."""
    if op.in_place:
        op.inp.zero_()
    else:
        fill_pattern(op.inp, comm.rank, comm.world_size)
        op.out.zero_()


# ---- availability: a reason string when a backend cannot run on this rank, else None ----

def unavailable_reason(name: str, comm: Comm) -> str | None:
    if name not in ALL_BACKENDS:
        return f"unknown backend (choose from {', '.join(ALL_BACKENDS)})"
    if name in GPU_BACKENDS and comm.device.type != "cuda":
        return "needs CUDA"
    if name == "pynccl":
        try:
            nccl = importlib.import_module("cupy.cuda.nccl")
        except Exception as e:
            return f"cupy.cuda.nccl not importable ({type(e).__name__}: {e})"
        if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
            return "cupy imports but finds no NCCL library"
    if name in SYMM_OPS:
        if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
            return "TORCH_SYMM_MEM_DISABLE_MULTICAST is not 1 (multicast must stay off)"
        if comm.world_size != comm.local_world_size:
            return "symmetric memory (CUDA backend) is single-node only"
        try:
            importlib.import_module("torch.distributed._symmetric_memory")
        except Exception as e:
            return f"torch.distributed._symmetric_memory missing ({type(e).__name__})"
        if not hasattr(torch.ops.symm_mem, SYMM_OPS[name]):
            return f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{SYMM_OPS[name]}"
        return p2p_reason(list(range(comm.local_world_size)))  # every rank of the job is cuda:<local rank>
    return None


def p2p_reason(devices: list[int], can_access=None) -> str | None:
    """Why the P2P-load backends cannot run on `devices`, or None when every ordered pair has peer access."""
    missing = missing_p2p_pairs(devices, can_access)
    if not missing:
        return None
    shown = ", ".join(f"{i}->{j}" for i, j in missing[:6])
    if len(missing) > 6:
        shown += f" and {len(missing) - 6} more"
    return f"no P2P access between GPUs {shown} (CUDA peer access): it loads peers' buffers over P2P"


# ---- backends: make(comm, max_numel) -> (numel -> ArOp); collective setup happens here, on every rank ----

def _torch_dist(name: str, comm: Comm, max_numel: int):
    buf = torch.empty(max_numel, dtype=DTYPE, device=comm.device)

    def make(numel: int) -> ArOp:
        t = buf[:numel]
        return ArOp(name, t, t, lambda: dist.all_reduce(t))

    return make


def _pynccl(comm: Comm, max_numel: int):
    import cupy
    from cupy.cuda import nccl

    key = f"pynccl/uid/{next(_uid_counter)}"
    if comm.rank == 0:
        uid = nccl.get_unique_id()  # bytes in cupy 14, a tuple of signed chars in older releases
        comm.store.set(key, (uid if isinstance(uid, bytes) else bytes(c & 0xFF for c in uid)).hex())
    uid = bytes.fromhex(comm.store.get(key).decode())
    with cupy.cuda.Device(comm.device.index):
        try:
            nc = nccl.NcclCommunicator(comm.world_size, uid, comm.rank)
        except TypeError:  # older cupy: the id as a tuple (the type check runs before any communication)
            nc = nccl.NcclCommunicator(comm.world_size, tuple(c - 256 if c > 127 else c for c in uid), comm.rank)
    bf16, op_sum = getattr(nccl, "NCCL_BFLOAT16", 9), nccl.NCCL_SUM  # ncclBfloat16 = 9 since NCCL 2.10
    inbuf = torch.empty(max_numel, dtype=DTYPE, device=comm.device)
    outbuf = torch.empty(max_numel, dtype=DTYPE, device=comm.device)

    def make(numel: int) -> ArOp:
        inp, out = inbuf[:numel], outbuf[:numel]
        src, dst = inp.data_ptr(), out.data_ptr()

        def run():
            # the current stream at call time: the capture stream inside torch.cuda.graph
            nc.allReduce(src, dst, numel, bf16, op_sum, torch.cuda.current_stream().cuda_stream)

        return ArOp("pynccl", inp, out, run)

    make.communicator = nc  # keep it alive as long as the ops
    return make


def _symm_group_name() -> str:
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    # Older torch needs the group registered; newer registers it itself and deprecates the call.
    if enable is not None and not hasattr(enable, "__deprecated__"):
        try:
            enable(group_name)
        except Exception:
            pass
    return group_name


def _symm(name: str, comm: Comm, max_numel: int):
    import torch.distributed._symmetric_memory as symm_mem

    try:
        symm_mem.set_backend("CUDA")  # P2P over cuMem handles; never NVSHMEM's own transport choices
    except Exception:
        pass
    group_name = _symm_group_name()
    buf = symm_mem.empty(max_numel, dtype=DTYPE, device=comm.device)
    symm_mem.rendezvous(buf, group_name)
    ops = torch.ops.symm_mem
    outbuf = torch.empty(max_numel, dtype=DTYPE, device=comm.device)

    def make(numel: int) -> ArOp:
        inp = buf[:numel]  # a prefix of the rendezvoused buffer: same storage, offset 0
        if name == "symm-one-shot":
            out = outbuf[:numel]
            return ArOp(name, inp, out, lambda: ops.one_shot_all_reduce_out(inp, "sum", group_name, out))
        return ArOp(name, inp, inp, lambda: ops.two_shot_all_reduce_(inp, "sum", group_name))

    make.buffer = buf
    return make


def make_backend(name: str, comm: Comm, max_numel: int) -> Callable[[int], ArOp]:
    """Set up `name` for sizes up to `max_numel` elements. Collective: every rank calls it in the same order."""
    if name in ("nccl", "gloo"):
        return _torch_dist(name, comm, max_numel)
    if name == "pynccl":
        return _pynccl(comm, max_numel)
    if name in SYMM_OPS:
        return _symm(name, comm, max_numel)
    raise ValueError(f"unknown backend {name!r}")


def backend_versions(comm: Comm) -> dict:
    """Versions of the communication libraries this rank loaded (NCCL through torch and through cupy)."""
    out: dict = {}
    if comm.device.type == "cuda":
        try:
            out["nccl_torch"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            out["nccl_torch"] = None
        try:
            from cupy.cuda import nccl

            v = nccl.get_version()
            out["nccl_cupy"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else str(v)
        except Exception:
            out["nccl_cupy"] = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            out["symm_mem_backend"] = symm_mem.get_backend(comm.device)
        except Exception:
            out["symm_mem_backend"] = None
    return out
