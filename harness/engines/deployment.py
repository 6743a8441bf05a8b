"""The engine as deployed: the installed engine, its version and its server flags (in the engine's own syntax), and
what each part of the forward runs for that deployment. One value, read by verify, cycle, run, plan and advise.

resolve() reads the flags with the installed engine's own parser and asks its own code what they pick on the target
GPU (harness/engines/sglang_server.py); add_arguments() is the one declaration of --engine / --engine-args /
--deploy-cc every command takes. Kernel names are harness/engines/backends.py's.
"""
from __future__ import annotations

import dataclasses
import functools
import shlex

DEFAULT_CC = 120  # the users' RTX PRO 6000 (sm_120)
ENGINES = ("sglang", "vllm")  # --engine's choices; vllm: the syntax of its settings only (advise), no dispatch
DISPATCHED = ("sglang",)
DEFAULT_TOPK = 1  # the checkpoint's EAGLE-3 draft: a chain unless --speculative-eagle-topk says otherwise
TOPK_ABOVE_1 = ("triton", "fa3")  # SGLang's MLA backends that take topk > 1 (its docs' MLA table)
# what each of SGLang's attention backends is in the suite: (decode attention, verify attention)
ATTENTION = {"triton": ("sglang.decode", "sglang.extend"), "flashinfer": ("flashinfer.decode", "flashinfer.mla")}
# SGLang's compressed-tensors MoE schemes for the checkpoint: (the suite's backend, the method's name)
MOE_SCHEMES = {"CompressedTensorsWNA16MoE": ("sglang.marlin", "Marlin"),
               "CompressedTensorsWNA16TritonMoE": ("sglang.triton", "Triton"),
               "CompressedTensorsMxInt4MoE": ("ours.moe", "FlashInfer TRT-LLM MxInt4")}
MXINT4_NOT_HERE = "FlashInfer's TRT-LLM MxInt4 MoE runs on SM100/103 only (and is not carried here)"
# ENGINES.md §2-3's reading of sglang 0.5.10.post1, used only where its own functions cannot be called here
DOCUMENTED_ATTENTION = {9: "fa3", 10: "flashinfer"}  # capability major -> default for MLA; else triton
REST = ("rest", "torch as in the suite", "norms, projections, router, shared expert, LM head: the suite's forward")


@dataclasses.dataclass(frozen=True)
class Deployment:
    """What each part of the forward runs. Kernel names are backend names of harness/engines/backends (an engine's
    "sglang.decode", "flashinfer.mla", "sglang.marlin", ...) or ours ("ours.split_kv", "ours.extend",
    "ours.decode", "ours.moe")."""
    engine: str | None                  # "sglang", or None: the suite's own kernels
    version: str | None                 # the installed engine's version
    engine_args: tuple[str, ...] = ()   # the server flags as given (the engine's syntax)
    attention_backend: str = "ours"     # the engine's name for it: "triton", "flashinfer", ...
    decode_attention: str = "ours.decode"   # plain decode and the draft steps (same backend)
    verify_attention: str = "ours.split_kv"  # target verify (tree-masked)
    extend_tiles_cc: int | None = None  # the capability whose tiles the engine's extend uses (None: this GPU's)
    kv_splits: int | None = None        # the decode kernel's KV-split cap (--triton-attention-num-kv-splits)
    moe: str = "ours.moe"               # the routed experts
    rows: tuple[tuple[str, str, str], ...] = ()  # (part, kernel, how it was decided / why a stand-in) per part
    cc: int = DEFAULT_CC                # the target GPU's capability the choices were made for
    attention_how: str = ""             # how attention_backend was decided ("given", "default on sm_120")
    moe_method: str = ""                # the engine's name for its MoE method ("Marlin")
    draft: tuple[int, int, int] | None = None  # (spec_steps, topk, D) where the flags give it

    def line(self) -> str:
        """One line naming it, as the report, verify, cycle and advise open with it."""
        if self.engine is None:
            return "the suite's kernels (no engine given): split-KV verify and decode, our INT4 MoE"
        if self.engine not in DISPATCHED:
            return (f"{self.engine} {self.version or '(not installed)'}: the syntax of its settings only, no "
                    "dispatch: the suite's kernels (split-KV verify and decode, our INT4 MoE)")
        how = f" ({self.attention_how})" if self.attention_how else ""
        moe = f"{self.moe_method} ({self.moe})" if self.moe_method else self.moe
        return (f"the engine as deployed: {self.engine} {self.version or '(version unknown)'}, attention "
                f"{self.attention_backend}{how}, decode kv splits {self.kv_splits}, MoE {moe}")

    def with_args(self, extra: str) -> "Deployment":
        """The same deployment with more flags (a lever's A/B: one flag changed)."""
        return resolve(self.engine, " ".join([shlex.join(self.engine_args), extra]).strip(), self.cc)


def check_cc(cc) -> int:
    """A compute capability as major * 10 + minor (90, 100, 120); ValueError in one line otherwise."""
    if isinstance(cc, bool) or not isinstance(cc, int) or not 70 <= cc <= 129:
        raise ValueError(f"--deploy-cc takes a compute capability as major*10+minor (90, 100, 120), got {cc!r}")
    return cc


def cc_arg(text: str) -> int:
    """--deploy-cc's type: '120' or 'sm_120'."""
    try:
        return check_cc(int(text.removeprefix("sm_")))
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"takes a compute capability as 90, 100 or 120 (sm_120), got {text!r}")


def resolve(engine: str | None, engine_args: str | None = None, cc: int | None = None) -> Deployment:
    """The deployment `engine` with `engine_args` on a GPU of capability `cc` (None: the users' sm_120 card).
    ValueError in one line for flags the engine refuses, a combination it refuses, or an engine not installed."""
    from verifybench.harness import engines

    cc = DEFAULT_CC if cc is None else check_cc(cc)
    if engine is None:
        if engine_args:
            raise ValueError("--engine-args needs --engine (whose server flags they are)")
        return Deployment(None, None, cc=cc)
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: choose from {', '.join(ENGINES)}")
    args = tuple(shlex.split(engine_args or ""))
    if engine not in DISPATCHED:
        return Deployment(engine, engines.version(engine), args, cc=cc, rows=(
            ("all", "ours", f"{engine}: the syntax of its settings only; the suite does not dispatch its kernels"),))
    if engines.version(engine) is None:
        raise ValueError(f"--engine {engine}: {engine} is not installed here (pip show "
                         f"{engines.DISTRIBUTIONS[engine]}: not found); its flags and dispatch are read from it")
    try:
        return _sglang(args, cc)
    except engines.EngineMissing as e:
        raise ValueError(f"--engine {engine}: {e}") from None


@functools.lru_cache(maxsize=64)  # a lever's A/B resolves the same flags again; the engine's code is slow to ask
def _sglang(args: tuple[str, ...], cc: int) -> Deployment:
    from verifybench.harness import engines
    from verifybench.harness.engines import backends, sglang_server

    server = sglang_server.parse(shlex.join(args))
    rows = []
    try:
        backend, how = sglang_server.attention(server, cc)
    except Exception as e:  # noqa: BLE001 (another release: its default picker takes other arguments)
        backend = DOCUMENTED_ATTENTION.get(cc // 10, "triton")
        how = (f"default on sm_{cc} as ENGINES.md documents {engines.label('sglang')}'s "
               f"_get_default_attn_backend (it could not be called here: {engines.one_line(e)})")
        server.attention_backend = backend
    prefill, decode = server.get_attention_backends()
    verify = decode if server.speculative_attention_mode == "decode" else prefill
    topk = server.speculative_eagle_topk or DEFAULT_TOPK
    for name in {verify, decode} - set(TOPK_ABOVE_1):
        if topk > 1:
            raise ValueError(f"--engine-args: --attention-backend {name} with --speculative-eagle-topk {topk}: "
                             f"SGLang refuses it ({name} MLA only supports topk=1 for speculative decoding)")
    own = {"decode": "--decode-attention-backend", "prefill": "--prefill-attention-backend"}
    verify_flag = own["decode" if server.speculative_attention_mode == "decode" else "prefill"]
    named = {"decode attention": (decode, 0, own["decode"]), "verify attention": (verify, 1, verify_flag)}
    picked, overridden = {}, ""
    for part, (name, which, flag) in named.items():
        decided = f"--attention-backend {name}: {how}"
        if getattr(server, flag[2:].replace("-", "_")) is not None:  # the part's own flag overrides it
            decided = f"{flag} {name} (given)"
            overridden += f"; {part.split()[0]} {name} ({flag})"
        if name in ATTENTION:
            picked[part] = ATTENTION[name][which]
            tiles = f"; its extend with the tiles SGLang picks on sm_{cc}" if picked[part] == "sglang.extend" else ""
            rows.append((part, picked[part], decided + tiles))
        else:
            why, verify_in, decode_in = backends.NOT_HERE.get(name, (f"{name} is not a backend the suite runs",
                                                                     "ours.split_kv", "ours.decode"))
            picked[part] = verify_in if which else decode_in
            rows.append((part, picked[part], f"{decided}; {why}: our stand-in"))
    moe, method, moe_how = _moe(server)
    rows.append(("MoE", moe, moe_how))
    splits = server.triton_attention_num_kv_splits
    given = "given" if any(a.split("=")[0] == "--triton-attention-num-kv-splits" for a in args) \
        else "SGLang's default"
    rows.append(("kv splits", str(splits), f"--triton-attention-num-kv-splits ({given})"
                 + ("" if decode == "triton" else f"; unused by {decode}")))
    draft = _draft(server, rows)
    rows.append(REST)
    return Deployment("sglang", engines.version("sglang"), args, backend, picked["decode attention"],
                      picked["verify attention"], cc if picked["verify attention"] == "sglang.extend" else None,
                      splits, moe, tuple(rows), cc, how + overridden, method, draft)


def _moe(server) -> tuple[str, str, str]:
    """(the suite's backend, the engine's method name, how decided) of the routed experts."""
    from verifybench.harness import engines
    from verifybench.harness.engines import sglang_server

    runner = f"--moe-runner-backend {server.moe_runner_backend}"
    try:
        scheme = sglang_server.moe_scheme(server)
        how = f"CompressedTensorsConfig.get_moe_scheme -> {scheme} (INT4 group 32 symmetric, CUDA, {runner})"
    except Exception as e:  # noqa: BLE001 (its quantization modules need the serving stack's imports)
        scheme = "CompressedTensorsMxInt4MoE" if server.moe_runner_backend == "flashinfer_trtllm" \
            else "CompressedTensorsWNA16MoE"
        how = (f"{scheme} as ENGINES.md §3 reads get_moe_scheme for CUDA with {runner} (it could not be called "
               f"here: {engines.one_line(e)})")
    if scheme not in MOE_SCHEMES:
        raise ValueError(f"--engine-args: SGLang picks {scheme} for the INT4 experts; the suite has no row for it")
    name, method = MOE_SCHEMES[scheme]
    if name == "ours.moe":
        how += f"; {MXINT4_NOT_HERE}: our stand-in"
    return name, method, how


def _draft(server, rows: list) -> tuple[int, int, int] | None:
    """(spec_steps, topk, D) where the flags give the steps; with topk 1, D = steps + 1 as SGLang adjusts it."""
    steps, topk, d = server.speculative_num_steps, server.speculative_eagle_topk, server.speculative_num_draft_tokens
    if steps is None:
        return None
    topk = topk or DEFAULT_TOPK
    adjusted = d is not None and topk == 1 and d != steps + 1
    d = steps + 1 if topk == 1 or d is None else d
    rows.append(("draft", f"steps {steps}, topk {topk}, D {d}", "--speculative-num-steps/-eagle-topk/-num-draft-"
                 "tokens" + ("; D = steps + 1 with topk 1, as SGLang adjusts it" if adjusted else "")))
    return steps, topk, d


def add_arguments(parser) -> None:
    """--engine, --engine-args and --deploy-cc: the one declaration every command takes (from_namespace reads it)."""
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="the engine as deployed: sglang (its kernels stand for each part, read from the "
                             "installed SGLang; on CUDA its Marlin MoE's JIT kernels build with nvcc on first use, "
                             "several minutes); vllm: the syntax of its settings only, no dispatch")
    parser.add_argument("--engine-args", metavar='"FLAGS"', default=None,
                        help='the server\'s flags in the engine\'s own syntax, parsed by its own parser, e.g. '
                             '"--attention-backend flashinfer" (one flag alone: --engine-args=--flag)')
    parser.add_argument("--deploy-cc", type=cc_arg, default=None, metavar="CC",
                        help=f"the GPU capability the deployment runs on (default {DEFAULT_CC}: the RTX PRO 6000)")


def from_namespace(ns) -> Deployment:
    """The deployment a command's parsed options name (add_arguments'); ValueError in one line where it cannot."""
    return resolve(getattr(ns, "engine", None), getattr(ns, "engine_args", None), getattr(ns, "deploy_cc", None))
