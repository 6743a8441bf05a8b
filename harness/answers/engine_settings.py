"""Where each lever lives in SGLang and vLLM, with its caveats: the facts `advise` prints, one table.
docs/engine-settings.md says the same in prose; check both against the engine version deployed."""
from __future__ import annotations

# lever -> {"sglang": ..., "vllm": ..., "caveat": ... (one text, or one per engine)}; "{...}" fields are filled
# from the measurement
SETTINGS: dict[str, dict[str, str]] = {
    "attention": {
        "sglang": "no NVIDIA split-KV MLA verify in SGLang's Triton backend (its verify_splitkv / verify_mla paths "
                  "are gated to AMD gfx95); --attention-backend flashinfer runs FlashInfer MLA, which splits the KV",
        "vllm": "the MLA backend is chosen by platform (VLLM_ATTENTION_BACKEND in older releases)",
        "caveat": "FlashInfer MLA ignores the tree mask and supports topk 1 only; on sm_120 trtllm_mla, cutlass_mla "
                  "and FlashMLA do not run",
    },
    "allreduce": {
        "sglang": "the server's environment: {env}; on PCIe TP8 also try SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1",
        "vllm": "the same NCCL_* variables in the server's environment",
        "caveat": "a container restart loses environment variables (the deployment's lost-settings incident: "
                  "decode 62.9 -> 88.8 tok/s once put back); custom allreduce is off on >2 PCIe-only GPUs",
    },
    "draft": {
        "sglang": "--speculative-algorithm EAGLE3 --speculative-num-steps {steps} --speculative-eagle-topk {topk} "
                  "--speculative-num-draft-tokens {d}",
        "vllm": "--speculative-config '{{\"method\": \"eagle3\", \"model\": DRAFT, \"num_speculative_tokens\": "
                "{steps}}}'",
        "caveat": "topk > 1 needs an attention backend with tree masks (Triton or FA3, page size 1); vLLM's "
                  "config counts draft tokens beyond the root",
    },
    "configs": {
        "sglang": "not a flag: the kernels' tuned config tables (this suite's: `verifybench tune`)",
        "vllm": "not a flag: the kernels' tuned config tables",
        "caveat": "the suite's own Triton kernels; the engine's Marlin MoE and its GEMMs have their own tuning",
    },
    "graphs": {
        "sglang": "keep CUDA graphs on (no --disable-cuda-graph); --cuda-graph-max-bs must cover the verify batch",
        "vllm": "no --enforce-eager; compilation_config cudagraph capture sizes cover B x D tokens",
        "caveat": {"sglang": "SGLang captures TARGET_VERIFY at B x D tokens; eager work around the graph remains",
                   "vllm": "vLLM replays a graph only for a token count in its capture sizes; eager work around the "
                           "graph remains"},
    },
    "host": {
        "sglang": "SGLANG_ENABLE_SPEC_V2=1 (the overlap scheduler is off for EAGLE without it)",
        "vllm": "the async scheduler where the release has it",
        "caveat": "host gaps show only in a profiler trace of the engine itself",
    },
}


def setting(lever: str, engine: str, **fields) -> str:
    """The engine's setting for a lever, its fields filled, with the caveat."""
    row = SETTINGS[lever]
    caveat = row["caveat"] if isinstance(row["caveat"], str) else row["caveat"][engine]  # one engine's own
    return f"{engine}: {row[engine].format(**fields)} (caveat: {caveat})"
