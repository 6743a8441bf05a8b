"""MLA verify attention with a tree mask (kernels/mla_verify/): the reference against float64 dense attention, both
Triton variants against the reference (interpreter on CPU, fp16/fp32: bf16 arithmetic is wrong in the interpreter)
on chain and random trees, bool and bit-packed masks, empty and unequal prefixes, masked keys without effect, every
error path; on a GPU the Kimi-K2.5 TP8 shapes in bf16 and a CUDA-graph replay with new lengths and masks.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported (conftest too)

from verifybench.harness.measure.timing.runner import rel_error  # noqa: E402
from verifybench.kernels.mla_verify import api as mv  # noqa: E402
from verifybench.kernels.tree import api as tree  # noqa: E402
from verifybench.kernels.mla_verify.api import mla_verify, mla_verify_reference  # noqa: E402
from verifybench.kernels.tree.inputs import random_tree  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FAR = 1e4  # cache rows outside every request: a kernel that reads one gives inf / NaN or a large error
# fp32 dots run at tf32 precision on a GPU (Triton's default); the interpreter computes them in fp32
TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 5e-3 if torch.cuda.is_available() else 1e-4}
# split_kv at the tiny shapes: 3 splits of >= 16 keys in 16-key tiles, so the tree keys share the last split
SPLIT3 = {"num_splits": 3, "min_split_keys": 16, "block_keys": 16}


def _parents_mask(parents):
    """[D, D] bool: row i sees itself and its ancestors."""
    d = len(parents)
    mask = torch.zeros(d, d, dtype=torch.bool)
    for i in range(d):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def _masks(b, d, kind, g):
    if kind == "chain":  # causal: D - 1 draft tokens in a line
        return torch.ones(d, d, dtype=torch.bool).tril().expand(b, d, d).contiguous()
    return torch.stack([_parents_mask([-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, d)])
                        for _ in range(b)])


def _inputs(lens, d, dtype, *, heads=2, kv_lora=32, rope=8, kind="random", seed=0, index_dtype=torch.int64):
    """q, cache, starts, prefix_lens, bool mask for len(lens) requests laid out in the cache with FAR-filled gaps."""
    g = torch.Generator().manual_seed(seed)
    dk = kv_lora + rope
    starts, row = [], 3
    for length in lens:
        starts.append(row)
        row += length + d + 2
    cache = torch.full((row + 3, dk), FAR)
    for s, length in zip(starts, lens):
        cache[s:s + length + d] = torch.randn(length + d, dk, generator=g)
    q = torch.randn(heads, len(lens) * d, dk, generator=g)
    mask = _masks(len(lens), d, kind, g)
    idx = dict(dtype=index_dtype, device=DEV)
    return (q.to(dtype).to(DEV), cache.to(dtype).to(DEV), torch.tensor(starts, **idx), torch.tensor(lens, **idx),
            mask.to(DEV))


def _words(mask, dtype):
    """Bit-packed rows as build_tree's qlen_only_bitpacking writes them: little-endian, bit c = column c."""
    b, d, _ = mask.shape
    w = (mask.long().cpu() << torch.arange(d)).sum(-1).flatten()
    bits = torch.iinfo(dtype).bits
    if dtype.is_signed and bits < 64:
        w = torch.where(w >= 1 << (bits - 1), w - (1 << bits), w)
    return w.to(dtype).to(mask.device)


def _check(args, variant, config=None, kv_lora=32, scale=0.3, tol=None):
    q = args[0]
    out = mla_verify(*args, kv_lora, scale, variant=variant, config=config)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], kv_lora)
    ref = mla_verify_reference(*(a.float() if a.is_floating_point() else a for a in args), kv_lora, scale)
    err = rel_error(out.float(), ref)
    assert err <= (tol or TOL[q.dtype]), (variant, config, err)
    return out


VARIANT_CONFIGS = {"extend": None, "extend-16rows": {"block_rows": 16, "block_keys": 16},
                   "split_kv-1": {"num_splits": 1}, "split_kv-3": SPLIT3}


def _variant(name):
    return name.split("-")[0], VARIANT_CONFIGS[name]


# ---------------------------------------------------------------------------------------------------- reference

def test_reference_equals_float64_dense_attention_over_each_requests_rows():
    q, cache, starts, lens, mask = _inputs([5, 0, 12], 3, torch.float32)
    got = mla_verify_reference(q, cache, starts, lens, mask, 32, 0.25)
    assert got.shape == (2, 9, 32) and got.dtype == torch.float32
    for b, (s, length) in enumerate(zip(starts.tolist(), lens.tolist())):
        keys = cache[s:s + length + 3].double()
        vis = torch.cat([torch.ones(3, length, dtype=torch.bool, device=DEV), mask[b]], 1)
        scores = (q[:, 3 * b:3 * b + 3].double() @ keys.T * 0.25).masked_fill(~vis, float("-inf"))
        want = torch.softmax(scores, -1) @ keys[:, :32]
        assert rel_error(got[:, 3 * b:3 * b + 3], want) < 1e-6


# ---------------------------------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name", list(VARIANT_CONFIGS))
def test_kernels_match_reference_on_random_trees_with_unequal_prefixes(name, dtype):
    variant, config = _variant(name)
    _check(_inputs([0, 37, 70], 5, dtype, seed=len(name)), variant, config)


@pytest.mark.parametrize("name", list(VARIANT_CONFIGS))
def test_chain_mask_is_causal_attention_over_prefix_and_tree(name):
    variant, config = _variant(name)
    args = _inputs([45], 4, torch.float32, kind="chain", seed=1)
    out = _check(args, variant, config)
    # the chain's first token sees the prefix and itself only: plain attention over those rows
    q, cache, starts, lens, _ = args
    keys = cache[3:3 + 45 + 1]
    want = torch.softmax(q[:, :1] @ keys.T * 0.3, -1) @ keys[:, :32]
    assert rel_error(out[:, :1], want) <= TOL[torch.float32]


@pytest.mark.parametrize("name", ["extend", "split_kv-3"])
def test_prefix_length_zero_sees_only_the_tree(name):
    variant, config = _variant(name)
    _check(_inputs([0, 0], 6, torch.float16, seed=2), variant, config)
    _check(_inputs([0], 1, torch.float32, seed=3), variant, config)  # one key: o = its latent part
    args = _inputs([0], 1, torch.float32, seed=3)
    one = mla_verify(*args, 32, 0.3, variant=variant, config=config)[:, 0]
    assert rel_error(one, args[1][3, :32].expand_as(one)) <= TOL[torch.float32]


@pytest.mark.parametrize("name", ["extend", "split_kv-1", "split_kv-3"])
def test_bool_and_bitpacked_masks_from_build_tree_give_the_same_output(name):
    variant, config = _variant(name)
    inp = random_tree(2, 2, 3, 6, 100, seed=4, context=40, spread=30)  # topk 2, 3 steps, D 6: a branching tree
    masks = {mode: tree.build_tree(**inp, mask_mode=mode, backend="reference")[0]
             for mode in ("qlen_only", "qlen_only_bitpacking")}
    assert masks["qlen_only"].dtype == torch.bool and masks["qlen_only_bitpacking"].dtype == torch.uint8
    q, cache, starts, lens, _ = _inputs(inp["seq_lens"].tolist(), 6, torch.float16, seed=5)
    outs = [_check((q, cache, starts, lens, m.to(DEV)), variant, config) for m in masks.values()]
    outs.append(_check((q, cache, starts, lens, masks["qlen_only"].view(2, 6, 6).to(DEV)), variant, config))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("word", [torch.int16, torch.int32, torch.int64])
def test_wider_and_signed_mask_words_match_the_bool_mask(word):
    d = torch.iinfo(word).bits  # a chain of D = word bits: the last row's top bit set, a negative word
    args = _inputs([9], d, torch.float32, heads=1, kind="chain", seed=6)
    for variant, config in (("extend", None), ("split_kv", {"num_splits": 1})):  # no combine: 64 rows in one
        want = mla_verify(*args, 32, 0.3, variant=variant, config=config)
        words = _words(args[4], word)
        assert words[-1] < 0
        got = mla_verify(*args[:4], words.view(1, d), 32, 0.3, variant=variant, config=config)
        if DEV == "cuda":  # another mask type is another compile: its tf32 dots may sum in another order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["extend", "split_kv-3"])
def test_a_masked_out_tree_key_has_no_effect(name):
    variant, config = _variant(name)
    args = _inputs([20, 33], 5, torch.float32, kind="chain", seed=7)
    q, cache, starts, lens, mask = args
    before = mla_verify(*args, 32, 0.3, variant=variant, config=config)
    row = starts[1].item() + lens[1].item() + 3  # request 1's tree key 3: seen by its tokens 3 and 4 only
    cache[row] = torch.randn(cache.shape[1], generator=torch.Generator().manual_seed(8)).to(DEV) * 5
    after = mla_verify(*args, 32, 0.3, variant=variant, config=config)
    assert torch.equal(after[:, :8], before[:, :8])  # request 0 and tokens 0..2 of request 1
    assert not torch.allclose(after[:, 8:], before[:, 8:])
    _check(args, variant, config)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 / 0
@pytest.mark.parametrize("name", ["extend", "split_kv-3"])
def test_a_query_that_sees_no_key_gets_nan_like_the_reference(name):
    variant, config = _variant(name)
    q, cache, starts, lens, mask = _inputs([0, 10], 3, torch.float32, kind="chain", seed=9)
    mask[0, 1] = False  # request 0 (no prefix), token 1 sees nothing
    out = mla_verify(q, cache, starts, lens, mask, 32, 0.3, variant=variant, config=config)
    ref = mla_verify_reference(q, cache, starts, lens, mask, 32, 0.3)
    assert out[:, 1].isnan().all() and ref[:, 1].isnan().all()
    keep = torch.ones(6, dtype=torch.bool)
    keep[1] = False
    assert rel_error(out[:, keep], ref[:, keep]) <= TOL[torch.float32]


def test_split_kv_variants_many_rows_and_splits():
    # 4 heads x 8 tokens = 32 rows: two row blocks of 16 or one of 32; int32 indices; more splits than key tiles
    args = _inputs([40, 5], 8, torch.float16, heads=4, seed=10, index_dtype=torch.int32)
    for config in ({"num_splits": 6, "min_split_keys": 1, "block_keys": 16}, {"block_rows": 32, **SPLIT3}):
        _check(args, "split_kv", config)


def test_default_split_count_fills_the_sms_and_runs(monkeypatch):
    assert mv.default_num_splits(1, 32, 16, 132) == 132  # 2 row blocks x 132 = 2 programs per SM
    assert mv.default_num_splits(64, 32, 16, 132) == 3
    assert mv.default_num_splits(1, 8, 16, 10 ** 4) == mv.MAX_SPLITS
    monkeypatch.setattr(mv, "sm_count", lambda device: 3)  # 6 splits: few interpreted programs
    _check(_inputs([50, 0], 4, torch.float16, seed=11), "split_kv", {"min_split_keys": 16, "block_keys": 16})


def test_out_argument_and_strided_query_views():
    q, cache, starts, lens, mask = _inputs([30, 12], 4, torch.float16, heads=3, seed=12)
    want = mla_verify_reference(q.float(), cache.float(), starts, lens, mask, 32, 0.3)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # [heads, T, DK] view of a [T, heads, DK] buffer
    big = torch.zeros(3, 8, 48, dtype=torch.float16, device=DEV)
    out = big[:, :, 8:40]
    for variant, config in (("extend", None), ("split_kv", SPLIT3)):
        got = mla_verify(q_t, cache, starts, lens, mask, 32, 0.3, variant=variant, config=config, out=out)
        assert got is out and rel_error(out.float(), want) <= 1e-2
    assert not big[:, :, :8].any() and not big[:, :, 40:].any()


def test_bytes_moved_counts_keys_once_per_request_and_queries_and_outputs():
    # Kimi TP8, B = 2, D = 4, prefixes 4096 + 1000: (5096 + 8) key rows, 8 heads x 8 tokens of q and o
    assert mv.bytes_moved(8, 8, 5096, 4, 512, 64, 2) == ((5096 + 8) * 576 + 8 * 8 * (576 + 512)) * 2


# ---------------------------------------------------------------------------------------------------- errors

def _good():
    q, cache, starts, lens, mask = _inputs([5, 7], 3, torch.float16)
    return dict(q=q, cache=cache, starts=starts, prefix_lens=lens, mask=mask, kv_lora=32, scale=0.3)


BAD_INPUTS = {
    "q 2-D": ({"q": lambda a: a["q"][0]}, r"q must be a \[heads, T, DK\]"),
    "cache 3-D": ({"cache": lambda a: a["cache"][None]}, r"cache must be a \[rows, DK\]"),
    "cache width": ({"cache": lambda a: a["cache"][:, :32]}, "width DK = 40"),
    "dtypes differ": ({"cache": lambda a: a["cache"].float()}, "share a dtype"),
    "int q": ({"q": lambda a: a["q"].long(), "cache": lambda a: a["cache"].long()}, "share a dtype"),
    "devices differ": ({"cache": lambda a: a["cache"].to("meta")}, "one device"),
    "starts float": ({"starts": lambda a: a["starts"].float()}, "starts must be a 1-D int32/int64"),
    "starts a list": ({"starts": lambda a: [3, 13]}, "starts must be a 1-D int32/int64"),
    "lens 2-D": ({"prefix_lens": lambda a: a["prefix_lens"][None]}, "prefix_lens must be a 1-D"),
    "lens on meta": ({"prefix_lens": lambda a: a["prefix_lens"].to("meta")}, "prefix_lens must be on q's device"),
    "B mismatch": ({"prefix_lens": lambda a: a["prefix_lens"][:1]}, "one entry per request"),
    "T not B*D": ({"starts": lambda a: torch.tensor([3, 13, 20, 22], device=DEV),
                   "prefix_lens": lambda a: torch.tensor([5, 7, 1, 0], device=DEV)}, r"T = 6 tokens must be B \* D"),
    "D past 64": ({"q": lambda a: a["q"].repeat(1, 22, 1)}, "at most 64"),
    "mask wrong D": ({"mask": lambda a: a["mask"][:, :2, :2]}, r"\[B, D, D\] = \[2, 3, 3\]"),
    "mask float": ({"mask": lambda a: a["mask"].float()}, "bool or bit-packed words"),
    "words wrong count": ({"mask": lambda a: torch.zeros(5, dtype=torch.uint8, device=DEV)},
                          r"\[B \* D\] = \[6\]"),
    "words too narrow": ({"q": lambda a: a["q"].repeat(1, 3, 1),
                          "mask": lambda a: torch.zeros(18, dtype=torch.uint8, device=DEV)}, "holds 8 columns"),
    "mask not contiguous": ({"mask": lambda a: a["mask"].transpose(1, 2)}, "contiguous"),
    "kv_lora past DK": ({"kv_lora": lambda a: 41}, r"kv_lora must be an int in 1\.\.DK = 40"),
    "scale None": ({"scale": lambda a: None}, "scale must be a finite positive"),
    "scale nan": ({"scale": lambda a: float("nan")}, "scale must be a finite positive"),
    "negative prefix": ({"prefix_lens": lambda a: torch.tensor([-1, 7], device=DEV)}, "request 0:"),
    "rows past the cache": ({"starts": lambda a: a["starts"] + 6}, "request 1:.*<= 28"),
}
KERNEL_BAD_INPUTS = {
    "variant": ({"variant": lambda a: "flash"}, "variant must be one of"),
    "unknown key": ({"config": lambda a: {"BLOCK_N": 16}}, "unknown split_kv config key"),
    "num_splits on extend": ({"variant": lambda a: "extend", "config": lambda a: {"num_splits": 2}},
                             "unknown extend config key"),
    "block_rows 8": ({"config": lambda a: {"block_rows": 8}}, "power of two >= 16"),
    "num_splits 0": ({"config": lambda a: {"num_splits": 0}}, "num_splits must be"),
    "num_warps 3": ({"config": lambda a: {"num_warps": 3}}, "num_warps must be"),
    "q strided along DK": ({"q": lambda a: torch.cat([a["q"], a["q"]], -1)[..., ::2]}, "unit stride along DK"),
    "out wrong shape": ({"out": lambda a: torch.empty(2, 6, 40, dtype=torch.float16, device=DEV)}, "out must be"),
}


def _bad(changes):
    a = _good()
    for k, f in changes.items():
        a[k] = f(a)
    return a


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
@pytest.mark.parametrize("fn", [mla_verify_reference, mla_verify], ids=["reference", "kernel"])
def test_bad_input_raises_a_clear_value_error(case, fn):
    changes, match = BAD_INPUTS[case]
    if fn is mla_verify and DEV == "cuda" and match.startswith("request"):
        pytest.skip("index values live on the GPU: the kernel does not read them on the host (no sync)")
    with pytest.raises(ValueError, match=match):
        fn(**_bad(changes))


@pytest.mark.parametrize("case", list(KERNEL_BAD_INPUTS), ids=list(KERNEL_BAD_INPUTS))
def test_bad_kernel_arguments_raise_a_clear_value_error(case):
    changes, match = KERNEL_BAD_INPUTS[case]
    with pytest.raises(ValueError, match=match):
        mla_verify(**_bad(changes))


# ---------------------------------------------------------------------------------------------------- configs

def test_default_and_space_configs_are_valid_configs():
    for variant in mv.VARIANTS:
        assert mv.check_config(variant) == mv.DEFAULT_CONFIGS[variant]
        assert len(mv.CONFIG_SPACE[variant]) >= 4
        for cfg in mv.CONFIG_SPACE[variant]:
            assert set(cfg) == set(mv.TILE_KEYS) and mv.check_config(variant, cfg)
    for ns in mv.SPLIT_CHOICES:
        mv.check_config("split_kv", {"num_splits": ns})
    assert all(cfg in mv.CONFIG_SPACE["extend"] for cfg in mv.ENGINE_EXTEND_CONFIGS.values())
    assert mv.DEFAULT_CONFIGS["extend"] == mv.ENGINE_EXTEND_CONFIGS[120]


# The default configs' shared memory at sm_80 ... sm_120: test_architectures.py (one compile job for all kernels).

# extend's engine tiles, one compile per distinct (tiles, ptxas): 32 x 32 as on sm_120 (and sm_86/89), 32 x 64 as on
# sm_90 and, through the Blackwell ptxas, sm_100. Compiled without a GPU; the stack is what ptxas spilled to.
EXTEND_TILE_COMPILES = [(120, mv.ENGINE_EXTEND_CONFIGS[120]), (90, mv.ENGINE_EXTEND_CONFIGS[90]),
                        (100, mv.ENGINE_EXTEND_CONFIGS[100])]


@pytest.mark.parametrize("cc,cfg", EXTEND_TILE_COMPILES, ids=[f"sm{cc}" for cc, _ in EXTEND_TILE_COMPILES])
def test_extend_gets_the_registers_its_engine_tiles_need(cc, cfg):
    """With its tree loop bounded by a compile-time D, extend got 32-128 registers and 2-5 KB of stack at these tiles
    (SGLang's own kernel: 128-255 and under 1.5 KB) and ran 5x slower than the engine's kernel at 32 x 32 on an H100."""
    try:
        got = mv.compiled_resources("extend", cfg, cc)["_extend_kernel"]
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert got["stack_bytes"] <= 1024 and got["registers"] >= 128, got


# ---------------------------------------------------------------------------------------------------- GPU

KIMI_SCALE = 192 ** -0.5  # (qk_nope + qk_rope) ** -0.5


@pytest.mark.gpu
@pytest.mark.parametrize("variant", mv.VARIANTS)
def test_kimi_tp8_shapes_bf16_on_gpu_match_the_reference(variant):
    for lens, kind in (([4096], "chain"), ([4096, 1000, 0], "random")):
        args = _inputs(lens, 4, torch.bfloat16, heads=8, kv_lora=512, rope=64, kind=kind, seed=13)
        _check(args, variant, None, kv_lora=512, scale=KIMI_SCALE)
        words = _words(args[4], torch.uint8)
        _check(args[:4] + (words,), variant, None, kv_lora=512, scale=KIMI_SCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", mv.VARIANTS)
def test_cuda_graph_replays_with_new_lengths_starts_and_masks(variant):
    q, cache, starts, lens, mask = _inputs([4096, 300], 4, torch.bfloat16, heads=8, kv_lora=512, rope=64, seed=14)
    out = torch.empty(8, 8, 512, dtype=torch.bfloat16, device="cuda")
    mla_verify(q, cache, starts, lens, mask, 512, KIMI_SCALE, variant=variant, out=out)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_verify(q, cache, starts, lens, mask, 512, KIMI_SCALE, variant=variant, out=out)
    q2, cache2, starts2, lens2, mask2 = _inputs([100, 4000], 4, torch.bfloat16, heads=8, kv_lora=512, rope=64,
                                                kind="chain", seed=15)
    cache.zero_()[:cache2.shape[0]].copy_(cache2)
    for dst, src in ((q, q2), (starts, starts2), (lens, lens2), (mask, mask2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want = mla_verify_reference(q.float(), cache.float(), starts, lens, mask, 512, KIMI_SCALE)
    assert rel_error(out.float(), want) <= 1e-2


def test_the_page_table_of_a_size_is_built_once_and_never_replaced():
    """A graph captured with extend reads its page table at every replay: another cache size must not free it."""
    from verifybench.kernels.mla_verify.kernels_extend import identity_rows

    first = identity_rows(37, "cpu")
    assert torch.equal(first, torch.arange(37)) and first.dtype == torch.int64
    identity_rows(4096, "cpu")
    assert identity_rows(37, "cpu") is first and torch.equal(first, torch.arange(37))
