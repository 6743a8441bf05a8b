"""MLA glue kernels (kernels/mla_glue/): mla_prep, q_absorb and v_up against their fp32 torch references on fresh
random inputs (interpreter on CPU, fp16/fp32: bf16 arithmetic is wrong in the interpreter; bf16 at Kimi-K2.5 shapes,
CUDA-graph replay and PDL on GPU), strided views, cache rows left alone, every error path.
"""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported (conftest too)

from verifybench.harness.measure.timing.runner import rel_error  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = (torch.float16, torch.float32)
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-3}
TINY = dict(heads=4, q_lora=64, kv_lora=32, nope=16, rope=8, v_head=16)
KIMI = dict(heads=8, q_lora=1536, kv_lora=512, nope=128, rope=64, v_head=128)
KIMI_CONTEXT = 4096


@pytest.fixture(scope="module")
def mg():
    """kernels/mla_glue/ with its kernels interpreted on a CPU-only machine, even when another test module imported
    it before TRITON_INTERPRET was set (triton.jit decides at decoration time)."""
    module = importlib.import_module("verifybench.kernels.mla_glue.api")
    if not torch.cuda.is_available() and not module._INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
        module = importlib.reload(module)
    return module


def _qkv(n, q_lora, kv_lora, rope, dtype, device=DEV, pad=5):
    """qkv as a column slice of a wider buffer: row stride > width, row starts off alignment."""
    return (torch.randn(n, q_lora + kv_lora + rope + 2 * pad, device=device, dtype=dtype) * 3)[:, pad:-pad]


def _check_prep(mg, dtype, n, q_lora, kv_lora, rope, pos, rows, device=DEV, pdl=None):
    qkv = _qkv(n, q_lora, kv_lora, rope, dtype, device)
    q_ln = torch.rand(q_lora, device=device, dtype=dtype) + 0.5
    kv_ln = torch.rand(kv_lora, device=device, dtype=dtype) + 0.5
    cache = torch.randn(rows, kv_lora + rope, device=device, dtype=dtype)
    want_cache = cache.clone()
    want = mg.mla_prep_reference(qkv, q_ln, kv_ln, want_cache, pos, q_lora, kv_lora)
    q_a = mg.mla_prep(qkv, q_ln, kv_ln, cache, pos, q_lora, kv_lora, pdl=pdl)
    where = (n, q_lora, kv_lora, rope, pos)
    assert q_a.dtype == dtype and q_a.shape == (n, q_lora) and q_a.is_contiguous(), where
    assert rel_error(q_a, want) <= TOL[dtype], where
    slots = slice(pos, pos + n)
    assert rel_error(cache[slots, :kv_lora], want_cache[slots, :kv_lora]) <= TOL[dtype], where
    assert torch.equal(cache[slots, kv_lora:], qkv[:, q_lora + kv_lora:]), where  # rope: a plain copy
    assert torch.equal(cache[:pos], want_cache[:pos]) and torch.equal(cache[pos + n:], want_cache[pos + n:]), where


def _check_absorb(mg, qh, w_uk, rope, pdl=None):
    q = mg.q_absorb(qh, w_uk, rope, pdl=pdl)
    n, heads, width = qh.shape
    nope, kv_lora = w_uk.shape[1:]
    assert q.dtype == qh.dtype and q.shape == (heads, n, kv_lora + rope) and q.is_contiguous()
    assert rel_error(q, mg.q_absorb_reference(qh, w_uk, rope)) <= TOL[qh.dtype], (n, heads, nope, rope, kv_lora)
    assert torch.equal(q[:, :, kv_lora:], qh[:, :, nope:].transpose(0, 1))  # rope: a plain copy


def _check_v_up(mg, o_lat, w_uv, pdl=None):
    o = mg.v_up(o_lat, w_uv, pdl=pdl)
    heads, n, kv_lora = o_lat.shape
    assert o.dtype == o_lat.dtype and o.shape == (n, heads * w_uv.shape[2]) and o.is_contiguous()
    assert rel_error(o, mg.v_up_reference(o_lat, w_uv)) <= TOL[o_lat.dtype], (heads, n, kv_lora, w_uv.shape[2])


def _absorb_inputs(n, heads, nope, rope, kv_lora, dtype, device=DEV):
    """qh as the view of the q_b linear's [n, heads * (nope + rope)] output the forward passes."""
    lin = torch.randn(n, heads * (nope + rope), device=device, dtype=dtype)
    w_uk = torch.randn(heads, nope, kv_lora, device=device, dtype=dtype) / nope ** 0.5
    return lin.view(n, heads, nope + rope), w_uk


def _v_up_inputs(n, heads, kv_lora, v_head, dtype, device=DEV):
    o_lat = torch.randn(heads, n, kv_lora, device=device, dtype=dtype)
    return o_lat, torch.randn(heads, kv_lora, v_head, device=device, dtype=dtype) / kv_lora ** 0.5


# ---------------------------------------------------------------------------------------------------- interpreter

def test_cpu_runs_the_kernels_in_the_interpreter(mg):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    from triton.runtime.interpreter import InterpretedFunction

    assert mg._INTERPRET  # else kernel == reference trivially
    for kernel in (mg._mla_prep_kernel, mg._q_absorb_kernel, mg._v_up_kernel):
        assert isinstance(kernel, InterpretedFunction)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_mla_prep_matches_reference(mg, dtype):
    t = TINY
    for n in range(1, 9):
        _check_prep(mg, dtype, n, t["q_lora"], t["kv_lora"], t["rope"], pos=3 + n, rows=20)
    _check_prep(mg, dtype, 3, 48, 20, 5, pos=0, rows=3)  # widths off the power-of-2 blocks; the whole cache
    _check_prep(mg, dtype, 2, 16, 8, 0, pos=4, rows=6)  # no rope part, the last rows


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_q_absorb_matches_reference(mg, dtype):
    t = TINY
    for n in range(1, 9):
        _check_absorb(mg, *_absorb_inputs(n, t["heads"], t["nope"], t["rope"], t["kv_lora"], dtype), t["rope"])
    _check_absorb(mg, *_absorb_inputs(17, 3, 12, 4, 40, dtype), 4)  # two row blocks, masked K and column blocks
    _check_absorb(mg, *_absorb_inputs(2, 2, 16, 0, 32, dtype), 0)  # no rope part


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_q_absorb_reads_strided_views(mg, dtype):
    n, heads, nope, rope, kv_lora = 3, 4, 16, 8, 32
    w_uk = torch.randn(heads, nope, kv_lora, device=DEV, dtype=dtype)
    wide = torch.randn(n, heads * (nope + rope) + 10, device=DEV, dtype=dtype)
    _check_absorb(mg, wide[:, 7:7 + heads * (nope + rope)].view(n, heads, nope + rope), w_uk, rope)  # row stride
    by_head = torch.randn(heads, n, nope + rope, device=DEV, dtype=dtype)
    _check_absorb(mg, by_head.transpose(0, 1), w_uk, rope)  # head-major storage


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_v_up_matches_reference(mg, dtype):
    t = TINY
    for n in range(1, 9):
        _check_v_up(mg, *_v_up_inputs(n, t["heads"], t["kv_lora"], t["v_head"], dtype))
    _check_v_up(mg, *_v_up_inputs(17, 3, 20, 24, dtype))  # two row blocks, masked K and column blocks
    o_lat, w_uv = _v_up_inputs(3, 4, 32, 16, dtype)
    wide = torch.randn(3, 4, 40, device=DEV, dtype=dtype)  # token-major storage, padded rows
    _check_v_up(mg, wide[:, :, 3:35].transpose(0, 1), w_uv)


def test_empty_batches_give_empty_outputs(mg):
    t = TINY
    cache = torch.randn(6, t["kv_lora"] + t["rope"], device=DEV)
    before = cache.clone()
    q_a = mg.mla_prep(_qkv(0, t["q_lora"], t["kv_lora"], t["rope"], torch.float32), torch.ones(t["q_lora"], device=DEV),
                      torch.ones(t["kv_lora"], device=DEV), cache, 6, t["q_lora"], t["kv_lora"])
    assert q_a.shape == (0, t["q_lora"]) and torch.equal(cache, before)
    qh, w_uk = _absorb_inputs(0, t["heads"], t["nope"], t["rope"], t["kv_lora"], torch.float32)
    assert mg.q_absorb(qh, w_uk, t["rope"]).shape == (t["heads"], 0, t["kv_lora"] + t["rope"])
    o_lat, w_uv = _v_up_inputs(0, t["heads"], t["kv_lora"], t["v_head"], torch.float32)
    assert mg.v_up(o_lat, w_uv).shape == (0, t["heads"] * t["v_head"])


def test_cpu_tensors_without_the_interpreter_take_the_reference(mg, monkeypatch):
    monkeypatch.setattr(mg, "_INTERPRET", False)
    t = TINY
    qkv = _qkv(3, t["q_lora"], t["kv_lora"], t["rope"], torch.float32, "cpu")
    q_ln, kv_ln = torch.rand(t["q_lora"]), torch.rand(t["kv_lora"])
    cache = torch.randn(8, t["kv_lora"] + t["rope"])
    want_cache = cache.clone()
    want = mg.mla_prep_reference(qkv, q_ln, kv_ln, want_cache, 2, t["q_lora"], t["kv_lora"])
    assert torch.equal(mg.mla_prep(qkv, q_ln, kv_ln, cache, 2, t["q_lora"], t["kv_lora"]), want)
    assert torch.equal(cache, want_cache)
    qh, w_uk = _absorb_inputs(3, t["heads"], t["nope"], t["rope"], t["kv_lora"], torch.float32, "cpu")
    assert torch.equal(mg.q_absorb(qh, w_uk, t["rope"]), mg.q_absorb_reference(qh, w_uk, t["rope"]))
    o_lat, w_uv = _v_up_inputs(3, t["heads"], t["kv_lora"], t["v_head"], torch.float32, "cpu")
    assert torch.equal(mg.v_up(o_lat, w_uv), mg.v_up_reference(o_lat, w_uv))


def test_pdl_is_off_on_cpu_even_when_asked(mg):
    # the interpreter has no inline asm: pdl=True runs without it, with the same result
    assert mg._pdl_on(None, torch.empty(1)) is False and mg._pdl_on(True, torch.empty(1)) is False


def _error_cases(mg):
    f16 = torch.float16
    qkv, q_ln, kv_ln = torch.randn(2, 14), torch.ones(6), torch.ones(4)  # q_lora 6, kv_lora 4, rope 4
    cache = torch.randn(5, 8)

    def prep(qkv=qkv, q_ln=q_ln, kv_ln=kv_ln, cache=cache, pos=1, q_lora=6, kv_lora=4, **kw):
        return lambda: mg.mla_prep(qkv, q_ln, kv_ln, cache, pos, q_lora, kv_lora, **kw)

    qh, w_uk = torch.randn(2, 3, 20), torch.randn(3, 16, 8)  # nope 16, rope 4

    def absorb(qh=qh, w_uk=w_uk, rope=4, **kw):
        return lambda: mg.q_absorb(qh, w_uk, rope, **kw)

    o_lat, w_uv = torch.randn(3, 2, 8), torch.randn(3, 8, 16)

    def up(o_lat=o_lat, w_uv=w_uv, **kw):
        return lambda: mg.v_up(o_lat, w_uv, **kw)

    return [
        (prep(qkv=qkv.tolist()), "qkv must be a torch.Tensor"),
        (prep(qkv=qkv.double()), "qkv must be float16, bfloat16 or float32"),
        (prep(qkv=qkv[0]), r"qkv must be 2-D \[n, q_lora \+ kv_lora \+ rope\]"),
        (prep(qkv=torch.randn(14, 2).t()), "qkv needs last-dim stride 1"),
        (prep(qkv=torch.randn(2, 15)), r"qkv must be \[n, q_lora \+ kv_lora \+ rope\] = \[n, 14\]"),
        (prep(q_lora=0), "q_lora must be an int"),
        (prep(q_lora=6.0), "q_lora must be an int"),
        (prep(kv_lora=True), "kv_lora must be an int"),
        (prep(kv_lora=9), "cache must be \\[rows, kv_lora \\+ rope\\]"),
        (prep(cache=torch.randn(5, 8, 1)), "cache must be 2-D"),
        (prep(cache=torch.randn(8, 5).t()), "cache needs last-dim stride 1"),
        (prep(cache=cache.to(f16)), "cache must have qkv's dtype torch.float32"),
        (prep(cache=cache.to("meta")), "cache is on meta, qkv on cpu"),
        (prep(cache=torch.randn(1, 8).expand(5, 8)), "rows of cache overlap"),
        (prep(q_ln=torch.ones(7)), r"q_ln must be \[q_lora\] = \[6\]"),
        (prep(q_ln=torch.ones(12)[::2]), "q_ln needs last-dim stride 1"),
        (prep(q_ln=q_ln.to(torch.int32)), "q_ln must be float16"),
        (prep(kv_ln=torch.ones(4, 1)), "kv_ln must be 1-D"),
        (prep(kv_ln=kv_ln.to("meta")), "kv_ln is on meta"),
        (prep(pos=4), "pos must be an int with 0 <= pos and pos \\+ n <= cache rows"),
        (prep(pos=-1), "pos must be an int"),
        (prep(pos=1.0), "pos must be an int"),
        (prep(pdl=1), "pdl must be None, True or False"),
        (absorb(qh=torch.randn(2, 60)), r"qh must be 3-D \[n, heads, nope \+ rope\]"),
        (absorb(qh=qh.to(torch.int64)), "qh must be float16"),
        (absorb(qh=torch.randn(20, 3, 2).transpose(0, 2)), "qh needs last-dim stride 1"),
        (absorb(w_uk=w_uk[0]), r"w_uk must be 3-D \[heads, nope, kv_lora\]"),
        (absorb(w_uk=w_uk.to(f16)), "w_uk must have qh's dtype"),
        (absorb(w_uk=torch.randn(3, 32, 8)[:, ::2]), "w_uk must be contiguous"),
        (absorb(w_uk=w_uk.to("meta")), "w_uk is on meta"),
        (absorb(w_uk=torch.randn(2, 16, 8)), r"w_uk must be \[heads, nope, kv_lora\] = \[3, 16, 8\]"),
        (absorb(rope=5), r"w_uk must be \[heads, nope, kv_lora\] = \[3, 15, 8\]"),
        (absorb(rope=20), "rope must be an int in 0..19"),
        (absorb(rope=-1), "rope must be an int"),
        (absorb(qh=torch.randn(1, 1, 300), w_uk=torch.randn(1, 300, 8), rope=0), "nope in 1..256"),
        (absorb(qh=torch.randn(2, 3, 0), w_uk=torch.randn(3, 0, 8), rope=0), "nope in 1..256"),
        (absorb(w_uk=torch.randn(3, 16, 0)), "kv_lora >= 1"),
        (up(o_lat=torch.randn(6, 8)), r"o_lat must be 3-D \[heads, n, kv_lora\]"),
        (up(o_lat=o_lat.to(torch.int32)), "o_lat must be float16"),
        (up(o_lat=torch.randn(8, 2, 3).transpose(0, 2)), "o_lat needs last-dim stride 1"),
        (up(w_uv=w_uv.to(f16)), "w_uv must have o_lat's dtype"),
        (up(w_uv=torch.randn(3, 16, 16)[:, ::2]), "w_uv must be contiguous"),
        (up(w_uv=torch.randn(3, 9, 16)), r"w_uv must be \[heads, kv_lora, v_head\]"),
        (up(w_uv=torch.randn(2, 8, 16)), r"w_uv must be \[heads, kv_lora, v_head\]"),
        (up(w_uv=w_uv.to("meta")), "w_uv is on meta"),
        (up(o_lat=torch.randn(1, 1, 1025), w_uv=torch.randn(1, 1025, 4)), "kv_lora in 1..1024"),
        (up(w_uv=torch.randn(3, 8, 0)), "v_head >= 1"),
        (up(pdl="on"), "pdl must be None, True or False"),
    ]


def test_bad_inputs_raise_value_error(mg):
    for i, (call, match) in enumerate(_error_cases(mg)):
        with pytest.raises(ValueError, match=match):
            call()
            pytest.fail(f"case {i} did not raise")


# ---------------------------------------------------------------------------------------------------- GPU, Kimi shapes

GPU_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
GPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_ops_on_gpu_at_kimi_shapes(mg, dtype):
    torch.manual_seed(1)
    k = KIMI
    for n in GPU_ROWS:
        _check_prep(mg, dtype, n, k["q_lora"], k["kv_lora"], k["rope"], KIMI_CONTEXT, KIMI_CONTEXT + 16, "cuda")
        _check_absorb(mg, *_absorb_inputs(n, k["heads"], k["nope"], k["rope"], k["kv_lora"], dtype, "cuda"),
                      k["rope"])
        _check_v_up(mg, *_v_up_inputs(n, k["heads"], k["kv_lora"], k["v_head"], dtype, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", (False, True))
def test_ops_replay_in_a_cuda_graph(mg, pdl):
    """The three ops chained, each reading the one before's output (q_lora 1536 = 8 heads x 192, so q_a serves as qh;
    q's latent part as o_lat): with PDL a missing or misplaced gdc_wait reads the last replay's stale values."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    torch.manual_seed(5)
    k, n, bf = KIMI, 4, torch.bfloat16
    assert k["q_lora"] == k["heads"] * (k["nope"] + k["rope"])
    qkv = torch.empty(n, k["q_lora"] + k["kv_lora"] + k["rope"] + 64, device="cuda", dtype=bf)[:, :-64]
    q_ln = torch.rand(k["q_lora"], device="cuda", dtype=bf) + 0.5
    kv_ln = torch.rand(k["kv_lora"], device="cuda", dtype=bf) + 0.5
    cache = torch.randn(KIMI_CONTEXT + 8, k["kv_lora"] + k["rope"], device="cuda", dtype=bf)
    w_uk = torch.randn(k["heads"], k["nope"], k["kv_lora"], device="cuda", dtype=bf) / k["nope"] ** 0.5
    w_uv = torch.randn(k["heads"], k["kv_lora"], k["v_head"], device="cuda", dtype=bf) / k["kv_lora"] ** 0.5

    def step():
        q_a = mg.mla_prep(qkv, q_ln, kv_ln, cache, KIMI_CONTEXT, k["q_lora"], k["kv_lora"], pdl=pdl)
        q = mg.q_absorb(q_a.view(n, k["heads"], -1), w_uk, k["rope"], pdl=pdl)
        return q_a, q, mg.v_up(q[:, :, :k["kv_lora"]], w_uv, pdl=pdl)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_a, q, o = step()
    for _ in range(3):  # fresh inputs each replay, read through the captured addresses
        qkv.copy_(torch.randn_like(qkv) * 3)
        want_cache = cache.clone()
        want_q_a = mg.mla_prep_reference(qkv, q_ln, kv_ln, want_cache, KIMI_CONTEXT, k["q_lora"], k["kv_lora"])
        graph.replay()
        assert rel_error(q_a, want_q_a) <= 1e-2 and rel_error(cache, want_cache) <= 1e-2
        assert torch.equal(cache[:KIMI_CONTEXT], want_cache[:KIMI_CONTEXT])
        assert torch.equal(cache[KIMI_CONTEXT + n:], want_cache[KIMI_CONTEXT + n:])
        assert rel_error(q, mg.q_absorb_reference(q_a.view(n, k["heads"], -1), w_uk, k["rope"])) <= 1e-2
        assert rel_error(o, mg.v_up_reference(q[:, :, :k["kv_lora"]], w_uv)) <= 1e-2


def test_mla_prep_writes_each_request_after_its_own_prefix(mg):
    """B requests of D tokens: request b's rows at pos + b * stride (the batched verify forward's layout)."""
    q_lora, kv_lora, rope, b, d, pos, stride = 32, 64, 16, 3, 2, 5, 11
    qkv = _qkv(b * d, q_lora, kv_lora, rope, torch.float32)
    q_ln, kv_ln = torch.rand(q_lora, device=DEV) + 0.5, torch.rand(kv_lora, device=DEV) + 0.5
    cache = torch.randn(pos + b * stride, kv_lora + rope, device=DEV)
    want_cache = cache.clone()
    want = mg.mla_prep_reference(qkv, q_ln, kv_ln, want_cache, pos, q_lora, kv_lora, per_request=d,
                                 request_stride=stride)
    got = mg.mla_prep(qkv, q_ln, kv_ln, cache, pos, q_lora, kv_lora, per_request=d, request_stride=stride)
    assert rel_error(got, want) <= TOL[torch.float32] and rel_error(cache, want_cache) <= TOL[torch.float32]
    for r in range(b):  # each request's rope part copied to its own rows, nothing between them touched
        assert torch.equal(cache[pos + r * stride: pos + r * stride + d, kv_lora:], qkv[r * d: (r + 1) * d,
                                                                                         q_lora + kv_lora:])
    with pytest.raises(ValueError, match="per_request must divide n"):
        mg.mla_prep(qkv, q_ln, kv_ln, cache, pos, q_lora, kv_lora, per_request=4, request_stride=stride)
    with pytest.raises(ValueError, match="pos must be an int"):
        mg.mla_prep(qkv, q_ln, kv_ln, cache, pos + stride, q_lora, kv_lora, per_request=d, request_stride=stride)
