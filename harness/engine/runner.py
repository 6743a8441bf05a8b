"""Check-then-time: the one path from a component's case to a stored result record.

A component hands over the callable, a correctness check and a function deriving figures from the measurement;
a failing check yields a Case with no time.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable

import torch

from verifybench.harness.engine.results import Case
from verifybench.harness.engine.timing import Measurement, measure

Check = Callable[[], tuple[bool, str]]
# The CPU smoke profile's cases: the Triton interpreter takes ~0.2-0.5 s a call and has no compile to warm up, so
# a case rotates over CPU_COPIES input sets and a sample is one pass over them (its figures are withheld as CPU
# numbers: the run checks every path and the rotation, not its size).
CPU_COPIES = 2
CPU_SMOKE_MEASURE = {"max_time_s": 0.2, "warmup_s": 0.0, "warmup_calls": 1, "min_samples": 3,
                     "calls_per_sample": CPU_COPIES}


class CaseSkipped(Exception):
    """Raised by a case's setup when the case cannot run on this machine (a backend or P2P missing, too little
    memory): the case is recorded with the reason, and it is neither timed nor counted as a failure."""


@dataclass
class CaseSpec:
    """A component's case before it runs: `setup()` allocates inputs and returns (fn, check, derive).

    Setup is deferred so listing cases allocates nothing; `measure_kw` are extra `measure` arguments.
    """

    name: str
    params: dict
    mode: str
    setup: Callable[[], tuple[Callable, Check, Callable[[Measurement], dict] | None]]
    measure_kw: dict = field(default_factory=dict)

    def spend(self) -> None:
        """Drop the setup: its closure may hold what the cases built (a weight stack shared across token counts),
        which a list of specs that outlives the run (pytest's parametrized items) would otherwise keep alive."""
        self.setup = _spent

    def run(self, **overrides) -> Case:
        try:
            fn, check, derive = self.setup()
            return run_case(self.name, self.params, fn, check=check, mode=self.mode, derive=derive,
                            **{**self.measure_kw, **overrides})
        except CaseSkipped as e:
            reason, oom = str(e), False
        except torch.cuda.OutOfMemoryError as e:  # the memory plan missed: the case is lost, not the run
            reason, oom = f"out of memory despite the memory plan: {str(e).splitlines()[0]}", True
        if oom:  # outside the except block: its traceback no longer holds the case's tensors
            fn = check = derive = None  # noqa: F841 (nor do these)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return Case(name=self.name, params=self.params, check_ok=False, check_detail=f"skipped: {reason}",
                    skipped=reason)


def _spent():
    raise RuntimeError("this case was spent: its component's cases ran and their memory was released")


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (accuracy measure)."""
    out64, ref64 = out.double(), ref.double()
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom else (0.0 if diff == 0 else float("inf"))


def run_case(
    name: str,
    params: dict,
    fn,
    *,
    check: Check,
    mode: str,
    derive: Callable[[Measurement], dict] | None = None,
    **measure_kw,
) -> Case:
    """Run `check` first; only a passing case is timed with `measure(fn, mode=mode, **measure_kw)`."""
    ok, detail = check()
    if not ok:
        return Case(name=name, params=params, check_ok=False, check_detail=detail)
    m = measure(fn, mode=mode, **measure_kw)
    return Case(name=name, params=params, check_ok=True, check_detail=detail, measurement=m,
                derived=derive(m) if derive else {})
