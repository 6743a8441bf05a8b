"""NVML access that works without a GPU: pynvml imports without a driver but fails on first use, so every call is
guarded and returns None (or a default) instead of raising."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _init() -> tuple[object | None, str | None]:
    try:
        import pynvml
    except Exception as e:
        return None, f"pynvml not importable ({type(e).__name__})"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return None, f"NVML did not start ({type(e).__name__}: {e}): no NVIDIA driver here"
    return pynvml, None


def nvml():
    """pynvml, initialised, or None when there is no driver."""
    return _init()[0]


def unavailable_reason() -> str | None:
    """Why nvml() is None, or None when NVML works."""
    return _init()[1]


def try_call(fn, *args, default=None):
    try:
        value = fn(*args)
    except Exception:
        return default
    return value.decode() if isinstance(value, bytes) else value


def nvml_handles():
    nv = nvml()
    if nv is None:
        return nv, []
    count = try_call(nv.nvmlDeviceGetCount, default=0)
    return nv, [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
