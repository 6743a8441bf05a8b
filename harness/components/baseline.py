"""The engine's own component: the copy-bandwidth ceiling (what eta is measured against) and the sync-distortion
exhibit (one op timed with a host sync per call, with events back to back, and in a CUDA graph, side by side).

Every `verifybench run` starts with it, so each results folder holds the ceiling of the GPU it ran on. A tuning loop
that times with a sync after each op sees the host round trip, not the op.
"""
from __future__ import annotations

from pathlib import Path

import torch

from verifybench.harness.measure import stance
from verifybench.harness.measure.timing import ceiling
from verifybench.harness.measure.results.store import cpu_numbers, mode_label, withhold_on_cpu
from verifybench.harness.measure.timing.runner import CaseSpec, rel_error
from verifybench.harness.measure.timing.timer import cuda_available

NAME = "baseline"
HELP = "copy-bandwidth ceiling and the sync-distortion exhibit"
EXHIBIT_MODES = ("host_sync", "hot", "graph")
L2_RESIDENT_BYTES = 8 << 20  # fits the 50-60 MB L2 of an H100/H200: hot and cold differ here


def _ops(device: str) -> dict:
    """name -> (make inputs, op). On CUDA the shapes are Kimi-K2.5's: a 14 KiB [1, 7168] bf16 add (the size of
    one token's allreduce) and the fused q_a/kv_a projection at 4 tokens. CPU: small fp32 stand-ins."""
    if device == "cuda":
        dtype, hidden, out_features, tokens = torch.bfloat16, 7168, 2112, 4
    else:
        dtype, hidden, out_features, tokens = torch.float32, 256, 64, 4
    return {
        f"add[1,{hidden}]": (
            lambda: (torch.randn(1, hidden, dtype=dtype, device=device), torch.randn(1, hidden, dtype=dtype, device=device)),
            torch.add,
        ),
        f"matmul[{tokens},{hidden}]x[{hidden},{out_features}]": (
            lambda: (torch.randn(tokens, hidden, dtype=dtype, device=device),
                     torch.randn(hidden, out_features, dtype=dtype, device=device) / hidden**0.5),
            torch.matmul,
        ),
    }


def exhibit_cases(device: str | None = None) -> list[CaseSpec]:
    device = device or ("cuda" if cuda_available() else "cpu")
    out = []
    for op_name, (make, op) in _ops(device).items():
        for mode in EXHIBIT_MODES:
            def setup(make=make, op=op):
                a, b = make()

                def fn():
                    return op(a, b)

                def check():
                    err = rel_error(fn(), op(a.double(), b.double()))
                    tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-5
                    return err <= tol, f"rel_err={err:.2e} (tol {tol:g})"

                return fn, check, None

            out.append(CaseSpec(name=f"sync/{op_name}/{stance.case_mode(mode, device)}",
                                params={"op": op_name, "device": device},
                                mode=mode, setup=setup, measure_kw={"device": device}))
    return out


def exhibit_table(case_records: list[dict]) -> list[dict]:
    """Rows op, median per mode (us) and ratios host_sync/graph and hot/graph, from stored case records."""
    by_op: dict[str, dict[str, float]] = {}
    for c in case_records:
        if c["name"].startswith("sync/") and c["check"]["ok"]:
            way = stance.gpu_mode(c["name"].rsplit("/", 1)[1])  # a CPU case's name carries cpu-loop for graph
            by_op.setdefault(c["params"]["op"], {})[way] = c["summary"]["median_us"]
    rows = []
    for op_name, t in by_op.items():
        row = {"op": op_name, **{f"{m}_us": t.get(m) for m in EXHIBIT_MODES}}
        if t.get("graph"):
            row["host_sync/graph"] = t["host_sync"] / t["graph"] if "host_sync" in t else None
            row["hot/graph"] = t["hot"] / t["graph"] if "hot" in t else None
        rows.append(row)
    return rows


TAKES_TOKENS = False  # fixed shapes: `baseline --tokens` would be accepted and ignored


def cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None = None) -> list[CaseSpec]:
    """Shapes do not depend on the preset: the ceiling is the GPU's (a large copy, and on a GPU a copy that fits
    its L2, hot and cold), the exhibit uses Kimi-K2.5 sizes."""
    copies = [ceiling.copy_case(mode=m) for m in ("hot", "graph")]
    if cuda_available():
        copies += [ceiling.copy_case(L2_RESIDENT_BYTES, mode=m) for m in ("cold", "hot", "graph")]
    return [*copies, *exhibit_cases()]


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    copy_rows = [{"case": r["name"], "mode": mode_label(r), "median_us": r["summary"]["median_us"],
                  "GB/s": r["derived"]["gbps"]} for r in records if r["name"].startswith("copy/") and r["check"]["ok"]]
    # on CPU the three ways are all perf_counter around CPU calls: their ratios say nothing of a GPU's distortion
    exhibit = withhold_on_cpu(records, exhibit_table(records), lambda k: "/" in k)
    copy_rows = withhold_on_cpu(records, copy_rows, ("GB/s",))  # a CPU memcpy's rate: no GPU's ceiling
    return [("copy-bandwidth ceiling (read + write bytes)", copy_rows),
            ("sync distortion: one op timed three ways (ratios to the graph time)"
             + ("; CPU: no CUDA graph nor device sync, each way is a loop of CPU calls" if cpu_numbers(records)
                else ""), exhibit)]


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    return []


def release() -> None:
    """Nothing is cached across cases."""
