"""The empty kernel of the latency floor (kernels/common/empty.py): it runs in the interpreter with the grid it is
given, compiles with programmatic dependent launch for a GPU, and each family's launch_grids names exactly the
launches its wrapper makes (the grid rule has one home)."""
import os
import subprocess
import sys

import pytest
import torch
from triton.runtime.jit import KernelInterface

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels modules are first imported (conftest too)

from verifybench.kernels.common import empty  # noqa: E402
from verifybench.kernels.mla_decode import api as md  # noqa: E402
from verifybench.kernels.mla_verify import api as mv  # noqa: E402
from verifybench.kernels.moe_int4 import api as mt  # noqa: E402
from verifybench.kernels.moe_int4 import reference as moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16


@pytest.fixture
def launched(monkeypatch):
    """Every Triton launch in the test as (kernel name, grid, num_warps), none of them run (only the grids matter)."""
    seen = []

    def record(self, grid):
        def call(*args, **kwargs):
            seen.append((self.__name__, tuple(grid), kwargs.get("num_warps")))
        return call

    monkeypatch.setattr(KernelInterface, "__getitem__", record)
    return seen


def _as_seen(launches: list[empty.Launch]) -> list[tuple]:
    return [(g.grid, g.num_warps) for g in launches]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU tensors")
def test_the_empty_kernel_runs_in_the_interpreter_with_the_grid_and_warps_it_is_given(monkeypatch):
    runs = []
    original = KernelInterface.__getitem__
    monkeypatch.setattr(KernelInterface, "__getitem__", lambda self, grid: runs.append(grid) or original(self, grid))
    launches = [empty.Launch((3, 2), 8), empty.Launch((5,), 4)]
    assert empty.launch(launches) is None  # ran every program of both grids, wrote nothing
    assert runs == [(3, 2), (5,)] and [one.programs for one in launches] == [6, 5]
    assert launches[0].as_dict() == {"grid": [3, 2], "num_warps": 8, "waits": False, "releases": False}


def test_the_empty_kernel_compiles_for_sm90_with_both_halves_of_pdl():
    code = ("from verifybench.kernels.common import compiler, empty\n"
            "k = compiler.compiled(empty._empty_kernel, {}, {'WAITS': True, 'RELEASES': True}, {'num_warps': 8}, 90)\n"
            "print(sum('griddepcontrol' in line for line in k.asm['ptx'].splitlines()), k.metadata.shared)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter's kernels do not compile
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2", "0"]  # wait + launch_dependents, no shared memory


@pytest.mark.parametrize("variant, config", [("split_kv", {"num_splits": 3, "min_split_keys": 16, "block_keys": 16}),
                                             ("split_kv", {"num_splits": 1}), ("extend", None)])
def test_mla_verify_launch_grids_are_the_launches_its_call_makes(launched, variant, config):
    heads, b, d, kv_lora, rope = 4, 2, 3, 32, 8
    q = torch.randn(heads, b * d, kv_lora + rope, device=DEVICE, dtype=DTYPE)
    cache = torch.randn(200, kv_lora + rope, device=DEVICE, dtype=DTYPE)
    starts = torch.tensor([0, 100], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([60, 90], dtype=torch.int32, device=DEVICE)
    mask = torch.ones(d, d, dtype=torch.bool, device=DEVICE).tril().expand(b, d, d).contiguous()
    grids = mv.launch_grids(q, cache, starts, lens, mask, kv_lora, 0.1, variant, config, pdl=False)
    mv.mla_verify(q, cache, starts, lens, mask, kv_lora, 0.1, variant, config, pdl=False)
    assert [(g, w) for _, g, w in launched] == _as_seen(grids)
    assert len(grids) == (2 if variant == "split_kv" and config["num_splits"] > 1 else 1)
    assert not any(g.waits or g.releases for g in grids)
    if variant == "split_kv" and config["num_splits"] == 3:  # (requests x row blocks, every launched split)
        assert grids[0].grid == (b * 1, 3) and grids[1].grid[0] == heads * b * d


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_mla_decode_launch_grids_are_the_launches_its_call_makes(launched, num_splits):
    q = torch.randn(4, 3, 40, device=DEVICE, dtype=DTYPE)
    cache = torch.randn(300, 40, device=DEVICE, dtype=DTYPE)
    config = {"block_rows": 16, "block_keys": 32, "num_warps": 2, "num_stages": 1, "num_splits": num_splits}
    grids = md.launch_grids(q, cache, 250, 32, 0.1, config=config, pdl=False)
    md.mla_decode(q, cache, 250, 32, 0.1, config=config, pdl=False)
    assert [(g, w) for _, g, w in launched] == _as_seen(grids)
    assert len(grids) == (1 if num_splits == 1 else 2) and grids[0].num_warps == 2
    if num_splits == 4:  # 250 keys in 4 splits of whole 32-key tiles: 64 keys each
        assert grids[0].grid == (1, 4) and grids[1].grid[0] == 4 * 3


@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_launch_grids_are_the_two_launches_its_call_makes(launched, tokens):
    e, h, inter, topk = 8, 64, 32, 2
    torch.manual_seed(0)
    w13, w2 = moe.quantize_w4a16(torch.randn(e, 2 * inter, h) * 0.1), moe.quantize_w4a16(torch.randn(e, h, inter) * 0.1)
    layer = tuple(t.to(DEVICE) for t in (*w13, *w2))
    x = torch.randn(tokens, h, device=DEVICE, dtype=DTYPE)
    tw, ids = moe.route_uniform(tokens, e, topk, seed=1, device=DEVICE)
    config = {"gate_up": {"BLOCK_N": 16, "num_warps": 1, "SPLIT_K": 2}, "down": {"BLOCK_N": 32, "ROW_ITERS": 2}}
    grids = mt.launch_grids(x, *layer, tw, ids, config=config)
    mt.fused_moe_w4a16(x, *layer, tw, ids, config=config)
    assert [(g, w) for _, g, w in launched] == _as_seen(grids)
    # one program per (pair, split, row block) of gate_up; per (token, row blocks of H) of down
    assert grids[0].grid == (tokens * topk * 2 * (inter // 16),) and grids[1].grid == (tokens * h // 64,)
