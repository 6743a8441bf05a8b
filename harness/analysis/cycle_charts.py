"""The cycle component's chart of cycle ms against context (`cycle --contexts`), one line per (deployment,
configuration, attention), and the one line saying where it went or why there is none.
"""
from __future__ import annotations

from pathlib import Path

from verifybench.harness.engine.charts import write_png
from verifybench.harness.engine.results import batch_of, cpu_numbers


def context_chart_line(records: list[dict], directory: Path, stamp: str) -> str:
    """`cycle --contexts`'s chart of cycle ms against context, written, in one line saying where; on CPU none, said
    why: its lines would compare extend and split_kv where the torch reference ran for both, a comparison the
    tables do not make."""
    from verifybench.harness.components.cycle import _ok, _several_contexts

    rows = _ok(records)
    if not _several_contexts(rows):
        return "no chart of cycle ms against context: fewer than two contexts passed their checks"
    if cpu_numbers(records):
        return ("no chart of cycle ms against context on CPU: the torch reference ran for every attention variant, "
                "so its lines would compare nothing; the tables give each context's cycle ms")
    return f"chart: {context_chart(rows, directory, stamp)}"


def context_chart(rows, directory: Path, stamp: str) -> Path:
    """Cycle ms against context, one line per (configuration, attention): extend against split_kv."""
    import matplotlib.pyplot as plt

    from verifybench.harness.components.cycle import _key

    least = min(batch_of(r) for r in rows)  # over batches: the batch chart (analysis/batches.py)
    rows = [r for r in rows if batch_of(r) == least]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    lines: dict[tuple, list] = {}
    for r in rows:
        lines.setdefault(tuple(v for k, v in _key(r).items() if k not in ("context",)), []).append(  # what ran
            (r["params"]["context"], r["derived"]["cycle_ms"]))
    for key, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--" if "split_kv" in key[-1] else "o-", label=" ".join(key))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({p[0] for pts in lines.values() for p in pts}))
    ax.get_xaxis().set_major_formatter(plt.FuncFormatter(lambda v, _: f"{int(v)}"))
    ax.set_xlabel("context (tokens in the KV cache)")
    ax.set_ylabel("ms per cycle")
    ax.set_title("EAGLE-3 cycle against context: extend vs split_kv" + (f" ({least} requests)" if least > 1 else ""))
    ax.legend(fontsize=8)
    return write_png(fig, Path(directory) / f"cycle_contexts-{stamp}.png")
