"""Sizing of the communication region and the analytic SM budget.

Every rank allocates one region of device memory, shares it with its peers through CUDA IPC,
and lays it out identically (csrc/common.h, RegionLayout):

    control block                      640 B   handshake counters, published T, flags
    counts    (8 + E_max) int32                tokens per rank, (token, expert) pairs per expert
    stage_x   T_max * hidden * dtype_bytes     dispatch rows (bf16; FP8 rows are smaller)
    stage_scales T_max * ceil(hidden/128) * 4  FP8 scales
    stage_idx / stage_w / stage_spos   3 * T_max * K_max * 4
    stage_rpos T_max * 8 * 4                   row of each token in each rank-major output
    comb_x    C * hidden * combine_bytes        combine input rows (C = combine_rows)
    comb_w    C * K_max * 4                     combine weights
    pool      P bytes                           rank-major dispatch outputs (push path)

with C = max(R * T_max, T_max * K_max) + (E_max / R) * 128 by default: the worst case of a
rank-major combine, and the usual expert-major one (about T * K rows plus alignment padding).
At the DeepSeek-V3 training shape (T_max 4096, hidden 7168, K 8, 256 experts, R 8) this is
about 59 MB of dispatch staging and 530 MB of combine area per rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MAX_RANKS = 8
FP8_BLOCK = 128
ALIGN = 256
CONTROL_BYTES = 1024  # >= sizeof(Control); checked against the extension at start-up

# The SM budget rule. A pull kernel is limited by the slower of the link that carries the rows
# and the rate at which its SMs can move them; give it enough SMs that their copy rate covers
# the link with 25% headroom. Virtual ranks (several processes on one GPU) share that GPU's HBM.
NVLINK_GBPS = 370.0  # practical NVLink 4 bandwidth per GPU (DESIGN §6)
HBM_COPY_GBPS = 4300.0  # measured H200 device-to-device copy, read + write
PER_SM_COPY_GBPS = 45.0  # bytes one SM moves per second in our pull kernels (docs/performance.md)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class RegionLayout:
    counts: int
    stage_x: int
    stage_scales: int
    stage_idx: int
    stage_w: int
    stage_rpos: int
    stage_spos: int
    comb_x: int
    comb_w: int
    total: int
    pool: int
    pool_bytes: int
    max_tokens: int
    max_topk: int
    max_experts: int
    x_row_bytes: int
    scale_cols: int
    comb_rows: int
    comb_row_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def plan_region(num_ranks: int, max_tokens: int, hidden: int, max_topk: int, max_experts: int,
                dtype_bytes: int = 2, combine_bytes: int = 2, combine_rows: int | None = None,
                pool_bytes: int | None = None) -> RegionLayout:
    if pool_bytes is None:  # a worst-case rank-major output (rows, scales, ids, weights) + 25%
        pool_bytes = 5 * num_ranks * max_tokens * (_align16(hidden * dtype_bytes) + 4 * math.ceil(hidden / FP8_BLOCK) + 12 * max_topk) // 4 + 8 * 256
    if combine_rows is None:
        combine_rows = max(num_ranks * max_tokens, max_tokens * max_topk) + (max_experts // num_ranks) * 128
    x_row = _align16(hidden * dtype_bytes)
    scale_cols = math.ceil(hidden / FP8_BLOCK)
    comb_row = _align16(hidden * combine_bytes)
    off = CONTROL_BYTES
    sections = {}
    for name, size in [
        ("counts", (MAX_RANKS + max_experts) * 4),
        ("stage_x", max_tokens * x_row),
        ("stage_scales", max_tokens * scale_cols * 4),
        ("stage_idx", max_tokens * max_topk * 4),
        ("stage_w", max_tokens * max_topk * 4),
        ("stage_rpos", max_tokens * MAX_RANKS * 4),
        ("stage_spos", max_tokens * max_topk * 4),
        ("comb_x", combine_rows * comb_row),
        ("comb_w", combine_rows * max_topk * 4),
        ("pool", pool_bytes),
    ]:
        off = _align(off)
        sections[name] = off
        off += max(size, 16)
    return RegionLayout(total=_align(off), pool_bytes=pool_bytes, max_tokens=max_tokens, max_topk=max_topk, max_experts=max_experts,
                        x_row_bytes=x_row, scale_cols=scale_cols, comb_rows=combine_rows,
                        comb_row_bytes=comb_row, **sections)


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def default_num_sms(ranks_per_device: int, sm_count: int) -> int:
    """SMs per rank for the pull kernels (see the rule above); even, at least 4, and small
    enough that every rank sharing the GPU keeps all its blocks resident at once."""
    link = HBM_COPY_GBPS / ranks_per_device if ranks_per_device > 1 else NVLINK_GBPS
    n = math.ceil(1.25 * link / PER_SM_COPY_GBPS)
    n += n % 2
    return max(4, min(n, sm_count // ranks_per_device))
