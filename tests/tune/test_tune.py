"""`verifybench tune` on CPU: its refusals, where the tables go ($VERIFYBENCH_CONFIG_DIR, ~/.config/verifybench,
--out), the atomic write merged over the shipped table, selection reading the user's table over the shipped one (and
hiding both), a tune that measures nothing writing nothing, and the defaults notice."""
import json
import sys
import types

import pytest
import torch

from verifybench.harness import cli
from verifybench.harness import tune
from verifybench.harness.tune import common
from verifybench.kernels.common import config_tables, devices
from verifybench.kernels.skinny_gemm import configs as sgs


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    d = tmp_path / "user"
    monkeypatch.setenv(config_tables.CONFIG_DIR_ENV, str(d))
    return d


def _fake_tuners(monkeypatch, wrote: dict):
    """Tuner modules that write (or not) a small table at the path they are given, recording their budget."""
    for name in tune.TUNERS:
        def fake(*args, name=name, **kw):
            path = kw.get("out") or args[0]
            wrote[name] = (path, kw.get("max_minutes", args[1] if len(args) > 1 else None))
            if name == "mla_decode":
                return None  # measured nothing
            table = {"cpu": {"shapes": {"1,1": {}}}}
            config_tables.save(table, path)
            return table
        monkeypatch.setitem(sys.modules, f"verifybench.harness.tune.{name}", types.SimpleNamespace(tune=fake))


def test_tune_without_cuda_exits_2_in_one_line_and_writes_nothing(user_dir, capsys, monkeypatch):
    monkeypatch.setattr(tune, "cuda_available", lambda: False)
    assert cli.main(["tune"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a CUDA GPU" in err
    assert not user_dir.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--components", "skinny_gemm,skinny_gemm"], "lists skinny_gemm twice"),
    (["--components", "nope"], "--components"),
    (["--tp", "0"], "--tp must be >= 1"),
    (["--preset", "nope"], "nope"),
    (["--budget-s", "1e9"], "--budget-s must be <="),
])
def test_tune_refuses_bad_arguments_before_any_work(argv, needle, user_dir, capsys, monkeypatch):
    monkeypatch.setattr(tune, "cuda_available", lambda: True)
    _fake_tuners(monkeypatch, wrote := {})
    assert cli.main(["tune", *argv]) == 2
    assert needle in capsys.readouterr().err and not wrote and not user_dir.exists()


def test_tune_help_says_where_the_tables_go(capsys):
    assert cli.main(["tune", "--help"]) == 0
    text = capsys.readouterr().out
    assert "VERIFYBENCH_CONFIG_DIR" in text and "~/.config/verifybench" in text and "--budget-s" in text


def test_tables_go_to_the_config_dir_env_else_home_config_else_out(tmp_path, monkeypatch):
    monkeypatch.setenv(config_tables.CONFIG_DIR_ENV, str(tmp_path / "env"))
    assert tune.table_path("skinny_gemm", None) == tmp_path / "env" / "skinny_gemm_configs.json"
    assert tune.table_path("mla_decode", tmp_path / "o") == tmp_path / "o" / "mla_decode_configs.json"
    monkeypatch.delenv(config_tables.CONFIG_DIR_ENV)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tune.table_path("moe_int4", None) == tmp_path / "home" / ".config" / "verifybench" / "moe_int4_configs.json"


def test_tune_writes_each_kernel_into_the_user_dir_and_exits_1_when_one_measured_nothing(user_dir, monkeypatch):
    monkeypatch.setattr(tune, "cuda_available", lambda: True)
    _fake_tuners(monkeypatch, wrote := {})
    assert cli.main(["tune", "--budget-s", "90"]) == 1  # mla_decode measured nothing
    assert set(wrote) == set(tune.TUNERS)
    assert all(str(path).startswith(str(user_dir)) for path, _ in wrote.values())
    assert sorted(p.name for p in user_dir.iterdir()) == ["moe_int4_configs.json", "skinny_gemm_configs.json"]
    assert wrote["skinny_gemm"][1] == pytest.approx(30, abs=1)  # the budget split three ways
    assert wrote["moe_int4"][1] == pytest.approx(1.5, abs=0.05)  # in minutes: what the others left unused
    assert not (sgs.CONFIG_PATH.parent / "mla_decode_configs.tuned.json").exists()


def test_tune_out_writes_there_and_one_component_exits_0(tmp_path, user_dir, monkeypatch):
    monkeypatch.setattr(tune, "cuda_available", lambda: True)
    _fake_tuners(monkeypatch, wrote := {})
    assert cli.main(["tune", "--components", "skinny_gemm", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "skinny_gemm_configs.json").is_file() and not user_dir.exists()
    assert wrote["skinny_gemm"][1] == pytest.approx(600, abs=1)


def test_merged_table_keeps_other_gpus_and_starts_from_the_shipped_entry(tmp_path):
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"GPU A": {"shapes": {"1,1": {"1": {"kind": "torch"}}}, "tuned_on": {}}}))
    user = tmp_path / "user.json"
    user.write_text(json.dumps({"GPU B": {"shapes": {}}}))
    table, entry = common.merged_table(user, shipped, "GPU A")
    assert set(table) == {"GPU A", "GPU B"} and entry["shapes"] == {"1,1": {"1": {"kind": "torch"}}}
    entry["shapes"]["2,2"] = {}
    assert "2,2" not in config_tables.load(shipped)["GPU A"]["shapes"]  # a copy: the shipped table is untouched


def test_save_is_atomic_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "t.json"
    config_tables.save({"a": {"x": 1}}, path)
    with pytest.raises(TypeError):
        config_tables.save({"a": {"x": object()}}, path)  # fails half way: the old table stays whole
    assert json.loads(path.read_text()) == {"a": {"x": 1}}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_selection_reads_the_user_table_over_the_shipped_one_per_gpu_and_can_hide_both(tmp_path, user_dir,
                                                                                      monkeypatch):
    shipped = tmp_path / "shipped.json"
    config_tables.save({"GPU A": {"v": "shipped"}, "GPU B": {"v": "shipped"}}, shipped)
    config_tables.save({"GPU A": {"v": "user"}}, user_dir / "shipped.json")
    assert config_tables.merged(shipped) == {"GPU A": {"v": "user"}, "GPU B": {"v": "shipped"}}
    before = config_tables.state()
    with config_tables.defaults_only():
        assert config_tables.merged(shipped) == {} and config_tables.state() != before
    monkeypatch.setenv(config_tables.TABLES_ENV, "none")
    assert config_tables.merged(shipped) == {}
    with config_tables.defaults_only(False):  # tables on whatever the environment says
        assert config_tables.merged(shipped)["GPU B"] == {"v": "shipped"}
    monkeypatch.setenv(config_tables.TABLES_ENV, "yes")
    with pytest.raises(ValueError, match="VERIFYBENCH_CONFIG_TABLES"):
        config_tables.merged(shipped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path")
@pytest.mark.parametrize("kernel", ["skinny_gemm", "mla_decode"])
def test_a_tune_that_measures_nothing_writes_no_table(kernel, tmp_path):
    import importlib

    mod = importlib.import_module(f"verifybench.harness.tune.{kernel}")
    out = tmp_path / "t.json"
    lines = []
    assert mod.tune(str(out), 0.0, smoke=True, log=lines.append) is None  # the time limit passed at once
    assert not out.exists() and "no table written" in lines[-1]


def test_defaults_notice_names_each_gpus_default_kernels_once(monkeypatch):
    monkeypatch.setattr(config_tables, "_LOOKUPS", {})
    monkeypatch.setattr(config_tables, "_NO_ENTRY", set())
    monkeypatch.setattr(config_tables, "_REPORTED", set())
    monkeypatch.setattr(devices, "device_name", lambda device: "NVIDIA H200")
    for n in (3, 5):
        config_tables.record("mla_decode", "cuda", f"n={n}", "default")
    config_tables.record("mla_decode", "cuda", "n=1", "tuned")
    config_tables.record("moe_int4", "cuda", "n=1", "default", gpu_in_table=False)
    config_tables.record("skinny_gemm", "cuda", "n=8", config_tables.fit_source(114688, 101376))
    config_tables.record("skinny_gemm", "cpu", "n=1", "default")  # CPU runs are not reported
    lines = config_tables.defaults_notice()
    assert lines == ["NOTE: NVIDIA H200: no tuned table for mla_decode (n=3,5), moe_int4: running defaults; "
                     "`verifybench tune` tunes this GPU",
                     "NOTE: NVIDIA H200: tuned entries too large for its shared memory, defaults run instead: "
                     "skinny_gemm n=8: tuned entry needs 114688 B shared memory, GPU allows 101376 B"]
    assert config_tables.defaults_notice() == []  # once per GPU


def test_defaults_notice_names_the_kernels_that_ran_with_tables_hidden(monkeypatch):
    from verifybench.kernels.common import config_tables as ct

    monkeypatch.setattr(devices, "device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(ct, "_LOOKUPS", {})
    monkeypatch.setattr(ct, "_NO_ENTRY", set())
    monkeypatch.setattr(ct, "_REPORTED", set())
    with ct.defaults_only():
        ct.record("moe_int4", "cuda", "n=1", "default", gpu_in_table=False)
        ct.record("skinny_gemm", "cuda", "n=4", "default", gpu_in_table=False)
    assert ct.sources("cuda") == {"moe_int4": [ct.HIDDEN_SOURCE], "skinny_gemm": [ct.HIDDEN_SOURCE]}
    lines = ct.defaults_notice()
    assert len(lines) == 1 and "tables hidden" in lines[0] and "moe_int4, skinny_gemm" in lines[0]
    assert ct.defaults_notice() == []  # once per GPU
