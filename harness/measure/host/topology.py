"""GPU-to-GPU links: per pair the NVLink count or the PCIe path (nvidia-smi topo's PIX/PXB/PHB/NODE/SYS) from NVML,
and whether CUDA grants peer-to-peer access. On a PCIe box without P2P, NCCL and the P2P allreduces take other paths.
"""
from __future__ import annotations

from typing import Callable

import torch

from verifybench.harness.measure.host.nvml import nvml_handles, try_call, unavailable_reason

NVLINK_MAX_LINKS = 18
# nvmlDeviceGetTopologyCommonAncestor levels, named as `nvidia-smi topo -m` names them
PCIE_LEVELS = {0: "INT", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
LEGEND = ("X self; NV# # NVLinks; INT same board; PIX one PCIe switch; PXB several PCIe switches, no host bridge; "
          "PHB through a host bridge (CPU); NODE across host bridges in one NUMA node; SYS across NUMA nodes (the "
          "CPU interconnect); p2p: CUDA peer access yes/no")


def _bus(pci) -> tuple | None:
    """'00000000:3B:00.0' or legacy '0000:3B:00.0' -> (domain, bus, device, function): both forms compare equal."""
    text = getattr(pci, "busId", pci)
    text = text.decode() if isinstance(text, bytes) else text
    try:
        domain, bus, devfn = str(text).strip().split(":")
        device, function = devfn.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except (ValueError, AttributeError):
        return None


def _nvlinks(nv, h, buses: list) -> tuple[dict[int, int], int]:
    """Active links of one GPU: {peer index: links}, and links that end at no GPU here (an NVSwitch)."""
    to, elsewhere = {}, 0
    for link in range(NVLINK_MAX_LINKS):
        state = try_call(nv.nvmlDeviceGetNvLinkState, h, link)
        if state is None:
            break
        if not state:
            continue
        remote = _bus(try_call(nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link))
        if remote is not None and remote in buses:
            to[buses.index(remote)] = to.get(buses.index(remote), 0) + 1
        else:
            elsewhere += 1
    return to, elsewhere


def link_matrix(nv, handles: list) -> list[list[str]]:
    """[i][j]: 'X' on the diagonal, 'NV<k>' with k NVLinks between i and j (through a switch: the smaller link
    count of the two), else the PCIe path level; '?' where NVML does not say."""
    buses = [_bus(try_call(nv.nvmlDeviceGetPciInfo, h)) for h in handles]
    links = [_nvlinks(nv, h, buses) for h in handles]
    out = []
    for i, h in enumerate(handles):
        row = []
        for j, other in enumerate(handles):
            direct = links[i][0].get(j, 0)
            switched = min(links[i][1], links[j][1])
            if i == j:
                row.append("X")
            elif direct or switched:
                row.append(f"NV{direct or switched}")
            else:
                level = try_call(nv.nvmlDeviceGetTopologyCommonAncestor, h, other)
                row.append(PCIE_LEVELS.get(level, "?" if level is None else str(level)))
        out.append(row)
    return out


def missing_p2p_pairs(devices: list[int], can_access: Callable[[int, int], bool] | None = None) -> list[tuple]:
    """Ordered pairs (i, j) of `devices` where i has no peer access to j."""
    can_access = can_access or torch.cuda.can_device_access_peer
    return [(i, j) for i in devices for j in devices if i != j and not can_access(i, j)]


def _cuda_index_of(nv, handles: list) -> dict[int, int]:
    """NVML index -> CUDA index, by UUID (CUDA_VISIBLE_DEVICES and CUDA's own ordering can differ from NVML's)."""
    uuids = [str(try_call(nv.nvmlDeviceGetUUID, h) or "").lower().removeprefix("gpu-") for h in handles]
    out = {}
    for c in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(c), "uuid", "")).lower()
        if uuid and uuid in uuids:
            out[uuids.index(uuid)] = c
    if not out and torch.cuda.device_count() == len(handles):  # a torch without uuid: same order assumed
        out = {i: i for i in range(len(handles))}
    return out


def build(nv, handles: list, cuda_index: dict[int, int] | None, can_access) -> dict:
    """The topology record from an NVML module and its handles; P2P over the GPUs CUDA sees (`cuda_index`:
    NVML index -> CUDA index; None: no CUDA)."""
    if nv is None:
        return {"available": False, "reason": unavailable_reason() or "no NVML"}
    if not handles:
        return {"available": False, "reason": "NVML sees no GPU"}
    out = {"available": True, "reason": None, "gpus": len(handles), "link": link_matrix(nv, handles),
           "p2p": None, "p2p_reason": None, "legend": LEGEND}
    if cuda_index is None:
        out["p2p_reason"] = "no CUDA device visible to torch"
    elif len(handles) > 1:
        def access(i, j):
            if i not in cuda_index or j not in cuda_index:
                return None
            return bool(can_access(cuda_index[i], cuda_index[j]))

        out["p2p"] = [[None if i == j else access(i, j) for j in range(len(handles))] for i in range(len(handles))]
    return out


def collect() -> dict:
    """This machine's GPU-to-GPU topology; {'available': False, 'reason': ...} without NVML or GPUs."""
    nv, handles = nvml_handles()
    try:
        cuda_index = _cuda_index_of(nv, handles) if nv is not None and torch.cuda.is_available() else None
        return build(nv, handles, cuda_index, torch.cuda.can_device_access_peer)
    except Exception as e:  # a probe that fails must not cost the run its fingerprint
        return {"available": False, "reason": f"topology probe failed: {type(e).__name__}: {e}"}


def table(topo: dict) -> str:
    """nvidia-smi topo style: one row per GPU, link then p2p per peer ('PIX/p2p', 'SYS/no p2p')."""
    if not topo.get("available"):
        return f"GPU topology: absent ({topo.get('reason')})"
    n = topo["gpus"]
    head = "      " + "".join(f"{'GPU' + str(j):>13}" for j in range(n))
    rows = [head]
    for i in range(n):
        cells = []
        for j in range(n):
            p2p = topo["p2p"][i][j] if topo["p2p"] else None
            mark = "" if i == j or p2p is None else ("/p2p" if p2p else "/no p2p")
            cells.append(f"{topo['link'][i][j] + mark:>13}")
        rows.append(f"GPU{i:<3}" + "".join(cells))
    if n > 1 and topo["p2p"] is None:
        rows.append(f"p2p: unknown ({topo['p2p_reason']})")
    rows.append(topo["legend"])
    return "\n".join(rows)
