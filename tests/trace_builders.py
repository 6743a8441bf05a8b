"""Hand-built PyTorch profiler traces and suite results for the trace tests: kernels named as the engines name
them, known durations, gaps, graph launches and ranges."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
PID = TID = 4242

NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
MLA = "void flashinfer::mla::BatchMLAPagedAttentionKernel<flashinfer::mla::KernelTraits<2u, 64u, 64u, 64u>>(...)"
MARLIN = "void marlin_moe_wna16::Marlin<__nv_bfloat16, 4, 8, 8, 8, 4, false>(...)"
GATE = "void kimi_k2_moe_fused_gate_kernel_small_token<float, 384>(...)"
GEMM = "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(...)"
VERIFY = "void VerifyTreeGreedy<long, int>(long*, int*, int*, int, int)"
MYSTERY = "mystery_kernel_xyz"
NORM = "void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(...)"
NVJET = "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"
DECODE = "_fwd_grouped_kernel_stage1"
ARGMAX = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps"
          "<c10::BFloat16>, unsigned int, long, 4, 4>>(...)")


class Builder:
    """Chrome trace events as torch.profiler writes them: CPU calls on (pid, tid), GPU events on (device, stream)
    with the launching call's correlation id."""

    def __init__(self, device: int = 0):
        self.events, self.corr, self.device = [], 0, device

    def call(self, name: str, cpu_us: float, dur_us: float = 1.0, cat: str = "cuda_runtime") -> int:
        self.corr += 1
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": TID, "ts": cpu_us, "dur": dur_us,
                            "args": {"External id": 0, "cbid": 211, "correlation": self.corr}})
        return self.corr

    def gpu(self, name: str, gpu_us: float, dur_us: float, corr: int | None, stream: int = 7, cat: str = "kernel"):
        args = {"device": self.device, "stream": stream, "External id": 0}
        if corr is not None:
            args["correlation"] = corr
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": self.device, "tid": stream, "ts": gpu_us,
                            "dur": dur_us, "args": args})

    def eager(self, name, cpu_us, gpu_us, dur_us, cat="kernel", call="cudaLaunchKernel"):
        self.gpu(name, gpu_us, dur_us, self.call(call, cpu_us), cat=cat)

    def graph(self, cpu_us, kernels, dur_us=2.0):
        corr = self.call("cudaGraphLaunch", cpu_us, dur_us)
        for k in kernels:
            self.gpu(*k[:3], corr, *k[3:])

    def range(self, name, start_us, dur_us, cat="user_annotation", pid=PID, tid=TID):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start_us,
                            "dur": dur_us, "args": {"External id": 0}})

    def write(self, path: Path, extra: dict | None = None) -> Path:
        text = json.dumps({"schemaVersion": 1, "traceEvents": self.events, **(extra or {})})
        if path.name.endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
        return path


def engine_trace(moe_us: float = 30.0, cycles: int = 3, ranges: bool = False, device: int = 0) -> Builder:
    """One cycle per 100 us: a CUDA graph (allreduce 10, MLA 20, Marlin MoE `moe_us` with the gate kernel 4 us on
    a second stream beside it, a GEMM 5), then eager tree verify 4, an unknown kernel 2, a D2H copy 3, and the
    host's stream sync; gaps 5 + 6 + 3 = 14 us. With `ranges`: a cycle range around it all, a verify range
    around the graph launch."""
    b = Builder(device)
    for k in range(cycles):
        g, c = 1000.0 + 100 * k, 500.0 + 100 * k
        if ranges:
            b.range("scheduler_step", c - 5, 100)
            b.range("verify_forward", c - 1, 4)
        end = g + 30 + moe_us
        b.graph(c, [(NCCL, g, 10.0), (MLA, g + 10, 20.0), (MARLIN, g + 30, moe_us), (GATE, g + 30, 4.0, 9),
                    (GEMM, end, 5.0)])
        b.eager(VERIFY, c + 10, end + 10, 4.0)
        b.eager(MYSTERY, c + 11, end + 20, 2.0)
        b.eager("Memcpy DtoH (Device -> Pinned)", c + 12, end + 25, 3.0, cat="gpu_memcpy", call="cudaMemcpyAsync")
        b.call("cudaStreamSynchronize", c + 13, 70.0)
    return b


def eager_engine_trace(cycles: int = 4) -> Builder:
    """engine_trace's cycle with every kernel launched eagerly (no CUDA graph to find cycles by: the periodic
    kernel sequence finds them), its D2H copy of 3 us after the cycle's last kernel."""
    b = Builder()
    for k in range(cycles):
        g, c = 1000.0 + 100 * k, 500.0 + 100 * k
        for i, (name, at, dur) in enumerate(((NCCL, 0, 10.0), (MLA, 10, 20.0), (MARLIN, 30, 30.0), (GEMM, 60, 5.0),
                                             (VERIFY, 70, 4.0), (MYSTERY, 80, 2.0))):
            b.eager(name, c + i, g + at, dur)
        b.eager("Memcpy DtoH (Device -> Pinned)", c + 12, g + 85, 3.0, cat="gpu_memcpy", call="cudaMemcpyAsync")
        b.call("cudaStreamSynchronize", c + 13, 70.0)
    return b


ENGINE_CYCLE = {"allreduce": 10.0, "attention": 20.0, "moe": 30.0, "router": 4.0, "projections": 5.0,
                "tree_sampling": 4.0, "other": 2.0, "memcpy": 3.0, "misc": 0.0,
                "gpu_idle": 14.0, "overlap": 4.0, "total": 88.0}


def suite_result(path: Path, layers: int | None = None, device: str | None = None) -> Path:
    """A valid verifybench.result for the verify component at n = 4 and 8 (isolated medians in us); `layers`: the
    layers its forward ran (unsaid by default), `device`: "cpu" for a smoke run's cases."""
    iso = {"misc": 1.0, "attn_proj": 2.0, "attn_core": 10.0, "allreduce": 5.0, "router": 1.0, "moe": 15.0,
           "dense": 1.0, "head": 2.0}
    cases = []
    for n, scale in ((4, 1.0), (8, 2.0)):
        for variant, us in [("full", 40.0), *((f"only-{c}", v) for c, v in iso.items())]:
            cases.append({"name": f"verify/x/{variant}/n{n}", "params": {"tokens": n, "variant": variant},
                          "check": {"ok": True, "detail": "runs"}, "mode": "graph",
                          "derived": {} if layers is None else {"layers_run": layers, "layers_total": layers},
                          "samples_us": [us * scale], "summary": {"n": 1, "median_us": us * scale}})
            if device:
                cases[-1]["device"] = device
    run = {"schema": "verifybench.result", "schema_version": 1, "component": "verify", "created_utc": "x",
           "fingerprint": {}, "extra": {}, "cases": cases}
    path.write_text(json.dumps(run))
    return path


EXTEND = "_fwd_kernel"  # SGLang's / vLLM's Triton extend (verify) attention


def verify_trace(cycles: int = 3, layers: int = 3, eager_attention: bool = True, ranges: bool = True) -> Builder:
    """One cycle per 1000 us: a draft graph (decode attention 10 us, a GEMM 5), then the verify forward of `layers`
    layers, each norm 3 + GEMM 10, Triton extend attention 20, GEMM 10 + allreduce 10 + gate 4 + Marlin 30; then
    the eager tree verify 4. With `eager_attention` the forward is piecewise: a graph before and one after each
    layer's attention, which Triton launches eagerly (cuLaunchKernelEx) between them; else one graph for it all.
    With `ranges`: "scheduler_step" around the cycle, "verify_forward" around the forward."""
    b = Builder()
    for k in range(cycles):
        c, g = 500.0 + 1000 * k, 5000.0 + 1000 * k
        if ranges:
            b.range("scheduler_step", c - 5, 60 + 100 * layers + 50)
            b.range("verify_forward", c + 55, 5 + 100 * layers)
        b.graph(c, [(DECODE, g, 10.0), (GEMM, g + 10, 5.0)])
        full = []
        for i in range(layers):
            t, gt = c + 60 + 100 * i, g + 50 + 100 * i
            pre = [(NORM, gt, 3.0), (GEMM, gt + 3, 10.0)]
            post = [(GEMM, gt + 40, 10.0), (NCCL, gt + 50, 10.0), (GATE, gt + 60, 4.0), (MARLIN, gt + 64, 30.0)]
            if eager_attention:
                b.graph(t, pre)
                b.gpu(EXTEND, gt + 15, 20.0, b.call("cuLaunchKernelEx", t + 10, cat="cuda_driver"))
                b.graph(t + 20, post)
            else:
                full += [*pre, (EXTEND, gt + 15, 20.0), *post]
        if full:
            b.graph(c + 60, full)
        b.eager(VERIFY, c + 60 + 100 * layers + 10, g + 50 + 100 * layers + 10, 4.0)
    return b
