"""Analytic performance model of expert-parallel dispatch and combine (docs/design.md §1, §6).

Run ``python -m megatron_ep.model`` (``--help`` for the flags). The defaults are the DeepSeek-V3
training shape of docs/design.md §6: 4096 tokens per rank, hidden 7168, top-8 of 256 experts in 8 groups
with group-limited routing to 4 groups, FP8 dispatch, BF16 combine, 8 GPUs per node, and a
decode shape of 128 tokens per rank for the low-latency path.

Everything is a closed formula; nothing is sampled. The pieces:

* Routing (``expected_units_touched``): experts are laid out contiguously (rank ``r`` owns
  experts ``[r*E/R, (r+1)*E/R)``, node ``n`` owns its ranks' experts, group ``g`` is experts
  ``[g*E/G, (g+1)*E/G)``). A token picks ``topk_groups`` of the ``G`` groups uniformly, then
  ``topk`` distinct experts uniformly among the ``M = topk_groups*E/G`` experts of those
  groups. For a unit (node or rank), ``P(untouched) = sum_S P(S) * C(M - m_S, k) / C(M, k)``
  with ``m_S`` the unit's experts inside the selected groups ``S``; ``E[#units touched] = sum
  over units of (1 - P(untouched))``. Without a group limit (``topk_groups = G``) and with
  ``U`` equal units this is ``U * (1 - C(E - E/U, k) / C(E, k))``.
* Normal path (``normal_path``): rows are deduplicated per destination. One level (EP <= GPUs
  per node): a token crosses NVLink once per destination rank other than its own. Two levels:
  a token crosses RDMA once per destination node other than its own (to the same-index GPU
  there), then NVLink once per destination GPU in that node other than the one it landed on;
  tokens for the own node go straight over NVLink. ``route_copies`` is that route, the one
  definition: ``RDMA = nodes - own node``, ``NVLink = ranks - landed`` (destination nodes whose
  landing rank is itself a destination). Per rank and token, averaged over source ranks
  (``P(own node) = E[nodes]/N``, ``E[landed] = E[ranks]/P``): ``RDMA copies = E[nodes] *
  (N-1)/N``, ``NVLink copies = E[ranks] * (P-1)/P`` (``N`` nodes, ``P`` GPUs per node).
  ``link_count`` applies the same route to a given routing and counts the rows per rank and
  link exactly; over random routings its mean converges to these expectations
  (tests/test_model.py). Combine is the same route reversed (in-node reduction before RDMA), so
  the same copy counts with combine rows. Time = max over links of
  bytes / bandwidth (per direction; traffic is symmetric, so every rank sends and receives the
  same bytes). Row payload only (hidden + FP8 scales), no metadata.
* DeepEP accounting (docs/design.md §6): the GB/s its tests print: NVLink = received rows including the
  rank's own rows (``E[ranks]`` per token) x row bytes / time; RDMA = tokens x ``E[nodes]``
  including the own node x row bytes / time. Both exceed the physical link rate by design.
* Against DeepEP V1 (``deepep_internode_check``): EP16-EP64 in its RDMA accounting, with its
  test's routing (one group per node, min(nodes, 4) per token) at H800 NVLink, beside its
  published figures (``DEEPEP_V1_INTERNODE``).
* SMs: a link moving ``B`` bytes in time ``t`` needs ``ceil(B / t / per-SM rate)`` SMs; for the
  bounding link that is ``ceil(link bandwidth / per-SM rate)``.
* Two-level stages (``StageWork``, ``calibrate_stages``, ``predict_stages``; the model check of
  scripts/bench_normal.py): our internode path runs the RDMA-domain hop ((token, node) pairs x
  row bytes on its blocks), the in-node stage (rank-major rows x row bytes on the Buffer's SMs)
  and local reorder / fan-out work (bytes read + written, on the GPU) one after the other. Per-SM
  rates calibrated on one measured operation's phase marks predict the others from exact row
  counts (``link_count``): FP8 rows, expert-major layouts, other SM counts. ``split_sms`` /
  ``bounding_stage``: the SMs each copy stage would need if the two ran at once, so that both
  finish together, and which stage (its SMs, or its link) bounds.
* Low-latency path (``low_latency``): every (token, expert) copy goes straight to the expert's
  rank, no deduplication: ``T * k`` rows per rank, ``(EP-P)/EP`` of them over RDMA,
  ``(P-1)/EP`` over NVLink, ``1/EP`` local. Time = fixed latency + max over links of
  bytes / bandwidth.
* Training step (``step_fraction``): per rank and micro-batch, expert FLOPs per MoE layer are
  ``2 * T * k * hidden * moe_ffn * 3`` forward (three GEMMs of the expert MLP) and twice that
  backward; the rest of the model is ``6 * (active params - routed-expert active params)`` per
  token (attention-score FLOPs left out). Communication per MoE layer is forward dispatch +
  combine plus the same two backward (4 transfers). The main fraction assumes no overlap at
  all, ``comm / (comm + compute)``: an upper bound on the exposed communication under this
  model; the lower bound (perfect overlap) is ``max(comm - compute, 0) / max(comm, compute)``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

from .protocol import FP8_BLOCK
from .runtime import NVLINK_GBPS, PER_SM_COPY_GBPS

DEFAULT_EPS = (8, 16, 32, 64, 128, 256)
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
_EPS = 1e-9  # slack for ceilings of ratios computed in floating point


@dataclass(frozen=True)
class Shape:
    """What each rank sends: tokens per rank and the MoE routing."""

    tokens: int = 4096  # per rank, training / prefill (normal path)
    decode_tokens: int = 128  # per rank, decode (low-latency path)
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    groups: int = 8  # expert groups of the group-limited router
    topk_groups: int = 4  # groups each token may use (= groups: no limit)
    fp8_dispatch: bool = True  # dispatch rows: hidden bytes + one fp32 scale per 128 channels
    combine_elem_bytes: int = 2  # BF16 combine

    @property
    def dispatch_row_bytes(self) -> int:
        if self.fp8_dispatch:
            return self.hidden + math.ceil(self.hidden / FP8_BLOCK) * 4
        return 2 * self.hidden

    @property
    def combine_row_bytes(self) -> int:
        return self.combine_elem_bytes * self.hidden

    def check(self) -> None:
        if self.experts % self.groups:
            raise ValueError(f"experts ({self.experts}) must be a multiple of groups ({self.groups})")
        if not 1 <= self.topk_groups <= self.groups:
            raise ValueError(f"topk_groups ({self.topk_groups}) must be in [1, groups={self.groups}]")
        if not 1 <= self.topk <= self.topk_groups * (self.experts // self.groups):
            raise ValueError(f"topk ({self.topk}) must be in [1, experts of the selected groups]")


@dataclass(frozen=True)
class Machine:
    """Link and SM rates, GB/s = 1e9 bytes/s, unidirectional, per GPU."""

    gpus_per_node: int = 8
    nvlink_gbps: float = NVLINK_GBPS  # practical NVLink 4 on H100/H200 (~370 of 450); H800: ~160
    nic_gbps: float = 50.0  # one 400 Gb/s InfiniBand NIC per GPU
    sm_nvlink_gbps: float = PER_SM_COPY_GBPS  # measured per-SM copy rate of our kernels
    sm_rdma_gbps: float = PER_SM_COPY_GBPS  # per-SM rate of staging rows for RDMA puts (assumed)
    ll_fixed_us: float = 40.0  # low-latency fixed cost: launch, put latency, completion signal


@dataclass(frozen=True)
class StepModel:
    """A DeepSeek-V3 training step, per rank and micro-batch of ``Shape.tokens`` tokens."""

    ep: int = 64
    moe_ffn: int = 2048  # expert MLP intermediate size
    moe_layers: int = 58
    layers: int = 61
    active_params: float = 37e9  # activated parameters per token (DeepSeek-V3)
    tflops: float = 400.0  # achieved dense TFLOP/s per GPU


# ---------------------------------------------------------------------------------------------
# Routing


def _overlaps(lo: int, hi: int, group_size: int) -> tuple[int, ...]:
    """Sizes of the intersections of the expert range [lo, hi) with the groups it meets."""
    out = []
    g = lo // group_size
    while g * group_size < hi:
        a, b = max(lo, g * group_size), min(hi, (g + 1) * group_size)
        out.append(b - a)
        g += 1
    return tuple(out)


def _untouched(overlaps: tuple[int, ...], groups: int, topk_groups: int, group_size: int,
               topk: int) -> Fraction:
    """P(a token picks none of a unit's experts); the unit holds ``overlaps[i]`` experts of the
    i-th group it meets. Counts group selections by (groups of the unit chosen j, unit experts
    available m), then sum C(G-q, g-j) * C(M-m, k) / (C(G, g) * C(M, k))."""
    ways = {(0, 0): 1}
    for o in overlaps:
        nxt: dict[tuple[int, int], int] = {}
        for (j, m), c in ways.items():
            nxt[(j, m)] = nxt.get((j, m), 0) + c
            nxt[(j + 1, m + o)] = nxt.get((j + 1, m + o), 0) + c
        ways = nxt
    q = len(overlaps)
    avail = topk_groups * group_size
    num = sum(c * math.comb(groups - q, topk_groups - j) * math.comb(avail - m, topk)
              for (j, m), c in ways.items() if j <= topk_groups)
    return Fraction(num, math.comb(groups, topk_groups) * math.comb(avail, topk))


def expected_units_touched_exact(experts: int, units: int, groups: int, topk_groups: int,
                                 topk: int) -> Fraction:
    """E[#distinct units (nodes, ranks) a token's experts fall in], as an exact fraction.

    ``units`` and ``groups`` split the experts into equal contiguous blocks; they need not nest.
    """
    if experts % units or experts % groups:
        raise ValueError(f"experts ({experts}) must be a multiple of units ({units}) and groups ({groups})")
    if not 1 <= topk_groups <= groups or not 0 <= topk <= topk_groups * (experts // groups):
        raise ValueError("need 1 <= topk_groups <= groups and topk <= experts of the selected groups")
    us, gs = experts // units, experts // groups
    memo: dict[tuple[int, ...], Fraction] = {}
    total = Fraction(0)
    for u in range(units):
        ov = _overlaps(u * us, (u + 1) * us, gs)
        if ov not in memo:
            memo[ov] = 1 - _untouched(ov, groups, topk_groups, gs, topk)
        total += memo[ov]
    return total


def expected_units_touched(experts: int, units: int, groups: int, topk_groups: int, topk: int) -> float:
    """Float of ``expected_units_touched_exact`` (see the module docstring for the formula)."""
    return float(expected_units_touched_exact(experts, units, groups, topk_groups, topk))


def max_units_touched(experts: int, units: int, groups: int, topk_groups: int, topk: int) -> int:
    """Worst case #units a token touches, for units and groups that nest either way."""
    us, gs = experts // units, experts // groups
    if us % gs and gs % us:
        raise ValueError("units and groups must nest (one block size a multiple of the other)")
    reachable = topk_groups * max(1, gs // us)  # units met by the selected groups, at most
    return min(topk, units, reachable)


# ---------------------------------------------------------------------------------------------
# The two-level route: one definition for the exact counts and the expectations


@dataclass(frozen=True)
class RouteCopies:
    """Rows one token (or one (token, destination node) pair) puts on each link."""

    rdma: Any  # over the RDMA domain, to the source's same-index rank of another node
    nvlink: Any  # over NVLink inside a node, from the rank the token landed on
    deepep_rdma: Any  # DeepEP's RDMA accounting: destination nodes, the own node included
    deepep_nvlink: Any  # DeepEP's NVLink accounting: destination ranks, the own rank included


def route_copies(nodes, own_node, ranks, landed) -> RouteCopies:
    """The normal path's route (docs/design.md §1), the one definition every count here uses.

    A token of rank (node n, local l) goes once to every destination node m, landing on rank
    (m, l) -- over the RDMA domain when m != n, on the source itself when m == n -- and from the
    landing rank once over NVLink to every destination rank of m other than itself. So
    ``rdma = nodes - own_node`` and ``nvlink = ranks - landed``, with ``nodes`` the destination
    nodes (own included), ``own_node`` 1 when the own node is one of them, ``ranks`` the
    destination ranks and ``landed`` the destination nodes whose landing rank is itself a
    destination. One node is the case N = 1 (landing rank = the source).

    Linear in its arguments, so it serves per (token, node) pair, per token (sums over nodes) and
    in expectation (expected arguments give expected copies): exact counts pass tensors
    (``link_count``), the analytic model passes expectations (``routing``)."""
    return RouteCopies(rdma=nodes - own_node, nvlink=ranks - landed, deepep_rdma=nodes, deepep_nvlink=ranks)


@dataclass(frozen=True)
class Routing:
    """Expected per-token fan-out at one EP size (uniform group-limited routing)."""

    ep: int
    nodes: int
    ranks_per_node: int
    nodes_touched: float  # E[#distinct nodes], own node included
    ranks_touched: float  # E[#distinct ranks], own rank included
    max_nodes: int
    rdma_copies: float  # E[#nodes other than the own one] = nodes_touched * (N-1)/N
    nvlink_copies: float  # E[#NVLink hops]: ranks_touched * (P-1)/P

    @property
    def ranks_per_touched_node(self) -> float:
        """E[#distinct GPUs of a node a token reaches, given it reaches that node]."""
        return self.ranks_touched / self.nodes_touched


def routing(shape: Shape, machine: Machine, ep: int) -> Routing:
    """Fan-out of one token at EP size ``ep`` (``ep`` ranks, ``gpus_per_node`` per node)."""
    shape.check()
    p = min(ep, machine.gpus_per_node)
    if ep % p or shape.experts % ep:
        raise ValueError(f"EP {ep}: need EP a multiple of GPUs per node ({machine.gpus_per_node}) "
                         f"when larger, and experts ({shape.experts}) a multiple of EP")
    n = ep // p
    rule = (shape.groups, shape.topk_groups, shape.topk)
    e_nodes = expected_units_touched_exact(shape.experts, n, *rule)
    e_ranks = expected_units_touched_exact(shape.experts, ep, *rule)
    # averaged over source ranks: P(own node touched) = E[nodes] / N, and the landing ranks (one
    # local index l over the nodes) are destinations E[ranks] / P times on average over l
    c = route_copies(e_nodes, e_nodes / n, e_ranks, e_ranks / p)
    return Routing(ep=ep, nodes=n, ranks_per_node=p, nodes_touched=float(e_nodes), ranks_touched=float(e_ranks),
                   max_nodes=max_units_touched(shape.experts, n, *rule),
                   rdma_copies=float(c.rdma), nvlink_copies=float(c.nvlink))


# ---------------------------------------------------------------------------------------------
# Exact per-link rows of one routing (the same route, counted instead of expected)


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


# ---------------------------------------------------------------------------------------------
# Copy stages bounded by their SMs (the bench's model check)


def per_sm_gbps(rows: float, row_bytes: int, time_us: float, sms: int) -> float:
    """Measured per-SM rate of a copy stage: rows x row bytes / time / SMs, GB/s."""
    return rows * row_bytes / (time_us * 1e-6) / sms / 1e9


def sm_bound_us(rows: float, row_bytes: int, sms: int, per_sm: float) -> float:
    """Time of a copy stage bounded by its SMs: rows x row bytes / (SMs x per-SM rate), µs."""
    return rows * row_bytes / (sms * per_sm * 1e9) * 1e6


# ---------------------------------------------------------------------------------------------
# The two-level path's stages, timed from per-SM rates calibrated on one measured operation
# (the bench's model check)
#
# An internode normal dispatch runs three stages one after the other (paths/internode.py):
#   rdma   the RDMA-domain hop: every (token, destination node) pair, the own node's included
#          (the same kernels copy it locally), on the path's RDMA blocks;
#   node   the in-node stage (the intranode path over the node's ranks): the rank-major rows it
#          delivers, on the Buffer's SMs;
#   local  local HBM work on the rank's whole share of the GPU: the reorder into the contract's
#          order (a torch index_select / index_copy_) and the expert-major fan-out; counted as
#          bytes read + written, at a per-GPU rate (it does not scale with --num-sms);
# plus `fixed`: measured terms the model has no formula for (the notify kernel), added as they
# are. Combine runs the same stages in reverse. Rates are calibrated per direction (dispatch on
# a dispatch, combine on a combine): the kernels differ (the combine's hop sums in fp32, its
# reorder scatters).

TIME_TOLERANCE = 0.25  # predicted/measured within 1 +- this: "within 25%"
STAGES = ("rdma", "node", "local", "fixed")
STAGE_NAMES = {"rdma": "RDMA hop", "node": "in-node stage", "local": "local reorder", "fixed": "notify"}
# The internode path's phase marks (Runtime.mark in paths/internode.py and paths/intranode.py) ->
# stage. "reduce" (expert-major combine) takes the place of the staging copy ("stage"): both
# write the rows that cross the in-node stage into the combine area. "fanout" spreads the
# received rank-major rows into expert segments on the local SMs, as the reorder does.
STAGE_OF_MARK = {"rdma": "rdma", "notify": "fixed", "stage": "node", "push": "node", "pull": "node",
                 "reduce": "node", "fanout": "local", "reorder": "local"}


@dataclass(frozen=True)
class StageWork:
    """What one two-level operation moves per rank in each stage, and on how many SMs."""

    rdma_bytes: float  # (token, node) pairs x row bytes
    node_bytes: float  # rank-major rows x the row bytes that cross the in-node stage
    local_bytes: float  # bytes the local reorder / fan-out read and write
    blocks: int  # the RDMA-domain kernels' blocks
    sms: int  # the in-node stage's SMs
    fixed_us: float = 0.0  # measured terms without a formula (notify)


@dataclass(frozen=True)
class StageRates:
    """Calibrated rates, GB/s: per block of the RDMA hop, per SM of the in-node stage, and of
    the local work on the rank's GPU share (bytes read + written)."""

    rdma_per_sm: float
    node_per_sm: float
    local_gbps: float


@dataclass(frozen=True)
class StageTimes:
    """µs per stage of one operation (measured phases or a prediction)."""

    rdma_us: float = 0.0
    node_us: float = 0.0
    local_us: float = 0.0
    fixed_us: float = 0.0

    def of(self, stage: str) -> float:
        return getattr(self, f"{stage}_us")

    @property
    def total_us(self) -> float:
        return self.rdma_us + self.node_us + self.local_us + self.fixed_us


def dispatch_stage_work(pairs: float, rows: float, row_bytes: int, blocks: int, sms: int,
                        expert_rows: float | None = None, fixed_us: float = 0.0) -> StageWork:
    """A two-level dispatch of ``row_bytes`` rows (bf16: 2H; FP8: H + H/128 x 4 scale bytes):
    ``pairs`` (token, node) pairs over the hop, ``rows`` rank-major rows through the in-node
    stage; local work: rank-major, the reorder reads and writes ``rows`` rows; expert-major, the
    fan-out reads ``rows`` and writes ``expert_rows`` (padding included) and the reorder reads
    and writes ``expert_rows``."""
    local = 2 * rows if expert_rows is None else rows + 3 * expert_rows
    return StageWork(pairs * row_bytes, rows * row_bytes, local * row_bytes, blocks, sms, fixed_us)


def combine_stage_work(pairs: float, rows: float, hidden: int, blocks: int, sms: int,
                       expert_rows: float | None = None, partials: bool = True,
                       elem_bytes: int = 2) -> StageWork:
    """A two-level combine of rows of ``hidden`` x ``elem_bytes`` (bf16): the reorder back to
    the in-node stage's order reads and writes the input rows (``rows`` rank-major, or
    ``expert_rows``); the in-node stage carries ``rows`` rank-major rows -- expert-major with
    ``partials``, each a token's rows of the rank pre-summed in fp32 (4 x hidden bytes), else
    every expert row; the hop carries ``pairs`` rows back."""
    row = hidden * elem_bytes
    if expert_rows is None:
        node, local = rows * row, 2 * rows * row
    else:
        node = rows * 4 * hidden if partials else expert_rows * row
        local = 2 * expert_rows * row
    return StageWork(pairs * row, node, local, blocks, sms)


def phase_stages(phases: dict) -> StageTimes:
    """The internode path's phase marks ({mark: µs}) summed into the stages (``STAGE_OF_MARK``;
    a mark it does not know is the intranode path's, so the in-node stage's)."""
    t = {s: 0.0 for s in STAGES}
    for mark, us in phases.items():
        t[STAGE_OF_MARK.get(mark, "node")] += us
    return StageTimes(*(t[s] for s in STAGES))


def calibrate_stages(work: StageWork, measured: StageTimes) -> StageRates:
    """Rates of one measured operation's phases: hop bytes / time / blocks, in-node bytes /
    time / SMs, local bytes / time."""
    for stage, nbytes in (("rdma", work.rdma_bytes), ("node", work.node_bytes), ("local", work.local_bytes)):
        if not (nbytes > 0 and measured.of(stage) > 0):
            raise ValueError(f"calibrate_stages: the {STAGE_NAMES[stage]} needs bytes and a measured time "
                             f"(got {nbytes} B in {measured.of(stage)} µs)")
    return StageRates(rdma_per_sm=per_sm_gbps(work.rdma_bytes, 1, measured.rdma_us, work.blocks),
                      node_per_sm=per_sm_gbps(work.node_bytes, 1, measured.node_us, work.sms),
                      local_gbps=work.local_bytes / (measured.local_us * 1e-6) / 1e9)


def predict_stages(work: StageWork, rates: StageRates) -> StageTimes:
    """Each stage's time at the calibrated rates (SM-bound: bytes / (SMs x per-SM rate))."""
    return StageTimes(rdma_us=sm_bound_us(work.rdma_bytes, 1, work.blocks, rates.rdma_per_sm),
                      node_us=sm_bound_us(work.node_bytes, 1, work.sms, rates.node_per_sm),
                      local_us=work.local_bytes / (rates.local_gbps * 1e9) * 1e6, fixed_us=work.fixed_us)


def within(ratio: float, tol: float = TIME_TOLERANCE) -> bool:
    return abs(ratio - 1) <= tol


def verdict(ratio: float, tol: float = TIME_TOLERANCE) -> str:
    return f"{'within' if within(ratio, tol) else 'OUTSIDE'} {100 * tol:g}%"


@dataclass(frozen=True)
class TimeCheck:
    """A prediction of one operation against its measurement: per stage (when its phases were
    traced) and in total against the measured time per call."""

    name: str
    predicted: StageTimes
    measured: StageTimes | None  # the operation's own phase marks (None: not traced)
    call_us: float  # measured µs per call

    def stage_ratio(self, stage: str) -> float | None:
        if self.measured is None or self.measured.of(stage) <= 0:
            return None
        return self.predicted.of(stage) / self.measured.of(stage)

    @property
    def ratio(self) -> float:
        return self.predicted.total_us / self.call_us

    @property
    def within(self) -> bool:
        return within(self.ratio)

    @property
    def outside_marks_us(self) -> float | None:
        """The measured call time outside the phase marks (host work, launches, counts)."""
        return None if self.measured is None else self.call_us - self.measured.total_us


def check_stages(name: str, work: StageWork, rates: StageRates, call_us: float,
                 measured: StageTimes | None = None) -> TimeCheck:
    return TimeCheck(name, predict_stages(work, rates), measured, call_us)


# ---------------------------------------------------------------------------------------------
# The two-level path's SM split, if its two copy stages ran at once on one SM budget


def stage_us(nbytes: float, sms: float, per_sm: float, link_bytes: float | None = None,
             link_gbps: float | None = None) -> float:
    """One stage on ``sms`` SMs: max(bytes / (SMs x per-SM rate), link bytes / link rate), µs
    (``link_bytes``: what crosses the link, default ``nbytes``; no link term without a rate)."""
    if nbytes <= 0:
        return 0.0
    t = nbytes / (sms * per_sm * 1e9) * 1e6 if sms > 0 else math.inf
    if link_gbps:
        t = max(t, (nbytes if link_bytes is None else link_bytes) / (link_gbps * 1e9) * 1e6)
    return t


@dataclass(frozen=True)
class StageBound:
    """Which of the two stages finishes last, and whether its SMs or its link limit it."""

    stage: str  # "rdma" or "node"
    limited_by: str  # "SMs" or "link"
    rdma_us: float
    node_us: float

    @property
    def time_us(self) -> float:
        return max(self.rdma_us, self.node_us)

    def describe(self) -> str:
        link = {"rdma": "the NIC", "node": "NVLink"}[self.stage]
        return f"the {STAGE_NAMES[self.stage]} ({'its SMs' if self.limited_by == 'SMs' else link})"


def bounding_stage(rdma_bytes: float, node_bytes: float, rdma_sms: float, node_sms: float, rdma_per_sm: float,
                   node_per_sm: float, *, nic_gbps: float | None = None, rdma_link_bytes: float | None = None,
                   nvlink_gbps: float | None = None, node_link_bytes: float | None = None) -> StageBound:
    """Which link bounds the two-level path when the RDMA hop runs on ``rdma_sms`` and the
    in-node stage on ``node_sms`` at once: the stage that takes longer (ties: the hop), limited
    by its SMs or, with a link rate given, by its link (``*_link_bytes``: what crosses it, e.g.
    only the remote rows over the NIC)."""
    sm_r, sm_n = stage_us(rdma_bytes, rdma_sms, rdma_per_sm), stage_us(node_bytes, node_sms, node_per_sm)
    t_r = stage_us(rdma_bytes, rdma_sms, rdma_per_sm, rdma_link_bytes, nic_gbps)
    t_n = stage_us(node_bytes, node_sms, node_per_sm, node_link_bytes, nvlink_gbps)
    stage, sm_time, t = ("rdma", sm_r, t_r) if t_r >= t_n else ("node", sm_n, t_n)
    return StageBound(stage, "SMs" if sm_time >= t else "link", t_r, t_n)


@dataclass(frozen=True)
class SmSplit:
    total_sms: int
    rdma_sms: int
    node_sms: int
    bound: StageBound
    ideal_us: float  # the continuous optimum: max((w_rdma + w_node) / SMs, link times), w = bytes / per-SM rate

    @property
    def time_us(self) -> float:
        return self.bound.time_us


def split_sms(total_sms: int, rdma_bytes: float, node_bytes: float, rdma_per_sm: float, node_per_sm: float, *,
              nic_gbps: float | None = None, rdma_link_bytes: float | None = None, nvlink_gbps: float | None = None,
              node_link_bytes: float | None = None) -> SmSplit:
    """SMs for the RDMA hop and the in-node stage if they ran at once (fused, as DeepEP's
    kernel) on ``total_sms``: the integer split that finishes soonest (ties: the smaller sum of
    the two times, so no SMs idle on a stage its link bounds). Without link limits both finish
    together at the hop's share ``w_rdma / (w_rdma + w_node)`` of the SMs, and the time equals
    the two stages run one after the other on all the SMs: overlap gains only where a link, not
    the SMs, bounds."""
    caps = dict(nic_gbps=nic_gbps, rdma_link_bytes=rdma_link_bytes, nvlink_gbps=nvlink_gbps,
                node_link_bytes=node_link_bytes)
    need_r, need_n = rdma_bytes > 0, node_bytes > 0
    if total_sms < need_r + need_n:
        raise ValueError(f"split_sms: {total_sms} SMs cannot run {need_r + need_n} stages")
    if not (need_r and need_n):
        cands = [(total_sms, 0)] if need_r else [(0, total_sms)]
    else:
        cands = [(a, total_sms - a) for a in range(1, total_sms)]
    best = None
    for a, b in cands:
        bd = bounding_stage(rdma_bytes, node_bytes, a, b, rdma_per_sm, node_per_sm, **caps)
        key = (bd.time_us, bd.rdma_us + bd.node_us)
        if best is None or key < best[0]:
            best = (key, a, b, bd)
    _, a, b, bd = best
    work = (rdma_bytes / rdma_per_sm + node_bytes / node_per_sm) / 1e9 * 1e6  # SM-µs
    links = [stage_us(rdma_bytes, math.inf, 1.0, rdma_link_bytes, nic_gbps) if nic_gbps else 0.0,
             stage_us(node_bytes, math.inf, 1.0, node_link_bytes, nvlink_gbps) if nvlink_gbps else 0.0]
    return SmSplit(total_sms, a, b, bd, max(work / total_sms, *links))


# ---------------------------------------------------------------------------------------------
# Normal path


def sms_for(rate_gbps: float, per_sm_gbps: float) -> int:
    """SMs whose copy rate covers ``rate_gbps``: ceil(rate / per-SM rate)."""
    return math.ceil(rate_gbps / per_sm_gbps - _EPS) if rate_gbps > 0 else 0


@dataclass(frozen=True)
class NormalResult:
    ep: int
    two_level: bool
    row_bytes: int
    rdma_bytes: float  # per rank, one direction
    nvlink_bytes: float
    time_us: float
    bound: str  # "RDMA" or "NVLink"
    deepep_rdma_gbps: float  # DeepEP accounting (0 on one level)
    deepep_nvlink_gbps: float
    sms_bound: int  # SMs that saturate the bounding link
    sms_all: int  # SMs for every link at the rate it runs during time_us


def normal_path(shape: Shape, machine: Machine, ep: int, row_bytes: int,
                tokens: int | None = None) -> NormalResult:
    """Bytes, time, DeepEP-accounting GB/s and SMs of one normal dispatch or combine."""
    r = routing(shape, machine, ep)
    t = shape.tokens if tokens is None else tokens
    rdma = t * r.rdma_copies * row_bytes
    nvl = t * r.nvlink_copies * row_bytes
    t_rdma = rdma / (machine.nic_gbps * 1e9)
    t_nvl = nvl / (machine.nvlink_gbps * 1e9)
    time_s = max(t_rdma, t_nvl)
    bound = "RDMA" if t_rdma > t_nvl else "NVLink"
    two = r.nodes > 1
    if time_s == 0:
        return NormalResult(ep, two, row_bytes, 0.0, 0.0, 0.0, bound, 0.0, 0.0, 0, 0)
    sms_bound = sms_for(machine.nic_gbps if bound == "RDMA" else machine.nvlink_gbps,
                        machine.sm_rdma_gbps if bound == "RDMA" else machine.sm_nvlink_gbps)
    sms_all = (sms_for(rdma / time_s / 1e9, machine.sm_rdma_gbps)
               + sms_for(nvl / time_s / 1e9, machine.sm_nvlink_gbps))
    return NormalResult(
        ep=ep, two_level=two, row_bytes=row_bytes, rdma_bytes=rdma, nvlink_bytes=nvl,
        time_us=time_s * 1e6, bound=bound,
        deepep_rdma_gbps=(t * r.nodes_touched * row_bytes / time_s / 1e9) if two else 0.0,
        deepep_nvlink_gbps=t * r.ranks_touched * row_bytes / time_s / 1e9,
        sms_bound=sms_bound, sms_all=sms_all)


# ---------------------------------------------------------------------------------------------
# Low-latency path


@dataclass(frozen=True)
class LowLatencyResult:
    ep: int
    row_bytes: int
    total_bytes: float  # every (token, expert) copy a rank sends, local ones included
    rdma_bytes: float
    nvlink_bytes: float
    time_us: float


def low_latency(shape: Shape, machine: Machine, ep: int, row_bytes: int,
                tokens: int | None = None) -> LowLatencyResult:
    """One low-latency dispatch or combine: ``T*k`` copies, fixed latency + max link time."""
    p = min(ep, machine.gpus_per_node)
    t = shape.decode_tokens if tokens is None else tokens
    total = t * shape.topk * row_bytes
    rdma = total * (ep - p) / ep
    nvl = total * (p - 1) / ep
    time_s = max(rdma / (machine.nic_gbps * 1e9), nvl / (machine.nvlink_gbps * 1e9))
    return LowLatencyResult(ep, row_bytes, total, rdma, nvl, machine.ll_fixed_us + time_s * 1e6)


# ---------------------------------------------------------------------------------------------
# Training step


@dataclass(frozen=True)
class StepResult:
    ep: int
    expert_flops: float  # per rank, all MoE layers, forward + backward
    other_flops: float  # per rank, 6 * non-routed active params * tokens
    compute_ms: float
    comm_ms: float  # all MoE layers, 2 dispatches + 2 combines each
    comm_per_layer_us: float
    fraction: float  # comm / (comm + compute), no overlap: an upper bound
    fraction_overlapped: float  # max(comm - compute, 0) / max(comm, compute): perfect overlap


def step_fraction(shape: Shape, machine: Machine, step: StepModel) -> StepResult:
    """Share of a training step spent in dispatch/combine if nothing overlaps (upper bound)."""
    t, k, h, f = shape.tokens, shape.topk, shape.hidden, step.moe_ffn
    expert_fwd = 2 * t * k * h * f * 3  # gate, up, down GEMMs over T*k rows
    expert = step.moe_layers * 3 * expert_fwd  # backward = 2x forward
    routed_params = step.moe_layers * k * 3 * h * f
    other = 6 * max(step.active_params - routed_params, 0.0) * t
    compute_s = (expert + other) / (step.tflops * 1e12)
    per_layer_us = 2 * (normal_path(shape, machine, step.ep, shape.dispatch_row_bytes).time_us
                        + normal_path(shape, machine, step.ep, shape.combine_row_bytes).time_us)
    comm_s = step.moe_layers * per_layer_us * 1e-6
    return StepResult(step.ep, expert, other, compute_s * 1e3, comm_s * 1e3, per_layer_us,
                      comm_s / (comm_s + compute_s),
                      max(comm_s - compute_s, 0.0) / max(comm_s, compute_s))


# ---------------------------------------------------------------------------------------------
# CLI


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def report(shape: Shape, machine: Machine, step: StepModel, eps: list[int]) -> str:
    out = []
    d_row, c_row = shape.dispatch_row_bytes, shape.combine_row_bytes
    out.append(
        f"megatron_ep analytic model: {shape.tokens} tokens/rank, hidden {shape.hidden}, "
        f"top-{shape.topk} of {shape.experts} experts, {shape.groups} groups, "
        f"{shape.topk_groups} per token; dispatch {'FP8' if shape.fp8_dispatch else 'BF16'} "
        f"{d_row} B/row, combine {c_row} B/row")
    out.append(
        f"machine: {machine.gpus_per_node} GPUs/node, NVLink {machine.nvlink_gbps:g} GB/s, "
        f"NIC {machine.nic_gbps:g} GB/s per GPU; per SM {machine.sm_nvlink_gbps:g} GB/s (NVLink copy), "
        f"{machine.sm_rdma_gbps:g} GB/s (RDMA issue)")

    rs = [routing(shape, machine, ep) for ep in eps]
    out.append("\nrouting (expected per token, uniform group-limited routing, exact)")
    out.append(_table(
        ["EP", "nodes", "E[nodes]", "max", "E[RDMA copies]", "E[ranks]", "E[GPUs/touched node]",
         "E[NVLink copies]"],
        [[str(r.ep), str(r.nodes), f"{r.nodes_touched:.2f}", str(r.max_nodes), f"{r.rdma_copies:.2f}",
          f"{r.ranks_touched:.2f}", f"{r.ranks_per_touched_node:.2f}", f"{r.nvlink_copies:.2f}"]
         for r in rs]))

    for name, row in (("dispatch", d_row), ("combine", c_row)):
        res = [normal_path(shape, machine, ep, row) for ep in eps]
        out.append(f"\nnormal {name} ({row} B/row), per rank; GB/s in DeepEP's accounting")
        out.append(_table(
            ["EP", "path", "RDMA MB", "NVLink MB", "time us", "bound", "RDMA GB/s", "NVL GB/s",
             "SMs bound", "SMs all"],
            [[str(x.ep), "2-level" if x.two_level else "1-level", f"{x.rdma_bytes / 1e6:.1f}",
              f"{x.nvlink_bytes / 1e6:.1f}", f"{x.time_us:.0f}", x.bound,
              f"{x.deepep_rdma_gbps:.0f}" if x.two_level else "-", f"{x.deepep_nvlink_gbps:.0f}",
              str(x.sms_bound), str(x.sms_all)] for x in res]))

    out.append(deepep_internode_check(shape, machine))

    out.append(f"\nlow-latency ({shape.decode_tokens} tokens/rank, every (token, expert) copy sent, "
               f"fixed {machine.ll_fixed_us:g} us + bytes/bandwidth)")
    rows = []
    for ep in eps:
        d = low_latency(shape, machine, ep, d_row)
        c = low_latency(shape, machine, ep, c_row)
        rows.append([str(ep), f"{d.total_bytes / 1e6:.2f}", f"{d.rdma_bytes / 1e6:.2f}",
                     f"{d.nvlink_bytes / 1e6:.2f}", f"{d.time_us:.0f}", f"{c.total_bytes / 1e6:.2f}",
                     f"{c.rdma_bytes / 1e6:.2f}", f"{c.nvlink_bytes / 1e6:.2f}", f"{c.time_us:.0f}"])
    out.append(_table(["EP", "disp MB", "RDMA MB", "NVL MB", "disp us", "comb MB", "RDMA MB",
                       "NVL MB", "comb us"], rows))

    s = step_fraction(shape, machine, step)
    out.append(
        f"\ntraining step at EP{s.ep} ({step.moe_layers} MoE of {step.layers} layers, expert FFN "
        f"{step.moe_ffn}, {step.active_params / 1e9:g}B active params, {step.tflops:g} TFLOP/s), "
        f"per rank and micro-batch:")
    out.append(f"  compute {s.compute_ms:.0f} ms (experts {s.expert_flops / 1e12:.0f} TFLOP, "
               f"rest {s.other_flops / 1e12:.0f} TFLOP); dispatch+combine fwd+bwd "
               f"{s.comm_per_layer_us:.0f} us per MoE layer, {s.comm_ms:.0f} ms in all")
    out.append(f"  communication share with no overlap: {100 * s.fraction:.1f}% "
               f"(an upper bound: any overlap lowers it); with perfect overlap "
               f"{100 * s.fraction_overlapped:.1f}% (the lower bound)")
    return "\n".join(out)


def deepep_internode_check(shape: Shape, machine: Machine) -> str:
    """EP16-EP64 two-level predictions in DeepEP's RDMA accounting beside its published figures,
    with DeepEP's test routing (one group per node, min(nodes, 4) per token) and H800 NVLink."""
    m = Machine(gpus_per_node=machine.gpus_per_node, nvlink_gbps=H800_NVLINK_GBPS, nic_gbps=machine.nic_gbps,
                sm_nvlink_gbps=machine.sm_nvlink_gbps, sm_rdma_gbps=machine.sm_rdma_gbps)
    rows = []
    for ep, (pub_d, pub_c) in sorted(DEEPEP_V1_INTERNODE.items()):
        n = ep // m.gpus_per_node
        if ep % m.gpus_per_node or n < 2 or shape.experts % ep or shape.experts % n:
            continue
        s = Shape(tokens=shape.tokens, hidden=shape.hidden, topk=shape.topk, experts=shape.experts, groups=n,
                  topk_groups=min(n, 4), fp8_dispatch=True, combine_elem_bytes=2)
        d, c = normal_path(s, m, ep, s.dispatch_row_bytes), normal_path(s, m, ep, s.combine_row_bytes)
        r = routing(s, m, ep)
        rows.append([str(ep), str(n), f"{r.nodes_touched:.2f}", d.bound, f"{d.deepep_rdma_gbps:.0f}", f"{pub_d:g}",
                     f"{d.deepep_rdma_gbps / pub_d:.2f}", f"{c.deepep_rdma_gbps:.0f}", f"{pub_c:g}",
                     f"{c.deepep_rdma_gbps / pub_c:.2f}"])
    head = (f"\ntwo-level vs DeepEP V1 published: RDMA GB/s in DeepEP's accounting ((token, node) pairs incl. own "
            f"node x row bytes / time)\n  model at NVLink {H800_NVLINK_GBPS:g} GB/s (H800), NIC {m.nic_gbps:g} GB/s, "
            f"DeepEP's test routing (groups = nodes, min(nodes, 4) per token), FP8 dispatch, BF16 combine\n"
            f"  published: {DEEPEP_V1_SOURCE}")
    if not rows:
        return head + "\n  (no EP16-EP64 two-level case at this --gpus-per-node / --experts)"
    return head + "\n" + _table(["EP", "nodes", "E[nodes]", "bound", "disp model", "DeepEP", "ratio", "comb model",
                                 "DeepEP", "ratio"], rows)


def build_parser() -> argparse.ArgumentParser:
    from .cli import ArgumentParser

    S, M, T = Shape(), Machine(), StepModel()
    p = ArgumentParser(
        prog="python -m megatron_ep.model",
        description="Analytic model of EP dispatch/combine: bytes per link, time, DeepEP-style "
                    "GB/s, SMs, low-latency time and the communication share of a training step.")
    p.add_argument("--ep", type=int, nargs="+", default=list(DEFAULT_EPS), help="EP sizes to tabulate")
    g = p.add_argument_group("shape")
    g.add_argument("--tokens", type=int, default=S.tokens, help="tokens per rank, normal path")
    g.add_argument("--decode-tokens", type=int, default=S.decode_tokens, help="tokens per rank, low-latency path")
    g.add_argument("--hidden", type=int, default=S.hidden,
                   help="hidden size (a multiple of 128 with FP8 dispatch: one scale per 128 channels)")
    g.add_argument("--topk", type=int, default=S.topk, help="experts per token")
    g.add_argument("--experts", type=int, default=S.experts, help="routed experts (a multiple of --groups and of each EP)")
    g.add_argument("--groups", type=int, default=S.groups, help="expert groups of the router")
    g.add_argument("--topk-groups", type=int, default=S.topk_groups,
                   help="groups a token may use (= --groups: no group limit)")
    g.add_argument("--bf16-dispatch", action="store_true", help="BF16 dispatch rows instead of FP8 + scales")
    m = p.add_argument_group("machine (GB/s = 1e9 B/s, one direction, per GPU)")
    m.add_argument("--gpus-per-node", type=int, default=M.gpus_per_node, help="GPUs per NVLink domain (node)")
    m.add_argument("--nvlink-gbps", type=float, default=M.nvlink_gbps,
                   help="practical NVLink bandwidth: ~370 H100/H200 (of 450), ~160 H800")
    m.add_argument("--nic-gbps", type=float, default=M.nic_gbps, help="NIC bandwidth (400 Gb/s IB = 50)")
    m.add_argument("--sm-nvlink-gbps", type=float, default=M.sm_nvlink_gbps,
                   help="bytes/s one SM copies (measured, megatron_ep.runtime.PER_SM_COPY_GBPS)")
    m.add_argument("--sm-rdma-gbps", type=float, default=M.sm_rdma_gbps,
                   help="bytes/s one SM stages and issues as RDMA puts (assumed = the copy rate)")
    m.add_argument("--ll-fixed-us", type=float, default=M.ll_fixed_us,
                   help="low-latency fixed cost per call (DeepEP V1 H800 figures exceed "
                        "bytes/bandwidth by 34-57 us)")
    t = p.add_argument_group("training step")
    t.add_argument("--step-ep", type=int, default=T.ep, help="EP size of the training-step estimate")
    t.add_argument("--moe-ffn", type=int, default=T.moe_ffn, help="expert MLP intermediate size")
    t.add_argument("--moe-layers", type=int, default=T.moe_layers, help="MoE layers (at most --layers)")
    t.add_argument("--layers", type=int, default=T.layers, help="transformer layers in all")
    t.add_argument("--active-params", type=float, default=T.active_params,
                   help="activated parameters per token (DeepSeek-V3: 37e9)")
    t.add_argument("--tflops", type=float, default=T.tflops, help="achieved TFLOP/s per GPU")
    return p


def _validate(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Sizes and rates the formulas divide by: refused with one line before any arithmetic."""
    for name in ("tokens", "decode_tokens", "hidden", "topk", "experts", "groups", "topk_groups", "gpus_per_node",
                 "step_ep", "moe_ffn", "moe_layers", "layers"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("nvlink_gbps", "nic_gbps", "sm_nvlink_gbps", "sm_rdma_gbps", "active_params", "tflops"):
        if not getattr(a, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if a.ll_fixed_us < 0:
        parser.error(f"--ll-fixed-us must be >= 0, got {a.ll_fixed_us}")
    bad = [ep for ep in a.ep if ep < 1]
    if bad:
        parser.error(f"--ep sizes must be >= 1, got {bad}")
    if a.moe_layers > a.layers:
        parser.error(f"--moe-layers {a.moe_layers} is more than --layers {a.layers}")
    if not a.bf16_dispatch and a.hidden % FP8_BLOCK:
        parser.error(f"--hidden {a.hidden} must be a multiple of {FP8_BLOCK} for FP8 dispatch (one scale per "
                     f"{FP8_BLOCK} channels), or pass --bf16-dispatch")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    _validate(parser, a)
    shape = Shape(tokens=a.tokens, decode_tokens=a.decode_tokens, hidden=a.hidden, topk=a.topk,
                  experts=a.experts, groups=a.groups, topk_groups=a.topk_groups,
                  fp8_dispatch=not a.bf16_dispatch)
    machine = Machine(gpus_per_node=a.gpus_per_node, nvlink_gbps=a.nvlink_gbps, nic_gbps=a.nic_gbps,
                      sm_nvlink_gbps=a.sm_nvlink_gbps, sm_rdma_gbps=a.sm_rdma_gbps,
                      ll_fixed_us=a.ll_fixed_us)
    step = StepModel(ep=a.step_ep, moe_ffn=a.moe_ffn, moe_layers=a.moe_layers, layers=a.layers,
                     active_params=a.active_params, tflops=a.tflops)
    try:
        text = report(shape, machine, step, a.ep)
    except ValueError as e:
        parser.error(str(e))
    print(text)
    return 0


if __name__ == "__main__":
    from .cli import run_main

    sys.exit(run_main(main, prog="python -m megatron_ep.model"))
