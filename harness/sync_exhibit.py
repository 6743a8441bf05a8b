"""Sync-distortion exhibit: one op timed three ways (host clock + synchronize per call, CUDA events back to back,
in a CUDA graph), side by side, with the ratios to the graph time.

A tuning loop that times with a sync after each op sees the host round trip, not the op (DESIGN.md section 3).
"""
from __future__ import annotations

import torch

from harness.runner import CaseSpec, rel_error
from harness.timing import cuda_available

EXHIBIT_MODES = ("host_sync", "hot", "graph")


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


def cases(device: str | None = None) -> list[CaseSpec]:
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

            out.append(CaseSpec(name=f"sync/{op_name}/{mode}", params={"op": op_name, "device": device},
                                mode=mode, setup=setup, measure_kw={"device": device}))
    return out


def table(case_records: list[dict]) -> list[dict]:
    """Rows op, median per mode (us) and ratios host_sync/graph and hot/graph, from stored case records."""
    by_op: dict[str, dict[str, float]] = {}
    for c in case_records:
        if c["name"].startswith("sync/") and c["check"]["ok"]:
            by_op.setdefault(c["params"]["op"], {})[c["name"].rsplit("/", 1)[1]] = c["summary"]["median_us"]
    rows = []
    for op_name, t in by_op.items():
        row = {"op": op_name, **{f"{m}_us": t.get(m) for m in EXHIBIT_MODES}}
        if t.get("graph"):
            row["host_sync/graph"] = t["host_sync"] / t["graph"] if "host_sync" in t else None
            row["hot/graph"] = t["hot"] / t["graph"] if "hot" in t else None
        rows.append(row)
    return rows
