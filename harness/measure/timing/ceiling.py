"""Copy-bandwidth ceiling of the device, measured in the same run, and eta against it.

eta = bytes a kernel must move / its time / this ceiling. The copy counts bytes read + written.
One ceiling per process and device: the baseline component's large hot copy when it ran (`verifybench run` starts
with it), else one measured on first use; every eta of a run is computed against that same figure.
"""
from __future__ import annotations

import torch

from verifybench.harness.measure import stance
from verifybench.harness.measure.stance import WITHHELD, cpu_numbers, mode_label
from verifybench.harness.measure.timing import memory
from verifybench.harness.measure.timing.modes import cache_bytes
from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec
from verifybench.harness.measure.timing.timer import Measurement, cuda_available

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
        memory.require(2 * size, f"a {size} B copy (source and destination)", device)
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
            g = gbps(2 * size, m.median_us)
            if mode == "hot" and size_bytes is None:  # the ceiling's own case: later etas of this run use it
                _CEILING[device] = (g, f"{name}, measured in this run")
            return {"bytes_moved": 2 * size, "gbps": g}

        return fn, check, derive

    name = f"copy/{size}B/{stance.case_mode(mode, device)}"
    return CaseSpec(name=name, params={"size_bytes": size, "device": device}, mode=mode,
                    setup=setup, measure_kw={"device": device})


_CEILING: dict[str, tuple[float, str]] = {}  # device -> (GB/s, which case measured it)


def copy_gbps(device: str | None = None) -> float:
    """The ceiling for eta: median GB/s of the large hot copy, once per process and device (the baseline
    component's figure when it ran first)."""
    device = device or ("cuda" if cuda_available() else "cpu")
    if device not in _CEILING:
        case = copy_case(device=device).run()
        full = COPY_BYTES_CUDA if device == "cuda" else COPY_BYTES_CPU
        # too little memory for the full copy: a quarter or a sixteenth of it, while still >= 2x the cache
        smaller = [size for size in (full // 4, full // 16) if size >= 2 * cache_bytes(device)]
        while case.skipped and smaller:
            case = copy_case(smaller.pop(0), device=device).run()
        if case.skipped:
            raise CaseSkipped(f"the copy ceiling that eta needs cannot be measured: {case.skipped}")
        if not case.check_ok:
            raise RuntimeError(f"copy ceiling check failed: {case.check_detail}")
        if device not in _CEILING:
            _CEILING[device] = (case.derived["gbps"], f"{case.name}, measured in this run (smaller: memory)")
    return _CEILING[device][0]


def copy_source(device: str | None = None) -> str | None:
    """Which case measured the ceiling `copy_gbps` returns (None before it was measured)."""
    got = _CEILING.get(device or ("cuda" if cuda_available() else "cpu"))
    return got[1] if got else None


def streaming_case_rows(records: list[dict], prefix: str, with_mode: bool = False) -> tuple[list[dict], list[dict]]:
    """The passing, timed records whose name starts with `prefix`, and one table row each for a weight-streaming
    kernel: median, MB moved, GB/s, eta and the bandwidth floor (derived figures the bench modules store). From a CPU
    run GB/s, eta and the floor are withheld: a CPU copy ceiling says nothing about a kernel's distance from a GPU's.
    A case that rotated over fewer sets than the rule wants (too little memory) says so in a `note` column."""
    ok = [r for r in records if r["name"].startswith(prefix) and r["check"]["ok"] and "summary" in r]
    cpu = cpu_numbers(records)
    rows = [{"case": r["name"], **({"mode": mode_label(r)} if with_mode else {}), "median_us": r["summary"]["median_us"],
             **({"distinct": r["derived"]["distinct_experts"]} if "distinct_experts" in r["derived"] else {}),
             "MB": r["derived"]["bytes_moved"] / 1e6, "GB/s": WITHHELD if cpu else r["derived"]["gbps"],
             "eta": WITHHELD if cpu else r["derived"]["eta"], "floor_us": WITHHELD if cpu else r["derived"]["floor_us"],
             **({"note": r["derived"]["memory_note"]} if r["derived"].get("memory_note") else {})} for r in ok]
    return ok, rows
