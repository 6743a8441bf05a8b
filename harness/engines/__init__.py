"""The inference engines' own kernels, timed beside ours: thin adapters that import an installed engine (SGLang,
FlashInfer, sgl-kernel, vLLM) and call its kernel as the engine calls it. Nothing here copies an engine's code or
installs one; where an engine is missing, its rows are skipped with the reason in one line.

Each adapter module is named for its engine (sglang.py), says which release it follows (FOLLOWS) and gives, per kernel
family, a function that builds the engine's inputs from ours once (outside the timed region) and returns the call to
time. Every backend is declared once in backends.py; a component lists its engine rows ("<engine>.<kernel>") from
there and checks them against the same plain-torch reference as ours. deployment.py says what a deployment's flags
run for each part of the forward.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from verifybench.harness.measure.host.fingerprint import ENGINE_DISTRIBUTIONS as DISTRIBUTIONS
from verifybench.harness.measure.host.fingerprint import engine_versions
from verifybench.harness.measure.timing.runner import CaseSkipped


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


def follows(engine: str) -> str | None:
    """The release the adapter of `engine` follows call by call (its FOLLOWS: 'sglang 0.5.10.post1'); None where the
    engine has no adapter here."""
    try:
        return importlib.import_module(f"{__name__}.{engine}").FOLLOWS
    except (ImportError, AttributeError):
        return None


def failed(engine: str, what: str, e: BaseException) -> EngineMissing:
    """The one line for a call into `engine` that failed inside the engine's code: the installed release, the call,
    the error, and the release the adapter follows (an engine of another release may take other arguments)."""
    followed = follows(engine)
    adapter = f" (harness/engines/{engine}.py follows {followed})" if followed else ""
    return EngineMissing(f"{label(engine)}: {what} failed here: {one_line(e)}{_raised_in(engine, e)}{adapter}")


def _raised_in(engine: str, e: BaseException) -> str:
    """' in sglang.srt...extend_attention._fwd_kernel': the engine's function the error came from (its innermost frame
    in the engine's package), '' where it came from our side of the call (a call the engine no longer takes)."""
    where, tb = "", e.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module == engine or module.startswith(engine + "."):
            where = f" in {module}.{tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return where


def engine_call(engine: str):
    """For an adapter's calls into the engine (its imports, tile pickers, plans, JIT builds, first calls): what fails
    inside them becomes EngineMissing with the reason in one line, so that engine's rows are skipped with it and the
    rest of the run goes on (a FlashInfer module that would not build once took every row of mla_verify down with it;
    an SGLang whose tile picker took another argument ended mla_verify with a TypeError). Running out of memory is
    left to the runner, which has its own word for it."""
    def wrap(setup):
        @functools.wraps(setup)
        def guarded(*args, **kwargs):
            try:
                return setup(*args, **kwargs)
            except (EngineMissing, CaseSkipped, torch.cuda.OutOfMemoryError):
                raise
            except Exception as e:  # an engine's build or first call can fail in many ways
                what = "its first calls" if setup.__name__ == "<lambda>" else setup.__name__
                raise failed(engine, what, e) from None
        return guarded
    return wrap


def engine_rows(engine: str | None, setup):
    """A component case's setup for an engine's row (engine None: ours, unchanged): whatever fails in it or in the
    check it returns, inside the engine or in an adapter call written for another release, skips that row in one line
    (skipped); our rows, the result file and the rest of the run go on."""
    if engine is None:
        return setup

    def run(what: str, fn):
        try:
            return fn()
        except EngineMissing as e:
            raise skipped(e) from None
        except (CaseSkipped, torch.cuda.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 (an engine of another release can fail in any way)
            raise skipped(failed(engine, what, e)) from None

    @functools.wraps(setup)  # its signature too: CaseSpec.prepare passes the params the setup names
    def guarded_setup(**params):
        fns, check, derive = run("its setup (inputs, tiles, first calls)", lambda: setup(**params))
        return fns, (lambda: run("its check", check)), derive
    return guarded_setup


def import_kernel_module(engine: str, module: str):
    """The engine's module (an ordinary import, so the engine's own package and dependencies are used); EngineMissing
    with the reason in one line where it cannot be imported."""
    if version(engine) is None and importlib.util.find_spec(engine) is None:
        raise EngineMissing(f"{engine} is not installed (pip show {DISTRIBUTIONS[engine]}: not found)")
    try:
        return importlib.import_module(module)
    except Exception as e:  # an engine's import can fail in many ways (a missing dependency, a torch mismatch)
        raise EngineMissing(f"{label(engine)}: import {module} failed: {one_line(e)}") from None

