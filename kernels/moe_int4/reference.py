"""INT4 (W4A16) MoE experts: the checkpoint format, a plain-torch fp32 reference, routing helpers and byte counts.

The Triton fast path lives in api.py beside it; this module is what it is checked against.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from verifybench.kernels.common.validators import check_int, check_matrix

PACK = 8  # int4 values per int32 word
QMIN, QMAX, QOFFSET = -8, 7, 8  # nibble = q + 8, in 0..15
ACT_DTYPES = (torch.float16, torch.bfloat16)
REF_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------- format

def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_group(k: int, group_size: int, name: str = "K") -> int:
    """group_size as an int (a float, even 32.0, is refused: it sizes a reshape), a positive multiple of PACK
    dividing `k`."""
    if isinstance(group_size, (bool, torch.Tensor)) or not hasattr(group_size, "__index__"):
        raise ValueError(f"group_size must be an int, got {type(group_size).__name__} {group_size!r}")
    group_size = group_size.__index__()
    if group_size <= 0 or group_size % PACK:
        raise ValueError(f"group_size must be a positive multiple of {PACK}, got {group_size}")
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide {name} = {k}")
    return group_size


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., K] integers in 0..15 -> int32 [..., K/8]; nibble i (bits 4i..4i+3) of word w holds element 8w + i."""
    *lead, k = nibbles.shape
    parts = nibbles.reshape(*lead, k // PACK, PACK).to(torch.int64)
    shifts = torch.arange(0, 4 * PACK, 4, device=nibbles.device, dtype=torch.int64)
    words = (parts << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # two's complement wrap


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int32 [..., K] in 0..15 (inverse of pack_nibbles)."""
    shifts = torch.arange(0, 4 * PACK, 4, device=packed.device, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def _check_scales(scales: torch.Tensor) -> None:
    """Every group's scale (max|w| / 7, float64) within bf16's normal range, or 0 (an all-zero group): below it
    the bf16 scale rounds to 0 or to a few bits and the group comes back zeroed; above it, inf."""
    info = torch.finfo(torch.bfloat16)
    bad = ((scales > 0) & (scales < info.tiny)) | (scales > info.max)
    if bad.any():
        at = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"w: the int4 scale of group {at} (max|w| / {QMAX} = {scales[at].item():.3g}) is outside "
                         f"bf16's normal range [{info.tiny:.3g}, {info.max:.3g}]; {int(bad.sum())} group(s) so: "
                         "rescale the weights")


def quantize_w4a16(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 with a bf16 scale per `group_size` inputs: w [..., N, K] float -> (packed int32 [..., N, K/8],
    scales bf16 [..., N, K/group_size]), the compressed-tensors pack-quantized layout.

    scale = max|w| / 7 over the group (rounded to bf16 first, so dequantization reproduces q * scale exactly);
    q = round(w / scale) clamped to -8..7. Values already on a group's grid q * s (|q| <= 7, max |q| = 7, s a bf16
    value) round-trip exactly. A NaN or inf weight (it would turn its whole group NaN) is a ValueError naming where,
    and so is a group whose scale falls outside bf16's normal range (it would round-trip as zeros or inf).
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() < 2:
        raise ValueError(f"w must be [..., N, K], got shape {tuple(w.shape)}")
    k = w.shape[-1]
    group_size = _check_group(k, group_size)
    bad = ~torch.isfinite(w)
    if bad.any():
        at = bad.nonzero()[0].tolist()
        lead = ["expert"] if len(at) == 3 else [f"dim {i}" for i in range(len(at) - 2)]
        where = ", ".join(f"{n} {i}" for n, i in zip(lead + ["row", "column"], at))
        raise ValueError(f"w has a non-finite weight ({w[tuple(at)].item()}) at {where} (index {tuple(at)}); "
                         "int4 groups need finite weights")
    groups = w.float().reshape(*w.shape[:-1], k // group_size, group_size)
    _check_scales(w.reshape(*w.shape[:-1], k // group_size, group_size).abs().amax(-1).double() / QMAX)
    scales = (groups.abs().amax(-1) / QMAX).to(torch.bfloat16)
    s32 = scales.float().unsqueeze(-1)
    q = torch.where(s32 > 0, torch.round(groups / torch.where(s32 > 0, s32, 1.0)), 0.0).clamp(QMIN, QMAX)
    packed = pack_nibbles((q.to(torch.int32) + QOFFSET).reshape(w.shape))
    return packed, scales


def dequantize_w4a16(packed: torch.Tensor, scales: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """(packed int32 [..., N, K/8], scales bf16 [..., N, K/group_size]) -> float32 [..., N, K]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed must be int32, got {packed.dtype}")
    if scales.dtype != torch.bfloat16:
        raise TypeError(f"scales must be bfloat16, got {scales.dtype}")
    k = packed.shape[-1] * PACK
    group_size = _check_group(k, group_size)
    if packed.dim() < 2 or scales.shape != (*packed.shape[:-1], k // group_size):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match packed {tuple(packed.shape)} "
                         f"with group_size {group_size} (want {(*packed.shape[:-1], k // group_size)})")
    q = (unpack_nibbles(packed) - QOFFSET).float()
    return q * scales.float().repeat_interleave(group_size, dim=-1)


# ---------------------------------------------------------------------------------------------------- checks

@dataclass(frozen=True)
class MoeShape:
    tokens: int
    hidden: int
    inter: int  # per expert, per rank
    experts: int
    topk: int
    group_size: int


def check_moe_inputs(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids, *,
                     act_dtypes=ACT_DTYPES, check_ids: bool = True) -> MoeShape:
    """Validate a MoE call and return its shape; raises ValueError (shapes, values) or TypeError (dtypes).

    check_ids reads the ids on the host (a device sync): the graph-captured path passes False after checking once
    (while a CUDA graph is being captured the read is skipped anyway). topk >= 1; an id may repeat within a row
    (each pair adds its own term), so topk may exceed E.
    """
    tensors = dict(x=x, w13_packed=w13_packed, w13_scales=w13_scales, w2_packed=w2_packed, w2_scales=w2_scales,
                   topk_weights=topk_weights, topk_ids=topk_ids)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_matrix("x", x, act_dtypes, f"one of {[str(d) for d in act_dtypes]}", "[M, H]", TypeError)
    m, h = x.shape
    if m == 0:
        raise ValueError("M = 0: x has no tokens (an empty batch is the caller's to skip)")
    for name in ("w13_packed", "w2_packed"):
        if tensors[name].dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (8 nibbles per word), got {tensors[name].dtype}")
    for name in ("w13_scales", "w2_scales"):
        if tensors[name].dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {tensors[name].dtype}")
    if w13_packed.dim() != 3 or w13_packed.shape[1] % 2 or w13_packed.shape[2] * PACK != h:
        raise ValueError(f"w13_packed must be [E, 2I, H/8] = [E, 2I, {h // PACK}], got {tuple(w13_packed.shape)}")
    e, two_i, _ = w13_packed.shape
    inter = two_i // 2
    if w13_scales.dim() != 3 or w13_scales.shape[:2] != (e, two_i) or w13_scales.shape[2] == 0 \
            or h % w13_scales.shape[2]:
        raise ValueError(f"w13_scales must be [E, 2I, H/group] with E={e}, 2I={two_i} and a group dividing "
                         f"H={h}, got {tuple(w13_scales.shape)}")
    group = h // w13_scales.shape[2]
    _check_group(h, group)
    if w2_packed.dim() != 3 or tuple(w2_packed.shape) != (e, h, inter // PACK) or inter % PACK:
        raise ValueError(f"w2_packed must be [E, H, I/8] = {(e, h, inter // PACK)}, got {tuple(w2_packed.shape)}")
    if inter % group or tuple(w2_scales.shape) != (e, h, inter // group):
        raise ValueError(f"w2_scales must be [E, H, I/group] = {(e, h, inter // group if group else 0)} "
                         f"(group {group} must divide I = {inter}), got {tuple(w2_scales.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids must be [M, topk] with M={m}, got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [M, topk] with topk >= 1, got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    if check_ids and not _capturing(topk_ids):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= e:
            raise ValueError(f"expert ids out of range: found {lo}..{hi}, valid 0..{e - 1}")
    return MoeShape(tokens=m, hidden=h, inter=inter, experts=e, topk=topk_ids.shape[1], group_size=group)


# ---------------------------------------------------------------------------------------------------- reference

def reference_moe_w4a16(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * W2_e(silu(Gate_e x_t) * Up_e x_t), e = ids[t,j]; fp32 math on dequantized weights of
    the touched experts only; w13 rows are gate then up; output [M, H] in x's dtype. Not graph-capturable."""
    s = check_moe_inputs(x, w13_packed, w13_scales, w2_packed, w2_scales, topk_weights, topk_ids,
                         act_dtypes=REF_ACT_DTYPES)
    x32 = x.float()
    out = torch.zeros(s.tokens, s.hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13 = dequantize_w4a16(w13_packed[e], w13_scales[e], s.group_size)
        w2 = dequantize_w4a16(w2_packed[e], w2_scales[e], s.group_size)
        gate_up = x32[tok] @ w13.T
        act = torch.nn.functional.silu(gate_up[:, :s.inter]) * gate_up[:, s.inter:]
        out.index_add_(0, tok, (act @ w2.T) * topk_weights[tok, slot].float().unsqueeze(1))
    return out.to(x.dtype)


def _check_ids(name: str, ids) -> None:
    """Expert ids: an int32 or int64 [tokens, topk] tensor (TypeError for the dtype, ValueError for the shape)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must be [tokens, topk], got shape {tuple(ids.shape)}")


def _check_dense(x, w13, w2, topk_weights, topk_ids) -> tuple[int, int, int]:
    """moe_dense_torch's inputs -> (M, topk, E); TypeError for dtypes, ValueError for shapes and ids."""
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    _check_ids("topk_ids", topk_ids)
    if x.dim() != 2 or w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != x.shape[1]:
        raise ValueError(f"x must be [M, H] and w13 [E, 2I, H], got {tuple(x.shape)} and {tuple(w13.shape)}")
    (m, hidden), (e, two_i, _) = x.shape, w13.shape
    if tuple(w2.shape) != (e, hidden, two_i // 2):
        raise ValueError(f"w2 must be [E, H, I] = {(e, hidden, two_i // 2)}, got {tuple(w2.shape)}")
    if topk_ids.shape[0] != m or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [M, topk] with M = {m} and topk >= 1, got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    devices = {t.device for t in (x, w13, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    if m and not _capturing(topk_ids):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= e:
            raise ValueError(f"expert ids out of range: found {lo}..{hi}, valid 0..{e - 1}")
    return m, topk_ids.shape[1], e


def moe_dense_torch(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The plain-torch baseline with dense weights (w13 [E, 2I, H], w2 [E, H, I], e.g. bf16): pairs sorted by
    expert, two grouped GEMMs (torch's grouped_mm: each group streams one expert's weights; experts without tokens
    are never read), SiLU * up, weighted combine. Graph-capturable: the ids are range-checked on the host (a device
    sync) only outside capture. Falls back to gathering each pair's expert and a batched matmul where grouped_mm is
    missing or refuses the inputs."""
    m, k, e = _check_dense(x, w13, w2, topk_weights, topk_ids)
    two_i, hidden = w13.shape[1:]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat)
    xs = x[order // k].to(w13.dtype)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    try:
        if grouped is None:
            raise RuntimeError("no grouped_mm in this torch")
        gate_up = grouped(xs, w13.transpose(1, 2), offs=offs)
        act = torch.nn.functional.silu(gate_up[:, :two_i // 2]) * gate_up[:, two_i // 2:]
        y = grouped(act, w2.transpose(1, 2), offs=offs)
    except RuntimeError:
        ids = flat[order]
        gate_up = torch.bmm(xs.unsqueeze(1), w13[ids].transpose(1, 2)).squeeze(1)
        act = torch.nn.functional.silu(gate_up[:, :two_i // 2]) * gate_up[:, two_i // 2:]
        y = torch.bmm(act.unsqueeze(1), w2[ids].transpose(1, 2)).squeeze(1)
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    combined = (unsorted.view(m, k, hidden).float() * topk_weights.float().unsqueeze(-1)).sum(1)
    return combined.to(x.dtype)


# ---------------------------------------------------------------------------------------------------- routing

def _gen(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed() % (1 << 62))
    return g


def _weights(m: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(m, topk, generator=gen), dim=-1)


def route_uniform(m: int, num_experts: int, topk: int, *, seed: int | None = None, device="cpu"):
    """Each token picks `topk` distinct experts uniformly at random; weights are a softmax of random logits.
    Returns (topk_weights fp32 [m, topk], topk_ids int32 [m, topk])."""
    m, num_experts = check_int("m", m, 0), check_int("num_experts", num_experts, 1)
    topk = check_int("topk", topk, 1, num_experts)
    gen = _gen(seed)
    ids = torch.rand(m, num_experts, generator=gen).topk(topk, dim=-1).indices
    return _weights(m, topk, gen).to(device), ids.to(torch.int32).to(device)


def route_skewed(m: int, num_experts: int, topk: int, *, hot_experts: int | None = None, hot_factor: float = 50.0,
                 seed: int | None = None, device="cpu"):
    """A few hot experts: `hot_experts` (default topk) randomly placed experts are each `hot_factor` times as likely
    to be picked as any other (sampling without replacement). With the defaults at K2.5 shapes about half of all
    picks go to the hot set, so n tokens touch far fewer distinct experts than under uniform routing."""
    m, num_experts = check_int("m", m, 0), check_int("num_experts", num_experts, 1)
    topk = check_int("topk", topk, 1, num_experts)
    hot = check_int("hot_experts", topk if hot_experts is None else hot_experts, 0, num_experts)
    if not (isinstance(hot_factor, (int, float)) and math.isfinite(hot_factor) and hot_factor > 0):
        raise ValueError(f"hot_factor must be a finite number > 0, got {hot_factor!r}")
    gen = _gen(seed)
    probs = torch.ones(num_experts)
    probs[torch.randperm(num_experts, generator=gen)[:hot]] = hot_factor
    ids = torch.multinomial(probs.expand(m, num_experts), topk, replacement=False, generator=gen)
    return _weights(m, topk, gen).to(device), ids.to(torch.int32).to(device)


def load_routing_trace(path: str | Path, num_experts: int | None = None, topk: int | None = None) -> torch.Tensor:
    """A recorded trace of topk_ids, one row per token: .pt/.pth (a tensor, or a dict with 'topk_ids'), .npy,
    .json (a list of rows, or {'topk_ids': rows}) or text (.txt/.csv: one row per line, ints split by spaces or
    commas). Returns int32 [T, topk]; checks the shape and, when given, topk and the expert range."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"routing trace {path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        data = torch.load(path, map_location="cpu", weights_only=True)
    elif suffix == ".npy":
        import numpy as np

        data = torch.from_numpy(np.load(path))
    elif suffix == ".json":
        data = json.loads(path.read_text())
    else:
        data = [[int(v) for v in line.replace(",", " ").split()] for line in path.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    if isinstance(data, dict):
        data = data.get("topk_ids")
    try:
        ids = torch.as_tensor(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"routing trace {path}: not a rectangular table of expert ids ({e})") from None
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"routing trace {path}: want integer ids [tokens, topk], got {ids.dtype} {tuple(ids.shape)}")
    if topk is not None and ids.shape[1] != topk:
        raise ValueError(f"routing trace {path}: rows have {ids.shape[1]} ids, expected topk={topk}")
    if num_experts is not None and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"routing trace {path}: ids {int(ids.min())}..{int(ids.max())} outside 0..{num_experts - 1}")
    return ids.to(torch.int32)


def trace_windows(trace: torch.Tensor, m: int, count: int, *, seed: int = 0, device="cpu"):
    """`count` routings of m consecutive trace rows (windows from evenly spaced starts), each with random softmax
    weights: a list of (topk_weights, topk_ids)."""
    _check_ids("trace", trace)
    m, count = check_int("m", m, 1), check_int("count", count, 1)
    if trace.shape[0] < m:
        raise ValueError(f"routing trace has {trace.shape[0]} rows, fewer than m={m}")
    gen = _gen(seed)
    starts = torch.linspace(0, trace.shape[0] - m, count).round().long().tolist()
    return [(_weights(m, trace.shape[1], gen).to(device), trace[s:s + m].to(device)) for s in starts]


# ---------------------------------------------------------------------------------------------------- bytes

def expert_bytes_int4(hidden: int, inter: int, group_size: int = 32) -> int:
    """One expert's packed weights + bf16 scales, gate_up [2I, H] and down [H, I] (3.10 MB at K2.5 TP8)."""
    hidden, inter = check_int("hidden", hidden, 1), check_int("inter", inter, 1)
    group_size = _check_group(hidden, group_size, "hidden")  # gate_up's groups run over H, down's over I
    _check_group(inter, group_size, "inter")
    return 2 * inter * (hidden // 2 + hidden // group_size * 2) + hidden * (inter // 2 + inter // group_size * 2)


def expert_bytes_bf16(hidden: int, inter: int) -> int:
    hidden, inter = check_int("hidden", hidden, 1), check_int("inter", inter, 1)
    return 3 * inter * hidden * 2


def expected_distinct_experts(n: int, num_experts: int, topk: int) -> float:
    """E * (1 - (1 - k/E)^n): distinct experts n uniformly routed tokens touch on average (each token picks k
    distinct experts, so a given expert escapes one token with probability 1 - k/E); within [0, E] for 1 <= k <= E."""
    num_experts = check_int("num_experts", num_experts, 1)
    n, topk = check_int("n", n, 0), check_int("topk", topk, 1, num_experts)
    return num_experts * (1.0 - (1.0 - topk / num_experts) ** n)


def moe_bytes(topk_ids: torch.Tensor, hidden: int, bytes_per_expert: int, act_bytes: int = 2) -> dict:
    """Bytes one MoE layer call must move: each distinct expert in topk_ids once (never n*k), plus x read, y
    written and the routing (ids and weights, 4 bytes each)."""
    _check_ids("topk_ids", topk_ids)
    hidden, bytes_per_expert = check_int("hidden", hidden, 0), check_int("bytes_per_expert", bytes_per_expert, 0)
    act_bytes = check_int("act_bytes", act_bytes, 1)
    distinct = int(torch.unique(topk_ids).numel())
    m, k = topk_ids.shape
    activations = 2 * m * hidden * act_bytes + 2 * m * k * 4
    return {"distinct_experts": distinct, "weight_bytes": distinct * bytes_per_expert,
            "activation_bytes": activations, "bytes_moved": distinct * bytes_per_expert + activations}
