"""What the kernel tuners share: the table they write (this GPU's entry over the shipped one, other GPUs kept, one
atomic write) and their closing report."""
from __future__ import annotations

import copy
import time
from pathlib import Path

from verifybench.kernels.common import config_tables


def merged_table(path: Path | str, shipped: Path | str, gpu: str) -> tuple[dict, dict]:
    """(the table to write at `path`: the one there, else {}; this GPU's entry to update in it: its entry there,
    else a copy of the shipped table's, else {})."""
    table = copy.deepcopy(config_tables.load(path))
    entry = table.get(gpu) or copy.deepcopy(config_tables.load(shipped).get(gpu, {}))
    table[gpu] = entry
    return table, entry


def report_tune(log, written: Path, t0: float, gpu: str, copy_gbps: float, rows: list[dict], time_limit_s: float,
                not_tuned: list[str], notes: tuple[str, ...] = ()) -> None:
    """The tuners' closing lines: what the time limit cut, where the table went, the table."""
    from tabulate import tabulate

    if not_tuned:
        log(f"time limit ({time_limit_s:.0f} s) reached: not tuned (default config at run time): "
            f"{', '.join(not_tuned)}")
    for note in notes:
        log(note)
    log(f"wrote {written} ({time.perf_counter() - t0:.0f} s, {gpu}, copy {copy_gbps:.0f} GB/s)")
    log(tabulate(rows, headers="keys", floatfmt=".3g"))
