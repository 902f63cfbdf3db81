"""The two-level path's SM split, if its two copy stages ran at once on one SM budget:
``split_sms`` gives the SMs each stage would need so that both finish together, and
``bounding_stage`` which stage (its SMs, or its link) bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.rates import us_at
from .stages import STAGE_NAMES


def _stage_terms(nbytes: float, sms: float, per_sm: float, link_bytes: float | None = None,
                 link_gbps: float | None = None) -> tuple[float, float]:
    """(µs on the SMs alone, µs with the link's limit too) of one stage; see ``stage_us``."""
    if nbytes <= 0:
        return 0.0, 0.0
    sm = us_at(nbytes, per_sm, sms) if sms > 0 else math.inf
    if not link_gbps:
        return sm, sm
    return sm, max(sm, us_at(nbytes if link_bytes is None else link_bytes, link_gbps))


def stage_us(nbytes: float, sms: float, per_sm: float, link_bytes: float | None = None,
             link_gbps: float | None = None) -> float:
    """One stage on ``sms`` SMs: max(bytes / (SMs x per-SM rate), link bytes / link rate), µs
    (``link_bytes``: what crosses the link, default ``nbytes``; no link term without a rate)."""
    return _stage_terms(nbytes, sms, per_sm, link_bytes, link_gbps)[1]


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
    intranode stage on ``node_sms`` at once: the stage that takes longer (ties: the hop), limited
    by its SMs or, with a link rate given, by its link (``*_link_bytes``: what crosses it, e.g.
    only the remote rows over the NIC)."""
    sm_r, t_r = _stage_terms(rdma_bytes, rdma_sms, rdma_per_sm, rdma_link_bytes, nic_gbps)
    sm_n, t_n = _stage_terms(node_bytes, node_sms, node_per_sm, node_link_bytes, nvlink_gbps)
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
    """SMs for the RDMA hop and the intranode stage if they ran at once (fused, as DeepEP's
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
