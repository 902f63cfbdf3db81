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
* `moe_expert_rank_capacity_factor` (0.19; `MEGATRON_EP_RANK_CAPACITY_FACTOR` anywhere): room for
  int(T * topk * factor) real rows on every rank, plus every segment's worst padding, rounded up
  to the alignment: the dispatch's num_worst_tokens, so there is no host sync at all. T is the
  larger of this rank's tokens and the group's largest token count, agreed once (with the
  Buffer's sizing) at the first budgeted dispatch, so every rank budgets alike and a rank
  without tokens still receives. A factor equal to the EP size then never drops. Rows past the
  budget are dropped by the dispatch and `num_dropped_rows` counts the ones this rank dropped;
  each budgeted call then sums its drops over the EP group (one all-reduce on the device, no host
  sync), so `over_budget` is raised on every rank whenever any rank dropped (a rank whose rows
  another rank dropped gets them back wrong: it must know) and `group_dropped_rows` counts them;
  `required_recv` keeps the most real rows a dispatch needed (device tensors). Megatron's
  paged-stash rerun (main) reads `required_recv` and calls `grow_recv_capacity`. A rank whose
  token count grows past the agreed one makes the budgets of the others too small for it: their
  drops raise `over_budget` everywhere, and the rerun (`invalidate_ep_bootstrap()`) agrees anew.
* `moe_pad_expert_input_to_capacity`: each local expert gets exactly capacity * group_size rows
  (the router already dropped tokens over capacity per source rank). The router fills every
  expert to capacity with pairs of probability 0, so its map's rows may name more than top-k
  experts: those pairs are left out (`permute.routed_pairs`), the segments' pad rows stand in.
A routing-map row with more than top-k experts is rejected before any communication (the
dynamic modes sync the host anyway); in the budget mode, which cannot sync, its extra
(token, expert) pairs are counted as dropped rows and raise `over_budget`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.moe_utils import get_capacity
from megatron.core.transformer.moe.token_dispatcher import _DispatchManager

from ..core import autograd as ep
from ..core.checks import capturing, check_capacity_factor, routing_inputs_error, routing_tokens_error
from ..core.permute import (attach_expert_rows, routed_pairs, routed_past_topk, routing_map_error,
                       routing_map_to_topk, worst_case_segments)
from . import compat
from .budget import agree_max, all_reduce_small, budget_rows, env_factor, reduces_on_device
from .buffers import fail_dispatch, get_buffer
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
        # Read at every dispatch: megatron-core's paged stash switches the static budget off
        # (None) for a rerun and back on through this attribute. Where the config has no such
        # field (0.16) or leaves it unset, MEGATRON_EP_RANK_CAPACITY_FACTOR sets it.
        self.moe_expert_rank_capacity_factor = compat.rank_capacity_factor(config)
        if self.moe_expert_rank_capacity_factor is None:
            self.moe_expert_rank_capacity_factor = env_factor("hybridep")
        self.moe_expert_rank_capacity_factor = check_capacity_factor(
            "moe_expert_rank_capacity_factor (or MEGATRON_EP_RANK_CAPACITY_FACTOR)", self.moe_expert_rank_capacity_factor)
        check_capacity_factor("moe_expert_capacity_factor", self.capacity_factor)
        self._factor = self.moe_expert_rank_capacity_factor  # the configured one (what a grown budget keeps)
        # Budget state, moved to the tokens' device at the first dispatch. over_budget and
        # required_recv are what megatron-core's reset_over_budget() zeroes; num_dropped_rows
        # counts from the manager's creation.
        self.over_budget = torch.zeros(1, dtype=torch.bool)
        self.num_dropped_rows = torch.zeros(1, dtype=torch.int64)  # rows this rank dropped
        self.group_dropped_rows = torch.zeros(1, dtype=torch.int64)  # rows any rank of the group dropped
        self._call_drops: Optional[torch.Tensor] = None  # this call's drops on this rank, until shared
        self.required_recv = torch.zeros(1, dtype=torch.int64)  # most real rows one dispatch needed
        self._recv_capacity_override = 0  # real rows grow_recv_capacity() asked room for
        # False until a budgeted dispatch agreed the token count and sized the Buffer;
        # megatron-core's invalidate_ep_bootstrap() clears it (redone at the next one).
        self._bootstrapped = False
        self._max_tokens_per_rank: Optional[int] = None  # the group's largest T at the bootstrap
        self._last_shape = None  # (T, H, element bytes) of the last budgeted dispatch
        self._reserved_rows = 0  # the most rows this manager sized the Buffer for

        # Metadata (Megatron's CUDA-graph code captures token_probs / routing_map)
        self.routing_map: Optional[torch.Tensor] = None
        self.token_probs: Optional[torch.Tensor] = None
        self._input_error: Optional[str] = None  # a routing_map / probs of the wrong kind or shape
        self.handle = None
        self.buffer = None
        self.dispatched_probs = None
        self.tokens_per_expert = None
        self.row_expert = None
        self.budget: Optional[int] = None  # rows of the last budgeted dispatch
        self.capacity: Optional[int] = None
        self._static: Optional[StaticRows] = None

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor):
        # a wrong kind or shape is raised at dispatch, where the peers can be told
        self._input_error = routing_inputs_error(routing_map, probs, self.num_experts)
        if self._input_error:
            return
        num_tokens = routing_map.shape[0]
        self.token_probs = probs.reshape(num_tokens, self.num_experts)
        self.routing_map = routed_pairs(routing_map.reshape(num_tokens, self.num_experts), self.token_probs,
                                        self.drop_and_pad)
        self.capacity = None
        if self.drop_and_pad:
            self.capacity = get_capacity(num_tokens=num_tokens * self.config.moe_router_topk,
                                         num_experts=self.num_experts, capacity_factor=self.capacity_factor)

    def _topk_routing(self, probs: Optional[torch.Tensor] = None):
        """Routing map -> top-k indices and their probs (megatron_ep.core.permute's rule), the probs
        taken from `probs` [T, num_experts] when given, else from token_probs. Derived here rather
        than in setup_metadata so a CUDA-graph replay of the preprocess, which restores only
        routing_map / token_probs, still dispatches correctly."""
        probs = self.token_probs if probs is None else probs.reshape(self.routing_map.shape)
        return routing_map_to_topk(self.routing_map, probs, self.router_topk)

    # ------------------------------------------------------------------------ static budget
    def _budget_rows(self, num_tokens: int, factor: float, chunks: int = 1) -> int:
        """Rows of one budgeted dispatch; with `chunks`, of each chunk's (its share of the tokens)."""
        tokens = -(-max(num_tokens, self._max_tokens_per_rank or 0) // chunks)
        return budget_rows(tokens, self.config.moe_router_topk, factor, self.num_local_experts, self.align,
                           self._recv_capacity_override)

    def _reserve(self, rows: int) -> None:
        """Size the Buffer for a budgeted dispatch of `rows` rows (collective: every rank, same
        point; each brings its own needs, the largest wins). A worst-case sized dispatch cannot
        grow the Buffer itself."""
        T, H, elt = self._last_shape
        self.buffer.reserve(max_tokens=max(T, self._max_tokens_per_rank or 0), hidden=H, dtype_bytes=elt,
                            topk=self.router_topk, num_experts=self.num_experts, combine_rows=rows)
        self._reserved_rows = max(self._reserved_rows, rows)

    def _bootstrap(self, hidden_states: torch.Tensor, factor: float) -> None:
        """At the first budgeted dispatch (and after invalidate_ep_bootstrap()): agree the token
        count every rank budgets for, then size the Buffer. Both are collectives with a host
        sync, hence not under CUDA-graph capture (Megatron's warm-up runs before it). A capture
        right after a rerun (megatron-core's full-iteration graph is re-captured at the first
        step after its reset) keeps the earlier agreement if the Buffer already holds the
        budget: grow_recv_capacity sized it outside the capture."""
        if capturing():
            if self._max_tokens_per_rank is None or self._budget_rows(hidden_states.shape[0], factor) > self._reserved_rows:
                raise RuntimeError("hybridep static budget: the first budgeted dispatch agrees the token count over the "
                                   "EP group and sizes the Buffer (collectives with a host sync), which cannot be "
                                   "captured in a CUDA graph; run one step before capturing")
            return  # re-agreed at the next dispatch outside a capture
        self._max_tokens_per_rank = agree_max(self.group, hidden_states.shape[0], hidden_states.device)
        self._reserve(self._budget_rows(hidden_states.shape[0], factor))
        self._bootstrapped = True

    def grow_recv_capacity(self, new_capacity: int) -> None:
        """megatron-core's paged-stash hook (main): after an over-budget step, make room for
        `new_capacity` real rows (the group's largest `required_recv`) in every later budgeted
        dispatch, and size the Buffer for it now -- collectively, outside any CUDA graph -- so
        the rerun and the steps after it never drop what that step needed. Never shrinks."""
        if self._factor is None:
            return
        self._recv_capacity_override = max(self._recv_capacity_override, int(new_capacity))
        if self.buffer is not None and self._last_shape is not None:
            self._reserve(self._budget_rows(self._last_shape[0], self._factor))

    # ------------------------------------------------------------------ a call's set-up
    def _open(self, hidden_states: torch.Tensor, align: int, check_routing: bool) -> None:
        """The Buffer for this call, then the routing's errors (a routing-map row past top-k only
        with `check_routing`: it costs a host sync), raised through the Buffer before any data
        moves."""
        self.buffer = get_buffer(self.group, hidden_states, self.num_experts, self.router_topk, self.num_sms,
                                 expert_major_align=align)
        error = self._input_error or routing_tokens_error(hidden_states, self.routing_map)
        if error:
            fail_dispatch(self.buffer, f"flex hybridep: {error}")
        error = routing_map_error(self.routing_map, self.router_topk) if check_routing else None
        if error:  # before any communication (the dynamic modes sync the host anyway)
            fail_dispatch(self.buffer, f"flex hybridep: {error}")

    def _budget(self, hidden_states: torch.Tensor, factor: float, chunks: int = 1) -> int:
        """The static budget's rows per dispatch of this call (the first budgeted call agrees the
        token count and sizes the Buffer). A routing-map row past top-k cannot be rejected without
        a host sync: its extra pairs count as dropped (megatron-core's paged stash then reruns
        dropless, which rejects it)."""
        self._last_shape = (hidden_states.shape[0], hidden_states.shape[-1], hidden_states.element_size())
        if not self._bootstrapped:
            self._bootstrap(hidden_states, factor)
        self._call_drops = torch.zeros(1, dtype=torch.int64, device=hidden_states.device)
        self._count_drops(routed_past_topk(self.routing_map, self.router_topk).sum())
        self.budget = self._budget_rows(hidden_states.shape[0], factor, chunks)
        return self.budget

    def _count_budgeted(self, out) -> None:
        """A budgeted dispatch's drops and the real rows it needed (what a rerun must make room for)."""
        self._count_drops(out.num_dropped)
        self._need((out.row_expert >= 0).sum() + out.num_dropped)

    def _share_drops(self) -> None:
        """End of a budgeted call: its drops summed over the EP group raise `over_budget` on every
        rank (a rank whose rows another dropped gets them back wrong). One all-reduce on the
        device with NCCL (no host sync, CUDA-graph capturable); through the host with gloo, which
        cannot run inside a CUDA-graph capture: there (virtual ranks only) each rank keeps its own."""
        drops, self._call_drops = self._call_drops, None
        if drops is None or (capturing() and not reduces_on_device(self.group, drops.device)):
            return
        drops = all_reduce_small(self.group, drops, dist.ReduceOp.SUM)
        self._on(drops.device)
        self.group_dropped_rows += drops
        self.over_budget |= drops > 0

    # ------------------------------------------------------------------ chunked experts
    def chunked_experts(self, hidden_states: torch.Tensor, experts, chunks: int,
                        probs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dispatch, `experts`' MLP and combine of this call's tokens in `chunks` pipelined rounds
        (megatron_ep.experts.chunked_expert_mlp): what megatron_ep.megatron.chunked puts in place
        of the layer's dispatch, routed-experts compute and combine. [T, H] -> [T, H]. `probs`
        [T, num_experts]: the routing probs whose top-k entries weight the experts' outputs (their
        gradient goes to this tensor); None: token_probs. The layer passes what its dispatch
        passed on: token_probs itself in the ordinary forward, the experts node's detached copy in
        Megatron's combined 1F1B schedule (whose dispatch node hands that gradient back). With the
        static budget every chunk is worst-case sized for its share of the agreed token count
        (no host sync): its drops and real rows are counted as a budgeted dispatch counts them,
        per chunk, so megatron-core's paged-stash rerun sizes a chunk's receive capacity."""
        from ..experts import chunked_expert_mlp

        factor = self.moe_expert_rank_capacity_factor
        self._open(hidden_states, self.align, check_routing=factor is None)
        worst, on_dispatch = None, None
        if factor is not None:  # every chunk worst-case sized for its share of the tokens
            worst = self._budget(hidden_states, factor, chunks)
            on_dispatch = lambda c, out: self._count_budgeted(out)  # noqa: E731

        idx, weights = self._topk_routing(probs)
        y = chunked_expert_mlp(self.buffer, hidden_states, idx, weights, experts.weight1, experts.weight2,
                               self.num_experts, chunks=chunks, expert_alignment=self.align,
                               activation=experts.activation, glu=experts.glu, backend=experts.backend,
                               num_worst_tokens=worst, on_dispatch=on_dispatch)
        self._share_drops()
        return y

    # ----------------------------------------------------------------------------- dispatch
    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = True,
                 allocate_on_comm_stream: bool = True) -> torch.Tensor:
        factor = self.moe_expert_rank_capacity_factor
        budgeted = factor is not None and not self.drop_and_pad
        align = 1 if self.drop_and_pad else self.align
        self._open(hidden_states, align, check_routing=not budgeted)
        idx, weights = self._topk_routing()
        # The static budget is the dispatch's own worst-case size: no host sync, rows past it
        # dropped and counted by the dispatch itself.
        worst, self.budget = 0, None
        if budgeted:
            worst = self._budget(hidden_states, factor)
        out = ep.dispatch(self.buffer, hidden_states, idx, weights, num_experts=self.num_experts,
                          permute=True, expert_alignment=align, num_worst_tokens=worst)
        self.handle = out.handle
        x, probs, row_expert, tpe = out.x, out.topk_weights, out.row_expert, out.tokens_per_expert
        self._static = None
        if self.drop_and_pad:
            self._static = StaticRows.segments(row_expert, tpe, self.capacity * self.group.size())
            self._count_drops(self._static.dropped(row_expert))
            x, probs = self._static.pack(x), self._static.pack(probs)
            row_expert = self._static.pack(row_expert + 1) - 1  # unfilled rows -> -1
            tpe = self._static.tokens_per_expert
        if worst:
            self._count_budgeted(out)
            self._share_drops()
            tpe = worst_case_segments(x, row_expert, tpe, self.align)  # also tags x with the real segments
        else:
            attach_expert_rows(x, row_expert, 1 if self.drop_and_pad else self.align)
        self.dispatched_probs = probs
        self.tokens_per_expert = tpe
        self.row_expert = row_expert
        return x

    def _on(self, device: torch.device) -> None:
        if self.over_budget.device != device:
            self.over_budget = self.over_budget.to(device)
            self.num_dropped_rows = self.num_dropped_rows.to(device)
            self.group_dropped_rows = self.group_dropped_rows.to(device)
            self.required_recv = self.required_recv.to(device)

    def _count_drops(self, dropped: torch.Tensor) -> None:
        self._on(dropped.device)
        self.num_dropped_rows += dropped
        self.over_budget |= dropped > 0
        if self._call_drops is not None:
            self._call_drops += dropped.reshape(1).to(torch.int64)

    def _need(self, real_rows: torch.Tensor) -> None:
        self._on(real_rows.device)
        torch.maximum(self.required_recv, real_rows.reshape(1).to(torch.int64), out=self.required_recv)

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
