"""Every config a tuned Triton kernel can be given (shipped tables, defaults, tuner spaces) compiled for sm_80 ...
sm_120 on CPU, and selection held to each architecture's shared memory per block: it never returns a config that
does not fit, the defaults fit everywhere, and the no-compile bounds selection trusts are upper bounds of the real
figure."""
import json
import os
import subprocess
import sys

import pytest
import triton

import early_jobs
from verifybench.kernels import config_tables
from verifybench.kernels import mla_decode_select as mds
from verifybench.kernels import mla_verify as mv
from verifybench.kernels import skinny_gemm_select as sgs

CCS = (80, 86, 89, 90, 100, 120)
LIMITS = config_tables.SMEM_LIMIT_BYTES

pytestmark = pytest.mark.skipif("nvidia" not in triton.backends.backends,
                                reason="this triton has no NVIDIA backend to compile for")

# Runs in a Python without TRITON_INTERPRET (the interpreter's kernels cannot be compiled): one process per CPU
# compiles every (config, architecture); kernels dedupe tiles, and their figures are cached on disk for reruns.
_WORKER = r"""
import json, os, sys
from concurrent.futures import ProcessPoolExecutor
from verifybench.kernels import mla_decode_select as mds, skinny_gemm_select as sgs

def job(j):
    kernel, c, cc, dtype = j
    return (sgs if kernel != "mla_decode" else mds).compiled_shared_bytes(c, cc, dtype)

ccs = json.loads(sys.argv[1])
fp32 = sgs.default_config(1, 4096, 4096, dtype=__import__("torch").float32)
jobs = [("skinny_gemm", c, cc, "bfloat16") for c in sgs.selectable_configs() for cc in ccs]
jobs += [("skinny_fp32_default", fp32, cc, "float32") for cc in ccs]
jobs += [("mla_decode", c, cc, "bfloat16") for c in mds.selectable_configs() for cc in ccs]
with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
    shared = list(pool.map(job, jobs))
out = {}
for (kernel, c, cc, _), b in zip(jobs, shared):
    out.setdefault(kernel, []).append([c, cc, b])
print(json.dumps(out))
"""

def _uninterpreted(code: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    run = subprocess.run([sys.executable, "-c", code, json.dumps(CCS)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def compiled() -> dict:
    return _uninterpreted(_WORKER)


def _tile(c: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in c.items() if k not in ("SPLIT_K", "reduce", "num_splits")))


def _select_with(monkeypatch, module, shared: dict, cc: int):
    """Selection as on a GPU of compute capability `cc` with that architecture's limit, answering compiles from
    `shared` (the figures compiled above)."""
    monkeypatch.setattr(config_tables, "device_limits", lambda device: (cc, LIMITS[cc]))
    monkeypatch.setattr(module, "compiled_shared_bytes", lambda c, cc_, *a, **k: shared[(_tile(module_tile(c)), cc_)])


def module_tile(c: dict) -> dict:
    keys = ("kind", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages") if "BLOCK_N" in c else tuple(mds.DEFAULT_CONFIG)
    return {k: c[k] for k in keys}


def test_defaults_fit_every_architecture(compiled):
    defaults = {_tile(module_tile(c)) for c in sgs.default_configs()[:-1]}
    assert len(defaults) == 3
    seen = set()
    for c, cc, shared in compiled["skinny_gemm"]:
        if _tile(module_tile(c)) in defaults:
            seen.add(_tile(module_tile(c)))
            assert shared <= LIMITS[cc], (cc, shared)
    assert seen == defaults
    for c, cc, shared in compiled["skinny_fp32_default"]:
        assert shared <= LIMITS[cc], ("fp32", cc, shared)
    for c, cc, shared in compiled["mla_decode"]:
        if c == mds.DEFAULT_CONFIG:
            assert shared <= LIMITS[cc], (cc, shared)


def test_bounds_are_upper_bounds_of_the_compiled_figure(compiled):
    for c, cc, shared in compiled["skinny_gemm"]:
        assert shared <= sgs.shared_bytes_bound(c), (c, cc, shared)
    for c, cc, shared in compiled["skinny_fp32_default"]:
        assert shared <= sgs.shared_bytes_bound(c, "float32"), (c, cc, shared)
    for c, cc, shared in compiled["mla_decode"]:
        assert shared <= mds.shared_bytes_bound(c), (c, cc, shared)


@pytest.mark.parametrize("cc", CCS)
def test_skinny_gemm_selection_never_returns_a_config_over_the_limit(compiled, monkeypatch, cc):
    shared = {(_tile(module_tile(c)), k): b for c, k, b in compiled["skinny_gemm"]}
    _select_with(monkeypatch, sgs, shared, cc)
    n_over = 0
    for c, k, need in compiled["skinny_gemm"]:
        if k != cc:
            continue
        n = 8 if c["kind"] == "dot" else 1
        table = {"cpu": {"shapes": {"4096,4096": {str(n): c}}}}
        got, source = sgs.select(n, 4096, 4096, "cpu", table)
        assert shared[(_tile(module_tile(got)), cc)] <= LIMITS[cc], (c, got)
        if need > LIMITS[cc]:
            n_over += 1
            assert source == config_tables.fit_source(need, LIMITS[cc]), (c, source)
        else:
            assert source == "tuned" and module_tile(got) == module_tile(c)
    assert n_over or LIMITS[cc] > 200_000  # the deep tuner tiles exceed the small-memory GPUs


@pytest.mark.parametrize("cc", CCS)
def test_mla_decode_selection_never_returns_a_config_over_the_limit(compiled, monkeypatch, cc):
    shared = {(_tile(c), k): b for c, k, b in compiled["mla_decode"]}
    _select_with(monkeypatch, mds, shared, cc)
    for c, k, need in compiled["mla_decode"]:
        if k != cc:
            continue
        table = {"cpu": {"shapes": {mds.shape_key(8, 8): {"4096": {**c, "num_splits": 32}}}}}
        got, source = mds.select(8, 8, 4104, "cpu", table)
        assert shared[(_tile(module_tile(got)), cc)] <= LIMITS[cc], (c, got)
        assert source == ("tuned" if need <= LIMITS[cc] else config_tables.fit_source(need, LIMITS[cc]))


def test_the_shipped_mla_entry_too_large_for_sm120_is_replaced_by_the_default(compiled, monkeypatch):
    shared = {(_tile(c), k): b for c, k, b in compiled["mla_decode"]}
    _select_with(monkeypatch, mds, shared, 120)
    table = {"cpu": mds.load_configs()["NVIDIA H200"]}  # n = 8 at 4096: 32 rows x 64 keys, 8 warps
    got, source = mds.select(8, 8, 4104, "cpu", table)
    assert source.startswith("default (tuned entry needs ") and got["block_rows"] == mds.DEFAULT_CONFIG["block_rows"]


def test_mla_verify_selection_defaults_and_engine_tiles_fit_every_architecture():
    # its selection is the default or the engine's tile for the architecture; the space's larger tiles are for a
    # tuner, which must skip what does not fit
    cases = [(v, None, cc) for v in mv.VARIANTS for cc in CCS]
    cases += [("extend", mv.ENGINE_EXTEND_CONFIGS[cc], cc) for cc in CCS]
    for (variant, cfg, cc), shared in zip(cases, early_jobs.in_parts(mv.shared_memory_bytes, cases)):
        assert shared and max(shared.values()) <= LIMITS[cc], (variant, cfg, cc, shared)


# The MoE's configs: tests/test_moe_int4.py compiles the tiles that bound every selectable one, per architecture.
