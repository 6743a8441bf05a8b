"""Every config a tuned Triton kernel can be given (shipped tables, defaults, tuner spaces) compiled for sm_80 ...
sm_120 on CPU, and selection held to each architecture's shared memory per block: it never returns a config that
does not fit, the defaults fit everywhere, and the no-compile bounds selection trusts are upper bounds of the real
figure."""
import concurrent.futures
import os
import threading

import pytest
import torch
import triton

from verifybench.kernels.common import compiler, config_tables, devices
from verifybench.kernels.mla_decode import configs as mds
from verifybench.kernels.mla_verify import api as mv
from verifybench.kernels.moe_int4 import kernels as mk
from verifybench.kernels.moe_int4 import configs as ms
from verifybench.kernels.skinny_gemm import configs as sgs

CCS = (80, 86, 89, 90, 100, 120)
LIMITS = devices.SMEM_LIMIT_BYTES

pytestmark = pytest.mark.skipif("nvidia" not in triton.backends.backends,
                                reason="this triton has no NVIDIA backend to compile for")

VERIFY_CASES = [(v, None, cc) for v in mv.VARIANTS for cc in CCS]
VERIFY_CASES += [("extend", mv.ENGINE_EXTEND_CONFIGS[cc], cc) for cc in CCS]


def _largest_tiles(configs: list[dict], dequant: str) -> dict:
    """The selectable MoE config of `dequant` with the largest gate_up tile (rows x words x warps, prefetch) and the
    largest down tile (rows, then row iterations): the shared memory of these kernels is reduction scratch that
    grows with the tile (no other parameter changes it), so this config bounds the others of its dequant."""
    mine = [c for c in configs if c["dequant"] == dequant]
    gate_up = max((c["gate_up"] for c in mine), key=lambda g: (g["BLOCK_N"] * g.get("BLOCK_W", 128) * g["num_warps"],
                                                                 g.get("PREFETCH", 1)))
    down = max((c["down"] for c in mine), key=lambda d: (d["BLOCK_N"], d.get("ROW_ITERS", 1)))
    return next(c for c in mine if c["gate_up"] == gate_up and c["down"] == down)  # selectable itself


def _moe_configs() -> list[dict]:
    return [{**ms.DEFAULT_CONFIG, **c} for c in ms.selectable_configs()]


def _moe_cases() -> list[tuple[dict, int]]:
    """Per architecture the MoE default and, per dequant, the selectable config with the largest tiles; pdl configs
    are selectable (and compiled with PDL) on sm_90+ only."""
    cases = []
    for cc in CCS:
        here = [c for c in _moe_configs() if cc >= 90 or not c.get("pdl")]
        cases += [(c, cc) for c in [ms.DEFAULT_CONFIG, *(_largest_tiles(here, d) for d in mk.DEQUANTS)]]
    return cases


@pytest.fixture(scope="module")
def compiled() -> dict:
    """kernel -> [[config, cc, figure]] of every (config, architecture), compiled in one Python without
    TRITON_INTERPRET (the interpreter's kernels cannot be compiled): figures its disk cache holds are read there,
    the rest compiled on a process per core (compile_many); kernels dedupe tiles."""
    fp32 = sgs.default_config(1, 4096, 4096, dtype=torch.float32)
    jobs = [("mla_verify", mv, [case]) for case in VERIFY_CASES]  # the slower compiles first
    jobs += [("moe", ms, c, cc) for c, cc in _moe_cases()]
    jobs += [("mla_decode", mds, c, cc, "bfloat16") for c in mds.selectable_configs() for cc in CCS]
    jobs += [("skinny_gemm", sgs, c, cc, "bfloat16") for c in sgs.selectable_configs() for cc in CCS]
    jobs += [("skinny_fp32_default", sgs, fp32, cc, "float32") for cc in CCS]
    calls = [[module.__name__, "shared_memory_bytes" if module is mv else "compiled_shared_bytes", *args]
             for _, module, *args in jobs]
    shared = compiler.uninterpreted(compiler.__name__, "compile_many", calls)
    assert len(shared) == len(calls)
    out = {}
    for (kernel, _, *args), b in zip(jobs, shared):
        out.setdefault(kernel, []).append(b[0] if kernel == "mla_verify" else [*args[:2], b])
    return out


def _tile(c: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in c.items() if k not in ("SPLIT_K", "reduce", "num_splits")))


def _select_with(monkeypatch, module, shared: dict, cc: int):
    """Selection as on a GPU of compute capability `cc` with that architecture's limit, answering compiles from
    `shared` (the figures compiled above)."""
    monkeypatch.setattr(devices, "device_limits", lambda device: (cc, LIMITS[cc]))
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


def test_mla_verify_selection_defaults_and_engine_tiles_fit_every_architecture(compiled):
    # its selection is the default or the engine's tile for the architecture; the space's larger tiles are for a
    # tuner, which must skip what does not fit
    for (variant, cfg, cc), shared in zip(VERIFY_CASES, compiled["mla_verify"]):
        assert shared and max(shared.values()) <= LIMITS[cc], (variant, cfg, cc, shared)
        assert set(shared) == ({"_extend_kernel"} if variant == "extend" else {"_split_kernel", "_combine_kernel"})
        if cfg is None and cc in (80, 90, 120):  # the defaults at K2.5 TP8 fit the users' card even where compiled
            assert all(0 < b <= LIMITS[120] for b in shared.values()), (variant, cc, shared)


def test_every_selectable_moe_config_fits_each_architecture(compiled):
    """The MoE's default and, per dequant, the selectable config with the largest tiles (shipped entries and tuner
    space alike) need no more shared memory per block than the architecture allows."""
    configs = _moe_configs()
    assert ms.DEFAULT_CONFIG in configs and any(c["dequant"] == "denormal" for c in configs)
    for c, cc, shared in compiled["moe"]:
        assert 0 <= shared <= LIMITS[cc], (cc, shared, c)


class _Kernel:
    """What compiled_shared reads of a kernel before it compiles."""
    arg_names = ()

    def __init__(self, name: str):
        self.__name__ = self.cache_key = name


def _stand_in(name: str) -> int:
    return compiler.compiled_shared(_Kernel(name), {}, {}, {}, 80)


def _thread() -> str:
    return threading.current_thread().name


def test_compile_many_compiles_only_what_the_cache_lacks(tmp_path, monkeypatch):
    # a stand-in compile that notes where it ran, and threads for workers: what is checked is which call runs where
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiled = []

    def compile_(source, target, options):
        compiled.append((source.name, _thread()))
        return 16 * len(source.name)

    monkeypatch.setattr(compiler, "_shared_at_llir", compile_)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", concurrent.futures.ThreadPoolExecutor)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    names = ["a" * i for i in range(1, 7)]
    calls = [[__name__, "_stand_in", n] for n in names]
    here = _thread()

    assert compiler.compile_many(calls[:2]) == [16, 32]  # 2 misses: too few for 2 workers
    assert sorted(compiled) == [("a", here), ("aa", here)]
    compiled.clear()
    figures = compiler.compile_many(calls)  # 4 misses: on the workers
    assert figures == [16 * len(n) for n in names]
    assert sorted(n for n, _ in compiled) == names[2:] and all(t != here for _, t in compiled)
    compiled.clear()
    assert compiler.compile_many(calls) == figures and not compiled  # all cached: no worker


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA 0x0090 ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   STL [R1+0x10], R4 ;
        /*0040*/                   HMMA.16816.F32.BF16 R8, R12, R14, R8 ;
        /*0050*/                   LDL R4, [R1+0x10] ;
        /*0060*/               @P1 BRA 0x0020 ;
        /*0070*/                   LDL R6, [R1+0x14] ;
        /*0080*/                   BRA 0x0080 ;
        /*0090*/                   EXIT ;
"""


def test_sass_loops_count_each_backward_branchs_body_and_nothing_outside_it():
    """One loop, 0x20-0x60: a load, a spill store and its reload, an MMA. The forward branch, the load after the
    loop and the branch to itself that a kernel's code ends with are no loop's."""
    from verifybench.kernels.common.compiler import sass_loops

    assert sass_loops(SASS) == [{"instructions": 5, "local_loads": 1, "local_stores": 1, "global_loads": 1, "mma": 1}]
