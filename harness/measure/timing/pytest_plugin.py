"""pytest-benchmark adapter: benchmarks run through the harness engine, and pytest-benchmark's statistics, saved
JSON, compare and histogram then hold the *device* per-call samples (seconds), not its host-clock rounds.

pytest-benchmark has no public hook for foreign samples. We use the fixture's private `_make_stats(iterations)`,
whose result's `update(seconds)` adds one sample; seen in 5.2.3 and 5.3.x (pyproject pins the range, and
tests/measure/test_pytest_plugin.py checks the saved JSON end to end). microbench/conftest.py imports this module's
names.
"""
from __future__ import annotations

import pytest
import torch

from verifybench.harness.measure.host import fingerprint, hostpin, hostprobe
from verifybench.harness.measure.timing import memory, timer
from verifybench.harness.measure.timing.runner import Case, CaseSkipped, CaseSpec
from verifybench.kernels.common import config_tables

CPU_NOTE = ("NOTE: no GPU here: these figures are CPU numbers (torch CPU code and the Triton interpreter, timed "
            "with perf_counter), not device times")
VOLATILE_KEYS = ("created_utc", "loadavg")  # differ run to run: pytest-benchmark would flag the machine as changed


def _no_ratio(baseline, value, width) -> str:
    return " " * width  # the cell pytest-benchmark would fill with "(2.31)" or "(>1000.0)"


def pytest_configure(config):
    """--benchmark-histogram needs pygal, which pytest-benchmark imports only after the whole run: refuse at once.
    Without a GPU the table shows no ratio to the best case: a ratio of CPU numbers carries no conclusion
    (stance.py); pytest-benchmark has no option for it, so its module-level formatter is replaced (5.2.3-5.3.x)."""
    if not torch.cuda.is_available():
        from pytest_benchmark import table

        table.compute_baseline_scale = _no_ratio
    if config.getoption("benchmark_histogram", default=None):
        try:
            import pygal  # noqa: F401
        except ImportError:
            raise pytest.UsageError("--benchmark-histogram needs pygal, which is not installed "
                                    "(pip install pygal), so no histogram can be drawn") from None


def pytest_sessionstart(session):
    """Before anything is timed: check the engine's VERIFYBENCH_* settings (a usage error naming the bad one), pin
    the process to one GPU-local CPU (harness/hostpin.py), cap its memory (VERIFYBENCH_MEMORY_CAP_GIB), and on a
    CPU-only machine time with one torch thread, as `verifybench run` does."""
    try:
        timer.max_time_from_env()
        hostprobe.process_gate()
        memory.cap_bytes()
        hostpin.pin()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    memory.apply_cap()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)


def pytest_terminal_summary(terminalreporter):
    """Which kernels ran on default configs on which GPU (no tuned table for it), once per GPU; on a machine
    without CUDA, that the figures are CPU numbers."""
    for line in config_tables.defaults_notice():
        terminalreporter.write_line(line)
    session = getattr(terminalreporter.config, "_benchmarksession", None)  # pytest-benchmark's, when it is active
    if not torch.cuda.is_available() and session is not None and session.benchmarks:
        terminalreporter.write_line(CPU_NOTE)


def pytest_benchmark_update_machine_info(config, machine_info):
    """The run fingerprint goes into machine_info['verifybench'] (clock readings go per benchmark, in extra_info)."""
    hostpin.pin()  # whichever hook pytest-benchmark calls first, the fingerprint shows the pinning in force
    fp = fingerprint.collect()
    for key in VOLATILE_KEYS:
        fp.pop(key, None)
    for gpu in fp.get("gpus", []):
        gpu.pop("now", None)
    machine_info["verifybench"] = fp
    machine_info["verifybench_method_version"] = timer.METHOD_VERSION  # compare warns when BASE and NEW differ in it
    machine_info["verifybench_cpu_numbers"] = not torch.cuda.is_available()


HISTOGRAM_MOST = 50  # pytest-benchmark's histogram draws one chart per group and leaves out a group larger than this


def histogram_group(name: str, names: list[str], most: int = HISTOGRAM_MOST) -> str:
    """The shortest '/'-prefix of `name` that at most `most` of `names` share (the whole name at worst)."""
    parts = name.split("/")
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        if sum(1 for n in names if n == prefix or n.startswith(prefix + "/")) <= most:
            return prefix
    return name


def _feed(benchmark, case: Case) -> None:
    """Put the engine's per-call samples into pytest-benchmark's stats, and the rest into extra_info."""
    if not hasattr(benchmark, "_make_stats"):
        raise RuntimeError("this pytest-benchmark has no BenchmarkFixture._make_stats; supported: 5.2.3 to 5.3.x")
    m = case.measurement
    stats = benchmark._make_stats(1)
    for sample_us in m.samples_us:
        stats.update(sample_us * 1e-6)
    benchmark._mode = "device_benchmark(...)"  # marks the fixture used, as its own entry points do
    info = m.as_dict()
    info.pop("samples_us")  # already the stats data
    benchmark.extra_info.update({"case": case.name, "params": case.params, "check": case.check_detail,
                                 **info, "derived": case.derived})


@pytest.fixture
def device_benchmark(benchmark, request):
    """Returns run(spec: CaseSpec) -> Case: checks the case, times it with the engine, feeds pytest-benchmark.

    A failing check fails the test and records no time; a case that cannot run here is skipped with its reason.
    With --benchmark-disable the case is only checked. The benchmark's group is a prefix of the case name shared by
    at most HISTOGRAM_MOST of the module's cases.
    """

    def run(spec: CaseSpec, **measure_overrides) -> Case:
        names = [s.name for s in getattr(request.module, "CASES", ())] or [spec.name]
        benchmark.group = benchmark.group or histogram_group(spec.name, names)
        if benchmark.disabled:
            try:
                fn, check, _ = spec.prepare()
            except CaseSkipped as why:
                pytest.skip(f"{spec.name}: {why}")
            ok, detail = check()
            if not ok:
                pytest.fail(f"{spec.name}: check failed: {detail}")
            return Case(name=spec.name, params=spec.params, check_ok=True, check_detail=detail)
        case = spec.run(**measure_overrides)
        if case.skipped:  # a case that cannot run here (e.g. a Triton kernel too slow for the CPU interpreter)
            pytest.skip(f"{spec.name}: {case.skipped}")
        if not case.check_ok:
            benchmark.has_error = True
            pytest.fail(f"{spec.name}: check failed, not timed: {case.check_detail}")
        _feed(benchmark, case)
        return case

    return run
