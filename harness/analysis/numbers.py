"""Command-line parsing every command and torchrun job shares: argument types for numbers (written plainly, finite,
in range, named in the error: Python's int() reads "1_0" as 10) and the parser that refuses in one line, exit 2."""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

INTEGER = re.compile(r"[+-]?[0-9]+")
DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(nan|inf|infinity)", re.IGNORECASE)
MAX_DRAFT_TOKENS = 64  # tokens per verify (--tokens) and so the largest mean accept length


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

EXIT_BAD_INPUT = 2


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
    """An argparse type: tau, the mean tokens accepted per verify with the bonus token, in 1..MAX_DRAFT_TOKENS."""
    value = finite_float(1)(text)
    if value > MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_DRAFT_TOKENS} (tokens per verify), got {text!r}")
    return value


def token_counts(text: str, high: int = MAX_DRAFT_TOKENS) -> tuple[int, ...]:
    """'1,2,4,8' or '1-8' (or both: '1-3,8') -> (1, 2, 4, 8): integers in 1..high, none twice; ValueError saying
    what is allowed otherwise."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", part)
        if not m:
            raise ValueError(f"takes positive integers like 1,2,4,8 or 1-8, got {text!r}")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise ValueError(f"the range {part.strip()!r} runs backwards, got {text!r}")
        out += range(lo, hi + 1)
    if min(out) < 1 or max(out) > high:
        raise ValueError(f"must be in 1..{high}, got {text!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"lists a count twice: {text!r}")
    return tuple(out)


def tokens_arg(text: str) -> tuple[int, ...]:
    """An argparse type: token_counts."""
    try:
        return token_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def out_path(text: str) -> Path:
    """An argparse type for a file or folder to write: a non-empty path (an empty one would be the working
    directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a file or folder")
    return Path(text)
