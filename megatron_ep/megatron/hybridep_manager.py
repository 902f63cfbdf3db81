"""`hybridep`-style flex manager on megatron_ep: the permute is fused into dispatch.

Same workflow and attributes as Megatron's `_HybridEPManager`:
(1) setup_metadata(): keeps the routing map and probs (`routing_map` / `token_probs` are what
    Megatron's CUDA-graph code captures); static budgets are computed here, on the host.
(2) dispatch(): one row per (token, local expert), grouped by local expert, each segment padded
    with zero rows to get_align_size_for_quantization(config); per-row probs (0 on pad rows);
    `tokens_per_expert` stays on the device.
(3)/(4) identity permute / unpermute: the experts consume the dispatch layout directly (the
    dispatched tensor also carries `row_expert`, DeepGEMM's m_indices, for megatron_ep.experts).
(5) combine(): rows back to their source tokens, summed per token.

Static shapes (no host sync in the manager):
* `moe_expert_rank_capacity_factor` (0.19; `MEGATRON_EP_RANK_CAPACITY_FACTOR` anywhere): the
  output has exactly int(T * topk * factor) rows rounded up to the alignment -- the dispatch's
  num_worst_tokens, so there is no host sync at all; rows past the budget are dropped by the
  dispatch, `over_budget` is raised and `num_dropped_rows` counts them (device tensors,
  accumulated until the dispatcher's reset_over_budget()).
* `moe_pad_expert_input_to_capacity`: each local expert gets exactly capacity * group_size rows
  (the router already dropped tokens over capacity per source rank).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron.core.transformer.moe.moe_utils import get_capacity
from megatron.core.transformer.moe.token_dispatcher import _DispatchManager

from .. import autograd as ep
from ..permute import attach_expert_rows, routing_map_to_topk
from . import compat
from .buffers import get_buffer
from .layouts import StaticRows


class MegatronEPHybridEPManager(_DispatchManager):
    """Drop-in for megatron.core.transformer.moe.token_dispatcher._HybridEPManager."""

    backend_name = "hybridep"

    def __init__(self, group: torch.distributed.ProcessGroup, num_local_experts: int, num_experts: int, config):
        self.group = group
        self.num_local_experts = num_local_experts
        self.num_experts = num_experts
        self.config = config
        # The flex dispatcher replicates each token over the expert-TP ranks: num_experts is
        # tp * config.num_moe_experts and every token names tp * topk of them.
        tp = max(1, num_experts // config.num_moe_experts)
        self.router_topk = tp * config.moe_router_topk
        self.num_sms = compat.flex_num_sms(config, "hybridep")
        self.align = compat.quant_align(config)
        self.capacity_factor = config.moe_expert_capacity_factor
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        if self.drop_and_pad:
            assert self.capacity_factor is not None
        # Read at every setup_metadata: megatron-core 0.19's paged stash switches the static
        # budget off (None) for a rerun and back on through this attribute. Where the config has
        # no such field (0.16) or leaves it unset, MEGATRON_EP_RANK_CAPACITY_FACTOR sets it.
        self.moe_expert_rank_capacity_factor = compat.rank_capacity_factor(config)
        if self.moe_expert_rank_capacity_factor is None and os.environ.get("MEGATRON_EP_RANK_CAPACITY_FACTOR"):
            self.moe_expert_rank_capacity_factor = float(os.environ["MEGATRON_EP_RANK_CAPACITY_FACTOR"])
        # Accumulated until the dispatcher's reset_over_budget(); moved to the tokens' device
        # at the first dispatch.
        self.over_budget = torch.zeros(1, dtype=torch.bool)
        self.num_dropped_rows = torch.zeros(1, dtype=torch.int64)

        # Metadata (Megatron's CUDA-graph code captures token_probs / routing_map)
        self.routing_map: Optional[torch.Tensor] = None
        self.token_probs: Optional[torch.Tensor] = None
        self.handle = None
        self.buffer = None
        self.dispatched_probs = None
        self.tokens_per_expert = None
        self.row_expert = None
        self.budget: Optional[int] = None
        self.capacity: Optional[int] = None
        self._static: Optional[StaticRows] = None
        self._reserved = False  # the buffer was sized for this manager's static budget

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor):
        num_tokens = routing_map.shape[0]
        self.routing_map = routing_map.reshape(num_tokens, self.num_experts)
        self.token_probs = probs.reshape(num_tokens, self.num_experts)
        self.budget = self.capacity = None
        if self.moe_expert_rank_capacity_factor is not None:
            budget = int(num_tokens * self.config.moe_router_topk * self.moe_expert_rank_capacity_factor)
            self.budget = budget + (-budget % self.align)
        if self.drop_and_pad:
            self.capacity = get_capacity(num_tokens=num_tokens * self.config.moe_router_topk,
                                         num_experts=self.num_experts, capacity_factor=self.capacity_factor)

    def _topk_routing(self):
        """Routing map -> top-k indices and their probs (megatron_ep.permute's rule). Derived
        here rather than in setup_metadata so a CUDA-graph replay of the preprocess, which
        restores only routing_map / token_probs, still dispatches correctly."""
        return routing_map_to_topk(self.routing_map, self.token_probs, self.router_topk)

    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = True,
                 allocate_on_comm_stream: bool = True) -> torch.Tensor:
        idx, weights = self._topk_routing()
        align = 1 if self.drop_and_pad else self.align
        self.buffer = get_buffer(self.group, hidden_states, self.num_experts, self.router_topk, self.num_sms,
                                 expert_major_align=align)
        # The static budget is the dispatch's own worst-case size: no host sync, rows past it
        # dropped and counted by the dispatch itself (the budget may differ per rank).
        worst = self.budget if (self.budget is not None and not self.drop_and_pad) else 0
        if worst and not self._reserved:
            # a worst-case sized dispatch cannot grow the buffer: size it, collectively, at this
            # manager's first budgeted dispatch (the same call on every rank; each brings its own
            # budget, the largest wins)
            self.buffer.reserve(max_tokens=hidden_states.shape[0], hidden=hidden_states.shape[-1],
                                dtype_bytes=hidden_states.element_size(), topk=self.router_topk,
                                num_experts=self.num_experts, combine_rows=worst)
            self._reserved = True
        out = ep.dispatch(self.buffer, hidden_states, idx, weights, num_experts=self.num_experts,
                          permute=True, expert_alignment=align, num_worst_tokens=worst)
        self.handle = out.handle
        x, probs, row_expert, tpe = out.x, out.topk_weights, out.row_expert, out.tokens_per_expert
        self._static = None
        real_tpe = None
        if self.drop_and_pad:
            self._static = StaticRows.segments(row_expert, tpe, self.capacity * self.group.size())
            self._count_drops(self._static.dropped(row_expert))
            x, probs = self._static.pack(x), self._static.pack(probs)
            row_expert = self._static.pack(row_expert + 1) - 1  # unfilled rows -> -1
            tpe = self._static.tokens_per_expert
        elif worst:
            self._count_drops(out.num_dropped)
            real_tpe = tpe  # our experts stop here (megatron_ep.experts); the tail's output is zeroed
            tpe = tpe.clone()  # Megatron's contract: the segments cover every row (the tail is padding)
            tpe[-1] += worst - tpe.sum()
        self.dispatched_probs = probs
        self.tokens_per_expert = tpe
        self.row_expert = row_expert
        attach_expert_rows(x, row_expert, 1 if self.drop_and_pad else self.align, real_tpe)
        return x

    def _count_drops(self, dropped: torch.Tensor) -> None:
        if self.over_budget.device != dropped.device:
            self.over_budget = self.over_budget.to(dropped.device)
            self.num_dropped_rows = self.num_dropped_rows.to(dropped.device)
        self.num_dropped_rows += dropped
        self.over_budget |= dropped > 0

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        return hidden_states, self.dispatched_probs

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        return self.tokens_per_expert

    def combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                allocate_on_comm_stream: bool = True) -> torch.Tensor:
        if self._static is not None:
            hidden_states = self._static.unpack(hidden_states)
        out = ep.combine(self.buffer, hidden_states, self.handle)
        self.handle = None
        self._static = None
        return out.x
