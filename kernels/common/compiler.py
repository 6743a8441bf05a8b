"""Triton kernels compiled for an architecture without a GPU: the shared memory per block a launch would need
(cached on disk beside Triton's own cache), the registers and stack ptxas gave, many such compiles on worker
processes, and a call outside the interpreter (whose kernels cannot be compiled)."""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
from pathlib import Path

from verifybench.kernels.common import interpret
from verifybench.kernels.common.atomic_files import write_atomic


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
        write_atomic(cached, lambda f: f.write(json.dumps({"shared": shared}).encode()))
    except OSError:  # a read-only cache costs a compile next time, nothing else
        pass
    return shared


def compiled(fn, types: dict[str, str], consts: dict, options: dict, cc: int):
    """`fn` compiled in full for sm_<cc> without a GPU (`types`: _source): Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compile(_source(fn, types, consts)[0], target=GPUTarget("cuda", cc, 32), options=options)


def _cuobjdump(kernel, flag: str) -> str:
    """What the cuobjdump that Triton ships says of `kernel`'s cubin (raises FileNotFoundError where this Triton has
    none)."""
    import subprocess
    import tempfile

    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        raise FileNotFoundError(f"no cuobjdump in this Triton ({cuobjdump})")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(cuobjdump), flag, str(cubin)], capture_output=True, text=True, check=True).stdout


def compiled_resources(fn, types: dict[str, str], consts: dict, options: dict, cc: int) -> dict:
    """{'registers', 'stack_bytes', 'shared_bytes', 'loops'} of `fn` compiled in full for sm_<cc> without a GPU
    (`types`: _source), as ptxas built it, read from the cubin: registers and stack per thread (a kernel that ptxas
    starves of registers shows a large stack), shared memory per block, and per loop in code order (a loop: the
    instructions from a backward branch's target to the branch) its instructions and, among them, LOOP_OPS' kinds.
    Local loads and stores in a loop are registers spilled and reloaded at every iteration: what a serial loop that
    waits on memory pays again each time."""
    import re

    kernel = compiled(fn, types, consts, options, cc)
    usage = _cuobjdump(kernel, "-res-usage")
    field = {k: re.search(rf"\b{k}:(\d+)", usage) for k in ("REG", "STACK")}
    if not all(field.values()):
        raise RuntimeError(f"cuobjdump -res-usage gave no REG/STACK figures: {usage[-300:]!r}")
    return {"registers": int(field["REG"][1]), "stack_bytes": int(field["STACK"][1]),
            "shared_bytes": kernel.metadata.shared, "loops": sass_loops(_cuobjdump(kernel, "-sass"))}


LOOP_OPS = {"local_loads": "LDL", "local_stores": "STL", "global_loads": "LDG", "mma": "HMMA"}


def sass_loops(sass: str) -> list[dict[str, int]]:
    """compiled_resources' loops from cuobjdump -sass text: `/*addr*/ [@P] OPCODE.mods operands ;` per instruction."""
    import re

    code = [(int(m[1], 16), m[2].split()[0].split(".")[0])
            for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(\S[^;]*);", sass, re.M)]
    targets = {int(m[1], 16): int(m[2], 16)
               for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass, re.M)}
    out = []
    for at, to in sorted(targets.items()):
        if to < at:
            body = [op for a, op in code if to <= a <= at]
            out.append({"instructions": len(body), **{k: body.count(op) for k, op in LOOP_OPS.items()}})
    return out


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
