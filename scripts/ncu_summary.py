"""Compact table from `ncu --import REP --page raw --csv` output: per kernel, duration, DRAM bytes read and their rate,
warp instructions, issue-slot use, achieved occupancy, registers, and the top warp-stall reasons (cycles per issued
instruction). ncu flushes the caches before each kernel, so data a kernel would find in L2 in the forward (split-K
partials, the previous kernel's output) counts as DRAM here.
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


SCALE = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "nsecond": 1e-3,  # to us
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}  # to MB


def main() -> int:
    with open(sys.argv[1], newline="") as f:
        reader = csv.reader(f)
        header, units = next(reader), next(reader)  # --page raw --csv: names, then units
        rows = [dict(zip(header, r)) for r in reader]
    unit = dict(zip(header, units))
    rows = [r for r in rows if num(r.get("gpu__time_duration.sum")) is not None]

    def scaled(r, key):
        v = num(r.get(key))
        return None if v is None else v * SCALE.get(unit.get(key, ""), float("nan"))

    out = []
    for r in rows:
        stalls = sorted(((num(v) or 0.0, k[len(STALL):-len(SUFFIX)]) for k, v in r.items()
                         if k.startswith(STALL) and k.endswith(SUFFIX)), reverse=True)
        us, mb = scaled(r, "gpu__time_duration.sum"), scaled(r, "dram__bytes_read.sum")
        out.append({"kernel": r.get("Kernel Name", "")[:28], "us": us,
                    "grid": r.get("launch__grid_size"), "blk": r.get("launch__block_size"),
                    "regs": r.get("launch__registers_per_thread"),
                    "dram_MB": mb, "GB/s": 1e3 * mb / us if mb and us else None,
                    "Minstr": (num(r.get("smsp__inst_executed.sum")) or 0) / 1e6 or None,
                    "issue%": num(r.get("smsp__issue_active.avg.pct_of_peak_sustained_active")),
                    "occ%": num(r.get("sm__warps_active.avg.pct_of_peak_sustained_active")),
                    "stalls": ", ".join(f"{k} {v:.1f}" for v, k in stalls[:4])})
    print(tabulate(out, headers="keys", floatfmt=".3g"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
