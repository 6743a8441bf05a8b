"""Whether figures can carry a conclusion: CPU numbers, or a torch reference standing in for a kernel, never yield a
ranking, a verdict, an engine flag, an `export` line, exit code 1 or a chart comparison. Every command asks here."""
from __future__ import annotations

WITHHELD = "withheld: CPU numbers"  # in a table cell: a figure CPU timer noise cannot support
NO_CONCLUSION = "conclusions from CPU numbers are withheld"
# The one line every command prints instead of a ranking, a verdict or a setting when its inputs are CPU numbers
CPU_STANCE = ("CPU numbers: perf_counter times of torch CPU code on a shared host; they carry no ranking, verdict, "
              "engine setting or recommendation")

# gloo on CPU: the NCCL variables do nothing there, so a CPU sweep's order between settings is noise on unread variables
NO_NCCL_ADVICE = "CPU sweep results give no NCCL recommendation"

# What a mode means when the samples are perf_counter times of CPU code (measure/timing/timer.py's CPU sampler)
# (`eager`: the allreduce's name for the engine's `hot`)
CPU_MODE_LABELS = {"graph": "cpu-loop", "hot": "cpu-hot", "eager": "cpu-hot", "cold": "cpu-cold", "cycle": "cpu-cycle"}
CPU_TIMING = "CPU: perf_counter; cpu-loop = K calls in a Python loop (no CUDA graph), cpu-cold = 64 MiB written first"


def cpu_numbers(records: list[dict]) -> bool:
    """Whether stored case records come from a CPU run (perf_counter samples of torch CPU code): their derived
    conclusions (fits, ratios, eta, break-even) are withheld in tables and reports."""
    return any(r.get("device") == "cpu" for r in records)


def cpu_fingerprint(fp: dict | None) -> bool:
    """A fingerprint of a machine without a GPU (a CPU smoke run's)."""
    return bool(fp) and (fp.get("gpu_model") == "cpu" or fp.get("cuda_available") is False)


def is_cpu_run(run: dict) -> bool:
    """A CPU smoke run: no GPU in its fingerprint, or CPU case records (conclusions from it are withheld)."""
    return cpu_numbers(run.get("cases") or []) or cpu_fingerprint(run.get("fingerprint"))


def any_cpu(runs) -> bool:
    """Whether any of `runs` (result dicts) holds CPU numbers: then nothing built from them is ranked or judged."""
    return any(is_cpu_run(r) for r in runs if isinstance(r, dict))


def refusal(run: dict, where) -> str | None:
    """The one-line refusal of a command that only draws conclusions (plan, project, trace --against), or None."""
    return f"{where}: a CPU smoke run; {NO_CONCLUSION}" if is_cpu_run(run) else None


def stand_in(case: dict) -> str | None:
    """What a torch reference stood in for (the kernel the case names but did not run: a CPU cycle's attention),
    or None when the named kernel ran. A stand-in's time says nothing about the kernel."""
    asked = case.get("params", {}).get("attention")
    ran = case.get("derived", {}).get("attention_ran", asked)
    return asked if ran != asked else None


def rate(column: str) -> bool:
    """A bandwidth column (GB/s): bytes over a CPU time says nothing of a GPU's, and the interpreter's read 0.000."""
    return "GB/s" in column


def withhold(rows: list[dict], keys) -> list[dict]:
    """Table rows with the cells under `keys` (a collection, or a predicate on the column name) replaced by
    WITHHELD where they hold a value."""
    hit = keys if callable(keys) else (lambda k: k in keys)
    return [{k: (WITHHELD if hit(k) and v is not None else v) for k, v in row.items()} for row in rows]


def withhold_on_cpu(records: list[dict], rows: list[dict], keys) -> list[dict]:
    """The one withholding rule: every derived figure (fit, ratio, eta, share, break-even, gain) of a table passes
    through here; from a CPU run (cpu_numbers) its cells read WITHHELD, from a GPU run they stay."""
    return withhold(rows, keys) if cpu_numbers(records) else rows


def cpu_mode(mode: str | None) -> str | None:
    """A mode as a CPU record's reader sees it (never `graph`/`eager`: there is no graph and no device on CPU);
    an already CPU label stays."""
    if mode is None or mode.startswith("cpu-"):
        return mode
    return CPU_MODE_LABELS.get(mode, f"cpu-{mode}")


def gpu_mode(label: str) -> str:
    """The GPU mode a CPU label stands for (cpu-loop -> graph); any other name unchanged."""
    return {"cpu-loop": "graph", "cpu-hot": "hot", "cpu-cold": "cold", "cpu-cycle": "cycle"}.get(label, label)


def case_mode(mode: str, device: str) -> str:
    """The mode as a case's name (its JSON name, its pytest-benchmark ID) carries it: on CPU the CPU label."""
    return cpu_mode(mode) if device == "cpu" and mode in CPU_MODE_LABELS else mode


def cpu_case_name(name: str) -> str:
    """A CPU case's name as this version gives it: an older file's `.../graph` reads `.../cpu-loop`, so old and new
    CPU files line up in compare."""
    head, sep, last = name.rpartition("/")
    return f"{head}/{CPU_MODE_LABELS[last]}" if sep and last in CPU_MODE_LABELS else name


def mode_label(record: dict) -> str:
    """The mode as a table shows it: a GPU record's own; a CPU record's says it was a CPU timing (never `graph`)."""
    mode = record.get("mode")
    return cpu_mode(mode) if record.get("device") == "cpu" else mode
