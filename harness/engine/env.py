"""`verifybench env`: the run fingerprint of this machine and process (GPUs, GPU-to-GPU links and P2P access, clocks
and throttle reasons, versions, NCCL_*/CUDA_*/TORCH_* variables, git state), as a table or JSON."""
from __future__ import annotations

import argparse
import json

from tabulate import tabulate

from verifybench.harness.engine import fingerprint, topology


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="the whole fingerprint as JSON")


def run(args) -> int:
    fp = fingerprint.collect()
    if args.json:
        print(json.dumps(fp, indent=1))
        return 0
    rows = [("gpu model", fp["gpu_model"]), ("machine", fp["slug"]), ("driver", fp["driver"]),
            ("versions", ", ".join(f"{k} {v}" for k, v in fp["versions"].items() if v)),
            ("git", f"{fp['git']['commit']} dirty={fp['git']['dirty']}")]
    for g in fp["gpus"]:
        now = g.get("now") or {}
        rows.append((f"gpu {g['index']}", f"{g['name']} {g['uuid']} SM {now.get('sm_clock_mhz')}/"
                     f"{g['sm_clock_max_mhz']} MHz mem {now.get('mem_clock_mhz')}/{g['mem_clock_max_mhz']} MHz "
                     f"{now.get('temperature_c')} C {now.get('power_w')} W throttle={now.get('throttle_reasons')} "
                     f"PCIe gen{g['pcie_gen']} x{g['pcie_width']} NVLink {g['nvlink_active']}/{g['nvlink_links']}"))
    rows += [(k, v) for k, v in fp["env"].items()]
    print(tabulate(rows, tablefmt="plain"))
    print("\n" + topology.table(fp["topology"]))
    if not fp["cuda_available"]:
        print("no CUDA device: the fingerprint of a CPU machine")
    return 0
