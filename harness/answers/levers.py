"""The levers' arithmetic: one lever's figures, and the verify attention per forward from mla_verify, ours or an
engine's own kernel (the attention levers on the engine's kernels, where mla_verify timed them)."""
from __future__ import annotations

import numpy as np

from verifybench.harness.answers.engine_settings import setting
from verifybench.harness.analysis.batches import passing_cases as ok_cases
from verifybench.harness.measure.results.store import batch_of


def attention_per_forward_ms(runs: dict, variant: str, d: int, context: int, batch: int = 1) -> tuple[float, str]:
    """mla_verify's per-forward attention (ms) of a chain of D tokens at `context` for `batch` requests (the cycle's:
    one for the one-request levers; a file of several batches is never mixed): measured there, else linear between
    the two measured contexts around it (said); outside them refused. Cases of spread contexts (--context-spread) are
    left out: the cycle's requests share one context."""
    cases = [c for c in ok_cases(runs["mla_verify"]) if batch_of(c) == batch  # none before --batch
             and not c["params"].get("context_spread", 0)]
    pts = sorted((c["params"]["context"], c["derived"]["per_forward_us"] / 1e3) for c in cases
                 if c["params"]["variant"] == variant and c["params"]["tokens"] == d and c["params"]["tree"] == "chain")
    xs = [p[0] for p in pts]
    if not pts or not xs[0] <= context <= xs[-1]:
        at = f" for {batch} requests" if batch > 1 else ""
        raise ValueError(f"mla_verify holds {variant} at D={d}{at} for contexts {xs}; --context {context} is outside")
    how = "measured" if context in xs else f"interpolated between contexts {max(x for x in xs if x < context)} and " \
                                           f"{min(x for x in xs if x > context)}"
    return float(np.interp(context, xs, [p[1] for p in pts])), how


def lever(name, before, after, status, files, how, tau=None, decode=None, note=""):
    return {"lever": name, "before_ms": before, "after_ms": after,
            "saved_ms": None if before is None or after is None else before - after,
            "tau_star": None if after is None else after / decode,
            "tok_s": None if after is None or tau is None else 1000 * tau / after,
            "status": status, "files": files, "how": how, "note": note}


def _engine_per_forward_ms(runs: dict, variant: str, d: int, context: int, batch: int = 1) -> float | None:
    """mla_verify's per-forward time of `variant` at (D, context, batch), or None where it did not run there."""
    if "mla_verify" not in runs:
        return None
    try:
        return attention_per_forward_ms(runs, variant, d, context, batch)[0]
    except ValueError:
        return None


def engine_attention_levers(runs, found, config, context, before, after, status, files, engine, tau, decode,
                            batch: int = 1):
    """The attention levers on the engine's own kernels, where mla_verify timed them beside ours at this D, context
    and batch (the cycle's): the cycle with SGLang's extend in place of our stand-in, against our split-KV (what the
    engine could reach) and against FlashInfer's MLA (SGLang's --attention-backend flashinfer, its plan() included;
    chains only). [] where mla_verify holds no SGLang extend there (the caller names what would measure
    FlashInfer's)."""
    d = config[2]
    ours, theirs = (_engine_per_forward_ms(runs, v, d, context, batch) for v in ("extend", "sglang.extend"))
    if ours is None or theirs is None:
        return []
    engine_before = before - ours + theirs
    files = [*files, str(found["mla_verify"])] if str(found["mla_verify"]) not in files else files
    sm120 = [_engine_per_forward_ms(runs, v, d, context, batch) for v in ("extend@sm120", "sglang.extend@sm120")]
    tiles = (f"; with the tiles SGLang picks on sm_120 (run here) the engine's extend takes {sm120[1]:.4g} ms per "
             f"forward, ours {sm120[0]:.4g}" if None not in sm120 else "")
    common = (f"context {context}: the cycle with SGLang's own extend ({theirs:.4g} ms per forward) in place of our "
              f"stand-in ({ours:.4g} ms){tiles}")
    out = [lever("verify attention: SGLang's Triton extend -> split-KV (ours: what the engine could reach)",
                  engine_before, after, status, files, setting("attention", engine), tau, decode,
                  common + "; no engine ships this kernel for MLA on NVIDIA")]
    split = _engine_per_forward_ms(runs, "split_kv", d, context, batch)
    flash = _engine_per_forward_ms(runs, "flashinfer.mla", d, context, batch)
    if flash is not None and split is not None and config[1] == 1:
        out.append(lever("verify attention: SGLang's Triton extend -> FlashInfer MLA (topk 1 only)", engine_before,
                          after - split + flash, status, files, setting("attention", engine), tau, decode,
                          common + f"; FlashInfer {flash:.4g} ms per forward, its plan() on the host included, in "
                          f"place of split_kv's {split:.4g}"))
    return out
