"""The verify forward on several ranks (verifybench.harness.multigpu.verify) on CPU: an 8-rank gloo run under torchrun
(checks, both timed variants and the allreduces alone per n, agreed counts, rank 0's JSON and table), the debug run
without an allreduce that the cross-rank check must fail, a crashing rank ending the job within the bound, and the
pure pieces.
"""
from __future__ import annotations

import re

import pytest
import torch

import early_jobs
from verifybench.harness.model.forward import allocated_bytes
from verifybench.harness.multigpu import verify as vd, verify_setup as setup
from verifybench.harness.measure.results.store import WITHHELD, load_run
from torchrun_jobs import BOUND_S, TORCHRUN, assert_no_orphans, run_job, run_jobs_at_once

VERIFY_DIST = TORCHRUN + ["-m", "verifybench.harness.multigpu.verify"]
VERIFY_DIST_8 = [a for a in TORCHRUN if not a.startswith("--nproc-per-node")] + ["--nproc-per-node=8", "-m",
                                                                                 "verifybench.harness.multigpu.verify"]
# the defaults these tests assert
DROP_ENV = ("VERIFYBENCH_ALLREDUCE_US", "VERIFYBENCH_ALLREDUCE_FROM", "VERIFYBENCH_VERIFY_OPS")
FAST = ["--allreduce", "gloo", "--preset", "tiny", "--tp", "1", "--context", "64", "--warmup", "2", "--samples", "3"]


def _eight_rank_job():
    out_dir = early_jobs.scratch("verify-dist")
    return (*_run(VERIFY_DIST_8 + [*FAST, "--tokens", "1,2", "--out", str(out_dir), "--name", "r.json"]), out_dir)


EARLY_JOBS = {"eight_rank_run": _eight_rank_job}  # started at collection (tests/early_jobs.py)


@pytest.fixture(scope="module")
def eight_rank_run():
    return early_jobs.job_result(f"{__name__}::eight_rank_run", _eight_rank_job)


def test_eight_rank_gloo_run_checks_times_both_variants_and_saves(eight_rank_run):
    rc, out, _, tag, tmp_path = eight_rank_run
    assert rc == 0, out[-3000:]
    assert re.search(r"n\s+size\(B\)\s+backend\s+full\(us\)\s+no-AR\(us\)\s+stand-in\(us\)", out), out[-3000:]
    assert "CPU numbers" in out and "stand-in: 7.7 us" in out
    # no AR marginal: its column named withheld once above the table, not in every cell
    assert "withheld (CPU numbers): AR marginal(us), per AR(us)" in out and "withheld: CPU numbers" not in out
    run = load_run(tmp_path / "r.json")
    assert run["component"] == "verify_dist"
    assert run["extra"]["world_size"] == 8 and run["extra"]["complete"]
    cases = {(c["params"]["tokens"], c["params"]["variant"]): c for c in run["cases"]}
    assert set(cases) == {(n, v) for n in (1, 2) for v in ("full", "without-allreduce", "only-allreduce")}
    for (n, variant), c in cases.items():
        p, d = c["params"], c["derived"]
        assert c["check"]["ok"], c["check"]
        assert "bit-identical across 8 ranks" in c["check"]["detail"] and "#wrong 0" in c["check"]["detail"]
        assert p == {"preset": "tiny", "tp": 1, "world_size": 8, "backend": "gloo", "tokens": n, "context": 64,
                     "layers": 3, "variant": variant}
        assert len(d["rank_medians_us"]) == 8 and d["time_us"] == max(d["rank_medians_us"])
        assert c["mode"] == ("cpu-loop" if c["device"] == "cpu" else "graph")  # a CPU record says so
        assert c["warmup_calls"] == 2 and len(c["samples_us"]) == 3  # the agreed counts
        assert c["calls_per_sample"] == 1
    for n in (1, 2):
        full, without = cases[(n, "full")]["derived"], cases[(n, "without-allreduce")]["derived"]
        assert full["allreduce_marginal_us"] == pytest.approx(full["time_us"] - without["time_us"])
        assert full["per_allreduce_marginal_us"] == pytest.approx(full["allreduce_marginal_us"] / 6)  # 2 x 3 layers
        assert full["allreduce_bytes"] == n * 256 * 2 and full["stand_in_us"] == 7.7
    assert_no_orphans(tag)


def _two_rank_jobs() -> dict:
    out = early_jobs.scratch("no-allreduce")
    no_allreduce = VERIFY_DIST + [*FAST, "--tokens", "1", "--no-allreduce", "--out", str(out), "--name", "r.json"]
    exit_early = VERIFY_DIST + [*FAST, "--tokens", "1,2", "--out", str(early_jobs.scratch("exit-early")),
                                "--fault", "exit-early:1@1", "--hang-timeout", "6"]
    results = run_jobs_at_once([no_allreduce, exit_early], 150, drop_env=DROP_ENV)
    return {"no-allreduce": (*results[0], out), "exit-early": results[1]}


TIMED_JOBS = {"two_rank_runs": _two_rank_jobs}  # timed bounds: last, with the other timed jobs (tests/early_jobs.py)


@pytest.fixture(scope="module")
def two_rank_runs() -> dict:
    """The two 2-rank jobs, run at once: "no-allreduce" (the debug run; its output folder too) and "exit-early"."""
    return early_jobs.timed_result(f"{__name__}::two_rank_runs", _two_rank_jobs)


def test_without_the_allreduce_the_cross_rank_check_fails_and_no_time_is_reported(two_rank_runs):
    rc, out, _, tag, tmp_path = two_rank_runs["no-allreduce"]
    assert rc != 0
    assert "FAILED checks" in out and "residual stream differs across ranks" in out, out[-3000:]
    run = load_run(tmp_path / "r.json")
    assert len(run["cases"]) == 3
    for c in run["cases"]:
        assert not c["check"]["ok"] and "samples_us" not in c and c["params"]["debug"] == "no-allreduce"
    assert_no_orphans(tag)


def test_rank_exiting_early_ends_job_nonzero_within_bound_naming_it(two_rank_runs):
    rc, out, wall_s, tag = two_rank_runs["exit-early"]
    assert rc != 0 and wall_s < BOUND_S
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\)", out, re.S), out[-3000:]
    assert_no_orphans(tag)


def _rank_records(full_us: float, without_us: float, alone_us: float) -> list[dict]:
    def m(t):
        return {"mode": "graph", "device": "cpu", "timer": "perf_counter", "samples_us": [t], "calls_per_sample": 1,
                "warmup_calls": 2, "stop_reason": "fixed_samples", "wall_s": 0.1, "clocks_before": None,
                "clocks_after": None, "summary": {"median_us": t}}

    return [{"n": 1, "ok": True, "detail": "ok", "variants": {"full": m(full_us), "without-allreduce": m(without_us),
                                                              "only-allreduce": m(alone_us)}}]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_allreduce_marginal_is_withheld_on_cpu_and_shown_on_a_gpu(device):
    """On CPU a forward without its allreduce timed 12,386 us slower than with it: a difference of two noisy
    perf_counter times is no allreduce cost."""
    plan = {"layers_run": 3, "tokens": [1], "stand_in_by_n_us": [7.7], "hidden": 256, "preset": "tiny", "tp": 1,
            "context": 64, "no_allreduce": False, "device": device}
    cases, (row,) = vd.build_cases("gloo", [_rank_records(100.0, 12486.0, 30.0)] * 2, plan, 2)
    assert cases[0].derived["allreduce_marginal_us"] == -12386.0  # stored as measured, for tools that read it
    assert row["full(us)"] == 100.0 and row["no-AR(us)"] == 12486.0 and row["stand-in(us)"] == 7.7
    for column in vd.DERIVED_COLUMNS:
        assert (row[column] == WITHHELD) == (device == "cpu"), column
    assert row["AR marginal(us)"] == (WITHHELD if device == "cpu" else -12386.0)


def test_cpu_verify_dist_table_says_withheld_once_above_it_not_in_every_cell():
    plan = {"layers_run": 3, "tokens": [1], "stand_in_by_n_us": [7.7], "hidden": 256, "preset": "tiny", "tp": 1,
            "context": 64, "no_allreduce": False, "device": "cpu"}
    _, rows = vd.build_cases("gloo", [_rank_records(100.0, 12486.0, 30.0)] * 2, plan, 2)
    text = vd.table_text(rows * 3, "cpu")
    assert text.count("withheld") == 1 and text.startswith("withheld (CPU numbers): AR marginal(us)")
    assert "full(us)" in text and WITHHELD not in text



def _streams(values):
    return [torch.tensor(v, dtype=torch.bfloat16).view(1, -1) for v in values]


def test_consistency_verdict_catches_a_missing_allreduce():
    same = _streams([[1.0, 2.0, 3.0]] * 2)
    differ = _streams([[1.0, 2.0, 3.0], [3.0, -1.0, 0.5]])
    ok, detail = vd.consistency_verdict(same, control=differ, replayed=same)
    assert ok and "bit-identical across 2 ranks" in detail and "graph replay" in detail
    ok, detail = vd.consistency_verdict(differ, control=differ)  # what a no-op allreduce gives
    assert not ok and "differs across ranks" in detail
    ok, detail = vd.consistency_verdict(same, control=differ, replayed=differ)  # broken only when replayed
    assert not ok and "graph replay: residual stream differs" in detail
    ok, detail = vd.consistency_verdict(same, control=same)  # identical weights on every rank: proves nothing
    assert not ok and "blind" in detail
    ok, detail = vd.consistency_verdict([same[0], None], control=differ)
    assert not ok and "no residual stream" in detail
    ok, _ = vd.consistency_verdict(_streams([[1.0, float("nan")]] * 2), control=differ)
    assert not ok
    close = _streams([[1.0, 2.0, 3.0], [1.0, 2.0, 3.015625]])  # one bf16 ulp: inside the tolerance
    ok, detail = vd.consistency_verdict(close, control=differ)
    assert ok and "max rel diff" in detail
    assert vd.consistency_verdict(same[:1], control=same[:1])[0]  # one rank: nothing to compare


def test_ranks_get_their_own_weights_replicated_ones_and_identical_inputs():
    plan = setup.make_plan(vd.build_parser().parse_args(["--preset", "tiny", "--tp", "1", "--context", "16",
                                                      "--tokens", "1,2", "--allreduce", "gloo"]))
    f0, f1 = setup.build_forward(plan, "cpu", 0), setup.build_forward(plan, "cpu", 1)
    assert not torch.equal(f0.layers[0]["q_b"], f1.layers[0]["q_b"]) and not torch.equal(f0.lm_head, f1.lm_head)
    for a, b in zip(f0.layers, f1.layers):  # what TP replicates is the same on every rank: the same routing
        assert torch.equal(a["q_a_kv_a"], b["q_a_kv_a"])
        assert "router" not in a or torch.equal(a["router"], b["router"])
    router = f0.layers[1]["router"].float()
    assert router.std().item() == pytest.approx(router.shape[-1] ** -0.5, rel=0.1)  # _rand's scale
    for n in (1, 2):
        assert set(f0.buf[n]) >= {"h0", "x", "attn_out", "candidates", "topk_ids"}
        for key, t in f0.buf[n].items():
            if key != "h":  # uninitialised scratch
                assert torch.equal(t, f1.buf[n][key]), key
    # the forward's own numbers: two ranks' streams differ without an allreduce (the check's control)
    for f in (f0, f1):
        f.allreduce_fn = lambda t: None
    h0, h1 = (f.forward(2, setup.NO_HEAD) for f in (f0, f1))
    assert vd.spread([h0, h1])["max_rel_diff"] > vd.CONTROL_MIN_REL
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for L in f0.layers
                for k, t in L.items() if k not in ("ln1", "ln2", "q_ln", "kv_ln")}  # views (router) count once
    assert allocated_bytes(f0.s, 16, 2) == sum(storages.values()) + f0.lm_head.numel() * 2


def test_a_measured_stand_in_is_taken_at_each_token_counts_size(tmp_path, monkeypatch):
    from verifybench.harness.measure.results import store

    run = store.make_run("allreduce", [], {"gpu_model": "NVIDIA X", "env": {}})
    run["cases"] = [{"name": f"nccl/{s}", "check": {"ok": True, "detail": ""}, "mode": "graph", "device": "cuda",
                     "samples_us": [t], "summary": {"median_us": t}, "derived": {"time_us": t},
                     "params": {"backend": "nccl", "size_bytes": s, "mode": "graph", "origin": f"{s // 512} tok"}}
                    for s, t in ((512, 10.0), (1024, 20.0))]
    path = store.write_json_atomic(tmp_path / "ar.json", run)
    monkeypatch.delenv("VERIFYBENCH_ALLREDUCE_US", raising=False)
    monkeypatch.setenv("VERIFYBENCH_ALLREDUCE_FROM", str(path))
    plan = setup.make_plan(vd.build_parser().parse_args(["--preset", "tiny", "--tp", "1", "--tokens", "1,2",
                                                      "--allreduce", "gloo"]))
    assert plan["stand_in_by_n_us"] == [10.0, 20.0]  # hidden 256 x n x 2 B
    assert plan["stand_in_us"] == 15.0 and plan["stand_in_source"].startswith(f"measured: {path}: nccl")


def test_the_forward_on_cpu_defaults_to_the_smoke_profiles_tiny_shapes():
    plan = setup.make_plan(vd.build_parser().parse_args(["--allreduce", "gloo", "--tokens", "1"]))
    assert (plan["preset"], plan["tp"], plan["context"], plan["device"]) == ("tiny", 1, 64, "cpu")
    plan = setup.make_plan(vd.build_parser().parse_args(["--allreduce", "gloo", "--tokens", "1", "--preset",
                                                      "kimi-k2.5", "--tp", "8", "--layers", "2"]))
    assert (plan["preset"], plan["tp"], plan["layers_run"]) == ("kimi-k2.5", 8, 2)  # what is asked, when it fits


def _refusal(capsys, monkeypatch, ranks_on_host: int) -> str:
    """What main says of a whole K2.5 TP8 rank on CPU with about 8 GiB free (under the memory cap)."""
    from verifybench.harness.measure.timing import memory

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_on_host))
    monkeypatch.setenv(memory.CAP_ENV, str(memory._cpu_rss_bytes() / memory.GIB + 8))
    assert vd.main(["--allreduce", "gloo", "--preset", "kimi-k2.5", "--tp", "8", "--tokens", "1"]) == 2
    return capsys.readouterr().err


def test_a_forward_that_does_not_fit_is_refused_before_building_naming_the_layers_that_fit(capsys, monkeypatch):
    alone = _refusal(capsys, monkeypatch, 1)
    assert re.search(r"kimi-k2.5 TP8 forward at context 64 \(61 layers\) needs [\d.]+ GiB .* is free", alone)
    shared = _refusal(capsys, monkeypatch, 4)  # the ranks of a host share its memory
    assert "shared by 4 ranks" in shared
    fits = [int(re.search(r"--layers (\d+) fits", err).group(1)) for err in (alone, shared)]
    assert 1 <= fits[1] < fits[0] < 61, fits


@pytest.mark.parametrize("argv, message", [
    (["--allreduce", "gloo,nccl"], "on its own"),
    (["--allreduce", "mpi"], "unknown --allreduce"),
    (["--preset", "kimi-k2.5", "--tp", "7"], "does not divide"),
    (["--tokens", "0-2"], "must be in 1..64"),
])
def test_bad_arguments_are_refused_before_any_rendezvous(argv, message, capsys):
    try:
        rc = vd.main(["--preset", "tiny", "--tp", "1", *argv])
    except SystemExit as e:  # refused by the argument parser (the shared token parser), exit 2 all the same
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


def _run(cmd: list[str], timeout_s: float = 150):
    return run_job(cmd, timeout_s, drop_env=DROP_ENV)
