"""The engine adapters against the released engine where it is installed (CI: SGLang 0.5.10.post1 in .ci/engines, its
Triton kernels in the interpreter): the engine's kernel is called as the engine calls it and checked against our
plain-torch reference; our tile tables are held against the installed engine's launcher. conftest.py puts .ci/engines
on the path."""
import importlib
import os

import pytest
import torch

from verifybench.harness import engines
from verifybench.kernels.mla_verify import api as mv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _adapter(engine: str, module_call: str):
    """The adapter module of `engine`, skipping the test where the engine's kernel module cannot be imported."""
    adapter = importlib.import_module(f"verifybench.harness.engines.{engine}")
    try:
        getattr(adapter, module_call)()
    except engines.EngineMissing as e:
        pytest.skip(f"{engine}'s kernels cannot be imported here: {e}")
    return adapter


def _sglang():
    return _adapter("sglang", "extend_module")


def _flashinfer():
    return _adapter("flashinfer", "mla_module")


def test_a_missing_engine_is_named_in_one_line_with_the_reason():
    with pytest.raises(engines.EngineMissing) as e:
        engines.import_kernel_module("vllm", "vllm.surely_not_a_module")
    assert "\n" not in str(e.value) and "vllm" in str(e.value)


def test_engine_extend_tables_match_the_installed_sglang_launcher():
    sglang = _sglang()
    assert engines.version("sglang") == mv.ENGINE_EXTEND_SOURCE.split()[1], \
        "the tables mirror another SGLang than the one installed: check them against its launcher and rename"
    for cc, cfg in mv.ENGINE_EXTEND_CONFIGS.items():
        picked = sglang.extend_tiles(cc)
        assert picked == {k: cfg[k] for k in picked}, f"sm_{cc}: SGLang picks {picked}, our table says {cfg}"


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="the kernels need a GPU or the interpreter")
@pytest.mark.parametrize("tree_shape", [None, (3, 2, 4)], ids=["chain", "tree"])
@pytest.mark.parametrize("cc", [None, 120], ids=["own-tiles", "sm120-tiles"])
def test_sglang_extend_called_for_target_verify_matches_the_reference(tree_shape, cc):
    from verifybench.kernels.tree import api as tree
    from verifybench.kernels.tree.inputs import random_tree

    sglang = _sglang()
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # bf16 arithmetic is wrong in the interpreter
    gen = torch.Generator().manual_seed(5)
    heads, kv_lora, rope, lens = 2, 32, 16, [37, 5]
    d = 4
    if tree_shape is None:
        mask = torch.ones(d, d, dtype=torch.bool).tril().expand(len(lens), d, d).contiguous()
    else:
        steps, topk, d = tree_shape
        inp = random_tree(len(lens), topk, steps, d, 100, seed=3, context=8, spread=0)
        mask = tree.build_tree(**inp, mask_mode="qlen_only", backend="reference")[0].view(len(lens), d, d)
    starts = [3, 3 + lens[0] + d + 2]
    cache = torch.randn(starts[1] + lens[1] + d + 1, kv_lora + rope, generator=gen).to(dtype).to(device)
    q = torch.randn(heads, len(lens) * d, kv_lora + rope, generator=gen).to(dtype).to(device)
    starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    mask = mask.contiguous().to(device)
    ref = mv.mla_verify_reference(q.float(), cache.float(), starts_t, lens_t, mask, kv_lora, 0.125)
    out = sglang.extend_verify(q, cache, starts_t, lens_t, mask, kv_lora, 0.125, cc=cc)()
    assert out.shape == ref.shape
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="the kernels need a GPU or the interpreter")
@pytest.mark.parametrize("tokens_per_request", [1, 3])
def test_sglang_mla_decode_matches_the_reference(tokens_per_request):
    """SGLang's decode at the MLA head (576 = 512 + 64, its split-rope path), B = 2 requests of different lengths
    in one cache: one split for the short request, several for the long one; g tokens per request as draft decode
    lays them out."""
    from verifybench.kernels.mla_decode.api import mla_decode_reference

    sglang = _sglang()
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # bf16 arithmetic is wrong in the interpreter
    gen = torch.Generator().manual_seed(7)
    heads, kv_lora, dk, lens, starts, g = 2, 512, 576, [70, 9], [4, 80], tokens_per_request
    cache = torch.randn(starts[1] + lens[1] + 3, dk, generator=gen).to(dtype).to(device)
    q = torch.randn(heads, len(lens) * g, dk, generator=gen).to(dtype).to(device)
    starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = torch.cat([mla_decode_reference(q[:, b * g:(b + 1) * g].float(), cache[s:].float(), n, kv_lora, 0.1)
                     for b, (s, n) in enumerate(zip(starts, lens))], 1)
    out = sglang.mla_decode(q, cache, starts_t, lens_t, kv_lora, 0.1)()
    assert out.shape == ref.shape and out.dtype == dtype
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_the_fingerprint_records_every_engine_package_found_without_importing_it():
    import sys

    from verifybench.harness.engine import fingerprint

    imported = "sglang" in sys.modules
    found = fingerprint.collect()["versions"]["engines"]
    assert set(found) == {"sglang", "flashinfer", "sgl_kernel", "vllm"}
    assert found["sglang"] == engines.version("sglang")
    assert ("sglang" in sys.modules) == imported  # read from the package metadata, not by importing the engine


@pytest.mark.gpu
def test_flashinfer_mla_planned_as_sglang_plans_target_verify_matches_the_chain_reference():
    flashinfer = _flashinfer()
    gen = torch.Generator().manual_seed(11)
    heads, kv_lora, rope, d, lens, starts = 8, 512, 64, 4, [1000, 37], [0, 1100]
    cache = torch.randn(starts[1] + lens[1] + d, kv_lora + rope, generator=gen).bfloat16().cuda()
    q = torch.randn(heads, len(lens) * d, kv_lora + rope, generator=gen).bfloat16().cuda()
    starts_t, lens_t = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (starts, lens))
    chain = torch.ones(d, d, dtype=torch.bool).tril().expand(len(lens), d, d).contiguous().cuda()
    ref = mv.mla_verify_reference(q.float(), cache.float(), starts_t, lens_t, chain, kv_lora, 192 ** -0.5)
    wrapper, plan = flashinfer.verify_planner(starts_t, lens_t, d, heads, kv_lora, rope, 192 ** -0.5, torch.bfloat16)
    out = flashinfer.mla_run(q, cache, kv_lora, wrapper)()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert flashinfer.plan_host_us(plan, calls=3) > 0


@pytest.mark.gpu
def test_flashinfer_mla_decode_planned_as_sglang_plans_decode_matches_the_reference():
    from verifybench.kernels.mla_decode.api import mla_decode_reference

    flashinfer = _flashinfer()
    gen = torch.Generator().manual_seed(12)
    heads, kv_lora, dk, length, g = 8, 512, 576, 4100, 3
    cache = torch.randn(length + 8, dk, generator=gen).bfloat16().cuda()
    q = torch.randn(heads, g, dk, generator=gen).bfloat16().cuda()
    starts = torch.zeros(1, dtype=torch.int32, device="cuda")
    lens = torch.full((1,), length, dtype=torch.int32, device="cuda")
    ref = mla_decode_reference(q.float(), cache.float(), length, kv_lora, 192 ** -0.5)
    wrapper, _ = flashinfer.decode_planner(starts, lens, g, heads, kv_lora, dk - kv_lora, 192 ** -0.5, torch.bfloat16)
    out = flashinfer.mla_run(q, cache, kv_lora, wrapper)()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
