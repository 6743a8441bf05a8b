"""Decomposition arithmetic of the verify forward: parts vs whole, the fixed-vs-per-token fit, the roofline, the
break-even accept length, and a labelled what-if projection onto another GPU.

Pure functions over medians in microseconds; the measuring is done by the verify component.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from verifybench.harness.analysis.fit import linear_fit


def table(full_us: dict[int, float], isolated_us: dict[str, dict[int, float]],
          without_us: dict[str, dict[int, float]], roofline_us: dict[int, float],
          comm: str = "allreduce") -> list[dict]:
    """One row per n: measured forward, every component's isolated time and marginal time (forward minus forward
    without it), the sum of the isolated parts and its error against the measured forward, and the roofline. The
    roofline has no term for communication, so it is held against the forward without `comm`."""
    rows = []
    for n in sorted(full_us):
        t = full_us[n]
        row = {"n": n, "measured_us": t}
        for comp in isolated_us:
            row[f"{comp}_us"] = isolated_us[comp].get(n)
            if comp in without_us and n in without_us[comp]:
                row[f"{comp}_marginal_us"] = t - without_us[comp][n]
        parts = [isolated_us[c][n] for c in isolated_us if n in isolated_us[c]]
        row["sum_of_parts_us"] = sum(parts)
        row["parts_error_%"] = 100 * (sum(parts) / t - 1)
        row["roofline_us"] = roofline_us.get(n)
        row["measured/roofline"] = t / roofline_us[n] if roofline_us.get(n) else None
        no_comm = without_us.get(comm, {}).get(n)
        row["no_comm_us"] = no_comm
        row["no_comm/roofline"] = no_comm / roofline_us[n] if roofline_us.get(n) and no_comm else None
        rows.append(row)
    return rows


def token_fit(full_us: dict[int, float]) -> dict:
    """T(n) = a + b n with 95% intervals; fixed share = a / T(max n)."""
    ns = sorted(full_us)
    f = linear_fit(ns, [full_us[n] for n in ns])
    return {**f.as_dict(), "fixed_share": f.a / f.predict(ns[-1]), "n_max": ns[-1]}


def batch_fits(rows: list[dict]) -> list[dict]:
    """T = a + b * tokens over the full forward's rows ({B, tokens_per_forward, forward_us}): one line per batch B
    over its n (tokens = B * n), and one over every row. b is the cost of one more token in the forward; a slope that
    falls as B grows is the MoE reading fewer new experts per token (their count saturates). Lines with fewer than
    3 rows or one token count are left out."""
    out = []
    for b in [*sorted({r["B"] for r in rows}), "all"]:
        pts = [r for r in rows if b == "all" or r["B"] == b]
        xs = [r["tokens_per_forward"] for r in pts]
        if len(pts) < 3 or len(set(xs)) < 2:
            continue
        f = linear_fit(xs, [r["forward_us"] for r in pts])
        out.append({"B": b, "tokens": f"{min(xs)}-{max(xs)}", "a_us": f.a, "a_ci_us": f.a_halfwidth,
                    "b_us_per_token": f.b, "b_ci_us": f.b_halfwidth, "r2": f.r2})
    return out


@dataclass(frozen=True)
class BreakEven:
    speedup: float
    tau_star: float
    cycle_ms: float


def break_even(accept_len: float, decode_ms: float, verify_ms: float, draft_ms: float, overhead_ms: float) -> BreakEven:
    """tau = mean tokens accepted per verify, bonus included. speedup = tau * T_decode / (T_draft + T_verify +
    T_overhead); break-even tau* = (T_draft + T_verify + T_overhead) / T_decode."""
    values = (accept_len, decode_ms, verify_ms, draft_ms, overhead_ms)
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"break-even needs finite numbers, got {values}")
    if accept_len <= 0 or decode_ms <= 0 or min(verify_ms, draft_ms, overhead_ms) < 0:
        raise ValueError("accept length and decode time must be > 0, the other times >= 0")
    cycle = draft_ms + verify_ms + overhead_ms
    if cycle <= 0:
        raise ValueError("a speculation cycle needs a positive time")
    return BreakEven(speedup=accept_len * decode_ms / cycle, tau_star=cycle / decode_ms, cycle_ms=cycle)


@dataclass(frozen=True)
class Gpu:
    """A GPU described by numbers, for a what-if projection."""

    name: str
    copy_gbps: float
    allreduce_us: float


def project(parts_us: dict[str, float], bytes_by_comp: dict[str, int], here: Gpu, there: Gpu,
            allreduces: int) -> dict[str, tuple[float, float]]:
    """A PROJECTION, not a measurement: each measured part moved onto `there` as a (low, high) range.
    A part that reads bytes is t = overhead + bytes / effective bandwidth, with the split unknown: one end assumes
    all of t scales with copy bandwidth (same eta there), the other that only the ideal streaming time bytes / copy
    bandwidth does and the rest (launches, latency, under-filled SMs) stays; low is the smaller of the two. The allreduce part is `allreduces` x there's
    latency; parts without bytes (norms, activations) stay as measured."""
    figures = (here.copy_gbps, there.copy_gbps, there.allreduce_us)
    if not all(math.isfinite(v) for v in figures) or not all(math.isfinite(v) for v in parts_us.values()):
        raise ValueError(f"a projection needs finite figures, got {figures} and parts {parts_us}")
    if here.copy_gbps <= 0 or there.copy_gbps <= 0 or there.allreduce_us < 0 or allreduces < 0:
        raise ValueError("copy bandwidths must be > 0, the allreduce latency and count >= 0")
    ratio = here.copy_gbps / there.copy_gbps
    out = {}
    for comp, t in parts_us.items():
        nbytes = bytes_by_comp.get(comp, 0)
        if comp == "allreduce":
            out[comp] = (allreduces * there.allreduce_us,) * 2
        elif nbytes:
            ideal_here = nbytes / (here.copy_gbps * 1e3)
            scaled, streaming_only = t * ratio, max(t - ideal_here, 0.0) + ideal_here * ratio
            out[comp] = (min(scaled, streaming_only), max(scaled, streaming_only))
        else:
            out[comp] = (t, t)
    return out
