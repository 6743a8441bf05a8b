"""Tuner of the moe_int4 kernel's config table (run through `verifybench tune`)."""
from __future__ import annotations

import json
import math
import os
import time

import torch

from verifybench.harness.model import presets
from verifybench.harness.measure.timing.runner import rel_error
from verifybench.harness.measure.timing.timer import cuda_available, measure
from verifybench.kernels.moe_int4 import reference as moe
from verifybench.kernels.moe_int4 import api as mt
from verifybench.kernels.moe_int4 import kernels as mtk
from verifybench.kernels.moe_int4 import configs as ms
from verifybench.harness.components.moe_int4 import TOL, make_case, preset_shape
from verifybench.harness.tune.common import merged_table
from verifybench.harness.measure.timing.capture import graph_capture

# ---------------------------------------------------------------------------------------------------- tuning

TUNE_NS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
PREWARM_SHARE = 0.6  # of the time cap, at most, for compiling ahead in parallel
SPACES = tuple(ms.TUNE_SPACES)  # split-denormal, split-half2: (starting config, gate_up and down candidates) each
# CPU dry run (preset tiny, interpreter): the same code path with few, large blocks (the interpreter's cost is per
# program); timings are meaningless there
SMOKE = {"gate_up": [{"BLOCK_N": 64, "num_warps": 1, "num_stages": 1, "SPLIT_K": 1, "PREFETCH": 1, "BLOCK_W": 16},
                     {"BLOCK_N": 64, "num_warps": 1, "num_stages": 1, "SPLIT_K": 2, "PREFETCH": 0, "BLOCK_W": 128},
                     {"BLOCK_N": 64, "num_warps": 1, "num_stages": 1, "SPLIT_K": 3}],  # invalid: skipped
         "down": [{"BLOCK_N": 128, "ROW_ITERS": 2, "num_stages": 1}, {"BLOCK_N": 256, "ROW_ITERS": 1, "num_stages": 1}]}


def _cfg_key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True)


def short_config(cfg: dict) -> str:
    """A config in one short string: 'gu 8r K7 pf0 w128 dn 16x1 pdl half2'."""
    c1, c2 = cfg["gate_up"], cfg["down"]
    gu = (f"gu {c1['BLOCK_N']}r K{c1.get('SPLIT_K', 1)} pf{int(c1.get('PREFETCH', 1))}"
          + (f" w{c1['BLOCK_W']}" if "BLOCK_W" in c1 else "") + (f" nw{c1['num_warps']}" if c1["num_warps"] != 1 else ""))
    return (f"{gu} dn {c2['BLOCK_N']}x{c2.get('ROW_ITERS', 1)}" + (" pdl" if cfg.get("pdl") else "")
            + (" half2" if cfg.get("dequant") == "half2" else ""))


def _time_config(preset: str, tp: int, n: int, config: dict, max_time_s: float, device: str = "cuda",
                 log=print) -> tuple[float, dict | None]:
    """(median us, derived metrics) of one config (graph mode, cold rotation) after its check against the fp32
    reference on fresh inputs; (inf, None) when it is invalid for the shapes, fails to build, or fails the check.
    On CPU (the interpreter's dry run: its path, not its times) one input set, eager, one sample."""
    try:
        spec = make_case(preset, tp, "triton", n, "uniform", device, "graph", {}, config=config)
        fns, check, derive = spec.prepare()
        ok, detail = check()
        if not ok:
            raise RuntimeError(f"check failed: {detail}")
        if device == "cuda":
            m = measure(fns, mode="graph", device=device, max_time_s=max_time_s, warmup_s=0.02)
        else:
            m = measure(fns[:1], mode="hot", device=device, warmup_calls=1, calls_per_sample=1, samples=1)
    except Exception as e:  # a config the shapes, the compiler or the GPU refuse is skipped, not fatal
        log(f"    skipped {short_config(config)} at n={n}: {type(e).__name__}: {str(e)[:300]}")
        return math.inf, None
    try:
        return m.median_us, derive(m)
    except Exception as e:  # eta is a by-product: never lose the time over it
        log(f"    no eta for n={n}: {type(e).__name__}: {str(e)[:200]}")
        return m.median_us, None


class _Tuner:
    """Coordinate descent over one config space per n, every (n, config) timed once, with progress lines and a
    wall-clock cap (checked before each measurement: the cap ends the sweep, never a measurement)."""

    def __init__(self, preset: str, tp: int, device: str, max_time_s: float, deadline: float, total: int, log):
        self.preset, self.tp, self.device, self.max_time_s = preset, tp, device, max_time_s
        self.shape = _shape(preset_shape(preset, tp))
        self.deadline, self.total, self.log = deadline, total, log
        self.t0 = time.perf_counter()
        self.done = 0
        self.cache: dict[tuple, tuple[float, dict | None]] = {}

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline

    def time(self, n: int, cfg: dict, label: str) -> float:
        key = (n, _cfg_key(cfg))
        if key not in self.cache:
            if self.out_of_time():
                return math.inf
            too_big = ms.misfit(cfg, self.device, self.shape)
            if too_big:  # it would fail to launch here; select() would not pick it either
                self.log(f"    skipped {short_config(cfg)}: needs {too_big[0]} B of shared memory, the GPU allows "
                         f"{too_big[1]} B")
                self.cache[key] = (math.inf, None)
                return math.inf
            self.cache[key] = _time_config(self.preset, self.tp, n, cfg, self.max_time_s, self.device, self.log)
            self.done += 1
            el = time.perf_counter() - self.t0
            us = self.cache[key][0]
            self.log(f"[{self.done:3d}/~{self.total} {el:5.0f}s] n={n:<2d} {label:3s} {short_config(cfg):44s} "
                     + (f"{us:9.2f} us" if math.isfinite(us) else "   failed"))
        return self.cache[key][0]

    def sweep(self, n: int, base: dict, key: str, candidates: list, label: str) -> tuple[dict, float]:
        """The best of base with base[key] replaced by each candidate (base itself counts: it was timed first)."""
        best, best_us = base, self.time(n, base, label)
        for c in candidates:
            cfg = {**base, key: c}
            us = self.time(n, cfg, label)
            if us < best_us:
                best, best_us = cfg, us
        return best, best_us


def _shape(p: presets.Preset) -> moe.MoeShape:
    return moe.MoeShape(tokens=1, hidden=p.hidden, inter=p.expert_intermediate, experts=p.experts, topk=p.topk,
                        group_size=p.expert_group_size)


def _valid(cfg: dict, p: presets.Preset) -> bool:
    try:
        mtk.check_config({**ms.DEFAULT_CONFIG, **cfg}, _shape(p), torch.device("cpu"))
        return True
    except ValueError:
        return False


def _small_layer(preset: str, tp: int, device: str, experts: int = 16) -> tuple:
    """One layer of random INT4 experts at the preset's shapes but 16 experts: the same kernel specializations as
    the real layers (E % 16 == 0, same strides and dtypes), ~50 MB for K2.5."""
    p = preset_shape(preset, tp)
    h, i, gs = p.hidden, p.expert_intermediate, p.expert_group_size
    gen = torch.Generator(device=device)
    gen.manual_seed(0)

    def linear(rows, k):
        return (torch.randint(0, 1 << 30, (experts, rows, k // 8), dtype=torch.int32, device=device, generator=gen),
                (torch.rand(experts, rows, k // gs, device=device, generator=gen) / (4.6 * math.sqrt(k))
                 ).to(torch.bfloat16))

    return (*linear(2 * i, h), *linear(h, i))


def _prewarm_worker(preset: str, tp: int, jobs: list, deadline_epoch: float = math.inf) -> list[str]:
    """Compile (by running once) each (n, config) on _small_layer, so that the main process finds the kernels in
    triton's disk cache, until the wall clock passes `deadline_epoch` (time.time(): shared across processes).
    Returns the failures."""
    p = preset_shape(preset, tp)
    device = "cuda" if cuda_available() else "cpu"
    act = torch.bfloat16 if device == "cuda" else torch.float16
    ws = _small_layer(preset, tp, device)
    failed = []
    for n, cfg in jobs:
        if time.time() > deadline_epoch:  # the sweep compiles the rest itself, within its own time limit
            break
        try:
            ms.misfit(cfg, device, _shape(p))  # compiles the shared-memory check here, in parallel (Triton's cache)
            tw, ids = moe.route_uniform(n, ws[0].shape[0], p.topk, seed=n, device=device)
            mt.fused_moe_w4a16(torch.randn(n, p.hidden, device=device).to(act), *ws, tw, ids, config=cfg,
                               check_ids=False)
        except Exception as ex:  # reported; the tuner then skips that config itself
            failed.append(f"{short_config(cfg)} n={n}: {type(ex).__name__}: {str(ex)[:200]}")
    if device == "cuda":
        torch.cuda.synchronize()
    return failed


def _probe_pdl_worker(preset: str, tp: int) -> str | None:
    """None when pdl configs match the reference eagerly and replayed from a CUDA graph; else why.
    Run in a separate process: a capture that fails there cannot leave the tuner's capture stream broken."""
    if not cuda_available():
        return None  # the interpreter runs pdl configs without PDL
    try:
        p = preset_shape(preset, tp)
        ws = _small_layer(preset, tp, "cuda")
        x = torch.randn(2, p.hidden, device="cuda").to(torch.bfloat16)
        tw, ids = moe.route_uniform(2, ws[0].shape[0], p.topk, seed=5, device="cuda")
        cfg = {**ms.TUNE_SPACES["split-half2"][0], "pdl": True}
        ref = moe.reference_moe_w4a16(x.float(), *ws, tw, ids)
        eager = mt.fused_moe_w4a16(x, *ws, tw, ids, config=cfg, check_ids=False)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            out = mt.fused_moe_w4a16(x, *ws, tw, ids, config=cfg, check_ids=False)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        errs = (rel_error(eager.float(), ref), rel_error(out.float(), ref))
        if not max(errs) <= TOL:
            return f"wrong result: rel_err eager {errs[0]:.2e}, graph {errs[1]:.2e} (tol {TOL:g})"
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"


def _prewarm(preset: str, tp: int, jobs: list, workers: int, log, probe: bool = True,
             time_limit_s: float = math.inf) -> bool:
    """Compile the sweep's kernels in `workers` spawned processes before timing (compiling dominates a cold sweep),
    for at most `time_limit_s`, and probe pdl in one more; any failure of the compiles only costs time (the sweep
    compiles what is missing). Returns whether pdl configs may be timed."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.perf_counter()
    step = -(-len(jobs) // max(1, workers))  # contiguous runs: calls that share a kernel mostly land in one process
    chunks = [jobs[w * step:(w + 1) * step] for w in range(workers) if jobs[w * step:(w + 1) * step]]
    if not chunks and not probe:
        return True
    try:
        with ProcessPoolExecutor(max(1, len(chunks)), mp_context=mp.get_context("spawn")) as pool:
            pdl = pool.submit(_probe_pdl_worker, preset, tp) if probe else None
            until = [time.time() + time_limit_s] * len(chunks)
            failed = [f for fs in pool.map(_prewarm_worker, [preset] * len(chunks), [tp] * len(chunks), chunks,
                                           until) for f in fs]
            pdl_error = pdl.result() if pdl else None
    except Exception as e:
        log(f"prewarm failed ({type(e).__name__}: {str(e)[:200]}); compiling during the sweep, pdl left out")
        return False
    if chunks:
        spent = time.perf_counter() - t0
        log(f"prewarmed {len(jobs)} (n, config) calls in {len(chunks)} processes: {spent:.0f} s"
            + (f" (stopped at its {time_limit_s:.0f} s limit: the sweep compiles the rest)"
               if spent > time_limit_s else "") + (f"; {len(failed)} failed, e.g. {failed[0]}" if failed else ""))
    if pdl_error:
        log(f"pdl probe failed, pdl configs left out: {pdl_error}")
    return pdl_error is None


def _prewarm_jobs(ns, gate_up: list, down: list, base: dict) -> list:
    """(n, config) calls that build every kernel variant a space's sweep may launch: the kernels do not specialize
    on the token count (one n does), but kernel 2 depends on SPLIT_K and both on pdl."""
    n = min(ns)
    jobs = []
    for pdl in (False, True) if gate_up else ():
        jobs += [(n, {**base, "pdl": pdl, "gate_up": c}) for c in gate_up]
        for split_rep in {c.get("SPLIT_K", 1): c for c in gate_up}.values():
            jobs += [(n, {**base, "pdl": pdl, "gate_up": split_rep, "down": c}) for c in down]
    return jobs


def tune(preset: str = "kimi-k2.5", tp: int = 8, ns=TUNE_NS, *, out: str, max_minutes: float = 4.0,
         max_time_s: float = 0.2, spaces=SPACES, jobs: int | None = None, log=print) -> dict:
    """Per n and space (ms.TUNE_SPACES: split-denormal, split-half2, the fp32 and the fp16-pair dequant): gate_up
    blocking x SPLIT_K x prefetch, then down blocking, then pdl, then the 3 best gate_up again with that down, every
    candidate checked against the fp32 reference, skipped where it does not fit the GPU's shared memory, then timed
    in graph mode with cold rotation (uniform routing). The winners are re-timed side by side; the fastest is the
    table's entry for n, with the default config's time at n beside it. Writes this GPU's entry into the table at
    `out` (other GPUs' entries kept), atomically. Without CUDA: a dry run of the same code path in the interpreter
    (preset tiny, small candidate lists, meaningless times; split-half2, which needs a GPU, is left out)."""
    t0 = time.perf_counter()
    device = "cuda" if cuda_available() else "cpu"
    if device == "cpu" and preset != "tiny":
        raise ValueError(f"tune on CPU is a dry run of preset 'tiny' only (got {preset!r}); the real run needs a GPU")
    if set(spaces) - set(SPACES) or not spaces:
        raise ValueError(f"spaces must be some of {SPACES}, got {spaces!r}")
    p = preset_shape(preset, tp)
    smoke = device == "cpu"
    if smoke and "split-half2" in spaces:
        log("space split-half2 left out: its inline PTX needs a CUDA GPU")
        spaces = tuple(sp for sp in spaces if sp != "split-half2")
    if smoke:
        base = {**ms.TUNE_SPACES["split-denormal"][0], "gate_up": SMOKE["gate_up"][0], "down": SMOKE["down"][0]}
        split_spaces = {"split-denormal": (base, SMOKE["gate_up"], SMOKE["down"])}
    else:
        split_spaces = {sp: (dict(base), gu, dn) for sp, (base, gu, dn) in ms.TUNE_SPACES.items()}
    split_spaces = {sp: v for sp, v in split_spaces.items() if sp in spaces}
    for sp, (base, cands, dn) in split_spaces.items():
        fit = [c for c in cands if _valid({**base, "gate_up": c}, p)]
        for c in cands:
            if c not in fit:
                log(f"candidate {c} does not fit preset {preset} (H {p.hidden}, group {p.expert_group_size}): left out")
        split_spaces[sp] = (base, fit, dn)
    per_n = sum(len(gu) + len(dn) + 1 + 3 for _, gu, dn in split_spaces.values()) + len(spaces)
    log(f"tune {preset}-tp{tp} on {ms.device_name(torch.device(device))}: n = {', '.join(map(str, ns))}; "
        f"spaces {', '.join(spaces)}; ~{per_n} timed configs per n, {max_time_s} s each; cap {max_minutes:.1f} min")
    workers = (0 if smoke else min(12, max(1, (os.cpu_count() or 2) - 2))) if jobs is None else jobs
    prewarm = [job for base, gu, dn in split_spaces.values() for job in _prewarm_jobs(ns, gu, dn, base)]
    # compiling may take most of a short cap, never all of it: the sweep needs time to measure
    pdl_ok = _prewarm(preset, tp, prewarm, workers, log, probe=not smoke and bool(split_spaces),
                      time_limit_s=PREWARM_SHARE * 60 * max_minutes)
    prewarm_s = time.perf_counter() - t0
    tuner = _Tuner(preset, tp, device, max_time_s, t0 + 60 * max_minutes, per_n * len(ns), log)
    best: dict[int, dict] = {}
    failed: list[int] = []  # every candidate of every space failed (the log says why)
    for n in ns:
        if tuner.out_of_time():
            break
        row = {}
        for sp, (base, gu, dn) in split_spaces.items():
            cfg, _ = tuner.sweep(n, base, "gate_up", gu, sp)
            cfg, _ = tuner.sweep(n, cfg, "down", dn, sp)
            if pdl_ok:
                cfg, _ = tuner.sweep(n, cfg, "pdl", [not cfg.get("pdl")], sp)
            ranked = sorted(gu, key=lambda c: tuner.cache.get((n, _cfg_key({**base, "gate_up": c})), (math.inf,))[0])
            cfg, us = tuner.sweep(n, cfg, "gate_up", ranked[:3], sp)
            row[sp] = (cfg, us)
        row = {k: v for k, v in row.items() if math.isfinite(v[1])}
        if row:
            best[n] = row
        elif not tuner.out_of_time():
            failed.append(n)
    # the winners again, side by side and longer: the sweep's minimum over many noisy samples is biased low
    final: dict[int, dict] = {}
    for n, row in best.items():
        res = {}
        for space, (cfg, _) in row.items():
            us, derived = _time_config(preset, tp, n, cfg, 2.5 * max_time_s, device, log)
            if math.isfinite(us):
                res[space] = {"config": cfg, "us": us, "eta": (derived or {}).get("eta", math.nan)}
        if res:
            final[n] = res
    skipped = [n for n in ns if n not in final]
    name = ms.device_name(torch.device(device))
    if not final:  # nothing measured: keep the table there is (an empty entry would replace this GPU's tuning)
        why = f"the {max_minutes:.1f} min cap was reached (compiling took {prewarm_s:.0f} s of it)" if not failed else \
            "every candidate failed (see above)"
        log(f"nothing tuned: {why}; no table written")
        raise RuntimeError(f"MoE tune measured no n: {why}")
    by_n = {}
    for n, res in final.items():
        space = min(res, key=lambda k: res[k]["us"])
        cfg = res[space]["config"]
        entry = {"gate_up": cfg["gate_up"], "down": cfg["down"], "dequant": cfg["dequant"],
                 "us": round(res[space]["us"], 2), "eta": round(res[space]["eta"], 3),
                 "by_space_us": {sp: round(r["us"], 2) for sp, r in res.items()}}
        default_us, _ = _time_config(preset, tp, n, ms.default_config(device, n), 2.5 * max_time_s, device, log)
        if math.isfinite(default_us):  # what the table buys over the untuned choice
            entry["default_us"] = round(default_us, 2)
        if cfg.get("pdl"):
            entry["pdl"] = True
        by_n[str(n)] = entry
    for n in skipped:  # keep the table complete; select_config would fall back the same way
        lower = [m for m in final if m < n]
        if lower:
            why = "every candidate failed" if n in failed else "time cap"
            by_n[str(n)] = {**by_n[str(max(lower))], "untuned": f"{why}: copied from n={max(lower)}"}
    table, _ = merged_table(out, ms.CONFIG_PATH, name)
    table[name] = {
        "by_n": by_n,
        "tuned_on": {"preset": f"{preset}-tp{tp}", "torch": torch.__version__, "triton": __import__("triton").__version__,
                     "date_utc": time.strftime("%Y-%m-%d", time.gmtime()), "sweep_s": round(time.perf_counter() - t0),
                     "spaces": list(spaces)}}
    path = ms.save_configs(table, out)
    log("")
    log(f"{'n':>3} " + " ".join(f"{sp + ' us':>9}" for sp in spaces) + f" {'default':>9} {'eta':>6}  chosen config")
    for n in ns:
        res = final.get(n)
        if res is None:
            why = "every candidate failed (see above)" if n in failed else f"the {max_minutes:.1f} min cap was reached"
            log(f"{n:>3} " + " ".join(f"{'-':>9}" for _ in spaces) + f" {'-':>9} {'':>6}  not tuned: {why}")
            continue
        space = min(res, key=lambda k: res[k]["us"])
        log(f"{n:>3} " + " ".join(f"{res.get(sp, {}).get('us', math.nan):9.2f}" for sp in spaces)
            + f" {by_n[str(n)].get('default_us', math.nan):9.2f} {res[space]['eta']:6.3f}  {space}: "
            + short_config(res[space]['config']))
    log(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return table
