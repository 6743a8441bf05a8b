"""`verifybench project`: the named PCIe target's figures, low <= high on slower and faster GPUs (ranges included),
refusal of CPU smoke results, and a --help that says the copy figure is read + write."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from verifybench.harness.analysis.decompose import Gpu
from verifybench.harness.answers.project import TARGETS, project_range
from verifybench.harness.cli import main
from verifybench.harness.measure.results import store

BASELINE = Path(__file__).resolve().parents[2] / "results/baselines/nvidia-h200-x1/verify.json"
HERE = Gpu("H200", 4000.0, 7.7)
# moe streams near the copy ceiling; attn reads "more" than it could at copy speed (eta > 1: bytes overstated, or
# a read-only kernel beating a read + write copy); misc reads nothing
PARTS = {"moe": 1000.0, "attn": 100.0, "misc": 50.0, "allreduce": 122 * 7.7}
BYTES = {"moe": 3_000_000_000, "attn": 600_000_000}


def test_rtx_pro_6000_pcie_target_has_read_write_copy_and_pcie_allreduce_figures():
    t = TARGETS["rtx-pro-6000-pcie-tp8"]
    assert 1600 <= t.copy_gbps[0] <= t.copy_gbps[1] <= 1800  # read + write, under the 1.79 TB/s datasheet
    assert 25 <= t.allreduce_us[0] < t.allreduce_us[1] <= 60  # NCCL over PCIe Gen5 at verify sizes
    assert "PCIe" in t.source and "ASSUMED" in t.source


@pytest.mark.parametrize("copy, ar", [((1600.0, 1790.0), (25.0, 60.0)),  # slower GPU, ranges
                                      ((500.0, 500.0), (30.0, 30.0)),  # much slower, single figures
                                      ((8000.0, 9000.0), (2.0, 4.0)),  # faster
                                      ((4000.0, 4000.0), (7.7, 7.7))])  # the same GPU
def test_projected_low_never_exceeds_high_on_slower_or_faster_gpus(copy, ar):
    low, high = project_range(PARTS, BYTES, HERE, "X", copy, ar, allreduces=122)
    assert 0 < low <= high
    if copy == (4000.0, 4000.0):
        assert low == pytest.approx(high) == pytest.approx(sum(PARTS.values()))


def test_a_slower_target_projects_slower_than_measured_and_the_range_widens_with_its_figures():
    narrow = project_range(PARTS, BYTES, HERE, "X", (1600.0, 1600.0), (30.0, 30.0), allreduces=122)
    wide = project_range(PARTS, BYTES, HERE, "X", (1600.0, 1790.0), (25.0, 60.0), allreduces=122)
    assert sum(PARTS.values()) < wide[0] <= narrow[0] <= narrow[1] <= wide[1]


def test_project_onto_the_pcie_target_prints_ordered_ranges(capsys):
    assert main(["project", str(BASELINE), "--target", "rtx-pro-6000-pcie-tp8"]) == 0
    out = capsys.readouterr().out
    assert "PROJECTION (not a measurement)" in out and "copy 1600-1790 GB/s (read + write)" in out
    assert "allreduce 25-60 us per call" in out and "ASSUMED" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 8
    for n, measured, _, low, high in ((r[0], *map(float, r[1:])) for r in rows):
        assert measured < low <= high, n  # a slower GPU and slower links: every n projects slower


def test_a_given_figure_overrides_the_targets_and_is_named(capsys):
    assert main(["project", str(BASELINE), "--target", "rtx-pro-6000-pcie-tp8", "--allreduce-us", "40"]) == 0
    out = capsys.readouterr().out
    assert "allreduce 40 us per call" in out and "given on the command line" in out


def test_project_refuses_cpu_smoke_results(tmp_path, capsys):
    run = json.loads(BASELINE.read_text())
    for c in run["cases"]:
        if "device" in c:
            c["device"] = "cpu"  # a GPU fingerprint, but every sample taken on the CPU
    path = store.write_json_atomic(tmp_path / "cpu.json", run)
    assert main(["project", str(path), "--target", "rtx-pro-6000-pcie-tp8"]) == 2
    assert "CPU smoke run" in capsys.readouterr().err


def test_project_help_says_the_copy_figure_is_read_plus_write(capsys):
    assert main(["project", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "read + write, as ours" in out and "read + written counted, as ours" in out
