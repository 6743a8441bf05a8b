"""Tables as the console and the report print them: one number format per column, columns a CPU run withholds named
once above the table instead of filling every cell, empty columns dropped, nothing wider than MAX_WIDTH_CHARS.
"""
from __future__ import annotations

import math
import textwrap

from tabulate import tabulate

from verifybench.harness.measure.results.store import WITHHELD
from verifybench.harness.measure.stance import withhold_on_cpu

MAX_WIDTH_CHARS = 120
MAX_KEY_COLUMNS = 3  # leading label columns repeated in every part of a split table


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def column_format(values: list):
    """One format for a whole column: integers as integers; floats with the decimals that give the column's largest
    value 4 significant digits (exponent notation for the whole column when its values need it)."""
    nums = [v for v in values if _number(v) and math.isfinite(v)]
    if nums and all(isinstance(v, int) for v in nums):
        return str
    peak = max((abs(v) for v in nums), default=0.0)
    if peak == 0:
        return lambda v: f"{v:.4g}"
    if peak >= 1e7 or peak < 1e-3:
        return lambda v: f"{v:.3e}"
    decimals = min(4, max(0, 3 - math.floor(math.log10(peak))))
    return lambda v: f"{v:.{decimals}f}"


def _cells(rows: list[dict]) -> tuple[list[str], list[list[str]], list[bool]]:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    columns = []
    for k in keys:
        values = [row.get(k) for row in rows]
        fmt = column_format(values)
        columns.append([("" if v is None else fmt(v) if _number(v) and math.isfinite(v) else str(v))
                        for v in values])
    numeric = [any(_number(row.get(k)) for row in rows) for k in keys]
    return keys, [list(r) for r in zip(*columns)], numeric


def _is_label(c: int, key: str, rows: list[dict], numeric: list[bool]) -> bool:
    """A label column: text, or a first column of integers such as n."""
    return not numeric[c] or (c == 0 and all(isinstance(r.get(key), int) for r in rows))


def _key_columns(keys: list[str], rows: list[dict], numeric: list[bool]) -> list[int]:
    """The leading label columns that every part of a split table repeats."""
    out = []
    for c, k in enumerate(keys[:MAX_KEY_COLUMNS]):
        if not _is_label(c, k, rows, numeric):
            break
        out.append(c)
    return out[: len(keys) - 1]


def _render(keys, cells, numeric, cols, tablefmt) -> str:
    return tabulate([[r[c] for c in cols] for r in cells], headers=[keys[c] for c in cols], tablefmt=tablefmt,
                    disable_numparse=True, colalign=["right" if numeric[c] else "left" for c in cols])


def _width(keys, cells, numeric, cols, tablefmt) -> int:
    return max(len(line) for line in _render(keys, cells, numeric, cols, tablefmt).splitlines())


def _field_value(keys: list[str], values: list[str], tablefmt: str, width: int) -> str:
    """One row as field / value lines, a long value wrapped onto the lines below its field (a markdown cell holds no
    line break)."""
    room = max(20, width - max(map(len, [*keys, "field"])) - 7)  # 7: the widest format's borders, "| " " | " " |"
    lines = [(key if i == 0 else "", part) for key, value in zip(keys, values)
             for i, part in enumerate(textwrap.wrap(value, room, break_on_hyphens=False) or [""])]
    return tabulate(lines, headers=["field", "value"], tablefmt=tablefmt, disable_numparse=True)


def render(rows: list[dict], tablefmt: str = "simple", width: int = MAX_WIDTH_CHARS) -> str:
    """The table text: withheld columns named above it, then one table, or several parts (the leading label columns
    repeated) when one would be wider than `width`; a single row too wide becomes field / value lines."""
    if not rows:
        return "(no rows)"
    withheld = [k for k in dict.fromkeys(k for row in rows for k in row)
                if all(row.get(k) in (WITHHELD, None) for row in rows) and any(row.get(k) == WITHHELD for row in rows)]
    head = "\n".join(textwrap.wrap(f"withheld ({WITHHELD.split(': ', 1)[-1]}): {', '.join(withheld)}", width,
                                   break_on_hyphens=False)) + "\n\n" if withheld else ""
    empty = {k for k in dict.fromkeys(k for row in rows for k in row) if all(row.get(k) is None for row in rows)}
    rows = [{k: v for k, v in row.items() if k not in withheld and k not in empty} for row in rows]
    keys, cells, numeric = _cells(rows)
    if withheld and all(_is_label(c, k, rows, numeric) for c, k in enumerate(keys)):
        # only labels left (a marginal table's n): rows of labels say nothing; the one line says why
        return "\n".join(textwrap.wrap(f"withheld ({WITHHELD.split(': ', 1)[-1]}): every figure of this table "
                                        f"({', '.join(withheld)})", width, break_on_hyphens=False))
    if _width(keys, cells, numeric, list(range(len(keys))), tablefmt) <= width:
        return head + _render(keys, cells, numeric, list(range(len(keys))), tablefmt)
    if len(rows) == 1:
        return head + _field_value(keys, cells[0], tablefmt, width)
    key_cols = _key_columns(keys, rows, numeric)
    parts, current = [], []
    for c in range(len(key_cols), len(keys)):
        if current and _width(keys, cells, numeric, key_cols + current + [c], tablefmt) > width:
            parts.append(current)
            current = []
        current.append(c)
    parts.append(current)
    return head + "\n\n".join(_render(keys, cells, numeric, key_cols + p, tablefmt) for p in parts)


def side_by_side(records: list[dict], ok: list[dict], key, start, fill, ratios: tuple, withheld) -> list[dict]:
    """A component's "Triton vs torch" table: one row per key(params) of the passing records `ok`, in the order first
    seen, begun by start(record) and given each record's columns by fill(row, record, median_us); then each ratio
    (column, numerator, denominator[, divisor]) where both ran; from a CPU run the `withheld` cells (stance.py)."""
    rows: dict = {}
    for r in ok:
        row = rows.setdefault(key(r["params"]), start(r))
        fill(row, r, r["summary"]["median_us"])
    for row in rows.values():
        for name, num, den, *divisor in ratios:
            if row.get(num) and row.get(den):
                value = row[num] / row[den]
                row[name] = value / divisor[0] if divisor else value
    return withhold_on_cpu(records, list(rows.values()), withheld)
