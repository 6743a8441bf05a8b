"""Every kernel the suite times for a part of the forward, ours and the engines', declared once as data: its part, the
component whose rows time it, where it runs, what it stands for, and its setup and call (module and function names,
imported only when the row runs). The components list their engine rows from here; the stand-ins table pairs them.

A new engine row is a declaration here, its adapter's functions, and nothing else in the component
(docs/adding-an-engine-row.md).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util

PARTS = ("verify_attention", "decode_attention", "moe")
# the params key naming a row in each component's records (stand_ins.py pairs rows by it)
ROW_KEY = {"mla_verify": "variant", "mla_decode": "impl", "moe_int4": "impl"}
SM120 = 120  # the users' RTX PRO 6000: "@sm120" rows run the tiles SGLang picks there, on this GPU
ANY_CUDA = "any CUDA GPU (compiled for it by Triton)"


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str             # "sglang.extend@sm120"; ours are "ours.<kernel>"
    engine: str | None    # whose kernel it is ("sglang", "flashinfer"); None: ours
    part: str             # one of PARTS
    component: str        # the component whose rows time it
    row: str              # its row there (the variant / impl the records name)
    module: str           # where setup and call live (imported when the row runs)
    call: str             # the function building the timed call
    setup: str | None     # the function giving (config, where it comes from); None: the component's own
    runs_on: str          # the GPUs it runs on, in words
    interpreter: bool     # runs on CPU in the Triton interpreter (CUDA otherwise)
    what: str             # what it is
    stand_in: str | None = None    # an engine's: which of ours stands in for it in the suite's forward
    tiles_cc: int | None = None    # runs with the tiles the engine picks on sm_<cc> (None: this GPU's)
    chains_only: str | None = None  # why tree masks are skipped (None: it takes any tree)

    def enabled(self, device: str | None = None) -> tuple[bool, str]:
        """(whether its rows can run here, the one-line reason): the engine installed, its adapter and functions
        present (a backend declared before its adapter exists says so), and a GPU where it needs one."""
        from verifybench.harness import engines
        from verifybench.kernels.common import interpret

        if self.engine is not None and engines.version(self.engine) is None \
                and importlib.util.find_spec(self.engine) is None:
            return False, f"{self.engine} is not installed (pip show {engines.DISTRIBUTIONS[self.engine]}: not found)"
        try:
            module = importlib.import_module(self.module)
        except ModuleNotFoundError as e:
            if e.name and self.module.startswith(e.name):
                return False, f"{self.name}: its adapter {self.module} is not on this branch"
            raise
        lacking = [f for f in (self.call, self.setup) if f and not hasattr(module, f)]
        if lacking:
            return False, f"{self.name}: {self.module} has no {', '.join(lacking)}"
        device = device or _device()
        if device != "cuda" and not self.interpreter:
            return False, f"{self.name} needs a CUDA GPU ({self.runs_on})"
        if device != "cuda" and not interpret.active():
            return False, "the Triton kernels need a GPU, or TRITON_INTERPRET=1 set before import on CPU"
        return True, engines.label(self.engine) if self.engine else "ours"

    def function(self, which: str = "call"):
        """Its setup or call function, imported now."""
        return getattr(importlib.import_module(self.module), getattr(self, which))


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


ENGINES_CALLS = "verifybench.harness.engines.calls"
CHAINS_ONLY = "FlashInfer MLA ignores the tree mask (SGLang runs it for topk 1 only); it is timed on chains"

DECLARED = (
    # ours: the suite's kernels, what its forward runs
    Backend("ours.extend", None, "verify_attention", "mla_verify", "extend", "verifybench.kernels.mla_verify.api",
            "mla_verify", None, ANY_CUDA, True, "our serial extend with SGLang's tiles for this GPU: the engine's "
            "Triton verify kernel as the suite models it"),
    Backend("ours.split_kv", None, "verify_attention", "mla_verify", "split_kv", "verifybench.kernels.mla_verify.api",
            "mla_verify", None, ANY_CUDA, True,
            "our split-KV verify: what a flash kernel over splits of the KV reaches (FA3, FlashMLA, TRT-LLM MLA)"),
    Backend("ours.extend@sm120", None, "verify_attention", "mla_verify", "extend@sm120",
            "verifybench.kernels.mla_verify.api", "mla_verify", None, ANY_CUDA, True,
            "our serial extend with the tiles SGLang picks on sm_120", tiles_cc=SM120),
    Backend("ours.decode", None, "decode_attention", "mla_decode", "triton", "verifybench.kernels.mla_decode.api",
            "mla_decode", None, ANY_CUDA, True, "our split-KV flash decoding (the tuned table's config)"),
    Backend("ours.moe", None, "moe", "moe_int4", "triton", "verifybench.kernels.moe_int4.api", "fused_moe_w4a16",
            None, ANY_CUDA, True, "our INT4 W4A16 MoE"),
    # the engines' own kernels, timed beside ours
    Backend("sglang.extend", "sglang", "verify_attention", "mla_verify", "sglang.extend", ENGINES_CALLS,
            "sglang_verify", "sglang_verify_config", ANY_CUDA, True,
            "SGLang's Triton extend kernel as --attention-backend triton runs target verify (its tiles for this GPU)",
            stand_in="ours.extend"),
    Backend("sglang.extend@sm120", "sglang", "verify_attention", "mla_verify", "sglang.extend@sm120", ENGINES_CALLS,
            "sglang_verify", "sglang_verify_config", ANY_CUDA, True,
            "SGLang's Triton extend kernel with the tiles it picks on sm_120, compiled for this GPU",
            stand_in="ours.extend@sm120", tiles_cc=SM120),
    Backend("flashinfer.mla", "flashinfer", "verify_attention", "mla_verify", "flashinfer.mla", ENGINES_CALLS,
            "flashinfer_verify", "flashinfer_verify_config", "CUDA GPUs nvcc builds FlashInfer's fa2 MLA for "
            "(sm_80 and later)", False, "FlashInfer's MLA as --attention-backend flashinfer runs target verify "
            "(its plan() timed on the host)", chains_only=CHAINS_ONLY),
    Backend("sglang.decode", "sglang", "decode_attention", "mla_decode", "sglang.decode", ENGINES_CALLS,
            "sglang_decode", None, ANY_CUDA, True, "SGLang's Triton split-KV decode as --attention-backend triton "
            "runs decode and the draft steps", stand_in="ours.decode"),
    Backend("flashinfer.decode", "flashinfer", "decode_attention", "mla_decode", "flashinfer.decode", ENGINES_CALLS,
            "flashinfer_decode", None, "CUDA GPUs nvcc builds FlashInfer's fa2 MLA for (sm_80 and later)", False,
            "FlashInfer's MLA decode as --attention-backend flashinfer plans it", stand_in="ours.decode"),
    Backend("sglang.triton", "sglang", "moe", "moe_int4", "sglang.triton", "verifybench.harness.engines.sglang",
            "moe_w4a16", "moe_w4a16_config", ANY_CUDA, True, "SGLang's Triton W4A16 MoE (its compressed-tensors "
            "method on ROCm; not what CUDA runs)", stand_in="ours.moe"),
    Backend("sglang.marlin", "sglang", "moe", "moe_int4", "sglang.marlin", "verifybench.harness.engines.marlin",
            "moe_marlin", "marlin_layer", "CUDA GPUs (SGLang's JIT Marlin kernels build with nvcc)", False,
            "SGLang's Marlin W4A16 MoE: what it serves compressed-tensors INT4 experts with on CUDA",
            stand_in="ours.moe"),
)
BY_NAME = {b.name: b for b in DECLARED}

# the engines' attention backends no machine of ours runs: (why, which of ours stands in for verify, for decode)
NOT_HERE = {
    "fa3": ("FA3 is sgl-kernel's compiled FlashAttention-3 (Hopper only; not carried here, no sm_120 build)",
            "ours.split_kv", "ours.decode"),
    "fa4": ("FA4 is a compiled FlashAttention-4 build (Blackwell; not carried here)", "ours.split_kv", "ours.decode"),
    "flashmla": ("FlashMLA is sgl-kernel's compiled kernel (not carried here; none for sm_120)", "ours.split_kv",
                 "ours.decode"),
    "trtllm_mla": ("TRT-LLM MLA is FlashInfer's TllmGen kernel for SM100/103 only", "ours.split_kv", "ours.decode"),
    "cutlass_mla": ("Cutlass MLA is a compiled kernel for sm_100 (it does not build for sm_120)", "ours.split_kv",
                    "ours.decode"),
}


def get(name: str) -> Backend:
    """The declared backend `name`; ValueError naming the known ones for anything else."""
    if name not in BY_NAME:
        raise ValueError(f"unknown backend {name!r}; declared: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def of(component: str, engines_only: bool = False, tiles_cc: int | None | str = "any") -> tuple[Backend, ...]:
    """The backends whose rows `component` times, in declaration order (ours first); engines_only: the engines';
    tiles_cc: only those of that tile capability (None: this GPU's)."""
    return tuple(b for b in DECLARED if b.component == component and (b.engine or not engines_only)
                 and (tiles_cc == "any" or b.tiles_cc == tiles_cc))


def for_row(component: str, row: str) -> Backend | None:
    """The backend behind a component's row (None: a row of ours with no declaration, as a torch path)."""
    return next((b for b in DECLARED if b.component == component and b.row == row), None)


def stand_in_pairs() -> dict[str, tuple[str, tuple[tuple[str, str], ...]]]:
    """component: (its row key, ((our row, the engine's row it stands in for), ...)), for the stand-ins table."""
    out: dict[str, list] = {}
    for b in DECLARED:
        if b.engine and b.stand_in:
            out.setdefault(b.component, []).append((get(b.stand_in).row, b.row))
    return {c: (ROW_KEY[c], tuple(pairs)) for c, pairs in out.items()}
