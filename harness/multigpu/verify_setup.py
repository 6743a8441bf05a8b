"""The distributed verify's setup: the plan every rank agrees on (shapes, counts, backends, the one-GPU stand-in),
the memory check before building, this rank's forward, and the allreduce function the forward calls."""
from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from verifybench.harness.collectives.backends import GPU_BACKENDS, Comm, make_backend
from verifybench.harness.analysis.numbers import name_list
from verifybench.harness.measure.timing import memory
from verifybench.harness.model import build, presets
from verifybench.harness.model.forward import COMPONENTS, VerifyForward, allocated_bytes
from verifybench.harness.model.presets import default_scope


BACKENDS = (*GPU_BACKENDS, "gloo")
ALL = frozenset(COMPONENTS)
VARIANTS = {"full": ALL, "without-allreduce": ALL - {"allreduce"}, "only-allreduce": frozenset({"allreduce"})}
BACKEND_HELP = {  # how each reduces the forward's [n, hidden] bf16 tensors, which are not preallocated buffers
    "nccl": "torch.distributed.all_reduce in place on the NCCL process group",
    "pynccl": "raw ncclAllReduce through cupy.cuda.nccl, in place, on torch's current stream (as serving engines "
              "call it inside their graphs)",
    "symm-one-shot": "torch symmetric memory: the tensor copied into a symmetric buffer (inside the kernel where "
                     "torch has one_shot_all_reduce_copy_out), every rank loads all peers' over P2P into the tensor",
    "symm-two-shot": "torch symmetric memory: copy into a symmetric buffer, reduce-scatter + all-gather over P2P "
                     "loads into the tensor",
    "gloo": "torch.distributed.all_reduce on gloo: the forward runs on CPU (the smoke run)",
}
NO_HEAD = ALL - {"head"}  # the head's lm_head is a per-rank vocab shard: its argmax differs by design
# (warm-up calls, samples) per variant and n, identical on every rank; one forward per graph replay
DEFAULT_COUNTS = {"cuda": (3, 40), "cpu": (2, 5)}


def check_memory(plan: dict, device: str, sharers: int = 1) -> None:
    """MemoryError naming the bytes and the --layers that would fit, when this rank's forward does not fit its share
    of the free memory (measure/timing/memory.py's rule): before building, not by dying of OOM halfway through. On a
    CPU the `sharers` ranks of a host share its memory; on GPUs each rank has its own."""
    s = presets.get(plan["preset"], plan["tp"], plan["layers"])

    def need(n_layers: int) -> int:
        return allocated_bytes(replace(s, layers=n_layers), plan["context"], max(plan["tokens"]))

    what = (f"one rank's {plan['preset']} TP{plan['tp']} forward at context {plan['context']}"
            + (f" on a host shared by {sharers} ranks" if sharers > 1 else ""))
    fit = memory.plan(need, s.layers, min(s.layers, s.dense_layers + 1), what, "layers", device,
                      free=memory.free_bytes(device) // sharers)
    if fit.units < s.layers:
        raise MemoryError(fit.skip or memory.shortfall(f"{what} ({s.layers} layers)", need(s.layers),
                                                       fit.free_bytes, device) + f": --layers {fit.units} fits")


def same_inputs(fwd: VerifyForward, seed: int = 0) -> None:
    """Redraw every per-n input and stand-in buffer identically on every rank: VerifyForward draws them from the
    global generator after the rank-seeded weights. Drawn on CPU (the same numbers on any GPU), then moved."""
    device, fwd.device = fwd.device, "cpu"
    torch.manual_seed(seed)
    try:
        bufs = {n: fwd._buffers(n) for n in fwd.buf}
    finally:
        fwd.device = device
    fwd.buf = {n: {k: v.to(device) for k, v in b.items()} for n, b in bufs.items()}


def replicate_weights(fwd: VerifyForward, seed: int = 0) -> None:
    """Make the weights TP replicates (fused q_a/kv_a projection, router) identical on every rank, as in a
    deployment: the ranks then route the same tokens to the same experts and do the same MoE work, so waits at
    the allreduce come from the allreduce, not from routing that differs per rank. The rest stays rank-seeded."""
    for i, L in enumerate(fwd.layers):
        for key in ("q_a_kv_a", "router"):
            if key in L:
                gen = torch.Generator(device=fwd.device).manual_seed(seed * 1000 + i)
                w = torch.randn(L[key].shape, generator=gen, device=fwd.device, dtype=L[key].dtype)
                L[key].copy_(w / L[key].shape[-1] ** 0.5)


def build_forward(plan: dict, device: str, rank: int) -> VerifyForward:
    """This rank's forward: the one-GPU report's MoE, tree verify and small-op set; rank-dependent weights except
    the replicated ones; inputs identical on every rank."""
    s = presets.get(plan["preset"], plan["tp"], plan["layers"])
    if device == "cuda":  # each rank its own GPU, now current; a CPU plan was checked before the rendezvous
        check_memory(plan, device)
    fwd = VerifyForward(s, plan["context"], device, build.moe_fn(device), None, build.chain_verify(device),
                        max_tokens=max(plan["tokens"]), seed=1 + rank, ops=build.forward_ops(device))
    replicate_weights(fwd)
    same_inputs(fwd)
    return fwd


# ---- allreduce_fn(t): in place over the N ranks, graph-capturable on CUDA ----

def make_allreduce_fn(name: str, comm: Comm, max_numel: int):
    """`fn(t)` sums a contiguous [n, hidden] bf16 tensor in place over every rank. Collective: every rank calls it."""
    if name in ("nccl", "gloo"):
        return lambda t: dist.all_reduce(t)
    if name == "pynccl":
        from cupy.cuda import nccl

        make = make_backend(name, comm, max_numel)  # the uid exchange and the communicator
        nc, bf16, op_sum = make.communicator, getattr(nccl, "NCCL_BFLOAT16", 9), nccl.NCCL_SUM

        def fn(t):  # in place; torch's current stream at call time (the capture stream inside torch.cuda.graph)
            nc.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), bf16, op_sum, torch.cuda.current_stream().cuda_stream)

        fn.keep = make
        return fn
    if name in ("symm-one-shot", "symm-two-shot"):
        from verifybench.harness.collectives.backends import _symm_group_name

        make = make_backend(name, comm, max_numel)  # the rendezvoused symmetric buffer
        buf, group, ops = make.buffer, _symm_group_name(), torch.ops.symm_mem
        if name == "symm-one-shot" and hasattr(ops, "one_shot_all_reduce_copy_out"):
            def fn(t):  # the kernel copies t into the buffer itself; each thread copies then writes the same
                flat = t.view(-1)  # elements, so the output may be t
                ops.one_shot_all_reduce_copy_out(buf[: flat.numel()], flat, "sum", group, flat)
        elif name == "symm-one-shot":
            def fn(t):
                flat = t.view(-1)
                sym = buf[: flat.numel()]
                sym.copy_(flat)
                ops.one_shot_all_reduce_out(sym, "sum", group, flat)
        else:
            def fn(t):  # copy in; reduce-scatter in the buffers, all-gather into t (or copy back)
                flat = t.view(-1)
                sym = buf[: flat.numel()]
                sym.copy_(flat)
                if hasattr(ops, "two_shot_all_reduce_out"):
                    ops.two_shot_all_reduce_out(sym, "sum", group, flat)
                else:
                    ops.two_shot_all_reduce_(sym, "sum", group)
                    flat.copy_(sym)

        fn.keep = make
        return fn
    raise ValueError(f"unknown backend {name!r}")



def make_plan(args) -> dict:
    """Everything every rank must agree on; validated before any process group exists (same answer on every rank)."""
    cuda = torch.cuda.is_available()
    backends = name_list(args.allreduce, "--allreduce", BACKENDS) if args.allreduce else ["nccl" if cuda else "gloo"]
    if "gloo" in backends and len(backends) > 1:
        raise ValueError("gloo runs the forward on CPU: run it on its own, not with GPU backends")
    if not cuda and backends != ["gloo"]:
        raise ValueError(f"--allreduce {','.join(backends)} needs a CUDA GPU and this machine has none: use "
                         "--allreduce gloo")
    tokens = sorted(args.tokens)
    device = "cuda" if cuda and backends != ["gloo"] else "cpu"
    default_preset, default_tp, default_context = default_scope(device == "cuda")  # CPU: the smoke profile's tiny
    preset = args.preset if args.preset is not None else default_preset
    tp = args.tp if args.tp is not None else default_tp
    context = args.context if args.context is not None else default_context
    s = presets.get(preset, tp, args.layers)  # raises on an unknown preset or a TP that does not divide
    warm, samples = DEFAULT_COUNTS[device]
    ar_us, ar_source = build.allreduce_stand_in_us()
    by_n = [build.allreduce_stand_in_us(n * s.hidden * 2)[0] for n in tokens]  # a measured figure: at each n's size
    plan = {"preset": preset, "tp": tp, "context": context, "layers": args.layers,
            "layers_run": s.layers, "preset_layers": presets.get(preset).layers, "hidden": s.hidden,
            "tokens": tokens, "backends": backends, "device": device, "warmup_calls": args.warmup or warm,
            "samples": args.samples or samples, "calls_per_sample": 1, "no_allreduce": args.no_allreduce,
            "stand_in_us": ar_us, "stand_in_source": ar_source, "stand_in_by_n_us": by_n, "variants": list(VARIANTS),
            "rank_bytes": allocated_bytes(s, context, max(tokens))}
    if device == "cpu":
        check_memory(plan, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return plan

