"""Per-GPU tuned config tables of the Triton kernels (MoE, skinny GEMM, MLA decode): JSON objects keyed by the GPU's
name, read once per path (a missing file is an empty table), written whole by the tuners."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

_TABLES: dict[str, dict] = {}


def load(path: Path | str) -> dict:
    """The table at `path`, read once ({} when absent); a file that is not a JSON object raises ValueError."""
    key = str(path)
    if key not in _TABLES:
        p = Path(path)
        try:
            table = json.loads(p.read_text()) if p.is_file() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a valid config table: {e}") from None
        if not isinstance(table, dict):
            raise ValueError(f"{p}: a config table must be a JSON object, got {type(table).__name__}")
        _TABLES[key] = table
    return _TABLES[key]


def save(table: dict, path: Path | str) -> Path:
    path = Path(path)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _TABLES.pop(str(path), None)
    return path


@functools.lru_cache(maxsize=None)
def _name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_name(device) -> str:
    """The table key of `device`: its CUDA name ('NVIDIA H200'), or 'cpu'."""
    return _name(torch.device(device))
