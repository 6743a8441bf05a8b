import os

import pytest
import torch

from verifybench.harness.measure.host import fingerprint, hostpin

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")


def test_choose_cpu_prefers_the_gpu_local_set_and_falls_back():
    assert hostpin.choose_cpu({0, 1, 2, 3}, {0, 1}) == 1
    assert hostpin.choose_cpu({0, 1, 2, 3}, {8, 9}) == 3  # GPU-local CPUs not allowed here: any allowed one
    assert hostpin.choose_cpu({5}, set()) == 5


@needs_affinity
def test_pin_to_an_explicit_cpu_and_report_it_in_the_fingerprint():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cpu = min(before)
    try:
        done = hostpin.pin(str(cpu))
        assert done["cpu"] == cpu and os.sched_getaffinity(0) == {cpu}
        fp = fingerprint.collect()
        assert fp["host_pin"]["cpu"] == cpu and fp["cpu_affinity"] == [cpu]
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
        hostpin.pin("off")


@needs_affinity
def test_pin_rejects_a_cpu_outside_the_allowed_set_and_nonsense():
    with pytest.raises(ValueError, match="not in this process's allowed CPUs"):
        hostpin.pin(str(max(os.sched_getaffinity(0)) + 1000))
    with pytest.raises(ValueError, match="auto, off or a CPU number"):
        hostpin.pin("fast")


def test_off_leaves_the_affinity_alone():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert hostpin.pin("off")["cpu"] is None
    if before is not None:
        assert os.sched_getaffinity(0) == before


def test_the_launcher_commit_wins_over_an_enclosing_checkout(monkeypatch):
    # an exported snapshot run inside another checkout must not report that checkout's HEAD
    monkeypatch.setenv("VERIFYBENCH_GIT_COMMIT", "abc1234")
    assert fingerprint.collect()["git"] == {"commit": "abc1234", "dirty": None, "source": "environment"}
