"""Bad input, fourth pass: result files read through one reader (a bad case left out, named and counted, never
merged), a batched answer that names its B, the regressions of the third pass, and the small ones."""
import json
import re
from pathlib import Path

import pytest

from verifybench.harness.cli import main
from verifybench.harness.measure.results import store

BASELINES = Path(__file__).resolve().parents[2] / "results" / "baselines" / "nvidia-h200-x1"
TAUS = ["--accept-len", "3:2.4,6:3.1"]


def _case(b, steps, topk, d, cycle_ms, decode_ms, context=4096, ok=True):
    """A GPU cycle case at B requests, as `verifybench cycle --batch` stores it."""
    table = {"draft": 1.0, "verify": cycle_ms - 1.5, "reextend": 0.3, "other": 0.2}
    case = {"name": f"cycle/kimi-k2.5-tp8/ctx{context}/B{b}/s{steps}k{topk}d{d}/extend",
            "params": {"preset": "kimi-k2.5", "tp": 8, "context": context, "batch": b, "steps": steps, "topk": topk,
                       "draft_tokens": d, "attention": "extend"},
            "check": {"ok": ok, "detail": "ok" if ok else "mismatch"},
            "derived": {"table_ms": table, "decode_ms": decode_ms, "bare_forward_ms": cycle_ms - 2.5,
                        "beyond_bare_total_ms": 1.0, "beyond_bare_ms": {"sync": 0.1},
                        "attention_per_forward_ms": {"tree": 0.5}, "allreduce_bytes": b * d * 7168 * 2}}
    if ok:
        case.update(mode="cycle", device="cuda", samples_us=[cycle_ms * 1e3] * 3,
                    summary={"n": 3, "median_us": cycle_ms * 1e3})
    return case


def _cycle_file(folder: Path, sizes=(1, 2, 4, 8), ok=True, edit=None) -> Path:
    """A GPU cycle result at each B of `sizes`, shapes (2,1,3) and (5,1,6); plain decode and the cycle grow with B."""
    cases = []
    for b in sizes:
        decode = 10.0 + 0.5 * b
        cases += [_case(b, 2, 1, 3, decode * {1: 1.5, 2: 1.8, 4: 2.2, 8: 2.9}[b], decode, ok=ok),
                  _case(b, 5, 1, 6, decode * {1: 2.0, 2: 2.5, 4: 3.3, 8: 4.4}[b], decode, ok=ok)]
    run = store.make_run("cycle", [], {"gpu_model": "NVIDIA H200", "cuda_available": True, "slug": "h200",
                                         "gpus": [{"name": "NVIDIA H200"}]})
    run["cases"] = cases
    if edit:
        edit(run)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cycle-20261201T000000Z.json"
    path.write_text(json.dumps(run))
    return path


def _at_b(b):
    return lambda run: [c for c in run["cases"] if c["params"]["batch"] == b]


def _run(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, [line for line in err.splitlines() if line.strip()]


# ---- one reader for result files

def test_a_batched_cycle_case_without_its_batch_is_left_out_not_merged_into_b1(tmp_path, capsys):
    path = _cycle_file(tmp_path, edit=lambda run: [c["params"].pop("batch") for c in _at_b(2)(run)])
    rc, out, err = _run(["advise", tmp_path, *TAUS], capsys)
    assert rc == 0 and "measured at B 1, 4, 8)" in out and "B 1, 1" not in out
    assert len(err) == 1 and err[0].startswith(f"note: {path}: 2 of 8 cases left out")
    assert "case 'cycle/kimi-k2.5-tp8/ctx4096/B2/s2k1d3/extend': field params.batch must be" in err[0]
    assert "got missing" in err[0]


@pytest.mark.parametrize("bad", [0, -2, 2.5, 100, "2", None, True])
def test_a_bad_batch_size_in_a_result_file_is_left_out_naming_the_file_the_case_and_the_field(bad, tmp_path, capsys):
    def edit(run):
        run["cases"][2]["params"]["batch"] = bad
    path = _cycle_file(tmp_path, edit=edit)
    for argv in (["plan", path, "--context", "4096", *TAUS], ["advise", path, *TAUS]):
        rc, out, err = _run(argv, capsys)
        assert rc == 0 and len(err) == 1, err
        assert err[0].startswith(f"note: {path}: 1 of 8 cases left out") and "field params.batch must be an " \
            "integer in 1..64, got" in err[0] and "B2/s2k1d3" in err[0]
        assert bad == "2" or f"B {bad}" not in out and f"B {bad!r}" not in out


def test_a_batch_times_draft_tokens_past_the_forward_rows_limit_is_left_out(tmp_path, capsys):
    def edit(run):
        run["cases"][-1]["params"]["batch"] = 16  # x D 6 = 96 rows
    path = _cycle_file(tmp_path, edit=edit)
    rc, out, err = _run(["plan", path, *TAUS], capsys)
    assert rc == 0 and "params.batch x params.draft_tokens = 16 x 6 = 96 rows; at most 64" in err[0]


def test_a_stored_median_far_from_its_own_samples_is_left_out(tmp_path, capsys):
    def edit(run):
        run["cases"][1]["summary"]["median_us"] *= 10
    path = _cycle_file(tmp_path, edit=edit)
    rc, out, err = _run(["plan", path, *TAUS], capsys)
    assert rc == 0 and len(err) == 1 and f"note: {path}: 1 of 8 cases left out" in err[0]
    assert "field summary.median_us" in err[0] and "disagrees with the median of its 3 samples" in err[0]


def test_every_case_of_a_result_with_a_bad_field_refuses_it_in_one_line(tmp_path, capsys):
    def edit(run):
        for c in run["cases"]:
            c["params"]["context"] = "4096"
    path = _cycle_file(tmp_path, edit=edit)
    rc, out, err = _run(["plan", path, *TAUS], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {path}: case ")
    assert "field params.context must be an integer in 1..1048576, got '4096'" in err[0]


def test_plan_on_a_cycle_whose_every_check_failed_names_the_file(tmp_path, capsys):
    path = _cycle_file(tmp_path, sizes=(2, 4, 8), ok=False)
    rc, out, err = _run(["plan", tmp_path, *TAUS], capsys)
    assert rc == 2 and len(err) == 1 and f"{path}: no passing case (every check failed" in err[0]


def test_advise_on_a_cycle_whose_every_check_failed_says_so_and_does_not_blame_the_accept_length(tmp_path, capsys):
    path = _cycle_file(tmp_path, sizes=(2, 4, 8), ok=False)
    rc, out, err = _run(["advise", tmp_path, *TAUS], capsys)
    assert rc == 0 and f"cycle ({path}): no passing case: every check failed" in out
    assert "--accept-len" not in " ".join(err)


# ---- a batched answer names its B, each rate per request or in total

def test_advise_on_a_batched_cycle_without_b1_names_the_b_of_its_answer_and_levers(tmp_path, capsys):
    _cycle_file(tmp_path, sizes=(2, 4, 8))
    rc, out, err = _run(["advise", tmp_path, *TAUS], capsys)
    assert rc == 0
    assert re.search(r"^## The answer at B = 2 \(.*tok/s per request", out, re.M), out
    assert re.search(r"^## Levers, .* at B = 2 \(", out, re.M)


def test_plan_at_one_batch_of_a_batched_cycle_says_per_request_and_in_total_and_keeps_the_per_batch_section(
        tmp_path, capsys):
    _cycle_file(tmp_path, sizes=(2, 4, 8))
    rc, out, err = _run(["plan", tmp_path, "--batch", "2", *TAUS], capsys)
    best = re.search(r"^best: .* at ([0-9.]+) tok/s per request at B 2 \(([0-9.]+) in total\)", out, re.M)
    assert rc == 0 and best, out
    assert float(best[2]) == pytest.approx(2 * float(best[1]), rel=1e-3)
    assert "## Per batch" in out


# ---- regressions

def test_advise_refuses_an_accept_length_past_what_the_shape_can_accept(capsys):
    rc, out, err = _run(["advise", BASELINES, "--accept-len", "4:9"], capsys)
    assert rc == 2 and len(err) == 1 and "--accept-len: accept length 9 for 4 outside 1..4" in err[0]


def test_compare_reads_a_gpu_pytest_benchmark_file_with_gloo_rows_as_gpu_numbers(capsys):
    f = BASELINES / "pytest-benchmark.json.gz"
    rc, out, err = _run(["compare", f, f], capsys)
    assert rc == 0 and "CPU numbers" not in out and "summary: SAME 545" in out


# ---- compare on folders: each refusal says what to pass

def test_compare_folder_refusals_say_what_to_pass_instead(tmp_path, capsys):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "verify-20261201T000000Z.json").write_bytes((BASELINES / "verify.json").read_bytes())
    mine = tmp_path / "mine.json"
    mine.write_bytes((BASELINES / "verify.json").read_bytes())
    text = tmp_path / "x.txt"
    text.write_bytes(mine.read_bytes())
    for other in (mine, text):
        rc, out, err = _run(["compare", folder, other], capsys)
        assert rc == 2 and len(err) == 1 and f"BASE {folder}" in err[0] and "pass --kind verify" in err[0], err


# ---- options mean the same on CPU and GPU

CPU_ONLY = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke profile's listing")


@CPU_ONLY
def test_mla_decode_on_cpu_runs_the_tokens_and_context_given_and_keeps_b_times_n_within_the_limit(monkeypatch,
                                                                                                     capsys):
    from verifybench.harness.analysis.numbers import FORWARD_ROWS_MAX
    from verifybench.harness.components import mla_decode as bench

    monkeypatch.setattr(bench, "INTERPRET", True)  # the interpreted kernels' rows listed too
    specs = bench.cases("tiny", 1, 128, (2,), batch=(2,))
    assert {(s.params["context"], s.params["tokens"], s.params["batch"]) for s in specs} == {(128, 2, 2)}
    specs = bench.cases("tiny", 1, 64, (1,), batch=(20,))
    assert {s.params["tokens"] for s in specs} == {1}
    assert all(s.params["batch"] * s.params["tokens"] <= FORWARD_ROWS_MAX for s in specs)
    from verifybench.harness import run as run_mod

    scope = {"preset": "tiny", "tp": 1, "context": 64, "tokens": (4,), "batch": (20,), "options": {}}
    with pytest.raises(ValueError, match="--batch 20 x --tokens 4 = 80 tokens per verify forward"):
        run_mod.check_cases(["mla_decode"], scope)  # the command's one check, on the cases listed
    capsys.readouterr()
    from verifybench.harness.measure.timing import runner

    monkeypatch.setattr(runner, "_SAID", set())
    assert {s.params["context"] for s in bench.cases("tiny", 1, 64)} == set(bench.CPU_CONTEXTS)
    said = capsys.readouterr().out.splitlines()
    assert said == ["mla_decode on CPU: context 256 in place of the profile's 64 (enough keys for the split kernel "
                    "to split; --context N runs N)"]


# ---- B x D: checked once, where the command reads --batch and --tokens (run._cases), for every component

BATCH_COMPONENTS = ("cycle", "mla_decode", "mla_verify", "verify")


@pytest.mark.parametrize("command", [*BATCH_COMPONENTS, "run"])
def test_b_times_d_past_the_limit_is_refused_in_one_line_by_every_command_that_takes_batch_and_tokens(
        command, tmp_path, capsys):
    assert main([command, "--batch", "32", "--tokens", "3", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    d = "--configs D" if command == "cycle" else "--tokens"  # the cycle's D is its configurations' (--tokens picks)
    assert len(err) == 1 and err[0].endswith(f"--batch 32 x {d} 3 = 96 tokens per verify forward; at most 64 (B x D)")
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_the_batch_components_cases_carry_batch_and_tokens_and_their_setups_take_them_by_name():
    """The batch and the tokens a case's record names are the arguments its setup gets (CaseSpec.prepare); the
    components list B x D past the limit without refusing it: the command's one check does."""
    import inspect

    from verifybench.harness import components, run as run_mod

    assert tuple(sorted(run_mod.batch_components())) == BATCH_COMPONENTS
    for name in BATCH_COMPONENTS:
        specs = components.load(name).cases("tiny", 1, 64, (3,), batch=(1, 32))
        tokens = "draft_tokens" if name == "cycle" else "tokens"
        assert specs and {s.params["batch"] for s in specs} == {1, 32}, name
        assert {s.params[tokens] for s in specs} == {3}, name
        assert all({"batch", tokens} <= set(inspect.signature(s.setup).parameters) for s in specs), name


def test_the_token_components_cases_carry_tokens_and_their_setups_take_them_by_name():
    """skinny_gemm and moe_int4 take --tokens only: the token count their records name is the one their setups get."""
    import inspect

    from verifybench.harness import components

    for name in ("skinny_gemm", "moe_int4"):
        specs = components.load(name).cases("tiny", 1, 64, (3,))
        plain = [s for s in specs if s.params["impl"] != "triton"]  # the interpreted kernel keeps its own CPU n
        assert plain and {s.params["tokens"] for s in plain} == {3}, name
        assert all("tokens" in inspect.signature(s.setup).parameters for s in specs
                   if s.params["device"] != "cpu" or s.params["impl"] != "triton" or name != "moe_int4"), name


@CPU_ONLY
@pytest.mark.parametrize("tokens, batch", [((1, 2, 4, 8), None), ((1,), (1, 2))])
def test_run_takes_the_readmes_token_counts_on_cpu_and_the_cycle_says_which_shapes_it_runs(tokens, batch, capsys,
                                                                                             monkeypatch):
    from verifybench.harness import components
    from verifybench.harness import run as run_mod
    from verifybench.harness.measure.timing import runner

    monkeypatch.setattr(runner, "_SAID", set())
    scope = {"preset": "tiny", "tp": 1, "context": 64, "tokens": tokens, "batch": batch, "options": {}}
    run_mod.check_cases(list(components.REGISTRY), scope)
    cycle = run_mod._cases("cycle", scope)  # listed a second time, as run does: said once
    assert cycle and {s.params["draft_tokens"] for s in cycle} == {3}
    out = capsys.readouterr().out
    assert out.count("cycle: --tokens ") == 1 and "names no draft-token count of its default shapes" in out


# ---- memory limits: the process's and the container's, and a CPU allocation failure skipped like a CUDA one

def test_cpu_free_memory_is_held_to_the_process_rlimit(monkeypatch):
    import resource

    from verifybench.harness.measure.timing import memory

    real = resource.getrlimit
    size = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (size + memory.GIB, resource.RLIM_INFINITY)
                        if which == resource.RLIMIT_AS else real(which))
    assert 0.9 * memory.GIB < memory.free_bytes("cpu") <= memory.GIB
    with pytest.raises(Exception, match=r"under this process's rlimit \(ulimit -v / -d\)"):
        memory.require(2 * memory.GIB, "a test allocation", "cpu")


@pytest.mark.parametrize("files, free", [
    ({"memory.max": "3221225472", "memory.current": "1073741824"}, 2 << 30),  # cgroup v2
    ({"memory.max": "max", "memory.current": "1073741824"}, None),  # v2, no limit
    ({"memory/memory.limit_in_bytes": "2147483648", "memory/memory.usage_in_bytes": "536870912"}, 3 << 29),  # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "5"}, None),  # v1 none
], ids=["v2", "v2-max", "v1", "v1-none"])
def test_the_container_memory_limit_is_read_from_cgroup_v2_and_v1(files, free, tmp_path):
    from verifybench.harness.measure.timing import memory

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    assert memory.container_free_bytes(tmp_path) == free


def test_a_cpu_allocation_failure_is_skipped_like_a_cuda_out_of_memory():
    from verifybench.harness.measure.timing.runner import CaseSpec

    def setup():
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 5368750080 bytes. Error code 12 (Cannot allocate memory)")
    case = CaseSpec("x", {}, "hot", setup).run()
    assert case.skipped == ("out of memory despite the memory plan: can't allocate memory: you tried to allocate "
                            "5368750080 bytes (twice; the second time after collecting unreferenced memory)")

    def other():
        raise RuntimeError("a shape mismatch")
    with pytest.raises(RuntimeError, match="a shape mismatch"):
        CaseSpec("y", {}, "hot", other).run()


@CPU_ONLY
def test_verify_under_ulimit_v_is_skipped_by_the_memory_plan_not_a_traceback(tmp_path):
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    proc = subprocess.run([sys.executable, "-m", "verifybench.harness.cli", "verify", "--batch", "64", "--tokens", "1",
                           "--context", "1048576", "--out", str(tmp_path)], preexec_fn=limit, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "skipped 17: " in proc.stdout and " is free" in proc.stdout  # under the rlimit, or less memory than it


# ---- the small ones

def test_trace_without_a_cycle_range_keeps_the_last_cycles_copy_after_its_last_kernel(tmp_path):
    from trace_builders import eager_engine_trace

    from verifybench.harness.answers import trace

    r = trace.decompose([eager_engine_trace(cycles=4).write(tmp_path / "t.json")])
    assert r["found_by"].startswith("periodic kernel sequence: 6 kernels per cycle") and r["cycles"] == 4
    assert r["per_cycle_us"]["memcpy"] == 3.0 and r["per_cycle_us"]["total"] == 88.0


def test_expert_bytes_int4_refuses_a_group_size_that_does_not_divide_hidden_or_inter():
    from verifybench.kernels.moe_int4.reference import expert_bytes_int4

    with pytest.raises(ValueError, match="group_size 32 does not divide hidden = 100"):
        expert_bytes_int4(100, 30, 32)
    with pytest.raises(ValueError, match="group_size 32 does not divide inter = 48"):
        expert_bytes_int4(128, 48, 32)
    assert expert_bytes_int4(128, 64, 32) == 2 * 64 * (64 + 4 * 2) + 128 * (32 + 2 * 2)


def test_quantize_w4a16_refuses_a_float_group_size_in_one_line():
    import torch

    from verifybench.kernels.moe_int4.reference import dequantize_w4a16, quantize_w4a16

    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="group_size must be an int, got float 32.0"):
        quantize_w4a16(w, 32.0)
    packed, scales = quantize_w4a16(w, 32)
    with pytest.raises(ValueError, match="group_size must be an int, got float 32.0"):
        dequantize_w4a16(packed, scales, 32.0)


def _tree_record(backend, skipped=False):
    rec = {"name": f"tree/verify/{backend}/d4t2s2/B1", "device": "cpu", "check": {"ok": not skipped},
           "params": {"step": "verify", "backend": backend, "tree": "d4t2s2", "batch": 1, "variant": "x"},
           "derived": {}}
    if skipped:
        rec["skipped"] = "Triton kernels not run: TRITON_INTERPRET='0' turns the interpreter off"
    else:
        rec.update(mode="cpu-loop", summary={"median_us": 5.0})
    return rec


def test_kv_tree_tables_say_the_kernels_did_not_run_when_the_interpreter_is_off():
    from verifybench.harness.components import kv_tree

    titles = " | ".join(t for t, _ in kv_tree.tables([_tree_record("reference"), _tree_record("kernel", True)]))
    assert "ran in the" not in titles and titles.count("the kernels did not run: the Triton interpreter is off") == 2
    titles = " | ".join(t for t, _ in kv_tree.tables([_tree_record("reference"), _tree_record("kernel")]))
    assert titles.count("the kernels ran in the Triton interpreter") == 2


def test_a_parent_cgroups_memory_limit_holds_the_process_cgroup_under_it(tmp_path):
    from verifybench.harness.measure.timing import memory

    leaf = tmp_path / "a" / "b"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text("100\n")
    (tmp_path / "a" / "memory.max").write_text("1100\n")
    (tmp_path / "a" / "memory.current").write_text("600\n")
    assert memory.container_free_bytes(tmp_path, "0::/a/b\n") == 500
