"""Our engine-style extend kernel beside the installed SGLang's, as ptxas builds each for sm_<cc> without a GPU:
registers, stack, and per loop (the first is the serial loop over the prefix, run once per key tile) its instructions,
spill loads and stores, global loads and MMAs. A difference here is one the timing of `verifybench mla_verify` (rows
extend and sglang.extend) may show on that GPU; docs/FINDINGS.md §9 reads it.

    python3 scripts/extend_fidelity.py [--cc 90,120] [--mask dense|words]

Needs SGLang importable (its pure-Python wheel; .ci/engines in a CI checkout) and the cuobjdump Triton ships.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cc", default="90,120", help="compute capabilities, e.g. 90,120 (default; 80, 86, 89, 90, 100, "
                   "120), each with the tiles SGLang's launcher picks for it")
    p.add_argument("--mask", choices=("dense", "words"), default="dense",
                   help="our kernel's tree mask: dense bool, as mla_verify gives it (default), or one word per query")
    args = p.parse_args(argv)
    from tabulate import tabulate

    from verifybench.harness.engines import EngineMissing, one_line, sglang
    from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
    from verifybench.kernels.mla_verify import api as mv

    known = sorted(mv.ENGINE_EXTEND_CONFIGS)  # the capabilities whose engine tiles the suite holds
    try:
        ccs = [int(c) for c in args.cc.split(",")]
    except ValueError:
        ccs = []
    if not ccs or any(cc not in known for cc in ccs):
        print(f"error: --cc takes compute capabilities among {','.join(map(str, known))}, got {args.cc!r}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    rows = []
    for cc in ccs:
        try:
            tiles = sglang.extend_tiles(cc)
            kernels = {"sglang.extend": sglang.extend_compiled(cc)}
        except EngineMissing as e:
            print(f"error: SGLang's extend kernel: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except Exception as e:  # the installed SGLang's kernel no longer compiles as its launch is described here
            print(f"error: compiling SGLang's extend kernel for sm_{cc}: {one_line(e)}", file=sys.stderr)
            return EXIT_FAILED
        ours = mv.compiled_resources("extend", {**mv.ENGINE_EXTEND_CONFIGS[cc], **tiles}, cc,
                                     mask_words=args.mask == "words")
        kernels[f"extend ({args.mask} mask)"] = ours["_extend_kernel"]
        for name, r in kernels.items():
            for i, loop in enumerate(r["loops"]):
                rows.append({"sm": cc, "tiles": f"{tiles['block_rows']}x{tiles['block_keys']}", "kernel": name,
                             "registers": r["registers"], "stack_B": r["stack_bytes"],
                             "loop": "prefix" if i == 0 else f"#{i + 1}", **loop})
    print(tabulate(rows, headers="keys"))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
