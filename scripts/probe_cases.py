"""The inputs of scripts/probe_bad_inputs.py, gathered from one file per class (probe_<class>.py, each on
probe_base.py's Case). Uses only public entry points, so it runs on older checkouts."""
from __future__ import annotations

from pathlib import Path

from probe_advise import new_cases
from probe_args import argument_cases, nan_cases, subprocess_cases
from probe_base import Case
from probe_files import compare_cases
from probe_flows import flow_cases
from probe_kernels import moe_cases, tree_cases
from probe_output import output_cases
from probe_ranks import rank_fault_cases


def all_cases(work: Path, torchrun: bool = True) -> list[Case]:
    return (argument_cases(work) + compare_cases(work) + nan_cases(work) + output_cases(work) + tree_cases()
            + moe_cases() + flow_cases(work) + subprocess_cases(work) + rank_fault_cases(work, torchrun)
            + new_cases(work, torchrun))
