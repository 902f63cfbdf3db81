"""Routing: the expected fan-out of one token, and the two-level route's copies per link.

* Expected units touched (``expected_units_touched``): experts are laid out contiguously (rank
  ``r`` owns experts ``[r*E/R, (r+1)*E/R)``, node ``n`` owns its ranks' experts, group ``g`` is
  experts ``[g*E/G, (g+1)*E/G)``). A token picks ``topk_groups`` of the ``G`` groups uniformly,
  then ``topk`` distinct experts uniformly among the ``M = topk_groups*E/G`` experts of those
  groups. For a unit (node or rank), ``P(untouched) = sum_S P(S) * C(M - m_S, k) / C(M, k)``
  with ``m_S`` the unit's experts inside the selected groups ``S``; ``E[#units touched] = sum
  over units of (1 - P(untouched))``. Without a group limit (``topk_groups = G``) and with
  ``U`` equal units this is ``U * (1 - C(E - E/U, k) / C(E, k))``.
* The route (``route_copies``): rows are deduplicated per destination. One level (EP <= GPUs
  per node): a token crosses NVLink once per destination rank other than its own. Two levels:
  a token crosses RDMA once per destination node other than its own (to the same-index GPU
  there), then NVLink once per destination GPU in that node other than the one it landed on;
  tokens for the own node go straight over NVLink. ``RDMA = nodes - own node``, ``NVLink =
  ranks - landed`` (destination nodes whose landing rank is itself a destination). Per rank
  and token, averaged over source ranks (``P(own node) = E[nodes]/N``, ``E[landed] =
  E[ranks]/P``): ``RDMA copies = E[nodes] * (N-1)/N``, ``NVLink copies = E[ranks] * (P-1)/P``
  (``N`` nodes, ``P`` GPUs per node); ``routing`` gives these per EP size. Combine is the same
  route reversed (intranode reduction before RDMA), so the same copy counts with combine rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .machine import Machine
from .shape import Shape


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
    p = machine.ranks_per_node(ep)
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
