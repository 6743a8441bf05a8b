"""Rank 0's allreduce results file for the torchrun job: re-saved after each backend, so a later crash keeps the
numbers measured so far; the closing table and notes."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from tabulate import tabulate

from verifybench.harness.collectives.allreduce_results import COMPONENT, build_cases, tables
from verifybench.harness.engine import fingerprint, results
from verifybench.harness.engine.tables import render
from verifybench.harness.engine.results import Case

# The file name's prefix names the kind of result: the one-rank `allreduce` component writes allreduce-<stamp>.json,
# this job allreduce_ranks-<stamp>.json; its stored component stays "allreduce", so baselines load and compare.
FILE_PREFIX = "allreduce_ranks"


class Output:
    """Rank 0's accumulating results file: re-saved after each backend, so a later crash keeps earlier numbers."""

    def __init__(self, args, info, plan: dict, device_type: str, ranks: list[dict]):
        self.args, self.info, self.plan, self.device_type = args, info, plan, device_type
        self.ranks = [{k: v for k, v in r.items() if k != "unavailable"} for r in ranks]
        self.cases: list[Case] = []
        self.versions: dict = {}
        self.fp = fingerprint.collect()
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.name = args.name or f"{FILE_PREFIX}-{stamp}.json"
        self.path: Path | None = None
        self.all_ok = True

    def add(self, backend: str, per_rank: list[list[dict]], skipped: dict, versions: dict) -> None:
        self.versions = versions
        self.cases += build_cases(backend, per_rank, self.plan, self.info.world_size) if per_rank[0] else []
        self._save(skipped, complete=False)

    def _save(self, skipped: dict, complete: bool, nccl_log: dict | None = None) -> dict:
        i = self.info
        extra = {"world_size": i.world_size, "local_world_size": i.local_world_size, "nnodes": i.nnodes,
                 "preset": self.plan["preset"], "tp": self.plan["tp"], "hidden": self.plan["hidden"],
                 "plan": self.plan, "skipped": skipped, "versions": self.versions, "complete": complete,
                 "label": self.args.label, "device": self.device_type, "nccl_log": nccl_log, "ranks": self.ranks,
                 "time_definition": "max over ranks of each rank's median; graph and eager: one sample = K ops / K"}
        run = results.make_run(COMPONENT, self.cases, self.fp, extra)
        self.path = results.save_run(run, self.args.out, self.name, update=self.path)
        return run

    def finish(self, skipped: dict, nccl_log_dir: str | None, added_env: tuple = ()) -> None:
        """Final save, then the table. `added_env`: variables this run set for itself (NCCL's log), kept out of
        the fingerprint so that compare's NCCL_* diff shows only the user's configuration."""
        nccl_log = None
        if nccl_log_dir:
            from verifybench.harness.multigpu.sweep import parse_nccl_logs

            nccl_log = parse_nccl_logs(Path(nccl_log_dir))
        for key in added_env:
            self.fp["env"].pop(key, None)
        run = self._save(skipped, complete=True, nccl_log=nccl_log)
        self.all_ok = all(c.check_ok for c in self.cases)
        if self.device_type == "cpu":
            print("NOTE: run on CPU: CPU numbers (gloo, perf_counter timing), not GPU numbers.")
        if self.info.world_size == 1:
            print("NOTE: one rank: each op has no peer (busbw 0). Multi-GPU: torchrun --nproc-per-node=N -m "
                  "verifybench.harness.multigpu.allreduce")
        print(f"\n# allreduce, {self.info.world_size} ranks on {self.info.nnodes} node(s), bf16 sum; time = max over "
              f"ranks of the per-rank median; K={self.plan['calls_per_sample']} ops per graph/eager sample, warm-up "
              f"{self.plan['warmup_calls']}, samples {self.plan['samples']} (isolated {self.plan['isolated_samples']})")
        for title, rows in tables(run["cases"]):
            if rows:
                # CPU-timed rows (gloo): through tables.render, which names a withheld column once above the table
                withheld = any(results.WITHHELD in row.values() for row in rows)
                print(f"\n{title}\n" + (render(rows) if withheld else
                                         tabulate(rows, headers="keys", floatfmt=".2f", stralign="right")))
        for b, why in skipped.items():
            print(f"skipped {b}: {why}")
        if nccl_log and nccl_log.get("transports"):
            print(f"NCCL transport (rank 0): {nccl_log['transports']}")
        failed = [c.name for c in self.cases if not c.check_ok]
        if failed:
            print(f"FAILED checks (no time reported): {', '.join(failed)}")
        if fingerprint.throttled(self.fp):
            print("WARNING: a GPU reported throttling when the run started")
        print(f"saved {self.path}", flush=True)
