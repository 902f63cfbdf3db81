"""The rate arithmetic every cost term shares: bytes over a bandwidth, measured per-SM rates and
the SMs that cover a rate. GB/s = 1e9 bytes/s."""

from __future__ import annotations

import math

_EPS = 1e-9  # slack for ceilings of ratios computed in floating point


def per_sm_gbps(rows: float, row_bytes: int, time_us: float, sms: int) -> float:
    """Measured per-SM rate of a copy stage: rows x row bytes / time / SMs, GB/s."""
    return rows * row_bytes / (time_us * 1e-6) / sms / 1e9


def sm_bound_us(rows: float, row_bytes: int, sms: int, per_sm: float) -> float:
    """Time of a copy stage bounded by its SMs: rows x row bytes / (SMs x per-SM rate), µs."""
    return rows * row_bytes / (sms * per_sm * 1e9) * 1e6


def sms_for(rate_gbps: float, per_sm_gbps: float) -> int:
    """SMs whose copy rate covers ``rate_gbps``: ceil(rate / per-SM rate)."""
    return math.ceil(rate_gbps / per_sm_gbps - _EPS) if rate_gbps > 0 else 0
