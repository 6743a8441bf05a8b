"""Rank 0's verify_dist results: one Case per n and variant (the max over ranks), the allreduce figures derived from
them, the table, the notes, and the file, re-saved after each backend."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from verifybench.harness.collectives.allreduce_results import measurement_from_dict
from verifybench.harness.engine import fingerprint, results
from verifybench.harness.engine.results import Case
from verifybench.harness.multigpu.verify_setup import VARIANTS


COMPONENT = "verify_dist"
# figures derived from the timed variants (differences and ratios): on CPU, timer noise, withheld in the table
DERIVED_COLUMNS = ("AR marginal(us)", "per AR(us)", "AR alone/op(us)", "no-AR+stand-ins(us)")


def build_cases(name: str, per_rank: list[list[dict]], plan: dict, world_size: int) -> tuple[list[Case], list[dict]]:
    """Per n and variant one Case: time = max over ranks of each rank's median, samples of that slowest rank.
    The allreduce figures go on the full forward's case and into the table row."""
    cases, rows = [], []
    n_ar = 2 * plan["layers_run"]
    for i, n in enumerate(plan["tokens"]):
        recs = [r[i] for r in per_rank]
        stand_in = plan["stand_in_by_n_us"][i]
        ok, detail = recs[0]["ok"], recs[0]["detail"]
        size = n * plan["hidden"] * 2
        row = {"n": n, "size(B)": size, "backend": name}
        base = {"preset": plan["preset"], "tp": plan["tp"], "world_size": world_size, "backend": name, "tokens": n,
                "context": plan["context"], "layers": plan["layers_run"]}
        if plan["no_allreduce"]:
            base["debug"] = "no-allreduce"
        if not ok:
            cases += [Case(f"{COMPONENT}/{name}/{v}/n{n}", {**base, "variant": v}, False, detail) for v in VARIANTS]
            rows.append({**row, "full(us)": "FAIL", "check": "FAIL"})
            continue
        meds = {v: [r["variants"][v]["summary"]["median_us"] for r in recs] for v in VARIANTS}
        t = {v: max(m) for v, m in meds.items()}
        marginal = t["full"] - t["without-allreduce"]
        ar = {"allreduces_per_forward": n_ar, "allreduce_bytes": size, "allreduce_marginal_us": marginal,
              "per_allreduce_marginal_us": marginal / n_ar, "per_allreduce_alone_us": t["only-allreduce"] / n_ar,
              "stand_in_us": stand_in, "stand_in_forward_us": t["without-allreduce"] + n_ar * stand_in}
        for v in VARIANTS:
            slowest = max(range(world_size), key=lambda r: meds[v][r])
            derived = {"time_us": t[v], "rank_medians_us": meds[v], "slowest_rank": slowest,
                       **(ar if v == "full" else {})}
            cases.append(Case(f"{COMPONENT}/{name}/{v}/n{n}", {**base, "variant": v}, True, detail,
                              measurement_from_dict(recs[slowest]["variants"][v]), derived))
        rows.append({**row, "full(us)": t["full"], "no-AR(us)": t["without-allreduce"], "AR marginal(us)": marginal,
                     "per AR(us)": marginal / n_ar, "AR alone/op(us)": t["only-allreduce"] / n_ar,
                     "stand-in(us)": stand_in, "no-AR+stand-ins(us)": ar["stand_in_forward_us"], "check": "ok"})
    return cases, (results.withhold(rows, DERIVED_COLUMNS) if plan["device"] == "cpu" else rows)


def table_text(rows: list[dict], device: str) -> str:
    """The per-n table; on CPU through tables.render, which names the withheld columns once above the table instead
    of repeating "withheld: CPU numbers" in every cell."""
    from tabulate import tabulate

    from verifybench.harness.engine import tables

    return tables.render(rows) if device == "cpu" else tabulate(rows, headers="keys", floatfmt=".1f", stralign="right")


class Output:
    """Rank 0's results file, re-saved after each backend so a later crash keeps the earlier numbers."""

    def __init__(self, args, info, plan: dict, ranks: list[dict]):
        self.args, self.info, self.plan, self.ranks = args, info, plan, ranks
        self.cases: list[Case] = []
        self.rows: list[dict] = []
        self.versions: dict = {}
        self.fp = fingerprint.collect()
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.name = args.name or f"{COMPONENT}-{stamp}.json"
        self.path: Path | None = None

    def add(self, backend: str, per_rank: list[list[dict]], skipped: dict, versions: dict) -> None:
        self.versions = versions
        if per_rank and per_rank[0]:
            cases, rows = build_cases(backend, per_rank, self.plan, self.info.world_size)
            self.cases += cases
            self.rows += rows
        self.save(skipped, complete=False)

    @property
    def all_ok(self) -> bool:
        return bool(self.cases) and all(c.check_ok for c in self.cases)

    def notes(self) -> list[str]:
        p, i = self.plan, self.info
        out = []
        if p["device"] == "cpu":
            out.append("NOTE: run on CPU: CPU numbers (gloo, perf_counter timing), not GPU numbers; the figures "
                       "derived from them (allreduce marginal, per allreduce, with stand-ins) are withheld.")
        if i.world_size < p["tp"]:
            out.append(f"NOTE: {i.world_size} ranks of a TP-{p['tp']} model: each rank holds the shapes one of "
                       f"{p['tp']} ranks holds, and the allreduce spans {i.world_size} ranks, not {p['tp']}.")
        elif i.world_size > p["tp"]:
            out.append(f"NOTE: {i.world_size} ranks, each with the shapes of a TP-{p['tp']} rank: the allreduce spans "
                       f"{i.world_size} ranks, more than a TP-{p['tp']} model has.")
        if i.world_size == 1:
            out.append("NOTE: one rank: the allreduce has no peer. Multi-GPU: torchrun --nproc-per-node=N -m "
                       "verifybench.harness.multigpu.verify")
        if p["layers_run"] != p["preset_layers"]:
            out.append(f"NOTE: {p['layers_run']} of the preset's {p['preset_layers']} layers, not scaled.")
        if p["no_allreduce"]:
            out.append("NOTE: --no-allreduce (debug): the allreduce is a no-op, the cross-rank check must fail.")
        per_n = "" if len(set(p["stand_in_by_n_us"])) == 1 else "; at each n's size in the table"
        out.append(f"stand-in: {p['stand_in_us']:g} us per allreduce in the one-GPU report ({p['stand_in_source']})"
                   + per_n)
        return out

    def save(self, skipped: dict, complete: bool) -> dict:
        i = self.info
        extra = {"world_size": i.world_size, "local_world_size": i.local_world_size, "nnodes": i.nnodes,
                 "plan": self.plan, "skipped": skipped, "versions": self.versions, "complete": complete,
                 "ranks": self.ranks, "table": self.rows, "notes": self.notes(), "ops": self.ranks[0]["ops"],
                 "allreduce": ("disabled (--no-allreduce, debug)" if self.plan["no_allreduce"] else
                               "real: through the named backend across the ranks, inside the forward's CUDA graph"),
                 "time_definition": "max over ranks of each rank's median; graph mode, one forward per replay; "
                                    "per AR = (full - without-allreduce) / (2 x layers)"}
        run = results.make_run(COMPONENT, self.cases, self.fp, extra)
        self.path = results.save_run(run, self.args.out, self.name, update=self.path)
        return run

    def finish(self, skipped: dict) -> None:
        self.save(skipped, complete=True)
        p = self.plan
        for line in self.notes():
            print(line)
        for b, why in skipped.items():
            print(f"skipped {b}: {why}")
        failed = [c.name for c in self.cases if not c.check_ok]
        if failed:
            details = {c.check_detail for c in self.cases if not c.check_ok}
            print(f"FAILED checks (no time reported): {', '.join(failed)}\n  " + "\n  ".join(sorted(details)))
        if fingerprint.throttled(self.fp):
            print("WARNING: a GPU reported throttling when the run started")
        print(f"saved {self.path}")
        ar = "NO allreduce (debug)" if p["no_allreduce"] else "real allreduce"
        print(f"\n# verify forward, {p['preset']} TP-{p['tp']} rank shapes on {self.info.world_size} ranks, "
              f"{p['layers_run']} layers, context {p['context']}, {self.ranks[0]['ops'] or 'no'} ops; {ar}, "
              f"2 per layer; time = max over ranks of the per-rank median, "
              f"{'cpu-loop (no CUDA graph)' if p['device'] == 'cpu' else 'graph mode'}, warm-up {p['warmup_calls']}, "
              f"samples {p['samples']}")
        print(table_text(self.rows, p["device"]), flush=True)

