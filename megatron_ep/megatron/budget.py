"""The hybridep manager's static per-rank budget (`moe_expert_rank_capacity_factor`): how many
rows a budgeted dispatch returns, and the token count every rank budgets for.

The factor promises room for `int(T * topk * factor)` real rows. Expert-major segments are
padded to the alignment, which can add up to `align - 1` rows to each local expert's segment, so
the rows a budgeted dispatch returns hold the real rows *plus* that worst-case padding: a batch
whose real rows fit the factor never loses a row to padding. With the same T on every rank
(the group's largest, agreed once), a factor equal to the EP size is the dropless worst case.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def budget_rows(tokens: int, topk: int, factor: float, num_local_experts: int, alignment: int,
                min_real_rows: int = 0) -> int:
    """Rows of a budgeted dispatch: room for max(int(tokens * topk * factor), min_real_rows) real
    rows plus `alignment - 1` pad rows per local expert, rounded up to the alignment, and at least
    one alignment: a budgeted dispatch is then worst-case sized on every rank, T = 0 included."""
    real = max(int(tokens * topk * factor), int(min_real_rows))
    rows = real + num_local_experts * (alignment - 1)
    rows += -rows % alignment
    return max(rows, alignment)


def agree_max(group, value: int, device: torch.device) -> int:
    """The largest `value` over `group` (one all-reduce and one host sync: call it where the
    ranks meet anyway, outside CUDA-graph capture)."""
    backend = str(dist.get_backend(group)).lower()
    on = device if (device.type == "cuda" and "nccl" in backend) else torch.device("cpu")
    t = torch.tensor([int(value)], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
