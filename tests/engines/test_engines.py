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


def test_sglang_extend_compiles_here_and_its_prefix_loop_spills_where_ours_does_not(capsys):
    """What ptxas builds for sm_90 with SGLang's tiles (docs/FINDINGS.md §9): the engine's serial loop over the prefix
    stores and reloads spilled registers at every key tile and runs more instructions; ours, with the dense mask
    mla_verify gives it, spills nothing there. The script prints the same beside each other."""
    import importlib.util
    from pathlib import Path

    sglang = _sglang()
    try:
        engine = sglang.extend_compiled(90)
        ours = mv.compiled_resources("extend", mv.ENGINE_EXTEND_CONFIGS[90], 90)["_extend_kernel"]
    except FileNotFoundError as e:  # no cuobjdump in this Triton
        pytest.skip(str(e))
    prefix_engine, prefix_ours = engine["loops"][0], ours["loops"][0]
    assert prefix_engine["mma"] == prefix_ours["mma"] > 0, (prefix_engine, prefix_ours)  # the same tiles' dots
    assert prefix_engine["local_stores"] > 0 == prefix_ours["local_stores"], (prefix_engine, prefix_ours)
    assert prefix_engine["instructions"] > prefix_ours["instructions"]
    path = Path(__file__).resolve().parents[2] / "scripts" / "extend_fidelity.py"
    spec = importlib.util.spec_from_file_location("extend_fidelity", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--cc", "90"]) == 0
    table = capsys.readouterr().out
    assert "sglang.extend" in table and "extend (dense mask)" in table and "prefix" in table
    for bad in ("sm90", "75", ""):
        assert script.main(["--cc", bad]) == 2 and "--cc takes" in capsys.readouterr().err


NINJA = ("Ninja build failed. Ninja output:\nninja: Entering directory `/root/.cache/flashinfer/x'\n[1/4] nvcc -c a.cu\n"
         "a.cu:17:10: fatal error: flashinfer/attention/mla.cuh: No such file or directory\ncompilation terminated.")


def test_a_failure_inside_an_engine_becomes_its_rows_one_line_reason_and_out_of_memory_stays_the_runners():
    def build():
        raise RuntimeError(NINJA)

    with pytest.raises(engines.EngineMissing) as e:
        engines.engine_call("flashinfer")(build)()
    reason = str(e.value)
    assert "\n" not in reason and reason.startswith("flashinfer ") and "build failed here: RuntimeError: Ninja build" \
        in reason and "fatal error: flashinfer/attention/mla.cuh: No such file" in reason

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        engines.engine_call("flashinfer")(out_of_memory)()


def test_an_engine_rows_setup_takes_the_case_params_its_setup_names():
    from verifybench.harness.measure.timing.runner import CaseSpec

    def setup(batch, tokens):
        return (lambda: batch * tokens), (lambda: (True, "ok")), None

    guarded = engines.engine_rows("flashinfer", setup)
    fn, check, _ = CaseSpec("x", {"batch": 2, "tokens": 3}, "graph", guarded).prepare()
    assert fn() == 6 and check() == (True, "ok")


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="the kernels need a GPU or the interpreter")
def test_an_engine_kernel_failing_at_its_first_call_skips_its_row_and_the_component_goes_on(monkeypatch, tmp_path):
    """A FlashInfer module that would not build once ended mla_verify at its first engine row, every row after it lost
    (2026-12-06); the engine's row is skipped with the reason now, ours still run."""
    import types

    from verifybench.harness.components import mla_verify

    sglang = _sglang()
    real = sglang.extend_module()

    def broken(*args, **kwargs):
        raise RuntimeError(NINJA)

    proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    proxy.extend_attention_fwd = broken
    monkeypatch.setattr(sglang, "extend_module", lambda: proxy)
    specs = [c for c in mla_verify.cases("tiny", 1, 32, tokens=(3,)) if c.params["tree"] == "chain"
             and c.params["variant"] in ("extend", "sglang.extend")]
    ran = {c.params["variant"]: c.run(max_time_s=0.01) for c in specs}
    assert ran["extend"].check_ok and not ran["extend"].skipped
    assert ran["sglang.extend"].skipped.startswith("the engine's rows: sglang ") and "its first calls failed here" \
        in ran["sglang.extend"].skipped and "mla.cuh: No such file" in ran["sglang.extend"].skipped


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
    # the MLA head SGLang serves (576 = 512 + 64, its split-rope path); at a 48-wide head this call ended in an illegal
    # address on an H100 (sglang 0.5.10.post1; not looked into further: no MLA model gives the kernel that shape)
    heads, kv_lora, rope, lens = 2, 512, 64, [37, 5]
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
def test_sglang_verify_rows_share_one_forward_metadata_across_the_rotated_layers(monkeypatch):
    """As SGLang's backend builds the page table, masks and offsets once per forward for all layers, mla_verify's
    engine rows build them once per case and every rotated cache (a layer) reads the same tensors: per-layer copies
    would make each call fetch a page table no earlier layer left in L2. Each layer's output still matches."""
    from verifybench.harness.components import mla_verify as component

    sglang = _sglang()
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(11)
    heads, kv_lora, rope, d, lens = 2, 512, 64, 3, [20, 9]
    starts = torch.tensor([0, lens[0] + d], dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    mask = torch.ones(d, d, dtype=torch.bool).tril().expand(2, d, d).contiguous().to(device)
    layers = [(torch.randn(heads, 2 * d, kv_lora + rope, generator=gen).to(dtype).to(device),
               torch.randn(sum(lens) + 2 * d, kv_lora + rope, generator=gen).to(dtype).to(device)) for _ in range(2)]
    given = []
    real = sglang.extend_verify

    def spy(*args, metadata=None, **kw):
        given.append(metadata)
        return real(*args, metadata=metadata, **kw)

    monkeypatch.setattr(sglang, "extend_verify", spy)
    call = component._calls("sglang.extend", None, False, starts, lens_t, mask, kv_lora, 0.125)
    for q, cache in layers:
        ref = mv.mla_verify_reference(q.float(), cache.float(), starts, lens_t, mask, kv_lora, 0.125)
        out = call(q, cache)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert len(given) == 2 and given[0] is not None and given[0] is given[1]


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

    from verifybench.harness.measure.host import fingerprint

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


# ---------------------------------------------------------------------------------------------------- MoE W4A16

def _sglang_moe():
    return _adapter("sglang", "moe_modules")


def _moe_weights(e=8, h=64, inter=32, seed=0):
    from verifybench.kernels.moe_int4 import reference as moe

    gen = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=gen) * 0.1, torch.randn(e, h, inter, generator=gen) * 0.1
    return (*moe.quantize_w4a16(w13), *moe.quantize_w4a16(w2))


def _sglang_moe_out(sglang, layers, x, tw, ids, group=32, flip_nibbles=False):
    w13p, w13s, w2p, w2s = layers
    e, two_i, _ = w13p.shape
    picked = sglang.moe_w4a16_config(x.shape[0], e, x.shape[1], two_i // 2, ids.shape[1], group)
    (w13, s13), (w2, s2) = sglang.w4a16_weights(w13p, w13s), sglang.w4a16_weights(w2p, w2s)
    if flip_nibbles:  # the high nibble first: what a wrong byte order would feed the kernel
        w13, w2 = ((w >> 4) | ((w & 0xF) << 4) for w in (w13, w2))
    return sglang.moe_w4a16(x, w13, s13, w2, s2, tw, ids, group, picked)()


def test_sglang_w4a16_layout_is_our_nibbles_low_first_and_sglangs_own_conversion():
    from verifybench.kernels.moe_int4 import reference as moe

    sglang = _sglang_moe()
    packed, scales, *_ = _moe_weights()
    engine, engine_scales = sglang.w4a16_weights(packed, scales)
    assert engine.dtype == torch.uint8 and engine.shape == (*packed.shape[:2], packed.shape[2] * 4)
    unpacked = torch.stack([engine & 0xF, engine >> 4], -1).flatten(-2).to(torch.int32)  # element 2j low, 2j+1 high
    assert torch.equal(unpacked, moe.unpack_nibbles(packed))
    assert engine_scales.shape == scales.shape
    # SGLang's own conversion, from the layout its loader stores a compressed-tensors checkpoint in (transposed)
    try:
        schemes = importlib.import_module(
            "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe")
    except Exception as e:  # its scheme module imports more than the kernels
        pytest.skip(f"SGLang's compressed-tensors MoE scheme cannot be imported here: {type(e).__name__}: {e}")
    layer = torch.nn.Module()
    for name, t in (("w13_weight_packed", packed), ("w2_weight_packed", packed),
                    ("w13_weight_scale", scales), ("w2_weight_scale", scales)):
        layer.register_parameter(name, torch.nn.Parameter(t.transpose(1, 2).contiguous(), requires_grad=False))
    method = schemes.CompressedTensorsWNA16TritonMoE
    method.process_weights_after_loading(object.__new__(method), layer)
    assert torch.equal(layer.w13_weight_packed, engine) and torch.equal(layer.w13_weight_scale, engine_scales)


def test_the_moe_adapter_mirrors_the_installed_sglang():
    sglang = _sglang_moe()
    assert engines.label("sglang") == sglang.MOE_MIRRORS, \
        "moe_w4a16 follows another SGLang's fused_experts_impl: check its calls against the installed one and rename"


def test_torch_block_alignment_keeps_sglangs_contract():
    sglang = _sglang_moe()
    # the example in SGLang's moe_align_block_size docstring (experts 1..4 of 5; expert 0 gets no pairs)
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_ids, expert_ids, post = sglang.align_block_size(ids, 4, 5)
    assert post.tolist() == [16] and post.dtype == torch.int32
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids[:4].tolist() == [1, 2, 3, 4] and (expert_ids[4:] == -1).all()
    gen = torch.Generator().manual_seed(3)
    for m, topk, e, block in ((1, 8, 384, 16), (8, 8, 384, 16), (5, 2, 16, 16), (32, 8, 16, 64), (7, 3, 4, 4)):
        ids = torch.rand(m, e, generator=gen).topk(topk, -1).indices.to(torch.int32)
        numel = m * topk
        sorted_ids, expert_ids, post = sglang.align_block_size(ids, block, e)
        cap = numel * block if numel < e + 1 else numel + (e + 1) * (block - 1)
        assert sorted_ids.shape == (cap,) and expert_ids.shape == (-(-cap // block),)
        total = int(post)
        assert total % block == 0 and (sorted_ids[total:] == numel).all()
        real = sorted_ids[:total][sorted_ids[:total] < numel]
        assert sorted(real.tolist()) == list(range(numel))  # every pair once
        for b in range(total // block):  # every block one expert's pairs, the padding after them
            chunk = sorted_ids[b * block:(b + 1) * block]
            pairs = chunk[chunk < numel].long()
            assert (ids.flatten()[pairs] == expert_ids[b]).all() and pairs.tolist() == sorted(pairs.tolist())
            assert torch.equal(chunk < numel, torch.arange(block) < len(pairs))
        counts = torch.bincount(ids.flatten().long(), minlength=e)
        assert total == int(((counts + block - 1) // block * block).sum())
        assert (expert_ids[total // block:] == -1).all()


def test_torch_block_alignment_reads_no_value_on_the_host_so_it_runs_in_a_cuda_graph():
    """On meta tensors (shapes, no values) every op whose output shape depends on the values (bincount, nonzero,
    repeat_interleave without output_size, boolean indexing) and every host read (item, int, bool) raises: a run
    there is one with fixed shapes and no sync, as a CUDA graph on the router's device-computed ids needs."""
    from verifybench.harness.engines import sglang

    for m, topk, e, block in ((1, 8, 384, 8), (8, 8, 384, 8), (64, 8, 384, 16), (3, 2, 16, 16)):
        ids = torch.zeros(m, topk, dtype=torch.int32, device="meta")
        got = sglang.align_block_size(ids, block, e)
        real = sglang.align_block_size(torch.zeros(m, topk, dtype=torch.int32), block, e)
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in real]
        assert got[0].shape == (sglang.align_capacity(m * topk, block, e),)


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="the kernels need a GPU or the interpreter")
@pytest.mark.parametrize("m,topk", [(1, 2), (3, 2), (2, 1), (3, 3)], ids=["m1", "m3", "topk1", "topk3"])
def test_sglang_w4a16_moe_called_as_fused_experts_matches_the_reference(m, topk):
    from verifybench.kernels.moe_int4 import reference as moe

    sglang = _sglang_moe()
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # bf16 arithmetic is wrong in the interpreter
    layers = tuple(w.to(device) for w in _moe_weights())
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(dtype).to(device)
    tw, ids = moe.route_uniform(m, 8, topk, seed=m + topk, device=device)
    ref = moe.reference_moe_w4a16(x.float(), *layers, tw, ids)
    out = _sglang_moe_out(sglang, layers, x, tw, ids)
    assert out.shape == ref.shape and out.dtype == dtype
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    if m == 3 and topk == 2:  # the check the component makes sees a wrong nibble order
        bad = _sglang_moe_out(sglang, layers, x, tw, ids, flip_nibbles=True)
        assert ((bad.float() - ref).norm() / ref.norm()).item() > 0.1


def test_the_moe_engine_row_is_skipped_in_one_line_without_sglang(monkeypatch):
    import importlib.util

    from verifybench.harness.components import moe_int4_engines
    from verifybench.harness.measure.timing.runner import CaseSkipped
    from verifybench.harness.model import presets

    real = importlib.util.find_spec
    monkeypatch.setattr(engines, "version", lambda engine: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    monkeypatch.setattr(moe_int4_engines.interpret, "active", lambda: True)
    with pytest.raises(CaseSkipped) as e:
        moe_int4_engines.setup(moe_int4_engines.SGLANG, presets.get("tiny", 1), 1, "cpu")
    assert str(e.value).startswith("the engine's rows: sglang is not installed") and "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8])
def test_sglang_w4a16_moe_at_the_kimi_tp8_shape_matches_the_reference(n):
    from verifybench.harness.components import moe_int4
    from verifybench.kernels.moe_int4 import reference as moe

    sglang = _sglang_moe()
    p = moe_int4.preset_shape("kimi-k2.5", 8)
    layers = moe_int4.int4_layers("kimi-k2.5", 8, "cuda", 1)[0]
    x = torch.randn(n, p.hidden, device="cuda").bfloat16()
    tw, ids = moe.route_uniform(n, p.experts, p.topk, seed=n, device="cuda")
    ref = moe.reference_moe_w4a16(x.float(), *layers, tw, ids)
    out = _sglang_moe_out(sglang, layers, x, tw, ids, group=p.expert_group_size)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
