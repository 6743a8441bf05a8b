"""The synthetic verify forward: the engine-style fused small ops agree with plain torch over whole forwards
(fp16: bf16 arithmetic is wrong in the Triton interpreter), and switching a component off keeps shapes."""
import pytest
import torch

from verifybench.harness.model.forward import COMPONENTS, TORCH_OPS, VerifyForward, fused_ops
from verifybench.harness.model import presets
from verifybench.harness.model.build import chain_verify, moe_fn

BODY = frozenset(COMPONENTS) - {"head"}


@pytest.fixture(scope="module")
def forward():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return VerifyForward(presets.get("tiny", 1), 64, dev, moe_fn("cpu"), lambda t: None, chain_verify(dev),
                         max_tokens=3, ops=fused_ops(), dtype=torch.float16)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("n", [1, 3])
def test_fused_small_ops_match_torch_over_the_whole_forward(forward, n):
    fused = forward.forward(n, BODY).clone()
    forward.ops = TORCH_OPS
    try:
        plain = forward.forward(n, BODY).clone()
    finally:
        forward.ops = fused_ops()
    assert _rel(fused, plain) <= 1e-2
    assert not torch.equal(fused, forward.buf[n]["h0"])  # the layers did change the residual stream


def test_every_component_can_be_switched_off_alone(forward):
    for comp in COMPONENTS:
        out = forward.forward(2, frozenset(COMPONENTS) - {comp})
        if comp != "head":
            predicts, accept_index, accepted = out  # the tree verification's outputs
            assert accepted.numel() == 1 and 0 <= int(accepted[0]) < 2
        else:  # without the head the forward ends at the residual stream
            assert out.shape == (2, forward.s.hidden) and bool(torch.isfinite(out).all())
            assert not torch.equal(out, forward.buf[2]["h0"])
    s = forward.s
    distinct = forward.distinct_experts(2)
    assert len(distinct) == s.layers - s.dense_layers
    assert all(s.topk <= d <= min(s.experts, 2 * s.topk) for d in distinct)


def test_bench_check_compares_the_first_layers_and_restores_the_forward(forward):
    from verifybench.harness.components import verify as bench_verify

    layers, ops = forward.layers, forward.ops
    assert bench_verify.fused_vs_torch(forward, 2) <= bench_verify.FORWARD_TOLERANCE
    assert forward.layers is layers and forward.ops is ops


@pytest.mark.parametrize("b, n", [(2, 3), (8, 3)])
def test_fused_kernels_at_b_requests_match_torch_each_request_over_its_own_rows(b, n):
    """The batched forward's kernels (mla_prep's per-request rows, split_kv over each request's cache; past the
    skinny GEMM's 16 rows torch's GEMM) against the torch ops; the cache rows each request wrote lie after its own
    prefix, the rest untouched."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fwd = VerifyForward(presets.get("tiny", 1), 64, dev, moe_fn("cpu"), lambda t: None, chain_verify(dev),
                        max_tokens=3, ops=fused_ops(), dtype=torch.float16, batch=b).at_batch(b)
    before = fwd.layers[0]["kv_cache"].clone()
    fused = fwd.forward(n, BODY).clone()
    after = fwd.layers[0]["kv_cache"].clone()
    written = torch.zeros(before.shape[0], dtype=torch.bool)
    for r in range(b):
        written[r * fwd.region + 64: r * fwd.region + 64 + n] = True
    assert torch.equal(after[~written], before[~written]) and not torch.equal(after[written], before[written])
    fwd.ops = TORCH_OPS
    plain = fwd.forward(n, BODY).clone()
    assert fused.shape[0] == b * n and _rel(fused, plain) <= 1e-2


def test_verify_cases_carry_batch_and_keep_the_batch_one_names():
    from verifybench.harness.components import verify as component

    plain = component.cases("tiny", 1, 64, (1, 2))
    both = component.cases("tiny", 1, 64, (1, 2), batch=(1, 4))
    assert [c.name for c in both[: len(plain)]] == [c.name for c in plain]
    assert {c.params["batch"] for c in plain} == {1} and {c.params["batch"] for c in both[len(plain):]} == {4}
    assert all(c.name.startswith("verify/tiny-tp1/B4/") for c in both[len(plain):])


def test_build_forward_lets_the_kept_forward_go_before_it_builds_another(monkeypatch):
    """Two K2.5 TP8 forwards do not fit side by side (a cycle over two contexts ran out of memory on an H200 so):
    when the arguments change, the kept one is dropped first."""
    from verifybench.harness.model import build

    alive_at_build = []

    class Recorded:
        def __init__(self, *args, **kwargs):
            alive_at_build.append(len(build._FORWARD))

    monkeypatch.setattr(build, "VerifyForward", Recorded)
    monkeypatch.setattr(build, "_FORWARD", {})
    first = build.build_forward("tiny", 1, None, 64, 0.0)
    assert build.build_forward("tiny", 1, None, 64, 0.0) is first  # kept while the arguments stay
    build.build_forward("tiny", 1, None, 128, 0.0)
    assert alive_at_build == [0, 0] and len(build._FORWARD) == 1


def test_the_report_of_a_run_at_several_batches_fits_the_forward_per_batch_and_over_all():
    """The committed H100 run of `verify --batch 1,2,4,8 --tokens 1-8`: the tables hold the forward per (B, n) and its
    fit over the tokens it carries, one line per B and one over every row."""
    import gzip
    import json
    from pathlib import Path

    from verifybench.harness.components import verify as component

    path = (Path(__file__).resolve().parents[2]
            / "results/baselines/nvidia-h100-80gb-hbm3-x1/batch-contexts-20261206/verify.json.gz")
    records = json.loads(gzip.decompress(path.read_bytes()))["cases"]
    tables = dict(component.tables(records))
    per_batch = next(rows for title, rows in tables.items() if title.startswith("the full forward at B requests"))
    assert len(per_batch) == 32 and max(r["tokens_per_forward"] for r in per_batch) == 64
    fits = next(rows for title, rows in tables.items() if title.startswith("fit of the full forward over the tokens"))
    assert [f["B"] for f in fits] == [1, 2, 4, 8, "all"] and fits[-1]["tokens"] == "1-64"
    slopes = [f["b_us_per_token"] for f in fits[:4]]
    assert slopes == sorted(slopes, reverse=True)  # each token costs less as B grows (the experts saturate)
