"""An empty Triton kernel, launched with a real kernel's grids: what a call of that kernel costs when it moves no
byte (its latency floor; harness/measure/timing/floors.py times it as the real case is timed).

Each family's api.py gives `launch_grids(...)` (the call's own arguments in, the launches its wrapper makes out), so
the grid rule keeps its one home in the family's launch code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from verifybench.kernels.common import pdl as _pdl


@dataclass(frozen=True)
class Launch:
    """One launch of a real kernel as its empty stand-in repeats it: the grid, the warps per program, and the two
    halves of programmatic dependent launch (kernels/common/pdl.py): `waits`, launched with the attribute (it may start
    early and waits for the kernel before it), and `releases`, it lets the kernel after it start early."""

    grid: tuple[int, ...]
    num_warps: int
    waits: bool = False
    releases: bool = False

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    def as_dict(self) -> dict:
        return {"grid": list(self.grid), "num_warps": self.num_warps, "waits": self.waits, "releases": self.releases}


def of_plan(plan: list[tuple], pdl: bool) -> list[Launch]:
    """The launches of a family's plan [(kernel, grid, constexprs, options)] whose every kernel waits and releases
    when `pdl` is on (the MLA kernels)."""
    return [Launch(tuple(grid), opts["num_warps"], pdl, pdl) for _, grid, _, opts in plan]


@triton.jit
def _empty_kernel(WAITS: tl.constexpr, RELEASES: tl.constexpr):
    # nothing read, nothing written: what is left is scheduling the grid's programs and, under PDL, the handoff
    if WAITS:
        gdc_wait()
    if RELEASES:
        gdc_launch_dependents()


def launch(launches: list[Launch]) -> None:
    """Launch the empty kernel once per entry, with its grid, warps and PDL flags, on the current device (in the
    interpreter: on the CPU)."""
    for one in launches:
        _empty_kernel[one.grid](WAITS=one.waits, RELEASES=one.releases, num_warps=one.num_warps,
                                **_pdl.launch_kwargs(one.waits))
