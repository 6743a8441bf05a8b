"""The suite's memory rule: before a component allocates, what it needs is held against what is free (under
VERIFYBENCH_MEMORY_CAP_GIB when set); when short it runs what fits, or its case is skipped naming both figures.

need(x) fits when  need(x) * (1 + MARGIN) + RESERVE_BYTES[device] <= free.  MARGIN covers what the planned tensors
do not count (activations, temporaries, graph pools, allocator rounding: the K2.5 verify forward allocates 70.9 GiB
and peaks near 74 GiB on an H200); the reserve is kept for the CUDA context and library workspaces. "Free" on a GPU
is what the device has free once dead Python objects are collected and torch's cache has returned its unused
blocks (blocks a cache keeps are not counted: a graph's private pool or a fragment cannot serve a new large tensor),
and under the cap no more than the cap minus what torch has reserved; on a CPU it is the least of the kernel's
MemAvailable, what the container's cgroup limit leaves (v2 memory.max, v1 memory.limit_in_bytes) and what the
process's rlimits leave (ulimit -v, -d), and under the cap, the cap minus this process's RSS.
"""
from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from verifybench.kernels.common import devices, settings
from verifybench.kernels.common.settings import positive_float

CAP_ENV = settings.MEMORY_CAP_GIB
MARGIN = 0.05
RESERVE_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
GIB = 1 << 30
_applied: dict = {}


def cap_bytes() -> int | None:
    """VERIFYBENCH_MEMORY_CAP_GIB in bytes (None when unset); ValueError naming it for anything but a number > 0."""
    text = settings.read(CAP_ENV)
    if text is None or not text.strip():
        return None
    return int(positive_float(CAP_ENV, text, "GiB", " (e.g. 94 to act like a 96 GB card)") * GIB)


def apply_cap() -> dict | None:
    """Cap this process's torch CUDA allocations at VERIFYBENCH_MEMORY_CAP_GIB (a fraction of the card's total
    memory), once; returns what was applied (None: no cap). Without CUDA the cap only lowers `free_bytes`."""
    cap = cap_bytes()
    if cap is None:
        return None
    import torch

    if torch.cuda.is_available() and not _applied:
        total = devices.total_memory_bytes("cuda")
        fraction = min(1.0, cap / total)
        torch.cuda.set_per_process_memory_fraction(fraction)
        _applied.update(cap_bytes=cap, total_bytes=total, fraction=fraction)
    return dict(_applied) or {"cap_bytes": cap}


def _meminfo_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _read_int(path: Path) -> int | None:
    """An integer file of the kernel's (None: absent, unreadable, or "max", no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def _cgroup_paths(root: Path, proc_cgroup: str | None = None) -> tuple[Path | None, Path | None]:
    """(this process's cgroup v2 folder, its v1 memory controller folder), each where it exists: the path
    /proc/self/cgroup (or `proc_cgroup`, its text) names under `root`, else `root` itself (a container sees its own
    cgroup as the root)."""
    v2 = v1 = None
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    for line in proc_cgroup.splitlines():
        hier, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hier == "0" and controllers == "":
            v2 = root / path.lstrip("/")
        elif "memory" in controllers.split(","):
            v1 = root / "memory" / path.lstrip("/")
    v2 = next((p for p in (v2, root) if p is not None and (p / "memory.max").is_file()), None)
    v1 = next((p for p in (v1, root / "memory") if p is not None and (p / "memory.limit_in_bytes").is_file()), None)
    return v2, v1


def container_free_bytes(root: Path | None = None, proc_cgroup: str | None = None) -> int | None:
    """What the container's memory limit leaves: cgroup v2 memory.max - memory.current (the least over the process's
    cgroup and its parents), or v1 memory.limit_in_bytes - memory.usage_in_bytes (None: no limit set)."""
    root = root or CGROUP_ROOT
    v2, v1 = _cgroup_paths(root, proc_cgroup)
    free = []
    for folder in ([v2, *(p for p in v2.parents if p.is_relative_to(root))] if v2 is not None else []):
        limit, used = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
        if limit is not None:  # a parent's limit holds its children too
            free.append(limit - (used or 0))
    if v1 is not None:
        limit, used = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
        if limit is not None and limit < NO_LIMIT:
            free.append(limit - (used or 0))
    return max(0, min(free)) if free else None


def process_free_bytes() -> int | None:
    """What this process's own limits leave (ulimit -v, ulimit -d): RLIMIT_AS less its address space, RLIMIT_DATA
    less its data segment (None: neither set)."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            fields = [int(x) * os.sysconf("SC_PAGE_SIZE") for x in f.read().split()]
    except (OSError, ValueError):
        return None
    free = []
    for limit, used in ((resource.RLIMIT_AS, fields[0]), (resource.RLIMIT_DATA, fields[5])):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            free.append(soft - used)
    return max(0, min(free)) if free else None


def _cpu_available_bytes() -> int:
    """The least of what the kernel has available (MemAvailable), what the container's cgroup limit leaves and what
    this process's rlimits leave: an allocation past any of them fails."""
    return min(x for x in (_meminfo_available_bytes(), container_free_bytes(), process_free_bytes()) if x is not None)


def _cpu_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def free_bytes(device: str) -> int:
    """Bytes a new allocation on `device` ("cuda" or "cpu") can still get, under the cap when one is set."""
    cap = cap_bytes()
    if device == "cuda":
        import torch

        from verifybench.harness.measure.timing.runner import release_unreferenced

        apply_cap()
        release_unreferenced()
        device_free, _ = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        return max(0, min(device_free, cap - reserved) if cap is not None else device_free)
    free = _cpu_available_bytes()
    return max(0, min(free, cap - _cpu_rss_bytes()) if cap is not None else free)


def live_bytes(device: str) -> int:
    """Bytes of tensors alive on `device`: torch's allocated bytes on a GPU; on a CPU, the distinct storages of the
    tensors Python can reach (collected first), so a test can see what a module left behind on either."""
    import torch

    gc.collect()
    if device == "cuda":
        # cuBLAS keeps a workspace per handle and stream in the allocator (32 MiB each on an H200, one per capture
        # stream): not tensors, and freed only when asked
        torch._C._cuda_clearCublasWorkspaces()
        return torch.cuda.memory_allocated()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (a sparse or wrapper subclass)
                continue
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def budget(need: int, device: str) -> int:
    """What `need` bytes of planned tensors take on `device` with the margin and the reserve."""
    return math.ceil(need * (1 + MARGIN)) + RESERVE_BYTES[device]


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def shortfall(what: str, need: int, free: int, device: str) -> str:
    """The one message of the suite for too little memory: what, the bytes it needs (with the rule's margin and
    reserve) and the bytes free."""
    where = f" under {CAP_ENV}={settings.read(CAP_ENV)}" if cap_bytes() is not None else ""
    if device == "cpu" and not where:  # name the limit that binds, where it is not the machine's memory
        limits = {"this process's rlimit (ulimit -v / -d)": process_free_bytes(),
                  "the container's cgroup memory limit": container_free_bytes()}
        binding = [name for name, left in limits.items() if left is not None and left <= free]
        where = f" under {binding[0]}" if binding else ""
    return (f"{what} needs {gib(budget(need, device))} ({need} B planned + {MARGIN:.0%} + "
            f"{gib(RESERVE_BYTES[device])} reserve) "
            f"but {gib(free)} ({free} B) is free{where}")


def require(need: int, what: str, device: str) -> None:
    """Raise CaseSkipped naming the bytes needed and free when `need` bytes do not fit on `device`."""
    from verifybench.harness.measure.timing.runner import CaseSkipped

    free = free_bytes(device)
    if budget(need, device) > free:
        raise CaseSkipped(shortfall(what, need, free, device))


@dataclass(frozen=True)
class Plan:
    """How many units (layers, rotation sets) of a component fit: `units` of `wanted` (0: not even `least`);
    `note` says why fewer than wanted run, `skip` why none does."""

    units: int
    wanted: int
    need_bytes: int
    free_bytes: int
    note: str = ""
    skip: str = ""

    @property
    def reduced(self) -> bool:
        return 0 < self.units < self.wanted

    def as_dict(self) -> dict:
        return {"units": self.units, "wanted": self.wanted, "need_bytes": self.need_bytes,
                "free_bytes": self.free_bytes, **({"note": self.note} if self.note else {})}


def plan(need_of: Callable[[int], int], wanted: int, least: int, what: str, unit: str, device: str,
         free: int | None = None) -> Plan:
    """The largest count in [least, wanted] whose `need_of(count)` bytes fit what is free on `device`."""
    if least < 1 or wanted < least:
        raise ValueError(f"need 1 <= least <= wanted, got least={least}, wanted={wanted}")
    free = free_bytes(device) if free is None else free
    for units in range(wanted, least - 1, -1):
        need = need_of(units)
        if budget(need, device) <= free:
            if units == wanted:
                return Plan(units, wanted, need, free)
            return Plan(units, wanted, need, free,
                        note=f"memory: {units} of {wanted} {unit} ({shortfall(what, need_of(wanted), free, device)})")
    need = need_of(least)
    return Plan(0, wanted, need, free,
                skip=shortfall(f"{what} ({least} {unit}, the least it can run)", need, free, device))
