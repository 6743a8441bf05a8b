import numpy as np
import pytest

from verifybench.harness.measure.timing import modes, timer
from verifybench.harness.measure.timing.modes import MODES
from verifybench.harness.measure.timing.timer import measure


@pytest.fixture
def fake_samples(monkeypatch):
    """Replace the CPU clock path by a generator of synthetic per-call samples. No host gate: on a GPU machine the
    real host's speed would drop synthetic batches (the gate's tests force a FakeGate)."""
    monkeypatch.setenv("VERIFYBENCH_HOST_GATE", "off")

    def install(gen):
        monkeypatch.setattr(modes.CpuSampler, "batch", lambda self, count: [gen() for _ in range(count)])
    return install


class FakeClock:
    """The engine's clock, advanced only by the fake sampler: each sample costs `sample_s` of pretend wall time,
    so where the time cap falls does not depend on how fast this CPU draws random numbers."""

    def __init__(self, sample_s: float):
        self.now, self.sample_s = 0.0, sample_s

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_timed_samples(monkeypatch):
    """Synthetic samples on a pretend clock: `install(gen, sample_s)`; no host gate, as in fake_samples."""
    monkeypatch.setenv("VERIFYBENCH_HOST_GATE", "off")

    def install(gen, sample_s=1e-3):
        clock = FakeClock(sample_s)

        def batch(self, count):
            clock.now += count * sample_s
            return [gen() for _ in range(count)]

        monkeypatch.setattr(timer, "time", clock)
        monkeypatch.setattr(modes.CpuSampler, "batch", batch)
        return clock
    return install


def test_stops_on_ci_target_when_samples_are_tight(fake_samples):
    rng = np.random.default_rng(0)
    fake_samples(lambda: 100 + rng.normal(0, 0.2))
    m = measure(lambda: None, mode="hot", device="cpu", warmup_s=0, max_time_s=30)
    assert m.stop_reason == "ci_target"
    assert 10 <= m.summary.n < 100
    assert m.summary.rel_ci_halfwidth <= 0.01
    assert m.median_us == pytest.approx(100, rel=0.01)


def test_stops_at_time_cap_when_noise_never_settles(fake_timed_samples):
    rng = np.random.default_rng(1)
    fake_timed_samples(lambda: float(rng.lognormal(4, 2)), sample_s=1e-3)  # 0.3 s: about 300 samples
    m = measure(lambda: None, mode="hot", device="cpu", warmup_calls=1, calls_per_sample=1, max_time_s=0.3,
                max_samples=10**9)
    assert m.stop_reason == "time_cap"
    assert 200 <= m.summary.n <= 310 and m.wall_s == pytest.approx(0.3, abs=0.01)
    assert m.summary.rel_ci_halfwidth > 0.01


def test_stops_at_max_samples(fake_samples):
    rng = np.random.default_rng(2)
    fake_samples(lambda: float(rng.lognormal(4, 2)))
    m = measure(lambda: None, mode="hot", device="cpu", warmup_s=0, max_time_s=60, max_samples=40)
    assert (m.stop_reason, m.summary.n) == ("max_samples", 40)


def test_fixed_counts_are_exact_for_collectives():
    calls = []
    m = measure(lambda: calls.append(1), mode="hot", device="cpu", warmup_calls=4, samples=25, calls_per_sample=1)
    assert (m.warmup_calls, m.summary.n, m.stop_reason) == (4, 25, "fixed_samples")
    assert len(calls) == 4 + 25


def test_every_mode_runs_on_cpu_and_records_its_timer():
    def cycle(mark):  # cycle mode times one whole cycle that marks each of its phases
        sum(range(50))
        mark("a")
        sum(range(50))
        mark("b")

    for mode in MODES:
        kw = {"phases": ("a", "b")} if mode == "cycle" else {}
        fn = cycle if mode == "cycle" else (lambda: sum(range(100)))
        m = measure(fn, mode=mode, device="cpu", max_time_s=0.2, warmup_s=0, **kw)
        assert m.timer == "perf_counter" and m.device == "cpu"
        assert m.summary.min_us > 0
        assert m.mode == ("hot" if mode.startswith("host_") else mode)
        assert (m.phases is not None) == (mode == "cycle")


def test_graph_mode_rotates_over_every_input_set_equally():
    counts = [0, 0, 0]
    fns = [lambda i=i: counts.__setitem__(i, counts[i] + 1) for i in range(3)]
    m = measure(fns, mode="graph", device="cpu", warmup_calls=3, samples=10, calls_per_sample=6)
    assert counts == [1 + 20] * 3 and m.summary.n == 10  # 3 warm-up calls, then 10 samples x 6 calls, round robin
    auto = measure(fns, mode="graph", device="cpu", warmup_calls=3, max_time_s=0.2)
    assert auto.calls_per_sample % 3 == 0


def test_fixed_samples_without_fixed_calls_per_sample_is_refused():
    with pytest.raises(ValueError, match="every rank"):
        measure(lambda: None, mode="hot", device="cpu", samples=10)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown mode"):
        measure(lambda: None, mode="warm", device="cpu")
    with pytest.raises(TypeError):
        measure([], device="cpu")
    with pytest.raises(ValueError):
        measure(lambda: None, device="cpu", min_samples=1)


def test_max_time_comes_from_environment_when_not_given(monkeypatch, fake_timed_samples):
    rng = np.random.default_rng(3)
    fake_timed_samples(lambda: float(rng.lognormal(4, 2)), sample_s=1e-3)
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.2")
    m = measure(lambda: None, device="cpu", warmup_calls=1, calls_per_sample=1, max_samples=10**9)
    assert m.stop_reason == "time_cap" and m.wall_s == pytest.approx(0.2, abs=0.01)


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "0", "-1", ""])
def test_a_bad_max_time_in_the_environment_is_named(monkeypatch, value):
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", value)
    with pytest.raises(ValueError, match="VERIFYBENCH_MAX_TIME_S must be a number of seconds > 0"):
        measure(lambda: None, device="cpu", warmup_calls=1, samples=2, calls_per_sample=1)


@pytest.mark.parametrize("kw, message", [
    ({"max_time_s": float("nan")}, "max_time_s"), ({"max_time_s": 0}, "max_time_s"),
    ({"rel_ci_target": -0.1}, "rel_ci_target"), ({"warmup_s": float("inf")}, "warmup_s"),
    ({"samples": 0, "calls_per_sample": 1}, "samples"), ({"warmup_calls": 0}, "warmup_calls"),
    ({"calls_per_sample": 0}, "calls_per_sample"),
])
def test_bad_measure_arguments_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        measure(lambda: None, device="cpu", **kw)


@pytest.mark.gpu
def test_graph_and_event_timing_agree_on_a_large_copy():
    import torch

    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    hot = measure(lambda: dst.copy_(src), mode="hot")
    graph = measure(lambda: dst.copy_(src), mode="graph")
    assert graph.median_us == pytest.approx(hot.median_us, rel=0.05)


class FakeGate:
    """A host that reads slow on every read listed in `slow_reads` (0-based)."""

    def __init__(self, slow_reads=()):
        self.slow_reads, self.reads, self.ref_us, self.factor = set(slow_reads), 0, 100.0, 1.4

    def read(self):
        slow = self.reads in self.slow_reads
        self.reads += 1
        return (200.0 if slow else 100.0), not slow


def test_host_gate_drops_batches_that_touch_a_slow_read(fake_samples):
    values = iter(range(1, 10**6))
    fake_samples(lambda: float(next(values)))
    # reads: 0 before batch 1, then one after each batch; read 2 is slow: batches 2 and 3 touch it
    m = measure(lambda: None, mode="hot", device="cpu", warmup_calls=1, calls_per_sample=1, min_samples=2,
                max_samples=8, max_time_s=60, host_gate=FakeGate({2}))
    assert m.host_gate == {"ref_us": 100.0, "slow_factor": 1.4, "kept_batches": 4, "dropped_batches": 2,
                           "dropped_samples": 4}
    assert m.samples_us == [1, 2, 7, 8, 9, 10, 11, 12]  # samples 3..6 (batches 2, 3) were dropped
    assert len(m.host_probe_us) == 2 + 6  # before, one read per batch, after


def test_host_gate_that_never_reads_fast_keeps_everything_at_the_time_cap(fake_samples):
    fake_samples(lambda: 1.0)
    m = measure(lambda: None, mode="hot", device="cpu", warmup_calls=1, max_time_s=0.2,
                host_gate=FakeGate(range(10**6)))
    assert m.stop_reason == "time_cap_host_slow_kept_all" and m.summary.n > 0
    assert m.host_gate["kept_batches"] == 0


def test_no_gate_without_a_gpu_and_when_switched_off(fake_samples, monkeypatch):
    fake_samples(lambda: 1.0)
    monkeypatch.setattr(timer, "cuda_available", lambda: False)  # a CPU-only box: CPU timers are not gated
    assert measure(lambda: None, mode="hot", device="cpu", warmup_calls=1, max_time_s=0.1).host_gate is None
    monkeypatch.setenv("VERIFYBENCH_HOST_GATE", "off")
    from verifybench.harness.measure.host import hostprobe
    assert hostprobe.process_gate() is None
    monkeypatch.setenv("VERIFYBENCH_HOST_GATE", "maybe")
    with pytest.raises(ValueError, match="VERIFYBENCH_HOST_GATE"):
        hostprobe.process_gate()


def test_auto_calls_per_sample_is_a_power_of_two_times_the_input_sets(fake_samples):
    fake_samples(lambda: 3.0)  # 3 us a call: 500 us / 3 = 167 calls, rounded up to 256
    assert measure(lambda: None, mode="graph", device="cpu", warmup_calls=1, max_time_s=0.05).calls_per_sample == 256
    fns = [lambda: None] * 3
    assert measure(fns, mode="hot", device="cpu", warmup_calls=3, max_time_s=0.05).calls_per_sample == 258
    fake_samples(lambda: 2000.0)  # slower than the target: one pass over the sets
    assert measure(fns, mode="graph", device="cpu", warmup_calls=3, max_time_s=0.05).calls_per_sample == 3


def test_process_state_is_recorded_with_every_measurement():
    m = measure(lambda: None, mode="hot", device="cpu", warmup_calls=1, samples=2, calls_per_sample=1)
    assert set(m.process_state) == {"cupy_imported", "process_group"}
    assert m.as_dict()["process_state"] == m.process_state


def test_a_cpu_case_is_checked_then_sampled_by_the_cpu_rule(monkeypatch, fake_timed_samples):
    from verifybench.harness.measure.timing import runner

    monkeypatch.setattr(timer, "cuda_available", lambda: False)  # no device given, no CUDA: a CPU case
    monkeypatch.delenv("VERIFYBENCH_MAX_TIME_S", raising=False)
    events = []

    def case(**kw):
        return runner.run_case("x", {}, lambda: events.append("call"), mode="hot",
                               check=lambda: (events.append("check") or True, "ok"), **kw).measurement

    rng = np.random.default_rng(4)
    noisy = lambda: float(rng.lognormal(4, 2))  # noqa: E731 (never settles: the cap ends the sampling)
    fake_timed_samples(noisy, sample_s=0.01)
    m = case(max_time_s=5.0)  # a GPU-sized cap: the CPU cap wins
    assert events == ["check", "call"]  # checked first, then one warm-up call (sampling is faked)
    assert (m.warmup_calls, m.calls_per_sample, m.stop_reason) == (1, 1, "time_cap")
    assert m.wall_s == pytest.approx(runner.CPU_MAX_TIME_S, abs=0.011)
    monkeypatch.setenv("VERIFYBENCH_MAX_TIME_S", "0.05")
    assert case(calls_per_sample=2).wall_s == pytest.approx(0.05, abs=0.011)  # the environment's cap
    assert case(calls_per_sample=2).calls_per_sample == 2  # a component's K (a rotation) is kept
    fake_timed_samples(noisy, sample_s=1.0)  # a sample slower than the cap: the minimum, no more
    assert case().summary.n == runner.CPU_MIN_SAMPLES


def test_a_fixed_count_case_keeps_its_counts_and_a_failed_check_is_not_timed(monkeypatch):
    from verifybench.harness.measure.timing import runner

    monkeypatch.setattr(timer, "cuda_available", lambda: False)
    calls = []
    m = runner.run_case("x", {}, lambda: calls.append(1), mode="hot", check=lambda: (True, "ok"), device="cpu",
                        samples=5, calls_per_sample=3, warmup_calls=4).measurement
    assert (m.warmup_calls, m.summary.n, m.calls_per_sample, m.stop_reason) == (4, 5, 3, "fixed_samples")
    assert len(calls) == 4 + 5 * 3
    calls.clear()
    case = runner.run_case("x", {}, lambda: calls.append(1), mode="hot", check=lambda: (False, "wrong"))
    assert not case.check_ok and case.measurement is None and calls == []
    seen = {}
    monkeypatch.setattr(runner, "measure", lambda fn, **kw: seen.update(kw))
    runner.run_case("x", {}, lambda: None, mode="graph", check=lambda: (True, "ok"), device="cuda", max_time_s=0.5)
    assert seen == {"mode": "graph", "device": "cuda", "max_time_s": 0.5}  # a GPU case: measure()'s own rule


def test_a_case_setup_gets_the_params_it_names_as_arguments():
    from verifybench.harness.measure.timing.runner import CaseSpec

    got = {}

    def setup(batch, tokens):
        got.update(batch=batch, tokens=tokens)
        return (lambda: None), (lambda: (True, "ok")), None

    case = CaseSpec("x", {"batch": 4, "tokens": 3, "context": 64}, "hot", setup).run(device="cpu", max_time_s=0.05)
    assert got == {"batch": 4, "tokens": 3} and case.check_ok
    with pytest.raises(TypeError, match=r"case y: its setup takes \['depth'\], which its params do not carry"):
        CaseSpec("y", {"batch": 1}, "hot", lambda depth: None).prepare()
