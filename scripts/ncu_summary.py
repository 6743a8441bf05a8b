"""Compact table from `ncu --import REP --page raw --csv` output: per kernel, duration, DRAM read rate, issue-slot
use, achieved occupancy, registers, and the top warp-stall reasons (cycles per issued instruction).
Usage: python3 scripts/ncu_summary.py RAW.csv"""
import csv
import sys

from tabulate import tabulate

STALL = "smsp__average_warps_issue_stalled_"
SUFFIX = "_per_issue_active.ratio"


def num(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return None


def main() -> int:
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    rows = [r for r in rows if num(r.get("gpu__time_duration.sum")) is not None]
    out = []
    for r in rows:
        stalls = sorted(((num(v) or 0.0, k[len(STALL):-len(SUFFIX)]) for k, v in r.items()
                         if k.startswith(STALL) and k.endswith(SUFFIX)), reverse=True)
        dur_ns = num(r["gpu__time_duration.sum"])
        rd = num(r.get("dram__bytes_read.sum"))
        out.append({"kernel": r.get("Kernel Name", "")[:28], "us": dur_ns / 1e3 if dur_ns else None,
                    "grid": r.get("launch__grid_size"), "blk": r.get("launch__block_size"),
                    "regs": r.get("launch__registers_per_thread"),
                    "dram_MB": rd / 1e6 if rd else None, "GB/s": rd / dur_ns if rd and dur_ns else None,
                    "issue%": num(r.get("smsp__issue_active.avg.pct_of_peak_sustained_active")),
                    "occ%": num(r.get("sm__warps_active.avg.pct_of_peak_sustained_active")),
                    "stalls": ", ".join(f"{k} {v:.1f}" for v, k in stalls[:4])})
    print(tabulate(out, headers="keys", floatfmt=".3g"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
