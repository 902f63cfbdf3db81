"""The expert-major ("contiguous") row layout the grouped GEMMs consume.

Rows are grouped by local expert: expert e owns rows [start_e, start_e + tokens_per_expert[e]),
and sum(tokens_per_expert) == number of rows (Megatron's contract for its experts). For
worst-case sized dispatches the dispatcher also attaches the real segments, which end before a
tail of pad rows: the offset-driven grouped_mm does not compute that tail. Pad rows
(zero rows the dispatch added to align segments) belong to their segment; when the dispatch
told us which they are (`row_expert` == -1, DeepGEMM's m_indices), their output is forced to 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..core.permute import expert_rows_of


@dataclass
class GroupedLayout:
    tokens_per_expert: torch.Tensor  # [G] int, device or host
    num_rows: int
    row_expert: Optional[torch.Tensor] = None  # [num_rows] int32, -1 on pad rows, if known
    alignment: int = 1  # every segment length is a multiple of this (known from the dispatch)
    # worst-case sized dispatches: the real segments, ending before the tail of pad rows that
    # Megatron's contract folds into the last segment; the offset-driven grouped_mm stops there
    gemm_tokens_per_expert: Optional[torch.Tensor] = None
    _host: Optional[List[int]] = field(default=None, repr=False)

    @classmethod
    def of(cls, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> "GroupedLayout":
        """Layout of dispatched rows `x`; picks up the row ids / alignment a dispatcher attached
        with megatron_ep.core.permute.attach_expert_rows (the hybridep manager does)."""
        rows = expert_rows_of(x)
        if rows is None:
            return cls(tokens_per_expert, x.shape[0])
        return cls(tokens_per_expert, x.shape[0], rows.row_expert, rows.alignment, rows.tokens_per_expert)

    @property
    def num_groups(self) -> int:
        return self.tokens_per_expert.numel()

    def host_counts(self) -> List[int]:
        """Segment lengths on the host (a device->host sync when they live on a GPU)."""
        if self._host is None:
            self._host = [int(c) for c in self.tokens_per_expert.tolist()]
        return self._host

    def offsets(self, device) -> torch.Tensor:
        """int32 segment ends, as torch's grouped_mm wants them (no host sync)."""
        tpe = self.tokens_per_expert if self.gemm_tokens_per_expert is None else self.gemm_tokens_per_expert
        return torch.cumsum(tpe.to(device=device, dtype=torch.int64), 0).to(torch.int32)

    def m_indices(self, device) -> torch.Tensor:
        """int32 expert id of every row (DeepGEMM's m_indices), -1 on known pad rows."""
        if self.row_expert is not None:
            return self.row_expert.to(device=device, dtype=torch.int32)
        groups = torch.arange(self.num_groups, device=device, dtype=torch.int32)
        return torch.repeat_interleave(groups, self.tokens_per_expert.to(device), output_size=self.num_rows)

    def pad_mask(self, device) -> Optional[torch.Tensor]:
        """[num_rows, 1] bool, True on real rows; None when pad rows are unknown."""
        if self.row_expert is None:
            return None
        return (self.row_expert >= 0).to(device).unsqueeze(1)
