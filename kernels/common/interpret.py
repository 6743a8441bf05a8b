"""Whether Triton kernels run in the interpreter: the one reader of TRITON_INTERPRET, asked by kernels/ and harness/.

triton.jit picks the interpreter when a kernel is decorated, i.e. when its module is first imported: a module that
decides something by it calls active() at its own import, as the decorators beside it read the variable then.
"""
from __future__ import annotations

import os

ENV = "TRITON_INTERPRET"


def setting() -> str | None:
    """The variable as the environment holds it now (None when unset)."""
    return os.environ.get(ENV)


def active() -> bool:
    """Whether the variable switches the interpreter on ("1")."""
    return setting() == "1"
