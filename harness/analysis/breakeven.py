"""Speculative decoding pays off when the tokens accepted per cycle outweigh the cycle's cost:
speedup = tau * T_decode / (T_draft + T_verify + T_overhead), break-even tau* = (T_draft + T_verify + T_overhead) /
T_decode, with tau the mean tokens accepted per verify, bonus token included.

Defaults: the Kimi-K2.5 deployment on 8x RTX PRO 6000 Blackwell (PCIe, SGLang EAGLE-3, 3 draft tokens): decode 11.1
ms, verify 25.6 ms, draft 1.0 ms, re-extend and bookkeeping 0.3 ms.
"""
from __future__ import annotations

import argparse

from tabulate import tabulate

from verifybench.harness.analysis.decompose import break_even
from verifybench.harness.analysis.numbers import MAX_DRAFT_TOKENS, accept_len, finite_float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept-len", type=accept_len, required=True,
                   help=f"tau: mean tokens accepted per verify, bonus included, in 1..{MAX_DRAFT_TOKENS} (1: the "
                   "bonus token alone, every draft token rejected)")
    p.add_argument("--decode-ms", type=finite_float(0, exclusive=True), default=11.1, help="one plain decode step (ms)")
    p.add_argument("--verify-ms", type=finite_float(0), default=25.6, help="one verify step (ms)")
    p.add_argument("--draft-ms", type=finite_float(0), default=1.0, help="drafting the tokens (ms)")
    p.add_argument("--overhead-ms", type=finite_float(0), default=0.3,
                   help="draft re-extend, tree build, sampling, bookkeeping per cycle (ms)")


def run(args) -> int:
    be = break_even(args.accept_len, args.decode_ms, args.verify_ms, args.draft_ms, args.overhead_ms)
    print(tabulate([{"accept_len": args.accept_len, "decode_ms": args.decode_ms, "draft_ms": args.draft_ms,
                     "verify_ms": args.verify_ms, "overhead_ms": args.overhead_ms, "cycle_ms": be.cycle_ms,
                     "speedup": be.speedup, "break-even accept len": be.tau_star}], headers="keys", floatfmt=".4g"))
    print("speculation pays off" if be.speedup > 1 else "speculation does NOT pay off at this accept length")
    return 0
