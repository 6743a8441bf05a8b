"""The `tune` command line shared by the kernel bench modules that write a tuned config table (skinny GEMM, MLA
decode): the same options, the same --smoke re-exec under the Triton interpreter, the same refusal without a GPU."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from verifybench.harness.engine.timing import cuda_available


def tune_main(argv, module: str, doc: str, config_path: Path, default_out: str, default_time_limit_s: float,
              interpreted: bool, run: Callable[[argparse.Namespace], object]) -> int:
    """Parse `tune [--preset --tp --out --time-limit --smoke]` and call run(args). `interpreted`: whether triton
    was imported under TRITON_INTERPRET=1 (it decides at import, so --smoke otherwise restarts the process)."""
    ap = argparse.ArgumentParser(prog=f"python3 -m {module}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["tune"])
    ap.add_argument("--preset", default="kimi-k2.5")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--out", default=None, help=f"table JSON to write (default {default_out}; "
                    f"{config_path.name} in kernels/ is the committed one)")
    ap.add_argument("--time-limit", type=float, default=default_time_limit_s,
                    help=f"seconds for the sweep after start-up (default {default_time_limit_s:g})")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter: checks "
                    "the tune path, times nothing meaningful")
    args = ap.parse_args(argv)
    if args.smoke and not interpreted:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        argv = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    if not args.smoke and not cuda_available():
        print("tune needs a CUDA GPU (or --smoke on CPU)")
        return 2
    run(args)
    return 0


def report_tune(log, written: Path, t0: float, gpu: str, copy_gbps: float, rows: list[dict], time_limit_s: float,
                not_tuned: list[str], notes: tuple[str, ...] = ()) -> None:
    """The tuners' closing lines: what the time limit cut, where the table went, the table."""
    import time

    from tabulate import tabulate

    if not_tuned:
        log(f"time limit ({time_limit_s:.0f} s) reached: not tuned (default config at run time): "
            f"{', '.join(not_tuned)}")
    for note in notes:
        log(note)
    log(f"wrote {written} ({time.perf_counter() - t0:.0f} s, {gpu}, copy {copy_gbps:.0f} GB/s)")
    log(tabulate(rows, headers="keys", floatfmt=".3g"))
