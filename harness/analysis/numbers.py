"""Argument types for numbers given on a command line: finite, in range, named in the error."""
from __future__ import annotations

import argparse
import math


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
