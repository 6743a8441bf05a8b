"""What the installed SGLang's own server code decides for a Kimi-K2.5 deployment from its flags: its argument parser,
its model-specific adjustments and default attention backend on a target capability, its compressed-tensors MoE scheme.

Called without a model, a GPU or a server: a stand-in model config (the checkpoint's architecture and quantization
config) and SGLang's capability checks answered for sm_<cc> (a CUDA new enough for it). Nothing is re-typed: where one
of these calls cannot be made here, the caller says so and uses ENGINES.md's reading of the release FOLLOWS names.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import types

from verifybench.harness import engines

SERVER_ARGS_MODULE = "sglang.srt.server_args"
CT_MODULE = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors"
MOE_UTILS_MODULE = "sglang.srt.layers.moe.utils"
ARCHITECTURE = "KimiK25ForConditionalGeneration"  # Kimi-K2.5's config.json architectures[0]
EXPERTS_LAYER = "model.layers.1.mlp.experts"  # a routed-expert layer (layer 0 is dense)
DUMMY_MODEL = "(none: the suite reads the flags only)"
# where SGLang's capability checks are named in server_args, answered as a CUDA GPU (not ROCm, Ascend, Apple, CPU)
PLATFORM = {"is_cuda": True, "is_hip": False, "is_npu": False, "is_mps": False, "is_cpu": False, "is_xpu": False}


def quantization_config(group_size: int = 32) -> dict:
    """The checkpoint's quantization_config as SGLang reads it (Kimi-K2.5: compressed-tensors pack-quantized, INT4
    symmetric, group 32 along K, static; attention, shared experts, dense MLPs and the LM head left in bf16)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
               "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}


def model_config() -> types.SimpleNamespace:
    """The stand-in for ServerArgs.get_model_config(): what the calls read of it (hf_config's architectures and
    quantization_config)."""
    hf = types.SimpleNamespace(architectures=[ARCHITECTURE], quantization_config=quantization_config())
    return types.SimpleNamespace(hf_config=hf)


class _Refusing(argparse.ArgumentParser):
    """SGLang's parser, raising where argparse would print usage and exit."""

    def error(self, message):
        raise ValueError(message)


@functools.lru_cache(maxsize=1)
def parser() -> argparse.ArgumentParser:
    """The installed SGLang's server parser (ServerArgs.add_cli_args)."""
    module = engines.import_kernel_module("sglang", SERVER_ARGS_MODULE)
    p = _Refusing(prog="sglang.launch_server", add_help=False)
    module.ServerArgs.add_cli_args(p)
    return p


def parse(engine_args: str):
    """A ServerArgs of `engine_args` (the server's flags, SGLang's syntax) over every field's default, built without
    its __post_init__ (which loads the model); a dummy --model-path where the parser requires one. ValueError in one
    line for a flag or value SGLang's parser refuses."""
    from verifybench.harness.engines import sglang

    try:
        tokens = shlex.split(engine_args or "")
    except ValueError as e:
        raise ValueError(f"--engine-args {engine_args!r}: {e}") from None
    p = parser()
    given = {t.split("=")[0] for t in tokens}
    dummy = [x for a in p._actions if a.required and a.dest == "model_path" and not given & set(a.option_strings)
             for x in (a.option_strings[0], DUMMY_MODEL)]
    try:
        ns = p.parse_args(dummy + tokens)
    except ValueError as e:
        raise ValueError(f"--engine-args: {engines.label('sglang')}'s server parser refuses {engine_args!r}: "
                         f"{str(e).splitlines()[0]}") from None
    args = sglang._default_server_args(engines.import_kernel_module("sglang", SERVER_ARGS_MODULE))
    for name, value in vars(ns).items():
        setattr(args, name, value)
    return args


@contextlib.contextmanager
def capability(module, cc: int):
    """Inside the block `module`'s capability checks answer for sm_<cc> on CUDA: each of SGLang's
    `_check_cuda_device_version` partials by its own list of majors, the platform checks by PLATFORM."""
    answers = {}
    for name, fn in vars(module).items():
        wrapped = getattr(fn, "__wrapped__", None)
        if isinstance(wrapped, functools.partial) and "device_capability_majors" in wrapped.keywords:
            answers[name] = (lambda hit: lambda *a, **k: hit)(cc // 10 in wrapped.keywords["device_capability_majors"])
    answers |= {name: (lambda v: lambda *a, **k: v)(v) for name, v in PLATFORM.items() if hasattr(module, name)}
    saved = {name: getattr(module, name) for name in answers}
    try:
        for name, fn in answers.items():
            setattr(module, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def attention(args, cc: int) -> tuple[str, str]:
    """(args.attention_backend after SGLang's own choice on sm_<cc>, how it was decided): the flag; else its
    model-specific adjustments for Kimi-K2.5 (on sm_100 they pick trtllm_mla, and the flashinfer_trtllm MoE runner);
    else its default for MLA (ServerArgs._get_default_attn_backend). Adjusts args as SGLang does. Where the default
    cannot be called (another release), the caller says so and uses the documented one."""
    module = engines.import_kernel_module("sglang", SERVER_ARGS_MODULE)
    given, note = args.attention_backend, ""
    config = model_config()
    args.get_model_config = lambda: config  # an instance attribute: what the adjustments read of the model
    with capability(module, cc):
        try:
            args._handle_model_specific_adjustments()
        except Exception as e:  # noqa: BLE001 (a release whose adjustments read more of the model)
            note = f" (its model-specific adjustments could not run here: {engines.one_line(e)})"
        if given is not None:
            return given, "given" + note
        if args.attention_backend is not None:
            return args.attention_backend, f"SGLang's choice for {ARCHITECTURE} on sm_{cc}" + note
        args.attention_backend = args._get_default_attn_backend(True, config)
    return args.attention_backend, f"default on sm_{cc}" + note


def moe_scheme(args) -> str:
    """The class name of SGLang's compressed-tensors MoE scheme for the checkpoint's routed experts on CUDA with
    args' --moe-runner-backend: CompressedTensorsConfig.get_moe_scheme called, each scheme's constructor left out
    (they need the serving process's distributed state): the class it would build is the answer."""
    ct = engines.import_kernel_module("sglang", CT_MODULE)
    moe = engines.import_kernel_module("sglang", MOE_UTILS_MODULE)
    import torch

    config = ct.CompressedTensorsConfig.from_config(quantization_config())
    layer = type("FusedMoE", (torch.nn.Module,), {})()  # the class name the config's "Linear" target maps to
    base = ct.CompressedTensorsMoEScheme
    schemes = {name: (lambda name: lambda *a, **k: name)(name) for name, c in vars(ct).items()
               if isinstance(c, type) and issubclass(c, base) and c is not base}
    saved = {name: getattr(ct, name) for name in (*schemes, "_is_hip", "_is_npu")}, moe.MOE_RUNNER_BACKEND
    try:
        for name, picked in {**schemes, "_is_hip": False, "_is_npu": False}.items():
            setattr(ct, name, picked)
        moe.MOE_RUNNER_BACKEND = moe.MoeRunnerBackend(args.moe_runner_backend)
        return config.get_moe_scheme(layer, EXPERTS_LAYER)
    finally:
        for name, value in saved[0].items():
            setattr(ct, name, value)
        moe.MOE_RUNNER_BACKEND = saved[1]
