"""A stand-in for sgl-kernel (SGLang's CUDA extension, a large GPU-only wheel), put on the path only where the real
one cannot be imported: CI's CPU and a GPU session that does not carry it. Importing SGLang's fused-MoE Triton
module runs its serving stack's imports, and those take names from sgl_kernel at import time (the host KV-cache
copies, on CUDA also the activation, alignment and attention ops). The MoE adapter calls only SGLang's Triton
kernels and its config lookup, never an sgl_kernel op: every name here is a function that raises when called, so a
path that did reach one fails loudly instead of computing anything.

Its own folder (not beside the torchvision stand-in): a GPU session whose real torchvision loads adds this one
alone."""
import sys
import types


def _standin(name: str):
    def missing(*args, **kwargs):
        raise RuntimeError(f"tests/engine_stubs: sgl_kernel is a stand-in here; {name} is not available")

    missing.__name__ = name
    return missing


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _standin(name)


# the submodules SGLang imports names from at module level; not scalar_type, whose absence SGLang's quantization
# utilities catch (ImportError) and replace with their own placeholders
for _sub in ("elementwise", "flash_attn", "flash_mla", "kvcacheio", "mamba", "quantization", "sparse_flash_attn",
             "speculative"):
    _module = types.ModuleType(f"{__name__}.{_sub}", "tests/engine_stubs: a stand-in sgl_kernel submodule")
    _module.__getattr__ = __getattr__
    sys.modules[_module.__name__] = _module
    setattr(sys.modules[__name__], _sub, _module)

# On CUDA, SGLang's MoE top-k module registers a fake (meta) implementation of sgl-kernel's fused gate at import time,
# which needs the operator to exist: it is declared here with no implementation, so a call still fails loudly
import torch  # noqa: E402

_LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")
_LIBRARY.define("moe_fused_gate(Tensor input, Tensor bias, int num_expert_group, int topk_group, int topk, "
                "int num_fused_shared_experts=0, float routed_scaling_factor=0, "
                "bool apply_routed_scaling_factor_on_output=False) -> Tensor[]")
