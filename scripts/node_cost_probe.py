"""Experiment: does process state change the per-node cost of a straight-line graph of tiny kernels?

The CLI (`verifybench graph`) read 1.03 us per node and two pytest runs 1.15 us, in the same session; pytest runs
the 1-rank allreduce cases (a NCCL communicator) before the graph cases. This measures N=1024 graphs in one process
before and after each step of what bench_allreduce does, and prints the per-node cost after each.
"""
import sys

import torch

from harness import hostpin
from harness.timing import measure
from kernels.graph_replay import tiny_kernel


def per_node_us(label: str, rows: list) -> None:
    x = torch.zeros(1, dtype=torch.int64, device="cuda")
    m = measure(lambda: tiny_kernel(x), mode="graph", calls_per_sample=1024, max_time_s=0.5)
    rows.append((label, m.median_us))
    print(f"{label:40s} {m.median_us:.4f} us per node ({m.summary.n} samples)", flush=True)


def main() -> int:
    hostpin.pin()
    rows: list = []
    per_node_us("fresh process", rows)
    per_node_us("fresh process, again", rows)
    import cupy  # noqa: F401  (the fingerprint imports it for its version)
    per_node_us("after import cupy", rows)
    torch.cuda.nccl.version()
    per_node_us("after torch.cuda.nccl.version()", rows)
    from harness import fingerprint
    fingerprint.collect()
    per_node_us("after fingerprint.collect()", rows)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    per_node_us("after using a second torch stream", rows)
    from harness.allreduce_backends import check_eager, check_graph, expected_sum
    from microbench import bench_allreduce as ba

    comm = ba._comm("cuda")
    per_node_us("after init_process_group (nccl, 1 rank)", rows)
    op = ba._backend("nccl", comm, 7168 * 8)(7168)
    check_eager(op, comm, expected_sum(7168, 1, comm.device))
    per_node_us("after an eager NCCL allreduce", rows)
    check_graph(op, comm, expected_sum(7168, 1, comm.device))
    per_node_us("after a graph-captured NCCL allreduce", rows)
    op2 = ba._backend("pynccl", comm, 7168 * 8)(7168)
    check_eager(op2, comm, expected_sum(7168, 1, comm.device))
    check_graph(op2, comm, expected_sum(7168, 1, comm.device))
    per_node_us("after pynccl eager + graph", rows)
    base = rows[0][1]
    for label, us in rows:
        print(f"RESULT {label:40s} {us:.4f} us/node  x{us / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
