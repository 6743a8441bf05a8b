"""Every VERIFYBENCH_* environment variable the suite reads, in one place: its name, what it means, and the one read
of it. kernels/ and harness/ both call `read`; each caller checks the kind of value it takes (named in its error)."""
from __future__ import annotations

import math
import os

ALLREDUCE_FROM = "VERIFYBENCH_ALLREDUCE_FROM"
ALLREDUCE_US = "VERIFYBENCH_ALLREDUCE_US"
CONFIG_DIR = "VERIFYBENCH_CONFIG_DIR"
CONFIG_TABLES = "VERIFYBENCH_CONFIG_TABLES"
GIT_COMMIT = "VERIFYBENCH_GIT_COMMIT"
HOST_GATE = "VERIFYBENCH_HOST_GATE"
MAX_TIME_S = "VERIFYBENCH_MAX_TIME_S"
MEMORY_CAP_GIB = "VERIFYBENCH_MEMORY_CAP_GIB"
MOE_TRACE = "VERIFYBENCH_MOE_TRACE"
PDL = "VERIFYBENCH_PDL"
PIN_CPU = "VERIFYBENCH_PIN_CPU"
VERIFY_OPS = "VERIFYBENCH_VERIFY_OPS"

# name -> (what it takes, what it does); docs/measuring.md's "Settings" table lists the same (a test holds the two equal)
VARIABLES = {
    ALLREDUCE_FROM: ("PATH or PATH:BACKEND", "the one-GPU forward's allreduce stand-in waits the latency measured in "
                     "this allreduce result or NCCL sweep summary (at each n's size; fastest backend unless named); "
                     "`--allreduce-from` gives the same for one run"),
    ALLREDUCE_US: ("microseconds in [0, 10000]", "the one-GPU forward's allreduce stand-in waits this long (default: "
                   "a reference figure, 2xH200 over NVLink); not with VERIFYBENCH_ALLREDUCE_FROM"),
    CONFIG_DIR: ("a folder", "where `verifybench tune` writes the user's config tables and selection reads them "
                 "(default ~/.config/verifybench)"),
    CONFIG_TABLES: ("unset or `none`", "`none`: every kernel runs its default config, as on a GPU nobody tuned"),
    GIT_COMMIT: ("a commit", "the commit the fingerprint records where the tree has no .git (a copy sent elsewhere)"),
    HOST_GATE: ("`on` (default) or `off`", "`off` keeps every timed batch, slow host states included"),
    MAX_TIME_S: ("seconds > 0", "the time cap per case (default 2 s; 0.2 s on CPU); a component's shorter cap stays"),
    MEMORY_CAP_GIB: ("GiB > 0", "cap this process's GPU memory (94 acts like a 96 GB card): what does not fit runs "
                     "fewer layers or says what it needed"),
    MOE_TRACE: ("a routing trace file", "the MoE component adds `trace` cases routed as in this file"),
    PDL: ("`1` (default) or `0`", "`0`: our kernels launch without programmatic dependent launch (sm_90+)"),
    PIN_CPU: ("`auto`, `off` or a CPU number", "the CPU the measuring process is pinned to (default auto on a GPU "
              "machine: the highest CPU of GPU 0's affinity set)"),
    VERIFY_OPS: ("`fused` or `torch`", "the verify forward's small ops: fused kernels (default on a GPU) or one torch "
                 "op per kernel (default on CPU)"),
}


def read(name: str, default: str | None = None) -> str | None:
    """The value of the VERIFYBENCH_* variable `name` as set now, else `default`; KeyError for a name not listed in
    VARIABLES (a variable nobody documented)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a setting of the suite (kernels/common/settings.py lists them)")
    return os.environ.get(name, default)


def positive_float(name: str, text: str, unit: str, hint: str = "") -> float:
    """`text`, the value of the variable `name`, as a finite number of `unit` > 0; else a ValueError naming the
    variable (with `hint`, an example, after the rule)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number of {unit} > 0{hint}, got {text!r}")
    return value
