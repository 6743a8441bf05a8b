"""The engine's own component: the copy-bandwidth ceiling and the sync-distortion exhibit, as one case list.

Every `verifybench run` starts with it, so each results folder holds the ceiling that eta is measured against.
"""
from __future__ import annotations

from harness import ceiling, sync_exhibit
from harness.runner import CaseSpec

COMPONENT = "baseline"


def cases(preset: str = "kimi-k2.5", tp: int = 8) -> list[CaseSpec]:
    """Shapes do not depend on the preset: the ceiling is the GPU's, the exhibit uses Kimi-K2.5 sizes."""
    return [ceiling.copy_case(mode="hot"), *sync_exhibit.cases()]


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    copy_rows = [{"case": r["name"], "mode": r["mode"], "median_us": r["summary"]["median_us"],
                  "GB/s": r["derived"]["gbps"]} for r in records if r["name"].startswith("copy/") and r["check"]["ok"]]
    return [("copy-bandwidth ceiling", copy_rows),
            ("sync distortion: one op timed three ways (ratios to the graph time)", sync_exhibit.table(records))]
