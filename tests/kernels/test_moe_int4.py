"""INT4 W4A16 MoE: the checkpoint format round trip, the Triton kernel against the fp32 reference (interpreter on
CPU, fp16: bf16 arithmetic is wrong in the interpreter), every error path, routing helpers, byte counts, the bench.
"""
import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported (conftest too)

import early_jobs  # noqa: E402
from verifybench.harness.measure.results.store import WITHHELD  # noqa: E402
from verifybench.harness.measure.timing.runner import CaseSkipped, rel_error  # noqa: E402
from verifybench.kernels.moe_int4 import reference as moe  # noqa: E402
from verifybench.kernels.moe_int4 import kernels as mk  # noqa: E402
from verifybench.kernels.moe_int4 import configs as ms  # noqa: E402

E, H, I, TOPK = 8, 64, 32, 2
# few, large blocks: the interpreter's cost is per program
REPO = Path(__file__).resolve().parents[2]
SMALL_CFG = {"gate_up": {"BLOCK_N": 16, "num_warps": 1}, "down": {"BLOCK_N": 32, "ROW_ITERS": 2}}


@pytest.fixture(scope="module")
def mt():
    """kernels/moe_int4/api.py with its kernels interpreted on a CPU-only machine, even when another test module
    imported them before TRITON_INTERPRET was set (triton.jit decides at decoration time): then the family's modules
    are reloaded in place, bottom up, so mk and ms see the interpreted kernels too."""
    module = importlib.import_module("verifybench.kernels.moe_int4.api")
    if not torch.cuda.is_available():
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mk._gate_up_split_kernel, InterpretedFunction):
            os.environ["TRITON_INTERPRET"] = "1"
            for name in ("kernels_dequant", "kernels", "configs", "api"):
                importlib.reload(importlib.import_module(f"verifybench.kernels.moe_int4.{name}"))
    return module


@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    return (*moe.quantize_w4a16(w13), *moe.quantize_w4a16(w2))


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _on(dev, ws):
    return tuple(w.to(dev) for w in ws)


# ---------------------------------------------------------------------------------------------------- format

def test_quantize_round_trip_is_exact_for_values_on_the_int4_grid():
    torch.manual_seed(1)
    n, k, gs = 6, 128, 32
    q = torch.randint(-7, 8, (n, k // gs, gs))
    q[:, :, 0] = torch.where(torch.rand(n, k // gs) < 0.5, 7, -7)  # max |q| = 7 in every group
    s = (torch.rand(n, k // gs) + 0.1).to(torch.bfloat16)
    w = (q.float() * s.float().unsqueeze(-1)).reshape(n, k)
    packed, scales = moe.quantize_w4a16(w, gs)
    assert packed.dtype == torch.int32 and packed.shape == (n, k // 8)
    assert scales.dtype == torch.bfloat16 and scales.shape == (n, k // gs)
    assert torch.equal(scales, s)
    assert torch.equal(moe.dequantize_w4a16(packed, scales, gs), w)


def test_nibble_i_of_word_w_holds_q_of_k_8w_plus_i_plus_8():
    q = torch.tensor([[-8, -7, -1, 0, 1, 2, 6, 7, 3, -3, 5, -5, 0, 0, -8, 7]])
    packed = moe.pack_nibbles(q + 8)
    for w in range(2):
        word = packed[0, w].item() & 0xFFFFFFFF
        for i in range(8):
            assert (word >> (4 * i)) & 0xF == q[0, 8 * w + i].item() + 8
    assert torch.equal(moe.unpack_nibbles(packed), q + 8)
    scales = torch.ones(1, 1, dtype=torch.bfloat16)
    assert torch.equal(moe.dequantize_w4a16(packed, scales, 16), q.float())  # nibble 0 is -8, 15 is +7


def test_quantize_random_weights_error_is_int4_sized_and_zero_groups_stay_zero():
    w = torch.randn(16, 256)
    w[0, :32] = 0
    back = moe.dequantize_w4a16(*moe.quantize_w4a16(w))
    assert rel_error(back, w) < 0.15
    assert torch.equal(back[0, :32], torch.zeros(32))


def test_repack_planar_permutes_nibbles_only_within_groups(mt):
    torch.manual_seed(2)
    packed, _ = moe.quantize_w4a16(torch.randn(3, 5, 64))
    planar = mt.repack_planar(packed, 32)
    q, qp = moe.unpack_nibbles(packed), moe.unpack_nibbles(planar)
    for k in range(64):  # planar: nibble i of word w of a group holds k = 32 g + 4 i + w
        g, r = divmod(k, 32)
        w, i = r % 4, r // 4
        assert torch.equal(qp[..., 32 * g + 8 * w + i], q[..., k])


# ---------------------------------------------------------------------------------------------------- kernel

@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_fused_matches_reference_fp16(mt, weights, m):
    dev = _device()
    ws = _on(dev, weights)
    x = torch.randn(m, H, dtype=torch.float16, device=dev)
    tw, ids = moe.route_uniform(m, E, TOPK, seed=m, device=dev)
    ref = moe.reference_moe_w4a16(x.float(), *ws, tw, ids)
    out = mt.fused_moe_w4a16(x, *ws, tw, ids, config=SMALL_CFG)
    assert out.shape == (m, H) and out.dtype == torch.float16
    assert rel_error(out.float(), ref) <= 1e-2


def test_fused_with_skewed_routing_fp16_weights_and_int64_ids_matches_reference(mt, weights):
    dev = _device()
    ws = _on(dev, weights)
    x = torch.randn(3, H, dtype=torch.float16, device=dev)
    tw, ids = moe.route_skewed(3, E, TOPK, hot_experts=1, seed=7, device=dev)
    tw = tw.half()  # any float dtype for the routing weights; int64 ids
    out = mt.fused_moe_w4a16(x, *ws, tw, ids.long(), config=SMALL_CFG)
    assert rel_error(out.float(), moe.reference_moe_w4a16(x.float(), *ws, tw, ids)) <= 1e-2


def test_fused_shares_an_expert_between_tokens(mt, weights):
    dev = _device()
    ws = _on(dev, weights)
    x = torch.randn(4, H, dtype=torch.float16, device=dev)
    ids = torch.tensor([[3, 5], [5, 3], [3, 0], [7, 3]], dtype=torch.int32, device=dev)
    tw = torch.softmax(torch.randn(4, 2, device=dev), -1)
    out = mt.fused_moe_w4a16(x, *ws, tw, ids, config=SMALL_CFG)
    assert rel_error(out.float(), moe.reference_moe_w4a16(x.float(), *ws, tw, ids)) <= 1e-2


def test_planar_repack_is_cached_per_tensor_and_version(mt, weights):
    packed, scales = weights[0].clone(), weights[1]
    first, _ = mt.kernel_weights(packed, scales)
    again, _ = mt.kernel_weights(packed, scales)
    assert again is first
    packed.add_(0)  # an in-place update bumps the version: repacked again
    assert mt.kernel_weights(packed, scales)[0] is not first


def test_select_config_uses_default_off_table_and_largest_tuned_n_below_m(mt):
    table = {"cpu": {"dequant": "denormal",
                     "by_n": {"1": {"gate_up": {"BLOCK_N": 2, "num_warps": 1}, "down": {"BLOCK_N": 4}},
                              "4": {"gate_up": {"BLOCK_N": 8, "num_warps": 2}, "down": {"BLOCK_N": 16}}}}}
    cpu = torch.device("cpu")
    assert ms.select(3, cpu, {}) == (ms.default_config(cpu, 3), "default")
    assert ms.select_config(3, cpu, table)["gate_up"]["BLOCK_N"] == 2
    assert ms.select_config(9, cpu, table)["down"]["BLOCK_N"] == 16
    assert ms.select(3, cpu, table)[1] == "tuned"


def test_select_falls_back_to_the_default_when_the_tuned_entry_does_not_fit(mt, monkeypatch):
    table = {"cpu": {"by_n": {"1": {"gate_up": {"BLOCK_N": 2, "num_warps": 1}, "down": {"BLOCK_N": 4}}}}}
    monkeypatch.setattr(ms, "misfit", lambda cfg, device, shape=None: (300000, 101376))
    cfg, source = ms.select(1, torch.device("cpu"), table)
    assert cfg == ms.default_config("cpu", 1)
    assert source.startswith("default (") and "300000 B" in source and "101376 B" in source


def test_default_config_is_the_shipped_family_and_the_interpreter_gets_denormal(mt):
    """On a GPU: half2 as every shipped entry picks, no pdl (sm_90+ only), the blocking of the shipped n = 1, 2 and
    8 entries over 1, 2..6 and 7+ tokens; in the interpreter the same blocking with the dequant it can run."""
    table = ms.load_configs()
    assert {e.get("dequant") for gpu in table.values() for e in gpu["by_n"].values()} == {"half2"}
    by_n = table["NVIDIA H200"]["by_n"]
    for m, entry in {1: "1", 2: "2", 6: "2", 7: "8", 8: "8", 16: "8"}.items():
        cfg = ms.default_config("cpu", m)
        assert cfg["gate_up"] == by_n[entry]["gate_up"] and cfg["down"] == by_n[entry]["down"], m
        assert cfg["dequant"] == "denormal" and not cfg["pdl"]
    assert ms.DEFAULT_CONFIG["dequant"] == "half2" and not ms.DEFAULT_CONFIG["pdl"]
    assert ms.default_config("cpu") == {**ms.DEFAULT_CONFIG, "dequant": "denormal"}


def test_shipped_config_table_names_gpus_and_every_n(mt):
    table = ms.load_configs()
    for gpu, entry in table.items():
        assert {int(n) for n in entry["by_n"]} >= set(range(1, 9)), gpu
        for n, tuned in entry["by_n"].items():
            cfg = ms._entry_config(entry, tuned, ms.DEFAULT_CONFIG)
            assert "layout" not in entry and tuned.get("kernel", "split") == "split", (gpu, n)
            mk.check_config(cfg, ms.K25_TP8, torch.device("cpu"))


# Every selectable config's shared memory per architecture: test_architectures.py, with the other kernels'.


# ---------------------------------------------------------------------------------------------------- split kernel

# kernel "split": H = 64 is 8 words, 2 groups per gate_up row
SPLIT_CFGS = {
    "K1 prefetch, 2 chunks": {"gate_up": {"BLOCK_N": 16, "num_warps": 1, "SPLIT_K": 1,
                                                             "BLOCK_W": 4}, "down": {"BLOCK_N": 32, "ROW_ITERS": 2}},
    "K2 no prefetch": {"gate_up": {"BLOCK_N": 16, "num_warps": 1, "SPLIT_K": 2, "PREFETCH": 0},
                       "down": {"BLOCK_N": 64, "ROW_ITERS": 1}},
    "K2 masked rows and words, pdl": {"pdl": True,
                                      "gate_up": {"BLOCK_N": 64, "num_warps": 1, "SPLIT_K": 2, "BLOCK_W": 8},
                                      "down": {"BLOCK_N": 16, "ROW_ITERS": 4}},
}


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("name", list(SPLIT_CFGS))
def test_split_kernel_matches_reference_fp16(mt, weights, name, m):
    dev = _device()
    ws = _on(dev, weights)
    x = torch.randn(m, H, dtype=torch.float16, device=dev)
    tw, ids = moe.route_uniform(m, E, TOPK, seed=10 + m, device=dev)
    out = mt.fused_moe_w4a16(x, *ws, tw, ids, config=SPLIT_CFGS[name])
    assert out.shape == (m, H) and out.dtype == torch.float16
    assert rel_error(out.float(), moe.reference_moe_w4a16(x.float(), *ws, tw, ids)) <= 1e-2


def test_split_kernel_shares_experts_between_tokens(mt, weights):
    dev = _device()
    ws = _on(dev, weights)
    x = torch.randn(4, H, dtype=torch.float16, device=dev)
    ids = torch.tensor([[3, 5], [5, 3], [3, 0], [7, 3]], dtype=torch.int64, device=dev)
    tw = torch.softmax(torch.randn(4, 2, device=dev), -1).half()
    out = mt.fused_moe_w4a16(x, *ws, tw, ids, config=SPLIT_CFGS["K2 no prefetch"])
    assert rel_error(out.float(), moe.reference_moe_w4a16(x.float(), *ws, tw, ids)) <= 1e-2


@pytest.mark.parametrize("name", ["small", "K2 no prefetch"])
def test_prepacked_planar_weights_match_reference_without_caching(mt, weights, name):
    """bench_verify's call: planar weights given as they are (prepacked=True, check_ids=False)."""
    dev = _device()
    w13, s13, w2, s2 = _on(dev, weights)
    planar = (mt.repack_planar(w13, 32), s13, mt.repack_planar(w2, 32), s2)
    cfg = SMALL_CFG if name == "small" else SPLIT_CFGS[name]
    x = torch.randn(2, H, dtype=torch.float16, device=dev)
    tw, ids = moe.route_uniform(2, E, TOPK, seed=21, device=dev)
    cached = len(mt._CACHE)
    out = mt.fused_moe_w4a16(x, *planar, tw, ids, config=cfg, check_ids=False, prepacked=True)
    assert len(mt._CACHE) == cached
    assert rel_error(out.float(), moe.reference_moe_w4a16(x.float(), w13, s13, w2, s2, tw, ids)) <= 1e-2


_SPLIT = SPLIT_CFGS["K2 no prefetch"]
BAD_CONFIGS = {
    "SPLIT_K not dividing the groups": ({**_SPLIT, "gate_up": {**_SPLIT["gate_up"], "SPLIT_K": 3}}, "SPLIT_K must divide"),
    "SPLIT_K 0": ({**_SPLIT, "gate_up": {**_SPLIT["gate_up"], "SPLIT_K": 0}}, "SPLIT_K must divide"),
    "BLOCK_W below a group": ({**_SPLIT, "gate_up": {**_SPLIT["gate_up"], "BLOCK_W": 2}}, "BLOCK_W"),
    "BLOCK_W not a power of two": ({**_SPLIT, "gate_up": {**_SPLIT["gate_up"], "BLOCK_W": 12}}, "BLOCK_W"),
    "PREFETCH 2": ({**_SPLIT, "gate_up": {**_SPLIT["gate_up"], "PREFETCH": 2}}, "PREFETCH"),
    "gate_up BLOCK_N 3": ({**_SPLIT, "gate_up": {**_SPLIT["gate_up"], "BLOCK_N": 3}}, r"gate_up\.BLOCK_N"),
    "down BLOCK_N 0": ({**_SPLIT, "down": {"BLOCK_N": 0}}, r"down\.BLOCK_N"),
    "ROW_ITERS 0": ({**_SPLIT, "down": {"BLOCK_N": 16, "ROW_ITERS": 0}}, "ROW_ITERS"),
    "another kernel": ({**_SPLIT, "kernel": "v3"}, "kernel must be 'split'"),
    "checkpoint layout": ({**_SPLIT, "layout": "checkpoint"}, "layout must be 'planar'"),
    "unknown dequant": ({**_SPLIT, "dequant": "magic"}, "dequant must be"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_bad_config_raises_a_clear_value_error(mt, weights, case):
    config, match = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=match):
        mt.fused_moe_w4a16(*_args(_on(_device(), weights), dev=_device()), config=config)


def test_half2_refuses_other_group_sizes_and_the_interpreter(mt):
    torch.manual_seed(2)
    ws = (*moe.quantize_w4a16(torch.randn(E, 2 * I, H), 16), *moe.quantize_w4a16(torch.randn(E, H, I), 16))
    with pytest.raises(ValueError, match="group size 32"):
        mt.fused_moe_w4a16(*_args(_on(_device(), ws), dev=_device()), config={**_SPLIT, "dequant": "half2"})
    if not torch.cuda.is_available():  # inline PTX: no interpreter path, and no silent fallback either
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            mt.fused_moe_w4a16(*_args(weights_k32()), config={**_SPLIT, "dequant": "half2"})


def weights_k32():
    torch.manual_seed(0)
    return (*moe.quantize_w4a16(torch.randn(E, 2 * I, H) * 0.1), *moe.quantize_w4a16(torch.randn(E, H, I) * 0.1))


def test_select_config_passes_the_tuned_keys_per_n(mt):
    split = {"pdl": True, "gate_up": {"BLOCK_N": 8, "num_warps": 1, "SPLIT_K": 7},
             "down": {"BLOCK_N": 16, "ROW_ITERS": 1}, "us": 12.0, "by_space_us": {"split-denormal": 12.0}}
    table = {"cpu": {"dequant": "denormal",
                     "by_n": {"1": split, "4": {"gate_up": {"BLOCK_N": 4, "num_warps": 1}, "down": {"BLOCK_N": 8}}}}}
    cpu = torch.device("cpu")
    one = ms.select_config(1, cpu, table)
    assert one["pdl"] is True and one["gate_up"]["SPLIT_K"] == 7
    assert "us" not in one and "by_space_us" not in one
    assert one["dequant"] == "denormal"  # the table's own default
    assert ms.select_config(5, cpu, table)["pdl"] is False  # the default's
    table["cpu"]["by_n"]["1"] = {**split, "dequant": "half2"}
    assert ms.select_config(1, cpu, table)["dequant"] == "half2"  # a per-n dequant wins over the table's


# ---------------------------------------------------------------------------------------------------- errors

def _args(weights, m=2, dev="cpu"):
    x = torch.randn(m, H, dtype=torch.float16, device=dev)
    tw, ids = moe.route_uniform(max(m, 1), E, TOPK, seed=0, device=dev)
    return [x, *weights, tw[:m], ids[:m]]


def _bad(weights, index, value):
    a = _args(weights)
    a[index] = value(a[index]) if callable(value) else value
    return a


BAD_INPUTS = {
    "x int": (0, lambda x: x.to(torch.int32), TypeError, "x must be"),
    "x 1-D": (0, lambda x: x[0], ValueError, r"x must be \[M, H\]"),
    "M = 0": (0, lambda x: x[:0], ValueError, "M = 0"),
    "w13 not int32": (1, lambda w: w.float(), TypeError, "w13_packed must be int32"),
    "w13 wrong H": (1, lambda w: w[..., :-1], ValueError, "w13_packed must be"),
    "w13 scales fp16": (2, lambda s: s.half(), TypeError, "w13_scales must be bfloat16"),
    "w13 scales not dividing H": (2, lambda s: torch.cat([s, s[..., :1]], -1), ValueError, "w13_scales must be"),
    "w2 wrong shape": (3, lambda w: w[:, :-1], ValueError, "w2_packed must be"),
    "w2 scales wrong shape": (4, lambda s: s[:, :-1], ValueError, "w2_scales must be"),
    "ids float": (6, lambda i: i.float(), TypeError, "topk_ids must be int32 or int64"),
    "ids not [M, topk]": (6, lambda i: i[:1], ValueError, "topk_ids must be"),
    "weights shape": (5, lambda w: w[:, :1], ValueError, "topk_weights"),
    "weights int": (5, lambda w: w.to(torch.int32), TypeError, "topk_weights must be floating"),
    "id too large": (6, lambda i: torch.full_like(i, E), ValueError, "out of range"),
    "id negative": (6, lambda i: torch.full_like(i, -1), ValueError, "out of range"),
    "topk 0": (6, lambda i: i[:, :0], ValueError, r"topk >= 1, got shape \(2, 0\)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
@pytest.mark.parametrize("impl", ["reference", "fused"])
def test_bad_input_raises_a_clear_error(mt, weights, case, impl):
    index, value, exc, match = BAD_INPUTS[case]
    fn = moe.reference_moe_w4a16 if impl == "reference" else mt.fused_moe_w4a16
    with pytest.raises(exc, match=match):
        fn(*_bad(weights, index, value))


def test_fused_rejects_fp32_activations_and_reference_accepts_them(mt, weights):
    a = _args(weights)
    a[0] = a[0].float()
    with pytest.raises(TypeError, match="x must be"):
        mt.fused_moe_w4a16(*a)
    assert moe.reference_moe_w4a16(*a).dtype == torch.float32


@pytest.mark.parametrize("k,gs,match", [(48, 32, "does not divide"), (64, 12, "multiple of 8"),
                                        (64, 0, "multiple of 8")])
def test_quantize_rejects_group_sizes_that_do_not_fit(k, gs, match):
    with pytest.raises(ValueError, match=match):
        moe.quantize_w4a16(torch.randn(4, k), gs)


def test_quantize_and_dequantize_reject_wrong_types_and_shapes():
    with pytest.raises(TypeError):
        moe.quantize_w4a16(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        moe.quantize_w4a16(torch.randn(32))
    packed, scales = moe.quantize_w4a16(torch.randn(4, 64))
    with pytest.raises(ValueError, match="does not match"):
        moe.dequantize_w4a16(packed, scales[:, :1])
    with pytest.raises(TypeError, match="int32"):
        moe.dequantize_w4a16(packed.float(), scales)
    with pytest.raises(TypeError, match="bfloat16"):
        moe.dequantize_w4a16(packed, scales.float())


@pytest.mark.parametrize("magnitude, dtype", [(1e-40, torch.float32), (1e-39, torch.float32),
                                              (1e40, torch.float64)], ids=["zeroed", "subnormal", "above-max"])
def test_quantize_refuses_a_group_whose_scale_is_outside_bf16s_range(magnitude, dtype):
    w = torch.randn(4, 64, dtype=dtype)
    w[2, 32:] = magnitude * torch.linspace(-1, 1, 32, dtype=dtype)  # row 2's second group only
    with pytest.raises(ValueError, match=r"scale of group \(2, 1\) .* outside bf16's normal range .*; 1 group"):
        moe.quantize_w4a16(w)
    w[2, 32:] = 0.0  # an all-zero group is exact
    packed, scales = moe.quantize_w4a16(w)
    assert moe.dequantize_w4a16(packed, scales)[2, 32:].abs().max().item() == 0.0


# ---------------------------------------------------------------------------------------------------- routing, bytes

def test_uniform_routing_picks_distinct_in_range_experts_with_normalised_weights():
    tw, ids = moe.route_uniform(50, 16, 4, seed=3)
    assert ids.dtype == torch.int32 and ids.shape == (50, 4) and int(ids.min()) >= 0 and int(ids.max()) < 16
    assert all(len(set(row.tolist())) == 4 for row in ids)
    assert torch.allclose(tw.sum(-1), torch.ones(50))


def test_skewed_routing_concentrates_on_hot_experts():
    _, uniform = moe.route_uniform(8, 384, 8, seed=4)  # n = 8 tokens of K2.5: ~59 distinct experts
    _, skewed = moe.route_skewed(8, 384, 8, seed=4)
    assert torch.unique(skewed).numel() < 0.9 * torch.unique(uniform).numel()
    assert all(len(set(row.tolist())) == 8 for row in skewed)


@pytest.mark.parametrize("suffix", [".json", ".txt", ".pt", ".npy"])
def test_routing_trace_loads_every_format_and_checks_it(tmp_path, suffix):
    rows = [[0, 3], [2, 1], [3, 3], [1, 0]]
    path = tmp_path / f"trace{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"topk_ids": rows}))
    elif suffix == ".txt":
        path.write_text("# token routing\n" + "\n".join(" ".join(map(str, r)) for r in rows))
    elif suffix == ".pt":
        torch.save(torch.tensor(rows), path)
    else:
        import numpy as np

        np.save(path, np.array(rows))
    ids = moe.load_routing_trace(path, num_experts=4, topk=2)
    assert ids.dtype == torch.int32 and ids.tolist() == rows
    windows = moe.trace_windows(ids, 2, 3)
    assert len(windows) == 3 and windows[-1][1].tolist() == rows[2:]
    with pytest.raises(ValueError, match="outside"):
        moe.load_routing_trace(path, num_experts=3)
    with pytest.raises(ValueError, match="topk"):
        moe.load_routing_trace(path, topk=3)


def test_routing_trace_rejects_missing_and_ragged_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        moe.load_routing_trace(tmp_path / "missing.json")
    ragged = tmp_path / "ragged.json"
    ragged.write_text("[[1, 2], [3]]")
    with pytest.raises(ValueError, match="rectangular"):
        moe.load_routing_trace(ragged)


def test_bytes_count_distinct_experts_and_match_design_figures():
    assert moe.expert_bytes_int4(7168, 256) == 3_096_576  # DESIGN 4.3: 3.10 MB per K2.5 TP8 expert
    assert [round(moe.expected_distinct_experts(n, 384, 8), 1) for n in range(1, 9)] == \
        [8.0, 15.8, 23.5, 31.0, 38.4, 45.6, 52.6, 59.5]
    ids = torch.tensor([[1, 2], [2, 1], [5, 1]])
    b = moe.moe_bytes(ids, hidden=64, bytes_per_expert=1000, act_bytes=2)
    assert b["distinct_experts"] == 3 and b["weight_bytes"] == 3000
    assert b["bytes_moved"] == 3000 + 2 * 3 * 64 * 2 + 2 * 3 * 2 * 4
    assert moe.expert_bytes_bf16(7168, 256) / moe.expert_bytes_int4(7168, 256) == pytest.approx(3.56, abs=0.01)


def test_dense_torch_path_matches_reference_on_dequantized_weights(weights):
    x = torch.randn(5, H)
    tw, ids = moe.route_uniform(5, E, TOPK, seed=9)
    dense = (moe.dequantize_w4a16(weights[0], weights[1]), moe.dequantize_w4a16(weights[2], weights[3]))
    out = moe.moe_dense_torch(x, *dense, tw, ids)
    assert rel_error(out, moe.reference_moe_w4a16(x, *weights, tw, ids)) < 1e-5


# ---------------------------------------------------------------------------------------------------- bench

def test_bench_cases_for_tiny_check_on_cpu_and_build_tables():
    bench = importlib.import_module("verifybench.harness.components.moe_int4")
    specs = bench.cases("tiny", 1, 64) if not torch.cuda.is_available() else []
    skipped = [spec.run() for spec in specs if spec.params["impl"] == "triton"]
    assert all(case.skipped == bench.CPU_TRITON_SKIP for case in skipped)  # listed, with its reason, not run
    records = []
    for spec in (s for s in specs if s.params["impl"] != "triton"):
        try:
            fns, check, derive = spec.prepare()
        except CaseSkipped as e:  # an engine's row where the engine is absent (a fresh clone): skipped, said why
            assert "." in spec.params["impl"] and "the engine's rows" in str(e), f"{spec.name}: {e}"
            continue
        ok, detail = check()
        assert ok, f"{spec.name}: {detail}"
        assert isinstance(fns, list) and len(fns) >= bench.LAYERS
        fns[0]()
        records.append({"name": spec.name, "params": spec.params, "mode": spec.mode, "check": {"ok": True},
                        "summary": {"median_us": 10.0}, "derived": {"distinct_experts": 3, "bytes_moved": 1e6,
                                                                     "gbps": 100.0, "eta": 0.5, "floor_us": 2.0}})
    titles = [t for t, _ in bench.tables(records)]
    assert len(titles) == 2


def test_bench_cases_refuse_a_gpu_preset_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    bench = importlib.import_module("verifybench.harness.components.moe_int4")
    with pytest.raises(ValueError, match="needs a GPU"):
        bench.cases("kimi-k2.5", 8, 4096)


HALF2_CFGS = {  # fp16-pair dequant: prefetch or not, split-K, masked rows, row iterations, pdl
    "BN8 pf0": {"dequant": "half2", "gate_up": {"BLOCK_N": 8, "num_warps": 1, "PREFETCH": 0},
                "down": {"BLOCK_N": 16, "ROW_ITERS": 1}},
    "BN4 pf1 pdl": {"dequant": "half2", "pdl": True,
                    "gate_up": {"BLOCK_N": 4, "num_warps": 1, "PREFETCH": 1, "BLOCK_W": 128},
                    "down": {"BLOCK_N": 8, "ROW_ITERS": 4}},
    "BN2 2 warps w256": {"dequant": "half2", "pdl": True,
                         "gate_up": {"BLOCK_N": 2, "num_warps": 2, "PREFETCH": 1, "BLOCK_W": 256},
                         "down": {"BLOCK_N": 8, "ROW_ITERS": 8}},
    "BN16 K4": {"dequant": "half2", "gate_up": {"BLOCK_N": 16, "num_warps": 1, "SPLIT_K": 4,
                                                                   "PREFETCH": 0}, "down": {"BLOCK_N": 4}},
    "BN64 masked rows": {"dequant": "half2", "gate_up": {"BLOCK_N": 64, "num_warps": 4,
                                                                           "PREFETCH": 0}, "down": {"BLOCK_N": 16}},
}
# the intermediate size per case (default 256, K2.5 at TP8): 96 (Qwen3-30B-A3B at TP8) leaves the last 64-row block
# of gate_up half masked, and the down rows a group count (3) that is no power of two
HALF2_INTER = {"BN64 masked rows": 96}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(HALF2_CFGS))
def test_half2_dequant_on_gpu_matches_reference(mt, name):
    """The fp16-pair path (inline PTX, GPU only) on fresh random inputs: bf16 and fp16 activations, n = 1..8."""
    torch.manual_seed(6)
    inter = HALF2_INTER.get(name, 256)
    ws = tuple(w.cuda() for w in (*moe.quantize_w4a16(torch.randn(16, 2 * inter, 1024) * 0.05),
                                  *moe.quantize_w4a16(torch.randn(16, 1024, inter) * 0.05)))
    for m, dtype in ((1, torch.bfloat16), (3, torch.float16), (8, torch.bfloat16)):
        x = torch.randn(m, 1024, dtype=dtype, device="cuda")
        tw, ids = moe.route_uniform(m, 16, 4, seed=m, device="cuda")
        out = mt.fused_moe_w4a16(x, *ws, tw, ids, config=HALF2_CFGS[name])
        assert rel_error(out.float(), moe.reference_moe_w4a16(x.float(), *ws, tw, ids)) <= 1e-2, (m, dtype)


@pytest.mark.gpu
def test_fused_bf16_on_gpu_matches_reference(mt):
    torch.manual_seed(5)
    ws = tuple(w.cuda() for w in (*moe.quantize_w4a16(torch.randn(16, 512, 1024) * 0.05),
                                  *moe.quantize_w4a16(torch.randn(16, 1024, 256) * 0.05)))
    for m in (1, 4, 8, 32):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        tw, ids = moe.route_uniform(m, 16, 4, seed=m, device="cuda")
        out = mt.fused_moe_w4a16(x, *ws, tw, ids)
        assert rel_error(out.float(), moe.reference_moe_w4a16(x.float(), *ws, tw, ids)) <= 1e-2


def test_checkpoint_from_planar_inverts_the_repack():
    from verifybench.kernels.moe_int4.api import checkpoint_from_planar, repack_planar

    packed = torch.randint(-2**31, 2**31 - 1, (3, 5, 64 // 8), dtype=torch.int32)
    planar = repack_planar(packed, 32)
    assert not torch.equal(planar, packed)
    assert torch.equal(checkpoint_from_planar(planar, 32), packed)


# ---------------------------------------------------------------------------------------------------- tuner

def test_tuning_candidates_fit_the_k25_tp8_shapes():
    """Every GPU candidate passes check_config at K2.5 TP8 (a bad one would only be skipped on the H200)."""
    bench = importlib.import_module("verifybench.harness.tune.moe_int4")
    p = bench.preset_shape("kimi-k2.5", 8)
    assert bench.SPACES == ("split-denormal", "split-half2")
    jobs = []
    for base, gate_up, down in ms.TUNE_SPACES.values():
        for key, cands in (("gate_up", gate_up), ("down", down)):
            for c in cands:
                assert bench._valid({**base, key: c}, p), (key, c)
                assert bench._valid({**base, key: c, "pdl": True}, p)
        jobs += bench._prewarm_jobs(bench.TUNE_NS, gate_up, down, base)
    assert all(bench._valid(cfg, p) for _, cfg in jobs)
    assert {cfg["dequant"] for _, cfg in jobs} == {"denormal", "half2"}


def test_tune_that_measures_nothing_writes_no_table(mt, tmp_path, monkeypatch):
    """A cap reached while compiling must not replace this GPU's tuning with an empty entry (seen on an H200)."""
    if torch.cuda.is_available():
        pytest.skip("the dry run is the CPU path")
    bench = importlib.import_module("verifybench.harness.tune.moe_int4")
    monkeypatch.setattr(bench._Tuner, "out_of_time", lambda self: True)
    out, lines = tmp_path / "table.json", []
    with pytest.raises(RuntimeError, match="measured no n"):
        bench.tune("tiny", 1, (1,), out=str(out), jobs=0, log=lines.append)
    assert not out.exists() and lines[-1].startswith("nothing tuned: the 4.0 min cap was reached")


# The CPU dry run of the tuner (interpreted kernels: half a minute of CPU), in a process of its own started at
# collection; it prints its progress lines, then the table it returned.
_TUNE_DRY_RUN = ("import json, sys\nfrom verifybench.harness.tune import moe_int4 as bench\n"
                 "table = bench.tune('tiny', 1, (1,), out=sys.argv[1], jobs=0, log=print)\nprint(json.dumps(table))\n")


def _tune_dry_run_job():
    if torch.cuda.is_available():
        return None
    out = early_jobs.scratch("moe-tune") / "table.json"
    out.write_text(json.dumps({"Other GPU": {"by_n": {}}}))  # tuned before: kept
    env = {**early_jobs.ENVIRON, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return early_jobs.run([sys.executable, "-c", _TUNE_DRY_RUN, str(out)], 600, cwd=REPO, env=env), out


EARLY_JOBS = {"tune_dry_run": _tune_dry_run_job}  # started at collection (tests/early_jobs.py)


@pytest.fixture(scope="module")
def tune_dry_run():
    return early_jobs.job_result(f"{__name__}::tune_dry_run", _tune_dry_run_job)


def test_tune_dry_run_on_cpu_writes_a_table_select_config_can_use(mt, tune_dry_run):
    if torch.cuda.is_available():
        pytest.skip("the dry run is the CPU path")
    r, out = tune_dry_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    *lines, returned = r.stdout.splitlines()
    table = json.loads(returned)
    assert json.loads(out.read_text()) == table and set(table) == {"Other GPU", "cpu"}
    entry = table["cpu"]["by_n"]["1"]
    assert entry["dequant"] == "denormal" and set(entry["by_space_us"]) == {"split-denormal"}
    assert entry["default_us"] > 0  # the default config timed beside the winner
    assert any(line.startswith("[  1/") for line in lines)  # progress lines
    assert any("does not fit preset tiny" in line for line in lines)  # the invalid smoke candidate is left out
    assert lines[-1].startswith(f"wrote {out}")
    bench = importlib.import_module("verifybench.harness.tune.moe_int4")
    # the chosen config runs and matches the reference at the tiny shapes
    p = bench.preset_shape("tiny", 1)
    from verifybench.harness.components import moe_int4 as component

    ws = component.int4_layers("tiny", 1, "cpu", component.LAYERS)[0]
    x = torch.randn(1, p.hidden, dtype=torch.float16)
    tw, ids = moe.route_uniform(1, p.experts, p.topk, seed=3)
    cfg = ms.select_config(1, torch.device("cpu"), table)
    out_t = mt.fused_moe_w4a16(x, *ws, tw, ids, config=cfg)
    assert rel_error(out_t.float(), moe.reference_moe_w4a16(x.float(), *ws, tw, ids)) <= 1e-2


def test_prewarm_compiles_in_a_spawned_process(mt):
    if torch.cuda.is_available():
        pytest.skip("the CPU path of the prewarm")
    bench = importlib.import_module("verifybench.harness.tune.moe_int4")
    cfg = {**ms.TUNE_SPACES["split-denormal"][0], **{k: bench.SMOKE[k][0] for k in ("gate_up", "down")}}
    assert bench._prewarm_worker("tiny", 1, [(1, cfg)]) == []
    bad = {**cfg, "gate_up": {**cfg["gate_up"], "SPLIT_K": 3}}
    assert "SPLIT_K" in bench._prewarm_worker("tiny", 1, [(1, bad)])[0]
    assert bench._prewarm_worker("tiny", 1, [(1, bad)], deadline_epoch=0.0) == []  # past its limit: compiles none
    lines = []
    assert bench._prewarm("tiny", 1, [(1, cfg)], 1, lines.append) is True  # pdl probe: no-op without CUDA
    assert lines and lines[0].startswith("prewarmed 1 (n, config) calls in 1 processes"), lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU cases' own params")
def test_moe_side_by_side_title_names_the_dense_weights_and_device_that_ran():
    from pathlib import Path

    from verifybench.harness.measure.results import store

    bench = importlib.import_module("verifybench.harness.components.moe_int4")
    cpu = [{"name": s.name, "params": s.params, "mode": s.mode, "device": "cpu", "check": {"ok": True},
            "summary": {"median_us": 10.0}, "derived": {"bytes_moved": 1e6, "gbps": 1.0, "eta": 0.1, "floor_us": 1.0}}
           for s in bench.cases("tiny", 1, 64) if s.params["impl"] == "torch-dense"]
    assert bench.tables(cpu)[1][0].endswith("dense = plain torch, float32 weights on CPU)")
    h200 = Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1/moe_int4.json"
    assert bench.tables(store.load_run(h200)["cases"])[1][0].endswith("bfloat16 weights on GPU)")


def test_moe_side_by_side_sets_ours_beside_sglangs_marlin_and_names_what_ran():
    from verifybench.harness.engines import marlin

    bench = importlib.import_module("verifybench.harness.components.moe_int4")
    note = marlin.describe({"block_size_m": 8, "use_atomic_add": True, "torch_ops": ["silu_and_mul",
                                                                                     "moe_sum_reduce"]})
    derived = {"distinct_experts": 8, "bytes_moved": 1e7, "gbps": 1000.0, "eta": 0.5, "floor_us": 5.0}

    def record(impl, us, **extra):
        params = {"preset": "kimi-k2.5", "tp": 8, "impl": impl, "tokens": 1, "routing": "uniform", "device": "cuda"}
        return {"name": f"moe/kimi-k2.5-tp8/{impl}/n1/uniform", "params": params, "mode": "graph", "device": "cuda",
                "check": {"ok": True}, "summary": {"median_us": us}, "derived": {**derived, **extra}}

    records = [record("triton", 20.0), record(bench.MARLIN, 40.0, kernel="sglang 0.5.10.post1", engine_note=note)]
    (_, per_case), (title, side) = bench.tables(records)
    assert [r["case"] for r in per_case] == [r["name"] for r in records]
    assert side[0]["marlin_us"] == 40.0 and side[0]["triton/marlin"] == pytest.approx(0.5)
    assert f"marlin = {note}" in title and "block_size_m 8" in title


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter at the tiny preset")
def test_our_moe_case_carries_its_floors_and_the_table_names_its_bound(mt, monkeypatch):
    """Our kernel's case end to end at the tiny preset with large tiles given (the default's many small programs take
    minutes in the interpreter): its latency floor is empty kernels of its two launches' grids."""
    bench = importlib.import_module("verifybench.harness.components.moe_int4")
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.05")
    big = {"gate_up": {"BLOCK_N": 64, "num_warps": 1}, "down": {"BLOCK_N": 64, "ROW_ITERS": 4}}
    try:
        rec = bench.make_case("tiny", 1, "triton", 1, "uniform", "cpu", "graph", {}, config=big).run().as_dict()
    finally:
        bench.release()
    assert rec["check"]["ok"], rec["check"]
    d = rec["derived"]
    # one program per (pair, 128 gate_up rows / 64); one per (token, 256 rows of H / (64 x 4))
    assert [one["grid"] for one in d["latency_floor_launches"]] == [[2 * 2], [1]]
    assert d["bound"] == ("memory" if d["floor_us"] >= d["latency_floor_us"] else "latency")
    assert d["x_floor"] == pytest.approx(rec["summary"]["median_us"] / max(d["floor_us"], d["latency_floor_us"]))
    title, [near] = bench.tables([rec])[-1]
    assert title.startswith("INT4 MoE layer, our kernel, near the limit")
    assert near["grids"] == "4+1" and near["bound"] == WITHHELD and near["us"] == rec["summary"]["median_us"]
    [gpu] = bench.tables([{**rec, "device": "cuda"}])[-1][1]
    assert (gpu["bound"], gpu["x_floor"], gpu["lat_floor_us"]) == (d["bound"], d["x_floor"], d["latency_floor_us"])
