"""The probes' common parts: a Case (how to run one input, whether it is bad, what its refusal must name, or how
to check a right answer), its Result, the ways to call the CLI, an API or a torchrun module, and result files."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FP = {"gpu_model": "NVIDIA H200", "slug": "h200", "env": {}, "gpus": [{"name": "NVIDIA H200", "uuid": "GPU-1"}]}
FAST = {"VERIFYBENCH_MAX_TIME_S": "0.05"}


@dataclass
class Result:
    kind: str  # "return" | "raise" | "exit" (os._exit / a signal) | "timeout"
    value: object = None
    exc_type: str = ""
    message: str = ""
    out: str = ""
    err: str = ""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass
class Case:
    cls: str
    name: str
    fn: Callable | None = None  # run in a forked child; CLI cases return the exit code
    bad: bool = True
    needle: str = ""  # what the refusal must name
    check: Callable | None = None  # Result -> (ok | "hang", why): decides instead of the default rules
    cli: bool = False
    api: bool = False
    env: dict | None = None
    timeout_s: float | None = None
    runner: Callable | None = None  # timeout_s -> Result, for real subprocesses


def cli(cls, argv, needle="", **kw) -> Case:
    def fn():
        from verifybench.harness.cli import main
        return main([str(a) for a in argv])
    return Case(cls, "verifybench " + " ".join(map(str, argv)), fn, needle=needle, cli=True, **kw)


def api(cls, name, fn, needle="", **kw) -> Case:
    return Case(cls, name, fn, needle=needle, api=True, **kw)


def module_main(cls, module, argv, needle="", **kw) -> Case:
    """`python -m verifybench.harness.multigpu.<module> ARGV` (one rank, no torchrun) in the child."""
    def fn():
        import importlib
        return importlib.import_module(f"verifybench.harness.multigpu.{module}").main([str(a) for a in argv])
    return Case(cls, f"python -m ...multigpu.{module} " + " ".join(map(str, argv)), fn, needle=needle, cli=True, **kw)


def _suite(path: Path, cases=None) -> Path:
    from verifybench.harness.measure.results import store
    from verifybench.harness.measure.timing.runner import Case as RCase
    from verifybench.harness.measure.timing.timer import Measurement

    cases = cases or {"x": np.random.default_rng(1).normal(100, 0.5, 50)}
    recs = [RCase(n, {}, True, "", Measurement("graph", "cuda", "cuda_event", list(map(float, s)), 1, 3, "ci_target",
                                                1.0)) for n, s in cases.items()]
    return store.write_json_atomic(path, store.make_run("demo", recs, FP))


def _edited(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _c(d):
    return d["cases"][0]
