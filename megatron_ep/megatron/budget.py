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

from ..core import envs
from ..core.checks import check_capacity_factor
from ..core.permute import round_up

ENV = "MEGATRON_EP_RANK_CAPACITY_FACTOR"  # the launcher's --ep-budget sets it


def factor_from_env():
    """MEGATRON_EP_RANK_CAPACITY_FACTOR (None when unset or empty): a finite number > 0."""
    return check_capacity_factor(f"{ENV} (the static budget's moe_expert_rank_capacity_factor)", envs.number(ENV, None))


def env_factor(backend: str):
    """MEGATRON_EP_RANK_CAPACITY_FACTOR for a flex manager of `backend` (None when unset): the
    static budget is the hybridep manager's, so another backend refuses a set value rather than
    run without the budget the user asked for."""
    factor = factor_from_env()
    if factor is not None and backend != "hybridep":
        raise ValueError(f"{ENV}={factor} (the launcher's --ep-budget) sets the hybridep manager's static budget, "
                         f"but this MoE layer's flex backend is {backend}, which has none: use "
                         f"--moe-flex-dispatcher-backend hybridep, or unset it")
    return factor


def budget_rows(tokens: int, topk: int, factor: float, num_local_experts: int, alignment: int,
                min_real_rows: int = 0) -> int:
    """Rows of a budgeted dispatch: room for max(int(tokens * topk * factor), min_real_rows) real
    rows plus `alignment - 1` pad rows per local expert, rounded up to the alignment, and at least
    one alignment: a budgeted dispatch is then worst-case sized on every rank, T = 0 included."""
    real = max(int(tokens * topk * factor), int(min_real_rows))
    return max(round_up(real + num_local_experts * (alignment - 1), alignment), alignment)


def reduces_on_device(group, device: torch.device) -> bool:
    """Whether `group` all-reduces tensors on `device` itself (NCCL and a GPU): no host sync, and
    capturable in a CUDA graph; otherwise the values go through the host."""
    return device.type == "cuda" and "nccl" in str(dist.get_backend(group)).lower()


def all_reduce_small(group, t: torch.Tensor, op) -> torch.Tensor:
    """A small tensor all-reduced over `group`, on t's device where the group can (see
    reduces_on_device), else through the host (one sync); returned on t's device."""
    if reduces_on_device(group, t.device):
        dist.all_reduce(t, op=op, group=group)
        return t
    host = t.cpu()
    dist.all_reduce(host, op=op, group=group)
    return host.to(t.device)


def agree_max(group, value: int, device: torch.device) -> int:
    """The largest `value` over `group` (one all-reduce and one host sync: call it where the
    ranks meet anyway, outside CUDA-graph capture)."""
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    return int(all_reduce_small(group, t, dist.ReduceOp.MAX).item())
