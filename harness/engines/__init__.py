"""The inference engines' own kernels, timed beside ours: thin adapters that import an installed engine (SGLang,
FlashInfer, sgl-kernel, vLLM) and call its kernel as the engine calls it. Nothing here copies an engine's code or
installs one; where an engine is missing, its rows are skipped with the reason in one line.

Each adapter module is named for its engine (sglang.py) and gives, per kernel family, a function that builds the
engine's inputs from ours once (outside the timed region) and returns the call to time. A component adds the engine's
rows as variants named "<engine>.<kernel>" and checks them against the same plain-torch reference as ours.
"""
from __future__ import annotations

import importlib
import importlib.util

from verifybench.harness.engine.fingerprint import ENGINE_DISTRIBUTIONS as DISTRIBUTIONS
from verifybench.harness.engine.fingerprint import engine_versions
from verifybench.harness.engine.runner import CaseSkipped


class EngineMissing(RuntimeError):
    """An engine (or one of its kernels) that cannot be imported here; the message is the one-line reason."""


def skipped(reason: EngineMissing | str) -> CaseSkipped:
    """The skip of an engine's row, worded the same in every component (the run's summary groups skips by reason)."""
    return CaseSkipped(f"the engine's rows: {reason}")


def version(engine: str) -> str | None:
    """The installed version of `engine` (a DISTRIBUTIONS key), read without importing it; None if absent."""
    return engine_versions()[engine]


def label(engine: str) -> str:
    """'sglang 0.5.10.post1': how a row names the engine it timed."""
    return f"{engine} {version(engine) or '(version unknown)'}"


def import_kernel_module(engine: str, module: str):
    """The engine's module (an ordinary import, so the engine's own package and dependencies are used); EngineMissing
    with the reason in one line where it cannot be imported."""
    if version(engine) is None and importlib.util.find_spec(engine) is None:
        raise EngineMissing(f"{engine} is not installed (pip show {DISTRIBUTIONS[engine]}: not found)")
    try:
        return importlib.import_module(module)
    except Exception as e:  # an engine's import can fail in many ways (a missing dependency, a torch mismatch)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EngineMissing(f"{label(engine)}: import {module} failed: {type(e).__name__}: {first}") from None

