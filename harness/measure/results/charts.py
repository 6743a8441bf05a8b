"""The components' PNG charts written beside the report: one way to save a figure (matplotlib stays a lazy import:
a run without charts never loads it)."""
from __future__ import annotations

from pathlib import Path

from verifybench.harness.measure.results.store import write_new


def write_png(fig, path: Path) -> Path:
    """A matplotlib figure saved as a new file (store.write_new: never over another run's chart of the
    same second), then closed; returns the path written."""
    import matplotlib.pyplot as plt

    try:
        return write_new(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)
