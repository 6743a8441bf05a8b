"""Command-line parsing every command and torchrun job shares: argument types for numbers (written plainly, finite,
in range, named in the error: Python's int() reads "1_0" as 10), one parser per kind of list (tokens, batches,
requests per forward, contexts, the spread of B requests' contexts), their limits, and the parser that refuses in
one line, exit 2."""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

INTEGER = re.compile(r"[+-]?[0-9]+")
DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(nan|inf|infinity)", re.IGNORECASE)
from verifybench.harness.measure.exits import EXIT_BAD_INPUT

from verifybench.harness.measure.limits import FORWARD_ROWS_MAX, MAX_CONTEXT, TOKEN_COUNT_MAX  # noqa: E402,F401
BATCH_MAX = 4096  # requests per batch: past any serving batch, and a range up to it stays small
CONTEXT_SPREAD_MAX = 1.0  # --context-spread S stays below it: the shortest request's context c x (1 - S) stays > 0
MAX_STEP_MS = 60_000.0  # a time per step given by hand: past a minute it is a unit slip (and sums of it stay finite)
MAX_GBPS = 100_000.0  # a copy bandwidth given by hand: 100 TB/s, far past any GPU's memory


def read_int(text: str) -> int:
    """An integer written as digits (an optional sign); ValueError otherwise."""
    if not INTEGER.fullmatch(text.strip()):
        raise ValueError(f"not an integer: {text!r}")
    return int(text)


def read_float(text: str) -> float:
    """A decimal number (sign, digits, point, exponent; nan/inf are read, for the range check to name them)."""
    if not DECIMAL.fullmatch(text.strip()):
        raise ValueError(f"not a number: {text!r}")
    return float(text)



class Parser(argparse.ArgumentParser):
    """argparse with its refusals in one line (naming the argument and what it allows) and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def finite_float(low: float | None = None, high: float | None = None, exclusive: bool = False):
    """An argparse type: a finite float >= low (> low with `exclusive`) and <= high; NaN and inf are refused."""
    def parse(text: str) -> float:
        try:
            value = read_float(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (value <= low if exclusive else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if exclusive else '>='} {low:g}, got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def int_in(low: int = 1, high: int | None = None):
    """An argparse type: an integer written as digits, in low..high."""
    def parse(text: str) -> int:
        try:
            value = read_int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {f'in {low}..{high}' if high is not None else f'>= {low}'}, "
                                             f"got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


positive_int = int_in(1)


def accept_len(text: str) -> float:
    """An argparse type: tau, the mean tokens accepted per verify with the bonus token, in 1..TOKEN_COUNT_MAX."""
    value = finite_float(1)(text)
    if value > TOKEN_COUNT_MAX:
        raise argparse.ArgumentTypeError(f"must be <= {TOKEN_COUNT_MAX} (tokens per verify), got {text!r}")
    return value


def split_list(text: str, name: str, takes: str) -> list[str]:
    """The items of a comma list, stripped, in the order given; ValueError naming `name` and what it `takes` for an
    empty item (an empty list included: it would run the defaults unasked). Every comma-list option reads its text
    through this, then name_list or count_list checks the items."""
    items = [part.strip() for part in text.split(",")]
    if not all(items):
        raise ValueError(f"{name + ' ' if name else ''}takes {takes}, got {text!r} (an empty item)")
    return items


def name_list(text: str, name: str, choices) -> list[str]:
    """'nccl,gloo' -> ['nccl', 'gloo']: distinct names among `choices`, in the order given; ValueError naming `name`,
    the unknown names and the choices otherwise."""
    choices = list(choices)
    items = split_list(text, name, f"names among {', '.join(choices)}")
    unknown = [n for n in items if n not in choices]
    if unknown:
        raise ValueError(f"unknown {name} {', '.join(unknown)}: choose from {', '.join(choices)}, got {text!r}")
    twice = sorted({n for n in items if items.count(n) > 1})
    if twice:
        raise ValueError(f"{name} lists {', '.join(twice)} twice, got {text!r}")
    return items


def count_list(text: str, name: str, high: int, ranges: bool = True, noun: str = "count") -> tuple[int, ...]:
    """'1,2,4,8' or '1-8' (or both: '1-3,8') -> (1, 2, 4, 8), in the order given: integers written as digits, in
    1..high, none twice, no empty item; ValueError naming `name` (argparse names it itself: "") otherwise."""
    lead = f"{name} " if name else ""
    takes = f"positive integers like {'1,2,4,8 or 1-8' if ranges else '1024,4096'}"
    out: list[int] = []
    for part in split_list(text, name, takes):
        m = re.fullmatch(r"([0-9]+)\s*(?:-\s*([0-9]+))?", part)
        if not m or (m[2] and not ranges):
            raise ValueError(f"{lead}takes {takes}, got {text!r}")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise ValueError(f"{name + ': ' if name else ''}the range {part!r} runs backwards, got {text!r}")
        if lo < 1 or hi > high:
            raise ValueError(f"{lead}must be in 1..{high}, got {text!r}")
        out += range(lo, hi + 1)
    if len(set(out)) != len(out):
        raise ValueError(f"{lead}lists a {noun} twice, got {text!r}")
    return tuple(out)


def token_counts(text: str, high: int = TOKEN_COUNT_MAX, name: str = "--tokens") -> tuple[int, ...]:
    """Token counts (tokens per verify forward)."""
    return count_list(text, name, high)


def batch_counts(text: str, name: str = "--batches") -> tuple[int, ...]:
    """Batch sizes (requests per step)."""
    return count_list(text, name, BATCH_MAX)


def request_batches(text: str, name: str = "--batch") -> tuple[int, ...]:
    """Requests per verify forward (`--batch 1,2,4,8`): each at most FORWARD_ROWS_MAX, as B requests of at least one
    token each carry B rows; the product with the token counts is checked by check_forward_rows."""
    return count_list(text, name, FORWARD_ROWS_MAX, noun="batch size")


# Where a case's params hold D, its tokens per request, and the option that sets it (the cycle's D: its --configs)
TOKENS_KEYS = {"tokens": "--tokens", "draft_tokens": "--configs D"}


def check_forward_rows(params: list[dict]) -> None:
    """B requests x D tokens each, over the params of the cases a command lists (its options and the component's
    defaults, as they will run): the rows one verify forward carries, at most FORWARD_ROWS_MAX (ValueError naming
    the largest B and D)."""
    if not params:
        return
    key = "tokens" if "tokens" in params[0] else "draft_tokens"
    b, d = max(p["batch"] for p in params), max(p[key] for p in params)
    if b * d > FORWARD_ROWS_MAX:
        raise ValueError(f"--batch {b} x {TOKENS_KEYS[key]} {d} = {b * d} tokens per verify forward; at most "
                         f"{FORWARD_ROWS_MAX} (B x D)")


def context_list(text: str, name: str = "--contexts") -> tuple[int, ...]:
    """Contexts (tokens in the KV cache), no ranges: '1024,4096'."""
    return count_list(text, name, MAX_CONTEXT, ranges=False, noun="context")


def nonempty(name: str):
    """An argparse type: the text as given, refused when empty (an empty list would run the defaults unasked); for a
    list its command checks later, with what it knows then."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("an empty list; leave the option out for the defaults")
        return text
    parse.__name__ = name
    return parse


def _arg(read, what: str):
    """An argparse type from a reader above (argparse names the option in its message)."""
    def parse(text: str):
        try:
            return read(text, name="")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = what
    return parse


tokens_arg = _arg(token_counts, "token counts")


def tokens_upto(high: int, one: bool = False):
    """An argparse type: token counts in 1..high (a command whose buffers hold fewer than TOKEN_COUNT_MAX);
    `one`: exactly one count, returned as an int."""
    def parse(text: str):
        try:
            counts = token_counts(text, high, name="")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if one and len(counts) != 1:
            raise argparse.ArgumentTypeError(f"takes one token count, got {text!r}")
        return counts[0] if one else counts
    parse.__name__ = "token counts"
    return parse


batches_arg = _arg(batch_counts, "batch sizes")
contexts_arg = _arg(context_list, "contexts")
request_batches_arg = _arg(request_batches, "batch sizes")
context_arg = int_in(1, MAX_CONTEXT)

CONTEXT_SPREAD_HELP = ("with B > 1 requests, spread their contexts around --context: request b of B gets "
                       "c x (1 - S + 2S x b / (B - 1)), evenly spaced over [c(1-S), c(1+S)] (no RNG: reruns compare), "
                       "rounded to the nearest token, at least 1; 0 <= S < 1 (default 0: every request at --context). "
                       "Needs a --batch size above 1; a B = 1 case runs --context")


def check_context_spread(spread: float) -> float:
    """S itself: a finite number with 0 <= S < CONTEXT_SPREAD_MAX (ValueError naming --context-spread otherwise)."""
    if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not math.isfinite(spread) \
            or not 0 <= spread < CONTEXT_SPREAD_MAX:
        raise ValueError(f"--context-spread {_SPREAD_RANGE}, got {spread!r}")
    return float(spread)


_SPREAD_RANGE = f"takes 0 <= S < {CONTEXT_SPREAD_MAX:g} (request contexts over [c(1-S), c(1+S)])"


def context_spread_arg(text: str) -> float:
    """An argparse type for --context-spread S (argparse names the option in its message)."""
    try:
        return check_context_spread(read_float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--context-spread ")) from None


context_spread_arg.__name__ = "number"


def check_spread_batches(spread: float, batches) -> float:
    """S checked against the batch sizes: S > 0 with no size above 1 would change nothing and is refused (a B = 1 case
    of a run that has larger ones keeps its one context)."""
    spread = check_context_spread(spread or 0.0)
    if spread > 0 and max(batches) == 1:
        raise ValueError(f"--context-spread {spread:g} spreads the contexts of B > 1 requests; with --batch 1 it "
                         "changes nothing: give a --batch size above 1")
    return spread


def spread_contexts(context: int, batch: int, spread: float) -> tuple[int, ...]:
    """The contexts of `batch` requests around `context` (CONTEXT_SPREAD_HELP's rule): request b of B at
    c x (1 - S + 2S x b / (B - 1)), rounded half up, at least 1 token; B = 1 or S = 0: `context` each. ValueError
    when S is out of range or the longest passes MAX_CONTEXT."""
    spread = check_context_spread(spread)
    if batch == 1 or spread == 0:
        return (context,) * batch
    out = tuple(max(1, math.floor(context * (1 - spread + 2 * spread * b / (batch - 1)) + 0.5)) for b in range(batch))
    if out[-1] > MAX_CONTEXT:
        raise ValueError(f"--context {context} with --context-spread {spread:g}: the longest request's context "
                         f"{out[-1]} passes {MAX_CONTEXT}")
    return out


# ---- the draft shapes and acceptance given to plan and advise ----

def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """"steps,topk,D;..." checked before anything is sized by it: steps >= 1, topk >= 1, 2 <= D, each at most
    TOKEN_COUNT_MAX (tokens per verify), and D - 1 <= topk + (steps-1)*topk^2 (the draft tree's candidates). The
    one reader of --configs: plan, cycle and record."""
    if not text.strip():
        raise ValueError("--configs: empty; give steps,topk,D;...")
    out = []
    for item in (s.strip() for s in text.split(";")):
        try:
            steps, topk, d = (read_int(v) for v in item.split(","))
        except ValueError:
            raise ValueError(f"--configs: {item!r} is not steps,topk,D (three integers), in {text!r}") from None
        if steps < 1 or topk < 1 or d < 2:
            raise ValueError(f"--configs: {item!r} needs steps >= 1, topk >= 1, D >= 2")
        if max(steps, topk, d) > TOKEN_COUNT_MAX:
            raise ValueError(f"--configs: {item!r}: steps, topk and D are at most {TOKEN_COUNT_MAX} (tokens per "
                             "verify)")
        if d - 1 > topk + (steps - 1) * topk**2:
            raise ValueError(f"--configs: {item!r}: D - 1 = {d - 1} draft nodes > the tree's "
                             f"{topk + (steps - 1) * topk**2} candidates (topk + (steps-1)*topk^2)")
        if (steps, topk, d) in out:
            raise ValueError(f"--configs: {item!r} given twice")
        out.append((steps, topk, d))
    return out


def _number(text: str, name: str, low: float, high: float | None = None) -> float:
    try:
        return finite_float(low, high)(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{name}: {e}") from None


def parse_keyed(text: str, name: str, low: float, high: float | None = None) -> dict:
    """"key:value,key:value" with key D (an int) or "steps,topk,D" (then items may be split by ';' too) -> {key:
    value}; values finite and >= low."""
    out, key_parts = {}, []
    for token in (t.strip() for t in re.split(r"[;,]", text)):
        if ":" not in token:
            key_parts.append(token)
            continue
        head, value = token.split(":", 1)
        key_parts.append(head)
        try:
            ints = tuple(read_int(k) for k in key_parts)
        except ValueError:
            raise ValueError(f"{name}: key {','.join(key_parts)!r} is not D or steps,topk,D") from None
        if len(ints) not in (1, 3) or min(ints) < 1:
            raise ValueError(f"{name}: key {','.join(key_parts)!r} is not D or steps,topk,D (positive integers)")
        key = ints[0] if len(ints) == 1 else ints
        if key in out:
            raise ValueError(f"{name}: {key} given twice")
        out[key] = _number(value, name, low, high)
        key_parts = []
    if key_parts or not out:
        raise ValueError(f"{name}: {text!r} is not key:value,... (e.g. 3:25.6,6:28.7)")
    return out


RATES_HELP = ("per-depth acceptance p1,p2,... each in [0, 1]: one rate for every depth, or as many rates as the "
              "deepest shape reaches, min(steps, D-1) (e.g. 5 for (5,1,6))")


def parse_rates(text: str) -> list[float]:
    return [_number(t, "--accept-rates", 0, 1) for t in split_list(text, "--accept-rates", "rates like 0.8,0.6")]


def out_path(text: str) -> Path:
    """An argparse type for a file or folder to write: a non-empty path (an empty one would be the working
    directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a file or folder")
    return Path(text)
