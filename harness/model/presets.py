"""Model presets and their per-rank shapes under tensor parallelism: the one shape type of the suite.

TP divides heads, the routed-expert and dense intermediates and the vocab; the fused q_a/kv_a projection and the
router stay replicated.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# tokens already in the KV cache when a command is given no --context: on a GPU, and in the CPU smoke profile
CONTEXT, CPU_CONTEXT = 4096, 64


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    layers: int
    dense_layers: int  # the first layers use a dense MLP instead of MoE
    experts: int
    topk: int
    shared_experts: int
    expert_intermediate: int  # per expert, whole model (divided by TP per rank)
    dense_intermediate: int
    heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    vocab: int
    expert_group_size: int = 32  # INT4 group along K
    tp: int = 1

    def per_rank(self, tp: int) -> "Preset":
        """The shapes one of `tp` ranks holds; raises if a divided dimension does not divide."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if self.tp != 1:
            raise ValueError("per_rank() applies to a whole-model preset")
        divided = {"heads": self.heads, "expert_intermediate": self.expert_intermediate,
                   "dense_intermediate": self.dense_intermediate, "vocab": self.vocab}
        bad = [f"{k}={v}" for k, v in divided.items() if v % tp]
        if bad:
            raise ValueError(f"preset {self.name}: TP {tp} does not divide {', '.join(bad)}")
        return replace(self, tp=tp, **{k: v // tp for k, v in divided.items()})

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def latent(self) -> int:
        """Values cached per token and layer: the compressed KV latent and the shared rope key."""
        return self.kv_lora + self.qk_rope

    def with_layers(self, layers: int | None) -> "Preset":
        """The same shapes with `layers` layers (None: unchanged); at least the dense layers plus one MoE layer."""
        if layers is None:
            return self
        if layers < self.dense_layers + 1:
            raise ValueError(f"layers must be >= {self.dense_layers + 1} for preset {self.name} "
                             f"({self.dense_layers} dense + at least one MoE layer), got {layers}")
        return replace(self, layers=layers)

    def projections(self) -> tuple[tuple[str, int, int], ...]:
        """(name, in, out) of each bf16 projection of one MoE layer in forward order (the routed INT4 experts are
        their own component): fused q_a/kv_a (replicated), q_b, kv_b (absorbed), o_proj, router (replicated), the
        shared expert's gate_up and down."""
        qk = self.qk_nope + self.qk_rope
        return (("q_a_kv_a", self.hidden, self.q_lora + self.latent),
                ("q_b", self.q_lora, self.heads * qk),
                ("kv_b", self.kv_lora, self.heads * (self.qk_nope + self.v_head)),
                ("o_proj", self.heads * self.v_head, self.hidden),
                ("router", self.hidden, self.experts),
                ("shared_gate_up", self.hidden, 2 * self.expert_intermediate),
                ("shared_down", self.expert_intermediate, self.hidden))

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "kimi-k2.5": Preset("kimi-k2.5", hidden=7168, layers=61, dense_layers=1, experts=384, topk=8, shared_experts=1,
                        expert_intermediate=2048, dense_intermediate=18432, heads=64, q_lora=1536, kv_lora=512,
                        qk_nope=128, qk_rope=64, v_head=128, vocab=163840),
    "deepseek-v3": Preset("deepseek-v3", hidden=7168, layers=61, dense_layers=3, experts=256, topk=8,
                          shared_experts=1, expert_intermediate=2048, dense_intermediate=18432, heads=128,
                          q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128, vocab=129280),
    # CPU tests and the smoke run: every dimension small, every structural feature kept.
    "tiny": Preset("tiny", hidden=256, layers=3, dense_layers=1, experts=16, topk=2, shared_experts=1,
                   expert_intermediate=128, dense_intermediate=512, heads=4, q_lora=64, kv_lora=32, qk_nope=16,
                   qk_rope=8, v_head=16, vocab=1024),
}


def get(name: str, tp: int = 1, layers: int | None = None) -> Preset:
    """The per-rank preset `name` at TP degree `tp` (and `layers` layers, None: all)."""
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise ValueError(f"tp must be an integer, got {tp!r}")
    try:
        preset = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return preset.per_rank(tp).with_layers(layers)


def default_scope(gpu: bool) -> tuple[str, int, int]:
    """(preset, tp, context) when none is given: the deployment's model on a GPU; the tiny preset at TP 1 and a
    64-token context on a CPU (the smoke profile: it checks the plumbing, its numbers are CPU numbers)."""
    return ("kimi-k2.5", 8, CONTEXT) if gpu else ("tiny", 1, CPU_CONTEXT)
