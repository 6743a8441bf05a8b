"""SGLang's Marlin MoE adapter (harness/engines/marlin.py) on CPU, against the installed SGLang 0.5.10.post1 where it
imports: our layout is the checkpoint's, SGLang's own loader step repacks it, and the adapter's GEMM calls are the ones
fused_marlin_moe makes (its body run on CPU with the CUDA-only calls recorded). The kernels need CUDA: the lead runs
scripts/marlin_check.py and `verifybench moe_int4` on a GPU."""
import importlib
import importlib.util
import inspect
import shutil
import subprocess
import types

import pytest
import torch

from verifybench.harness import engines
from verifybench.harness.measure.timing.runner import CaseSkipped
from verifybench.harness.engines import marlin
from verifybench.kernels.moe_int4 import reference as moe

E, H, INTER, TOPK, GROUP = 8, 256, 64, 2, 32
FUSED_MODULE = "sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe"


def _module(name: str):
    try:
        return engines.import_kernel_module("sglang", name)
    except engines.EngineMissing as e:
        pytest.skip(f"SGLang's {name} cannot be imported here: {e}")


def _layers(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.1, torch.randn(E, H, INTER, generator=gen) * 0.1
    return (*moe.quantize_w4a16(w13, GROUP), *moe.quantize_w4a16(w2, GROUP))


@pytest.fixture
def repack_calls(monkeypatch):
    """SGLang's scheme module with its JIT repack (CUDA) replaced by a recorder that returns zeros of the Marlin
    shape; marlin_layer allowed on CPU tensors. Yields the recorded (weight, perm, size_k, size_n, bits) calls."""
    scheme = _module(marlin.SCHEME_MODULE)
    calls = []

    def repack(b_q_weight, perm, size_k, size_n, num_bits):
        calls.append((b_q_weight.clone(), perm, size_k, size_n, num_bits))
        return torch.zeros(b_q_weight.shape[0], size_k // 16, size_n * num_bits // 2, dtype=b_q_weight.dtype)

    monkeypatch.setattr(scheme, "gptq_marlin_moe_repack", repack)
    monkeypatch.setattr(marlin, "_need_cuda", lambda t: None)
    return calls


# ---------------------------------------------------------------------------------------------------- layout

def test_our_packing_is_compressed_tensors_pack_quantized_and_the_loader_holds_it_transposed():
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError as e:
        pytest.skip(f"compressed-tensors is not importable here: {e}")
    packed, scales, *_ = _layers()
    q = (moe.unpack_nibbles(packed) - 8).to(torch.int8)  # the signed int4 values the checkpoint was made from
    assert torch.equal(pack_to_int32(q, 4), packed)  # a checkpoint's [N, K/8] per expert is ours
    w, s = marlin.checkpoint_layout(packed, scales)
    assert w.shape == (E, H // 8, 2 * INTER) and s.shape == (E, H // GROUP, 2 * INTER)
    assert torch.equal(w, packed.transpose(1, 2)) and w.is_contiguous() and s.is_contiguous()


def test_the_loaded_layer_is_what_sglangs_triton_conversion_turns_into_its_triton_layout():
    """The layout the loader leaves is what both of SGLang's methods start from: its Triton method's own conversion
    of loaded_layer gives the bytes the Triton adapter hands SGLang's Triton kernel (held there against the
    reference), so loaded_layer holds our weights as SGLang's loader does."""
    from verifybench.harness.engines import sglang

    scheme = _module(marlin.SCHEME_MODULE)
    layers = _layers()
    layer = marlin.loaded_layer(*layers, torch.bfloat16)
    method = scheme.CompressedTensorsWNA16TritonMoE
    method.process_weights_after_loading(object.__new__(method), layer)
    for name, packed, scales in (("w13", *layers[:2]), ("w2", *layers[2:])):
        engine, engine_scales = sglang.w4a16_weights(packed, scales)
        assert torch.equal(getattr(layer, f"{name}_weight_packed"), engine)
        assert torch.equal(getattr(layer, f"{name}_weight_scale"), engine_scales)


def test_checkpoint_layout_refuses_other_than_our_packed_layout():
    packed, scales, *_ = _layers()
    with pytest.raises(ValueError, match="int32"):
        marlin.checkpoint_layout(packed.float(), scales)
    with pytest.raises(ValueError, match="do not match"):
        marlin.checkpoint_layout(packed, scales[:, :3])


# ---------------------------------------------------------------------------------------------------- repack

def test_sglangs_loader_step_repacks_the_checkpoint_layout_and_permutes_the_scales_by_group(repack_calls):
    utils = _module("sglang.srt.layers.quantization.marlin_utils")
    layers = _layers()
    layer = marlin.marlin_layer(*layers, GROUP, torch.bfloat16)
    (w13, p13, k13, n13, b13), (w2, p2, k2, n2, b2) = repack_calls
    assert torch.equal(w13, layers[0].transpose(1, 2)) and torch.equal(w2, layers[2].transpose(1, 2))
    assert (k13, n13, b13, k2, n2, b2) == (H, 2 * INTER, 4, INTER, H, 4)
    assert p13.shape == (E, 0) and p2.shape == (E, 0)  # no act order: empty sort indices, as SGLang passes them
    assert layer.w13_weight_packed.shape == (E, H // 16, 2 * INTER * 2)
    assert layer.w2_weight_packed.shape == (E, INTER // 16, H * 2)
    # group 32 < K: the grouped permutation over each run of 64 scales (the "single" one is for channel-wise)
    perm = utils.get_scale_perms()[0]
    for name, scales in (("w13", layers[1]), ("w2", layers[3])):
        loaded = scales.transpose(1, 2).contiguous()
        got = getattr(layer, f"{name}_weight_scale")
        assert got.shape == loaded.shape and got.dtype == torch.bfloat16
        assert torch.equal(got.reshape(-1, 64), loaded.reshape(-1, 64)[:, perm])
    assert layer.w13_weight_g_idx.shape == (E, 0) and layer.w2_g_idx_sort_indices.shape == (E, 0)


@pytest.fixture
def sglang_allocates(monkeypatch):
    """SGLang's own loader step on CPU or meta tensors with only the repack kernel a no-op: gptq_marlin_moe_repack,
    its JIT wrapper and marlin_moe_permute_scales allocate every output as they do on a GPU, so the shapes are
    SGLang's."""
    gptq = _module("sglang.srt.layers.quantization.gptq")
    jit = _module(marlin.REPACK_MODULE)
    monkeypatch.setattr(gptq, "gptq_marlin_repack", jit.gptq_marlin_repack, raising=False)  # imported on CUDA only
    monkeypatch.setattr(jit, "_jit_gptq_marlin_repack_module",
                        lambda: types.SimpleNamespace(gptq_marlin_repack=lambda *args: None))
    monkeypatch.setattr(marlin, "_need_cuda", lambda t: None)


def _forward_experts(preset: str, tp: int, device="meta"):
    """One MoE layer's experts as the forward makes them (forward.py: w13p, w13s, w2p, w2s), on `device`."""
    from verifybench.harness.model import presets

    s = presets.get(preset, tp)
    e, h, i, g = s.experts, s.hidden, s.expert_intermediate, s.expert_group_size
    return (torch.empty(e, 2 * i, h // 8, dtype=torch.int32, device=device),
            torch.empty(e, 2 * i, h // g, dtype=torch.bfloat16, device=device),
            torch.empty(e, h, i // 8, dtype=torch.int32, device=device),
            torch.empty(e, h, i // g, dtype=torch.bfloat16, device=device)), g


@pytest.mark.parametrize("preset,tp", [("kimi-k2.5", 8), ("tiny", 1)])
def test_the_forwards_experts_viewed_for_marlin_have_the_shapes_sglangs_loader_step_makes(sglang_allocates, preset,
                                                                                         tp):
    ours, group = _forward_experts(preset, tp)
    repacked = marlin.marlin_layer(*ours, group, torch.bfloat16)  # SGLang's shapes for this layer
    view = marlin.forward_view(*ours)
    for name, t in vars(view).items():
        engine = getattr(repacked, name)
        assert t.shape == engine.shape and t.dtype == engine.dtype and t.is_contiguous(), name
    for mine, theirs in zip(ours, ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")):
        assert getattr(view, theirs).numel() == mine.numel()  # every element once: the same bytes
    if preset == "kimi-k2.5":  # H 7168, I 256 per rank, 384 experts, group 32
        assert view.w13_weight_packed.shape == (384, 448, 1024) and view.w2_weight_packed.shape == (384, 16, 14336)
        assert view.w13_weight_scale.shape == (384, 224, 512) and view.w2_weight_scale.shape == (384, 8, 7168)


def test_the_view_is_no_copy_and_refuses_what_marlin_cannot_tile():
    ours, _ = _forward_experts("tiny", 1, device="cpu")
    view = marlin.forward_view(*ours)
    for mine, theirs in zip(ours, ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")):
        assert getattr(view, theirs).data_ptr() == mine.data_ptr()
    w13p, w13s, w2p, w2s = ours
    with pytest.raises(ValueError, match="multiples of 16"):
        marlin.forward_view(w13p[:, :24], w13s[:, :24], w2p, w2s)  # I = 12
    with pytest.raises(RuntimeError):  # a strided tensor cannot be viewed: no silent copy
        marlin.forward_view(w13p.transpose(1, 2).contiguous().transpose(1, 2), w13s, w2p, w2s)


def test_the_check_layer_is_small_and_runs_the_forwards_block_size_m():
    assert marlin.check_experts(8, 8, 384) == 16  # one request at D = 8: 64 pairs, block_size_m 8 at 16 experts
    assert marlin.check_experts(64, 8, 384) == 72  # 8 requests at D = 8: the fewest with block_size_m 8
    for m in (1, 3, 8, 24, 64, 345):
        e = marlin.check_experts(m, 8, 384)
        assert 16 <= e <= 384 and marlin.block_size_m(m, 8, e) == marlin.block_size_m(m, 8, 384)
    assert marlin.check_experts(3, 2, 16) == 16  # the tiny preset: all its experts


# ---------------------------------------------------------------------------------------------------- the calls



@pytest.fixture
def fused_marlin_moe(monkeypatch):
    """SGLang's fused_marlin_moe as its source defines it, runnable on CPU: its module loaded afresh with
    register_custom_op a no-op (the registered op dispatches to CUDA only), the CUDA-only names it calls recorded
    or stood in for, device queries answered as an H100's. Yields (function, recorded calls)."""
    _module(FUSED_MODULE)
    custom_op = importlib.import_module("sglang.srt.utils.custom_op")
    monkeypatch.setattr(custom_op, "register_custom_op", lambda fn=None, **kw: fn if fn else (lambda f: f))
    spec = importlib.util.find_spec(FUSED_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a private copy: sys.modules keeps the registered one
    calls = {"gemm": [], "align": [], "scalar_type": []}
    gemm_module = _module(marlin.GEMM_MODULE)
    signature = inspect.signature(gemm_module.moe_wna16_marlin_gemm)

    def gemm(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        calls["gemm"].append(call)
        c = call["c_or_none"]
        return c.copy_(torch.arange(c.numel(), dtype=torch.float32).reshape(c.shape).sin())  # same on both sides

    def align(topk_ids, block_size, num_experts):
        from verifybench.harness.engines import sglang

        calls["align"].append(block_size)
        return sglang.align_block_size(topk_ids, block_size, num_experts)

    def scalar_type(num_bits, has_zp):
        calls["scalar_type"].append((num_bits, has_zp))
        return marlin.uint4b8()

    module.moe_wna16_marlin_gemm = gemm
    module.get_scalar_type = scalar_type
    module.silu_and_mul = lambda x, out: out.copy_(torch.nn.functional.silu(x[:, :x.shape[1] // 2])
                                                    * x[:, x.shape[1] // 2:])
    module.moe_sum_reduce = lambda x, out, scale: torch.sum(x, dim=1, out=out).mul_(scale)
    monkeypatch.setattr(importlib.import_module("sglang.srt.layers.moe.fused_moe_triton"), "moe_align_block_size",
                        align)
    monkeypatch.setattr(gemm_module, "moe_wna16_marlin_gemm", gemm)  # what the adapter calls
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    return module.fused_marlin_moe, calls


def test_block_size_m_is_the_one_fused_marlin_moe_picks(fused_marlin_moe):
    fused, calls = fused_marlin_moe
    k, n = 64, 32  # hidden and intermediate of a layer the recorded GEMM accepts at any size
    cases = {(1, 384, 8): 8, (8, 384, 8): 8, (345, 384, 8): 8, (346, 384, 8): 16, (64, 16, 2): 16,
             (200, 16, 4): 64, (1000, 8, 8): 64}
    for (m, e, topk), expected in cases.items():
        w1, w2 = torch.zeros(e, k // 16, 4 * n, dtype=torch.int32), torch.zeros(e, n // 16, 2 * k, dtype=torch.int32)
        s1, s2 = torch.ones(e, k // GROUP, 2 * n).bfloat16(), torch.ones(e, n // GROUP, k).bfloat16()
        tw, ids = moe.route_uniform(m, e, topk, seed=m)
        fused(torch.zeros(m, k).bfloat16(), w1, w2, s1, s2, torch.zeros(m, e), tw, ids, num_bits=4)
        assert calls["align"][-1] == marlin.block_size_m(m, topk, e) == expected, (m, e, topk)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_the_adapters_gemm_calls_are_the_ones_fused_marlin_moe_makes(repack_calls, fused_marlin_moe, m):
    fused, calls = fused_marlin_moe
    layer = marlin.marlin_layer(*_layers(), GROUP, torch.bfloat16)
    x = torch.randn(m, H).bfloat16()
    tw, ids = moe.route_uniform(m, E, TOPK, seed=m)
    fused(x, layer.w13_weight_packed, layer.w2_weight_packed, layer.w13_weight_scale, layer.w2_weight_scale,
          torch.zeros(m, E), tw, ids, g_idx1=layer.w13_weight_g_idx, g_idx2=layer.w2_weight_g_idx,
          sort_indices1=layer.w13_g_idx_sort_indices, sort_indices2=layer.w2_g_idx_sort_indices, num_bits=4,
          is_k_full=True)  # as CompressedTensorsWNA16MoE.apply_weights calls it (no expert map: plain TP)
    engine_calls, calls["gemm"] = calls["gemm"], []
    run = marlin.moe_marlin(x, layer, tw, ids)
    run()
    assert calls["align"] == [run.info["block_size_m"]] and calls["scalar_type"] == [(4, False), (4, False)]
    assert run.info["use_atomic_add"] is True  # capability 9: on, as fused_marlin_moe sets it
    assert len(calls["gemm"]) == len(engine_calls) == 2
    for ours, theirs in zip(calls["gemm"], engine_calls):
        assert ours.keys() == theirs.keys()
        for name, value in theirs.items():
            mine = ours[name]
            if isinstance(value, torch.Tensor):
                assert mine.shape == value.shape and mine.dtype == value.dtype, name
                if name != "c_or_none":  # SGLang's output buffers are uninitialised
                    assert torch.equal(mine, value), name
            elif name == "b_q_type":
                assert mine.id == value.id
            else:
                assert mine == value, name
    whole, calls["gemm"] = calls["gemm"], []
    gemms = run.gemms()  # marlin_check's split: each GEMM alone makes the call run() makes
    gemms["gate_up"](), gemms["down"]()
    for i, (alone, in_run) in enumerate(zip(calls["gemm"], whole)):
        intermediates = {"c_or_none", "workspace"} | ({"a"} if i else set())  # down's input: SiLU*up's output in run
        for name, value in in_run.items():
            if isinstance(value, torch.Tensor) and name not in intermediates:
                assert torch.equal(alone[name], value), name
            elif not isinstance(value, torch.Tensor):
                assert alone[name] == value or name == "b_q_type", name


def test_the_forwards_moe_makes_fused_marlin_moes_calls_on_its_own_weights_with_the_alignment_in_the_call(
        fused_marlin_moe, monkeypatch):
    """forward_moe over the forward's tensors: fused_marlin_moe (as apply_weights calls it) given the same views makes
    the same GEMM calls; the alignment is made inside the call, from the ids as they are when it runs."""
    fused, calls = fused_marlin_moe
    monkeypatch.setattr(marlin, "_need_cuda", lambda t: None)
    ours, _ = _forward_experts("tiny", 1, device="cpu")
    for t in ours:
        t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    m, e, topk, h = 3, ours[0].shape[0], 2, ours[2].shape[1]
    x = torch.randn(m, h).bfloat16()
    tw, ids = moe.route_uniform(m, e, topk, seed=m)
    view = marlin.forward_view(*ours)
    fused(x, view.w13_weight_packed, view.w2_weight_packed, view.w13_weight_scale, view.w2_weight_scale,
          torch.zeros(m, e), tw, ids, g_idx1=view.w13_weight_g_idx, g_idx2=view.w2_weight_g_idx,
          sort_indices1=view.w13_g_idx_sort_indices, sort_indices2=view.w2_g_idx_sort_indices, num_bits=4,
          is_k_full=True)
    engine_calls, calls["gemm"] = calls["gemm"], []
    marlin.forward_moe(x, *ours, tw, ids)
    assert len(calls["gemm"]) == len(engine_calls) == 2
    for mine, theirs in zip(calls["gemm"], engine_calls):
        for name, value in theirs.items():
            if isinstance(value, torch.Tensor) and name != "c_or_none":
                assert torch.equal(mine[name], value), name
        assert mine["b_q_weight"].data_ptr() in (ours[0].data_ptr(), ours[2].data_ptr())  # the forward's own bytes
    calls["gemm"] = []
    run = marlin.moe_marlin(x, view, tw, ids, align_in_call=True)
    from verifybench.harness.engines import sglang

    before = sglang.align_block_size(ids, run.info["block_size_m"], e)[0]
    ids.copy_(ids.flip(0))  # as the router writes the forward's ids after the call was built
    run()
    expected = sglang.align_block_size(ids, run.info["block_size_m"], e)[0]
    assert torch.equal(calls["gemm"][0]["sorted_token_ids"], expected) and not torch.equal(expected, before)
    assert run.info["alignment"] == "in the call"
    assert "alignment (ours, one launch) in the call" in marlin.describe(run.info)


def test_building_the_jit_kernels_says_so_first_and_on_cpu_is_engine_missing(monkeypatch, capsys):
    from verifybench.harness.measure.timing import runner

    if not torch.cuda.is_available():
        with pytest.raises(engines.EngineMissing, match="needs a CUDA GPU"):
            marlin.build(torch.bfloat16)
    built = []
    repack, gemm = _module(marlin.REPACK_MODULE), _module(marlin.GEMM_MODULE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner, "_SAID", set())
    monkeypatch.setattr(repack, "_jit_gptq_marlin_repack_module", lambda: built.append(capsys.readouterr().out))
    monkeypatch.setattr(gemm, "_jit_moe_wna16_marlin_module", lambda dtype: built.append(dtype))
    marlin.build(torch.bfloat16)
    assert built == [marlin.BUILD_LINE + "\n", torch.bfloat16]  # the line before the build starts

    def broken(dtype):
        raise RuntimeError("Ninja build failed. Ninja output:\nerror: nvcc not found")
    monkeypatch.setattr(gemm, "_jit_moe_wna16_marlin_module", broken)
    with pytest.raises(engines.EngineMissing) as e:
        marlin.build(torch.bfloat16)
    assert "\n" not in str(e.value) and "build failed here" in str(e.value) and "nvcc not found" in str(e.value)


def test_uint4b8_is_the_id_sglangs_header_computes(tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ here to compile SGLang's scalar_type.hpp")
    include = _module("sglang.jit_kernel.utils").KERNEL_PATH / "include"
    source = ("#include <tuple>\n#include <string>\n#include <utility>\n#include <type_traits>\n#include <cstdio>\n"
              '#include "sgl_kernel/scalar_type.hpp"\n'
              "int main() { std::printf(\"%lld\\n\", (long long)host::kU4B8.id()); }\n")
    exe = str(tmp_path / "scalar_type")
    built = subprocess.run([gxx, "-std=c++20", f"-I{include}", "-x", "c++", "-", "-o", exe], input=source,
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    assert int(subprocess.run([exe], capture_output=True, text=True).stdout) == marlin.uint4b8().id


# ---------------------------------------------------------------------------------------------------- rows

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU cases")
def test_the_marlin_row_is_skipped_on_cpu_in_one_line_naming_the_release_and_the_reason():
    from verifybench.harness.components import moe_int4

    spec = next(s for s in moe_int4.cases("tiny", 1, 64) if s.params["impl"] == "sglang.marlin")
    with pytest.raises(CaseSkipped) as e:
        spec.prepare()
    reason = str(e.value)
    assert "\n" not in reason and reason.startswith("the engine's rows: sglang")
    assert "needs a CUDA GPU" in reason and "nvcc" in reason


def test_the_adapter_on_cpu_tensors_is_engine_missing_in_one_line():
    packed, scales, w2p, w2s = _layers()
    with pytest.raises(engines.EngineMissing) as e:
        marlin.marlin_layer(packed, scales, w2p, w2s, GROUP, torch.float16)
    assert "\n" not in str(e.value) and marlin.CPU_REASON in str(e.value)


def test_the_marlin_adapter_mirrors_the_installed_sglang():
    _module(marlin.GEMM_MODULE)
    assert engines.label("sglang") == marlin.MARLIN_MIRRORS, \
        "moe_marlin follows another SGLang's fused_marlin_moe: check its calls against the installed one and rename"


def test_the_row_label_says_what_ran():
    label = marlin.describe({"block_size_m": 8, "use_atomic_add": True, "torch_ops": ["silu_and_mul",
                                                                                      "moe_sum_reduce"]})
    assert "Marlin MoE" in label and "block_size_m 8" in label and "atomic add on" in label
    assert "in torch: silu_and_mul, moe_sum_reduce" in label and engines.label("sglang") in label


def test_a_marlin_layer_is_repacked_once_per_run_and_each_input_built_once():
    from verifybench.harness.components import moe_int4_engines as rows

    made = {"layer": 0, "input": 0}

    def marlin_layer(*args):
        made["layer"] += 1
        return "marlin copy"

    def moe_marlin(x, layer, tw, ids):
        made["input"] += 1
        run = (lambda: x)
        run.info = {"block_size_m": 8, "use_atomic_add": True, "torch_ops": []}
        return run

    fake = types.SimpleNamespace(marlin_layer=marlin_layer, moe_marlin=moe_marlin, describe=marlin.describe)
    layer, x, tw, ids = _layers(), torch.zeros(1, H), torch.ones(1, TOPK), torch.zeros(1, TOPK, dtype=torch.int32)
    try:
        for _ in range(2):  # two cases of one run
            engine = rows.MarlinEngine(fake, GROUP)
            assert engine.call(layer, x, tw, ids) is x and engine.call(layer, x, tw, ids) is x
        assert made == {"layer": 1, "input": 2}
        assert engine.record["marlin"]["block_size_m"] == 8 and "Marlin MoE" in engine.record["engine_note"]
    finally:
        rows.release()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8])
def test_sglangs_marlin_moe_matches_the_reference_on_a_gpu(n):
    """The JIT kernels built with nvcc (minutes the first time; tvm-ffi caches them): scripts/marlin_check.py runs
    the same at the Kimi-K2.5 TP8 shape."""
    _module(marlin.GEMM_MODULE)
    e, h, inter, topk = 16, 1024, 256, 2
    gen = torch.Generator().manual_seed(n)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=gen) * 0.05, torch.randn(e, h, inter, generator=gen) * 0.05
    layers = tuple(t.cuda() for t in (*moe.quantize_w4a16(w13, GROUP), *moe.quantize_w4a16(w2, GROUP)))
    x = torch.randn(n, h, device="cuda").bfloat16()
    tw, ids = moe.route_uniform(n, e, topk, seed=n, device="cuda")
    run = marlin.moe_marlin(x, marlin.marlin_layer(*layers, GROUP, torch.bfloat16), tw, ids)
    ref = moe.reference_moe_w4a16(x.float(), *layers, tw, ids)
    out = run()
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()).item() <= marlin.TOLERANCE


@pytest.mark.gpu
def test_the_forwards_marlin_path_matches_the_reference_at_the_k25_tp8_layer_shape_on_a_gpu():
    """What the composition's check runs before a deployed cycle is timed: 16 experts at H 7168, I 256, top-8."""
    _module(marlin.GEMM_MODULE)
    ok, detail = marlin.check_against_reference(7168, 256, GROUP, 8, 384, (1, 3, 8), torch.bfloat16, "cuda")
    assert ok, detail
