"""Speculative decoding pays off when the tokens accepted per cycle outweigh the cycle's cost:
speedup = tau * T_decode / (T_draft + T_verify + T_overhead), break-even tau* = (T_draft + T_verify + T_overhead) /
T_decode, with tau the mean tokens accepted per verify, bonus token included.

Defaults: the Kimi-K2.5 deployment on 8x RTX PRO 6000 Blackwell (PCIe, SGLang EAGLE-3, 3 draft tokens): decode 11.1
ms, verify 25.6 ms, draft 1.0 ms, overhead 0.4 ms (re-extend 0.3 + tree build, sync, bookkeeping 0.1): a 27 ms cycle.
A time not given is that assumed figure, labelled ASSUMED in the output. The ASSUMED_* constants of
harness/analysis/breakeven.py are the one place every command takes these assumptions from.
"""
from __future__ import annotations

import argparse

from tabulate import tabulate

from verifybench.harness.analysis.decompose import break_even
from verifybench.harness.analysis.numbers import MAX_STEP_MS, TOKEN_COUNT_MAX, accept_len, finite_float

DEPLOYMENT = "Kimi-K2.5 on 8x RTX PRO 6000 Blackwell, PCIe, SGLang EAGLE-3"
ASSUMED_DECODE_MS, ASSUMED_VERIFY_MS = 11.1, 25.6  # the deployment's plain decode, and its verify at 3 draft tokens
ASSUMED_DRAFT_MS, ASSUMED_DRAFT_STEPS = 1.0, 2  # drafting per cycle, over its 2 draft steps
ASSUMED_DRAFT_STEP_MS = ASSUMED_DRAFT_MS / ASSUMED_DRAFT_STEPS
ASSUMED_REEXTEND_MS, ASSUMED_OTHER_MS = 0.3, 0.1  # re-extend; tree build, sync, bookkeeping
ASSUMED_OVERHEAD_MS = ASSUMED_REEXTEND_MS + ASSUMED_OTHER_MS


class Assumed(float):
    """An option's default taken from ASSUMED_*: argparse keeps a default as given, so a value of this type is one
    the user did not give, and the output labels it ASSUMED."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept-len", type=accept_len, required=True,
                   help=f"tau: mean tokens accepted per verify, bonus included, in 1..{TOKEN_COUNT_MAX} (1: the "
                   "bonus token alone, every draft token rejected)")
    p.add_argument("--decode-ms", type=finite_float(0, MAX_STEP_MS, exclusive=True),
                   default=Assumed(ASSUMED_DECODE_MS), help="one plain decode step (ms)")
    p.add_argument("--verify-ms", type=finite_float(0, MAX_STEP_MS), default=Assumed(ASSUMED_VERIFY_MS),
                   help="one verify step (ms)")
    p.add_argument("--draft-ms", type=finite_float(0, MAX_STEP_MS), default=Assumed(ASSUMED_DRAFT_MS),
                   help="drafting the tokens (ms)")
    p.add_argument("--overhead-ms", type=finite_float(0, MAX_STEP_MS), default=Assumed(ASSUMED_OVERHEAD_MS),
                   help="draft re-extend, tree build, sampling, bookkeeping per cycle (ms)")


def run(args) -> int:
    be = break_even(args.accept_len, args.decode_ms, args.verify_ms, args.draft_ms, args.overhead_ms)
    times = {k: getattr(args, k) for k in ("decode_ms", "draft_ms", "verify_ms", "overhead_ms")}
    assumed = [k for k, v in times.items() if isinstance(v, Assumed)]
    if assumed:
        print(f"ASSUMED (not given; the figures of {DEPLOYMENT}): "
              + ", ".join(f"{k} {float(times[k]):g}" for k in assumed))
    print(tabulate([{"accept_len": args.accept_len, **{k: float(v) for k, v in times.items()}, "cycle_ms": be.cycle_ms,
                     "speedup": be.speedup, "break-even accept len": be.tau_star}], headers="keys", floatfmt=".4g"))
    print("speculation pays off" if be.speedup > 1 else "speculation does NOT pay off at this accept length")
    return 0
