"""`verifybench run` end to end on the CPU smoke profile: every component, the report and its arithmetic."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import early_jobs
from verifybench.harness.analysis.fit import linear_fit
from verifybench.harness.components import verify as bench_verify

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir():
    """The output folder of `verifybench run` on the tiny preset, started at collection (tests/early_jobs.py)."""
    rc, stdout, stderr, out = early_jobs.run_result()
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    assert ("CPU smoke profile" in stdout) == (not torch.cuda.is_available())
    (out / "stdout.txt").write_text(stdout)
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
    assert "unknown --components nope" in capsys.readouterr().err
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
        cycle = bench_verify.ASSUMED_DRAFT_MS + t["measured_us"] / 1e3 + bench_verify.ASSUMED_OVERHEAD_MS
        assert row["break-even accept len"] == pytest.approx(cycle / decode_ms)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run's figures are not withheld")
def test_cpu_report_withholds_what_cpu_noise_cannot_support(run_dir):
    from verifybench.harness.measure.results.store import WITHHELD

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
    assert report.count("withheld (CPU numbers): ") > 10 and "fixed_share_a/T(8)" not in report


def test_eta_uses_the_copy_ceiling_measured_by_the_baseline_of_the_same_run(run_dir):
    baseline = json.loads(next(run_dir.glob("baseline-*.json")).read_text())["cases"]
    hot = next(r for r in baseline if r["name"].startswith("copy/") and r["mode"] in ("hot", "cpu-hot"))
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

    monkeypatch.delenv("VERIFYBENCH_MAX_TIME_S", raising=False)

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
    from verifybench.kernels.common import config_tables

    monkeypatch.delenv("VERIFYBENCH_MAX_TIME_S", raising=False)
    line = "NOTE: Some GPU: no tuned table for skinny_gemm: running defaults; `verifybench tune` tunes this GPU"
    monkeypatch.setattr(config_tables, "defaults_notice", lambda: [line])
    monkeypatch.setattr(run, "run_component", lambda name, scope, out: ({
        "component": name, "fingerprint": {"gpu_model": "Some GPU", "git": {"commit": "x", "dirty": False},
                                           "versions": {"torch": "t"}, "driver": "d"},
        "created_utc": "2026-12-02T00:00:00+00:00", "cases": []}, out / f"{name}-20261202T000000Z.json"))
    assert main(["run", "--components", "baseline", "--out", str(tmp_path)]) == 0
    report = next(tmp_path.glob("run-*.md")).read_text()
    assert f"**{line}**" in report and line in capsys.readouterr().out
    assert "From `baseline-20261202T000000Z.json`." in report  # the report names the files it was made from


def _interrupted_run() -> tuple[int, str, Path]:
    """A real run of two components, SIGINT once the first has saved (the second is measuring): (rc, stderr, out)."""
    import signal
    import time

    out = early_jobs.scratch("sigint")
    cmd = [sys.executable, "-m", "verifybench.harness", "run", "--preset", "tiny", "--tp", "1", "--context", "64",
           "--components", "baseline,graph_replay", "--out", str(out)]
    proc = early_jobs.popen(cmd, cwd=REPO, env={**early_jobs.ENVIRON, "VERIFYBENCH_MAX_TIME_S": "0.05"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(out.glob("baseline-*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err, _ = early_jobs.communicate(proc, 120)
    return proc.returncode, err, out


EARLY_JOBS = {"interrupted_run": _interrupted_run}  # started at collection (tests/early_jobs.py)


@pytest.fixture(scope="module")
def interrupted_run():
    return early_jobs.job_result(f"{__name__}::interrupted_run", _interrupted_run)


def test_sigint_during_a_real_run_exits_130_in_one_line_and_leaves_only_complete_files(interrupted_run):
    rc, err, out = interrupted_run
    assert rc == 130, (rc, err[-2000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in err, err[-2000:]
    from verifybench.harness.measure.results import store

    left = sorted(p.name for p in out.iterdir())
    assert all(name.endswith((".json", ".png")) for name in left), left  # no temp file, no half report
    for name in left:
        if name.endswith(".json"):
            store.load_run(out / name)


def test_an_interrupt_mid_component_saves_its_finished_cases_marked_partial_and_says_where(tmp_path, monkeypatch,
                                                                                           capsys):
    from verifybench.harness import run
    from verifybench.harness.cli import main
    from verifybench.harness.measure.results import store

    real = run._cases

    class Interrupt:
        def run(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(run, "_cases", lambda name, scope: [real(name, scope)[0], Interrupt(), real(name, scope)[1]])
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.02")
    assert main(["baseline", "--out", str(tmp_path)]) == 130
    line = capsys.readouterr().err.strip()
    saved = list(tmp_path.glob("baseline-*.json"))
    assert len(saved) == 1 and f"baseline's 1 finished cases of 3 are in {saved[0]}" in line, line
    partial = store.load_run(saved[0])
    assert len(partial["cases"]) == 1 and partial["cases"][0]["check"]["ok"]
    assert partial["extra"]["interrupted_after_cases"] == 1 and partial["extra"]["cases_planned"] == 3


def _summary(run_dir) -> str:
    return (run_dir / "stdout.txt").read_text().split("== summary", 1)[1]


def test_run_ends_with_one_summary_of_components_cases_skips_wall_time_and_files(run_dir):
    from verifybench.harness.components import REGISTRY

    out = (run_dir / "stdout.txt").read_text()
    assert out.count("== summary") == 1
    summary = _summary(run_dir)
    assert f"components run: {len(REGISTRY)}" in summary and "wall time:" in summary
    counts = next(line for line in summary.splitlines() if line.startswith("cases:"))
    checked, passed, failed = (int(counts.split()[i]) for i in (1, 3, 5))
    assert checked == passed + failed and failed == 0 and checked > 100
    report = next(run_dir.glob("run-*.md"))
    assert f"report: {report}" in summary and all(p.name in summary for p in run_dir.glob("*.json"))
    for line in summary.splitlines():
        if line.strip().startswith("skipped"):
            assert ": " in line  # every skip carries its reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")
def test_cpu_run_checks_the_triton_kernels_through_the_interpreter_unasked(run_dir):
    summary = _summary(run_dir)
    assert "Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by verifybench" in summary
    records = {p.name.split("-2")[0]: json.loads(p.read_text())["cases"] for p in run_dir.glob("*.json")}
    ran = lambda comp, impl_key, impl: [r for r in records[comp] if r["params"].get(impl_key) == impl  # noqa: E731
                                        and r["check"]["ok"]]
    assert ran("mla_verify", "variant", "split_kv") and ran("mla_verify", "variant", "extend")
    assert ran("kv_tree", "backend", "kernel") and ran("skinny_gemm", "impl", "triton")
    assert ran("mla_decode", "impl", "triton")
    skips = [line for line in (run_dir / "stdout.txt").read_text().splitlines() if "cannot run here" in line]
    # moe's Triton case, and the engines' rows where no engine is installed or it needs a GPU: each says why
    named = re.findall(r"([a-z_0-9]+/tiny-tp1/\S+) \(([^)]*)", "\n".join(skips))
    ours = [name for name, _ in named if "/sglang." not in name and "/flashinfer." not in name]
    assert ours and all(name.startswith("moe/tiny-tp1/triton") for name in ours), ours
    assert all(why.startswith("the engine's rows: ") for name, why in named if name not in ours), named


def test_report_names_the_result_file_of_every_section(run_dir):
    report = next(run_dir.glob("run-*.md")).read_text()
    for path in run_dir.glob("*.json"):
        assert f"From `{path.name}`." in report


def test_run_tables_stay_within_120_characters(run_dir):
    from verifybench.harness.measure.results.tables import MAX_WIDTH_CHARS

    report = next(run_dir.glob("run-*.md")).read_text()
    table_lines = [line for line in report.splitlines() if line.startswith("|")]
    assert table_lines and max(len(line) for line in table_lines) <= MAX_WIDTH_CHARS


def test_run_exits_1_and_names_the_failed_check_in_the_summary(tmp_path, monkeypatch, capsys):
    from verifybench.harness import run
    from verifybench.harness.cli import main

    monkeypatch.delenv("VERIFYBENCH_MAX_TIME_S", raising=False)
    monkeypatch.setattr(run, "run_component", lambda name, scope, out: ({
        "component": name, "fingerprint": {"gpu_model": "Some GPU", "git": {"commit": "x", "dirty": False},
                                           "versions": {"torch": "t"}, "driver": "d"},
        "created_utc": "2026-12-02T00:00:00+00:00",
        "cases": [{"name": "copy/x", "params": {}, "check": {"ok": False, "detail": "dst != src"}, "derived": {}},
                  {"name": "copy/y", "params": {}, "check": {"ok": False, "detail": "skipped: no P2P"},
                   "derived": {}, "skipped": "no P2P"}]}, tmp_path / f"{name}-x.json"))
    assert main(["run", "--components", "baseline", "--out", str(tmp_path)]) == 1
    summary = capsys.readouterr().out.split("== summary", 1)[1]
    assert "cases: 1 checked, 0 passed, 1 failed, 1 skipped" in summary
    assert "FAILED copy/x: dst != src" in summary and "skipped 1: no P2P (copy/y)" in summary


def _figures(monkeypatch):
    """The figures a charts() call draws, kept open."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    return figs


def test_verify_charts_tick_integer_n_and_plot_no_withheld_roofline_on_cpu(run_dir, tmp_path, monkeypatch):
    records = json.loads(next(run_dir.glob("verify-*.json")).read_text())["cases"]
    figs = _figures(monkeypatch)
    bench_verify.charts(records, tmp_path, "x")
    assert len(figs) == (2 if torch.cuda.is_available() else 1)
    for fig in figs:
        ax = fig.axes[0]
        assert all(float(t).is_integer() for t in ax.get_xticks())
    if torch.cuda.is_available():
        labels = [line.get_label() for line in figs[1].axes[0].get_lines()]
        assert "weight+KV roofline" in labels


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run's charts")
def test_cpu_charts_draw_no_comparison_the_tables_withhold(run_dir, tmp_path, monkeypatch):
    """No measured-vs-predicted verify chart, no measured forward over the stacked parts, no cycle over the stacked
    phases (their sum is not the cycle on CPU), and each chart says so in its title."""
    from verifybench.harness.components import cycle

    verify = json.loads(next(run_dir.glob("verify-*.json")).read_text())["cases"]
    figs = _figures(monkeypatch)
    paths = bench_verify.charts(verify, tmp_path, "x")
    assert [p.name for p in paths] == ["verify_components-x.png"]
    ax = figs[0].axes[0]
    assert "measured forward" not in [line.get_label() for line in ax.get_lines()] and "not compared" in ax.get_title()
    records = json.loads(next(run_dir.glob("cycle-*.json")).read_text())["cases"]
    cycle.charts(records, tmp_path, "x")
    ax = figs[-1].axes[0]
    assert not ax.get_lines() and "their sum is not the cycle" in ax.get_title()


def test_cycle_chart_has_an_x_label_and_its_legend_beside_the_bars(run_dir, tmp_path, monkeypatch):
    from verifybench.harness.components import cycle

    records = json.loads(next(run_dir.glob("cycle-*.json")).read_text())["cases"]
    figs = _figures(monkeypatch)
    cycle.charts(records, tmp_path, "x")
    ax = figs[0].axes[0]
    legend = ax.get_legend()
    assert ax.get_xlabel() and legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU report's opening")
def test_cpu_report_opens_with_what_was_verified_and_one_cpu_numbers_line(run_dir):
    from markdown_it import MarkdownIt

    report = next(run_dir.glob("run-*.md")).read_text()
    opening = report.split("\n## ", 2)[1]  # the first section, up to the first component's
    counts = next(line for line in _summary(run_dir).splitlines() if line.startswith("cases:"))
    assert opening.startswith("What was verified") and f"- {counts}" in opening and "- components run: 10" in opening
    assert "The answer" not in report and opening.count("CPU numbers") == 1 and "withheld" in opening
    html = MarkdownIt().render(opening)
    assert f"<li>{counts}</li>" in html or f"<li>{counts}\n<ul>" in html  # its own item (its skips under it)


def test_gpu_report_opening_renders_each_answer_and_lever_line_on_its_own():
    from markdown_it import MarkdownIt

    from verifybench.harness import run
    from verifybench.harness.answers import advise
    from verifybench.harness.measure.results import store

    h200 = REPO / "results/baselines/nvidia-h200-x1"
    runs = {k: store.load_run(h200 / f) for k, f in (("verify", "verify.json"), ("cycle", "cycle.json"))}
    opening = run.report_opening(runs, {"cpu": False}, Path("out"))
    plain = advise.report_lines(runs, Path("out"))
    answer = plain[1:plain.index("")]  # the lines under "### The answer"
    html = MarkdownIt().render("\n".join(opening))
    section = html.split("<h3>The answer</h3>")[1].split("<h3>")[0]
    assert len(answer) >= 3 and section.count("<li>") == len(answer) and "<p>" not in section
    levers = html.split("<h3>Levers")[1]
    assert levers.count("<li>") >= 2 * levers.count("<ol")  # each lever's detail lines are items under it


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU report's withheld tables")
def test_cpu_report_prints_no_table_with_nothing_to_say_and_skinny_gemm_as_one(run_dir):
    report = next(run_dir.glob("run-*.md")).read_text()
    assert "measured_in_s" not in report and "| slowest rank" not in report  # a fit's wall time; rank 0 of 1 rank
    marginal = report.split("**marginal cost")[1].split("**bytes and eta")[0]
    assert "every figure of this table" in marginal and "|" not in marginal  # the n column alone said nothing
    skinny = report.split("## skinny_gemm")[1].split("\n## ")[0]
    assert skinny.count("| shape") == 1 and skinny.count("| case") == 1


def test_report_says_the_token_counts_the_verify_forward_ran_not_a_default_range(run_dir):
    records = json.loads(next(run_dir.glob("verify-*.json")).read_text())["cases"]
    ns = sorted({r["params"]["tokens"] for r in records})
    section = next(run_dir.glob("run-*.md")).read_text().split("\n## verify:")[1].split("\n## ")[0]
    heading = section.splitlines()[0]
    assert f". Ran at n = {', '.join(map(str, ns))} tokens." in section and ".." not in heading


def test_run_help_wraps_the_component_list_between_names_never_inside_one(monkeypatch, capsys):
    from verifybench.harness.cli import main
    from verifybench.harness.components import REGISTRY

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["run", "--help"]) == 0
    help_text = capsys.readouterr().out.split("--components COMPONENTS")[-1]  # the option, not the usage
    words = {w.strip(",.()") for w in help_text.split()}
    assert set(REGISTRY) <= words  # each name whole on one line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run's tables")
def test_cpu_run_tables_print_no_bandwidth_and_no_graph_mode(run_dir):
    """GB/s from a CPU time (the interpreter's kernels read 0.000) is withheld in every component's tables, and no
    row of a CPU run says `graph`/`eager`: the mode reads cpu-loop/cpu-hot as in the JSON."""
    from verifybench.harness.components import REGISTRY, load

    for name in REGISTRY:
        records = json.loads(next(run_dir.glob(f"{name}-2*.json")).read_text())["cases"]
        for title, rows in load(name).tables(records):
            for row in rows:
                rates = {k: v for k, v in row.items() if "GB/s" in k and isinstance(v, (int, float))}
                assert not rates, (name, title, rates)
                assert row.get("mode") not in ("graph", "eager", "hot"), (name, title, row)
        assert all(r.get("mode", "cpu-") is None or r.get("mode", "cpu-").startswith("cpu-") for r in records), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU listing")
def test_run_passes_batch_to_the_attention_components_and_its_help_names_them(capsys):
    from verifybench.harness import run as run_mod
    from verifybench.harness.cli import main

    assert {"mla_verify", "mla_decode", "verify", "cycle"} <= set(run_mod.batch_components())
    scope = {"preset": "tiny", "tp": 1, "context": 64, "tokens": (3,), "batch": (1, 2), "options": {}}
    for name, two in (("mla_verify", "mla_verify/tiny-tp1/ctx64/B2/"), ("mla_decode", "mla/tiny-tp1/ctx256/B2/")):
        specs = run_mod._cases(name, scope)
        assert {s.params["batch"] for s in specs} == {1, 2} and any(s.name.startswith(two) for s in specs)
    assert main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "the components that take it (mla_decode, mla_verify, verify, cycle)" in text
