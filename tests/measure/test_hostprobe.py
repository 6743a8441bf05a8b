import pytest

from verifybench.harness.cli import main as cli_main
from verifybench.harness.measure import hostnoise
from verifybench.harness.measure.host import hostprobe
from verifybench.harness.measure.timing import timer


def test_probe_is_a_positive_time_and_the_engine_records_it_around_each_case():
    assert hostprobe.probe_us(reps=3) > 0
    m = timer.measure(lambda: None, mode="hot", device="cpu", samples=3, calls_per_sample=2, warmup_calls=1)
    assert len(m.host_probe_us) == 2 and all(p > 0 for p in m.host_probe_us)
    assert m.as_dict()["host_probe_us"] == m.host_probe_us


def test_series_summary_spread_and_rank_correlation():
    rows = [{"t_s": i, "probe_us": p, "replay_us": 2 * p} for i, p in enumerate([10, 20, 30, 40, 50, 60, 70, 80, 90,
                                                                                 100, 110])]
    s = hostnoise.summarize_series(rows)
    assert s["slots"] == 11
    assert s["probe_us"]["p10"] == pytest.approx(20) and s["probe_us"]["p90"] == pytest.approx(100)
    assert s["probe_us"]["p90_over_p10"] == pytest.approx(5)
    assert s["spearman_probe_replay_us"]["rho"] == pytest.approx(1.0)
    assert "eager_us" not in s


def test_cli_on_cpu_writes_the_series(tmp_path, capsys):
    assert cli_main(["hostprobe", "--seconds", "0.2", "--json", str(tmp_path / "h.json")]) == 0
    assert "probe_us" in capsys.readouterr().out and (tmp_path / "h.json").exists()
    assert cli_main(["hostprobe", "--seconds", "0"]) == 2
    assert cli_main(["hostprobe", "--seconds", "nan"]) == 2


def test_cli_json_onto_an_existing_file_writes_a_new_one_and_keeps_the_old(tmp_path, capsys):
    first = tmp_path / "h.json"
    first.write_text('{"mine": 1}')
    assert cli_main(["hostprobe", "--seconds", "0.2", "--json", str(first)]) == 0
    assert first.read_text() == '{"mine": 1}'
    assert (tmp_path / "h-2.json").exists() and "wrote " + str(tmp_path / "h-2.json") in capsys.readouterr().out


def test_gate_calibrates_to_the_fastest_read_and_splits_states_at_the_factor():
    reads = iter([100, 90, 95, 120, 130, 125, 80, 111, 113])
    gate = hostprobe.HostGate(probe=lambda: next(reads), factor=1.4, calibrate_s=0)
    assert gate.read() == (90, True) and gate.ref_us == 90  # calibration read 100 first; the reference is the min
    assert gate.read() == (95, True)
    assert gate.read() == (120, True)  # 120 <= 1.4 x 90 = 126
    assert gate.read() == (130, False)
    assert gate.read() == (125, True)
    assert gate.read() == (80, True) and gate.ref_us == 80  # a faster read lowers the reference
    assert gate.read() == (111, True)  # 111 <= 112
    assert gate.read() == (113, False)
