"""Target for Nsight Compute: one eager Kimi-K2.5 TP8 verify forward at n tokens (PDL off), with the CUDA profiler
range around it only, so `ncu --profile-from-start off --launch-skip S --launch-count C` picks kernels of one layer.
The first forward (compiles, routing) runs outside the range. Layers: 12 by default (enough that a layer's weights
are cold in L2 when it runs; ncu also flushes caches between passes).
Usage: ncu --clock-control none --profile-from-start off ... python3 scripts/verify_ncu.py N [LAYERS]
"""
import sys

import torch

from kernels import pdl
from microbench.bench_verify import CONTEXT, REFERENCE_ALLREDUCE_US, _forward


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    fwd = _forward("kimi-k2.5", 8, layers, CONTEXT, REFERENCE_ALLREDUCE_US)
    with pdl.forced(False):
        fwd.forward(n)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fwd.forward(n)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
