"""FlashInfer's MLA attention as SGLang's flashinfer_mla backend calls it for target verify (topk 1): the
BatchMLAPagedAttentionWrapper planned with page size 1, causal, the prefix and the D tree tokens as one paged range per
request. It ignores SGLang's tree mask (SGLang's own TODO), so it is exact for chains only.

GPU only: FlashInfer compiles its MLA module with nvcc on first use (about a minute per configuration).
"""
from __future__ import annotations

import time

import torch

from verifybench.harness.engines import EngineMissing, import_kernel_module

WORKSPACE_BYTES = 128 * 1024 * 1024  # the float workspace FlashInfer's docs recommend, as SGLang allocates it


def mla_module():
    return import_kernel_module("flashinfer", "flashinfer.mla")


def verify_planner(starts, prefix_lens, d: int, heads: int, kv_lora: int, rope: int, scale: float, dtype,
                   backend: str = "fa2"):
    """(wrapper, plan) for B requests of D tree tokens each over their prefix and their own D rows (the chain mask),
    planned as SGLang's flashinfer_mla backend plans target verify: qo_indptr = arange(0, (B + 1) D, D), kv_indptr =
    cumsum(L_b + D), kv_indices = each request's prefix and tree rows (page size 1), kv_len = L_b + D, causal. One
    plan serves every layer (the rows are the same; the caches differ), as SGLang plans once per verify forward;
    plan() copies the indptrs to the host (a device sync) and is what SGLang pays on the host before the replay."""
    device = starts.device
    if device.type != "cuda":
        raise EngineMissing("FlashInfer's MLA kernels need a CUDA GPU (they compile with nvcc)")
    mla = mla_module()
    b = starts.numel()
    lens, firsts = prefix_lens.tolist(), starts.tolist()
    kv_indices = torch.cat([torch.arange(s, s + n + d, device=device) for s, n in zip(firsts, lens)]).to(torch.int32)
    kv_len = torch.tensor([n + d for n in lens], dtype=torch.int32, device=device)
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), kv_len.cumsum(0).to(torch.int32)])
    qo_indptr = torch.arange(0, (b + 1) * d, d, dtype=torch.int32, device=device)
    wrapper = mla.BatchMLAPagedAttentionWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device),
                                                backend=backend)

    def plan():
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, heads, kv_lora, rope, 1, True, scale, dtype, dtype)

    plan()  # a run needs a plan; the caller times further plans on the host
    return wrapper, plan


def mla_verify(q, cache, kv_lora: int, wrapper):
    """run() -> out [heads, T, kv_lora] (a view of the engine's [T, heads, .]) of one layer's q [heads, T, DK] over
    cache [rows, DK], through a planned wrapper (verify_planner): q_nope / q_pe the first kv_lora / the rope values of
    q as [T, heads, .]; ckv / kpe the same views of the cache as [rows, 1, .], as SGLang passes its KV buffer."""
    heads, t, dk = q.shape
    q_engine = q.transpose(0, 1).contiguous()
    q_nope, q_pe = q_engine[..., :kv_lora], q_engine[..., kv_lora:]
    pages = cache.view(-1, 1, dk)
    ckv, kpe = pages[..., :kv_lora], pages[..., kv_lora:]
    out = torch.empty(t, heads, kv_lora, dtype=q.dtype, device=q.device)

    def run():
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
        return out.transpose(0, 1)

    return run


def plan_host_us(plan, calls: int = 20) -> float:
    """Median host time of one plan() call (µs): what SGLang pays on the host per verify forward before the replay."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        plan()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]
