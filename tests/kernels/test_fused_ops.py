"""Fused verify-forward ops (kernels/fused_ops/): each Triton kernel against its fp32 torch reference on fresh
random inputs (interpreter on CPU, fp16/fp32: bf16 arithmetic is wrong in the interpreter; bf16 at Kimi-K2.5 shapes
and CUDA-graph capture on GPU), strided views, the in-place residual update, every error path.
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


@pytest.fixture(scope="module")
def fo():
    """kernels/fused_ops/ with its kernels interpreted on a CPU-only machine, even when another test module imported
    it before TRITON_INTERPRET was set (triton.jit decides at decoration time)."""
    module = importlib.import_module("verifybench.kernels.fused_ops.api")
    if not torch.cuda.is_available() and not module._INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
        module = importlib.reload(module)
    return module


def _distinct_logits(n, experts, dtype, device=DEV, step=0.125):
    """Rows of distinct values on a grid exact in fp16/bf16 (|v| <= 2^8 * step): no ties, no near-ties."""
    rows = [(torch.randperm(experts) - experts // 2 + torch.randint(-8, 8, ())) * step for _ in range(n)]
    return torch.stack(rows).to(device=device, dtype=dtype)


def _check_topk(fo, logits, k):
    w, ids = fo.softmax_topk(logits, k)
    w_ref, ids_ref = fo.softmax_topk_reference(logits, k)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (logits.shape[0], k)
    assert torch.equal(ids, ids_ref)
    assert (w - w_ref).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------------------------- interpreter

def test_cpu_runs_the_kernels_in_the_interpreter(fo):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    from triton.runtime.interpreter import InterpretedFunction

    assert fo._INTERPRET and isinstance(fo._rmsnorm_kernel, InterpretedFunction)  # else kernel == reference trivially


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rmsnorm_matches_reference(fo, dtype):
    for n, hidden in ((1, 64), (3, 48), (2, 1)):
        x = torch.randn(n, hidden, device=DEV, dtype=dtype) * 3
        w = torch.randn(hidden, device=DEV, dtype=dtype)
        y = fo.rmsnorm(x, w)
        assert y.dtype == dtype and y.shape == (n, hidden)
        assert rel_error(y, fo.rmsnorm_reference(x, w)) <= TOL[dtype]


def test_rmsnorm_reference_is_the_verify_forwards_unfused_norm(fo):
    from verifybench.harness.model.forward import _rmsnorm

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, w = torch.randn(4, 96, dtype=dtype), torch.randn(96, dtype=dtype)
        assert torch.equal(fo.rmsnorm_reference(x, w), _rmsnorm(x, w))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rmsnorm_reads_column_slices_and_writes_in_place(fo, dtype):
    wide = torch.randn(3, 56, device=DEV, dtype=dtype)  # as kv_a [n, 512 + 64]: norm the first columns only
    before = wide.clone()
    w = torch.randn(40, device=DEV, dtype=dtype)
    for cols in (slice(0, 40), slice(5, 45)):  # second: a row start off 16-byte alignment
        y = fo.rmsnorm(wide[:, cols], w)
        assert rel_error(y, fo.rmsnorm_reference(before[:, cols], w)) <= TOL[dtype]
    assert torch.equal(wide, before)
    y = fo.rmsnorm(wide[:, :40], w, out=wide[:, :40])
    assert y.data_ptr() == wide.data_ptr()
    assert rel_error(wide[:, :40], fo.rmsnorm_reference(before[:, :40], w)) <= TOL[dtype]
    assert torch.equal(wide[:, 40:], before[:, 40:])  # the rope columns stay


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_add_rmsnorm_updates_h_in_place_and_matches_reference(fo, dtype):
    for n, hidden, delta_dtype in ((1, 64, dtype), (4, 48, torch.float32), (2, 32, torch.float16)):
        wide = torch.randn(n, hidden + 8, device=DEV, dtype=dtype)
        h = wide[:, 8:]  # a strided residual view
        delta = torch.randn(n, hidden, device=DEV, dtype=delta_dtype)
        w = torch.randn(hidden, device=DEV, dtype=dtype)
        h_ref, delta_before, head = h.clone(), delta.clone(), wide[:, :8].clone()
        y_ref = fo.add_rmsnorm_reference(h_ref, delta, w)
        y = fo.add_rmsnorm(h, delta, w)
        assert torch.equal(h, h_ref)  # the same fp32 sum, rounded once to h's dtype
        assert rel_error(y, y_ref) <= TOL[dtype]
        assert torch.equal(delta, delta_before) and torch.equal(wide[:, :8], head)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_softmax_topk_matches_reference_on_distinct_logits(fo, dtype):
    for n, experts, k in ((1, 40, 8), (5, 64, 3), (2, 9, 9), (3, 16, 1)):
        _check_topk(fo, _distinct_logits(n, experts, dtype), k)
    wide = _distinct_logits(3, 48, dtype)
    _check_topk(fo, wide[:, 8:], 4)  # strided rows


def test_softmax_topk_breaks_ties_by_lower_index(fo):
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]], device=DEV)
    w, ids = fo.softmax_topk(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]
    assert torch.allclose(w[1], torch.full((4,), 0.2, device=DEV))


def test_softmax_topk_ids_stay_in_range_for_nan_logits(fo):
    logits = torch.randn(2, 12, device=DEV)
    logits[0, 3] = float("nan")
    _, ids = fo.softmax_topk(logits, 5)
    assert ((ids >= 0) & (ids < 12)).all() and all(len(set(r)) == 5 for r in ids.tolist())


def test_empty_batches_give_empty_outputs(fo):
    x, w = torch.empty(0, 16, device=DEV), torch.ones(16, device=DEV)
    assert fo.rmsnorm(x, w).shape == (0, 16) and fo.add_rmsnorm(x, x.clone(), w).shape == (0, 16)
    assert [t.shape for t in fo.softmax_topk(x, 2)] == [(0, 2), (0, 2)]


def test_cpu_tensors_without_the_interpreter_take_the_reference(fo, monkeypatch):
    monkeypatch.setattr(fo, "_INTERPRET", False)
    x, w = torch.randn(3, 16), torch.randn(16)
    assert torch.equal(fo.rmsnorm(x, w), fo.rmsnorm_reference(x, w))
    h, h_ref, delta = x.clone(), x.clone(), torch.randn(3, 16)
    assert torch.equal(fo.add_rmsnorm(h, delta, w), fo.add_rmsnorm_reference(h_ref, delta, w))
    assert torch.equal(h, h_ref)
    assert all(torch.equal(a, b) for a, b in zip(fo.softmax_topk(x, 3), fo.softmax_topk_reference(x, 3)))


def _error_cases(fo):
    x, w = torch.randn(2, 8), torch.randn(8)
    return [
        (lambda: fo.rmsnorm(torch.randn(8), w), "2-D"),
        (lambda: fo.rmsnorm(torch.randn(2, 2, 8), w), "2-D"),
        (lambda: fo.rmsnorm(x.to(torch.int32), w), "float16, bfloat16 or float32"),
        (lambda: fo.rmsnorm(x.double(), w), "float16, bfloat16 or float32"),
        (lambda: fo.rmsnorm(x.tolist(), w), "torch.Tensor"),
        (lambda: fo.rmsnorm(torch.randn(8, 2).t(), torch.randn(2)), "last-dim stride 1"),
        (lambda: fo.rmsnorm(torch.randn(2, 16)[:, ::2], w), "last-dim stride 1"),
        (lambda: fo.rmsnorm(x, torch.randn(9)), r"weight must be \[8\]"),
        (lambda: fo.rmsnorm(x, torch.randn(16)[::2]), "weight needs stride 1"),
        (lambda: fo.rmsnorm(x, w.to(torch.int64)), "weight must be a float"),
        (lambda: fo.rmsnorm(x, w.to("meta")), "weight is on meta"),
        (lambda: fo.rmsnorm(x, w, out=torch.empty(3, 8)), r"out must be \[2, 8\]"),
        (lambda: fo.rmsnorm(x, w, out=torch.empty(2, 8, dtype=torch.float16)), "out must be torch.float32"),
        (lambda: fo.rmsnorm(torch.randn(1, fo.MAX_ROW + 1), torch.randn(fo.MAX_ROW + 1)), "hidden size"),
        (lambda: fo.add_rmsnorm(x, torch.randn(2, 9), w), r"delta must be \[2, 8\]"),
        (lambda: fo.add_rmsnorm(x, torch.randn(3, 8), w), r"delta must be \[2, 8\]"),
        (lambda: fo.add_rmsnorm(x, x.to(torch.int32), w), "delta must be float16"),
        (lambda: fo.add_rmsnorm(x, torch.randn(8, 2).t(), w), "delta needs last-dim stride 1"),
        (lambda: fo.add_rmsnorm(x, x.to("meta"), w), "delta is on meta"),
        (lambda: fo.add_rmsnorm(torch.randn(1, 8).expand(2, 8), x, w), "rows of h overlap"),
        (lambda: fo.add_rmsnorm(x, x.clone(), torch.randn(4)), r"weight must be \[8\]"),
        (lambda: fo.softmax_topk(x, 9), "k must be"),
        (lambda: fo.softmax_topk(x, 0), "k must be"),
        (lambda: fo.softmax_topk(x, 2.0), "k must be"),
        (lambda: fo.softmax_topk(x, True), "k must be"),
        (lambda: fo.softmax_topk(torch.randn(2, 200)[:, ::2], 2), "last-dim stride 1"),
        (lambda: fo.softmax_topk(torch.randn(8), 2), "2-D"),
        (lambda: fo.softmax_topk(x.to(torch.int64), 2), "float16, bfloat16 or float32"),
        (lambda: fo.softmax_topk(torch.randn(1, fo.MAX_EXPERTS + 1), 2), "experts"),
        (lambda: fo.softmax_topk(torch.randn(1, 128), fo.MAX_TOPK + 1), "k must be"),
    ]


def test_bad_inputs_raise_value_error(fo):
    for i, (call, match) in enumerate(_error_cases(fo)):
        with pytest.raises(ValueError, match=match):
            call()
            pytest.fail(f"case {i} did not raise")


# ---------------------------------------------------------------------------------------------------- GPU, Kimi shapes

GPU_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 64)
GPU_DTYPES = (torch.bfloat16, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rmsnorm_on_gpu_at_kimi_shapes(fo, dtype):
    torch.manual_seed(1)
    for n in GPU_ROWS:
        for hidden, width in ((7168, 7168), (1536, 2112), (512, 576)):  # hidden; q_a in qkv; kv_a in [n, 576]
            wide = torch.randn(n, width, device="cuda", dtype=dtype)
            w = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
            x = wide[:, :hidden]
            want = fo.rmsnorm_reference(x, w)
            assert rel_error(fo.rmsnorm(x, w), want) <= TOL[dtype], (n, hidden)
            rest = wide[:, hidden:].clone()
            fo.rmsnorm(x, w, out=x)
            assert rel_error(x, want) <= TOL[dtype] and torch.equal(wide[:, hidden:], rest), (n, hidden)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_add_rmsnorm_on_gpu_at_kimi_shapes(fo, dtype):
    torch.manual_seed(2)
    for n in GPU_ROWS:
        h = torch.randn(n, 7168, device="cuda", dtype=dtype) * 4
        delta = torch.randn(n, 7168, device="cuda", dtype=dtype)
        w = torch.rand(7168, device="cuda", dtype=dtype) + 0.5
        h_ref = h.clone()
        y_ref = fo.add_rmsnorm_reference(h_ref, delta, w)
        y = fo.add_rmsnorm(h, delta, w)
        assert torch.equal(h, h_ref) and rel_error(y, y_ref) <= TOL[dtype], n


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_softmax_topk_on_gpu_at_kimi_shapes(fo, dtype):
    torch.manual_seed(4)
    for n in GPU_ROWS:
        _check_topk(fo, _distinct_logits(n, 384, dtype, "cuda", step=1 / 32), 8)  # 384 experts, top-8
        wide = torch.zeros(n, 100 + 384, device="cuda", dtype=dtype)
        wide[:, 100:] = _distinct_logits(n, 384, dtype, "cuda", step=1 / 32)
        _check_topk(fo, wide[:, 100:], 8)  # strided rows


@pytest.mark.gpu
def test_all_ops_replay_in_a_cuda_graph(fo):
    torch.manual_seed(5)
    n, bf = 4, torch.bfloat16
    h = torch.randn(n, 7168, device="cuda", dtype=bf)
    delta = torch.randn(n, 7168, device="cuda", dtype=bf)
    w = torch.rand(7168, device="cuda", dtype=bf) + 0.5
    logits = _distinct_logits(n, 384, bf, "cuda", step=1 / 32)

    def step():
        return fo.add_rmsnorm(h, delta, w), fo.rmsnorm(h, w), *fo.softmax_topk(logits, 8)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):  # fresh inputs each replay, read through the captured addresses
        h.copy_(torch.randn_like(h))
        delta.copy_(torch.randn_like(delta))
        logits.copy_(_distinct_logits(n, 384, bf, "cuda", step=1 / 32))
        h_ref = h.clone()
        graph.replay()
        y_ref = fo.add_rmsnorm_reference(h_ref, delta, w)
        assert torch.equal(h, h_ref) and rel_error(outs[0], y_ref) <= 1e-2
        assert rel_error(outs[1], fo.rmsnorm_reference(h_ref, w)) <= 1e-2
        w_ref, ids_ref = fo.softmax_topk_reference(logits, 8)
        assert torch.equal(outs[3], ids_ref) and (outs[2] - w_ref).abs().max().item() <= 1e-5
