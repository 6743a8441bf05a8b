# Over 400 lines: ours and the engines' rows share one case builder, check and table, per batch.
"""MLA verify attention with the tree mask at one rank's shape: the engine-style serial "extend" kernel (what SGLang's
Triton backend runs for verify) beside our "split_kv", per context and draft-token count, and per forward.

One request (batch 1) of D tree tokens, the root included, over `context` prefix rows plus its D own rows (Kimi-K2.5
TP8: 8 heads, DK = 576 = 512 latent + 64 rope, bf16); with --batch, B requests in one call, each over its own
`context` rows (request b's right after request b-1's context + 64 rows) with its own tree, and the check holds each
request's rows to that request run alone; --context-spread S spreads the B contexts evenly over [c(1-S), c(1+S)].
The mask is a chain (topk 1: a token sees itself and every earlier tree token), the deployment's default; the
default set adds one branching tree (spec_steps 5, topk 4, D 8).
"extend" runs with the engine's tiles for this GPU's capability (ENGINE_EXTEND_CONFIGS) and without programmatic
dependent launch, as the engine launches it; "split_kv" with its default config, as our forward launches it. Where
SGLang is installed, its own extend kernel ("sglang.extend", harness/engines/sglang.py) runs beside ours with the same
inputs, check and timing. On a GPU other than sm_120, "...@sm120" rows run ours and the engine's with the tiles SGLang
picks for sm_120 (the users' RTX PRO 6000), compiled for this GPU. Where FlashInfer is installed, "flashinfer.mla" is
the kernel of SGLang's --attention-backend flashinfer for target verify (chains only: it ignores the tree mask), its
run() timed like ours and its plan(), which SGLang calls once per verify forward, timed on the host (plan_host_us).
Graph mode, every call reading another cache (>= 4 caches totalling >= 4x L2), as a forward reads each layer's cache
once; per_forward_us is the median times the preset's layers: what the engine's kernel choice costs per forward.
CPU (preset tiny, under TRITON_INTERPRET=1): the given context (64 by default, at most 4096), fp16 (bf16 arithmetic
is wrong in the interpreter) and a split config sized to the tiny shapes, since the interpreter runs every launched
program.

Each case of our kernels carries its memory and latency floors and the bound between them
(harness/measure/timing/floors.py): the last table, "near the limit", sets the case beside them.

Run: pytest --benchmark-only microbench/bench_mla_verify.py
"""
from __future__ import annotations

from pathlib import Path

import torch
import triton

from verifybench.harness import engines
from verifybench.harness.engines import backends
from verifybench.harness.analysis.numbers import (CONTEXT_SPREAD_HELP, check_context_spread, check_spread_batches,
                                                  context_spread_arg, spread_contexts)
from verifybench.harness.measure.timing import ceiling, floors, memory
from verifybench.harness.measure.results.charts import write_png
from verifybench.harness.measure.results.store import CPU_TIMING, batch_of, cpu_numbers, withhold_on_cpu
from verifybench.harness.measure.timing.runner import CPU_COPIES, CaseSkipped, CaseSpec, rel_error
from verifybench.harness.measure.timing.timer import cold_rotation_sets, cuda_available
from verifybench.harness.model import presets
from verifybench.kernels.common import interpret
from verifybench.kernels.common import devices
from verifybench.kernels.mla_verify import api as mv
from verifybench.kernels.common import pdl
from verifybench.kernels.tree import api as tree
from verifybench.kernels.tree.inputs import random_tree

NAME = "mla_verify"
HELP = "MLA verify attention with the tree mask: engine-style serial extend vs split-KV, per context and per forward"
TAKES_BATCH = True  # --batch: B requests per call, each over its own context (B > 1 cases name their batch)
SM120 = backends.SM120  # the users' GPU: "@sm120" variants run the tiles SGLang picks there
# ours, then the engines' own kernels, as harness/engines/backends.py declares them (this GPU's tiles; sm_120's)
VARIANTS = tuple(b.row for b in backends.of(NAME, tiles_cc=None))
SM120_VARIANTS = tuple(b.row for b in backends.of(NAME, tiles_cc=SM120))
GPU_CONTEXTS = (1024, 4096, 16384, 32768)
GPU_NS = (3, 4, 6)  # D (root included): the deployment's 3 and 6, SGLang's chain default for Kimi (the cycle's 3,1,4)
CPU_MAX_CONTEXT = 4096  # the interpreter walks the keys serially: a longer context takes minutes per case
CPU_NS = (3,)
TREE = (5, 4, 8)  # (spec_steps, topk, D): a branching tree beside the chains
TREE_VOCAB = 1000  # build_tree's token ids only; the mask does not depend on them
SPARE_ROWS = mv.MAX_TREE  # each request's region holds context + this many rows, so every D of one context shares it
MAX_COPIES = 256  # a 1k-context cache is 1.25 MB: about 200 of them make 4x an H200's L2
TOL = 1e-2  # bf16 output against the fp32 reference
# a split_kv config for the tiny shapes: 2 splits of 16-key tiles, so the tree keys share the last split and the
# combine runs; the default's 256 splits would cost the interpreter seconds per call
CPU_SPLIT_CONFIG = {"num_splits": 2, "min_split_keys": 16, "block_keys": 16}
# triton.jit picks the interpreter at decoration time: CPU runs of the kernels need TRITON_INTERPRET=1 before import
INTERPRET = interpret.active()


def add_arguments(p) -> None:
    p.add_argument("--context-spread", metavar="S", type=context_spread_arg, default=None, help=CONTEXT_SPREAD_HELP)


def runs_here(spec: CaseSpec) -> bool:
    """Whether a case's kernels can run in this process (a GPU, or the interpreter on CPU)."""
    return spec.params["device"] == "cuda" or INTERPRET


# ---------------------------------------------------------------------------------------------------- inputs

_HELD: dict = {}  # the caches of one (rows, dk, device, dtype) and their memory plan; cases of one context share them


def planned_caches(rows: int, dk: int, device: str, dtype: torch.dtype, batch: int = 1) -> tuple[tuple, memory.Plan]:
    """The rotation's caches (random, one per layer a forward would read; `rows` holds all `batch` requests'
    regions), as many as fit the free memory (at least one, else CaseSkipped); the previous shape's caches are
    dropped first."""
    key = (rows, dk, device, dtype)
    if _HELD.get("key") != key:
        _HELD.clear()
        per_set = rows * dk * dtype.itemsize
        wanted = cold_rotation_sets(per_set, device, MAX_COPIES if device == "cuda" else CPU_COPIES)
        what = f"the {rows}-row KV-cache copies" + (f" of {batch} requests" if batch > 1 else "")
        plan = memory.plan(lambda c: c * per_set, wanted, 1, what, "copies", device)
        if plan.units == 0:
            raise CaseSkipped(plan.skip)
        gen = torch.Generator(device=device)
        gen.manual_seed(1234)
        caches = tuple(torch.randn(rows, dk, device=device, generator=gen).to(dtype) for _ in range(plan.units))
        _HELD.update(key=key, plan=plan, caches=caches)
    return _HELD["caches"], _HELD["plan"]


def tree_mask(n: int, tree_shape: tuple[int, int, int] | None, context: int, device: str,
              batch: int = 1) -> torch.Tensor:
    """The mask of `batch` requests: a chain of n tokens each (bool [B, n, n], lower triangles), or build_tree's
    qlen_only mask (flat bool [B * n * n]) of a random draft of (spec_steps, topk, D = n) per request (their trees
    differ)."""
    if tree_shape is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(batch, n, n).contiguous()
    steps, topk, d = tree_shape
    inp = random_tree(batch, topk, steps, d, TREE_VOCAB, seed=7, context=context, spread=0)
    return tree.build_tree(**inp, mask_mode="qlen_only", backend="reference")[0].contiguous().to(device)


def _capability() -> int:
    return devices.device_limits(torch.device("cuda", torch.cuda.current_device()))[0]  # as 90


def variant_config(variant: str, device: str) -> tuple[dict, str]:
    """(config, where it comes from) of our kernels: the engine's extend tiles for this GPU's capability (or, for
    "extend@sm120", sm_120's); split_kv's default."""
    if variant == "split_kv":
        if device == "cpu":
            return mv.check_config(variant, CPU_SPLIT_CONFIG), "CPU config sized to the tiny shapes"
        return mv.check_config(variant), "DEFAULT_CONFIGS['split_kv']"
    if device == "cpu":
        return mv.check_config("extend"), "DEFAULT_CONFIGS['extend'] (no GPU)"
    cc = SM120 if variant.endswith("@sm120") else _capability()
    if cc in mv.ENGINE_EXTEND_CONFIGS:
        return (mv.check_config("extend", mv.ENGINE_EXTEND_CONFIGS[cc]),
                f"ENGINE_EXTEND_CONFIGS[{cc}] ({mv.ENGINE_EXTEND_SOURCE}'s tiles)")
    return mv.check_config("extend"), f"DEFAULT_CONFIGS['extend'] (no engine entry for sm_{cc})"


def variants(device: str) -> tuple[str, ...]:
    """Ours and the engine's; on a GPU other than sm_120 also both extends with sm_120's tiles."""
    if device == "cuda" and _capability() != SM120:
        return (*VARIANTS, *SM120_VARIANTS)
    return VARIANTS


def _calls(variant, cfg, launch_pdl, starts, lens, mask, kv_lora, scale, q_shape=None, dtype=None):
    """call(q, cache) -> the variant's output [heads, T, kv_lora]: ours, or the engine's kernel through its declared
    call (harness/engines/calls.py: its inputs built once per (q, cache), outside the timed region)."""
    backend = backends.for_row(NAME, variant)
    if backend.engine:
        heads, rope = q_shape or (None, None)
        return backend.function("call")(starts, lens, mask, kv_lora, scale, heads=heads, rope=rope, dtype=dtype,
                                        cc=backend.tiles_cc)
    return lambda q, cache: mv.mla_verify(q, cache, starts, lens, mask, kv_lora, scale, ours(variant), cfg,
                                          pdl=launch_pdl)


def ours(variant: str) -> str:
    """Our kernel a row of ours runs ("extend@sm120" is our extend with sm_120's tiles)."""
    return "split_kv" if variant == "split_kv" else "extend"


def split_counts(cfg: dict, heads: int, n: int, context: int, device: str, batch: int = 1) -> tuple[int, int]:
    """(splits launched per request, splits each request of `context` uses) of a split_kv call of `batch` requests,
    as the kernel cuts them."""
    sms = devices.sm_count(device)
    launched = cfg["num_splits"] or mv.default_num_splits(batch, heads * n, cfg["block_rows"], sms)
    keys = context + n
    splits = max(1, min(launched, triton.cdiv(keys, cfg["min_split_keys"])))
    split_keys = triton.cdiv(triton.cdiv(keys, splits), cfg["block_keys"]) * cfg["block_keys"]  # whole key tiles
    return launched, triton.cdiv(keys, split_keys)


def layout(contexts, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, prefix_lens) int32 [B] of requests of `contexts` tokens: request b's prefix right after request b-1's
    region (its context + SPARE_ROWS rows; with one context each, b x (context + SPARE_ROWS)), its D rows after it."""
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    regions = lens + SPARE_ROWS
    return torch.cumsum(regions, 0, dtype=torch.int32) - regions, lens


def request_mask(mask: torch.Tensor, batch: int, d: int, b: int) -> torch.Tensor:
    """Request b's mask of a B-request mask (bool [B, D, D] or flat), as a one-request mask [1, D, D]."""
    return mask.reshape(batch, d, d)[b:b + 1].contiguous()


def check_requests(call, alone, q, cache, starts, lens, mask, kv_lora: int, scale: float) -> tuple[bool, str]:
    """One call over B requests (q [heads, B * D, DK]) against the fp32 reference and, for B > 1, each request's rows
    against that request run alone (alone(b) -> its call(q_b, cache)): batching must not change an answer."""
    batch = starts.numel()
    d = q.shape[1] // batch
    ref = mv.mla_verify_reference(q.float(), cache.float(), starts, lens, mask, kv_lora, scale)
    out = call(q, cache)
    err = rel_error(out.float(), ref)
    ok = tuple(out.shape) == tuple(ref.shape) and out.dtype == q.dtype and err <= TOL
    detail = f"rel_err={err:.2e} vs fp32 reference (tol {TOL:g}), {out.dtype} out"
    if batch > 1:
        rows = [slice(b * d, (b + 1) * d) for b in range(batch)]
        worst = max(rel_error(out[:, r].float(), alone(b)(q[:, r].contiguous(), cache).float())
                    for b, r in enumerate(rows))
        ok = ok and worst <= TOL
        detail += f"; each of {batch} requests run alone: rel_err <= {worst:.2e}"
    return ok, detail


# ---------------------------------------------------------------------------------------------------- cases

def make_case(preset: str, tp: int, context: int, n: int, tree_shape, variant: str, device: str,
              measure_kw: dict, batch: int = 1, context_spread: float = 0.0) -> CaseSpec:
    p = presets.get(preset, tp)
    heads, kv_lora, rope = p.heads, p.kv_lora, p.qk_rope
    dk, scale = kv_lora + rope, (p.qk_nope + p.qk_rope) ** -0.5
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    label = "chain" if tree_shape is None else ",".join(map(str, tree_shape))
    spread = check_context_spread(context_spread) if batch > 1 else 0.0  # one request has nothing to spread
    contexts = spread_contexts(context, batch, spread)
    params = {"preset": preset, "tp": tp, "layers": p.layers, "heads": heads, "DK": dk, "kv_lora": kv_lora,
              "context": context, "context_spread": spread, "contexts": list(contexts), "tokens": n, "tree": label,
              "batch": batch, "variant": variant, "device": device, "dtype": str(dtype).split(".")[1]}
    mask_id = "chain" if tree_shape is None else "tree" + "-".join(map(str, tree_shape))  # no commas in test ids
    # B = 1 keeps the names the baselines compare by; S = 0 keeps the B > 1 names
    requests = (f"B{batch}/" if batch > 1 else "") + (f"spread{spread:g}/" if spread > 0 else "")
    name = f"mla_verify/{preset}-tp{tp}/ctx{context}/{requests}{mask_id}/{variant}/n{n}"

    backend = backends.for_row(NAME, variant)
    engine = backend.engine  # None: ours

    def setup(batch: int, tokens: int):  # the case's params (CaseSpec.prepare): what its record names runs
        if device != "cuda" and not INTERPRET:
            raise CaseSkipped("the Triton kernels need a GPU, or TRITON_INTERPRET=1 set before import on CPU")
        if engine:
            if tree_shape is not None and backend.chains_only:
                raise engines.skipped(backend.chains_only)
            runs, why = backend.enabled(device)
            if not runs:
                raise engines.skipped(why)
            cfg, source = backend.function("setup")(backend.tiles_cc)
        else:
            cfg, source = variant_config(variant, device)
        caches, plan = planned_caches(sum(contexts) + batch * SPARE_ROWS, dk, device, dtype, batch)
        launch_pdl = False if variant != "split_kv" else None  # the engine launches extend without PDL
        starts, lens = layout(contexts, device)
        mask = tree_mask(tokens, tree_shape, context, device, batch)

        def calls(starts, lens, mask):
            return _calls(variant, cfg, launch_pdl, starts, lens, mask, kv_lora, scale, (heads, rope), dtype)

        qs = [torch.randn(heads, batch * tokens, dk, device=device).to(dtype) for _ in caches]  # one q per layer
        call = calls(starts, lens, mask)
        fns = [lambda q=q, c=c: call(q, c) for q, c in zip(qs, caches)]
        if engine:  # its inputs built, and its kernels compiled, before the timed region
            engines.engine_call(engine)(lambda: [fn() for fn in fns])()

        def check() -> tuple[bool, str]:
            q = torch.randn(heads, batch * tokens, dk, device=device).to(dtype)
            alone = lambda b: calls(starts[b:b + 1], lens[b:b + 1],  # noqa: E731
                                    request_mask(mask, batch, tokens, b))
            return check_requests(call, alone, q, caches[0], starts, lens, mask, kv_lora, scale)

        def derive(m) -> dict:  # every request's rows, queries and outputs: B times one request's bytes
            moved = mv.bytes_moved(heads, batch * tokens, sum(contexts), tokens, kv_lora, rope, dtype.itemsize)
            copy_gbps = ceiling.copy_gbps(device)
            d = {"bytes_moved": moved, "cache_bytes": (sum(contexts) + batch * tokens) * dk * dtype.itemsize,
                 "gbps": ceiling.gbps(moved, m.median_us), "eta": ceiling.eta(moved, m.median_us, copy_gbps),
                 "floor_us": moved / (copy_gbps * 1e3), "copy_gbps": copy_gbps,
                 "per_forward_us": m.median_us * p.layers, "config": cfg, "config_source": source,
                 "pdl": pdl.resolve(launch_pdl, torch.device(device)), "rotation": len(fns),
                 "kernel": engines.label(engine) if engine else "ours",
                 **({"memory_note": plan.note} if plan.reduced else {})}
            if variant == "split_kv":
                # the longest request's splits: the call waits for it
                d["splits_launched"], d["splits_used"] = split_counts(cfg, heads, tokens, max(contexts), device,
                                                                      batch)
            if not engine:  # our kernels' latency floor: empty kernels of the grids this call launches
                d.update(floors.figures(m, d["floor_us"], mv.launch_grids(
                    qs[0], caches[0], starts, lens, mask, kv_lora, scale, ours(variant), cfg, pdl=launch_pdl)))
            if hasattr(call, "plan"):  # FlashInfer: SGLang plans once per verify forward, on the host
                from verifybench.harness.engines import flashinfer

                d["plan_host_us"] = flashinfer.plan_host_us(call.plan)
                d["per_forward_us"] += d["plan_host_us"]  # the lever's cost is the kernels plus the plan
            return d

        return fns, check, derive

    # whatever fails in an engine's setup or check (an engine of another release) skips its row in one line
    return CaseSpec(name=name, params=params, mode="graph", setup=engines.engine_rows(engine, setup),
                    measure_kw={"device": device, **measure_kw})


def cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None = None,
          batch: tuple[int, ...] | None = None, context_spread: float | None = None) -> list[CaseSpec]:
    """Per context, batch (B requests, default 1), draft-token count D (chain masks) and variant, plus the TREE at its
    D with the default set or when --tokens names that D. GPU: GPU_CONTEXTS and `context`, D in GPU_NS. CPU (preset
    tiny): `context` alone, D in CPU_NS; its cases skip unless TRITON_INTERPRET=1 was set before import. The command
    refuses B x D past FORWARD_ROWS_MAX, as in a verify forward. `context_spread` S spreads each B > 1 case's contexts
    around its context (numbers.spread_contexts); S > 0 with no batch above 1 would change nothing and is refused."""
    bad = [t for t in tokens or () if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= mv.MAX_TREE]
    if bad:
        raise ValueError(f"--tokens: MLA verify takes D = 1..{mv.MAX_TREE} tree tokens per request, got {bad}")
    gpu = cuda_available()
    if not gpu and preset != "tiny":
        raise ValueError(f"preset {preset!r} needs a GPU (the interpreter would take hours); use 'tiny' on CPU")
    presets.get(preset, tp)  # an unknown preset or a TP that does not divide it is refused now, not at setup
    ns = tokens or (GPU_NS if gpu else CPU_NS)
    shapes = [(n, None) for n in ns]
    if (tokens is None and gpu) or TREE[2] in (tokens or ()):
        shapes.append((TREE[2], TREE))
    batches = tuple(batch or (1,))
    spread = check_spread_batches(context_spread, batches)
    if gpu:
        contexts, device, kw = sorted({context, *GPU_CONTEXTS}), "cuda", {"max_time_s": 0.5}
    else:  # a sample is one pass over the rotation; no compile to warm up in the interpreter
        longest = max(spread_contexts(context, b, spread)[-1] for b in batches)
        if longest > CPU_MAX_CONTEXT:
            spread_note = f" (the longest request's, --context-spread {spread:g})" if longest > context else ""
            raise ValueError(f"--context {longest}{spread_note}: without a GPU mla_verify runs contexts up to "
                             f"{CPU_MAX_CONTEXT} (the Triton interpreter walks the keys one by one)")
        contexts, device, kw = (context,), "cpu", {"calls_per_sample": CPU_COPIES}
    for c in contexts:
        for b in batches:
            spread_contexts(c, b, spread)  # a longest request past MAX_CONTEXT is refused now, not at setup
    return [make_case(preset, tp, c, n, shape, v, device, kw, b, spread) for c in contexts for b in batches
            for n, shape in shapes for v in variants(device)]


# ---------------------------------------------------------------------------------------------------- tables

# ours / the engine's, per tile set: the stand-in is faithful where these stay within 0.9-1.1
FIDELITY = backends.stand_in_pairs()[NAME][1]


def spread_of(r: dict) -> float:
    """A case's --context-spread (0: every request at its context; a result written before the spread had none)."""
    return r["params"].get("context_spread", 0.0)


def side_by_side(records: list[dict]) -> list[dict]:
    """Per (context, B, D, tree): each variant's median and eta, per layer and per forward; extend over split_kv, and
    our extend over the engine's with the same tiles, each at one B (a B column where the records hold several)."""
    rows: dict[tuple, dict] = {}
    several = len({batch_of(r) for r in records if r["name"].startswith("mla_verify/")}) > 1
    spread = any(spread_of(r) for r in records if r["name"].startswith("mla_verify/"))
    for r in records:
        if not (r["name"].startswith("mla_verify/") and r["check"]["ok"] and "summary" in r):
            continue
        prm, d = r["params"], r["derived"]
        row = rows.setdefault((prm["preset"], prm["tp"], prm["context"], batch_of(r), spread_of(r), prm["tokens"],
                               prm["tree"]), {
            "context": prm["context"], **({"B": batch_of(r)} if several else {}),
            **({"spread": spread_of(r)} if spread else {}), "n": prm["tokens"],
            "tree": prm["tree"], "MB": d["bytes_moved"] / 1e6,  # every request's bytes
            "floor_us": d["floor_us"]})  # the roofline: the bytes at this GPU's copy bandwidth
        v = prm["variant"]
        row.update({f"{v}_us": r["summary"]["median_us"], f"{v}_eta": d["eta"],
                    f"{v}_per_forward_ms": d["per_forward_us"] / 1e3})
        if "plan_host_us" in d:
            row[f"{v}_plan_host_us"] = d["plan_host_us"]
    out = sorted(rows.values(), key=lambda row: (row["tree"] != "chain", row.get("B", 1), row.get("spread", 0),
                                                 row["n"], row["context"]))
    for row in out:
        if row.get("extend_us") and row.get("split_kv_us"):
            row["extend/split_kv"] = row["extend_us"] / row["split_kv_us"]
            row["extend_minus_split_kv_per_forward_ms"] = (row["extend_per_forward_ms"]
                                                           - row["split_kv_per_forward_ms"])
        for ours, theirs in FIDELITY:
            if row.get(f"{ours}_us") and row.get(f"{theirs}_us"):
                row[f"{ours}/{theirs}"] = row[f"{ours}_us"] / row[f"{theirs}_us"]
    return out


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    rows = side_by_side(records)
    # CPU timer noise and an interpreter cannot support a GPU kernel's ratio or eta
    rows = withhold_on_cpu(records, rows, lambda k: k.endswith("eta") or "/" in k or k == "floor_us"
                           or k.endswith("_minus_split_kv_per_forward_ms"))
    layers = sorted({r["params"]["layers"] for r in records if r["name"].startswith("mla_verify/")})
    per_forward = f"x {', '.join(map(str, layers))} layers" if layers else "x layers"
    timing = "the kernels in the Triton interpreter, " + CPU_TIMING if cpu_numbers(records) else "graph mode"
    kernels = sorted({r["derived"]["kernel"] for r in records if r["name"].startswith("mla_verify/")
                      and r.get("derived", {}).get("kernel", "ours") != "ours"})
    engine = f"; {', '.join(kernels)}: the engines' own kernels" if kernels else ""
    if any(k.endswith("_plan_host_us") for row in rows for k in row):
        engine += "; flashinfer per forward = run x layers + one plan() on the host"
    if any(batch_of(r) > 1 for r in records if r["name"].startswith("mla_verify/")):
        engine += "; B requests per call, each over its own context"
    if any(spread_of(r) for r in records if r["name"].startswith("mla_verify/")):
        engine += " (spread: contexts evenly over [c(1-S), c(1+S)], MB their real total)"
    out = [(f"MLA verify attention, tree mask: engine-style extend vs split_kv ({timing}, caches rotated; "
            f"per forward = per layer {per_forward}{engine})", rows)]
    mine = [r for r in records if r["name"].startswith("mla_verify/")]
    several, spread = len({batch_of(r) for r in mine}) > 1, any(spread_of(r) for r in mine)
    near = floors.table(mine, lambda r: {
        "context": r["params"]["context"], **({"B": batch_of(r)} if several else {}),
        **({"spread": spread_of(r)} if spread else {}), "n": r["params"]["tokens"], "tree": r["params"]["tree"],
        "variant": r["params"]["variant"]})
    return out + ([(floors.title("MLA verify, our kernels"), near)] if near else [])


STYLES = {"extend": "-o", "split_kv": "--s", "sglang.extend": "-.x", "extend@sm120": "-D",
          "sglang.extend@sm120": "-.+", "flashinfer.mla": ":v"}  # a line style and marker per variant


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    """One PNG: median time vs context, per variant, mask (D) and batch."""
    ok = [r for r in records if r["name"].startswith("mla_verify/") and r["check"]["ok"] and "summary" in r]
    if not ok:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple, list] = {}
    for r in ok:
        prm = r["params"]
        lines.setdefault((prm["variant"], prm["tree"], prm["tokens"], batch_of(r), spread_of(r)), []).append(
            (prm["context"], r["summary"]["median_us"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, ((variant, label, n, b, spread), points) in enumerate(sorted(lines.items())):
        xs, ys = zip(*sorted(points))
        # a color per series and a marker per variant: a series of one point (one context, as on CPU) has no line
        ax.plot(xs, ys, STYLES.get(variant, ":^"), color=f"C{i % 10}",
                label=f"{variant}, {'chain' if label == 'chain' else 'tree ' + label} D={n}"
                + (f" B={b}" if b > 1 else "") + (f" spread {spread:g}" if spread else ""))
    contexts = {x for pts in lines.values() for x, _ in pts}
    times = [y for pts in lines.values() for _, y in pts]
    log_y = len(contexts) > 1 and max(times) >= 10 * min(times)  # split_kv 10-100x below extend: a log axis
    if len(contexts) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prefix tokens in the KV cache)")
    ax.set_ylabel("us per layer (median" + (", log scale)" if log_y else ")"))
    if log_y:
        ax.set_yscale("log")
    ax.set_title("MLA verify attention: engine-style extend vs split_kv, and the engines' own kernels"
                 + (" (CPU numbers: the plumbing, not a GPU's figures)" if cpu_numbers(records) else ""))
    ax.legend(fontsize=8, ncol=2)
    return [write_png(fig, Path(directory) / f"mla_verify-{stamp}.png")]


def release() -> None:
    """Drop the cached KV-cache copies."""
    _HELD.clear()
