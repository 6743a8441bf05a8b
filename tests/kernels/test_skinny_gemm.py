"""Skinny GEMM (kernels/skinny_gemm/): both kernels and both split-K reductions against the fp32 reference
(interpreter on CPU, fp16/fp32: bf16 arithmetic is wrong in the interpreter), the fused residual add in every path,
config selection, every error path, the bench's CPU path and the tune smoke; bf16 at the real Kimi-K2.5 TP8 shapes,
CUDA-graph capture, and PDL launches (a chain of two linears in a graph) on a GPU.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported (conftest too)

from verifybench.harness.measure.results.store import WITHHELD  # noqa: E402
from verifybench.harness.measure.timing.runner import CPU_COPIES, rel_error  # noqa: E402
from verifybench.kernels.common import pdl  # noqa: E402
from verifybench.kernels.skinny_gemm import api as sg  # noqa: E402
from verifybench.kernels.skinny_gemm import kernels as sgk  # noqa: E402
from verifybench.kernels.skinny_gemm import configs as sgs  # noqa: E402
from verifybench.kernels.fused_ops.api import silu_mul_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 48, 320  # 5 steps of BLOCK_K 64: SPLIT_K 3 runs as splits of 2, 2 and 1 steps
TOL = 1e-3
# few, large blocks: the interpreter's cost is per program
DOT = {"kind": "dot", "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "reduce": "serial", "num_warps": 4,
       "num_stages": 2}
FMA = {"kind": "fma", "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1, "reduce": "serial", "num_warps": 1,
       "num_stages": 1}
needs_kernel = pytest.mark.skipif(DEV == "cpu" and not sg._INTERPRET,
                                  reason="kernels.skinny_gemm was imported before TRITON_INTERPRET was set")


def _inputs(n, k=K, rows=N, dtype=torch.float16, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    x = torch.randn(n, k, device=DEV).to(dtype)
    w = (torch.randn(rows, k, device=DEV) / k**0.5).to(dtype)
    return x, w


def _err(y, x, w):
    return rel_error(y.float(), sg.linear_reference(x, w))


# ---------------------------------------------------------------------------------------------------- kernels

@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("base", [DOT, {**DOT, "BLOCK_N": 16, "num_warps": 2}, FMA], ids=["dot", "dot-bn16", "fma"])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("split,reduce", [(1, "serial"), (3, "serial"), (3, "kernel")])
def test_kernel_matches_fp32_reference(dtype, base, n, split, reduce):
    x, w = _inputs(n, dtype=dtype)
    cfg = {**base, "SPLIT_K": split, "reduce": reduce}
    y = sg.linear(x, w, cfg)
    assert y.shape == (n, N) and y.dtype == dtype
    assert _err(y, x, w) <= TOL
    if split > 1:
        assert sgk.plan(n, N, K, sgs.check_config(cfg, n))["split"] == 3


@needs_kernel
@pytest.mark.parametrize("base", [DOT, FMA], ids=["dot", "fma"])
def test_strided_x_ragged_k_and_rows(base):
    """x a column slice of a wider buffer (row stride != K), K not a multiple of BLOCK_K, N not of BLOCK_N."""
    k, rows = 200, 40
    buf = torch.randn(3, k + 24, device=DEV).to(torch.float16)
    x = buf[:, 8: 8 + k]
    assert x.stride(0) == k + 24
    _, w = _inputs(3, k, rows)
    for split in (1, 2):
        y = sg.linear(x, w, {**base, "SPLIT_K": split})
        assert y.shape == (3, rows) and _err(y, x, w) <= TOL


@needs_kernel
def test_every_row_count_up_to_16():
    x16, w = _inputs(16, seed=3)
    for n in (3, 8, 9, 16):
        x = x16[:n]
        assert _err(sg.linear(x, w, {**DOT, "SPLIT_K": 2}), x, w) <= TOL
        if n <= sgs.FMA_MAX_TOKENS:
            assert _err(sg.linear(x, w, FMA), x, w) <= TOL


@needs_kernel
def test_split_reductions_are_deterministic_and_leave_counters_zeroed():
    x, w = _inputs(4, dtype=torch.float32, seed=5)
    cfg = {**DOT, "SPLIT_K": 4}
    a = sg.linear(x, w, cfg)
    b = sg.linear(x, w, cfg)
    c = sg.linear(x, w, {**cfg, "reduce": "kernel"})
    assert torch.equal(a, b) and torch.equal(a, c)  # both sum the same partials in split order
    assert int(sgk._COUNTERS[x.device].abs().sum()) == 0


@needs_kernel
def test_default_config_runs_and_matches():
    x, w = _inputs(2, seed=7)
    assert _err(sg.linear(x, w), x, w) <= TOL


def _residual(n, rows, dtype, seed=None):
    """add as a column slice of a wider buffer: row stride != N."""
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(n, rows + 8, device=DEV).to(dtype)[:, 4: 4 + rows]


ADD_CASES = {"dot": DOT, "dot-serial": {**DOT, "SPLIT_K": 3}, "dot-kernel": {**DOT, "SPLIT_K": 3, "reduce": "kernel"},
             "fma": FMA, "fma-serial": {**FMA, "SPLIT_K": 3}, "fma-kernel": {**FMA, "SPLIT_K": 3, "reduce": "kernel"},
             "torch": {"kind": "torch"}}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", list(ADD_CASES))
def test_add_matches_fp32_reference(case, dtype):
    """y = x @ w.T + add in every kind and reduce, with add a strided view; N = 40 and K = 200 are ragged."""
    cfg = ADD_CASES[case]
    for n, k, rows in [(1, K, N), (5, 200, 40)]:
        x, w = _inputs(n, k, rows, dtype, seed=n)
        add = _residual(n, rows, dtype)
        assert add.stride(0) == rows + 8
        y = sg.linear(x, w, cfg, add=add)
        assert y.shape == (n, rows) and y.dtype == dtype
        assert rel_error(y.float(), sg.linear_reference(x, w, add)) <= TOL, (case, n)
        if case == "torch":
            assert torch.equal(y, torch.nn.functional.linear(x, w) + add)  # F.linear, then a torch add
        else:  # the same kernel without add, plus add in fp32: only the rounding of the sum may differ
            assert rel_error(y.float(), sg.linear(x, w, cfg).float() + add.float()) <= TOL
    if cfg["kind"] != "torch" and cfg["SPLIT_K"] > 1 and cfg["reduce"] == "serial":
        assert int(sgk._COUNTERS[x.device].abs().sum()) == 0


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", list(ADD_CASES))
def test_silu_mul_prologue_matches_the_separate_activation(case, dtype):
    """act="silu_mul": x is gate_up [n, 2K] (a column slice of a wider buffer), with and without add, in every kind
    and reduce; the same as the GEMM of the activation computed apart (rounded to x's dtype the same way)."""
    cfg = ADD_CASES[case]
    for n, k, rows in [(1, K, N), (5, 200, 40)]:
        torch.manual_seed(n + 30)
        gate_up = (torch.randn(n, 2 * k + 6, device=DEV) * 2).to(dtype)[:, 3: 3 + 2 * k]
        w = (torch.randn(rows, k, device=DEV) / k**0.5).to(dtype)
        act = silu_mul_reference(gate_up)
        for add in (None, _residual(n, rows, dtype)):
            y = sg.linear(gate_up, w, cfg, add=add, act="silu_mul")
            assert y.shape == (n, rows) and y.dtype == dtype
            assert rel_error(y.float(), sg.linear_reference(gate_up, w, add, act="silu_mul")) <= TOL, (case, n)
            assert rel_error(y.float(), sg.linear(act, w, cfg, add=add).float()) <= TOL, (case, n)


@needs_kernel
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, in the interpreter
def test_silu_mul_prologue_stays_finite_for_large_gates():
    gate_up = torch.tensor([[-200.0, -100.0, 0.0, 100.0, 1.0, 2.0, 3.0, 4.0]] * 2, device=DEV)
    w = torch.eye(4, device=DEV)
    for cfg in (DOT, FMA):
        y = sg.linear(gate_up, w, {**cfg, "BLOCK_K": 16}, act="silu_mul")
        assert torch.isfinite(y).all() and rel_error(y, silu_mul_reference(gate_up)) <= 1e-6


def test_silu_mul_prologue_checks_the_gate_up_width():
    # on DEV: CPU tensors on a GPU machine (no interpreter) would take the reference, not the fused prologue
    x, w = torch.randn(2, 64, device=DEV), torch.randn(8, 64, device=DEV)
    with pytest.raises(ValueError, match=r"gate_up \[n, 2K\]"):
        sg.linear(x, w, act="silu_mul")
    with pytest.raises(ValueError, match="act must be one of"):
        sg.linear(x, w, act="gelu")
    gu = torch.randn(2, 128, device=DEV)
    assert rel_error(sg.linear(gu, w, act="silu_mul"), sg.linear(silu_mul_reference(gu), w)) <= 1e-5


@needs_kernel
def test_add_is_rounded_once():
    """fp16: the kernel rounds the fp32 sum once, so it matches the rounded fp32 reference (but for a rare tie of
    summation order); the "torch" kind rounds x @ w.T first and misses it in many places."""
    x, w = _inputs(2, seed=11)
    add = (torch.randn(2, N, device=DEV) * 3).half()
    want = sg.linear_reference(x, w, add).half()
    once = (sg.linear(x, w, {**DOT, "SPLIT_K": 3, "reduce": "kernel"}, add=add) != want).sum()
    twice = (sg.linear(x, w, {"kind": "torch"}, add=add) != want).sum()
    assert once <= 2 < twice


@needs_kernel
@pytest.mark.parametrize("base", [DOT, FMA], ids=["dot", "fma"])
def test_pdl_true_without_pdl_support_runs_plain(base):
    # CPU and the interpreter have no PDL: pdl=True silently runs the same kernels without it
    assert not pdl.enabled(DEV) or DEV == "cuda"
    x, w = _inputs(3, seed=13)
    cfg = {**base, "SPLIT_K": 2}
    assert torch.equal(sg.linear(x, w, cfg, pdl=True), sg.linear(x, w, cfg, pdl=False))


def test_cpu_without_interpreter_takes_the_reference(monkeypatch):
    monkeypatch.setattr(sg, "_INTERPRET", False)
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    y = sg.linear(x, w)
    assert y.dtype == x.dtype and torch.allclose(y, sg.linear_reference(x, w))
    add = torch.randn(2, 16)[:, ::2]  # last-dim stride 2: checked before the reference path
    with pytest.raises(ValueError, match="last-dim stride 1"):
        sg.linear(x, w, add=add)
    add = add.contiguous()
    assert torch.equal(sg.linear(x, w, add=add, pdl=True), sg.linear_reference(x, w, add))


# ---------------------------------------------------------------------------------------------------- configs

def _table(buckets):
    return {sgs.device_name(DEV): {"shapes": {sgs.shape_key(N, K): buckets}}}


def test_select_config_table_hit_picks_the_smallest_bucket_at_or_above_n():
    b = {"1": {**FMA, "BLOCK_N": 4, "us": 1.0}, "4": {**FMA, "BLOCK_N": 8}, "16": {**DOT, "SPLIT_K": 2}}
    table = _table(b)
    got = sgs.select_config(1, N, K, DEV, table)
    assert got["BLOCK_N"] == 4 and got["kind"] == "fma" and "us" not in got
    assert sgs.select_config(3, N, K, DEV, table)["BLOCK_N"] == 8  # bucket 4: the BLOCK_M it was tuned with
    assert sgs.select_config(9, N, K, DEV, table)["kind"] == "dot"
    assert sgs.select_config(16, N, K, DEV, {sgs.device_name(DEV): {"shapes": {sgs.shape_key(N, K): {
        "1": b["1"]}}}})["kind"] == "dot"  # above every bucket: the largest, an fma one cannot serve 16 -> default


def test_select_config_falls_back_to_the_default():
    default = sgs.default_config(4, N, K, sgs.sm_count(DEV))
    assert sgs.select_config(4, N, K, DEV, {}) == default  # GPU not in the table
    assert sgs.select_config(4, N, K, DEV, {sgs.device_name(DEV): {"shapes": {"1,1": {"1": FMA}}}}) == default
    assert sgs.select_config(4, N, K, DEV, _table({"4": {"kind": "nope"}})) == default  # a broken entry
    fp32 = sgs.select_config(4, N, K, DEV, _table({"4": FMA}), dtype=torch.float32)  # the table holds 2-byte tunings
    assert fp32 == sgs.default_config(4, N, K, sgs.sm_count(DEV), torch.float32)


def test_default_split_fills_the_gpu_without_empty_splits():
    for rows, k in [(384, 7168), (512, 7168), (1536, 1536), (2112, 7168), (7168, 256), (20480, 7168), (48, 256)]:
        cfg = sgs.default_config(1, rows, k, 132)
        geo = sgk.plan(1, rows, k, cfg, 132)
        steps = -(-k // cfg["BLOCK_K"])
        assert geo["blocks"] * geo["split"] >= 264 or geo["split"] == steps or geo["split"] * 2 > cfg["SPLIT_K"]
        assert (geo["split"] - 1) * geo["k_per_split"] < k <= geo["split"] * geo["k_per_split"]
        assert geo["k_per_split"] % cfg["BLOCK_K"] == 0
    assert sgs.default_config(1, 384, 7168)["SPLIT_K"] > 1 and sgs.default_config(1, 20480, 7168)["SPLIT_K"] == 1
    assert sgs.default_config(1, 48, 256, dtype=torch.float32)["BLOCK_K"] == 64


def test_default_kind_and_tile_follow_tokens_and_row_length():
    pick = lambda n, k: (lambda c: (c["kind"], c["BLOCK_N"], c["BLOCK_K"]))(sgs.default_config(n, 2112, k))  # noqa
    assert pick(1, 7168) == pick(2, 1536) == ("fma", 4, 1024)  # rows of several 1024-element steps
    assert pick(1, 1024) == pick(4, 1536) == pick(16, 2304) == ("dot", 64, 128)
    assert pick(3, 7168) == pick(16, 4096) == ("dot", 32, 256)
    assert {sgs.check_config(c, 1)["kind"] for c in sgs.default_configs()} == {"fma", "dot"}


def test_configs_round_trip_through_json(tmp_path):
    table = _table({"2": {**FMA, "us": 3.5}})
    path = sgs.save_configs(table, tmp_path / "t.json")
    assert sgs.load_configs(path) == table
    assert sgs.select_config(2, N, K, DEV, sgs.load_configs(path))["kind"] == "fma"
    assert sgs.load_configs(tmp_path / "missing.json") == {}


# ---------------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("cfg,match", [
    ({"kind": "gemv"}, "kind"), ({"reduce": "atomic"}, "reduce"), ({"BLOCK_N": 48}, "BLOCK_N"),
    ({"BLOCK_N": 8}, "BLOCK_N"), ({**FMA, "BLOCK_N": 512}, "BLOCK_N"), ({"BLOCK_K": 8}, "BLOCK_K"),
    ({"BLOCK_K": 96}, "BLOCK_K"), ({"SPLIT_K": 0}, "SPLIT_K"), ({"SPLIT_K": 2.0}, "SPLIT_K"),
    ({"num_warps": 3}, "num_warps"), ({"num_stages": 0}, "num_stages"), ({"tile": 3}, "unknown config keys"),
    ("dot", "dict"),
])
def test_bad_config_raises(cfg, match):
    x, w = _inputs(2)
    with pytest.raises(ValueError, match=match):
        sg.linear(x, w, cfg)


def test_fma_above_8_tokens_raises():
    x, w = _inputs(9)
    with pytest.raises(ValueError, match="n <= 8"):
        sg.linear(x, w, FMA)


def test_bad_inputs_raise():
    x, w = _inputs(2)
    cases = [
        ((x.tolist(), w), "torch.Tensor"), ((x, "w"), "torch.Tensor"),
        ((x.to(torch.int32), w), "bfloat16, float16 or float32"),
        ((x, w.float()), "one dtype"),
        ((x[0], w), "2-D"), ((x, w[None]), "2-D"),
        ((x[:0], w), "1..16 rows"), ((torch.randn(17, K, device=DEV).half(), w), "1..16 rows"),
        ((x[:, :100], w), "agree on K"), ((x, w[:0]), "agree on K"),
        ((x.t().contiguous().t(), w), "last-dim stride 1"),
        ((x, torch.randn(K, N, device=DEV).half().t()), "contiguous"),
        ((x, w.to("meta")), "is on"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            sg.linear(*args)


def test_bad_add_raises():
    x, w = _inputs(2)
    add = torch.zeros(2, N, device=DEV, dtype=x.dtype)
    cases = [
        (add.tolist(), "torch.Tensor or None"), (add[:1], r"\[n, N\] = \[2, 48\]"), (add[:, :-1], r"\[n, N\]"),
        (add[None], r"\[n, N\]"), (add.float(), "x's dtype"), (add.to("meta"), "is on"),
        (torch.zeros(N, 2, device=DEV, dtype=x.dtype).t(), "last-dim stride 1"),
    ]
    for bad, match in cases:
        for cfg in (DOT, {"kind": "torch"}):  # checked before any dispatch
            with pytest.raises(ValueError, match=match):
                sg.linear(x, w, cfg, add=bad)


def test_bytes_moved_counts_w_x_and_y():
    assert sg.bytes_moved(8, 384, 7168) == (384 * 7168 + 8 * 7168 + 8 * 384) * 2


# ---------------------------------------------------------------------------------------------------- bench

def test_bench_shapes_are_the_kimi_tp8_projections():
    from verifybench.harness.components import skinny_gemm as bench

    got = {s.name: (s.N, s.K) for s in bench.shapes("kimi-k2.5", 8)}
    assert got == {"q_a_kv_a": (2112, 7168), "q_b": (1536, 1536), "o_proj": (7168, 1024), "router": (384, 7168),
                   "router_shared_gate_up": (896, 7168), "shared_gate_up": (512, 7168), "shared_down": (7168, 256), "dense_gate_up": (4608, 7168),
                   "dense_down": (7168, 2304), "lm_head": (20480, 7168)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke profile")
def test_bench_cpu_case_runs_and_tables_pair_the_impls(monkeypatch):
    from verifybench.harness.components import skinny_gemm as bench

    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.1")  # the copy ceiling's time cap

    shape = bench.shapes("tiny", 1)[0]
    quick = {"calls_per_sample": CPU_COPIES, "max_time_s": 0.05}  # as the CPU cases, at a shorter cap
    records = [bench.make_case(shape, 2, impl, "cpu", quick, "tiny", 1).run().as_dict() for impl in bench.IMPLS]
    assert all(r["check"]["ok"] for r in records)
    # the interpreter is slow: a CPU case rotates over a few copies, not the cold rule's 64
    assert {r["derived"]["rotation"] for r in records} == {CPU_COPIES}
    title = next(t for t, _ in bench.tables(records) if t.startswith("Skinny GEMM: Triton vs F.linear"))
    side = dict(bench.tables(records))[title]
    assert len(side) == 1 and side[0]["config"].startswith("dot")
    assert side[0]["speedup"] == WITHHELD  # an interpreter's time against torch's says nothing of a GPU
    (gpu,) = bench.tables([{**r, "device": "cuda"} for r in records])[1][1]
    assert gpu["speedup"] == pytest.approx(gpu["torch_us"] / gpu["triton_us"])


@needs_kernel
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_tune_smoke_writes_a_table_select_config_reads(tmp_path, monkeypatch):
    from verifybench.harness.tune import skinny_gemm as bench

    monkeypatch.setattr(bench, "SMOKE_SHAPES", [bench.Shape("smoke", 48, 128, 1)])
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.1")
    out = tmp_path / "table.json"
    table = bench.tune(out=str(out), smoke=True, log=lambda *a: None)
    buckets = table["cpu"]["shapes"]["48,128"]
    assert set(buckets) == {"1", "2", "16"} and all(b["us"] > 0 for b in buckets.values())
    assert buckets["1"]["default_us"] > 0 and buckets["2"]["default_us"] > 0  # the untuned choice, timed beside
    cfg = sgs.select_config(2, 48, 128, "cpu", sgs.load_configs(out))
    # the interpreter loses to F.linear, so the tune may keep "torch" (cuBLAS on a GPU) for a bucket
    assert cfg == sgs.check_config({k: v for k, v in buckets["2"].items() if k in sgs.DEFAULT_DOT}, 2)
    assert cfg["kind"] == "torch" or cfg["SPLIT_K"] >= 1


# ---------------------------------------------------------------------------------------------------- GPU

KIMI_TP8 = [(2112, 7168), (1536, 1536), (7168, 1024), (384, 7168), (512, 7168), (7168, 256), (4608, 7168),
            (7168, 2304), (20480, 7168)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,k", KIMI_TP8, ids=[f"{r}x{k}" for r, k in KIMI_TP8])
def test_gpu_bf16_real_shapes(rows, k):
    torch.manual_seed(0)
    w = (torch.randn(rows, k, device="cuda") / k**0.5).bfloat16()
    for n in (1, 4, 8, 16):
        x = torch.randn(n, k, device="cuda").bfloat16()
        ref = sg.linear_reference(x, w)
        configs = [None, sgs.default_config(n, rows, k), {**sgs.default_config(n, rows, k), "reduce": "kernel"}]
        if n <= 8:
            configs.append({**FMA, "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "SPLIT_K": None})
        outs = []
        for cfg in configs:
            y = sg.linear(x, w, cfg)
            assert y.dtype == torch.bfloat16 and rel_error(y.float(), ref) <= 1e-2, (n, cfg)
            outs.append(y)
        # serial (last program reduces) and kernel reductions sum the same partials in one order: a race in the
        # counter handshake would show as a difference
        assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], sg.linear(x, w, configs[1])), n


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False], ids=["counters_made_eagerly", "counters_made_in_capture"])
def test_gpu_cuda_graph_capture_and_replay(warm):
    torch.manual_seed(1)
    w = (torch.randn(384, 7168, device="cuda") / 7168**0.5).bfloat16()
    x = torch.randn(4, 7168, device="cuda").bfloat16()
    cfg = {**sgs.default_config(4, 384, 7168), "reduce": "serial"}
    eager = sg.linear(x, w, cfg)  # compiles; makes the counters
    if not warm:
        sgk._COUNTERS.clear()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            y = sg.linear(x, w, cfg)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, sg.linear(x, w, cfg))


def _graph(fn):
    """fn() captured into a CUDA graph on a side stream (after an eager warm-up run that compiles); returns the
    graph and the captured output."""
    fn()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return g, out


_D = {"kind": "dot", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
_F = {**FMA, "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "SPLIT_K": 3}
# (config of x @ w1.T, w1 [256, 7168]; of h @ w2.T + r, w2 [7168, 256]); None: the table / default config.
# The second dot: a peeled step and one pipelined one, or one step per split (the peel alone).
PDL_CASES = {"table": (None, None),
             "dot": ({**_D, "BLOCK_N": 64, "num_stages": 3, "SPLIT_K": 1}, {**_D, "BLOCK_N": 64, "BLOCK_K": 128,
                                                                             "SPLIT_K": 1}),
             "dot-serial": ({**_D, "SPLIT_K": 7}, {**_D, "BLOCK_K": 128, "SPLIT_K": 2}),
             "dot-kernel": ({**_D, "SPLIT_K": 7, "reduce": "kernel"},
                            {**_D, "BLOCK_K": 128, "SPLIT_K": 2, "reduce": "kernel"}),
             "dot-bn16": ({**_D, "BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 2}, {**_D, "BLOCK_N": 16, "SPLIT_K": 1}),
             "fma-serial": (_F, _F),
             "fma-kernel": ({**_F, "reduce": "kernel"},) * 2}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(PDL_CASES))
def test_gpu_pdl_chain_in_a_cuda_graph(case):
    """h = x @ w1.T (K 7168), y = h @ w2.T + r (shared_down [7168, 256] with the fused residual) with PDL, captured
    and replayed: equal to the same calls without PDL. The second call reads the first's output, and every replay
    reuses the buffers of the last, so an x or add load before gdc_wait (or a store before it) would show as a
    difference once x and r change between replays."""
    if not pdl.enabled("cuda"):
        pytest.skip("PDL needs sm_90+ (and VERIFYBENCH_PDL not 0)")
    torch.manual_seed(2)
    cfg1, cfg2 = PDL_CASES[case]
    w1 = (torch.randn(256, 7168, device="cuda") / 7168**0.5).bfloat16()
    w2 = (torch.randn(7168, 256, device="cuda") / 256**0.5).bfloat16()
    for n in (1, 4, 8) if case.startswith("fma") else (1, 4, 16):
        x = torch.randn(n, 7168, device="cuda").bfloat16()
        r = torch.randn(n, 7168 + 64, device="cuda").bfloat16()[:, 32: 32 + 7168]

        def chain(on):
            return sg.linear(sg.linear(x, w1, cfg1, pdl=on), w2, cfg2, add=r, pdl=on)

        want = chain(False)
        ref = sg.linear_reference(sg.linear_reference(x, w1).bfloat16(), w2, r)
        assert rel_error(want.float(), ref) <= 1e-2
        g, y = _graph(lambda: chain(True))
        for _ in range(2):
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, want), (case, n)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            r.copy_(torch.randn_like(r))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, chain(False)), (case, n)
        assert torch.equal(chain(True), y)  # eager PDL launches too


def test_a_torch_entry_dispatches_to_f_linear():
    # where the tune measured cuBLAS faster, the table says "torch" and linear() calls F.linear; on DEV: CPU
    # tensors on a GPU machine (no interpreter) take the fp32 reference before any dispatch
    x, w = torch.randn(3, 64, dtype=torch.float16, device=DEV), torch.randn(32, 64, dtype=torch.float16, device=DEV)
    cfg = sgs.check_config({"kind": "torch"}, 3)
    assert cfg["kind"] == "torch"
    assert torch.equal(sg.linear(x, w, config={"kind": "torch"}), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_skinny_gemm_side_by_side_table_prints_as_one_table_within_120_chars(device):
    from pathlib import Path

    from verifybench.harness.components import skinny_gemm as bench
    from verifybench.harness.measure.results import store, tables

    path = Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1/skinny_gemm.json"
    records = [{**r, "device": device} for r in store.load_run(path)["cases"]]
    title, side = bench.tables(records)[1]
    text = tables.render(side, "github")
    assert text.count("| shape") == 1 and max(map(len, text.splitlines())) <= tables.MAX_WIDTH_CHARS
    assert "| config" in text and "every config tuned" in title
