"""The benchmark modules leave the memory as they found it, graph captures run with the collector held off, and
pytest-benchmark's histogram and groups work on our cases."""
import gc
import gzip
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import early_jobs
from verifybench.harness.components import graph_replay
from verifybench.harness.measure.timing import capture, memory
from verifybench.harness.measure.timing.pytest_plugin import HISTOGRAM_MOST, histogram_group

REPO = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the benchmarks' tensors live


def _child_pytest(folder: Path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in early_jobs.ENVIRON.items() if not k.startswith("PYTEST_XDIST")}
    env.update(VERIFYBENCH_MAX_TIME_S="0.05")
    return early_jobs.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder), *args], 300,
                          cwd=folder, env=env)


def _bench_folder(body: str) -> Path:
    folder = early_jobs.scratch("bench")
    shutil.copy(REPO / "microbench" / "conftest.py", folder / "conftest.py")
    (folder / "bench_probe.py").write_text(body)
    (folder / "pytest.ini").write_text("[pytest]\npython_files = bench_*.py\n")
    return folder


KEEPS = f"import torch\nKEPT = []\n\ndef test_keeps():\n" \
        f"    KEPT.append(torch.ones(64 << 20, dtype=torch.uint8, device='{DEVICE}'))\n"
FREES = (f"import torch\n\ndef test_frees():\n"
         f"    x = torch.ones(64 << 20, dtype=torch.uint8, device='{DEVICE}')\n"
         "    assert x.sum() > 0\n\n"
         "from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec\n\n"
         "def _setup():\n    raise CaseSkipped('too slow in the interpreter')\n\n"
         "def test_cannot_run_here(device_benchmark):\n"
         "    spec = CaseSpec(name='probe/x', params={}, mode='hot', setup=_setup)\n"
         "    device_benchmark(spec)\n")


def _no_pygal_run() -> subprocess.CompletedProcess:
    shim = early_jobs.scratch("shim")
    (shim / "pygal.py").write_text("raise ImportError('no pygal here')\n")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(shim), early_jobs.ENVIRON.get("PYTHONPATH")) if p)}
    return early_jobs.run([sys.executable, "-m", "pytest", "--benchmark-only", "-q", "-p", "no:cacheprovider",
                           "microbench/bench_baseline.py", f"--benchmark-histogram={shim / 'h'}"], 300,
                          cwd=REPO, env={**early_jobs.ENVIRON, **env})


def _child_runs() -> dict:
    return {"keeps": _child_pytest(_bench_folder(KEEPS)), "frees": _child_pytest(_bench_folder(FREES), "-rs"),
            "no-pygal": _no_pygal_run()}


EARLY_JOBS = {"child_runs": _child_runs}  # started at collection (tests/early_jobs.py)


@pytest.fixture(scope="module")
def child_runs() -> dict:
    return early_jobs.job_result(f"{__name__}::child_runs", _child_runs)


def test_a_bench_module_that_leaves_tensors_alive_fails_at_its_end(child_runs):
    r = child_runs["keeps"]
    assert r.returncode == 1, r.stdout[-2000:]
    assert "left" in r.stdout and "memory alive" in r.stdout


def test_a_bench_module_that_frees_what_it_built_passes_and_a_case_that_cannot_run_here_is_a_skip(child_runs):
    r = child_runs["frees"]
    assert r.returncode == 0, r.stdout[-2000:]
    assert "1 passed, 1 skipped" in r.stdout and "too slow in the interpreter" in r.stdout, r.stdout[-2000:]


def test_cublas_workspaces_are_released_before_the_gpu_bytes_are_counted(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: calls.append("count") or 123)
    assert memory.live_bytes("cuda") == 123
    assert calls == ["clear", "count"]


def test_spent_cases_free_the_weight_stack_their_setups_shared():
    specs = [s for s in graph_replay.cases("tiny", 1, 64, (1, 2)) if s.name.startswith("graph/model/")]
    before = memory.live_bytes(DEVICE)
    fn, check, derive = specs[0].prepare()
    assert check()[0]
    del fn, check, derive
    built = memory.live_bytes(DEVICE) - before
    assert built > 0  # the shared stack lives in the specs' closures
    for s in specs:
        s.spend()
    graph_replay.release()
    assert memory.live_bytes(DEVICE) - before < max(built // 10, 1)
    with pytest.raises(RuntimeError, match="spent"):
        specs[0].prepare()


def test_graph_capture_holds_the_collector_off_inside_and_restores_it(monkeypatch):
    seen = {}

    @contextmanager
    def fake_graph(g, **kw):
        seen["gc_enabled_inside"] = gc.isenabled()
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with capture.graph_capture(object()):
        pass
    assert seen["gc_enabled_inside"] is False and gc.isenabled()
    with pytest.raises(ValueError), capture.graph_capture(object()):  # a failed capture restores it too
        raise ValueError
    assert gc.isenabled()


def test_histogram_groups_hold_at_most_50_of_the_h200_run_benchmarks():
    with gzip.open(REPO / "results/baselines/nvidia-h200-x1/pytest-benchmark.json.gz") as f:
        names = [b["extra_info"]["case"] for b in json.load(f)["benchmarks"]]
    by_module: dict[str, list[str]] = {}
    for n in names:  # one module per component: its cases are what the group rule sees
        by_module.setdefault(n.split("/")[0], []).append(n)
    groups: dict[str, int] = {}
    for module_names in by_module.values():
        for n in module_names:
            g = histogram_group(n, module_names)
            groups[g] = groups.get(g, 0) + 1
            assert n == g or n.startswith(g + "/")
    assert max(groups.values()) <= HISTOGRAM_MOST
    assert len(groups) < len(names) // 2  # groups, not one chart per benchmark


def test_histogram_without_pygal_is_refused_before_anything_runs(child_runs):
    r = child_runs["no-pygal"]
    out = r.stdout + r.stderr
    assert r.returncode == 4, out[-2000:]  # pytest's usage error
    assert "needs pygal" in out and "Traceback" not in out and "passed" not in out
