"""The cycle component's passing rows and their labels, and its chart of cycle ms against context (`cycle
--contexts`), one line per (deployment, configuration, attention), with the one line saying where it went or why not.
"""
from __future__ import annotations

from pathlib import Path

from verifybench.harness.measure.results.charts import write_png
from verifybench.harness.measure.results.store import batch_of, cpu_numbers


def passing_rows(records):
    """The cases that passed their checks and hold the cycle's phases."""
    return [r for r in records if r["check"]["ok"] and "phases_ms" in r.get("derived", {})]


def row_key(r, contexts: bool = False, batches: bool = False) -> dict:
    """The row's configuration; its attention label says what ran (on CPU the torch reference stands in)."""
    p = r["params"]
    ran = r.get("derived", {}).get("attention_ran", p["attention"])
    return {**({"deployment": p["deployment"]} if "deployment" in p else {}),
            **({"context": p["context"]} if contexts else {}), **({"B": batch_of(r)} if batches else {}),
            "steps,topk,D": f"{p['steps']},{p['topk']},{p['draft_tokens']}",
            "attention": p["attention"] if ran == p["attention"] else f"{ran} (not {p['attention']})"}


def several_contexts(rows) -> bool:
    return len({r["params"]["context"] for r in rows}) > 1


def several_batches(rows) -> bool:
    return len({batch_of(r) for r in rows}) > 1


def context_chart_line(records: list[dict], directory: Path, stamp: str) -> str:
    """`cycle --contexts`'s chart of cycle ms against context, written, in one line saying where; on CPU none, said
    why: its lines would compare extend and split_kv where the torch reference ran for both, a comparison the
    tables do not make."""
    rows = passing_rows(records)
    if not several_contexts(rows):
        return "no chart of cycle ms against context: fewer than two contexts passed their checks"
    if cpu_numbers(records):
        return ("no chart of cycle ms against context on CPU: the torch reference ran for every attention variant, "
                "so its lines would compare nothing; the tables give each context's cycle ms")
    return f"chart: {context_chart(rows, directory, stamp)}"


def context_chart(rows, directory: Path, stamp: str) -> Path:
    """Cycle ms against context, one line per (configuration, attention): extend against split_kv."""
    import matplotlib.pyplot as plt

    least = min(batch_of(r) for r in rows)  # over batches: the batch chart (analysis/batches.py)
    rows = [r for r in rows if batch_of(r) == least]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    lines: dict[tuple, list] = {}
    for r in rows:
        lines.setdefault(tuple(v for k, v in row_key(r).items() if k not in ("context",)), []).append(  # what ran
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
