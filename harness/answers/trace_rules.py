"""Kernel-name rules of `verifybench trace`: an ordered table of regular expressions that names the component each
GPU kernel of a profiler trace belongs to, and the map from the suite's verify components onto those components.

The first rule whose pattern is found in the kernel name (re.search, case-insensitive) wins; a name no rule matches
is "other". User rules (a JSON list of [regex, component]) go before the defaults, so they extend and override them.
Copies and fills (gpu_memcpy / gpu_memset events) are "memcpy" by their category, whatever their name.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

# display order; user rules may add names of their own, shown after these
COMPONENTS = ("allreduce", "attention", "projections", "moe", "router", "misc", "tree_sampling", "memcpy", "other")
# the decomposition's own accounts, beside the components: a rule naming one would hide its kernels' time
ACCOUNTS = ("gpu_idle", "overlap", "total")
COMPONENT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.+-]*$")

DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    # communication: every NCCL collective (the logits all-gather too), the custom one/two-shot allreduce kernels
    (r"nccl(Dev)?Kernel", "allreduce"),
    (r"cross_device_reduce_[12]stage", "allreduce"),
    (r"all_?reduce|all_?gather|reduce_?scatter", "allreduce"),
    # torch.cuda._sleep: the suite's one-GPU allreduce stand-in (the timing engine's launch pad is one too)
    (r"\bspin_kernel\b", "allreduce"),
    # the suite's own Triton kernels, by exact name (some are generic words that must not catch other code)
    (r"^_(dot|fma|reduce)_kernel$|^_serial_reduce$", "projections"),
    (r"^_(q_absorb|v_up)_kernel$", "projections"),  # the kv_b absorption GEMMs: the suite counts them in attn_proj
    (r"^_(gate_up|down)(_split)?_kernel$", "moe"),
    (r"^_(split|combine|extend)_kernel$", "attention"),  # kernels/mla_decode/, kernels/mla_verify/
    (r"^_(rmsnorm|mla_prep)_kernel$", "misc"),
    (r"^_softmax_topk_kernel$", "router"),
    (r"^_(organize|build_tree|verify|assign|argmax)_kernel$", "tree_sampling"),
    # MoE routing: the gate / top-k over experts
    (r"moe_fused_gate|grouped_topk|topk_softmax|topk_sigmoid|topkGating|moeSoftmax|moeTopK", "router"),
    # routed experts: GEMMs (Marlin, wna16, Triton fused_moe) and their sort / align / sum helpers
    (r"moe|marlin|count_and_sort_expert", "moe"),
    # norms, activations, rotary embedding
    (r"rms_?norm|layer_?norm|(silu|gelu|gelu_tanh|act)_and_mul|rotary|(^|_)rope(_|$)", "misc"),
    # attention: FlashInfer (MLA and paged), FlashAttention, FlashMLA, Triton decode / extend / split-KV verify
    (r"BatchMLAPaged|Batch(Decode|Prefill)With|Single(Decode|Prefill)With|flash_?fwd|flash_?mla|fmha|sdpa|"
     r"flash_?fprop|efficient_attention", "attention"),  # ... and torch's scaled_dot_product_attention (cuDNN, mem-eff)
    (r"^_fwd_(grouped_)?kernel|_verify_prefix_stage|_verify_combine_stage|merge_?state|mla|attention", "attention"),
    # draft tree, greedy verify, sampling, argmax, softmax / top-k / sort of the draft and verify steps
    (r"build_tree|verify_?tree|tree_?speculative|argmax|sampl|renorm|softmax|topk|sort", "tree_sampling"),
    (r"assign_(req_to_token|draft_cache)|create_extend_after_decode", "tree_sampling"),
    # dense GEMMs: cuBLAS / cuBLASLt (ampere_*gemm, sm90_xmma, nvjet, gemv, splitKreduce), CUTLASS, Triton matmul
    (r"gemm|gemv|cutlass|xmma|nvjet|cublas|wmma|splitKreduce|matmul|(^|_)b?mm(_|$)", "projections"),
)

# suite component(s) of bench_verify.py -> trace component(s), one row each in the side-by-side. GEMMs cannot be
# told apart by kernel name (q/kv, o_proj, shared expert, router GEMM and lm_head all run the same tiles), so the
# suite's attn_proj, dense, router and head sit in one row against the trace's projections + router + tree/sampling.
SUITE_MAP: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("allreduce", ("allreduce",), ("allreduce",)),
    ("attention core", ("attn_core",), ("attention",)),
    ("routed experts", ("moe",), ("moe",)),
    ("GEMMs + router + head", ("attn_proj", "dense", "router", "head"), ("projections", "router", "tree_sampling")),
    ("norms, activations", ("misc",), ("misc",)),
)


class RulesError(ValueError):
    """A --rules file that cannot be read or holds a bad rule."""


def load_rules(path: Path | str) -> list[tuple[str, str]]:
    """The [regex, component] pairs of a --rules file, validated (each regex compiles, each component is a name)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RulesError(f"{path}: no such rules file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RulesError(f"{path}: cannot read the rules file: {e}") from None
    except json.JSONDecodeError as e:
        raise RulesError(f"{path}: rules file is not JSON: {e}") from None
    return check_rules(data, str(path))


def check_rules(data, where: str = "rules") -> list[tuple[str, str]]:
    if not isinstance(data, list):
        raise RulesError(f'{where}: expected a JSON list of [regex, component] pairs, e.g. [["my_gemm", '
                         f'"projections"]], got a {type(data).__name__}')
    rules = []
    for i, rule in enumerate(data):
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            raise RulesError(f"{where}: rule {i} is {rule!r}; each rule is a [regex, component] pair of strings")
        pattern, component = rule
        try:
            re.compile(pattern)
        except re.error as e:
            raise RulesError(f"{where}: rule {i}: bad regex {pattern!r}: {e}") from None
        if not COMPONENT_NAME.match(component):
            raise RulesError(f"{where}: rule {i}: component {component!r} is not a name (letters, digits, _ . + -)")
        if component in ACCOUNTS:
            raise RulesError(f"{where}: rule {i}: component {component!r} is reserved (the report's "
                             f"{', '.join(ACCOUNTS)} rows); name it otherwise")
        rules.append((pattern, component))
    return rules


class Classifier:
    """Kernel name -> component by the first matching rule; names are few and repeat, so answers are cached."""

    def __init__(self, user_rules: list[tuple[str, str]] | None = None):
        self.user_rules = list(user_rules or [])
        self._rules = [(re.compile(p, re.IGNORECASE), c) for p, c in [*self.user_rules, *DEFAULT_RULES]]
        self._cache: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        comp = self._cache.get(name)
        if comp is None:
            comp = next((c for rx, c in self._rules if rx.search(name)), "other")
            self._cache[name] = comp
        return comp

    def components(self) -> list[str]:
        """Every component a rule can give, in display order (defaults first, then the user's own names)."""
        extra = [c for _, c in self.user_rules if c not in COMPONENTS]
        return [*COMPONENTS, *dict.fromkeys(extra)]
