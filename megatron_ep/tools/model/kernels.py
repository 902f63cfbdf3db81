"""One dispatch or combine call of each path: bytes per link, time, DeepEP-style GB/s and SMs.

* Normal path (``normal_path``): the route's expected copies (``route.routing``) x tokens x row
  bytes per link. Time = max over links of bytes / bandwidth (per direction; traffic is
  symmetric, so every rank sends and receives the same bytes). Row payload only (hidden + FP8
  scales), no metadata.
* DeepEP accounting (docs/design.md §6): the GB/s its tests print: NVLink = received rows
  including the rank's own rows (``E[ranks]`` per token) x row bytes / time; RDMA = tokens x
  ``E[nodes]`` including the own node x row bytes / time. Both exceed the physical link rate by
  design.
* SMs: a link moving ``B`` bytes in time ``t`` needs ``ceil(B / t / per-SM rate)`` SMs; for the
  bounding link that is ``ceil(link bandwidth / per-SM rate)``.
* Low-latency path (``low_latency``): every (token, expert) copy goes straight to the expert's
  rank, no deduplication: ``T * k`` rows per rank, ``(EP-P)/EP`` of them over RDMA,
  ``(P-1)/EP`` over NVLink, ``1/EP`` local. Time = fixed latency + max over links of
  bytes / bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from .machine import Machine
from ...core.rates import gbps_of, sms_for
from .route import routing
from .shape import Shape


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
    t_rdma, t_nvl = machine.link_seconds(rdma, nvl)
    time_s = max(t_rdma, t_nvl)
    bound = "RDMA" if t_rdma > t_nvl else "NVLink"
    two = r.nodes > 1
    if time_s == 0:
        return NormalResult(ep, two, row_bytes, 0.0, 0.0, 0.0, bound, 0.0, 0.0, 0, 0)
    sms_bound = sms_for(*machine.link_rates(bound))
    sms_all = sum(sms_for(gbps_of(nbytes, time_s), machine.link_rates(link)[1])
                  for link, nbytes in (("RDMA", rdma), ("NVLink", nvl)))
    return NormalResult(
        ep=ep, two_level=two, row_bytes=row_bytes, rdma_bytes=rdma, nvlink_bytes=nvl,
        time_us=time_s * 1e6, bound=bound,
        deepep_rdma_gbps=gbps_of(t * r.nodes_touched * row_bytes, time_s) if two else 0.0,
        deepep_nvlink_gbps=gbps_of(t * r.ranks_touched * row_bytes, time_s),
        sms_bound=sms_bound, sms_all=sms_all)


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
    p = machine.ranks_per_node(ep)
    t = shape.decode_tokens if tokens is None else tokens
    total = t * shape.topk * row_bytes
    rdma = total * (ep - p) / ep
    nvl = total * (p - 1) / ep
    time_s = max(machine.link_seconds(rdma, nvl))
    return LowLatencyResult(ep, row_bytes, total, rdma, nvl, machine.ll_fixed_us + time_s * 1e6)
