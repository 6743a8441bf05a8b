"""The suite's own scheduling (tests/early_jobs.py, conftest.py): the tiny run and the files' EARLY_JOBS start at
collection and their readers run late, the timed jobs follow the early ones, jobs yield the CPU to the tests, fault
jobs run at once."""
import os
import subprocess
import sys
import threading
import time

import early_jobs
from torchrun_jobs import run_jobs_at_once


def test_the_early_jobs_start_at_collection_their_readers_run_late_and_the_timed_files_last(request):
    items = request.session.items
    place = [early_jobs.place(item) for item in items]
    assert place == sorted(place)
    assert all((at == 2) == bool(early_jobs.job_fixtures(item, "TIMED_JOBS")) for item, at in zip(items, place))
    assert all(place[i] == 1 for i, item in enumerate(items) if "run_dir" in item.fixturenames)
    jobs = {name for item in items for name in early_jobs.job_fixtures(item)}
    run = {"run"} if any("run_dir" in getattr(item, "fixturenames", ()) for item in items) else set()
    assert early_jobs.started_at_collection == run | jobs


def test_a_job_not_queued_at_collection_runs_when_its_fixture_reads_it():
    calls = []
    assert early_jobs.job_result("probe::not-queued", lambda: calls.append(1) or 8) == 8 and calls == [1]


def test_the_timed_jobs_follow_the_early_ones_and_every_job_runs_below_the_tests_priority(monkeypatch):
    for name, fresh in (("_lane", None), ("_jobs", {}), ("_started", {}), ("_timed_fns", {}), ("_timed_start", None),
                        ("_timed_lane", None), ("_timed", {}), ("started_at_collection", set())):
        monkeypatch.setattr(early_jobs, name, fresh)  # a session of its own, beside the real one
    niceness = [sys.executable, "-c", "import os; print(os.nice(0))"]
    order, early_may_end = [], threading.Event()

    def early():
        early_may_end.wait(10)
        order.append("early")
        return int(early_jobs.run(niceness, 30).stdout)

    early_jobs.submit("probe::early", early)
    early_jobs.register_timed("probe::timed", lambda: order.append("timed") or int(early_jobs.run(niceness, 30).stdout))
    early_jobs.queue_timed()
    try:
        time.sleep(0.3)
        assert order == []  # not beside the early job
        early_may_end.set()
        deadline = time.monotonic() + 10
        while len(order) < 2 and time.monotonic() < deadline:  # no reader has asked for it yet
            time.sleep(0.02)
        assert order == ["early", "timed"]
        below = max(early_jobs.JOB_NICE, os.nice(0))
        assert early_jobs.job_result("probe::early", None) == early_jobs.timed_result("probe::timed", None) == below
    finally:
        early_may_end.set()
        for lane in (early_jobs._lane, early_jobs._timed_lane):
            if lane is not None:
                lane.shutdown(wait=True)


def test_jobs_run_at_once_each_with_its_own_outcome():
    sleep = [sys.executable, "-c", "import sys, time; time.sleep(2); print(sys.argv[1:]); sys.exit(3)"]
    t0 = time.monotonic()
    done = run_jobs_at_once([sleep, sleep + ["x"]], 60)
    assert time.monotonic() - t0 < 3.8  # not one after the other
    (rc0, out0, _, tag0), (rc1, out1, _, tag1) = done
    assert rc0 == rc1 == 3 and tag0 != tag1 and tag0 in out0 and "'x'" in out1 and tag1 in out1


def _past_a_3_s_timeout(cmd: list[str]) -> tuple[subprocess.Popen, str, bool, float]:
    """(the process, its output, whether it was killed, wall seconds) of `cmd` run through early_jobs with a 3 s
    timeout."""
    t0 = time.monotonic()
    proc = early_jobs.popen(cmd, stdout=subprocess.PIPE, text=True)
    out, _, killed = early_jobs.communicate(proc, 3)
    return proc, out, killed, time.monotonic() - t0


def test_a_job_process_past_its_timeout_is_ended_with_its_children():
    tree = [sys.executable, "-c", "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); "
            "time.sleep(60)"]
    proc, out, killed, wall_s = _past_a_3_s_timeout(tree)
    assert killed and "up" in out and wall_s < 10
    time.sleep(0.2)
    group = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(proc.pid)], capture_output=True, text=True).stdout
    assert all(line.split()[1].startswith("Z") for line in group.splitlines()), group  # its child went too


def test_a_driver_past_its_timeout_ends_the_job_it_started_in_a_session_of_its_own():
    """As the NCCL sweep runs each torchrun: the driver is asked to stop (SIGINT) before it is killed, so that it
    ends its job, which its own group's kill would not reach."""
    driver = [sys.executable, "-c", "import subprocess, sys, time\n"
              "job = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
              "print(job.pid, flush=True)\ntry:\n    time.sleep(60)\nfinally:\n    job.kill()\n"]
    _, out, killed, wall_s = _past_a_3_s_timeout(driver)
    assert killed and wall_s < 15  # not the job's own minute: its end closed the output too
    stat = f"/proc/{int(out.split()[0])}/stat"
    time.sleep(0.2)
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"


def test_the_tiny_run_and_the_jobs_run_unpinned_unless_the_session_was_pinned(monkeypatch, tmp_path):
    # pinned, each GPU job would take the same CPU (VERIFYBENCH_PIN_CPU=auto) and wait there behind the others
    assert early_jobs.ENVIRON["VERIFYBENCH_PIN_CPU"] == os.environ.get("VERIFYBENCH_PIN_CPU", "off")
    seen = {}

    class Popen:
        pid = -1  # no process: the lower priority has nobody to change

        def __init__(self, cmd, env, **kwargs):
            seen.update(env)

    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.setenv("VERIFYBENCH_PIN_CPU", "auto")  # a test's change after the session began does not leak in
    early_jobs.start_run(tmp_path)
    assert seen["VERIFYBENCH_PIN_CPU"] == early_jobs.ENVIRON["VERIFYBENCH_PIN_CPU"]
