"""The first GPU check of SGLang's Marlin MoE adapter (harness/engines/marlin.py): builds its JIT kernels, repacks a
random INT4 layer with SGLang's own loader step, runs fused_marlin_moe's calls once at n = 1, 4, 8 and prints the
relative error against our fp32 reference and the block_size_m it used, at Kimi-K2.5's TP8 layer shape (H 7168,
I 256 per rank, 384 experts, top-8, group 32) and a small one.

    PYTHONPATH=.ci/engines:.ci/engines-extra:tests/engine_stubs:tests/engine_stubs/no_sgl_kernel \\
        python3 scripts/marlin_check.py [--build-only]

The Marlin GEMM is one translation unit of ~180 kernel instances, built by one nvcc on first use (for sm_90 with CUDA
13.0: 6 min of one CPU core, checked off-device); tvm-ffi caches the build, so on a warm machine `--build-only`
first, under its own time limit, then the check.

Exit 0: every check passed; 1: a check failed; 2: no check ran (no GPU, SGLang's JIT build or repack failed), with
the reason in one line.
"""
from __future__ import annotations

import math
import sys
import time

import torch

from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK

# (name, experts, hidden, intermediate per rank, topk, group)
SHAPES = (("kimi-k2.5 tp8", 384, 7168, 256, 8, 32), ("small", 16, 1024, 256, 2, 32))
TOKENS = (1, 4, 8)
TOL = 1e-2  # the component's tolerance against the fp32 reference


def random_layer(e: int, h: int, inter: int, group: int, seed: int) -> tuple:
    """Random INT4 experts in our layout, as harness/components/moe_int4.py makes them (uniform nibbles; scales that
    keep every projection at unit variance): (w13_packed, w13_scales, w2_packed, w2_scales)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def linear(n, k):
        packed = torch.randint(-(1 << 31), (1 << 31) - 1, (e, n, k // 8), dtype=torch.int32, device="cuda",
                               generator=gen)
        std = 1.0 / (4.6 * math.sqrt(k))
        scales = std * (0.5 + torch.rand(e, n, k // group, device="cuda", generator=gen))
        return packed, scales.to(torch.bfloat16)

    return (*linear(2 * inter, h), *linear(h, inter))


def main(argv: list[str]) -> int:
    if argv in (["--help"], ["-h"]):
        print(__doc__)
        return EXIT_OK
    if argv not in ([], ["--build-only"]):
        print("usage: scripts/marlin_check.py [--build-only]")
        return EXIT_BAD_INPUT
    from verifybench.harness.engines import EngineMissing, engine_call, import_kernel_module, label, marlin
    from verifybench.harness.measure.timing.runner import rel_error
    from verifybench.kernels.moe_int4 import reference as moe

    if not torch.cuda.is_available():
        print(f"marlin_check: {label('sglang')}: {marlin.CPU_REASON}")
        return EXIT_BAD_INPUT
    try:
        t0 = time.perf_counter()
        engine_call("sglang")(lambda: (
            import_kernel_module("sglang", marlin.REPACK_MODULE)._jit_gptq_marlin_repack_module(),
            import_kernel_module("sglang", marlin.GEMM_MODULE)._jit_moe_wna16_marlin_module(torch.bfloat16)))()
        print(f"{label('sglang')}: JIT gptq_marlin_repack and moe_wna16_marlin (bf16) built or loaded in "
              f"{time.perf_counter() - t0:.0f} s; sgl-kernel steps in torch: {marlin.torch_ops() or 'none'}")
        if argv:
            return 0
        failed = 0
        for name, e, h, inter, topk, group in SHAPES:
            ours = random_layer(e, h, inter, group, seed=e)
            layer = marlin.marlin_layer(*ours, group, torch.bfloat16)
            for n in TOKENS:
                x = torch.randn(n, h, device="cuda").bfloat16()
                tw, ids = moe.route_uniform(n, e, topk, seed=n, device="cuda")
                run = marlin.moe_marlin(x, layer, tw, ids)
                out = engine_call("sglang")(run)()
                ref = moe.reference_moe_w4a16(x.float(), *ours, tw, ids)
                err = rel_error(out.float(), ref)
                ok = out.shape == ref.shape and out.dtype == x.dtype and err <= TOL
                failed += not ok
                print(f"{name:14s} E={e} H={h} I={inter} top-{topk} n={n}: block_size_m={run.info['block_size_m']} "
                      f"atomic_add={run.info['use_atomic_add']} rel_err={err:.2e} {'ok' if ok else 'FAILED'} "
                      f"(tol {TOL:g})")
            if name == "small":  # the check can fail: experts shifted by one must be far off the reference
                shifted = marlin.marlin_layer(*(t.roll(1, 0) for t in ours), group, torch.bfloat16)
                err = rel_error(engine_call("sglang")(marlin.moe_marlin(x, shifted, tw, ids))().float(), ref)
                failed += err <= 0.1
                print(f"{name:14s} control (experts shifted by one): rel_err={err:.2e} "
                      f"{'ok, far off' if err > 0.1 else 'FAILED: the check cannot tell'}")
            del ours, layer
    except EngineMissing as e:
        print(f"marlin_check: {e}")
        return EXIT_BAD_INPUT
    print(f"marlin_check: {'all checks passed' if not failed else f'{failed} checks FAILED'}")
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
