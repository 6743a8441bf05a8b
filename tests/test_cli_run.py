"""`verifybench run` end to end on the CPU smoke profile: every component, the report and its arithmetic."""
import json

import pytest
import torch

import early_jobs
from verifybench.harness.analysis.fit import linear_fit
from verifybench.harness.components import verify as bench_verify


@pytest.fixture(scope="module")
def run_dir():
    """The output folder of `verifybench run` on the tiny preset, started at collection (tests/early_jobs.py)."""
    rc, stdout, stderr, out = early_jobs.run_result()
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    assert ("CPU smoke profile" in stdout) == (not torch.cuda.is_available())
    return out


def test_run_writes_every_component_report_and_charts(run_dir):
    from verifybench.harness.components import REGISTRY

    names = {p.name.split("-2")[0] for p in run_dir.glob("*.json")}
    assert names == set(REGISTRY)
    report_path = next(run_dir.glob("run-*.md"))
    stamp = report_path.stem.rsplit("-", 1)[1]
    report = report_path.read_text()
    chart = run_dir / f"verify_components-{stamp}.png"  # charts carry the run's time, like the JSON and the report
    assert ("CPU numbers" in report) == (not torch.cuda.is_available()) and chart.name in report
    assert chart.stat().st_size > 0


def test_report_parts_add_up_and_fit_matches_its_points(run_dir):
    records = json.loads(next(run_dir.glob("verify-*.json")).read_text())["cases"]
    dec = bench_verify.decomposition(records)
    for row in dec["table"]:
        parts = [row[f"{c}_us"] for c in bench_verify.COMPONENTS]
        assert row["sum_of_parts_us"] == pytest.approx(sum(parts))
        assert row["parts_error_%"] == pytest.approx(100 * (sum(parts) / row["measured_us"] - 1))
    ns = [row["n"] for row in dec["table"]]
    direct = linear_fit(ns, [row["measured_us"] for row in dec["table"]])
    assert (dec["fit"]["a"], dec["fit"]["b"]) == pytest.approx((direct.a, direct.b))


def test_run_rejects_an_unknown_component(tmp_path, capsys):
    from verifybench.harness.cli import main

    assert main(["run", "--components", "verify,nope", "--out", str(tmp_path)]) == 2
    assert "unknown component(s) nope" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_report_holds_the_no_comm_roofline_column(run_dir):
    records = json.loads(next(run_dir.glob("verify-*.json")).read_text())["cases"]
    for row in bench_verify.decomposition(records)["table"]:
        assert row["no_comm_us"] is not None and "no_comm/roofline" in row


def test_report_break_even_follows_its_formula(run_dir):
    records = json.loads(next(run_dir.glob("verify-*.json")).read_text())["cases"]
    table = bench_verify.decomposition(records)["table"]
    rows = bench_verify.break_even_rows(table)
    decode_ms = next(r["measured_us"] for r in table if r["n"] == 1) / 1e3
    assert len(rows) == len(table)
    for row, t in zip(rows, table):
        cycle = bench_verify.DEFAULT_DRAFT_MS + t["measured_us"] / 1e3 + bench_verify.DEFAULT_OVERHEAD_MS
        assert row["break-even accept len"] == pytest.approx(cycle / decode_ms)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run's figures are not withheld")
def test_cpu_report_withholds_what_cpu_noise_cannot_support(run_dir):
    from verifybench.harness.engine.results import WITHHELD

    records = json.loads(next(run_dir.glob("verify-*.json")).read_text())["cases"]
    tables = dict(bench_verify.tables(records))
    ns = sorted({r["params"]["tokens"] for r in records})
    fit_title = next(t for t in tables if t.startswith("fit T(n)"))
    fit = tables[fit_title][0]
    assert f"fixed_share_a/T({max(ns)})" in fit and set(fit.values()) == {WITHHELD}  # the real n_max, withheld
    be = next(rows for title, rows in tables.items() if title.startswith("break-even"))
    assert all(r["break-even accept len"] == WITHHELD and r["verify_ms"] > 0 for r in be)
    marginal = next(rows for title, rows in tables.items() if title.startswith("marginal"))
    assert all(v == WITHHELD for r in marginal for k, v in r.items() if k != "n")
    report = next(run_dir.glob("run-*.md")).read_text()
    assert report.count(WITHHELD) > 10 and "fixed_share_a/T(8)" not in report


def test_eta_uses_the_copy_ceiling_measured_by_the_baseline_of_the_same_run(run_dir):
    baseline = json.loads(next(run_dir.glob("baseline-*.json")).read_text())["cases"]
    hot = next(r for r in baseline if r["name"].startswith("copy/") and r["mode"] == "hot")
    for component in ("verify", "skinny_gemm", "mla_decode", "moe_int4"):
        records = json.loads(next(run_dir.glob(f"{component}-*.json")).read_text())["cases"]
        ceilings = {r["derived"]["copy_gbps"] for r in records if r["check"]["ok"] and "copy_gbps" in r["derived"]}
        assert ceilings == {hot["derived"]["gbps"]}, component
    verify = json.loads(next(run_dir.glob("verify-*.json")).read_text())["cases"]
    full = next(r for r in verify if r["params"]["variant"] == "full" and r["check"]["ok"])
    assert full["derived"]["copy_source"] == f"{hot['name']}, measured in this run"


def test_every_component_command_defaults_to_the_tiny_preset_without_a_gpu(monkeypatch):
    from verifybench.harness import components, run
    from verifybench.harness.cli import build_parser

    monkeypatch.setattr(run, "cuda_available", lambda: False)
    parser = build_parser()
    for name in components.REGISTRY:
        scope = run.resolve_scope(parser.parse_args([name]))
        assert (scope["preset"], scope["tp"], scope["context"], scope["cpu"]) == ("tiny", 1, 64, True), name
        with pytest.raises(ValueError, match="needs a GPU"):
            run.resolve_scope(parser.parse_args([name, "--preset", "kimi-k2.5"]))


def test_an_unwritable_out_is_refused_before_anything_is_measured(tmp_path, monkeypatch, capsys):
    from verifybench.harness import run
    from verifybench.harness.cli import main
    from verifybench.harness.engine import results

    monkeypatch.delenv("VERIFYBENCH_MAX_TIME_S", raising=False)  # the CPU profile sets it: undone after the test

    def measured(*a, **k):
        raise AssertionError("measured before the output folder was checked")

    monkeypatch.setattr(run, "run_component", measured)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["run", "--components", "baseline", "--out", str(blocker / "sub")]) == 2
    assert "output folder" in capsys.readouterr().err

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)  # read-only, also when the tests run as root
    assert main(["verify", "--out", str(tmp_path / "ro")]) == 2
    assert "is not writable: Permission denied" in capsys.readouterr().err


def test_the_report_and_the_output_name_the_kernels_that_ran_on_defaults(tmp_path, monkeypatch, capsys):
    """A GPU without tables (or with them hidden): the notice heads the report as well as the console."""
    from verifybench.harness import run
    from verifybench.harness.cli import main
    from verifybench.kernels import config_tables

    monkeypatch.delenv("VERIFYBENCH_MAX_TIME_S", raising=False)
    line = "NOTE: Some GPU: no tuned table for skinny_gemm: running defaults; `verifybench tune` tunes this GPU"
    monkeypatch.setattr(config_tables, "defaults_notice", lambda: [line])
    monkeypatch.setattr(run, "run_component", lambda name, scope, out: {
        "component": name, "fingerprint": {"gpu_model": "Some GPU", "git": {"commit": "x", "dirty": False},
                                           "versions": {"torch": "t"}, "driver": "d"},
        "created_utc": "2026-12-02T00:00:00+00:00", "cases": []})
    assert main(["run", "--components", "baseline", "--out", str(tmp_path)]) == 0
    report = next(tmp_path.glob("run-*.md")).read_text()
    assert f"**{line}**" in report and line in capsys.readouterr().out
