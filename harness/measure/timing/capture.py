"""CUDA-graph capture for every graph the suite builds: torch.cuda.graph with Python's collector held off while
capturing.

A collection inside a capture can destroy a dead graph, event or stream of an earlier case that sat in a reference
cycle; that CUDA call is forbidden while a stream captures, so the capture is invalidated
(cudaErrorStreamCaptureInvalidated) at a place that depends on the allocation count, not on the case. Held off, the
garbage waits until after the capture. No collection is forced before it: a full one costs ~0.1 s in a benchmark
session, and a run captures hundreds of graphs.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

import torch


@contextmanager
def graph_capture(graph: "torch.cuda.CUDAGraph", **graph_kw):
    """`with graph_capture(g): ...` captures into `g` as `with torch.cuda.graph(g, **graph_kw)` does."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **graph_kw):
            yield graph
    finally:
        if was_enabled:
            gc.enable()
