"""The machine: link and SM rates per GPU, and the published DeepEP V1 figures (H800 NVLink, one
CX7 NIC per GPU) that the model is checked against."""

from __future__ import annotations

from dataclasses import dataclass

from ...core.rates import NVLINK_GBPS, PER_SM_COPY_GBPS, seconds_at

# DeepEP V1's published internode normal-kernel figures, "bottleneck bandwidth" (RDMA) in its
# accounting, GB/s, (dispatch FP8, combine BF16) per EP: H800 (~160 GB/s NVLink), one CX7
# 400 Gb/s NIC (~50 GB/s) per GPU, 4096 tokens, hidden 7168, top-8 experts, top-4 groups.
# deepseek-ai/DeepEP README.md from commit 3b1045d ("Fix the performance data", 2025-04-22)
# until the EPv2 release (b306af0) replaced the table; its tests/test_internode.py routes with
# one group per node and min(nodes, 4) groups per token, and counts RDMA bytes as (token,
# destination node) pairs, own node included, x row bytes.
DEEPEP_V1_INTERNODE = {16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
DEEPEP_V1_SOURCE = "deepseek-ai/DeepEP README.md, commit 3b1045d (2025-04-22), H800 + CX7 400 Gb/s"
H800_NVLINK_GBPS = 160.0


@dataclass(frozen=True)
class Machine:
    """Link and SM rates, GB/s = 1e9 bytes/s, unidirectional, per GPU."""

    gpus_per_node: int = 8
    nvlink_gbps: float = NVLINK_GBPS  # practical NVLink 4 on H100/H200 (~370 of 450); H800: ~160
    nic_gbps: float = 50.0  # one 400 Gb/s InfiniBand NIC per GPU
    sm_nvlink_gbps: float = PER_SM_COPY_GBPS  # measured per-SM copy rate of our kernels
    sm_rdma_gbps: float = PER_SM_COPY_GBPS  # per-SM rate of staging rows for RDMA puts (assumed)
    ll_fixed_us: float = 40.0  # low-latency fixed cost: launch, put latency, completion signal
    sms: int = 132  # SMs per GPU (H100 / H200 SXM): the GEMMs get what the communication leaves

    def ranks_per_node(self, ep: int) -> int:
        """Ranks of an EP group of ``ep`` inside one node (the whole group when it fits)."""
        return min(ep, self.gpus_per_node)

    def link_rates(self, link: str) -> tuple[float, float]:
        """(link GB/s, per-SM GB/s) of the ``"RDMA"`` or the ``"NVLink"`` link."""
        return (self.nic_gbps, self.sm_rdma_gbps) if link == "RDMA" else (self.nvlink_gbps, self.sm_nvlink_gbps)

    def link_seconds(self, rdma_bytes: float, nvlink_bytes: float) -> tuple[float, float]:
        """Seconds the RDMA and the NVLink share of a transfer take at the links' rates."""
        return seconds_at(rdma_bytes, self.nic_gbps), seconds_at(nvlink_bytes, self.nvlink_gbps)
