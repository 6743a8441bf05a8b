"""FlashInfer's MLA attention as SGLang's flashinfer_mla backend calls it: the BatchMLAPagedAttentionWrapper planned
with page size 1, for target verify (causal, the prefix and the D tree tokens as one paged range per request; it
ignores SGLang's tree mask, SGLang's own TODO, so it is exact for chains only: topk 1) and for decode.

GPU only: FlashInfer compiles its MLA module with nvcc on first use (about a minute per configuration).
"""
from __future__ import annotations

import time

import torch

from verifybench.harness.engines import EngineMissing, engine_call, import_kernel_module

FOLLOWS = "flashinfer 0.6.7.post3"  # the release whose calls this adapter makes, as SGLang 0.5.10.post1 makes them
WORKSPACE_BYTES = 128 * 1024 * 1024  # the float workspace FlashInfer's docs recommend, as SGLang allocates it


def mla_module():
    return import_kernel_module("flashinfer", "flashinfer.mla")


def _planner(q_per_request: int, firsts: list[int], lens: list[int], heads: int, kv_lora: int, rope: int,
             scale: float, dtype, device, causal: bool, backend: str):
    """(wrapper, plan) of requests with q_per_request queries each over cache rows [first, first + len) (page size 1),
    planned as SGLang's flashinfer_mla backend plans; plan() copies the indptrs to the host (a device sync)."""
    if device.type != "cuda":
        raise EngineMissing("FlashInfer's MLA kernels need a CUDA GPU (they compile with nvcc)")
    mla = mla_module()
    kv_indices = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(firsts, lens)]).to(torch.int32)
    kv_len = torch.tensor(lens, dtype=torch.int32, device=device)
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), kv_len.cumsum(0).to(torch.int32)])
    qo_indptr = torch.arange(0, (len(lens) + 1) * q_per_request, q_per_request, dtype=torch.int32, device=device)
    wrapper = mla.BatchMLAPagedAttentionWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device),
                                                backend=backend)

    def plan():
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, heads, kv_lora, rope, 1, causal, scale, dtype, dtype)

    plan()  # a run needs a plan; the caller times further plans on the host
    return wrapper, plan


@engine_call("flashinfer")
def verify_planner(starts, prefix_lens, d: int, heads: int, kv_lora: int, rope: int, scale: float, dtype,
                   backend: str = "fa2"):
    """(wrapper, plan) for B requests of D tree tokens each over their prefix and their own D rows (the chain mask),
    as SGLang plans target verify: qo_indptr = arange(0, (B + 1) D, D), kv_indptr = cumsum(L_b + D), kv_indices =
    each request's prefix and tree rows, kv_len = L_b + D, causal. One plan serves every layer (the rows are the same;
    the caches differ), as SGLang plans once per verify forward, on the host, before the replay."""
    lens = [n + d for n in prefix_lens.tolist()]
    return _planner(d, starts.tolist(), lens, heads, kv_lora, rope, scale, dtype, starts.device, True, backend)


@engine_call("flashinfer")
def decode_planner(starts, lens, tokens_per_request: int, heads: int, kv_lora: int, rope: int, scale: float, dtype,
                   backend: str = "fa2"):
    """(wrapper, plan) for decode as SGLang's flashinfer_mla backend plans it: one query per row, each over its
    request's rows (qo_indptr = arange(0, rows + 1), kv_len = the request's length, not causal); a request's
    tokens_per_request tokens are that many rows over the same rows, as kernels/mla_decode/ lays them out."""
    firsts = starts.repeat_interleave(tokens_per_request).tolist()
    rows = lens.repeat_interleave(tokens_per_request).tolist()
    return _planner(1, firsts, rows, heads, kv_lora, rope, scale, dtype, starts.device, False, backend)


def mla_run(q, cache, kv_lora: int, wrapper):
    """run() -> out [heads, T, kv_lora] (a view of the engine's [T, heads, .]) of one layer's q [heads, T, DK] over
    cache [rows, DK], through a planned wrapper: q_nope / q_pe the first kv_lora / the rope values of q as
    [T, heads, .]; ckv / kpe the same views of the cache as [rows, 1, .], as SGLang passes its KV buffer."""
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
