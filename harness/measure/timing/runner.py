"""Check-then-time: the one path from a component's case (CaseSpec) to its record (Case), which results/ stores.

A component hands over the callable, a correctness check and a function deriving figures from the measurement;
a failing check yields a Case with no time.
"""
from __future__ import annotations

import gc
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from verifybench.harness.measure.timing import timer
from verifybench.harness.measure.timing.timer import Measurement, measure
from verifybench.kernels.common import settings

Check = Callable[[], tuple[bool, str]]
# The CPU smoke profile: a CPU case's figures are withheld, the run checks every case and the plumbing, so it
# samples briefly. A weight-streaming case rotates over CPU_COPIES input sets, not the cold rule's many (the Triton
# interpreter takes ~0.05-1 s a call): it checks the rotation, not its size.
CPU_COPIES = 2
CPU_MAX_TIME_S = 0.2  # per case, unless VERIFYBENCH_MAX_TIME_S says otherwise
# two samples: the fewest measure() takes (a spread for the summary); a third would only add an interpreted call
CPU_MIN_SAMPLES = 2


_SAID: set[str] = set()


def say_once(line: str) -> None:
    """Print a line about a component's cases once per process (a command lists its cases twice: to check the
    scope before anything runs, then to run them)."""
    if line not in _SAID:
        _SAID.add(line)
        print(line)


class CaseSkipped(Exception):
    """Raised by a case's setup when the case cannot run on this machine (a backend or P2P missing, too little
    memory): the case is recorded with the reason, and it is neither timed nor counted as a failure."""


@dataclass
class Case:
    """One benchmark case. `measurement` is None when `check_ok` is False: a failed check reports no time."""

    name: str
    params: dict
    check_ok: bool
    check_detail: str = ""
    measurement: Measurement | None = None
    derived: dict = field(default_factory=dict)
    skipped: str | None = None  # why the case could not run here (no P2P, too little memory): not a failure

    def as_dict(self) -> dict:
        if self.check_ok and self.measurement is None:
            raise ValueError(f"case {self.name}: a passing case needs a measurement")
        d = {
            "name": self.name,
            "params": self.params,
            "check": {"ok": self.check_ok, "detail": self.check_detail},
            "derived": self.derived,
        }
        if self.skipped:
            d["skipped"] = self.skipped
        if self.measurement is not None and self.check_ok:
            d.update(self.measurement.as_dict())
        return d


@dataclass
class CaseSpec:
    """A component's case before it runs: `prepare()` calls `setup`, which allocates inputs and returns
    (fn, check, derive).

    Setup is deferred so listing cases allocates nothing; `measure_kw` are extra `measure` arguments. The arguments
    the setup names are the case's params of those names (`def setup(batch, tokens)` gets params["batch"] and
    params["tokens"]): what the record says the case ran reaches its kernels as arguments a reader can follow.
    """

    name: str
    params: dict
    mode: str
    setup: Callable[..., tuple[Callable, Check, Callable[[Measurement], dict] | None]]
    measure_kw: dict = field(default_factory=dict)

    def prepare(self) -> tuple[Callable, Check, Callable[[Measurement], dict] | None]:
        """Call the setup with the params it names; (fn, check, derive)."""
        # named, with no default: a default binds a loop's value (`lambda p=params: ...`), *args and **kw get nothing
        names = [n for n, p in inspect.signature(self.setup).parameters.items()
                 if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        missing = [n for n in names if n not in self.params]
        if missing:
            raise TypeError(f"case {self.name}: its setup takes {missing}, which its params do not carry")
        return self.setup(**{n: self.params[n] for n in names})

    def spend(self) -> None:
        """Drop the setup: its closure may hold what the cases built (a weight stack shared across token counts),
        which a list of specs that outlives the run (pytest's parametrized items) would otherwise keep alive."""
        self.setup = _spent

    def run(self, **overrides) -> Case:
        """Set up, check and time the case. Out of memory, it is tried once more after collecting what is no longer
        referenced: a case whose objects form a reference cycle (a captured graph and the state it reads) keeps its
        memory until the collector runs, and the next case's setup may need it (an H100 lost 3 of 32 batched cycle
        cases to out-of-memory errors while larger cases beside them ran). Out of memory again, it is skipped."""
        for _ in range(2):
            try:
                fn, check, derive = self.prepare()
                return run_case(self.name, self.params, fn, check=check, mode=self.mode, derive=derive,
                                **{**self.measure_kw, **overrides})
            except CaseSkipped as e:
                return self._skipped(str(e))
            except (torch.cuda.OutOfMemoryError, MemoryError) as e:  # the plan missed: the case is lost, not the run
                first_line = (str(e) or type(e).__name__).splitlines()[0]
            except RuntimeError as e:  # the CPU allocator's failure (a limit the plan could not see) reads the same
                if not cpu_out_of_memory(e):
                    raise
                first_line = cpu_out_of_memory(e)
            # outside the except block: its traceback no longer holds the case's tensors, nor do these
            fn = check = derive = None  # noqa: F841
            release_unreferenced()
        return self._skipped(f"out of memory despite the memory plan: {first_line} (twice; the second time after "
                             "collecting unreferenced memory)")

    def _skipped(self, reason: str) -> Case:
        return Case(name=self.name, params=self.params, check_ok=False, check_detail=f"skipped: {reason}",
                    skipped=reason)


def cpu_out_of_memory(e: BaseException) -> str | None:
    """The CPU allocator's out-of-memory error as one line ("can't allocate memory: you tried to allocate N
    bytes"), None for any other error."""
    text = str(e)
    at = text.find("can't allocate memory")
    return text[at:].splitlines()[0].split(". Error code")[0] if at >= 0 else None


def release_unreferenced() -> None:
    """Collect what nothing refers to any more, reference cycles included (a finished case's captured graphs and the
    state they read refer to each other), and give the device's cached blocks back: what a finished case or component
    held is the next one's."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    """Run `check` first; only a passing case is timed with `measure(fn, mode=mode, **measure_kw)`, under the
    CPU rule (cpu_measure_kw) when it is measured on the CPU."""
    ok, detail = check()
    if not ok:
        return Case(name=name, params=params, check_ok=False, check_detail=detail)
    device = measure_kw.get("device") or ("cuda" if timer.cuda_available() else "cpu")
    m = measure(fn, mode=mode, **(cpu_measure_kw(measure_kw) if device == "cpu" else measure_kw))
    return Case(name=name, params=params, check_ok=True, check_detail=detail, measurement=m,
                derived=derive(m) if derive else {})


def cpu_measure_kw(measure_kw: dict) -> dict:
    """The CPU smoke profile's sampling rule over a case's measure() arguments: one warm-up call (the check already
    ran the callable), CPU_MIN_SAMPLES, one call per sample unless the case gives K, and at most VERIFYBENCH_MAX_TIME_S
    (else CPU_MAX_TIME_S) per case, or the case's own shorter cap. A fixed `samples` (collectives: every rank runs
    the same count) is kept as given."""
    if measure_kw.get("samples") is not None:
        return measure_kw
    cap_s = timer.max_time_from_env() if settings.read(timer.MAX_TIME_ENV) is not None else CPU_MAX_TIME_S
    given_s = measure_kw.get("max_time_s")
    return {"calls_per_sample": 1, **measure_kw, "warmup_calls": 1, "warmup_s": 0.0, "min_samples": CPU_MIN_SAMPLES,
            "max_time_s": cap_s if given_s is None else min(cap_s, given_s)}
