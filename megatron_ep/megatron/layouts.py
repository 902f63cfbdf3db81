"""Local row re-layouts around a dispatch, all differentiable (gathers, index_copy, index_add).

* `LocalPermute`: rank-major rows ([N, K] local expert ids, as DeepEP delivers them) into
  expert-major rows, one per (row, local expert), each expert's segment padded with zero rows to
  an alignment. Row order inside an expert follows the received rows, exactly as Megatron's
  `permute(tokens, routing_map)` orders them.
* `StaticRows`: an expert-major layout copied into fixed per-expert capacity segments
  (`moe_pad_expert_input_to_capacity`). Rows that do not fit go to a dump row and are dropped;
  the mapping is computed on the device from device counts (no host sync).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..core.permute import place


class LocalPermute:
    """Rank-major rows -> expert-major rows, placed by megatron_ep.core.permute (the one owner)."""

    def __init__(self, topk_idx: torch.Tensor, num_local_experts: int, align: int, host_counts: Optional[List[int]] = None):
        pl = place(topk_idx, num_local_experts, align, host_counts)
        self.rows, self.slots, self.pos = pl.rows, pl.slots, pl.pos
        self.num_rows_in = topk_idx.shape[0]
        self.padded_counts = pl.padded
        self.num_rows_out = pl.num_rows

    def permute(self, x: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [N, H], probs [N, K] -> x [M, H] (zero pad rows), probs [M] (0 on pad rows)."""
        M = self.num_rows_out
        out_x = x.new_zeros((M,) + tuple(x.shape[1:])).index_copy(0, self.pos, x.index_select(0, self.rows))
        out_p = probs.new_zeros(M).index_copy(0, self.pos, probs[self.rows, self.slots])
        return out_x, out_p

    def unpermute(self, y: torch.Tensor) -> torch.Tensor:
        """y [M, H] -> [N, H]: each received row gets the sum of its experts' rows (fp32)."""
        acc = torch.float64 if y.dtype == torch.float64 else torch.float32
        out = y.new_zeros((self.num_rows_in,) + tuple(y.shape[1:]), dtype=acc)
        return out.index_add(0, self.rows, y.index_select(0, self.pos).to(acc)).to(y.dtype)


class StaticRows:
    """Map the rows of a dynamic expert-major layout into `num_rows` static rows."""

    def __init__(self, dst: torch.Tensor, num_rows: int, tokens_per_expert: torch.Tensor):
        self.dst = dst  # [M] static row of each dynamic row; num_rows = dropped
        self.num_rows = num_rows
        self.tokens_per_expert = tokens_per_expert  # static segment lengths, sum == num_rows

    @classmethod
    def segments(cls, row_expert: torch.Tensor, tokens_per_expert: torch.Tensor, seg_len: int) -> "StaticRows":
        """Expert e's rows go to [e * seg_len, (e + 1) * seg_len); rows past seg_len and pad
        rows (row_expert -1) are dropped."""
        L = tokens_per_expert.numel()
        device = row_expert.device
        e = row_expert.long()
        valid = e >= 0
        e0 = e.clamp(min=0)
        seg_start = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
        rank_in_seg = torch.arange(e.numel(), device=device) - seg_start[e0]
        keep = valid & (rank_in_seg < seg_len)
        dst = torch.where(keep, e0 * seg_len + rank_in_seg, L * seg_len)
        tpe = torch.full((L,), seg_len, dtype=torch.int64, device=device)
        return cls(dst, L * seg_len, tpe)

    def dropped(self, row_expert: torch.Tensor) -> torch.Tensor:
        """Real (non-pad) rows that did not fit (device scalar)."""
        return ((self.dst == self.num_rows) & (row_expert >= 0)).sum()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[M, ...] -> [num_rows, ...]; unfilled rows are zero."""
        out = x.new_zeros((self.num_rows + 1,) + tuple(x.shape[1:]))
        return out.index_copy(0, self.dst, x)[: self.num_rows]

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[num_rows, ...] -> [M, ...]; dropped rows come back as zeros."""
        ext = torch.cat([y, y.new_zeros((1,) + tuple(y.shape[1:]))])
        return ext.index_select(0, self.dst)
