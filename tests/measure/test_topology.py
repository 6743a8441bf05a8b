"""The GPU-to-GPU matrix (NVLink count or PCIe path, P2P access) built from a fake NVML, its absence without NVML,
and the P2P rule that skips the symmetric-memory allreduces."""
from __future__ import annotations

from types import SimpleNamespace

from verifybench.harness.collectives.backends import p2p_reason
from verifybench.harness.measure.host import fingerprint, topology


class NVMLError(Exception):
    pass


class FakeNVML:
    """Handles are ints. `levels[(i, j)]`: the common-ancestor level; `nvlinks[i]`: remote bus ids of i's active
    links (a bus no GPU has stands for an NVSwitch); no entry: NVLink not supported."""

    def __init__(self, buses, levels=None, nvlinks=None):
        self.buses, self.levels, self.nvlinks = buses, levels or {}, nvlinks or {}

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.buses[h].encode())

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h not in self.nvlinks or link >= len(self.nvlinks[h]):
            raise NVMLError("NotSupported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self.nvlinks[h][link])

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.levels.get((a, b), self.levels.get((b, a)))


PCIE_BOX = FakeNVML(  # GPUs 0, 1 on one PCIe switch, 2 beside them on the same CPU, 3 on the other socket
    ["00000000:1A:00.0", "00000000:1B:00.0", "00000000:3A:00.0", "00000000:9A:00.0"],
    {(0, 1): 10, (0, 2): 30, (1, 2): 40, (0, 3): 50, (1, 3): 50, (2, 3): 50})


def test_pcie_box_shows_the_path_level_of_every_pair_and_p2p_where_granted():
    no_p2p_across_sockets = lambda i, j: 3 not in (i, j)  # noqa: E731
    topo = topology.build(PCIE_BOX, [0, 1, 2, 3], {i: i for i in range(4)}, no_p2p_across_sockets)
    assert topo["available"] and topo["gpus"] == 4
    assert topo["link"] == [["X", "PIX", "PHB", "SYS"], ["PIX", "X", "NODE", "SYS"],
                            ["PHB", "NODE", "X", "SYS"], ["SYS", "SYS", "SYS", "X"]]
    assert topo["p2p"][0] == [None, True, True, False] and topo["p2p"][3][0] is False
    text = topology.table(topo)
    assert "PIX/p2p" in text and "SYS/no p2p" in text and "PXB" in text  # the legend names every level


def test_nvlink_pairs_show_their_link_count_direct_or_through_a_switch():
    bridged = FakeNVML(["0000:01:00.0", "0000:02:00.0"], {(0, 1): 50},
                       {0: ["00000000:02:00.0"] * 4, 1: ["0000:01:00.0"] * 4})  # both bus id forms
    assert topology.link_matrix(bridged, [0, 1]) == [["X", "NV4"], ["NV4", "X"]]
    switch = "00000000:C0:00.0"
    switched = FakeNVML(["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"], {(0, 2): 40, (1, 2): 40},
                        {0: [switch] * 18, 1: [switch] * 18})
    assert topology.link_matrix(switched, [0, 1, 2]) == [["X", "NV18", "NODE"], ["NV18", "X", "NODE"],
                                                         ["NODE", "NODE", "X"]]


def test_one_gpu_is_a_one_by_one_matrix_and_unknown_levels_show_a_question_mark():
    one = topology.build(PCIE_BOX, [0], {0: 0}, lambda i, j: True)
    assert one["link"] == [["X"]] and one["p2p"] is None and "GPU0" in topology.table(one)
    unknown = FakeNVML(["0000:01:00.0", "0000:02:00.0"])
    assert topology.link_matrix(unknown, [0, 1])[0][1] == "?"


def test_without_nvml_or_cuda_the_matrix_is_absent_with_a_reason_not_a_crash():
    absent = topology.build(None, [], None, None)
    assert absent["available"] is False and absent["reason"]
    assert "absent" in topology.table(absent)
    assert topology.build(PCIE_BOX, [], None, None)["reason"] == "NVML sees no GPU"
    no_cuda = topology.build(PCIE_BOX, [0, 1], None, None)
    assert no_cuda["link"][0][1] == "PIX" and no_cuda["p2p"] is None and "no CUDA" in no_cuda["p2p_reason"]
    assert "p2p: unknown" in topology.table(no_cuda)
    gpus_cuda_cannot_see = topology.build(PCIE_BOX, [0, 1], {0: 0}, lambda i, j: True)
    assert gpus_cuda_cannot_see["p2p"] == [[None, None], [None, None]]


def test_fingerprint_carries_the_topology_on_any_machine():
    topo = fingerprint.collect()["topology"]
    assert topo["available"] in (True, False)
    assert topo["reason"] if not topo["available"] else topo["link"]


def test_p2p_backends_are_refused_naming_the_pairs_without_peer_access():
    assert p2p_reason([0, 1, 2, 3], lambda i, j: True) is None
    reason = p2p_reason([0, 1, 2, 3], lambda i, j: {i, j} != {0, 3})
    assert "no P2P access between GPUs 0->3, 3->0" in reason
    assert topology.missing_p2p_pairs([0, 1], lambda i, j: False) == [(0, 1), (1, 0)]
    many = p2p_reason(list(range(8)), lambda i, j: False)
    assert "and 50 more" in many  # 56 ordered pairs, six named
