"""Copy-bandwidth ceiling of the device, measured in the same run, and eta against it.

eta = bytes a kernel must move / its time / this ceiling (DESIGN.md section 3). The copy counts bytes read + written.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from verifybench.harness.engine.runner import CaseSpec
from verifybench.harness.engine.timing import Measurement, cuda_available

COPY_BYTES_CUDA = 1 << 30  # 1 GiB each way: >> L2, long enough that launch cost is < 0.1%
COPY_BYTES_CPU = 32 << 20


def gbps(bytes_moved: int, time_us: float) -> float:
    """GB/s with GB = 1e9 B."""
    return bytes_moved / (time_us * 1e-6) / 1e9


def eta(bytes_moved: int, time_us: float, copy_gbps: float) -> float:
    """Fraction of the measured copy bandwidth that moving `bytes_moved` in `time_us` reaches."""
    return gbps(bytes_moved, time_us) / copy_gbps


def copy_case(size_bytes: int | None = None, mode: str = "hot", device: str | None = None) -> CaseSpec:
    """A device-to-device copy of `size_bytes` (random bytes); derived: bytes_moved (read + write) and GB/s."""
    device = device or ("cuda" if cuda_available() else "cpu")
    size = size_bytes or (COPY_BYTES_CUDA if device == "cuda" else COPY_BYTES_CPU)

    def setup():
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)

        def fn():
            dst.copy_(src)

        def check():
            dst.fill_(0)
            fn()
            ok = torch.equal(dst, src)
            return ok, "dst == src" if ok else "copy produced different bytes"

        def derive(m: Measurement) -> dict:
            return {"bytes_moved": 2 * size, "gbps": gbps(2 * size, m.median_us)}

        return fn, check, derive

    return CaseSpec(name=f"copy/{size}B/{mode}", params={"size_bytes": size, "device": device}, mode=mode,
                    setup=setup, measure_kw={"device": device})


@lru_cache(maxsize=None)
def copy_gbps(device: str | None = None) -> float:
    """The ceiling for eta: median GB/s of the large copy, measured once per process and device."""
    case = copy_case(device=device).run()
    if not case.check_ok:
        raise RuntimeError(f"copy ceiling check failed: {case.check_detail}")
    return case.derived["gbps"]


def streaming_case_rows(records: list[dict], prefix: str, with_mode: bool = False) -> tuple[list[dict], list[dict]]:
    """The passing, timed records whose name starts with `prefix`, and one table row each for a weight-streaming
    kernel: median, MB moved, GB/s, eta and the bandwidth floor (derived figures the bench modules store)."""
    ok = [r for r in records if r["name"].startswith(prefix) and r["check"]["ok"] and "summary" in r]
    rows = [{"case": r["name"], **({"mode": r["mode"]} if with_mode else {}), "median_us": r["summary"]["median_us"],
             **({"distinct": r["derived"]["distinct_experts"]} if "distinct_experts" in r["derived"] else {}),
             "MB": r["derived"]["bytes_moved"] / 1e6, "GB/s": r["derived"]["gbps"], "eta": r["derived"]["eta"],
             "floor_us": r["derived"]["floor_us"]} for r in ok]
    return ok, rows
