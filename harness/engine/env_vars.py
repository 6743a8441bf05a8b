"""The suite's numeric environment variables (VERIFYBENCH_*): one parser, one wording of its refusal."""
from __future__ import annotations

import math


def positive_float(name: str, text: str, unit: str, hint: str = "") -> float:
    """`text`, the value of the variable `name`, as a finite number of `unit` > 0; else a ValueError naming the
    variable (with `hint`, an example, after the rule)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number of {unit} > 0{hint}, got {text!r}")
    return value
