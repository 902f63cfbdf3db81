"""The workload: tokens per rank, the MoE router's rule and the row sizes of dispatch and combine."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.protocol import FP8_BLOCK


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
