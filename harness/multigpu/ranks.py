"""Who a torchrun rank is and how the ranks talk outside any device collective: rank discovery, the rendezvous
store, store-based agreement, and the environment every rank and child process runs under (multicast off)."""
from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from verifybench.harness.multigpu.report import log_prefix

# Multicast (NVLS, multimem) stays off on our H200s; every rank and child process gets these.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def force_safe_env(env: dict | None = None) -> dict:
    """Set SAFE_ENV in `env` (default os.environ), overriding other values; returns the overridden {key: old}."""
    env = os.environ if env is None else env
    changed = {k: env[k] for k, v in SAFE_ENV.items() if k in env and env[k] != v}
    env.update(SAFE_ENV)
    return changed


@dataclass(frozen=True)
class RankInfo:
    """Who this process is. `agent_store`: torchrun's agent hosts the store, so it outlives every rank."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool
    run_id: str
    host: str

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_info() -> RankInfo:
    """From torchrun's environment; without it (plain `python -m`), a single rank with a private store."""
    env = os.environ
    if "RANK" not in env:
        return RankInfo(0, 1, 0, 1, "127.0.0.1", _free_port(), False, uuid.uuid4().hex[:12], socket.gethostname())
    run_id = f"{env.get('TORCHELASTIC_RUN_ID', 'run')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return RankInfo(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env["MASTER_PORT"]),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        run_id=run_id,
        host=socket.gethostname(),
    )


def open_store(info: RankInfo, timeout_s: float, host_it: bool = False) -> dist.Store:
    """A store connection namespaced by run. `host_it`: this process serves the store (rank 0 without an agent)."""
    store = dist.TCPStore(info.master_addr, info.master_port, info.world_size if host_it else None, host_it,
                          timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"verifybench/{info.run_id}/", store)


class Agreement:
    """All-gather / broadcast of JSON values through the store: backend-agnostic, and never a device collective.

    Every rank must call the same methods in the same order (keys are numbered by call).
    """

    def __init__(self, store: dist.Store, info: RankInfo):
        self.store, self.info, self.calls = store, info, 0

    def _key(self, rank: int) -> str:
        return f"agree/{self.calls}/{rank}"

    def allgather(self, value) -> list:
        self.calls += 1
        self.store.set(self._key(self.info.rank), json.dumps(value))
        return [json.loads(self.store.get(self._key(r))) for r in range(self.info.world_size)]

    def gather(self, value, root: int = 0) -> list | None:
        self.calls += 1
        self.store.set(self._key(self.info.rank), json.dumps(value))
        if self.info.rank != root:
            return None
        return [json.loads(self.store.get(self._key(r))) for r in range(self.info.world_size)]

    def broadcast(self, value, root: int = 0):
        self.calls += 1
        if self.info.rank == root:
            self.store.set(self._key(root), json.dumps(value))
            return value
        return json.loads(self.store.get(self._key(root)))


def run_backends(backends, skipped: dict, run, agree: Agreement, guard, out, versions) -> None:
    """The torchrun jobs' loop, on every rank: each backend not in `skipped`, in order, by run(name) -> (records,
    error); an error puts it in `skipped`; its records gathered to rank 0's `out` (None on the others) with
    versions(), the backends' versions as they stand after it ran."""
    for name in backends:
        if name in skipped:
            continue
        records, error = run(name)
        if error:
            skipped[name] = error
        gathered = agree.gather(records)
        guard.mark(f"{name}: save")  # on every rank: the watchdog compares step numbers across ranks
        if out:
            out.add(name, gathered, skipped, versions())


def announce_safe_env() -> None:
    """force_safe_env() for this process, saying on stderr what it overrode."""
    overridden = force_safe_env()
    if overridden:
        forced = ", ".join(f"{k}={SAFE_ENV[k]} (was {v!r})" for k, v in overridden.items())
        print(f"{log_prefix()} forced {forced}: multicast stays off", file=sys.stderr)

