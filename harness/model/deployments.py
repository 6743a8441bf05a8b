"""The deployments a command runs: the engine as given (--engine, --engine-args), its A/B variants (--ab: the same
flags plus one change each), and ours beside it; how a case names and records each.
"""
from __future__ import annotations

import re
import shlex

from verifybench.harness.engines import deployment as deployment_module
from verifybench.harness.engines.deployment import Deployment

# the levers as flags (--ab levers): the verify/decode backend (FlashInfer's MLA: chains only) and the decode
# kernel's KV-split cap; the draft shape is each case's (steps, topk, D) (--configs), every variant runs them all
LEVERS_AB = ("--attention-backend flashinfer", "--triton-attention-num-kv-splits 16",
             "--triton-attention-num-kv-splits 32", "--triton-attention-num-kv-splits 64")
SUITE = Deployment(None, None)  # ours: the suite's kernels
SPEC_FLAGS = {"--speculative-num-steps": 0, "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": 2}


def add_arguments(p, ab: bool = False) -> None:
    """--engine, --engine-args, --deploy-cc (deployment.add_arguments: the one declaration) and with `ab`, --ab."""
    deployment_module.add_arguments(p)
    if ab:
        p.add_argument("--ab", default=None, metavar="FLAGS;FLAGS;...",
                       help="A/B the engine's flags: the same cases again once per variant, each with those flags "
                       f"added to --engine-args; 'levers' = {'; '.join(LEVERS_AB)}. `advise` on the folder ranks "
                       "the variants by measured ms per cycle")


def parse_ab(text: str | None) -> list[str]:
    """"--a 1;--b 2" -> ["--a 1", "--b 2"]; "levers" -> LEVERS_AB; each variant's flags checked as shell words."""
    if text is None:
        return []
    if text.strip() == "levers":
        return list(LEVERS_AB)
    parts = [t.strip() for t in text.split(";")]
    if not text.strip() or not all(parts):
        raise ValueError(f"--ab: flags separated by ';', none empty (or 'levers'), got {text!r}")
    for t in parts:
        try:
            words = shlex.split(t)
        except ValueError as e:
            raise ValueError(f"--ab: {t!r}: {e}") from None
        if not words[0].startswith("--"):
            raise ValueError(f"--ab: each variant is engine flags starting with '--', got {t!r}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"--ab: a variant given twice in {text!r}")
    return parts


def tag(flags: str) -> str:
    """A variant's name in its cases' names: "--triton-attention-num-kv-splits 64" -> "triton-attention-num-kv-
    splits=64" (no '/': a case name's separator)."""
    words = [w.lstrip("-").replace("/", "_") for w in shlex.split(flags)]
    return re.sub(r"[^A-Za-z0-9_.=,+-]", "_", "=".join(words) if len(words) == 2 else "+".join(words))


def variants(engine: str | None, engine_args: str | None = None, ab: str | None = None,
             beside_ours: bool = False, cc: int | None = None) -> list[tuple[str, Deployment]]:
    """[(tag, deployment)]: the deployment given ("deployed"), one per --ab variant (its flags added), and with
    `beside_ours` the suite's kernels ("ours": what the engine could reach). [] without an engine (the suite's)."""
    if engine is None:
        if ab is not None or engine_args is not None:
            raise ValueError("--engine-args and --ab need --engine (the engine whose flags they are)")
        return []
    base = deployment_module.resolve(engine, engine_args, cc)
    out = [("deployed", base)] + [(tag(flags), base.with_args(flags)) for flags in parse_ab(ab)]
    return out + ([("ours", SUITE)] if beside_ours else [])


def spec_shape(dep: Deployment) -> tuple[int, int, int] | None:
    """(steps, topk, D) where the deployment's flags set all three speculative flags (its draft shape), else None
    (the cases' --configs)."""
    words = list(dep.engine_args)
    words = [w for a in words for w in shlex.split(a)]
    got = {}
    for i, w in enumerate(words):
        key, _, val = w.partition("=")
        if key in SPEC_FLAGS:
            val = val or (words[i + 1] if i + 1 < len(words) else "")
            if not val.isdigit():
                raise ValueError(f"{key} takes a number, got {val!r}")
            got[SPEC_FLAGS[key]] = int(val)
    return tuple(got[i] for i in range(3)) if len(got) == 3 else None


def cycle_attention(dep: Deployment) -> str:
    """Our verify attention variant the cycle is built with: the deployment's own where it is ours, else the one that
    stands in for the engine's kernel where that cannot run (extend for SGLang's, split_kv for FlashInfer's)."""
    v = dep.verify_attention
    return {"ours.split_kv": "split_kv", "ours.extend": "extend", "sglang.extend": "extend",
            "flashinfer.mla": "split_kv"}.get(v, "split_kv")


def params(tag_: str, dep: Deployment) -> dict:
    """What a case's params record of its deployment (the kernels that ran and the stand-ins: its derived figures)."""
    return {"deployment": tag_, "engine": dep.engine, "engine_version": dep.version,
            "engine_args": " ".join(dep.engine_args), "deployment_line": dep.line(),
            "kernels": {"decode attention": dep.decode_attention, "verify attention": dep.verify_attention,
                        "moe": dep.moe, **({"decode kv splits": dep.kv_splits} if dep.kv_splits else {})}}


def chains_only(dep: Deployment) -> bool:
    """FlashInfer's MLA ignores the tree mask: its verify is exact for topk 1 only."""
    return dep.verify_attention == "flashinfer.mla"


def stand_in_text(stand_ins) -> str:
    """[(part, engine kernel, stand-in, reason)] in one cell."""
    return "; ".join(f"{part}: {ours} for {engine} ({why})" for part, engine, ours, why in stand_ins) or "none"


def table(records: list[dict]) -> tuple[str, list[dict]]:
    """The tables' opening: the deployment's line as the title, and per variant its flags, the kernel that ran per
    part (the first passing case's), what stood in, with the reason, and how an engine's kernel runs here where the
    composition says (notes: the Marlin MoE over the forward's own weights)."""
    seen: dict[str, dict] = {}
    for r in records:
        p = r.get("params", {})
        if "deployment" not in p:
            continue
        ran = r.get("derived", {}).get("deployment", {})
        row = seen.setdefault(p["deployment"], {"variant": p["deployment"], "engine args": p.get("engine_args") or "-",
                                                "line": p.get("deployment_line")})
        if ran and "ran" not in row:
            row.update(ran={k: v for k, v in ran.get("kernels", {}).items()}, stand_ins=ran.get("stand_ins", []),
                       notes=ran.get("notes", {}))
    if not seen:
        return SUITE.line(), [{"engine": "none given (--engine)", "kernels": "the suite's own"}]
    first = next(iter(seen.values()))
    title = next((r["params"]["deployment_line"] for r in records if r.get("params", {}).get("deployment") ==
                  "deployed"), None) or first.get("line") or SUITE.line()
    rows = []
    for row in seen.values():
        ran = row.pop("ran", None)
        stood = row.pop("stand_ins", None)
        notes = row.pop("notes", None)
        row.pop("line")
        rows.append({**row, **(ran or {"kernels": "not run (no case passed its setup)"}),
                     "stand-ins": stand_in_text(stood) if stood is not None else "-",
                     "notes": "; ".join(f"{part}: {text}" for part, text in notes.items()) if notes else None})
    return f"{title} (per variant: the kernel that ran per part; ours where the engine's cannot run, and why)", rows
