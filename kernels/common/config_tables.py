"""Per-GPU tuned config tables of the Triton kernels (MoE, skinny GEMM, MLA decode): JSON objects keyed by the GPU's
name; the shipped ones beside the kernels, the user's (`verifybench tune`) merged over them per GPU name."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
from pathlib import Path

import torch

from verifybench.kernels.common import interpret
from verifybench.kernels.common.atomic_files import write_atomic

CONFIG_DIR_ENV = "VERIFYBENCH_CONFIG_DIR"  # where `verifybench tune` writes and selection reads the user's tables
TABLES_ENV = "VERIFYBENCH_CONFIG_TABLES"  # "none": every kernel runs its defaults, as on a GPU nobody tuned
# Shared memory per block (opt-in maximum) by compute capability, for a device torch cannot ask and for compiling
# without a GPU
SMEM_LIMIT_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

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
    if os.environ.get(CONFIG_DIR_ENV):
        return Path(os.environ[CONFIG_DIR_ENV]).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "verifybench"


def user_path(shipped: Path | str) -> Path:
    """The user's table that goes over the shipped table `shipped` (same file name, in user_dir())."""
    return user_dir() / Path(shipped).name


def hidden() -> bool:
    """Whether selection ignores every table (VERIFYBENCH_CONFIG_TABLES=none, or inside defaults_only())."""
    if _HIDDEN:
        return _HIDDEN[-1]
    value = os.environ.get(TABLES_ENV, "")
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
    return _EPOCH[0], os.environ.get(TABLES_ENV), os.environ.get(CONFIG_DIR_ENV)


def merged(shipped: Path | str) -> dict:
    """The shipped table with the user's entries over it, per GPU name; {} when hidden()."""
    if hidden():
        return {}
    return {**load(shipped), **load(user_path(shipped))}


@functools.lru_cache(maxsize=None)
def _name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_name(device) -> str:
    """The table key of `device`: its CUDA name ('NVIDIA H200'), or 'cpu'."""
    return _name(torch.device(device))


@functools.lru_cache(maxsize=None)
def _limits(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return cc, smem or SMEM_LIMIT_BYTES.get(cc, min(SMEM_LIMIT_BYTES.values()))


def device_limits(device) -> tuple[int, int] | None:
    """(compute capability as 90, shared memory per block in bytes) of a CUDA device; None off CUDA (the
    interpreter has no shared memory to fit)."""
    return _limits(torch.device(device))


def fit_source(needed: int, limit: int) -> str:
    """The config_source of a default that replaced a tuned entry too large for this GPU."""
    return f"default (tuned entry needs {needed} B shared memory, GPU allows {limit} B)"


def _source(fn, types: dict[str, str], consts: dict):
    """(ASTSource, signature, attributes) of `fn` as a launch would compile it: `types` gives each argument not in
    `consts` its Triton type ('*bf16', 'i32', 'fp32'); pointers and ints typed with a leading '16:' ('16:i32') get
    the divisibility hint a launch gives them."""
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        ty = types[name]
        if ty.startswith(("*", "16:")):
            attrs[(i,)] = [["tt.divisibility", 16]]
        sig[name] = ty.removeprefix("16:")
    return ASTSource(fn, sig, consts, attrs), sig, attrs


def compiled_shared(fn, types: dict[str, str], consts: dict, options: dict, cc: int) -> int:
    """Shared memory per block (bytes) of the Triton kernel `fn` compiled for sm_<cc> without a GPU (`types`:
    _source). Triton fixes the figure when it lowers to LLVM IR, so the stages after that (PTX, ptxas: most of the
    time) are skipped where this Triton's stage list allows; otherwise it compiles in full."""
    from triton.backends.compiler import GPUTarget
    import triton

    source, sig, attrs = _source(fn, types, consts)
    key = json.dumps([fn.cache_key, sig, consts, sorted((k[0], v) for k, v in attrs.items()), cc, options,
                      triton.__version__], sort_keys=True, default=str)
    cached = _shared_cache() / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    if cached.is_file():
        return json.loads(cached.read_text())["shared"]
    if _CACHED_ONLY:
        raise NotCached(key)
    target = GPUTarget("cuda", cc, 32)
    try:
        shared = _shared_at_llir(source, target, options)
    except Exception:  # another Triton's internals: the public path, slower
        shared = triton.compile(source, target=target, options=options).metadata.shared
    try:
        save({"shared": shared}, cached)
    except OSError:  # a read-only cache costs a compile next time, nothing else
        pass
    return shared


def compiled_resources(fn, types: dict[str, str], consts: dict, options: dict, cc: int) -> dict[str, int]:
    """{'registers', 'stack_bytes', 'shared_bytes'} per thread / block of `fn` compiled in full for sm_<cc> without a
    GPU (`types`: _source), as ptxas allocated them: read from the cubin by the cuobjdump that Triton ships (raises
    FileNotFoundError where this Triton has none). A kernel that ptxas starves of registers shows a large stack."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    compiled = triton.compile(_source(fn, types, consts)[0], target=GPUTarget("cuda", cc, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        raise FileNotFoundError(f"no cuobjdump in this Triton ({cuobjdump})")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    field = {k: re.search(rf"\b{k}:(\d+)", usage) for k in ("REG", "STACK")}
    if not all(field.values()):
        raise RuntimeError(f"cuobjdump -res-usage gave no REG/STACK figures: {usage[-300:]!r}")
    return {"registers": int(field["REG"][1]), "stack_bytes": int(field["STACK"][1]),
            "shared_bytes": compiled.metadata.shared}


class NotCached(LookupError):
    """What compiled_shared raises inside cached_only() for a figure its disk cache lacks."""


_CACHED_ONLY: list[bool] = []


@contextlib.contextmanager
def cached_only():
    """compiled_shared inside the block answers from its disk cache or raises NotCached, compiling nothing: a caller
    learns what needs compiling before it starts processes to compile it."""
    _CACHED_ONLY.append(True)
    try:
        yield
    finally:
        _CACHED_ONLY.pop()


def _call(call: list):
    module, function, *args = call
    return getattr(importlib.import_module(module), function)(*args)


def compile_many(calls: list) -> list:
    """The results of `calls`, each [module, function, *args] run as module.function(*args) (JSON in and out: for
    uninterpreted), which compile through compiled_shared: the ones its disk cache answers run here, the misses on
    worker processes. So a warm cache starts no worker, which where the start method is not fork imports torch and
    triton (seconds)."""
    done, misses = {}, []
    with cached_only():
        for i, call in enumerate(calls):
            try:
                done[i] = _call(call)
            except NotCached:
                misses.append(i)
    workers = min(os.cpu_count() or 1, len(misses) // 2)  # two compiles a worker at least, to repay its start
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers) as pool:
            done.update(zip(misses, pool.map(_call, [calls[i] for i in misses])))
    return [done[i] if i in done else _call(call) for i, call in enumerate(calls)]


def _shared_cache() -> Path:
    """Figures of compiled_shared, kept beside Triton's own cache (its stages before PTX leave nothing there)."""
    base = os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache"
    return Path(base) / "verifybench_shared"


def _shared_at_llir(source, target, options: dict) -> int:
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **source.parse_options()))
    stages: dict = {}
    backend.add_stages(stages, opts, source.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(),
                            context)
    metadata = {"target": target, **opts.__dict__}
    for ext, stage in stages.items():
        module = stage(module, metadata)
        if ext == "llir":
            return metadata["shared"]
    raise KeyError("no llir stage")


def uninterpreted(module: str, function: str, *args):
    """module.function(*args) in a Python without TRITON_INTERPRET (JSON in and out): the interpreter's kernels
    cannot be compiled, and triton.jit chose the interpreter when the module was imported."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != interpret.ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    code = (f"import json, sys; from {module} import {function} as f; "
            "print(json.dumps(f(*json.load(sys.stdin))))")
    run = subprocess.run([sys.executable, "-c", code], input=json.dumps(args), env=env, capture_output=True,
                         text=True)
    if run.returncode:
        raise RuntimeError(f"{module}.{function} failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.splitlines()[-1])


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
    key = (device_name(device), kernel)
    _LOOKUPS.setdefault(key, set()).add((detail, HIDDEN_SOURCE if hidden() else source))
    if not gpu_in_table and not hidden():
        _NO_ENTRY.add(key)


def sources(device) -> dict[str, list[str]]:
    """Per kernel, the config sources its selections on this GPU took so far in this process (for a case that
    runs many kernels, such as the verify forward)."""
    if torch.device(device).type != "cuda":
        return {}
    gpu = device_name(device)
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
