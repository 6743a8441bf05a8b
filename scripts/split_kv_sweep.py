"""Our split-KV verify attention over its tiles, split counts and minimum keys per split, beside FlashInfer's MLA (where
installed), at the contexts mla_verify runs: which config is fastest at each context, checked before it is timed.

GPU only. usage: python3 scripts/split_kv_sweep.py OUT.json [--contexts 1024,4096,16384,32768] [--tokens 3,6]
Each case: one call per rotated cache (the layers of a forward, >= 4x L2), graph mode, as mla_verify times it.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from verifybench.harness.components import mla_verify as comp
from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from verifybench.harness.measure.timing.runner import rel_error
from verifybench.harness.measure.timing.timer import measure
from verifybench.harness.model import presets
from verifybench.kernels.mla_verify import api as mv

MIN_SPLIT_KEYS = (16, 32, 64, 128)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument("--tokens", default="3,6")
    p.add_argument("--splits", default="default", help="split counts to try, comma-separated ('default': the kernel's)")
    p.add_argument("--max-time-s", type=float, default=0.2)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("split_kv_sweep: needs a CUDA GPU", file=sys.stderr)
        return EXIT_BAD_INPUT
    s = presets.get("kimi-k2.5", 8)
    heads, kv_lora, rope = s.heads, s.kv_lora, s.qk_rope
    dk, scale, dtype = kv_lora + rope, (s.qk_nope + s.qk_rope) ** -0.5, torch.bfloat16
    rows = []
    for context in map(int, a.contexts.split(",")):
        caches, _ = comp.planned_caches(context + comp.SPARE_ROWS, dk, "cuda", dtype)
        starts, lens = comp.layout([context], "cuda")
        for d in map(int, a.tokens.split(",")):
            mask = comp.tree_mask(d, None, context, "cuda")
            qs = [torch.randn(heads, d, dk, device="cuda").to(dtype) for _ in caches]
            q = torch.randn(heads, d, dk, device="cuda").to(dtype)
            ref = mv.mla_verify_reference(q.float(), caches[0].float(), starts, lens, mask, kv_lora, scale)

            def timed(label, make):
                call = make()
                err = rel_error(call(q, caches[0]).float(), ref)
                if not err <= 1e-2:
                    rows.append({"context": context, "D": d, "config": label, "rel_err": err, "us": None})
                    return
                fns = [lambda q=qq, c=c: call(q, c) for qq, c in zip(qs, caches)]
                us = measure(fns, mode="graph", max_time_s=a.max_time_s).median_us
                rows.append({"context": context, "D": d, "config": label, "rel_err": err, "us": us})

            try:
                from verifybench.harness.engines import flashinfer

                wrapper, _ = flashinfer.verify_planner(starts, lens, d, heads, kv_lora, rope, scale, dtype)
                built = {}

                def fi(qq, c):
                    key = (id(qq), id(c))
                    if key not in built:
                        built[key] = (qq, c, flashinfer.mla_run(qq, c, kv_lora, wrapper))
                    return built[key][2]()
                timed("flashinfer.mla", lambda: fi)
            except Exception as e:  # noqa: BLE001 (a missing engine: its row says why)
                print(f"flashinfer: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            for tiles in mv.CONFIG_SPACE["split_kv"]:
                for msk in MIN_SPLIT_KEYS:
                    for ns in [None if x == "default" else int(x) for x in a.splits.split(",")]:
                        cfg = {**tiles, "min_split_keys": msk, "num_splits": ns}
                        label = (f"{tiles['block_rows']}x{tiles['block_keys']} w{tiles['num_warps']} "
                                 f"s{tiles['num_stages']} msk{msk} ns{ns}")
                        try:
                            mv.check_config("split_kv", cfg)
                        except ValueError:
                            continue
                        timed(label, lambda cfg=cfg: lambda qq, c: mv.mla_verify(qq, c, starts, lens, mask, kv_lora,
                                                                                 scale, "split_kv", cfg))
            default = [r for r in rows if r["context"] == context and r["D"] == d]
            print(f"ctx {context} D {d}: {len(default)} configs", flush=True)
    from verifybench.harness.measure.host import fingerprint  # the GPU, versions (engines included) and commit, as results carry

    json.dump({"gpu": torch.cuda.get_device_name(), "fingerprint": fingerprint.collect(), "rows": rows},
              open(a.out, "w"), indent=1)
    print(f"{'ctx':>6} {'D':>2} {'flashinfer':>10} {'default':>8} {'best':>8}  best config")
    for context in sorted({r["context"] for r in rows}):
        for d in sorted({r["D"] for r in rows}):
            rs = [r for r in rows if r["context"] == context and r["D"] == d and r["us"] is not None]
            fi_us = next((r["us"] for r in rs if r["config"] == "flashinfer.mla"), float("nan"))
            dflt = mv.DEFAULT_CONFIGS["split_kv"]
            dlabel = (f"{dflt['block_rows']}x{dflt['block_keys']} w{dflt['num_warps']} s{dflt['num_stages']} "
                      f"msk{dflt['min_split_keys']} nsNone")
            de = next((r["us"] for r in rs if r["config"] == dlabel), float("nan"))
            best = min((r for r in rs if r["config"] != "flashinfer.mla"), key=lambda r: r["us"])
            print(f"{context:>6} {d:>2} {fi_us:>10.1f} {de:>8.1f} {best['us']:>8.1f}  {best['config']}")
    failed = [r for r in rows if r["us"] is None]
    print(f"{len(rows)} cases, {len(failed)} failed checks")
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
