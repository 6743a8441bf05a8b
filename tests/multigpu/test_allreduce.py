"""The allreduce component on CPU: an 8-rank gloo run under torchrun (table, JSON, checks, agreed counts), the failure
paths (a rank that exits early, a rank that hangs) ending the job non-zero within the bound, naming the rank and
leaving no process behind, the NCCL sweep driver (one fresh 8-rank torchrun per setting, ranking, combination,
export lines), the measured stand-in figure read back from a result, and the pure pieces.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import early_jobs
from verifybench.harness.multigpu import sweep
from verifybench.harness.analysis.numbers import batch_counts, token_counts
from verifybench.harness.multigpu.allreduce import main as allreduce_main, parse_bytes, plan_sizes
from verifybench.harness.collectives.allreduce_results import build_cases, busbw_factor, stand_in_from_result, table_rows
from verifybench.harness.collectives.backends import BF16_EXACT_MAX, expected_sum, pattern_modulus
from verifybench.harness.multigpu.sweep import parse_nccl_log, parse_setting
from verifybench.harness.measure.results import store
from verifybench.harness.measure.results.store import load_run
from verifybench.harness.model.build import allreduce_stand_in_us
from torchrun_jobs import BOUND_S, TORCHRUN, assert_no_orphans
from torchrun_jobs import run_job, run_jobs_at_once

DROP_ENV = ("VERIFYBENCH_ALLREDUCE_US", "VERIFYBENCH_ALLREDUCE_FROM")  # the defaults these tests assert
TORCHRUN_8 = [a for a in TORCHRUN if not a.startswith("--nproc-per-node")] + ["--nproc-per-node=8"]

FAST = ["--backend", "gloo", "--preset", "tiny", "--tokens", "1,2", "--warmup", "2", "--samples", "5",
        "--isolated-samples", "6", "--calls-per-sample", "3"]


def _quick_sweep_job():
    out_dir = early_jobs.scratch("sweep")
    return (*_run([sys.executable, "-m", "verifybench.harness.multigpu.allreduce", "--nccl-sweep", "--quick", *FAST,
                   "--mode", "graph,eager,isolated", "--nproc-per-node", "8", "--out", str(out_dir)], timeout_s=240),
            out_dir)


def _killed_driver_job():
    """A driver that starts a job as run_setting does (a sleeper that carries a tag), then dies by SIGKILL."""
    tag = f"killed-driver-{os.getpid()}"
    code = ("import os, signal, subprocess, sys; from verifybench.harness.multigpu import sweep; "
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{tag}'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, "
            "preexec_fn=sweep._end_with_driver); os.kill(os.getpid(), signal.SIGKILL)")  # our pipes not held open
    return early_jobs.run([sys.executable, "-c", code], timeout_s=120).returncode, tag


EARLY_JOBS = {"quick_sweep": _quick_sweep_job, "killed_driver": _killed_driver_job}  # started at collection


@pytest.fixture(scope="module")
def quick_sweep():
    """One quick sweep (two settings, each a fresh 8-rank gloo torchrun, every mode): the 8-rank allreduce job and
    the sweep driver are both checked on it, so CI starts the 8 ranks twice, not three times."""
    rc, out, _, tag, out_dir = early_jobs.job_result(f"{__name__}::quick_sweep", _quick_sweep_job)
    assert rc == 0, out[-3000:]
    assert_no_orphans(tag)
    return out, next(out_dir.glob("allreduce_sweep-*.json"))


@pytest.fixture(scope="module")
def killed_driver():
    return early_jobs.job_result(f"{__name__}::killed_driver", _killed_driver_job)


def test_gloo_eight_rank_run_prints_table_and_saves_checked_json(quick_sweep):
    _, summary = quick_sweep
    job = next(summary.with_suffix("").glob("00-*"))  # the runs sit in the folder of its name
    out = (job / "output.log").read_text()
    # gloo: CPU-timed, so the bandwidth columns are named withheld once above the table (stance.py)
    assert "withheld (CPU numbers): algbw(GB/s), busbw(GB/s)" in out, out[-3000:]
    assert re.search(r"size\(B\)\s+count\s+type\s+backend\s+mode\s+time\(us\)\s+#wrong", out), out[-3000:]
    run = load_run(job / "allreduce.json")
    assert run["component"] == "allreduce"
    assert run["extra"]["world_size"] == 8 and run["extra"]["complete"]
    cases = run["cases"]
    assert {(c["params"]["size_bytes"], c["params"]["mode"]) for c in cases} == {
        (s, m) for s in (512, 1024) for m in ("graph", "eager", "isolated")}
    for c in cases:
        assert c["check"]["ok"], c["check"]
        assert c["params"]["world_size"] == 8 and c["derived"]["wrong"] == 0
        assert len(c["derived"]["rank_medians_us"]) == 8  # every rank contributed a time
        assert c["derived"]["time_us"] == max(c["derived"]["rank_medians_us"])
        assert c["warmup_calls"] == 2  # the agreed counts, not an adaptive stop
        assert len(c["samples_us"]) == (6 if c["params"]["mode"] == "isolated" else 5)
        assert c["calls_per_sample"] == (1 if c["params"]["mode"] == "isolated" else 3)


FAULTS = ("exit-early:1@1", "hang:0@1", "hang:1@1")


def _fault_jobs() -> dict:
    cmds = [TORCHRUN + ["-m", "verifybench.harness.multigpu.allreduce", *FAST, "--out",
                        str(early_jobs.scratch("fault")), "--fault", fault]
            + (["--hang-timeout", "4"] if fault.startswith("hang") else []) for fault in FAULTS]
    return dict(zip(FAULTS, run_jobs_at_once(cmds, 120, drop_env=DROP_ENV)))


TIMED_JOBS = {"fault_runs": _fault_jobs}  # timed bounds: last, with the other timed jobs (tests/early_jobs.py)


@pytest.fixture(scope="module")
def fault_runs() -> dict:
    """fault -> (rc, output, wall seconds, tag) of a 2-rank job with that fault, the jobs run at once."""
    return early_jobs.timed_result(f"{__name__}::fault_runs", _fault_jobs)


def test_rank_exiting_early_ends_job_nonzero_within_bound_naming_it(fault_runs):
    rc, out, wall_s, tag = fault_runs["exit-early:1@1"]
    assert rc != 0
    assert wall_s < BOUND_S
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\)", out, re.S), out[-3000:]
    assert_no_orphans(tag)


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_hanging_ends_job_nonzero_within_bound_naming_it(fault_runs, rank):
    rc, out, wall_s, tag = fault_runs[f"hang:{rank}@1"]
    assert rc != 0
    assert wall_s < BOUND_S
    assert f"rank {rank} stopped making progress" in out, out[-3000:]
    assert f"waiting: rank {1 - rank}" in out
    assert_no_orphans(tag)


def test_quick_nccl_sweep_runs_each_setting_in_a_fresh_eight_rank_torchrun_and_prints_exports(quick_sweep):
    out, summary = quick_sweep
    assert "1. [default] default" in out and "2. [protocol x algorithm] NCCL_PROTO=LL,NCCL_ALGO=Ring" in out
    assert "the NCCL variables do nothing here" in out  # gloo: a plumbing check, said so
    assert re.search(r"\[sweep 1/3, \d+/1800 s\] default \.\.\. ok", out), out[-3000:]
    assert "cpu-loop time (us) per NCCL setting" in out and "graph-mode time" not in out  # CPU: no CUDA graph
    assert "settings ranked at verify sizes" not in out
    assert "no NCCL recommendation" in out and not re.search(r"^export ", out, re.M)  # gloo: no winner to paste
    run = load_run(summary)
    assert {c["params"]["nccl_setting"] for c in run["cases"]} == {"default", "NCCL_PROTO=LL,NCCL_ALGO=Ring"}
    assert all(c["check"]["ok"] and c["params"]["world_size"] == 8 for c in run["cases"])
    assert run["extra"]["winner"] is None  # gloo: CPU numbers name no winner
    # each setting reached its ranks' environment (recorded in their fingerprint), multicast still off
    for i, want in enumerate((None, "LL")):
        setting_run = load_run(next(summary.with_suffix("").glob(f"{i:02d}-*/allreduce.json")))
        env = setting_run["fingerprint"]["env"]
        assert env.get("NCCL_PROTO") == want
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    if torch.cuda.is_available():  # a GPU run's stand-in takes no gloo latency
        with pytest.raises(ValueError, match=r"a CPU \(gloo\) run"):
            stand_in_from_result(str(summary), 512)
        return
    us, source = stand_in_from_result(str(summary), 512)  # a sweep summary serves as the stand-in's source
    assert us > 0 and "under NCCL setting" in source and "CPU numbers" in source


def test_sweep_list_names_every_pcie_knob_and_the_combination(capsys):
    assert allreduce_main(["--list"]) == 0
    out = capsys.readouterr().out
    for setting in ("NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_P2P_LEVEL=PXB", "NCCL_P2P_LEVEL=PHB",
                    "NCCL_P2P_LEVEL=SYS", "NCCL_BUFFSIZE=1048576", "NCCL_BUFFSIZE=8388608", "NCCL_NTHREADS=64",
                    "NCCL_NTHREADS=512", "NCCL_MIN_NCHANNELS=1,NCCL_MAX_NCHANNELS=1",
                    "NCCL_MIN_NCHANNELS=32,NCCL_MAX_NCHANNELS=32", "NCCL_PROTO=LL128,NCCL_ALGO=Tree",
                    "NCCL_PROTO=Simple,NCCL_ALGO=Ring"):
        assert f"] {setting}\n" in out, setting
    assert "best of each group combined" in out
    assert sweep.group_of({"NCCL_P2P_LEVEL": "SYS"}) == "transport" and sweep.group_of({}) == "default"


def _outcome(label: str, env: dict, times: dict[int, float], status: str = "ok") -> dict:
    cases = [{"params": {"backend": "nccl", "size_bytes": s, "mode": "graph", "origin": f"{s // 512} tok"},
              "check": {"ok": True}, "derived": {"time_us": t}} for s, t in times.items()]
    return {"label": label, "group": sweep.group_of(env), "env": env, "status": status, "run": {"cases": cases}}


def test_cpu_sweep_tables_show_the_times_only_no_fastest_setting_nor_ranking():
    outcomes = [{**_outcome("default", {}, {512: 20.0}), "nccl_log": {}},
                {**_outcome("NCCL_PROTO=LL", {"NCCL_PROTO": "LL"}, {512: 10.0}), "nccl_log": {}}]
    gpu = dict(sweep.summary_tables(outcomes))
    assert gpu["fastest setting per size"][0]["gain vs default"] == "+50.0%"
    for o in outcomes:
        for c in o["run"]["cases"]:
            c["device"] = "cpu"
    (title, grid), = sweep.summary_tables(outcomes)
    assert "not ranked" in title and [r["setting"] for r in grid] == ["default", "NCCL_PROTO=LL"]


def test_sweep_ranks_at_verify_sizes_and_combines_the_best_of_independent_groups():
    outcomes = [_outcome("default", {}, {512: 20.0, 1024: 22.0}),
                _outcome("NCCL_PROTO=LL,NCCL_ALGO=Ring", {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"},
                         {512: 10, 1024: 11}),
                _outcome("NCCL_PROTO=Simple,NCCL_ALGO=Tree", {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Tree"},
                         {512: 15, 1024: 16}),
                _outcome("NCCL_NTHREADS=256", {"NCCL_NTHREADS": "256"}, {512: 18, 1024: 21}),
                _outcome("NCCL_BUFFSIZE=8388608", {"NCCL_BUFFSIZE": "8388608"}, {512: 30, 1024: 30}),  # slower
                _outcome("NCCL_P2P_LEVEL=SYS", {"NCCL_P2P_LEVEL": "SYS"}, {512: 5.0}),  # one size missing
                _outcome("NCCL_SHM_DISABLE=1", {"NCCL_SHM_DISABLE": "1"}, {}, status="exit 1")]
    ranking = sweep.rank_settings(outcomes)
    assert [r["setting"] for r in ranking] == ["NCCL_PROTO=LL,NCCL_ALGO=Ring", "NCCL_PROTO=Simple,NCCL_ALGO=Tree",
                                               "NCCL_NTHREADS=256", "default", "NCCL_BUFFSIZE=8388608"]
    assert ranking[0]["x default"] == pytest.approx((110 / 440) ** 0.5)
    labels, env = sweep.combine_winners(outcomes, ranking)
    assert labels == ["NCCL_PROTO=LL,NCCL_ALGO=Ring", "NCCL_NTHREADS=256"]  # one per group, only those that beat it
    assert env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_NTHREADS": "256"}
    assert sweep.combine_winners(outcomes[:2], sweep.rank_settings(outcomes[:2])) is None  # one group: no new run
    lines = sweep.export_lines(env, {"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO", "PATH": "/bin"})
    assert lines == ["export NCCL_ALGO=Ring", "export NCCL_IB_DISABLE=1", "export NCCL_NTHREADS=256",
                     "export NCCL_PROTO=LL"]  # what every setting ran under and the winner's: nothing unmeasured


def _stub_setting(label, env, folder, args, nproc, backends, timeout_s) -> dict:
    """run_setting without a torchrun: a gloo run whose LL setting is 40% faster than the default."""
    t = 6.0 if env else 10.0
    case = {"name": "allreduce/gloo/512B/graph", "check": {"ok": True, "detail": ""}, "mode": "graph",
            "device": "cpu", "samples_us": [t], "summary": {"median_us": t}, "derived": {"time_us": t},
            "params": {"backend": "gloo", "size_bytes": 512, "mode": "graph", "origin": "1 tok"}}
    return {"label": label, "group": sweep.group_of(env), "env": env, "status": "ok", "wall_s": 0.1,
            "run": {"fingerprint": {"env": {}}, "cases": [case]}, "nccl_log": {}, "output_tail": [], "folder": None}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a gloo sweep on a CPU box: its folder, its launch env")
def test_sweep_without_out_saves_under_the_default_folder_exports_only_what_it_measured_and_withholds_cpu_gains(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep, "run_setting", _stub_setting)
    monkeypatch.setattr(sweep, "_gpu_count", lambda: 0)
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):  # launched as on an NVSwitch box
        monkeypatch.delenv(key, raising=False)
    assert allreduce_main(["--nccl-sweep", "--setting", "default", "--setting", "NCCL_PROTO=LL"]) == 0
    out = capsys.readouterr().out
    (summary,) = (tmp_path / store.DEFAULT_OUT / "cpu").glob("allreduce_sweep-*.json")
    assert load_run(summary)["component"] == "allreduce_sweep"
    assert "every setting runs with NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (launched with " \
           "NCCL_NVLS_ENABLE unset" in out  # what it measured under, said once
    assert "+40.0%" not in out and "settings ranked" not in out and "CPU numbers" in out  # no gain, no ranking


@pytest.mark.skipif(torch.cuda.is_available(), reason="a gloo sweep on a CPU box")
def test_cpu_sweep_prints_no_export_line_no_winner_and_says_it_recommends_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "run_setting", _stub_setting)  # its LL setting is 40% faster than the default
    monkeypatch.setattr(sweep, "_gpu_count", lambda: 0)
    assert allreduce_main(["--nccl-sweep", "--setting", "default", "--setting", "NCCL_PROTO=LL",
                           "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"^export ", out, re.M) and "fastest" not in out and "winner" not in out.split("NOTE")[-1]
    assert "no recommendation: CPU sweep results give no NCCL recommendation" in out
    assert "combined: not run (CPU numbers" in out  # nothing won, so nothing is combined
    (summary,) = tmp_path.glob("allreduce_sweep-*.json")
    extra = load_run(summary)["extra"]
    assert extra["winner"] is None and extra["ranking"] == [] and "no NCCL recommendation" in extra["recommendation"]


def test_gpu_sweep_still_names_its_winner_and_prints_its_export_lines(tmp_path, monkeypatch, capsys):
    def gpu_setting(*args):
        outcome = _stub_setting(*args)
        for c in outcome["run"]["cases"]:
            c["device"], c["params"]["backend"] = "cuda", "nccl"
        return outcome

    monkeypatch.setattr(sweep, "run_setting", gpu_setting)
    monkeypatch.setattr(sweep, "_gpu_count", lambda: 2)
    assert allreduce_main(["--nccl-sweep", "--setting", "default", "--setting", "NCCL_PROTO=LL",
                           "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fastest at verify sizes: NCCL_PROTO=LL; paste to use it:" in out and "export NCCL_PROTO=LL" in out


def test_sigterm_mid_sweep_ends_the_setting_as_ctrl_c_does_exit_130_in_one_line(tmp_path, monkeypatch, capsys):
    """`timeout` and `kill` send SIGTERM: the driver ends the running setting's torchrun (its finally) instead of dying
    past it, and leaves SIGTERM as it found it."""
    def terminated_mid_setting(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises here
        raise AssertionError("SIGTERM did not interrupt the setting")

    monkeypatch.setattr(sweep, "run_setting", terminated_mid_setting)
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    assert allreduce_main(["--nccl-sweep", "--quick", "--out", str(tmp_path)]) == 130
    assert time.monotonic() - t0 < 20 and signal.getsignal(signal.SIGTERM) == before
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted: the setting's torchrun is ended"), err
    assert not list(tmp_path.glob("allreduce_sweep-*.json"))  # no summary of a sweep that did not finish


def test_a_setting_job_ends_when_its_driver_is_killed_outright(killed_driver):
    """SIGKILL runs no handler of the driver's: the job learns of it from the kernel (parent-death signal)."""
    rc, tag = killed_driver
    assert rc == -signal.SIGKILL
    assert_no_orphans(tag, grace_s=10)


def test_a_sweep_setting_that_cannot_be_read_is_refused_in_one_line(capsys):
    assert allreduce_main(["--nccl-sweep", "--setting", "NCCL_NVLS_ENABLE=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --setting:") and "NVLS multicast" in err[0]


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
    assert token_counts("1-8") == tuple(range(1, 9)) and batch_counts("1,4-5") == (1, 4, 5)
    assert parse_bytes("14K") == 14336 and parse_bytes("1M") == 1 << 20 and parse_bytes("512") == 512
    sizes = plan_sizes(7168, list(range(1, 9)), [1], [], None)
    assert [s for s, _ in sizes] == [7168 * 2 * t for t in range(1, 9)]  # 14 KiB .. 112 KiB
    assert sizes[0] == (14336, "1 tok")
    with_batch = dict(plan_sizes(7168, [1, 2], [1, 4], [], (1024, 4096)))
    assert with_batch[7168 * 2 * 4] == "1 tok x 4 req" and {1024, 2048, 4096} <= set(with_batch)
    with pytest.raises(ValueError):
        plan_sizes(7168, [1], [1], [100], None)


@pytest.mark.parametrize("text", ["1_0", "1-", "-2", "4-2", "1,,2", "1,", "0", "a", "1-100000000", "1.5", "2,2", ""])
def test_a_count_list_is_read_exactly_or_refused_naming_the_option(text):
    with pytest.raises(ValueError, match=r"^--batches:? (takes|must be|lists|the range)"):
        batch_counts(text)


@pytest.mark.parametrize("text", ["1_0", "1e3", "14KK", "K", "-1K", "nan", "inf", ""])
def test_a_byte_count_is_read_exactly_or_refused(text):
    with pytest.raises(ValueError, match="not a byte count"):
        parse_bytes(text)
    assert parse_bytes("1.5K") == 1536 and parse_bytes("64mb") == 64 << 20


def test_busbw_uses_the_nccl_tests_factor():
    assert busbw_factor(2) == 1.0 and busbw_factor(8) == 1.75 and busbw_factor(1) == 0.0


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 16, 64, 256])
def test_check_pattern_sums_are_exact_in_bf16_in_any_order(world_size):
    from verifybench.harness.collectives.backends import _pattern_int

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


def _stored(path, component: str, cases: list[tuple[str, int, str, float, str]], device: str = "cuda"):
    """A result file with passing cases (backend, size, mode, time, origin)."""
    run = store.make_run(component, [], {"gpu_model": "NVIDIA X", "env": {}})
    run["cases"] = [{"name": f"{b}/{s}/{m}", "check": {"ok": True, "detail": ""}, "mode": m, "device": device,
                     "samples_us": [t], "summary": {"median_us": t}, "derived": {"time_us": t},
                     "params": {"backend": b, "size_bytes": s, "mode": m, "origin": o}} for b, s, m, t, o in cases]
    return store.write_json_atomic(path, run)


AR_CASES = [("nccl", 14336, "graph", 30.0, "1 tok"), ("nccl", 28672, "graph", 32.0, "2 tok"),
            ("nccl", 57344, "graph", 40.0, "4 tok"), ("symm-one-shot", 14336, "graph", 12.0, "1 tok"),
            ("symm-one-shot", 28672, "graph", 50.0, "2 tok"), ("symm-one-shot", 57344, "graph", 60.0, "4 tok"),
            ("nccl", 14336, "eager", 5.0, "1 tok"), ("nccl", 1 << 20, "graph", 99.0, "pow2")]


# how a GPU figure is labelled when it stands in on this host
GPU_LABEL = "" if torch.cuda.is_available() else " (a GPU figure, measured on NVIDIA X)"


def test_stand_in_takes_the_median_at_the_nearest_size_of_the_named_or_fastest_backend(tmp_path):
    path = str(_stored(tmp_path / "ar.json", "allreduce", AR_CASES))
    assert stand_in_from_result(path, 14336) == (
        12.0, f"{path}: symm-one-shot, the fastest, graph mode, at 14336 B{GPU_LABEL}")
    us, source = stand_in_from_result(f"{path}:nccl", 14336)  # named: graph mode, never the faster eager figure
    assert us == 30.0 and source == f"{path}: nccl, graph mode, at 14336 B{GPU_LABEL}"
    us, source = stand_in_from_result(path, 7168 * 3 * 2)  # 43008 B: nearest measured is 57344 (ratio 1.33 < 1.5)
    assert us == 40.0 and "at 57344 B (the size nearest 43008 B)" in source
    us, source = stand_in_from_result(path)  # no size: the median over the verify sizes, not the pow2 one
    assert us == 32.0 and "nccl, the fastest" in source and "median over its 3 verify sizes 14336-57344 B" in source
    with pytest.raises(ValueError, match="backend gloo"):
        stand_in_from_result(f"{path}:gloo", 14336)
    other = _stored(tmp_path / "v.json", "verify", [])
    with pytest.raises(ValueError, match="allreduce result or NCCL sweep summary"):
        stand_in_from_result(str(other))


def test_a_default_allreduce_file_stands_in_with_its_gpu_backends_and_ignores_gloo(tmp_path):
    """The job's default backend set includes gloo, so a GPU run's file holds gloo's host times too: they never stand
    in (on a GPU a file was refused for them); only a file with no GPU-backend case is CPU numbers, refused on a
    GPU. The latency comes rounded (6.608500028960407 us was printed)."""
    path = str(_stored(tmp_path / "ar.json", "allreduce", [
        ("nccl", 14336, "graph", 6.608500028960407, "1 tok"), ("gloo", 14336, "graph", 3.0, "1 tok")]))
    for case in (run := load_run(path))["cases"]:
        case["device"] = "cpu" if case["params"]["backend"] == "gloo" else "cuda"
    store.write_json_atomic(path, run)
    assert stand_in_from_result(path, 14336) == (6.61, f"{path}: nccl, graph mode, at 14336 B{GPU_LABEL}")
    cpu_only = str(_stored(tmp_path / "gloo.json", "allreduce", [("gloo", 14336, "graph", 3.04449, "1 tok")],
                           device="cpu"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"a CPU \(gloo\) run"):
            stand_in_from_result(cpu_only, 14336)
        with pytest.raises(ValueError, match=r"a CPU \(gloo\) run"):
            stand_in_from_result(f"{path}:gloo", 14336)
    else:
        assert stand_in_from_result(cpu_only, 14336) == (3.04, f"{cpu_only}: gloo, graph mode, at 14336 B "
                                                               "(CPU numbers: gloo)")


def test_verifybench_allreduce_from_sets_the_one_gpu_stand_in_and_names_its_source(tmp_path, monkeypatch):
    path = str(_stored(tmp_path / "ar.json", "allreduce", AR_CASES))
    monkeypatch.delenv("VERIFYBENCH_ALLREDUCE_US", raising=False)
    monkeypatch.setenv("VERIFYBENCH_ALLREDUCE_FROM", f"{path}:nccl")
    assert allreduce_stand_in_us(28672) == (32.0, f"measured: {path}: nccl, graph mode, at 28672 B{GPU_LABEL}")
    assert allreduce_stand_in_us()[0] == 32.0
    monkeypatch.setenv("VERIFYBENCH_ALLREDUCE_US", "20")
    with pytest.raises(ValueError, match="not both"):
        allreduce_stand_in_us()
    monkeypatch.delenv("VERIFYBENCH_ALLREDUCE_FROM")
    assert allreduce_stand_in_us() == (20.0, "VERIFYBENCH_ALLREDUCE_US")
    monkeypatch.setenv("VERIFYBENCH_ALLREDUCE_FROM", str(tmp_path / "missing.json"))
    monkeypatch.delenv("VERIFYBENCH_ALLREDUCE_US")
    with pytest.raises(ValueError):
        allreduce_stand_in_us()


def _run(cmd: list[str], timeout_s: float = 120):
    return run_job(cmd, timeout_s, drop_env=DROP_ENV)


def test_each_kind_of_result_the_torchrun_room_writes_has_its_own_file_prefix(monkeypatch):
    """The name's prefix before -<UTC stamp> names the kind: the one-rank component owns allreduce-, the torchrun
    job writes allreduce_ranks- (its stored component stays "allreduce", so baselines still load and compare)."""
    from types import SimpleNamespace

    from verifybench.harness.components import allreduce as one_rank
    from verifybench.harness.measure.host import fingerprint
    from verifybench.harness.multigpu import allreduce, driver, verify
    from verifybench.harness.multigpu.driver import RankInfo

    monkeypatch.setattr(fingerprint, "collect", lambda: {"env": {}})
    info = RankInfo(0, 2, 0, 2, "127.0.0.1", 1, True, "r", "h")
    job = driver.Output(allreduce.AllreduceJob(), SimpleNamespace(name=None, out=None, label=None), info, {}, [])
    prefix, _, stamp = job.name.removesuffix(".json").rpartition("-")
    assert prefix == "allreduce_ranks" and re.fullmatch(r"\d{8}T\d{6}Z", stamp)
    assert allreduce.COMPONENT == "allreduce"
    kinds = [one_rank.NAME, prefix, sweep.COMPONENT, verify.COMPONENT]
    assert kinds == ["allreduce", "allreduce_ranks", "allreduce_sweep", "verify_dist"]


def test_cpu_allreduce_rows_withhold_gb_s_and_read_eager_as_cpu_hot():
    def record(mode, device):
        return {"name": f"allreduce1/gloo/512B/{mode}", "check": {"ok": True, "detail": ""}, "device": device,
                "params": {"backend": "gloo", "size_bytes": 512, "count": 256, "dtype": "bf16", "mode": mode},
                "derived": {"time_us": 80.0, "algbw_gbps": 0.006, "busbw_gbps": 0.0, "wrong": 0, "p99_us": 90.0,
                            "slowest_rank": 0}}

    cpu = table_rows([record("graph", "cpu"), record("eager", "cpu")])
    assert [r["mode"] for r in cpu] == ["cpu-loop", "cpu-hot"]
    assert all(r["algbw(GB/s)"] == store.WITHHELD and r["busbw(GB/s)"] == store.WITHHELD for r in cpu)
    (gpu,) = table_rows([record("graph", "cuda")])
    assert gpu["mode"] == "graph" and gpu["algbw(GB/s)"] == 0.006  # a GPU row keeps its bandwidth
    # the torchrun job's tables on CPU: no "fastest backend" ranking, the withheld columns named once above
    from verifybench.harness.collectives.allreduce_results import tables
    from verifybench.harness.measure.results.tables import render

    (title, rows), = tables([record("graph", "cpu"), record("eager", "cpu")])
    assert render(rows).count("withheld") == 1 and store.WITHHELD not in render(rows)
    assert [t for t, _ in tables([record("graph", "cuda")])][-1] == "fastest backend per size, graph mode"


def test_cpu_case_names_carry_the_cpu_mode_label_as_the_tables_do():
    """A CPU case's name (its JSON name, its pytest-benchmark ID) says cpu-loop/cpu-hot, never graph/eager."""
    from verifybench.harness.components import allreduce as bench_allreduce, baseline

    specs = [s for s in bench_allreduce.cases("tiny", 1, 64) if s.params["backend"] == "gloo"]
    specs += [s for s in baseline.cases("tiny", 1, 64) if s.measure_kw.get("device") == "cpu"]
    assert specs
    assert not [s.name for s in specs if s.name.rsplit("/", 1)[1] in ("graph", "eager", "hot", "cold")]
    assert {s.name.rsplit("/", 1)[1] for s in specs if s.name.startswith("allreduce1/")} == {"cpu-loop", "cpu-hot"}
