"""The allreduce component on CPU: a 2-rank gloo run under torchrun (table, JSON, checks, agreed counts), the failure
paths (a rank that exits early, a rank that hangs) ending the job non-zero within the bound, naming the rank and
leaving no process behind, the NCCL sweep driver (one fresh torchrun per setting), and the pure pieces.
"""
from __future__ import annotations

import re
import sys

import pytest
import torch

from verifybench.harness.dist.allreduce import parse_bytes, parse_int_list, plan_sizes
from verifybench.harness.dist.allreduce_results import build_cases, busbw_factor, table_rows
from verifybench.harness.dist.backends import BF16_EXACT_MAX, expected_sum, pattern_modulus
from verifybench.harness.dist.sweep import parse_nccl_log, parse_setting
from verifybench.harness.engine.results import load_run
from torchrun_jobs import BOUND_S, TORCHRUN, assert_no_orphans
from torchrun_jobs import run_job

FAST = ["--backend", "gloo", "--preset", "tiny", "--tokens", "1,2", "--warmup", "2", "--samples", "5",
        "--isolated-samples", "6", "--calls-per-sample", "3"]


def test_gloo_two_rank_run_prints_table_and_saves_checked_json(tmp_path):
    rc, out, _, tag = _run(TORCHRUN + ["-m", "verifybench.harness.dist.allreduce", *FAST, "--out", str(tmp_path), "--name", "r.json"])
    assert rc == 0, out[-3000:]
    assert re.search(r"size\(B\)\s+count\s+type\s+backend\s+mode\s+time\(us\)\s+algbw\(GB/s\)\s+busbw\(GB/s\)\s+#wrong",
                     out), out[-3000:]
    run = load_run(tmp_path / "r.json")
    assert run["component"] == "allreduce"
    assert run["extra"]["world_size"] == 2 and run["extra"]["complete"]
    cases = run["cases"]
    assert {(c["params"]["size_bytes"], c["params"]["mode"]) for c in cases} == {
        (s, m) for s in (512, 1024) for m in ("graph", "eager", "isolated")}
    for c in cases:
        assert c["check"]["ok"], c["check"]
        assert c["params"]["world_size"] == 2 and c["derived"]["wrong"] == 0
        assert len(c["derived"]["rank_medians_us"]) == 2  # both ranks contributed a time
        assert c["derived"]["time_us"] == max(c["derived"]["rank_medians_us"])
        assert c["warmup_calls"] == 2  # the agreed counts, not an adaptive stop
        assert len(c["samples_us"]) == (6 if c["params"]["mode"] == "isolated" else 5)
        assert c["calls_per_sample"] == (1 if c["params"]["mode"] == "isolated" else 3)
    assert_no_orphans(tag)


def test_rank_exiting_early_ends_job_nonzero_within_bound_naming_it(tmp_path):
    rc, out, wall_s, tag = _run(TORCHRUN + ["-m", "verifybench.harness.dist.allreduce", *FAST, "--out", str(tmp_path),
                                            "--fault", "exit-early:1@1"])
    assert rc != 0
    assert wall_s < BOUND_S
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\)", out, re.S), out[-3000:]
    assert_no_orphans(tag)


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_hanging_ends_job_nonzero_within_bound_naming_it(tmp_path, rank):
    rc, out, wall_s, tag = _run(TORCHRUN + ["-m", "verifybench.harness.dist.allreduce", *FAST, "--out", str(tmp_path),
                                            "--fault", f"hang:{rank}@1", "--hang-timeout", "4"])
    assert rc != 0
    assert wall_s < BOUND_S
    assert f"rank {rank} stopped making progress" in out, out[-3000:]
    assert f"waiting: rank {1 - rank}" in out
    assert_no_orphans(tag)


def test_nccl_sweep_runs_each_setting_in_a_fresh_torchrun(tmp_path):
    rc, out, _, tag = _run([sys.executable, "-m", "verifybench.harness.dist.allreduce", "--nccl-sweep", "--setting", "default",
                            "--setting", "NCCL_PROTO=LL,NCCL_MAX_NCHANNELS=2", *FAST, "--mode", "graph",
                            "--nproc-per-node", "2", "--out", str(tmp_path)], timeout_s=150)
    assert rc == 0, out[-3000:]
    assert "fastest setting per size" in out
    summary = next(tmp_path.glob("allreduce-sweep-*/summary.json"))
    run = load_run(summary)
    assert {c["params"]["nccl_setting"] for c in run["cases"]} == {"default", "NCCL_PROTO=LL,NCCL_MAX_NCHANNELS=2"}
    assert all(c["check"]["ok"] for c in run["cases"])
    # each setting reached its ranks' environment (recorded in their fingerprint), multicast still off
    for i, want in enumerate((None, "LL")):
        setting_run = load_run(next(summary.parent.glob(f"{i:02d}-*/allreduce.json")))
        env = setting_run["fingerprint"]["env"]
        assert env.get("NCCL_PROTO") == want
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert_no_orphans(tag)


def test_sweep_refuses_settings_that_enable_multicast():
    assert parse_setting("default") == ("default", {})
    assert parse_setting("NCCL_ALGO=^NVLS,NCCL_PROTO=LL")[1] == {"NCCL_ALGO": "^NVLS", "NCCL_PROTO": "LL"}
    for bad in ("NCCL_ALGO=NVLS", "NCCL_ALGO=Ring,NVLSTree", "NCCL_NVLS_ENABLE=1", "PROTO=LL"):
        with pytest.raises(ValueError):
            parse_setting(bad)


def test_nccl_log_parser_reads_transport_channels_env_and_choices():
    log = """host:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
host:1:1 [0] NCCL INFO NCCL_PROTO set by environment to LL
host:1:1 [0] NCCL INFO NCCL_NVLS_ENABLE set by environment to 0.
host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
host:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
host:1:1 [0] NCCL INFO Channel 00 : 1[1] -> 0[0] via SHM/direct/direct
host:1:1 [0] NCCL INFO 24 coll channels, 24 collnet channels, 0 nvls channels, 32 p2p channels
host:1:1 [0] NCCL INFO Best tuning, algorithm, RING, protocol, LL
host:1:1 [0] NCCL INFO AllReduce: 14336 Bytes -> Algo 1 proto 0 time 6.500000"""
    got = parse_nccl_log(log)
    assert got["version"] == "2.28.9+cuda13.0"
    assert got["transports"] == {"P2P/CUMEM/read": 2, "SHM/direct/direct": 1}
    assert got["env"] == {"NCCL_PROTO": "LL", "NCCL_NVLS_ENABLE": "0"}
    assert got["coll_channels"] == [24] and got["nvls_channels"] == [0]
    assert got["algo_proto"] == {"RING/LL": 1, "14336B Ring/LL": 1}


def test_verify_sizes_are_hidden_times_tokens_times_two_bytes():
    assert parse_int_list("1-8") == list(range(1, 9)) and parse_int_list("1,4-5") == [1, 4, 5]
    assert parse_bytes("14K") == 14336 and parse_bytes("1M") == 1 << 20 and parse_bytes("512") == 512
    sizes = plan_sizes(7168, list(range(1, 9)), [1], [], None)
    assert [s for s, _ in sizes] == [7168 * 2 * t for t in range(1, 9)]  # 14 KiB .. 112 KiB
    assert sizes[0] == (14336, "1 tok")
    with_batch = dict(plan_sizes(7168, [1, 2], [1, 4], [], (1024, 4096)))
    assert with_batch[7168 * 2 * 4] == "1 tok x 4 req" and {1024, 2048, 4096} <= set(with_batch)
    with pytest.raises(ValueError):
        plan_sizes(7168, [1], [1], [100], None)


def test_busbw_uses_the_nccl_tests_factor():
    assert busbw_factor(2) == 1.0 and busbw_factor(8) == 1.75 and busbw_factor(1) == 0.0


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 16, 64, 256])
def test_check_pattern_sums_are_exact_in_bf16_in_any_order(world_size):
    from verifybench.harness.dist.backends import _pattern_int

    numel = 1000
    exact = sum(_pattern_int(numel, r, world_size, "cpu") for r in range(world_size))
    assert int(exact.max()) <= BF16_EXACT_MAX and pattern_modulus(world_size) >= 1
    for order in (range(world_size), reversed(range(world_size))):  # a bf16 accumulation, as the backends do
        acc = torch.zeros(numel, dtype=torch.bfloat16)
        for r in order:
            acc = acc + _pattern_int(numel, r, world_size, "cpu").to(torch.bfloat16)
        assert torch.equal(acc, expected_sum(numel, world_size, "cpu"))


def _rank_record(samples_by_mode: dict, wrong_after: int = 0, wrong_eager: int = 0) -> dict:
    checks = [{"wrong_eager": wrong_eager, "wrong_graph": None, "error": None}] * 2
    modes = {}
    for mode, samples in samples_by_mode.items():
        m = {"mode": mode, "device": "cpu", "timer": "perf_counter", "samples_us": samples, "calls_per_sample": 1,
             "warmup_calls": 2, "stop_reason": "fixed_samples", "wall_s": 0.1, "clocks_before": None,
             "clocks_after": None, "summary": {"median_us": sorted(samples)[len(samples) // 2]}}
        modes[mode] = {"measurement": m, "wrong_after": wrong_after}
    return {"size_bytes": 1024, "origin": "1 tok", "checks": checks, "modes": modes}


def test_case_time_is_the_slowest_ranks_median_and_a_wrong_output_reports_no_time():
    plan = {"sizes": [(1024, "1 tok")], "modes": ["eager"], "preset": "tiny", "tp": 1, "hidden": 256,
            "calls_per_sample": 1}
    fast, slow = _rank_record({"eager": [1.0, 2.0, 3.0]}), _rank_record({"eager": [5.0, 6.0, 7.0]})
    (case,) = build_cases("gloo", [[fast], [slow]], plan, 2)
    assert case.check_ok and case.derived["time_us"] == 6.0 and case.derived["slowest_rank"] == 1
    assert case.measurement.samples_us == [5.0, 6.0, 7.0]
    assert case.derived["busbw_gbps"] == case.derived["algbw_gbps"] == 1024 / 6.0 / 1e3
    (bad,) = build_cases("gloo", [[fast], [_rank_record({"eager": [1.0]}, wrong_after=3)]], plan, 2)
    assert not bad.check_ok and bad.measurement is None and bad.derived["wrong"] == 3
    failed_check = _rank_record({}, wrong_eager=1)
    (bad,) = build_cases("gloo", [[failed_check], [failed_check]], plan, 2)
    assert not bad.check_ok and bad.measurement is None
    row = table_rows([{"params": {**bad.params}, "derived": bad.derived, "check": {"ok": False}}])[0]
    assert row["time(us)"] == "FAIL"


def _run(cmd: list[str], timeout_s: float = 120):
    return run_job(cmd, timeout_s)
