"""The engines' attention kernels behind one call per part, as mla_verify and mla_decode call them: their backends'
declarations (harness/engines/backends.py) name these functions, so a component holds no per-engine branch.

verify: setup(cc) -> (config, where it comes from); call(starts, lens, mask, kv_lora, scale, heads, rope, dtype, cc)
-> call(q, cache) -> out [heads, T, kv_lora], its engine inputs built once per (q, cache) outside the timed region;
FlashInfer's also carries .plan (the host-side plan SGLang calls once per forward).
decode: call(starts, lens, n, heads, kv_lora, rope, scale, dtype, kv_splits) -> (make(q, cache) -> run(), plan|None);
make.record, where present, is what the row's record adds.
"""
from __future__ import annotations

from verifybench.harness import engines


def per_input(make):
    """call(q, cache) -> make(q, cache)(), made once per (q, cache): an engine's inputs are built from ours outside
    the timed region (setup and the check call it first); the pair is held, so its ids cannot be reused meanwhile."""
    built: dict = {}

    def call(q, cache):
        key = (id(q), id(cache))
        if key not in built:
            built[key] = (q, cache, make(q, cache))
        return built[key][2]()
    return call


def sglang_verify_config(cc: int | None) -> tuple[dict, str]:
    """The installed SGLang's extend tiles for sm_<cc> (None: this GPU's), as its launcher picks them."""
    from verifybench.harness.engines import sglang

    on = f" as on sm_{cc}" if cc is not None else ""
    return sglang.extend_tiles(cc), f"{engines.label('sglang')}'s launcher{on}"


def sglang_verify(starts, lens, mask, kv_lora: int, scale: float, cc: int | None = None, **_):
    """SGLang's extend for target verify, one forward's metadata shared by every layer (rotated cache), as its
    backend shares it."""
    from verifybench.harness.engines import sglang

    meta = sglang.extend_metadata(starts, lens, mask)
    return per_input(lambda q, cache: sglang.extend_verify(q, cache, starts, lens, mask, kv_lora, scale, cc=cc,
                                                           metadata=meta))


def flashinfer_verify_config(cc: int | None) -> tuple[dict, str]:
    from verifybench.harness.engines import flashinfer

    flashinfer.mla_module()
    return {"backend": "fa2"}, f"{engines.label('flashinfer')}, backend fa2, planned as SGLang does"


def flashinfer_verify(starts, lens, mask, kv_lora: int, scale: float, heads: int, rope: int, dtype, **_):
    """FlashInfer's MLA for target verify (chains: its D is the mask's), planned once as SGLang plans a forward."""
    from verifybench.harness.engines import flashinfer

    wrapper, plan = flashinfer.verify_planner(starts, lens, mask.shape[-1], heads, kv_lora, rope, scale, dtype)
    call = per_input(lambda q, cache: flashinfer.mla_run(q, cache, kv_lora, wrapper))
    call.plan = plan
    return call


def sglang_decode(starts, lens, n: int, heads: int, kv_lora: int, rope: int, scale: float, dtype,
                  kv_splits: int | None = None):
    """SGLang's Triton decode over the requests, one forward's metadata shared by every layer."""
    from verifybench.harness.engines import sglang

    sglang.decode_module()
    meta = sglang.decode_metadata(starts, lens, n, heads, kv_lora, kv_splits or sglang.MAX_KV_SPLITS)

    def make(q, c):
        return sglang.mla_decode(q, c, starts, lens, kv_lora, scale, meta)
    make.record = {"max_kv_splits": meta["max_kv_splits"]}  # what the row's record adds
    return make, None


def flashinfer_decode(starts, lens, n: int, heads: int, kv_lora: int, rope: int, scale: float, dtype,
                      kv_splits: int | None = None):
    """FlashInfer's MLA decode as SGLang's flashinfer_mla backend plans it (one plan per forward)."""
    from verifybench.harness.engines import flashinfer

    wrapper, plan = flashinfer.decode_planner(starts, lens, n, heads, kv_lora, rope, scale, dtype)
    return (lambda q, c: flashinfer.mla_run(q, c, kv_lora, wrapper)), plan
