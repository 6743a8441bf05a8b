"""compare of two CPU runs (measure/stance.py: CPU numbers carry no verdict): each case's samples side by side, no
SAME/FAST/SLOW, no change figure, exit 0 unless a check failed in NEW."""
from __future__ import annotations

from tabulate import tabulate

from verifybench.harness.measure import stance
from verifybench.harness.measure.timing.stats import summarize


def _spread(c) -> str:
    """q1..q3 of the samples (the stored interval when a file has only summaries)."""
    if c.samples_us is not None and len(c.samples_us):
        s = summarize(c.samples_us)
        lo, hi = s.q1_us, s.q3_us
    else:
        lo, hi = c.interval_us or (None, None)
    return "-" if lo is None else f"{_us(lo)}..{_us(hi)}"


def _n(c) -> str:
    return str(len(c.samples_us)) if c.samples_us is not None else "-"


def _us(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"  # no exponent: the medians beside it are printed whole


def report(base, new, exit_ok: int, exit_failed: int) -> int:
    """Two CPU runs: each case's samples side by side, no verdict, no change figure (a ratio of CPU medians is
    host noise, stance.py); exit 0 unless a check failed in NEW, which is a correctness failure."""
    rows, failed, other = [], [], []
    for name in sorted(base.cases.keys() | new.cases.keys()):
        b, n = base.cases.get(name), new.cases.get(name)
        if n is not None and not n.ok and not n.skipped:
            failed.append(name)
        if b is None or n is None or not (b.ok and n.ok):
            why = ("only in BASE" if n is None else "only in NEW" if b is None else
                   "check failed in NEW" if not n.ok and not n.skipped else "skipped or failed in one file")
            other.append(f"{why}: {name}")
            continue
        rows.append({"case": name, "mode": n.mode or b.mode, "base median_us": _us(b.median_us),
                     "base q1..q3": _spread(b), "base n": _n(b), "new median_us": _us(n.median_us),
                     "new q1..q3": _spread(n), "new n": _n(n)})
    print(f"{stance.CPU_STANCE}.\nEach case's samples side by side (median, q1..q3, n), no verdict:")
    if rows:
        print(tabulate(rows, headers="keys", disable_numparse=True, colalign=["left", "left"] + ["right"] * 6))
    for line in other:
        print(line)
    print(f"cases: {len(rows)} timed in both" + (f", {len(failed)} check(s) failed in NEW" if failed else "")
          + "; compare GPU runs for speed")
    return exit_failed if failed else exit_ok
