"""Command-line parsing every command and torchrun job shares: argument types for numbers (finite, in range, named
in the error) and the parser that refuses in one line with exit code 2."""
from __future__ import annotations

import argparse
import math

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """argparse with its refusals in one line (naming the argument and what it allows) and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def finite_float(low: float | None = None, high: float | None = None, exclusive: bool = False):
    """An argparse type: a finite float >= low (> low with `exclusive`) and <= high; NaN and inf are refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (value <= low if exclusive else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if exclusive else '>='} {low:g}, got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value
