"""`verifybench trace --against`: an engine trace's decomposition beside a suite verify result, part by part, like
with like: the same n, the verify step (not the whole cycle) when named, and the same number of layers.

The trace's layers are its allreduce kernels per cycle over two (two allreduces per layer); when they disagree with
the result's layers by more than LAYERS_SLACK, the comparison is refused unless --layers N names the engine's
layers, and then the suite is scaled per layer (every part but the lm_head) and says so.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from verifybench.harness.answers.trace_read import TraceError
from verifybench.harness.answers.trace_rules import SUITE_MAP

ALLREDUCES_PER_LAYER = 2  # after attention and after the MLP (the logits all-gather adds one per forward)
LAYERS_SLACK = 1.5  # the draft model's and the logits' collectives move the estimate a little, never 20x
PER_FORWARD = ("head",)  # suite parts that run once per forward, not once per layer
RESULT_COMMAND = "verifybench verify, or verifybench run --components verify"


def load_against(path: str | Path) -> dict:
    """A suite verify result from a GPU (schema verifybench.result, component verify), or TraceError."""
    from verifybench.harness.measure.results.store import ResultsError, load_run, read_json, validate_run

    try:  # its kind first: another kind's cases are not read as a verify result's
        run = validate_run(read_json(Path(path)), str(path))
    except ResultsError as e:
        raise TraceError(str(e)) from None
    if run["component"] != "verify":
        raise TraceError(f"{path}: a {run['component']!r} result; --against needs a verify result "
                         f"({RESULT_COMMAND})")
    try:  # the one rule of every command that draws conclusions: none from a CPU run
        return load_run(Path(path), {"verify": ()}, "--against", gpu_only=True)
    except ResultsError as e:
        raise TraceError(f"{e}: --against needs a GPU verify result") from None


def suite_parts(run: dict, where: str = "result") -> dict[int, dict[str, float]]:
    """n -> {"full": us, "<component>": isolated us} from a verify result's passing cases."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for case in run["cases"]:
        params, summary = case.get("params", {}), case.get("summary") or {}
        variant, n = params.get("variant"), params.get("tokens")
        if not case["check"]["ok"] or not isinstance(n, int) or not isinstance(variant, str):
            continue
        key = "full" if variant == "full" else variant[5:] if variant.startswith("only-") else None
        if key is None or not isinstance(summary.get("median_us"), (int, float)):
            continue
        if key in out[n]:
            raise TraceError(f"{where}: two cases for variant {variant!r} at n={n}; pass a result of one run")
        out[n][key] = float(summary["median_us"])
    if not out:
        raise TraceError(f"{where}: no passing 'full' or 'only-<component>' verify cases")
    return dict(out)


def suite_layers(run: dict, n: int) -> int | None:
    """The layers the result's forward ran at n: derived layers_run, else the case's layers, else (None: all) its
    preset's; None if the result says none of these."""
    from verifybench.harness.model import presets

    for case in run["cases"]:
        params = case.get("params", {})
        if params.get("tokens") == n and params.get("variant") == "full":
            got = (case.get("derived") or {}).get("layers_run", params.get("layers"))
            if got is None and isinstance(params.get("preset"), str):
                try:
                    got = presets.get(params["preset"], params.get("tp", 1)).layers
                except (ValueError, KeyError, TypeError):  # a preset this checkout does not know
                    return None
            if isinstance(got, int) and not isinstance(got, bool) and got > 0:
                return got
    return None


def _layers(part: dict, run_layers: int | None, layers: int | None, where: str) -> tuple[float, str]:
    """(scale applied to the suite's per-layer parts, a note saying what was compared)."""
    calls = part.get("per_cycle_calls", {}).get("allreduce", 0.0)
    guess = round(calls / ALLREDUCES_PER_LAYER) if calls >= ALLREDUCES_PER_LAYER else None
    if run_layers is None:
        return 1.0, "the result does not say its layers: compare only if the engine ran as many"
    if layers is not None:
        if layers == run_layers:
            return 1.0, f"{layers} layers on both sides (--layers)"
        return layers / run_layers, (f"suite scaled per layer from {run_layers} to {layers} layers (--layers; "
                                     f"x{layers / run_layers:.3g} on every part but the lm_head): an estimate")
    if guess is None:
        seen = (f"{calls:g} allreduce kernel{'' if calls == 1 else 's'} per cycle, fewer than a layer's "
                f"{ALLREDUCES_PER_LAYER}") if calls > 0 else "no allreduce kernels"
        return 1.0, (f"suite {run_layers} layers; the trace's layers are unknown ({seen}): pass --layers N if the "
                     "engine ran another number")
    if max(guess, run_layers) / min(guess, run_layers) > LAYERS_SLACK:
        raise TraceError(f"{where}: the suite ran {run_layers} layers, the trace about {guess} ({calls:.0f} "
                         f"allreduce kernels per cycle, {ALLREDUCES_PER_LAYER} per layer): pass --layers N (the "
                         "engine's layers) to scale the suite per layer")
    return 1.0, f"suite {run_layers} layers, trace about {guess} by its allreduce kernels"


def against_table(result: dict, run: dict, tokens: int | None, where: str = "result",
                  layers: int | None = None) -> tuple[list[list], str]:
    """Rows of (part, engine us per cycle, suite isolated us at n, engine / suite) and a line saying which n, which
    part of the engine's cycle and how many layers were compared."""
    parts = suite_parts(run, where)
    if tokens is not None and tokens not in parts:
        raise TraceError(f"{where}: no cases at n={tokens} (--tokens); it has n = {', '.join(map(str, sorted(parts)))}")
    n = tokens if tokens is not None else max(parts)
    note = f"suite at n = {n}" + (" (--tokens)" if tokens is not None else
                                  ": the largest n in the result; pass --tokens N for the engine's tokens per verify")
    part = result["verify"] or result
    if result["verify"]:
        note += "; engine: the verify part of each cycle"
    elif result.get("verify_range") and not result.get("cycle_range"):
        note += f"; engine: each --verify-range {result['verify_range']!r} range (the verify step alone)"
    else:
        note += "; engine: the whole cycle (draft steps included: name the verify range with --verify-range)"
    scale, layer_note = _layers(part, suite_layers(run, n), layers, where)
    note += "; " + layer_note
    eng = part["per_cycle_us"]
    suite = {c: us * (1.0 if c in PER_FORWARD else scale) for c, us in parts[n].items() if c != "full"}
    rows = []
    for label, suite_comps, trace_comps in SUITE_MAP:
        have = [c for c in suite_comps if c in suite]
        s = sum(suite[c] for c in have) if have else None
        e = sum(eng.get(c, 0.0) for c in trace_comps)
        label += f"  [{'+'.join(suite_comps)} | {'+'.join(trace_comps)}]"
        rows.append([label, e, s, e / s if s else None])
    f = parts[n].get("full")
    if f is not None and scale != 1.0:
        head = parts[n].get("head", 0.0)
        f = (f - head) * scale + head
    rows.append(["forward  [full | total]", eng["total"], f, eng["total"] / f if f else None])
    return rows, note
