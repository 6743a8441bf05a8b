"""The Triton interpreter on a machine without CUDA: the command line turns it on before any kernel is imported, so
the CPU smoke profile runs (and checks) every Triton kernel on CPU tensors without the user exporting anything.

triton.jit picks the interpreter when a kernel is decorated, i.e. when its module is first imported: the switch
only works before that, which is why the CLI calls enable_without_gpu() before it imports a component.
"""
from __future__ import annotations

import os
import sys

from verifybench.kernels.common import interpret
from verifybench.kernels.common.interpret import ENV

KERNELS_PACKAGE = "verifybench.kernels"
_STATE: dict[str, str] = {}  # "how": who set the interpreter (set_here, user, off, too_late, gpu)


# the switch's own reader and the package it lies in decorate no kernel
_NOT_KERNELS = {interpret.__name__, interpret.__name__.rpartition(".")[0]}


def _kernels_imported() -> bool:
    return any(m.startswith(KERNELS_PACKAGE + ".") and m not in _NOT_KERNELS for m in sys.modules)


def enable_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when there is no CUDA device, the user did not set it, and no kernel module is imported
    yet. Returns whether the kernels will run in the interpreter."""
    import torch

    if torch.cuda.is_available():
        _STATE["how"] = "gpu"
        return False
    given = interpret.setting()
    if given is not None:
        _STATE["how"] = "user" if given == "1" else "off"
        return given == "1"
    if _kernels_imported():
        _STATE["how"] = "too_late"
        return False
    os.environ[ENV] = "1"
    _STATE["how"] = "set_here"
    return True


def active() -> bool:
    """Whether Triton kernels of this process run in the interpreter (as far as the environment says)."""
    return interpret.active()


def version_trap() -> str | None:
    """triton 3.6 with numpy >= 2.4 fails on kernel loops with a run-time trip count (triton 3.8 works)."""
    try:
        import numpy
        import triton
    except ImportError:
        return None
    major_minor = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2])  # noqa: E731
    if major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        return (f"triton {triton.__version__} with numpy {numpy.__version__}: the interpreter fails on kernel loops "
                "with a run-time trip count (install triton 3.8, or numpy <= 2.3)")
    return None


def describe() -> str:
    """One line for a CPU run's output and report: whether and how the Triton kernels ran."""
    how = _STATE.get("how") or ("user" if active() else "off")
    if how == "gpu":
        return "Triton kernels run compiled on the GPU."
    if how in ("set_here", "user"):
        line = ("Triton kernels run in the interpreter (TRITON_INTERPRET=1, "
                + ("set by verifybench: no CUDA device)." if how == "set_here" else "as set in the environment)."))
        trap = version_trap()
        return line + (f" WARNING: {trap}." if trap else "")
    if how == "too_late":
        return ("Triton kernels NOT run: a kernel module was imported before TRITON_INTERPRET could be set; their "
                "cases are skipped.")
    return (f"Triton kernels NOT run: {ENV}={interpret.setting()!r} in the environment turns the interpreter off; "
            "their cases are skipped.")
