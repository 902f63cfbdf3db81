"""The rate arithmetic every cost term shares: bytes over a bandwidth, rates of measured
transfers, and the SMs that cover a rate. GB/s = 1e9 bytes/s; a rate of ``units`` SMs (or
blocks) is ``units`` x the per-unit rate."""

from __future__ import annotations

import math

_EPS = 1e-9  # slack for ceilings of ratios computed in floating point

# Hardware rates the model and the cuda runtime's SM budget share (one owner: here).
NVLINK_GBPS = 370.0  # practical NVLink 4 bandwidth per GPU (docs/design.md §6)
HBM_COPY_GBPS = 4300.0  # measured H200 device-to-device copy, read + write
PER_SM_COPY_GBPS = 45.0  # bytes one SM moves per second in our pull kernels (docs/performance.md)
# A copy kernel gets the SMs whose copy rate covers the link it feeds, with this headroom.
COPY_HEADROOM = 1.25
# The routed experts' grouped GEMMs (the expert MLP over the expert-major rows), bf16 forward +
# backward on one H200, by rows per local expert: docs/performance.md, "Expert GEMMs, one H200"
# (DeepGEMM bf16, balanced routing, 4096 tokens x top-8 over G = 4 / 8 / 32 / 128 experts; torch
# grouped_mm within 3% of it; Zipf-skewed routing 3-7% lower).
EXPERT_GEMM_TFLOPS_BY_ROWS = ((256, 416.0), (1024, 507.0), (4096, 528.0), (8192, 531.0))


def expert_gemm_tflops(rows_per_expert: float) -> float:
    """The measured expert GEMM rate at this many rows per expert: linear in log2(rows) between the
    measured points, the nearest point's rate outside them."""
    pts = EXPERT_GEMM_TFLOPS_BY_ROWS
    if rows_per_expert <= pts[0][0]:
        return pts[0][1]
    for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
        if rows_per_expert <= r1:
            f = (math.log2(rows_per_expert) - math.log2(r0)) / (math.log2(r1) - math.log2(r0))
            return t0 + f * (t1 - t0)
    return pts[-1][1]


def seconds_at(nbytes: float, gbps: float) -> float:
    """Seconds ``nbytes`` take at ``gbps``."""
    return nbytes / (gbps * 1e9)


def us_at(nbytes: float, gbps: float, units: float = 1) -> float:
    """µs ``nbytes`` take on ``units`` SMs (or links) of ``gbps`` each."""
    return seconds_at(nbytes, units * gbps) * 1e6


def gbps_of(nbytes: float, seconds: float, units: float = 1) -> float:
    """The rate per unit (SM, block) at which ``units`` of them moved ``nbytes`` in ``seconds``, GB/s."""
    return nbytes / seconds / units / 1e9


def per_sm_gbps(rows: float, row_bytes: int, time_us: float, sms: int) -> float:
    """Measured per-SM rate of a copy stage: rows x row bytes / time / SMs, GB/s."""
    return gbps_of(rows * row_bytes, time_us * 1e-6, sms)


def sm_bound_us(rows: float, row_bytes: int, sms: int, per_sm: float) -> float:
    """Time of a copy stage bounded by its SMs: rows x row bytes / (SMs x per-SM rate), µs."""
    return us_at(rows * row_bytes, per_sm, sms)


def sms_for(rate_gbps: float, per_sm_gbps: float) -> int:
    """SMs whose copy rate covers ``rate_gbps``: ceil(rate / per-SM rate)."""
    return math.ceil(rate_gbps / per_sm_gbps - _EPS) if rate_gbps > 0 else 0
