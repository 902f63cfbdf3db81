"""Exact rows per rank and link of given routings: the route of ``route.route_copies`` applied to
each (token, destination node) of real ``topk_idx`` tensors and counted instead of expected. Over
random routings the mean converges to ``route.routing``'s expectations (tests/tools/test_model.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .route import route_copies


LINK_FIELDS = ("rdma_sent", "rdma_recv", "deepep_rdma", "nvlink_sent", "nvlink_recv", "recv_rows")


@dataclass
class LinkCount:
    """Rows (x ``row_bytes``: bytes) per rank on each link of the two-level route, for one
    routing, counted exactly; lists indexed by rank. Rows only, no metadata.

    rdma_sent    rows the rank sends over the RDMA domain: one per (token, other destination node)
    rdma_recv    rows it receives over the RDMA domain as a landing rank (forwarder)
    deepep_rdma  (token, destination node) pairs of its tokens, own node included (DeepEP's
                 RDMA accounting; what the RDMA kernels handle, the own node's copy being local)
    nvlink_sent  rows it forwards over NVLink as the landing rank: tokens arriving from other
                 nodes and its own tokens, once per destination rank of its node but itself
    nvlink_recv  rows it receives over NVLink (its rank-major rows that did not land on it)
    recv_rows    rank-major rows it receives, own included (DeepEP's NVLink accounting)
    """

    num_ranks: int
    ranks_per_node: int
    row_bytes: int
    rdma_sent: list
    rdma_recv: list
    deepep_rdma: list
    nvlink_sent: list
    nvlink_recv: list
    recv_rows: list

    def __add__(self, other: "LinkCount") -> "LinkCount":
        if (self.num_ranks, self.ranks_per_node, self.row_bytes) != (other.num_ranks, other.ranks_per_node,
                                                                     other.row_bytes):
            raise ValueError("LinkCount: adding counts of different groups or row sizes")
        return LinkCount(self.num_ranks, self.ranks_per_node, self.row_bytes,
                         *[[a + b for a, b in zip(getattr(self, f), getattr(other, f))] for f in LINK_FIELDS])

    def bytes(self, name: str) -> list:
        """Bytes per rank of one field (``LINK_FIELDS``)."""
        return [v * self.row_bytes for v in getattr(self, name)]

    @property
    def rdma_bytes(self) -> list:
        return self.bytes("rdma_sent")

    @property
    def deepep_rdma_bytes(self) -> list:
        return self.bytes("deepep_rdma")

    @property
    def nvlink_bytes(self) -> list:
        return self.bytes("nvlink_sent")


def link_count_from(topk_idx, num_experts: int, num_ranks: int, ranks_per_node: int, rank: int,
                    row_bytes: int = 1) -> LinkCount:
    """What the tokens of one source rank put on each link, per rank (``rank``'s own sending
    counts and the landing / destination ranks' shares); ``route_copies`` applied per (token,
    destination node). ``topk_idx`` [T, K] global expert ids, -1 = unused slot."""
    import torch

    R, P_ = num_ranks, ranks_per_node
    if R < 1 or P_ < 1 or R % P_ or num_experts % R:
        raise ValueError(f"need ranks_per_node ({P_}) dividing ranks ({R}) and ranks dividing num_experts "
                         f"({num_experts})")
    if not 0 <= rank < R:
        raise ValueError(f"rank {rank} not in [0, {R})")
    idx = torch.as_tensor(topk_idx).to(torch.int64).cpu()
    if idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, K], got shape {tuple(idx.shape)}")
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
        raise ValueError(f"topk_idx holds ids outside [-1, {num_experts})")
    T, N = idx.shape[0], R // P_
    node, local = divmod(rank, P_)
    dst = torch.where(idx >= 0, idx // (num_experts // R) + 1, torch.zeros_like(idx))
    in_rank = torch.zeros((T, R + 1), dtype=torch.int64).scatter_(1, dst, 1)[:, 1:]  # [T, R]
    g = in_rank.view(T, N, P_)
    ranks = g.sum(2)  # [T, N] destination ranks per node
    nodes = (ranks > 0).to(torch.int64)
    own = torch.zeros(N, dtype=torch.int64)
    own[node] = 1
    c = route_copies(nodes, nodes * own, ranks, g[:, :, local])  # per (token, node): lands on (m, local)
    landing = torch.arange(N) * P_ + local

    def at(values, where) -> list:
        out = torch.zeros(R, dtype=torch.int64)
        out[where] += values
        return out.tolist()

    not_landed = g.clone()
    not_landed[:, :, local] = 0
    return LinkCount(
        num_ranks=R, ranks_per_node=P_, row_bytes=row_bytes,
        rdma_sent=at(c.rdma.sum(), rank), rdma_recv=at(c.rdma.sum(0), landing),
        deepep_rdma=at(c.deepep_rdma.sum(), rank),
        nvlink_sent=at(c.nvlink.sum(0), landing), nvlink_recv=not_landed.sum(0).flatten().tolist(),
        recv_rows=in_rank.sum(0).tolist())


def link_count(routings: Sequence, num_experts: int, ranks_per_node: int, row_bytes: int = 1) -> LinkCount:
    """Exact rows and bytes per rank on each link for every rank's routing (``routings[r]`` =
    rank r's topk_idx [T_r, K]): the sum of ``link_count_from`` over the source ranks."""
    R = len(routings)
    total = None
    for r, idx in enumerate(routings):
        c = link_count_from(idx, num_experts, R, ranks_per_node, r, row_bytes)
        total = c if total is None else total + c
    if total is None:
        raise ValueError("link_count: no routings")
    return total
