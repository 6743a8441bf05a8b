"""The first GPU check of SGLang's Marlin MoE adapter (harness/engines/marlin.py): builds its JIT kernels, repacks a
random INT4 layer with SGLang's own loader step, runs fused_marlin_moe's calls once at n = 1, 4, 8 and prints the
relative error against our fp32 reference and the block_size_m it used, at Kimi-K2.5's TP8 layer shape (H 7168,
I 256 per rank, 384 experts, top-8, group 32) and a small one. Then the path the deployed forward runs: the check the
composition makes before a cycle is timed (marlin.check_against_reference), and that path captured in one CUDA
graph (the block alignment inside it, sync-free), replayed on ids rewritten in place, against the reference. Last,
where Marlin's layer time goes at n = 1, 2, 4, 8: each GEMM alone and the steps around them.

    PYTHONPATH=.ci/engines:.ci/engines-extra:tests/engine_stubs:tests/engine_stubs/no_sgl_kernel \\
        python3 scripts/marlin_check.py [--build-only]

The Marlin GEMM is one translation unit of ~180 kernel instances, built by one nvcc on first use (for sm_90 with CUDA
13.0: 6 min of one CPU core, checked off-device); tvm-ffi caches the build, so on a warm machine `--build-only`
first, under its own time limit, then the check.

Exit 0: every check passed; 1: a check failed; 2: no check ran (no GPU, SGLang's JIT build or repack failed), with
the reason in one line.
"""
from __future__ import annotations

import functools
import sys
import time

import torch

from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK

# (name, experts, hidden, intermediate per rank, topk, group)
SHAPES = (("kimi-k2.5 tp8", 384, 7168, 256, 8, 32), ("small", 16, 1024, 256, 2, 32))
TOKENS = (1, 4, 8)


def forward_path(marlin, moe, rel_error) -> int:
    """The deployed forward's Marlin path (alignment in the call) at the K2.5 TP8 layer shape: the composition's
    check, then one CUDA graph of it replayed on new routing (ids and weights) written in place. Returns the number
    of failed checks."""
    from verifybench.harness.engines import engine_call

    _, e_forward, h, inter, topk, group = SHAPES[0]
    ok, detail = marlin.check_against_reference(h, inter, group, topk, e_forward, TOKENS, torch.bfloat16, "cuda")
    print(f"forward path: {detail} {'ok' if ok else 'FAILED'}")
    e, n = marlin.check_experts(8, topk, e_forward), 8
    ours = marlin.random_layer(e, h, inter, group, "cuda", seed=1)
    layer = marlin.marlin_layer(*ours, group, torch.bfloat16)
    x = torch.randn(n, h, device="cuda").bfloat16()
    tw, ids = moe.route_uniform(n, e, topk, seed=1, device="cuda")
    run = marlin.moe_marlin(x, layer, tw, ids, align_in_call=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as torch's graph capture wants it
        engine_call("sglang")(run)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync inside (the alignment's) would raise here
        out = run()
    new_tw, new_ids = moe.route_uniform(n, e, topk, seed=2, device="cuda")
    tw.copy_(new_tw)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    err = rel_error(out.float(), moe.reference_moe_w4a16(x.float(), *ours, tw, ids))
    good = err <= marlin.TOLERANCE
    print(f"forward path in one CUDA graph, replayed on new routing: n={n} {e} experts rel_err={err:.2e} "
          f"{'ok' if good else 'FAILED'} (tol {marlin.TOLERANCE:g})")
    return (not ok) + (not good) + alignment_cost(e_forward, topk)


def alignment_cost(experts: int, topk: int) -> int:
    """What the forward's block alignment costs per MoE layer (graph mode, the suite's timing engine) at the token
    counts of a decode step and a verify forward, ours (one Triton launch, what the forward runs) beside the torch
    version (~20 small kernels): SGLang runs it as one sgl-kernel op, absent here, so the deployed forward carries
    ours where the engine runs its own. Each checked equal to the torch one first. Returns the failed checks."""
    from verifybench.harness.engines.marlin import block_size_m
    from verifybench.harness.engines.sglang import align_block_size, align_capacity
    from verifybench.kernels.common.moe_align import reference
    from verifybench.harness.measure.timing.timer import measure
    from verifybench.harness.model import presets

    layers, failed = presets.get("kimi-k2.5", 8).moe_layers, 0
    for n in (1, 3, 6, 48):
        ids = torch.stack([torch.randperm(experts, device="cuda")[:topk] for _ in range(n)]).to(torch.int32)
        bm = block_size_m(n, topk, experts)
        in_torch = functools.partial(reference, capacity=align_capacity(n * topk, bm, experts))
        same = all(torch.equal(a, b) for a, b in zip(align_block_size(ids, bm, experts), in_torch(ids, bm, experts)))
        failed += not same
        us = {name: measure([lambda fn=fn: fn(ids, bm, experts)], mode="graph", max_time_s=0.2).median_us
              for name, fn in (("ours", align_block_size), ("torch", in_torch))}
        print(f"block alignment (SGLang: one sgl-kernel op): n={n} ours (one launch) {us['ours']:.1f} us per layer, "
              f"{us['ours'] * layers / 1e3:.2f} ms per forward of {layers} MoE layers; in torch {us['torch']:.1f} us, "
              f"{us['torch'] * layers / 1e3:.2f} ms; equal: {'ok' if same else 'FAILED'}")
    return failed


ROUTINGS = 8  # routings rotated in the split: 8 x 8 experts x 2.75 MB at n = 1 is 3.5x an H100's L2


def where_time_goes(marlin, moe) -> None:
    """Marlin's MoE layer split at the K2.5 TP8 shape (graph mode, rotated over ROUTINGS routings so the experts read
    are not in L2 from the previous call): the whole call as the moe_int4 row runs it, each GEMM alone, and the rest
    (the workspace zeroing, SiLU*up and the top-k sum; sgl-kernel ops in SGLang, in torch here unless sgl-kernel
    imports). The GEMMs alone are the least Marlin as deployed can take; ours against them says what the kernel
    itself gains."""
    from verifybench.harness.engines import engine_call
    from verifybench.harness.measure.timing.timer import measure

    _, e, h, inter, topk, group = SHAPES[0]
    layer = marlin.marlin_layer(*marlin.random_layer(e, h, inter, group, "cuda", seed=3), group, torch.bfloat16)
    for n in (1, 2, 4, 8):
        runs = []
        for r in range(ROUTINGS):
            tw, ids = moe.route_uniform(n, e, topk, seed=100 + r, device="cuda")
            runs.append(marlin.moe_marlin(torch.randn(n, h, device="cuda").bfloat16(), layer, tw, ids))
        gemms = [run.gemms() for run in runs]
        us = {name: engine_call("sglang")(measure)(fns, mode="graph", max_time_s=0.3).median_us
              for name, fns in (("whole", runs), ("gate_up", [g["gate_up"] for g in gemms]),
                                ("down", [g["down"] for g in gemms]))}
        rest = us["whole"] - us["gate_up"] - us["down"]
        print(f"marlin split n={n} (graph, {ROUTINGS} routings): whole {us['whole']:.1f} us = gate_up GEMM "
              f"{us['gate_up']:.1f} + down GEMM {us['down']:.1f} + rest {rest:.1f} (zeroing, "
              + (f"{'/'.join(marlin.torch_ops())} in torch)" if marlin.torch_ops() else "sgl-kernel's ops)"))


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
            ours = marlin.random_layer(e, h, inter, group, "cuda", seed=e)
            layer = marlin.marlin_layer(*ours, group, torch.bfloat16)
            for n in TOKENS:
                x = torch.randn(n, h, device="cuda").bfloat16()
                tw, ids = moe.route_uniform(n, e, topk, seed=n, device="cuda")
                run = marlin.moe_marlin(x, layer, tw, ids)
                out = engine_call("sglang")(run)()
                ref = moe.reference_moe_w4a16(x.float(), *ours, tw, ids)
                err = rel_error(out.float(), ref)
                ok = out.shape == ref.shape and out.dtype == x.dtype and err <= marlin.TOLERANCE
                failed += not ok
                print(f"{name:14s} E={e} H={h} I={inter} top-{topk} n={n}: block_size_m={run.info['block_size_m']} "
                      f"atomic_add={run.info['use_atomic_add']} rel_err={err:.2e} {'ok' if ok else 'FAILED'} "
                      f"(tol {marlin.TOLERANCE:g})")
            if name == "small":  # the check can fail: experts shifted by one must be far off the reference
                shifted = marlin.marlin_layer(*(t.roll(1, 0) for t in ours), group, torch.bfloat16)
                err = rel_error(engine_call("sglang")(marlin.moe_marlin(x, shifted, tw, ids))().float(), ref)
                failed += err <= 0.1
                print(f"{name:14s} control (experts shifted by one): rel_err={err:.2e} "
                      f"{'ok, far off' if err > 0.1 else 'FAILED: the check cannot tell'}")
            del ours, layer
        failed += forward_path(marlin, moe, rel_error)
        where_time_goes(marlin, moe)
    except EngineMissing as e:
        print(f"marlin_check: {e}")
        return EXIT_BAD_INPUT
    print(f"marlin_check: {'all checks passed' if not failed else f'{failed} checks FAILED'}")
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
