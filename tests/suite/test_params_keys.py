"""One params key per quantity in every component's result files, and older files read under today's keys: the
components' cases write no old key, every committed baseline loads with today's keys and its readers (tables, compare,
plan, advise) take it as it is on disk, which stays untouched."""
import hashlib
import json
import re
from pathlib import Path

import pytest

from verifybench.harness import components
from verifybench.harness.cli import main as cli_main
from verifybench.harness.measure.results import store
from verifybench.harness.model.presets import default_scope

BASELINES = Path(__file__).resolve().parents[2] / "results" / "baselines"
H200 = BASELINES / "nvidia-h200-x1"
# names that meant a quantity another key now carries, in any component (moe_int4's topk is old only there: the
# draft tree's width keeps topk in kv_tree and cycle)
NEVER_WRITTEN = {"n", "D", "B", "spec_steps"}


def _suite_files() -> list[Path]:
    out = []
    for p in sorted(BASELINES.rglob("*.json*")):
        if p.name.endswith((".json", ".json.gz")) and store.read_json(p).get("schema") == store.SCHEMA:
            out.append(p)
    return out


SUITE_FILES = _suite_files()


def _specs(name: str) -> list:
    preset, tp, context = default_scope(False)
    return components.load(name).cases(preset, tp, context, None)


@pytest.mark.parametrize("name", components.REGISTRY)
def test_no_component_writes_an_old_params_key(name):
    specs = _specs(name)
    assert specs
    old = set(store.OLD_PARAMS_KEYS.get(name, {})) | NEVER_WRITTEN
    written = {k for s in specs for k in s.params}
    assert not written & old, f"{name} writes {sorted(written & old)}: write {store.OLD_PARAMS_KEYS.get(name)}"
    for s in specs:  # a case's params are already today's: reading them back changes nothing
        assert store.current_params(name, s.params) == s.params, s.name


@pytest.mark.parametrize("name", components.REGISTRY)
def test_the_case_names_numbers_are_the_params_under_one_key_each(name):
    """n<k>, ctx<k> and B<k> in a case name are the tokens, context and batch params: one key per quantity."""
    for s in _specs(name):
        for seg in s.name.split("/"):
            for prefix, key in (("n", "tokens"), ("ctx", "context"), ("B", "batch")):
                m = re.fullmatch(rf"{prefix}(\d+)", seg)
                if m:
                    assert s.params.get(key) == int(m[1]), f"{s.name}: params[{key!r}] = {s.params.get(key)!r}"


@pytest.mark.parametrize("name", components.REGISTRY)
def test_a_component_whose_cases_carry_batch_reads_older_files_without_it_as_one_request(name):
    if any("batch" in s.params for s in _specs(name)) and "batch" not in store.OLD_PARAMS_KEYS.get(name, {}).values():
        assert store.MISSING_PARAMS_KEYS.get(name, {}).get("batch") == 1, \
            f"{name}'s cases carry batch: its older files need batch 1 in store.MISSING_PARAMS_KEYS"


def test_the_committed_baselines_cover_the_renamed_components():
    held = {store.read_json(p)["component"] for p in SUITE_FILES}
    assert set(store.OLD_PARAMS_KEYS) | set(store.MISSING_PARAMS_KEYS) <= held


@pytest.mark.parametrize("path", SUITE_FILES, ids=lambda p: str(p.relative_to(BASELINES)))
def test_a_committed_baseline_loads_under_todays_keys_and_stays_as_it_is_on_disk(path):
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    raw = store.read_json(path)
    run = store.load_run(path)
    comp = run["component"]
    for old_case, case in zip(raw["cases"], run["cases"]):
        p = case["params"]
        assert not set(p) & set(store.OLD_PARAMS_KEYS.get(comp, {})), case["name"]
        for old, new in store.OLD_PARAMS_KEYS.get(comp, {}).items():
            if old in old_case["params"]:
                assert p[new] == old_case["params"][old], case["name"]
        for key in store.MISSING_PARAMS_KEYS.get(comp, {}):
            assert key in p, case["name"]
        assert case["name"] == old_case["name"]  # the names are compare's keys
    if comp in components.REGISTRY:  # the component's own readers take the old file
        assert components.load(comp).tables(run["cases"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_an_old_file_with_old_keys_still_holds_them_on_disk():
    """The check above reads a file that still has old keys, so it tests the reading, not an already-new file."""
    raw = store.read_json(H200 / "mla_verify.json")
    assert all("n" in c["params"] and "tokens" not in c["params"] for c in raw["cases"])


@pytest.mark.parametrize("kind", ["mla_verify", "kv_tree", "moe_int4", "cycle"])
def test_an_old_baseline_compares_same_by_name_with_itself_and_with_its_new_keys_copy(kind, tmp_path, capsys):
    """An older file against the same run as today's writer stores it (params under today's keys): every case
    pairs by name (the keys compare matches on are unchanged) and nothing moved."""
    path = next(p for p in (H200 / f"{kind}.json", H200 / f"{kind}.json.gz") if p.exists())
    raw = store.read_json(path)
    new = store.validate_run(json.loads(json.dumps(raw)), "copy")
    copy = store.write_json_atomic(tmp_path / f"{kind}-new.json", new)
    assert cli_main(["compare", str(path), str(path)]) == 0
    assert cli_main(["compare", str(path), str(copy)]) == 0
    out = capsys.readouterr().out
    assert "only in BASE" not in out and "only in NEW" not in out
    assert not re.search(r"\b(SLOW|FAST)\b", out.split("summary")[0])
    assert "SAME" in out


def test_plan_and_advise_read_the_old_baselines(capsys):
    for kind in ("cycle", "verify"):  # neither file has batch: written before --batch
        assert "batch" not in store.read_json(H200 / f"{kind}.json")["cases"][0]["params"]
        assert cli_main(["plan", str(H200 / f"{kind}.json"), "--accept-len", "3:2.4"]) == 0
    capsys.readouterr()
    assert cli_main(["advise", str(H200), "--accept-len", "3:2.4"]) == 0
    text = capsys.readouterr().out
    assert "split_kv" in text  # advise's attention lever, from mla_verify's old "n" read as tokens


def test_the_docs_list_every_old_key_beside_its_new_one():
    text = (Path(__file__).resolve().parents[2] / "docs" / "measuring.md").read_text()
    rows = [line.split(" | ") for line in text.split("### Params keys")[1].split("\n## ")[0].splitlines()
            if line.startswith("| `")]
    for comp, renamed in store.OLD_PARAMS_KEYS.items():
        for old, new in renamed.items():
            assert any(f"`{new}`" in r[0] and f"`{old}`" in r[2] and comp in r[2] for r in rows), (comp, old, new)
    for comp, missing in store.MISSING_PARAMS_KEYS.items():
        for key in missing:
            assert any(f"`{key}`" in r[0] and comp in r[2] for r in rows), (comp, key)


def test_current_params_renames_fills_and_refuses_two_values_of_one_quantity():
    old = {"n": 3, "D": 576, "context": 64}
    assert store.current_params("mla_decode", old) == {"tokens": 3, "DK": 576, "context": 64, "batch": 1}
    assert old == {"n": 3, "D": 576, "context": 64}  # a copy: a spec's own dict may be the one passed
    assert store.current_params("kv_tree", {"D": 4, "B": 8, "spec_steps": 3}) == {
        "draft_tokens": 4, "batch": 8, "steps": 3}  # per component: D was another quantity there
    assert store.current_params("verify", {"tokens": 1}) == {"tokens": 1, "batch": 1}
    assert store.current_params("cycle", {"batch": 4}) == {"batch": 4}
    assert store.current_params("moe_int4", {"n": 2, "tokens": 2}) == {"tokens": 2}
    with pytest.raises(store.ResultsError, match="'n' .*'tokens'"):
        store.current_params("skinny_gemm", {"n": 2, "tokens": 3})
    assert store.current_params("someone_else", {"n": 2}) == {"n": 2}
