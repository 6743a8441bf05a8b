"""The components the suite measures: one protocol, one registry.

A component is one module of this package with

    NAME: str    the CLI subcommand, the results-file prefix and the report section
    HELP: str    one line for --help
    cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None) -> list[CaseSpec]
        the cases for a model preset at TP degree `tp`, a KV-cache context length and the token counts to verify
        (None: the component's own default set); listing cases allocates nothing (CaseSpec.setup does)
    tables(records: list[dict]) -> list[tuple[str, list[dict]]]
        (title, rows) from the stored case records of a run
    charts(records: list[dict], directory: Path, stamp: str) -> list[Path]
        PNG files written into `directory`, each name carrying `stamp` (the run's UTC time)
    release() -> None
        drop what the cases cached (weights, process groups), so the next component has the GPU's memory

Optional: add_arguments(parser) declares the component's own options for its command (`verifybench <name>`);
their values reach cases() as keyword arguments (`verifybench run` passes none: the component's defaults).

The CLI, `verifybench run` and the pytest-benchmark modules all loop over the same `cases`. To add a component:
write the module and add its name to REGISTRY (docs/adding-a-component.md).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from verifybench.harness.analysis.numbers import name_list
from verifybench.harness.model.presets import default_scope

# In `verifybench run` order: the baseline first, so every results folder holds the copy ceiling.
REGISTRY = ("baseline", "graph_replay", "kv_tree", "skinny_gemm", "mla_decode", "mla_verify", "moe_int4", "allreduce",
            "verify", "cycle")
PROTOCOL = ("NAME", "HELP", "cases", "tables", "charts", "release")


def load(name: str) -> ModuleType:
    """The component module `name`; ValueError naming the known ones for anything else."""
    if name not in REGISTRY:
        raise ValueError(f"unknown component {name!r}; choose from {', '.join(REGISTRY)}")
    module = importlib.import_module(f"{__name__}.{name}")
    missing = [attr for attr in PROTOCOL if not hasattr(module, attr)]
    if missing or module.NAME != name:
        raise TypeError(f"component module {module.__name__} breaks the protocol: missing {missing}, "
                        f"NAME={getattr(module, 'NAME', None)!r}")
    return module


def parse_names(text: str | None) -> list[str]:
    """A comma-separated component list (None: all), checked: known names, no duplicates, not empty."""
    if text is None:
        return list(REGISTRY)
    return name_list(text, "--components", REGISTRY)


def bench_cases(name: str, presets: tuple[str, ...] | None = None, keep=None) -> list:
    """The cases a pytest-benchmark module parametrizes over: the component's cases at the default scope (or at each
    of `presets` on a GPU), filtered by `keep(spec)`."""
    import torch

    gpu = torch.cuda.is_available()
    preset, tp, context = default_scope(gpu)
    module = load(name)
    specs = [s for p in (presets if gpu and presets else (preset,)) for s in module.cases(p, tp, context, None)]
    return [s for s in specs if keep is None or keep(s)]
