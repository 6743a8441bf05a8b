"""Our stand-ins held against the engine's own kernels: for each component that timed an engine's row beside ours, at
every shape both ran for one request, the engine kernel's median, ours, the roofline (the bytes at this GPU's copy
bandwidth) and ours / engine. A ratio far from 1 says the suite's figure for that part is not what the engine spends."""
from __future__ import annotations

from verifybench.harness.measure import stance
from verifybench.harness.measure.results import tables
from verifybench.harness.measure.results.store import WITHHELD, batch_of
from verifybench.harness.engines import backends

# component: (the params key naming what ran, (our stand-in, the engine's kernel it stands in for) pairs), as
# harness/engines/backends.py declares each engine backend's stand-in
PAIRS = backends.stand_in_pairs()
SHAPE_KEYS = ("context", "tokens", "tree", "routing")  # those a component's params carry name its shape
FIGURES = ("engine_us", "ours_us", "roofline_us", "ours/engine")


def _median_us(case: dict) -> float:
    return case["summary"]["median_us"]


def rows(runs: dict) -> list[dict]:
    """One row per (component, shape, pair) where both kernels passed their check at batch 1."""
    out = []
    for component, (key, pairs) in PAIRS.items():
        run = runs.get(component)
        if not run:
            continue
        by = {}
        for c in run["cases"]:
            if c.get("check", {}).get("ok") and c.get("summary") and batch_of(c) == 1:
                shape = tuple((k, c["params"][k]) for k in SHAPE_KEYS if k in c["params"])
                by[(c["params"].get(key), shape)] = c
        for ours, engine in pairs:
            for (impl, shape), theirs in by.items():
                mine = by.get((ours, shape))
                if impl != engine or mine is None:
                    continue
                out.append({"component": component, "shape": ", ".join(f"{k} {v}" for k, v in shape),
                            "engine": engine, "engine_us": _median_us(theirs), "ours": ours,
                            "ours_us": _median_us(mine), "roofline_us": mine["derived"].get("floor_us"),
                            "ours/engine": _median_us(mine) / _median_us(theirs)})
    return out


def lines(runs: dict) -> list[str]:
    """The section for advise and the report: [] where no component holds an engine row beside ours."""
    table = rows(runs)
    if not table:
        return []
    if stance.any_cpu(runs[r["component"]] for r in table):
        table = stance.withhold(table, FIGURES)
        said = f"CPU numbers: the kernels ran and passed their checks; {WITHHELD} is every figure"
    else:
        said = ("per layer, one request; ours/engine far from 1: the suite's figure for that part is not the engine's "
                "(the levers use the engine's rows where they exist)")
    return ["", "## Our stand-ins against the engine's own kernels", said, tables.render(table)]
