"""What the console and the report print: tables within 120 characters in one number format per column, withheld
columns named once, and the Triton interpreter switched on by the command line before any kernel is imported."""
import os
import sys
from pathlib import Path

import pytest
import torch

import early_jobs
from verifybench.harness.measure.host import interpreter
from verifybench.harness.measure.results import tables
from verifybench.harness.measure.results.store import WITHHELD

REPO = Path(__file__).resolve().parents[2]


def _wide_rows():
    return [{"n": n, "measured_us": 13990.0 * n, "small_us": 4.557 / n, "sum_of_parts_us": 3100.0 + n,
             **{f"part{j}_us": 1.1 * j + n for j in range(14)}, "ratio": WITHHELD} for n in range(1, 4)]


def test_tables_split_past_120_chars_and_repeat_the_label_column():
    text = tables.render(_wide_rows())
    assert max(len(line) for line in text.splitlines()) <= tables.MAX_WIDTH_CHARS
    parts = [p for p in text.split("\n\n") if not p.startswith("withheld")]
    assert len(parts) >= 2 and all(p.splitlines()[0].split()[0] == "n" for p in parts)


def test_tables_print_one_number_format_per_column_never_mixing_exponents():
    text = tables.render([{"us": v} for v in (1859.0, 8984.0, 11760.0, 2.5)])
    cells = [line.strip() for line in text.splitlines()[2:]]
    assert cells == ["1859", "8984", "11760", "2"] and "e+" not in text


def test_a_column_withheld_in_every_row_is_named_once_above_the_table():
    text = tables.render(_wide_rows(), "github")
    assert text.startswith("withheld (CPU numbers): ratio") and text.count(WITHHELD) == 0
    assert "| ratio" not in text


def test_a_column_empty_in_every_row_is_dropped_and_a_long_withheld_list_wraps():
    rows = [{"n": n, "no_pdl_us": None, **{f"component_{j}_marginal_us": WITHHELD for j in range(12)}} for n in (1, 2)]
    text = tables.render(rows)
    assert "no_pdl_us" not in text and max(len(line) for line in text.splitlines()) <= tables.MAX_WIDTH_CHARS


def test_a_table_left_with_only_its_labels_prints_one_withheld_line_instead():
    rows = [{"n": n, "attention": "torch", "moe_marginal_us": WITHHELD, "head_marginal_us": WITHHELD} for n in (1, 2)]
    text = tables.render(rows, "github")
    assert text == "withheld (CPU numbers): every figure of this table (moe_marginal_us, head_marginal_us)"


@pytest.mark.parametrize("tablefmt", ["simple", "github"])
def test_a_single_wide_row_becomes_field_value_lines_within_the_width(tablefmt):
    said = ("device wait of 7.7 us per allreduce (reference figure (NCCL all_reduce_perf, graph mode, 2xH200 over "
            "NVLink; PCIe boxes are slower: measure yours))")  # a GPU run's forward setup
    text = tables.render([{"ops": "torch", "allreduce": said, "token": "x" * 150}], tablefmt)
    lines = text.splitlines()
    assert lines[0].replace("|", " ").split() == ["field", "value"] and max(map(len, lines)) <= tables.MAX_WIDTH_CHARS
    at = lines[0].index("value")
    cells = [(line[:at].strip("| "), line[at:].strip("| ")) for line in lines[2:]]
    assert [c[0] for c in cells if c[0]] == ["ops", "allreduce", "token"]
    values = [c[-1] for c in cells]
    assert " ".join(values[1:-2]) == said and "".join(values[-2:]) == "x" * 150  # the value wrapped, all of it


def test_the_interpreter_is_not_forced_over_the_users_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreter.enable_without_gpu() and os.environ["TRITON_INTERPRET"] == "0"
    assert "NOT run" in interpreter.describe()


def test_the_interpreter_cannot_be_switched_on_after_a_kernel_module_was_imported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "verifybench.kernels.fake", object())
    assert not interpreter.enable_without_gpu() and "TRITON_INTERPRET" not in os.environ
    assert "imported before" in interpreter.describe()


def test_interpreter_warns_of_triton_3_6_with_numpy_2_4(monkeypatch):
    import numpy
    import triton

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    assert "run-time trip count" in interpreter.version_trap()
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    assert interpreter.version_trap() is None


def _cli_runs() -> dict | None:
    """Two command lines without TRITON_INTERPRET exported (the CPU path): an import of the CLI and a component, and a
    component command end to end."""
    if torch.cuda.is_available():
        return None
    env = {k: v for k, v in early_jobs.ENVIRON.items() if k != "TRITON_INTERPRET"}
    code = ("import os, verifybench.harness.cli; from verifybench.harness.components import mla_verify; "
            "print(os.environ.get('TRITON_INTERPRET'), mla_verify.INTERPRET)")
    return {"import": early_jobs.run([sys.executable, "-c", code], 300, cwd=REPO, env=env),
            "command": early_jobs.run([sys.executable, "-m", "verifybench.harness", "mla_verify", "--out",
                                       str(early_jobs.scratch("mla-verify"))], 900, cwd=REPO, env=env)}


EARLY_JOBS = {"cli_runs": _cli_runs}  # started at collection (tests/early_jobs.py)


@pytest.fixture(scope="module")
def cli_runs():
    return early_jobs.job_result(f"{__name__}::cli_runs", _cli_runs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")
def test_cli_sets_the_interpreter_before_any_kernel_is_imported_without_a_gpu(cli_runs):
    r = cli_runs["import"]
    assert r.stdout.split() == ["1", "True"], r.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")
def test_a_component_command_runs_its_triton_kernels_without_triton_interpret_exported(cli_runs):
    r = cli_runs["command"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by verifybench" in r.stdout
    assert "split_kv_us" in r.stdout and "extend_us" in r.stdout
    skipped = [item for line in r.stdout.splitlines() if line.startswith("skipped (cannot run here): ")
               for item in line.split(": ", 1)[1].split("; ")]
    assert all("/sglang." in item or "/flashinfer." in item for item in skipped), skipped  # only the engines' rows


def test_a_closed_stdout_ends_quietly_with_141_as_unix_tools_do(monkeypatch, capsys):
    from verifybench.harness.cli import EXIT_STDOUT_CLOSED, main

    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` that has left
    with os.fdopen(write_end, "w", buffering=1) as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        rc = main(["advise", str(REPO / "results/baselines/nvidia-h200-x1")])
        monkeypatch.undo()
    assert rc == EXIT_STDOUT_CLOSED == 141 and capsys.readouterr().err == ""
