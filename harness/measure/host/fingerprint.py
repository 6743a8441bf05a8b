"""Run fingerprint: the GPU, its clocks and throttle state, GPU-to-GPU links and P2P access, software versions,
the environment and the git state.

Works without a GPU (fewer fields); pynvml imports without one but fails on first use, so every probe is guarded.
"""
from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

from verifybench.harness.measure.host import hostpin, topology
from verifybench.harness.measure.host.nvml import nvml_handles, try_call as _try
from verifybench.harness.measure.host.topology import NVLINK_MAX_LINKS
from verifybench.kernels.common import devices, settings

ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_")
# clock-event reasons that mean the GPU ran slower than asked (idle, app-clock and sync-boost are not throttling)
THROTTLE_BITS = {
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
}
REPO = Path(__file__).resolve().parents[3]  # the checkout (git state); absent in a wheel install


def _event_reasons(nv, h) -> int | None:
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        if hasattr(nv, name):
            return _try(getattr(nv, name), h)
    return None


def clock_snapshot(index: int | None = None) -> dict | None:
    """SM/memory clocks, clock-event reasons, power and temperature of one GPU now; `throttled` if any
    reason in THROTTLE_BITS is set. None without NVML."""
    nv, handles = nvml_handles()
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if nv is None or index >= len(handles):
        return None
    h = handles[index]
    reasons = _event_reasons(nv, h)
    active = [name for name, bit in THROTTLE_BITS.items() if reasons is not None and reasons & bit]
    power_mw = _try(nv.nvmlDeviceGetPowerUsage, h)
    return {
        "sm_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
        "mem_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
        "clock_event_reasons": reasons,
        "throttle_reasons": active,
        "throttled": bool(active),
        "power_w": power_mw / 1000 if power_mw is not None else None,
        "temperature_c": _try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
    }


def _gpu_static(nv, h, index: int) -> dict:
    ecc = _try(nv.nvmlDeviceGetEccMode, h)
    power_limit_mw = _try(nv.nvmlDeviceGetEnforcedPowerLimit, h)
    links = {}
    for link in range(NVLINK_MAX_LINKS):
        state = _try(nv.nvmlDeviceGetNvLinkState, h, link)
        if state is None:
            break
        links[link] = bool(state)
    return {
        "index": index,
        "name": _try(nv.nvmlDeviceGetName, h),
        "uuid": _try(nv.nvmlDeviceGetUUID, h),
        "sm_clock_max_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
        "mem_clock_max_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM),
        "power_limit_w": power_limit_mw / 1000 if power_limit_mw is not None else None,
        "ecc_current": ecc[0] if ecc else None,
        "pcie_gen": _try(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
        "pcie_width": _try(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
        "nvlink_active": sum(links.values()),
        "nvlink_links": len(links),
        "now": clock_snapshot(index),
    }


# The inference engines whose kernels the suite times beside its own (harness/engines), by the name pip knows them
ENGINE_DISTRIBUTIONS = {"sglang": "sglang", "flashinfer": "flashinfer-python", "sgl_kernel": "sgl-kernel",
                        "vllm": "vllm"}


def engine_versions() -> dict[str, str | None]:
    """The installed version of each engine (None where absent), read without importing it (an engine's import pulls
    in its serving stack: seconds)."""
    import importlib.metadata

    out = {}
    for engine, dist in ENGINE_DISTRIBUTIONS.items():
        try:
            out[engine] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[engine] = None
    return out


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
           "engines": engine_versions()}
    for name in ("triton", "cupy", "numpy", "scipy", "pytest_benchmark"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:
        out["nccl"] = None
    return out


def _git() -> dict:
    def git(*args):
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None

    if settings.read(settings.GIT_COMMIT):
        # the launcher says which commit it sent (a copy without .git, or an exported snapshot inside another
        # checkout, whose enclosing HEAD would be the wrong answer)
        return {"commit": settings.read(settings.GIT_COMMIT), "dirty": None, "source": "environment"}
    try:
        commit = git("rev-parse", "HEAD")
    except Exception:
        commit = None
    if commit is None:
        return {"commit": None, "dirty": None, "source": "no git"}
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "source": "git"}


def collect() -> dict:
    """The full fingerprint of this machine and process, as plain JSON-able data."""
    nv, handles = nvml_handles()
    gpus = [_gpu_static(nv, h, i) for i, h in enumerate(handles)] if nv else []
    fp = {
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "host_pin": hostpin.state(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cuda_available": torch.cuda.is_available(),
        "driver": _try(nv.nvmlSystemGetDriverVersion) if nv else None,
        "cuda_driver": _try(nv.nvmlSystemGetCudaDriverVersion) if nv else None,
        "gpus": gpus,
        "topology": topology.collect(),
        "versions": _versions(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "git": _git(),
    }
    if torch.cuda.is_available():
        p = devices.properties("cuda")
        fp["torch_device"] = {"name": p["name"], "sm_count": p["sms"], "capability": f"{p['cc'] // 10}.{p['cc'] % 10}",
                              "memory_bytes": p["memory"], "l2_bytes": p["l2"]}
    fp["gpu_model"] = gpu_model(fp)
    fp["slug"] = machine_slug(fp)
    return fp


def gpu_model(fp: dict) -> str:
    """The GPU model name compare() matches on ('cpu' without a GPU), from the GPU list, else torch's device. A
    stored `gpu_model` (what reports and plan read) must say the same: ValueError when the fingerprint contradicts
    itself, as an edited file does."""
    if fp.get("gpus"):
        model = fp["gpus"][0]["name"] or "unknown-gpu"
    elif fp.get("torch_device"):
        model = fp["torch_device"]["name"]
    else:
        return fp.get("gpu_model") or "cpu"
    stored = fp.get("gpu_model")
    if stored is not None and stored != model:
        raise ValueError(f"the fingerprint contradicts itself: gpu_model {stored!r} but its GPU is {model!r}")
    return model


def machine_slug(fp: dict) -> str:
    """Folder name under results/: the GPU model and count, e.g. 'nvidia-h200-x2', or 'cpu'."""
    model = gpu_model(fp)
    if model == "cpu":
        return "cpu"
    base = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"{base}-x{max(1, len(fp.get('gpus') or [1]))}"


def throttled(fp: dict) -> bool:
    return any((g.get("now") or {}).get("throttled") for g in fp.get("gpus", []))
