"""Per-GPU tuned config tables of the Triton kernels (MoE, skinny GEMM, MLA decode): JSON objects keyed by the GPU's
name; the shipped ones beside the kernels, the user's (`verifybench tune`) merged over them per GPU name; and the
notice of the kernels that ran on their defaults. Which GPU it is: devices.py; compiling for a GPU without one:
compiler.py."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from verifybench.kernels.common import devices  # a module attribute, so a test can stand in for the GPU
from verifybench.kernels.common import settings
from verifybench.kernels.common.atomic_files import write_atomic

CONFIG_DIR_ENV = settings.CONFIG_DIR  # where `verifybench tune` writes and selection reads the user's tables
TABLES_ENV = settings.CONFIG_TABLES  # "none": every kernel runs its defaults, as on a GPU nobody tuned

_TABLES: dict[str, dict] = {}
_EPOCH = [0]  # bumped by every save and every hide: selection caches key on state()
_HIDDEN: list[bool] = []


def load(path: Path | str) -> dict:
    """The table at `path`, read once ({} when absent); a file that is not a JSON object raises ValueError."""
    key = str(path)
    if key not in _TABLES:
        p = Path(path)
        try:
            table = json.loads(p.read_text()) if p.is_file() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a valid config table: {e}") from None
        if not isinstance(table, dict):
            raise ValueError(f"{p}: a config table must be a JSON object, got {type(table).__name__}")
        _TABLES[key] = table
    return _TABLES[key]


def save(table: dict, path: Path | str) -> Path:
    """Write the whole table through write_atomic: a reader never sees half a table."""
    path = write_atomic(Path(path), lambda f: f.write((json.dumps(table, indent=1, sort_keys=True) + "\n").encode()))
    _TABLES.pop(str(path), None)
    _EPOCH[0] += 1
    return path


def user_dir() -> Path:
    """$VERIFYBENCH_CONFIG_DIR, else ~/.config/verifybench (XDG_CONFIG_HOME when set)."""
    if settings.read(CONFIG_DIR_ENV):
        return Path(settings.read(CONFIG_DIR_ENV)).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "verifybench"


def user_path(shipped: Path | str) -> Path:
    """The user's table that goes over the shipped table `shipped` (same file name, in user_dir())."""
    return user_dir() / Path(shipped).name


def hidden() -> bool:
    """Whether selection ignores every table (VERIFYBENCH_CONFIG_TABLES=none, or inside defaults_only())."""
    if _HIDDEN:
        return _HIDDEN[-1]
    value = settings.read(TABLES_ENV, "")
    if value not in ("", "none"):
        raise ValueError(f"{TABLES_ENV} must be unset or 'none' (defaults only), got {value!r}")
    return value == "none"


@contextlib.contextmanager
def defaults_only(on: bool = True):
    """Selection inside the block sees no table (on) or the tables whatever the environment says (off): tuned and
    default configs side by side in one process."""
    _HIDDEN.append(bool(on))
    _EPOCH[0] += 1
    try:
        yield
    finally:
        _HIDDEN.pop()
        _EPOCH[0] += 1


def state() -> tuple:
    """What a cached selection depends on besides its own key: saves, hiding, the user's folder."""
    return _EPOCH[0], settings.read(TABLES_ENV), settings.read(CONFIG_DIR_ENV)


def merged(shipped: Path | str) -> dict:
    """The shipped table with the user's entries over it, per GPU name; {} when hidden()."""
    if hidden():
        return {}
    return {**load(shipped), **load(user_path(shipped))}


def fit_source(needed: int, limit: int) -> str:
    """The config_source of a default that replaced a tuned entry too large for this GPU."""
    return f"default (tuned entry needs {needed} B shared memory, GPU allows {limit} B)"


# ---------------------------------------------------------------------------------------------------- notice

_LOOKUPS: dict[tuple[str, str], set[tuple[str, str]]] = {}  # (gpu, kernel) -> {(detail, config_source)}
_NO_ENTRY: set[tuple[str, str]] = set()  # (gpu, kernel) whose tables have no entry for the GPU at all
_REPORTED: set[str] = set()
HIDDEN_SOURCE = f"default (tables hidden: {TABLES_ENV}=none)"


def record(kernel: str, device, detail: str, source: str, gpu_in_table: bool = True) -> None:
    """Note one selection from the tables on a CUDA device (`detail`: what it was for, 'n=3'; gpu_in_table: whether
    the tables have an entry for this GPU at all), for defaults_notice."""
    if torch.device(device).type != "cuda":
        return
    key = (devices.device_name(device), kernel)
    _LOOKUPS.setdefault(key, set()).add((detail, HIDDEN_SOURCE if hidden() else source))
    if not gpu_in_table and not hidden():
        _NO_ENTRY.add(key)


def sources(device) -> dict[str, list[str]]:
    """Per kernel, the config sources its selections on this GPU took so far in this process (for a case that
    runs many kernels, such as the verify forward)."""
    if torch.device(device).type != "cuda":
        return {}
    gpu = devices.device_name(device)
    return {k: sorted({s for _, s in seen}) for (g, k), seen in sorted(_LOOKUPS.items()) if g == gpu}


def _ns(details) -> str:
    """'n=1', 'n=3', 'n=5' -> 'n=1,3,5' (other details listed as they are)."""
    ns = sorted(int(d[2:]) for d in details if d.startswith("n=") and d[2:].isdigit())
    rest = sorted(d for d in details if not (d.startswith("n=") and d[2:].isdigit()))
    return ", ".join(([f"n={','.join(map(str, ns))}"] if ns else []) + rest)


def defaults_notice() -> list[str]:
    """Lines for the GPUs not reported yet whose kernels ran on defaults: no table entry for the GPU (or for these
    shapes), or a tuned entry too large for the GPU's shared memory. Marks those GPUs reported."""
    lines = []
    for gpu in sorted({g for g, _ in _LOOKUPS} - _REPORTED):
        missing, too_big, hid = [], [], []
        for (g, kernel), seen in sorted(_LOOKUPS.items()):
            if g != gpu:
                continue
            if any(s == HIDDEN_SOURCE for _, s in seen):
                hid.append(kernel)
            plain = {d for d, s in seen if s == "default"}
            if plain:
                missing.append(kernel if (g, kernel) in _NO_ENTRY else f"{kernel} ({_ns(plain)})")
            too_big += [f"{kernel} {d}: {s.partition('(')[2].rstrip(')')}" for d, s in sorted(seen)
                        if s.startswith("default (") and s != HIDDEN_SOURCE]
        if hid:
            lines.append(f"NOTE: {gpu}: tuned tables hidden ({TABLES_ENV}=none): {', '.join(hid)} ran on their "
                         "defaults")
        if missing:
            lines.append(f"NOTE: {gpu}: no tuned table for {', '.join(missing)}: running defaults; "
                         "`verifybench tune` tunes this GPU")
        if too_big:
            lines.append(f"NOTE: {gpu}: tuned entries too large for its shared memory, defaults run instead: "
                         f"{'; '.join(too_big)}")
        _REPORTED.add(gpu)
    return lines


def print_defaults_notice(print_fn=print) -> None:
    """Print defaults_notice() (nothing when every kernel ran tuned or every GPU was reported)."""
    for line in defaults_notice():
        print_fn(line)
