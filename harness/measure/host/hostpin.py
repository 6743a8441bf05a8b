"""Pin the measuring process to one CPU next to the GPU.

Host-bound figures (eager launch rate, `replay()` cost, a sync round trip) depend on the core the scheduler picks
and on migrations; two processes on the same VM measured the same eager op 30-110% apart. One fixed core of the
GPU's NUMA set, chosen the same way every run, removes the choice from the comparison.

VERIFYBENCH_PIN_CPU: "auto" (default when there is a GPU: the highest-numbered allowed CPU of GPU 0's affinity set;
CPU 0 takes most interrupts), "off", or a CPU number. The outcome lands in the fingerprint (`host_pin`).
"""
from __future__ import annotations

import os

import torch

from verifybench.harness.measure.host.nvml import nvml_handles
from verifybench.kernels.common import settings

ENV = settings.PIN_CPU
_state: dict = {"policy": "off", "cpu": None, "reason": "not requested", "applied": False}


def gpu_local_cpus(index: int = 0) -> set[int]:
    """CPUs NVML calls ideal for GPU `index` (its NUMA node); empty when NVML cannot say."""
    nv, handles = nvml_handles()
    if not nv or index >= len(handles):
        return set()
    words = 16  # 16 x 64 bits: up to 1024 CPUs
    try:
        masks = nv.nvmlDeviceGetCpuAffinity(handles[index], words)
    except Exception:
        return set()
    return {w * 64 + b for w, mask in enumerate(masks) for b in range(64) if (mask >> b) & 1}


def choose_cpu(allowed: set[int], local: set[int]) -> int:
    """The highest allowed CPU of the GPU-local set, else the highest allowed CPU."""
    pool = (allowed & local) or allowed
    return max(pool)


def pin(policy: str | None = None) -> dict:
    """Apply VERIFYBENCH_PIN_CPU (or `policy`) once per process (later calls without `policy` return the first
    outcome); returns what was done (also for the fingerprint). Pinned, torch's intra-op threads drop to 1: more
    threads on one CPU would only contend."""
    if policy is None and _state.get("applied"):
        return dict(_state)
    _state["applied"] = True
    policy = (policy or settings.read(ENV) or ("auto" if torch.cuda.is_available() else "off")).strip().lower()
    if not hasattr(os, "sched_setaffinity"):
        _state.update(policy=policy, cpu=None, reason="no sched_setaffinity on this platform")
        return dict(_state)
    if policy == "off":
        _state.update(policy="off", cpu=None, reason=f"{ENV}=off" if settings.read(ENV) else "no GPU")
        return dict(_state)
    allowed = os.sched_getaffinity(0)
    if policy == "auto":
        cpu = choose_cpu(allowed, gpu_local_cpus(0))
    else:
        try:
            cpu = int(policy)
        except ValueError:
            raise ValueError(f"{ENV} must be auto, off or a CPU number, got {policy!r}") from None
        if cpu not in allowed:
            raise ValueError(f"{ENV}={cpu}: not in this process's allowed CPUs {sorted(allowed)}")
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    _state.update(policy=policy, cpu=cpu, reason="pinned")
    return dict(_state)


def state() -> dict:
    return dict(_state)
