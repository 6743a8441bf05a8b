"""Draft-tree (EAGLE) component: organize the draft, build the tree (three mask modes; the full mask at 1k and 32k
context), verify greedily, write the KV slots, full-vocabulary argmax; kernel vs reference, device-timed.

Run: verifybench kv_tree   or   pytest --benchmark-only microbench/bench_kv_tree.py  (no CUDA: the reference on CPU,
B in (1, 8)). --tokens n adds a chain tree of n draft tokens (spec_steps n, topk 1, D = n + 1) per n.
"""
from __future__ import annotations

from pathlib import Path

import torch

from verifybench.harness.measure.timing import ceiling
from verifybench.harness.measure.results.store import cpu_numbers, mode_label, withhold_on_cpu
from verifybench.harness.model import presets
from verifybench.harness.measure.timing.runner import CaseSkipped, CaseSpec
from verifybench.harness.measure.timing.timer import Measurement, cuda_available
from verifybench.kernels.common import interpret
from verifybench.kernels.tree import api as tree
from verifybench.kernels.tree.inputs import children, random_draft, random_target_predict, random_tree

NAME = "kv_tree"
HELP = "EAGLE draft tree: organize, build_tree (3 mask layouts), greedy verify, KV slots, argmax; kernel vs reference"
TREES = ((3, 1, 4), (5, 4, 8), (6, 10, 60))  # (spec_steps, topk, D): SGLang's chain default, two wider trees
CONTEXTS = (1024, 32768)  # the full mask's context lengths; qlen-only masks use the first
STEPS = ("organize", "build_tree", "verify", "assign", "argmax")
KERNEL_KW = {"max_time_s": 0.2}
REFERENCE_KW = {"max_time_s": 0.25}  # host-heavy plain torch: a few hundred samples at most


def tree_label(steps: int, topk: int, d: int) -> str:
    return f"d{d}t{topk}s{steps}"


def _variants(step: str, d: int) -> list[str]:
    if step == "build_tree":
        return [f"full-ctx{c}" for c in CONTEXTS] + ["qlen_only"] + (["qlen_only_bitpacking"] if d <= 32 else [])
    return [""]


def trees(tokens: tuple[int, ...] | None) -> list[tuple[int, int, int]]:
    """TREES, plus a chain of n draft tokens for each n in `tokens` that no preset tree already is."""
    chains = [(n, 1, n + 1) for n in tokens or ()]
    return list(TREES) + [c for c in chains if c not in TREES]


def _backends(gpu: bool, batch: int, variant: str) -> tuple[str, ...]:
    """GPU: kernel and reference. CPU: the reference, and the kernels through the Triton interpreter (a check on
    tiny shapes, not a timing) at B=1 and the short context, which the interpreter runs in well under a second."""
    if gpu:
        return ("kernel", "reference")
    small = batch == 1 and not variant.endswith(f"ctx{CONTEXTS[-1]}")
    return ("kernel", "reference") if small else ("reference",)  # without the interpreter: skipped, said so


def cases(preset: str, tp: int, context: int, tokens: tuple[int, ...] | None = None) -> list[CaseSpec]:
    """The trees x B x steps x backends; the model preset only sets the argmax vocab (per TP rank).
    Without CUDA: the reference backend on CPU, B in (1, 8), and the kernels in the interpreter at B=1."""
    vocab = presets.get(preset, tp).vocab
    gpu = cuda_available()
    device = "cuda" if gpu else "cpu"
    out = []
    for steps, topk, d in trees(tokens):
        for step in STEPS:
            batches = (range(1, 9) if step in ("build_tree", "verify") else (1, 2, 4, 8)) if gpu else (1, 8)
            for batch in batches:
                for variant in _variants(step, d):
                    for backend in _backends(gpu, batch, variant):
                        params = {"step": step, "backend": backend, "tree": tree_label(steps, topk, d),
                                  "steps": steps, "topk": topk, "draft_tokens": d, "batch": batch, "variant": variant,
                                  "vocab": vocab, "device": device}
                        graph = gpu and (backend == "kernel" or step == "argmax")  # torch.argmax captures too
                        name = "/".join(x for x in ("tree", step, backend, params["tree"], f"B{batch}",
                                                    variant or (f"V{vocab}" if step == "argmax" else "")) if x)
                        out.append(CaseSpec(name=name, params=params, mode="graph" if graph else "hot",
                                            setup=lambda p=params: _setup(p),
                                            measure_kw={"device": device, **(KERNEL_KW if graph else REFERENCE_KW)}))
    return out


def _setup(p):
    """The step's setup; a kernel case on CPU with the interpreter off (TRITON_INTERPRET=0 exported) is skipped, so
    the run's count of skipped cases says what its note says: the kernels did not run."""
    if p["backend"] == "kernel" and p["device"] == "cpu" and not interpret.active():
        raise CaseSkipped(f"Triton kernels not run: TRITON_INTERPRET={interpret.setting()!r} turns "
                          "the interpreter off")
    return _SETUPS[p["step"]](p)


def _agree(run, invariant, backend: str) -> tuple[bool, str]:
    """kernel: run("kernel") == run("reference") exactly, output by output; reference: its invariants hold."""
    if backend == "reference":
        return invariant()
    got, want = run("kernel"), run("reference")
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g.cpu(), w.cpu())]
    return (not bad, "kernel == reference exactly" if not bad else f"outputs {bad} differ from the reference")


def _setup_organize(p):
    d, dev = p["draft_tokens"], p["device"]
    draft = random_draft(p["batch"], p["topk"], p["steps"], p["vocab"], seed=1, device=dev)
    fresh = random_draft(p["batch"], p["topk"], p["steps"], p["vocab"], seed=2, device=dev)

    def run(backend, inputs=fresh):
        return tree.organize_draft_results(*inputs, d, backend=backend)

    def invariant():
        _, top, tokens = run("reference")
        scores = torch.cat([s.flatten(1) for s in fresh[0]], 1)
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
        ok = bool((top.diff(dim=1) > 0).all()) and torch.equal(tokens, torch.cat([t.flatten(1) for t in fresh[1]],
                                                                                 1).gather(1, top))
        if (~kept).any(dim=1).all():
            ok &= bool((scores.masked_fill(~kept, float("inf")).amin(1)
                        >= scores.masked_fill(kept, float("-inf")).amax(1)).all())
        return ok, "kept the largest scores, ascending" if ok else "selection broke an invariant"

    return (lambda: run(p["backend"], draft)), (lambda: _agree(run, invariant, p["backend"])), None


def _tree_inputs(p, seed):
    ctx = int(p["variant"].split("ctx")[1]) if "ctx" in p["variant"] else CONTEXTS[0]
    inp = random_tree(p["batch"], p["topk"], p["steps"], p["draft_tokens"], p["vocab"], seed=seed, context=ctx,
                      spread=0 if seed == 1 else None, device=p["device"])
    return inp, int(inp["seq_lens"].sum())


def _setup_build_tree(p):
    mode = "full" if p["variant"].startswith("full") else p["variant"]
    timed, timed_sum = _tree_inputs(p, seed=1)
    fresh, fresh_sum = _tree_inputs(p, seed=2)

    def run(backend, inp=fresh, total=fresh_sum):
        return tree.build_tree(**inp, mask_mode=mode, backend=backend, seq_lens_sum=total)

    def invariant():
        mask, pos, index, nxt, sib, _ = run("reference")
        d, batch = p["draft_tokens"], p["batch"]
        qlen = _qlen_rows(mask, mode, fresh["seq_lens"].tolist(), d)
        for b in range(batch):
            for j in range(d):
                for k in children(nxt[b].tolist(), sib[b].tolist(), j):
                    row_ok = torch.equal(qlen[b][k], qlen[b][j] | (torch.arange(d) == k))
                    if not row_ok or pos[b * d + k] != pos[b * d + j] + 1:
                        return False, f"request {b}: node {k} disagrees with its parent {j}"
        ok = torch.equal(index.cpu().flatten(), torch.arange(batch * d))
        return ok, "mask rows, positions and child lists consistent" if ok else "retrieve_index wrong"

    def derive(m: Measurement) -> dict:
        out = run(p["backend"], timed, timed_sum)[0]
        mask_bytes = out.numel() * out.element_size()
        fig = {"mask_bytes": mask_bytes, "mask_gbps": ceiling.gbps(mask_bytes, m.median_us)}
        if mode == "full":
            fig["eta"] = ceiling.eta(mask_bytes, m.median_us, ceiling.copy_gbps(p["device"]))
        return fig

    return (lambda: run(p["backend"], timed, timed_sum)), (lambda: _agree(run, invariant, p["backend"])), derive


def _qlen_rows(mask, mode, seq_lens, d):
    """Per request, the D x D tree part of the mask as bool rows."""
    if mode == "qlen_only_bitpacking":
        words = mask.cpu().long().view(-1, d)
        return [((w[:, None] >> torch.arange(d)) & 1).bool() for w in words]
    blocks, at = [], 0
    for seq in (seq_lens if mode == "full" else [0] * len(seq_lens)):
        blocks.append(mask[at:at + d * (seq + d)].cpu().view(d, seq + d)[:, seq:])
        at += d * (seq + d)
    return blocks


def _verify_inputs(p, seed):
    inp, total = _tree_inputs(p, seed)
    _, _, index, nxt, sib, tokens = tree.build_tree(**inp, mask_mode="qlen_only", backend="reference")
    cand = tokens.view(p["batch"], p["draft_tokens"])
    # timed inputs: the longest walk (every level accepted, through the last sibling); checks: random acceptance
    target = random_target_predict(cand, nxt, sib, p["vocab"], accept_prob=1.0 if seed == 1 else 0.7,
                                   last_child=seed == 1, seed=seed)
    return cand, index, nxt, sib, target, p["steps"] + 1


def _setup_verify(p):
    timed, fresh = _verify_inputs(p, 1), _verify_inputs(p, 2)

    def run(backend, args=fresh):
        return tree.verify_tree_greedy(*args, backend=backend)

    def invariant():
        predicts, accept, num = (t.cpu() for t in run("reference"))
        cand, _, nxt, sib, target, _ = (t.cpu() if torch.is_tensor(t) else t for t in fresh)
        d = p["draft_tokens"]
        for b in range(p["batch"]):
            path = accept[b, :num[b] + 1].tolist()
            for a, z in zip(path, path[1:]):
                if z - b * d not in children(nxt[b].tolist(), sib[b].tolist(), a - b * d) \
                        or cand.view(-1)[z] != target[a] or predicts[a] != target[a]:
                    return False, f"request {b}: accepted {z} does not follow {a}"
            if predicts[path[-1]] != target[path[-1]]:
                return False, f"request {b}: no bonus token"
        return True, "every accepted token is a child matching the target"

    def derive(m: Measurement) -> dict:
        return {"accept_len_mean": run("reference", timed)[2].float().mean().item()}

    return (lambda: run(p["backend"], timed)), (lambda: _agree(run, invariant, p["backend"])), derive


def _assign_inputs(p, seed):
    g = torch.Generator().manual_seed(seed)
    batch, d, ctx = p["batch"], p["draft_tokens"], CONTEXTS[0]
    table = torch.zeros(2 * batch, ctx + d, dtype=torch.int32)
    pools, seq = torch.randperm(2 * batch, generator=g)[:batch], torch.randint(0, ctx, (batch,), generator=g)
    loc = torch.randint(0, 1 << 30, (batch * d,), generator=g)
    return [t.to(p["device"]) for t in (table, pools, seq, loc)]


def _setup_assign(p):
    timed, fresh = _assign_inputs(p, 1), _assign_inputs(p, 2)

    def run(backend, args=fresh):
        return (tree.assign_req_to_token(args[0].clone(), *args[1:], p["draft_tokens"], backend=backend),)

    def invariant():
        table, (_, pools, seq, loc) = run("reference")[0].cpu(), (t.cpu() for t in fresh)
        ok = all(torch.equal(table[pools[b], seq[b]:seq[b] + p["draft_tokens"]], loc.view(p["batch"], -1)[b].int())
                 for b in range(p["batch"])) and int(table.count_nonzero()) <= loc.numel()
        return ok, "slots written where they belong" if ok else "slots misplaced"

    return (lambda: tree.assign_req_to_token(*timed, p["draft_tokens"], backend=p["backend"])), \
        (lambda: _agree(run, invariant, p["backend"])), None


def _setup_argmax(p):
    dtype = torch.bfloat16 if p["device"] == "cuda" else torch.float32
    rows = p["batch"] * p["draft_tokens"]
    timed, fresh = (torch.randn(rows, p["vocab"], generator=torch.Generator().manual_seed(s)).to(p["device"], dtype)
                    for s in (1, 2))

    def invariant():
        idx = tree.argmax(fresh, backend="reference")
        top = fresh.max(dim=1).values
        first = (fresh == top[:, None]).int().argmax(dim=1)  # first position holding the maximum
        ok = torch.equal(idx, first)
        return ok, "first maximum of every row" if ok else "not the first maximum"

    def derive(m: Measurement) -> dict:
        read = timed.numel() * timed.element_size()
        return {"bytes_read": read, "gbps": ceiling.gbps(read, m.median_us)}

    return (lambda: tree.argmax(timed, backend=p["backend"])), \
        (lambda: _agree(lambda be: (tree.argmax(fresh, backend=be),), invariant, p["backend"])), derive


_SETUPS = {"organize": _setup_organize, "build_tree": _setup_build_tree, "verify": _setup_verify,
           "assign": _setup_assign, "argmax": _setup_argmax}


def tables(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """Kernel vs reference per step; the full-mask fill's bytes and bandwidth; the B=8 targets."""
    by_key: dict[tuple, dict] = {}
    for r in records:
        if r["name"].startswith("tree/") and r["check"]["ok"]:
            p = r["params"]
            key = (p["step"], p["tree"], p["batch"], p["variant"])
            by_key.setdefault(key, {})[p["backend"]] = r
    rows, fill_rows, target_rows = [], [], {}
    for (step, label, batch, variant), got in by_key.items():
        k, ref = got.get("kernel"), got.get("reference")
        k_us = k["summary"]["median_us"] if k else None
        ref_us = ref["summary"]["median_us"] if ref else None
        rows.append({"step": step, "tree": label, "B": batch, "variant": variant, "kernel_us": k_us,
                     "kernel_mode": mode_label(k) if k else None, "reference_us": ref_us,
                     "reference_mode": mode_label(ref) if ref else None,
                     "speedup": ref_us / k_us if k_us and ref_us else None})
        if step == "build_tree" and variant.startswith("full"):
            r = k or ref
            fill_rows.append({"tree": label, "B": batch, "context": variant.split("ctx")[1], "backend":
                              r["params"]["backend"], "mask_bytes": r["derived"].get("mask_bytes"),
                              "median_us": r["summary"]["median_us"], "GB/s": r["derived"].get("mask_gbps"),
                              "eta": r["derived"].get("eta")})
        if step in ("build_tree", "verify") and batch == 8 and k_us:
            t = target_rows.setdefault((step, label), {"step": step, "tree": label, "worst_kernel_us": 0.0,
                                                       "min_speedup": float("inf")})
            t["worst_kernel_us"] = max(t["worst_kernel_us"], k_us)
            t["min_speedup"] = min(t["min_speedup"], ref_us / k_us if ref_us else float("inf"))
    for t in target_rows.values():
        t["meets <=8us and >=20x"] = "yes" if t["worst_kernel_us"] <= 8.0 and t["min_speedup"] >= 20 else "NO"
    targets_title = ("targets at B=8: build_tree and verify <= 8 us and >= 20x the reference (worst over mask modes "
                     "and contexts)")
    # what the kernels did on CPU, from the records (TRITON_INTERPRET=0 exported: skipped, never interpreted)
    ran = any(r["params"].get("backend") == "kernel" and not r.get("skipped") for r in records)
    how = ("the kernels ran in the Triton interpreter" if ran else
           "the kernels did not run: the Triton interpreter is off (TRITON_INTERPRET=0), the reference only")
    if cpu_numbers(records):  # the targets are a GPU's: an interpreter's time meets or misses none of them
        targets_title += f": withheld, CPU numbers ({how}" + (" at B=1, checked, not timed)" if ran else ")")
        targets = []
    else:
        targets = list(target_rows.values()) or [{"note": "no kernel timings at B=8 in these records"}]
    rows = withhold_on_cpu(records, rows, ("speedup",))
    fill_rows = withhold_on_cpu(records, fill_rows, ("eta", "GB/s"))
    return [("draft tree: kernel vs reference, median us" + (f"; CPU: {how}, perf_counter timing"
                                                              if cpu_numbers(records) else ""), rows),
            ("full tree mask: bytes written and bandwidth", fill_rows),
            (targets_title, targets)]


def charts(records: list[dict], directory: Path, stamp: str) -> list[Path]:
    return []


def release() -> None:
    """Each case's setup owns its inputs; nothing is cached at module level."""
