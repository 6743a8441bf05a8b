"""The inference engines' own kernels, timed beside ours: thin adapters that import an installed engine (SGLang,
FlashInfer, sgl-kernel, vLLM) and call its kernel as the engine calls it. Nothing here copies an engine's code or
installs one; where an engine is missing, its rows are skipped with the reason in one line.

Each adapter module is named for its engine (sglang.py) and gives, per kernel family, a function that builds the
engine's inputs from ours once (outside the timed region) and returns the call to time. A component adds the engine's
rows as variants named "<engine>.<kernel>" and checks them against the same plain-torch reference as ours.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

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


def one_line(e: BaseException) -> str:
    """An engine's exception in one line: its type and first line, and where that line says nothing of the cause (a
    failed JIT build's "Ninja build failed. Ninja output:"), also the first compiler line naming an error."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    cause = next((line for line in lines[1:] if "error" in line.lower() and len(line) < 400), None)
    return f"{type(e).__name__}: {first}" + (f" ... {cause}" if cause and "error" not in first.lower() else "")


def engine_call(engine: str):
    """For an adapter's setup (its imports, plans and JIT builds): what fails inside the engine becomes EngineMissing
    with the reason in one line, so that engine's rows are skipped with it and the rest of the run goes on (a
    FlashInfer module that would not build once took every row of mla_verify down with it). Running out of memory
    is left to the runner, which has its own word for it."""
    def wrap(setup):
        @functools.wraps(setup)
        def guarded(*args, **kwargs):
            try:
                return setup(*args, **kwargs)
            except (EngineMissing, torch.cuda.OutOfMemoryError):
                raise
            except Exception as e:  # an engine's build or first call can fail in many ways
                what = "its first calls" if setup.__name__ == "<lambda>" else setup.__name__
                raise EngineMissing(f"{label(engine)}: {what} failed here: {one_line(e)}") from None
        return guarded
    return wrap


def import_kernel_module(engine: str, module: str):
    """The engine's module (an ordinary import, so the engine's own package and dependencies are used); EngineMissing
    with the reason in one line where it cannot be imported."""
    if version(engine) is None and importlib.util.find_spec(engine) is None:
        raise EngineMissing(f"{engine} is not installed (pip show {DISTRIBUTIONS[engine]}: not found)")
    try:
        return importlib.import_module(module)
    except Exception as e:  # an engine's import can fail in many ways (a missing dependency, a torch mismatch)
        raise EngineMissing(f"{label(engine)}: import {module} failed: {one_line(e)}") from None

