"""The engine as deployed: the installed engine, its version and its server flags (in the engine's own syntax), and
what each part of the forward runs for that deployment. One value, read by verify, cycle, run, plan and advise.

CONTRACT (stub, 2026-12-07): the fields below are what the composition reads; `resolve` is filled by the dispatch
work (the engine's own parser and dispatch functions). Until then it returns the suite's kernels.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Deployment:
    """What each part of the forward runs. Kernel names are backend names of harness/engines/backends (an engine's
    "sglang.decode", "flashinfer.mla", "sglang.marlin", ...) or ours ("ours.split_kv", "ours.extend",
    "ours.decode", "ours.moe")."""
    engine: str | None                  # "sglang", or None: the suite's own kernels
    version: str | None                 # the installed engine's version
    engine_args: tuple[str, ...] = ()   # the server flags as given (the engine's syntax)
    attention_backend: str = "ours"     # the engine's name for it: "triton", "flashinfer", ...
    decode_attention: str = "ours.decode"   # plain decode and the draft steps (same backend)
    verify_attention: str = "ours.split_kv"  # target verify (tree-masked)
    extend_tiles_cc: int | None = None  # the capability whose tiles the engine's extend uses (None: this GPU's)
    kv_splits: int | None = None        # the decode kernel's KV-split cap (--triton-attention-num-kv-splits)
    moe: str = "ours.moe"               # the routed experts
    rows: tuple[tuple[str, str, str], ...] = ()  # (part, kernel, how it was decided / why a stand-in) per part

    def line(self) -> str:
        """One line naming it, as the report, verify, cycle and advise open with it."""
        if self.engine is None:
            return "the suite's kernels (no engine given): split-KV verify and decode, our INT4 MoE"
        return (f"the engine as deployed: {self.engine} {self.version or '(version unknown)'}, attention "
                f"{self.attention_backend}, decode kv splits {self.kv_splits}, MoE {self.moe}")

    def with_args(self, extra: str) -> "Deployment":
        """The same deployment with more flags (a lever's A/B: one flag changed)."""
        return resolve(self.engine, " ".join([*self.engine_args, extra]))


def resolve(engine: str | None, engine_args: str | None = None, cc: int | None = None) -> Deployment:
    """The deployment `engine` with `engine_args` on a GPU of capability `cc` (None: the users' sm_120 card)."""
    if engine is None:
        return Deployment(None, None)
    raise NotImplementedError("dispatch not written yet")
