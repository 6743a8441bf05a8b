"""FlashInfer's MLA attention as SGLang's flashinfer_mla backend calls it for target verify (topk 1): the
BatchMLAPagedAttentionWrapper planned with page size 1, causal, the prefix and the D tree tokens as one paged range per
request. It ignores SGLang's tree mask (SGLang's own TODO), so it is exact for chains only.

GPU only: FlashInfer compiles its MLA module with nvcc on first use (about a minute per configuration).
"""
from __future__ import annotations

import time

import torch

from verifybench.harness.engines import EngineMissing, import_kernel_module, requests

WORKSPACE_BYTES = 128 * 1024 * 1024  # the float workspace FlashInfer's docs recommend, as SGLang allocates it


def mla_module():
    return import_kernel_module("flashinfer", "flashinfer.mla")


def mla_verify(q, cache, starts, prefix_lens, kv_lora: int, scale: float, backend: str = "fa2"):
    """(run, plan) for B requests of D tree tokens each over their prefix and their own D rows (the chain mask).

    Ours: q [heads, T, DK]; cache [rows, DK]; request b's prefix rows [start_b, start_b + L_b), its D tree rows right
    after. The engine's (flashinfer_mla_backend, target verify): qo_indptr = arange(0, (B + 1) D, D), kv_indptr =
    cumsum(L_b + D), kv_indices = each request's prefix and tree rows (page size 1), kv_len = L_b + D, causal;
    q_nope / q_pe the first kv_lora / the rope values of q [T, heads, .]; ckv / kpe the same views of the cache as
    [rows, 1, .]. plan() is the host call SGLang makes once per verify forward (it copies the indptrs to the host: a
    device sync); run() is the kernel, returning out [heads, T, kv_lora] (a view of the engine's [T, heads, .])."""
    if q.device.type != "cuda":
        raise EngineMissing("FlashInfer's MLA kernels need a CUDA GPU (they compile with nvcc)")
    mla = mla_module()
    heads, t, dk, b, d, lens, firsts = requests(q, starts, prefix_lens)
    device = q.device
    kv_indices = torch.cat([torch.arange(s, s + n + d, device=device) for s, n in zip(firsts, lens)]).to(torch.int32)
    kv_len = torch.tensor([n + d for n in lens], dtype=torch.int32, device=device)
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), kv_len.cumsum(0).to(torch.int32)])
    qo_indptr = torch.arange(0, (b + 1) * d, d, dtype=torch.int32, device=device)
    wrapper = mla.BatchMLAPagedAttentionWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device),
                                                backend=backend)
    q_engine = q.transpose(0, 1).contiguous()
    q_nope, q_pe = q_engine[..., :kv_lora], q_engine[..., kv_lora:]
    pages = cache.view(-1, 1, dk)
    ckv, kpe = pages[..., :kv_lora], pages[..., kv_lora:]
    out = torch.empty(t, heads, kv_lora, dtype=q.dtype, device=device)

    def plan():
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, heads, kv_lora, dk - kv_lora, 1, True, scale, q.dtype,
                     cache.dtype)

    def run():
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
        return out.transpose(0, 1)

    plan()  # a run needs a plan; the caller times further plans on the host
    return run, plan


def plan_host_us(plan, calls: int = 20) -> float:
    """Median host time of one plan() call (µs): what SGLang pays on the host per verify forward before the replay."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        plan()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]
