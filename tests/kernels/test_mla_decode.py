"""Over 400 lines: the kernel, its config selection and its component (with the engine's row) share these helpers.

MLA decode attention (kernels/mla_decode/): the reference against float64 and the forward's torch path, the
Triton kernel against the fp32 reference (interpreter on CPU, fp16/fp32: bf16 arithmetic is wrong in the
interpreter), every error path; on a GPU the Kimi-K2.5 shapes in bf16 and a CUDA-graph capture. Config selection
from the tuned table (hit, length buckets, fallbacks, malformed tables) and the tune smoke path. The component's
SGLang row against the released SGLang in .ci/engines where it can be imported.
"""
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported (conftest too)

from verifybench.harness.measure.results.store import WITHHELD  # noqa: E402
from verifybench.harness.measure.timing import floors  # noqa: E402
from verifybench.harness.measure.timing.runner import CPU_COPIES, rel_error  # noqa: E402
from verifybench.kernels.mla_decode import kernels as mdk  # noqa: E402
from verifybench.kernels.mla_decode import configs as mds  # noqa: E402
from verifybench.kernels.mla_decode.api import mla_decode, mla_decode_reference  # noqa: E402
from verifybench.kernels.mla_decode.configs import DEFAULT_CONFIG, default_num_splits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KIMI_SCALE = 192 ** -0.5  # (qk_nope + qk_rope) ** -0.5, what the verify forward passes


def _inputs(heads, n, d, length, dtype, spare=5, seed=0, peak=1.0, device=DEV):
    """q [heads, n, d] and a cache with `spare` rows past `length` (never read: filled with huge values so a read
    past `length` shows). `peak` scales q: large values make the softmax peaky, so the splits' maxima differ."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(heads, n, d, generator=g) * peak).to(dtype).to(device)
    cache = torch.randn(length + spare, d, generator=g)
    cache[length:] = 1e4
    return q, cache.to(dtype).to(device)


def _forward_torch_path(q, cache, length, kv_lora, scale):
    """attn_core's torch path with bf16 scores, op for op (harness/model/forward.py's _mla now scores in fp32)."""
    keys = cache[:length]
    scores = torch.matmul(q, keys.t()).float() * scale
    return torch.matmul(torch.softmax(scores, -1).to(q.dtype), keys[:, :kv_lora])


# ---------------------------------------------------------------------------------------------------- reference

def test_reference_equals_float64_softmax_attention_and_ignores_rows_past_length():
    q, cache = _inputs(3, 2, 48, 37, torch.float32, device="cpu")
    q64, k64 = q.double(), cache[:37].double()
    want = torch.softmax(q64 @ k64.T * 0.3, -1) @ k64[:, :32]
    got = mla_decode_reference(q, cache, 37, kv_lora=32, scale=0.3)
    assert got.dtype == torch.float32 and got.shape == (3, 2, 32)
    assert rel_error(got, want) < 1e-6
    default = mla_decode_reference(q, cache, 37, kv_lora=32)  # scale defaults to D ** -0.5
    assert rel_error(default, torch.softmax(q64 @ k64.T * 48 ** -0.5, -1) @ k64[:, :32]) < 1e-6


def test_reference_matches_the_forward_torch_path_in_bf16():
    q, cache = _inputs(4, 3, 576, 300, torch.bfloat16, device="cpu")
    ref = mla_decode_reference(q, cache, 300, 512, KIMI_SCALE)
    assert ref.dtype == torch.bfloat16
    assert rel_error(_forward_torch_path(q, cache, 300, 512, KIMI_SCALE).float(),
                     mla_decode_reference(q.float(), cache.float(), 300, 512, KIMI_SCALE)) <= 1e-2


# ---------------------------------------------------------------------------------------------------- kernel

# fp32 against the fp32 reference: exact up to rounding in the interpreter; tl.dot runs fp32 as tf32 on a GPU
FP32_TOL = 5e-3 if torch.cuda.is_available() else 1e-5


def _check_kernel(heads, n, d, kv_lora, length, dtype, num_splits, peak=1.0, scale=None, config=None, tol=1e-2):
    q, cache = _inputs(heads, n, d, length, dtype, seed=length * 31 + n, peak=peak)
    out = mla_decode(q, cache, length, kv_lora, scale, num_splits, config=config)
    assert out.dtype == dtype and out.shape == (heads, n, kv_lora)
    ref = mla_decode_reference(q.float(), cache.float(), length, kv_lora, scale)
    err = rel_error(out.float(), ref)
    assert err <= tol, (heads, n, d, kv_lora, length, num_splits, err)
    return err


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,length,num_splits", [
    (1, 1, 1),  # one key: o = that key's latent part
    (3, 77, 1),  # one split, a partial last tile: stage 1 writes o itself
    (3, 200, 3),  # 3 splits of 96 keys (3 tiles each), the last one partial
    (1, 130, 2),
])
def test_kernel_matches_reference_at_the_mla_head_dims(dtype, n, length, num_splits):
    limits = mds.devices.device_limits(DEV)
    if dtype == torch.float32 and limits and not mds.fits(mds.FP32_CONFIGS[-1], *limits, "float32", heads=2, n=n)[0]:
        with pytest.raises(ValueError, match="fp32 at D=576.*use bf16 or fp16"):  # e.g. sm_120's 101,376 B
            _check_kernel(2, n, 576, 512, length, dtype, num_splits, scale=KIMI_SCALE)
        return
    _check_kernel(2, n, 576, 512, length, dtype, num_splits, scale=KIMI_SCALE)


@pytest.mark.parametrize("d,kv_lora", [(48, 32), (48, 40), (32, 32), (40, 24)],
                         ids=["rope16", "lora-not-pow2", "no-rope", "both-not-pow2"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_kernel_is_generic_in_head_dim_and_kv_lora(d, kv_lora, num_splits):
    _check_kernel(3, 3, d, kv_lora, 131, torch.float16, num_splits)


def test_peaky_softmax_rescales_across_tiles_and_splits():
    # scores of std ~12: each row's mass sits on a few keys in some split, so both the online rescale inside a
    # split and the log-sum-exp combine across splits matter
    for num_splits in (1, 5):
        _check_kernel(2, 3, 48, 32, 301, torch.float32, num_splits, peak=12.0, tol=FP32_TOL)
        _check_kernel(2, 3, 48, 32, 301, torch.float16, num_splits, peak=12.0)


def test_more_splits_than_tiles_runs_no_empty_split():
    # 40 keys are 3 tiles of 16: 100 requested splits become 3, none empty (an empty one would divide by zero)
    _check_kernel(2, 2, 32, 32, 40, torch.float32, 100, config={"block_keys": 16}, tol=FP32_TOL)


def test_larger_row_and_key_blocks_and_rows_spanning_blocks():
    # 8 heads x 3 tokens = 24 rows: two row blocks of 16, or one of 32 / 64
    for cfg in ({"block_rows": 16}, {"block_rows": 32, "block_keys": 64}, {"block_rows": 64, "block_keys": 16}):
        _check_kernel(8, 3, 48, 32, 150, torch.float16, 3, config=cfg)


def test_many_splits_combine_in_one_step_over_column_chunks():
    # 150 splits: stage 2 holds all of them at once (256 padded), so its programs take 32 of the 64 columns each
    _check_kernel(2, 2, 80, 64, 2400, torch.float32, 150, peak=6.0, config={"block_keys": 16}, tol=FP32_TOL)


def test_out_argument_and_strided_query_views():
    q, cache = _inputs(4, 3, 48, 90, torch.float16)
    want = mla_decode_reference(q.float(), cache.float(), 90, 32)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # [heads, n, D] view of an [n, heads, D] buffer
    big = torch.zeros(4, 3, 64, dtype=torch.float16, device=DEV)
    out = big[:, :, 8:40]  # a strided out view: the rest of `big` stays zero
    for splits in (1, 2):
        got = mla_decode(q_t, cache, 90, 32, num_splits=splits, out=out)
        assert got is out and rel_error(out.float(), want) <= 1e-2
    assert not big[:, :, :8].any() and not big[:, :, 40:].any()


def test_default_splits_fill_the_sms_and_keep_splits_long():
    assert default_num_splits(4096 + 1, 8, 16, 132) == 65  # one row block: 4097 / 64 keys
    assert default_num_splits(32768 + 8, 64, 16, 132) == 66  # 4 row blocks: 2 x 132 programs
    assert default_num_splits(32768, 8, 16, 132) == 256  # one row block: capped
    assert default_num_splits(100, 64, 16, 132) == 2 and default_num_splits(64, 64, 16, 132) == 1
    assert default_num_splits(10 ** 7, 1, 16, 10 ** 4) == 256  # capped
    assert DEFAULT_CONFIG["block_rows"] >= 16 and DEFAULT_CONFIG["block_keys"] >= 16


# ---------------------------------------------------------------------------------------------------- errors

def _good():
    q, cache = _inputs(2, 2, 48, 20, torch.float16)
    return dict(q=q, cache=cache, length=20, kv_lora=32)


BAD_INPUTS = {
    "q 2-D": ({"q": lambda a: a["q"][0]}, r"q must be a \[heads, n, D\]"),
    "q not a tensor": ({"q": lambda a: [[1.0]]}, r"q must be a \[heads, n, D\]"),
    "cache 3-D": ({"cache": lambda a: a["cache"][None]}, r"cache must be a \[rows, D\]"),
    "no heads": ({"q": lambda a: a["q"][:0]}, "heads, n, D >= 1"),
    "cache D differs": ({"cache": lambda a: a["cache"][:, :40]}, "head dim D = 48"),
    "dtypes differ": ({"cache": lambda a: a["cache"].float()}, "share a dtype"),
    "int dtype": ({"q": lambda a: a["q"].long(), "cache": lambda a: a["cache"].long()}, "share a dtype"),
    "devices differ": ({"cache": lambda a: a["cache"].to("meta")}, "one device"),
    "length 0": ({"length": lambda a: 0}, r"length must be in 1\.\.25"),
    "length past the cache": ({"length": lambda a: 26}, r"length must be in 1\.\.25"),
    "length float": ({"length": lambda a: 20.0}, "length must be a Python int"),
    "length bool": ({"length": lambda a: True}, "length must be a Python int"),
    "length tensor": ({"length": lambda a: torch.tensor(20)}, "length must be a Python int"),
    "kv_lora past D": ({"kv_lora": lambda a: 49}, r"kv_lora must be an int in 1\.\.D = 48"),
    "kv_lora 0": ({"kv_lora": lambda a: 0}, "kv_lora must be"),
    "scale nan": ({"scale": lambda a: float("nan")}, "scale must be a finite"),
    "scale tensor": ({"scale": lambda a: torch.tensor(0.1)}, "scale must be a finite"),
}
KERNEL_BAD_INPUTS = {
    "num_splits 0": ({"num_splits": lambda a: 0}, "num_splits must be"),
    "num_splits float": ({"num_splits": lambda a: 2.0}, "num_splits must be"),
    "q strided along D": ({"q": lambda a: torch.cat([a["q"], a["q"]], -1)[..., ::2]}, "unit stride along D"),
    "out wrong shape": ({"out": lambda a: torch.empty(2, 2, 48, dtype=torch.float16, device=DEV)}, "out must be"),
    "out wrong dtype": ({"out": lambda a: torch.empty(2, 2, 32, device=DEV)}, "out must be"),
    "block_rows 8": ({"config": lambda a: {"block_rows": 8}}, "power of two >= 16"),
    "block_keys 24": ({"config": lambda a: {"block_keys": 24}}, "power of two >= 16"),
    "unknown config key": ({"config": lambda a: {"BLOCK_N": 32}}, "unknown config key"),
}


def _bad(changes):
    a = _good()
    for k, f in changes.items():
        a[k] = f(a)
    return a


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
@pytest.mark.parametrize("fn", [mla_decode_reference, mla_decode], ids=["reference", "kernel"])
def test_bad_input_raises_a_clear_value_error(case, fn):
    changes, match = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=match):
        fn(**_bad(changes))


@pytest.mark.parametrize("case", list(KERNEL_BAD_INPUTS), ids=list(KERNEL_BAD_INPUTS))
def test_bad_kernel_arguments_raise_a_clear_value_error(case):
    changes, match = KERNEL_BAD_INPUTS[case]
    with pytest.raises(ValueError, match=match):
        mla_decode(**_bad(changes))


# ---------------------------------------------------------------------------------------------------- configs

T4096 = {"num_splits": 64, "block_rows": 16, "block_keys": 64, "num_warps": 4, "num_stages": 2}
T32K = {"num_splits": 128, "block_rows": 32, "block_keys": 32, "num_warps": 8, "num_stages": 3}
TABLE = {"cpu": {"shapes": {"8,4,576,512": {"4096": {**T4096, "us": 5.0, "default_us": 9.0, "torch_us": 20.0},
                                            "32768": T32K}},
                 "tuned_on": {"preset": "test"}},
         "Other GPU": {"shapes": {"8,1,576,512": {"4096": T32K}}}}


@pytest.fixture
def fresh_selection():
    mds.cached_config.cache_clear()  # mla_decode caches select_config per shape
    yield
    mds.cached_config.cache_clear()


def test_select_config_hits_the_table_at_the_largest_bucket_not_above_length():
    sel = lambda length, **kw: mds.select_config(4, 8, length, "cpu", TABLE, **kw)  # noqa: E731
    assert sel(4096 + 4) == T4096  # the stored timings are not part of the config
    assert sel(20000) == T4096 and sel(32768) == T32K and sel(10 ** 6) == T32K
    assert sel(4095) == mds.default_config(4, 8, 4095)  # below every bucket
    assert sel(4100, d=48, kv_lora=32) == mds.default_config(4, 8, 4100)  # another head dim
    assert sel(4100, dtype=torch.float32) == mds.default_config(4, 8, 4100, dtype=torch.float32)  # 2-byte tunings
    assert mds.default_config(4, 8, 4100, dtype=torch.float32)["block_keys"] == mds.FP32_CONFIGS[0]["block_keys"]


def test_fp32_defaults_take_the_first_tile_that_fits_and_refuse_when_none_does(monkeypatch):
    monkeypatch.setattr(mds.devices, "device_limits", lambda device: (120, 101376))
    sizes = iter([(False, 176128), (True, 90000), (True, 80000)])
    monkeypatch.setattr(mds, "fits", lambda *a, **k: next(sizes))
    assert mds.default_config(1, 8, 4096, dtype=torch.float32)["block_keys"] == mds.FP32_CONFIGS[1]["block_keys"]
    monkeypatch.setattr(mds, "fits", lambda *a, **k: (False, 106496))
    with pytest.raises(ValueError, match="needs 106496 B of shared memory.*allows 101376 B: use bf16 or fp16"):
        mds.default_config(1, 8, 4096, dtype=torch.float32)
    assert mds.default_config(1, 8, 4096)["block_keys"] == DEFAULT_CONFIG["block_keys"]  # 2-byte: no question


def test_select_config_falls_back_to_todays_defaults():
    want = {"num_splits": 65, **DEFAULT_CONFIG}  # default_num_splits(4097, 8 rows, ...)
    assert mds.default_config(1, 8, 4097) == want
    assert mds.select_config(1, 8, 4097, "cpu", TABLE) == want  # GPU present, shape absent
    assert mds.select_config(1, 8, 4097, "cpu", {}) == want  # GPU absent
    assert mds.select_config(1, 8, 4097, "cpu", {"Other GPU": {}}) == want
    assert set(want) == set(mds.CONFIG_KEYS)


BAD_TABLES = {
    "table not a dict": ([1], "table must be a dict"),
    "gpu entry not a dict": ({"cpu": 3}, "entry 'cpu' must be"),
    "shapes not a dict": ({"cpu": {"shapes": []}}, "entry 'cpu' must be"),
    "buckets not a dict": ({"cpu": {"shapes": {"8,4,576,512": [T4096]}}}, "bad length buckets"),
    "bucket not an int": ({"cpu": {"shapes": {"8,4,576,512": {"4k": T4096}}}}, "bad length buckets"),
    "config not a dict": ({"cpu": {"shapes": {"8,4,576,512": {"4096": 64}}}}, "bucket 4096: config must be a dict"),
    "unknown key": ({"cpu": {"shapes": {"8,4,576,512": {"4096": {**T4096, "BLOCK_N": 3}}}}}, "unknown config key"),
    "block_rows 24": ({"cpu": {"shapes": {"8,4,576,512": {"4096": {**T4096, "block_rows": 24}}}}},
                      "block_rows must be a power of two"),
    "num_warps 3": ({"cpu": {"shapes": {"8,4,576,512": {"4096": {**T4096, "num_warps": 3}}}}}, "num_warps must"),
    "num_stages 0": ({"cpu": {"shapes": {"8,4,576,512": {"4096": {**T4096, "num_stages": 0}}}}}, "num_stages must"),
    "num_splits 0": ({"cpu": {"shapes": {"8,4,576,512": {"4096": {**T4096, "num_splits": 0}}}}}, "num_splits must"),
    "num_splits missing": ({"cpu": {"shapes": {"8,4,576,512": {"4096": {"block_rows": 16}}}}}, "num_splits missing"),
}


@pytest.mark.parametrize("case", list(BAD_TABLES), ids=list(BAD_TABLES))
def test_a_malformed_table_raises_a_clear_error(case):
    table, match = BAD_TABLES[case]
    with pytest.raises(ValueError, match=match):
        mds.select_config(4, 8, 5000, "cpu", table)


def test_load_configs_reads_once_and_rejects_bad_json(tmp_path):
    good = tmp_path / "good.json"
    mds.save_configs(TABLE, good)
    assert mds.load_configs(str(good)) == TABLE and mds.load_configs(str(good)) is mds.load_configs(str(good))
    assert mds.load_configs(str(tmp_path / "absent.json")) == {}
    for name, text, match in (("bad.json", "{not json", "not a valid config table"),
                              ("list.json", "[1, 2]", "must be a JSON object")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            mds.load_configs(str(tmp_path / name))
    assert json.loads(mds.CONFIG_PATH.read_text()) is not None  # the committed table parses


def test_mla_decode_selects_from_the_table_unless_told(monkeypatch, fresh_selection):
    q, cache = _inputs(8, 2, 48, 150, torch.float16)
    want = mla_decode_reference(q.float(), cache.float(), 150, 32)
    cfg = {"num_splits": 3, "block_rows": 16, "block_keys": 16, "num_warps": 4, "num_stages": 2}
    table = {mds.device_name(DEV): {"shapes": {"8,2,48,32": {"128": cfg}}}}
    seen = []
    real = mds.select_config
    monkeypatch.setattr(mds.config_tables, "merged", lambda path: table)  # the tables selection reads
    monkeypatch.setattr(mds, "select_config", lambda *a, **kw: seen.append((a, kw)) or real(*a, **kw))
    assert rel_error(mla_decode(q, cache, 150, 32).float(), want) <= 1e-2
    assert seen == [((2, 8, 150, q.device), {"d": 48, "kv_lora": 32, "dtype": torch.float16})]
    mla_decode(q, cache, 150, 32)
    assert len(seen) == 1  # cached per shape: eager calls pay a dict lookup
    mla_decode(q, cache, 150, 32, num_splits=2)
    mla_decode(q, cache, 150, 32, config={"block_keys": 32})
    assert len(seen) == 1  # an explicit split count or config bypasses the table
    got = mla_decode(q, cache, 150, 32, config=real(2, 8, 150, DEV, table, d=48, kv_lora=32,
                                                     dtype=torch.float16))  # a selected config is a valid config
    assert rel_error(got.float(), want) <= 1e-2
    table[mds.device_name(DEV)]["shapes"]["8,2,48,32"]["128"] = {**cfg, "block_keys": 24}
    mds.cached_config.cache_clear()
    with pytest.raises(ValueError, match="MLA decode config table"):
        mla_decode(q, cache, 150, 32)


def test_a_split_count_alone_takes_the_default_tile_of_the_dtype(monkeypatch):
    """fp32 with only num_splits given must not launch the 2-byte default tile (249,856 B on sm_90 at D=576)."""
    launched = []

    class Stop(Exception):
        pass

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(kw["BLOCK_N"])
                raise Stop
            return launch

    monkeypatch.setattr(mdk, "_split_kernel", Kernel())
    monkeypatch.setattr(mds.devices, "device_limits", lambda device: (90, 232448))
    for dtype in (torch.bfloat16, torch.float32):
        q, cache = _inputs(2, 1, 576, 130, dtype, device="cpu")
        with pytest.raises(Stop):
            mla_decode(q, cache, 130, 512, num_splits=2)
        assert launched[-1] == mds.default_config(1, 2, 130, "cpu", dtype)["block_keys"]
    assert launched == [mds.DEFAULT_CONFIG["block_keys"], mds.FP32_CONFIGS[0]["block_keys"]]


# ---------------------------------------------------------------------------------------------------- bench

def test_bench_shape_and_bytes_are_kimi_tp8():
    from verifybench.harness.components import mla_decode as bench

    a = bench.attn_shape("kimi-k2.5", 8)
    assert (a.heads, a.d, a.kv_lora) == (8, 576, 512) and a.scale == KIMI_SCALE
    assert bench.bytes_moved(a, 4, 4100) == (4100 * 576 + 8 * 4 * (576 + 512)) * 2
    cfg = {"num_splits": 100, "block_rows": 16, "block_keys": 16}
    assert bench.splits_run(cfg, 40) == 3 and bench.programs(cfg, a, 4, 40) == 2 * 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke profile")
def test_bench_cpu_cases_run_and_tables_pair_the_impls(monkeypatch):
    from verifybench.harness.components import mla_decode as bench

    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.1")  # the copy ceiling's time cap
    a = bench.attn_shape("tiny", 1)
    quick = {"calls_per_sample": CPU_COPIES, "max_time_s": 0.05}  # as the CPU cases, at a shorter cap
    records = [bench.make_case(a, 2, 64, impl, "cpu", quick, "tiny", 1).run().as_dict() for impl in bench.IMPLS]
    assert all(r["check"]["ok"] for r in records)
    # the interpreter is slow: a CPU case rotates over a few copies, not the cold rule's 64
    assert {r["derived"]["rotation"] for r in records} == {CPU_COPIES}
    title = "MLA decode: Triton (tuned / default config) vs the torch path and the engines' kernels"
    side = dict(bench.tables(records))[title]
    assert len(side) == 1 and side[0]["speedup"] == WITHHELD and side[0]["default_us"] > 0
    (gpu,) = dict(bench.tables([{**r, "device": "cuda"} for r in records]))[title]
    assert gpu["speedup"] == pytest.approx(gpu["torch_us"] / gpu["triton_us"])
    assert side[0]["config"].startswith("s")
    # our kernel's rows (tuned and default config) carry their floors, the torch path none
    for r in records:
        d = r["derived"]
        assert ("latency_floor_us" in d) == (r["params"]["impl"] != "torch")
        if "latency_floor_us" in d:
            assert d["latency_floor_us"] > 0
            assert d["bound"] == ("memory" if d["floor_us"] >= d["latency_floor_us"] else "latency")
            assert d["x_floor"] == pytest.approx(r["summary"]["median_us"] / max(d["floor_us"], d["latency_floor_us"]))
            assert d["latency_floor_launches"][0]["grid"] == [1, d["splits_run"]]  # row blocks x splits, stage 1
    near = dict(bench.tables(records))["MLA decode, our kernel, near the limit (" + floors.NOTE + ")"]
    assert [(r["impl"], r["mem_floor_us"]) for r in near] == [("triton", WITHHELD), ("triton-default", WITHHELD)]
    gpu_near = bench.tables([{**r, "device": "cuda"} for r in records])[-1][1]
    assert [r["x_floor"] for r in gpu_near] == [r["derived"]["x_floor"] for r in records[:2]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke profile")
def test_bench_sglang_row_runs_beside_ours_and_passes_its_check(monkeypatch):
    from verifybench.harness import engines
    from verifybench.harness.components import mla_decode as bench
    from verifybench.harness.engines import sglang

    try:
        sglang.decode_module()
    except engines.EngineMissing as e:
        pytest.skip(f"SGLang's kernels cannot be imported here: {e}")
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.1")
    a = bench.attn_shape("tiny", 1)
    records = [bench.make_case(a, 2, 64, impl, "cpu", {"max_time_s": 0.05}, "tiny", 1).run().as_dict()
               for impl in ("triton", "sglang.decode")]
    ours, engine = records
    assert engine["name"] == "mla/tiny-tp1/ctx64/sglang.decode/n2" and engine["check"]["ok"], engine["check"]
    assert engine["params"]["engine"] == engines.label("sglang") and engine["derived"]["rotation"] == CPU_COPIES
    assert engine["params"]["dtype"] == ours["params"]["dtype"] == "float16"
    title = "MLA decode: Triton (tuned / default config) vs the torch path and the engines' kernels"
    (side,) = dict(bench.tables(records))[title]
    assert side["sglang_us"] == engine["summary"]["median_us"] > 0 and side["triton/sglang"] == WITHHELD
    (gpu,) = dict(bench.tables([{**r, "device": "cuda"} for r in records]))[title]
    assert gpu["triton/sglang"] == pytest.approx(gpu["triton_us"] / gpu["sglang_us"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU listing")
def test_bench_sglang_rows_are_listed_by_their_own_name_and_skipped_in_one_line_without_sglang(monkeypatch):
    from verifybench.harness import engines
    from verifybench.harness.components import mla_decode as bench
    from verifybench.harness.engines import sglang

    def missing():
        raise engines.EngineMissing("sglang is not installed (pip show sglang: not found)")

    monkeypatch.setattr(sglang, "decode_module", missing)
    monkeypatch.setattr(bench, "INTERPRET", True)  # the CPU listing holds the interpreted kernels' rows
    names = {c.name for c in bench.cases("tiny", 1, 64)}
    assert {"mla/tiny-tp1/ctx256/triton/n1", "mla/tiny-tp1/ctx256/sglang.decode/n4"} <= names
    rec = bench.make_case(bench.attn_shape("tiny", 1), 1, 64, "sglang.decode", "cpu", {}, "tiny", 1).run().as_dict()
    assert rec["skipped"] == "the engine's rows: sglang is not installed (pip show sglang: not found)"
    assert "summary" not in rec


def test_bench_flashinfer_rows_are_listed_and_say_in_one_line_why_they_cannot_run_without_a_gpu(monkeypatch):
    from verifybench.harness.components import mla_decode as bench

    monkeypatch.setattr(bench, "INTERPRET", True)
    names = {c.name for c in bench.cases("tiny", 1, 64)}
    assert "mla/tiny-tp1/ctx256/flashinfer.decode/n4" in names
    rec = bench.make_case(bench.attn_shape("tiny", 1), 1, 64, "flashinfer.decode", "cpu", {}, "tiny", 1).run().as_dict()
    assert rec["skipped"].startswith("the engine's rows: ") and "\n" not in rec["skipped"] and "summary" not in rec


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter at the tiny shapes")
@pytest.mark.parametrize("lengths", [[70, 9], [33, 5, 50]], ids=["B2", "B3"])
def test_bench_b_requests_of_unequal_contexts_equal_each_run_alone_and_the_reference(lengths):
    """Ours (one launch per request), the torch path and, where it imports, SGLang's decode (one call): B requests
    over their own rows of one cache, each request's rows equal to it run alone and to the reference."""
    from verifybench.harness import engines
    from verifybench.harness.components import mla_decode as bench
    from verifybench.harness.engines import sglang

    a, n = bench.attn_shape("tiny", 1), 2
    firsts = [3 + sum(lengths[:b]) + 4 * b for b in range(len(lengths))]
    cache = torch.randn(firsts[-1] + lengths[-1] + 2, a.d, generator=torch.Generator().manual_seed(4)).half()
    starts, lens = torch.tensor(firsts, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)
    impls = ["triton", "torch"]
    try:
        sglang.decode_module()
        impls.append("sglang.decode")
    except engines.EngineMissing:
        pass
    for impl in impls:
        c = cache.float() if impl == "torch" else cache
        if impl == "sglang.decode":
            fn = bench.engine_fns(impl, a, n, starts, lens, (), (c,))[1]
            alone = lambda b: bench.engine_fns(impl, a, n, starts[b:b + 1], lens[b:b + 1], (), (c,))[1]  # noqa
        else:
            cfgs = [bench._config(impl, a, n, length, "cpu", c.dtype)[0] for length in lengths]
            fn = bench.requests_fn(impl, a, firsts, lengths, cfgs)
            alone = lambda b: bench.requests_fn(impl, a, firsts[b:b + 1], lengths[b:b + 1], cfgs[b:b + 1])  # noqa
        ok, detail = bench.check_requests(fn, alone, a, n, firsts, lengths, c)
        assert ok and f"each of {len(lengths)} requests run alone" in detail, (impl, detail)
        q = torch.randn(a.heads, len(lengths) * n, a.d).to(c.dtype)
        out = fn(q, c)
        for b, (s, length) in enumerate(zip(firsts, lengths)):
            rows = slice(b * n, (b + 1) * n)
            torch.testing.assert_close(out[:, rows], alone(b)(q[:, rows].contiguous(), c), msg=impl)
            ref = mla_decode_reference(q[:, rows].float(), c[s:].float(), length, a.kv_lora, a.scale)
            assert rel_error(out[:, rows].float(), ref.float()) < 1e-2, impl


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU listing")
def test_bench_batch_cases_carry_it_keep_the_one_request_names_and_count_every_requests_bytes(monkeypatch):
    from verifybench.harness.components import mla_decode as bench

    monkeypatch.setattr(bench, "INTERPRET", True)
    one = bench.cases("tiny", 1, 64)
    both = bench.cases("tiny", 1, 64, None, batch=(1, 2))
    ones = [s for s in both if s.params["batch"] == 1]
    assert [s.name for s in ones] == [s.name for s in one] and {s.params["batch"] for s in one} == {1}
    twos = {s.name for s in both if s.params["batch"] == 2}
    assert twos == {s.name.replace("/ctx256/", "/ctx256/B2/") for s in one}
    a = bench.attn_shape("kimi-k2.5", 8)
    assert bench.bytes_moved(a, 4, 4100, 2, batch=3) == 3 * bench.bytes_moved(a, 4, 4100)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke profile")
def test_bench_a_b2_case_runs_checked_per_request_and_the_table_keys_rows_by_batch(monkeypatch):
    from verifybench.harness.components import mla_decode as bench

    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.1")
    a = bench.attn_shape("tiny", 1)
    quick = {"calls_per_sample": CPU_COPIES, "max_time_s": 0.05}
    records = [bench.make_case(a, 2, 64, impl, "cpu", quick, "tiny", 1, b).run().as_dict()
               for b in (1, 2) for impl in ("triton", "torch")]
    bench.release()
    two = records[2]
    assert two["name"] == "mla/tiny-tp1/ctx64/B2/triton/n2" and two["params"]["batch"] == 2
    assert two["check"]["ok"] and "each of 2 requests run alone" in two["check"]["detail"]
    assert two["derived"]["bytes_moved"] == 2 * records[0]["derived"]["bytes_moved"]
    assert two["derived"]["programs"] == 2 * records[0]["derived"]["programs"]
    # B launches of each stage, one per request: the empty kernels repeat them
    assert two["derived"]["latency_floor_launches"] == 2 * records[0]["derived"]["latency_floor_launches"]
    title = "MLA decode: Triton (tuned / default config) vs the torch path and the engines' kernels"
    side = dict(bench.tables(records))[title]
    assert [(r["B"], r["speedup"]) for r in side] == [(1, WITHHELD), (2, WITHHELD)]
    gpu = dict(bench.tables([{**r, "device": "cuda"} for r in records]))[title]
    assert [r["speedup"] for r in gpu] == [pytest.approx(r["torch_us"] / r["triton_us"]) for r in gpu]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke profile")
def _missing():
    from verifybench.harness import engines

    raise engines.EngineMissing("sglang is not installed (pip show sglang: not found)")


def test_cli_batch_runs_both_batches_and_withholds_derived_figures(tmp_path, capsys, monkeypatch):
    from verifybench.harness.cli import main
    from verifybench.harness.engines import sglang
    from verifybench.harness.measure.results import store

    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.05")  # the plumbing, not the figures
    monkeypatch.setattr(sglang, "decode_module", _missing)  # its B requests are checked above; the interpreter is slow
    assert main(["mla_decode", "--batch", "1,2", "--tokens", "2", "--out", str(tmp_path)]) == 0
    assert "withheld" in capsys.readouterr().out
    [path] = tmp_path.glob("mla_decode-*.json")
    run = store.read_json(path)
    assert run["extra"]["batch"] == [1, 2]
    assert {c["params"]["batch"] for c in run["cases"] if c["check"]["ok"]} == {1, 2}
    assert main(["mla_decode", "--batch", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--batch" in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
def test_tune_smoke_writes_a_table_select_config_reads(tmp_path, monkeypatch):
    from verifybench.harness.tune import mla_decode as bench

    monkeypatch.setattr(bench, "SMOKE_SPLITS", (2,))
    monkeypatch.setattr(bench, "SMOKE_TILES", [(16, 32, 4, 2), (16, 16, 4, 3)])
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.1")
    out = tmp_path / "table.json"
    table = bench.tune(out=str(out), smoke=True, log=lambda *a: None)
    s = bench.SMOKE
    buckets = table["cpu"]["shapes"][mds.shape_key(s.heads, 2, s.d, s.kv_lora)]
    assert set(buckets) == {"64", "128"} and all(b["us"] > 0 and b["default_us"] > 0 for b in buckets.values())
    cfg = mds.select_config(2, s.heads, 64 + 2, "cpu", mds.load_configs(str(out)), d=s.d, kv_lora=s.kv_lora,
                           dtype=torch.float16)
    assert cfg == {k: buckets["64"][k] for k in mds.CONFIG_KEYS}


# ---------------------------------------------------------------------------------------------------- GPU

KIMI = dict(heads=8, d=576, kv_lora=512)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [4096, 32768])
def test_kimi_shapes_bf16_on_gpu_match_reference_and_the_torch_path(context):
    for n in range(1, 9):
        length = context + n
        err = _check_kernel(KIMI["heads"], n, KIMI["d"], KIMI["kv_lora"], length, torch.bfloat16, None,
                            scale=KIMI_SCALE)
        assert err <= 1e-2
    q, cache = _inputs(8, 8, 576, context + 8, torch.bfloat16, seed=1)
    ours = mla_decode(q, cache, context + 8, 512, KIMI_SCALE)
    torch_path = _forward_torch_path(q, cache, context + 8, 512, KIMI_SCALE)
    assert rel_error(ours.float(), torch_path.float()) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    {"block_rows": 32, "num_warps": 8}, {"block_rows": 64, "num_warps": 8}, {"block_keys": 64},
    {"block_keys": 16, "num_stages": 3}], ids=["rows32", "rows64", "keys64", "keys16"])
def test_alternative_configs_compile_and_match_on_gpu(config):
    for n, splits in ((1, None), (8, None), (8, 1)):
        _check_kernel(8, n, 576, 512, 4096 + n, torch.bfloat16, splits, scale=KIMI_SCALE, config=config)


@pytest.mark.gpu
def test_cuda_graph_capture_replays_with_new_inputs():
    length = 4096 + 4
    q, cache = _inputs(8, 4, 576, length, torch.bfloat16)
    out = torch.empty(8, 4, 512, dtype=torch.bfloat16, device="cuda")
    for splits in (None, 1):
        mla_decode(q, cache, length, 512, KIMI_SCALE, splits, out=out)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mla_decode(q, cache, length, 512, KIMI_SCALE, splits, out=out)
        q2, cache2 = _inputs(8, 4, 576, length, torch.bfloat16, seed=7)
        q.copy_(q2)
        cache.copy_(cache2)
        graph.replay()
        torch.cuda.synchronize()
        want = mla_decode_reference(q.float(), cache.float(), length, 512, KIMI_SCALE)
        assert rel_error(out.float(), want) <= 1e-2
