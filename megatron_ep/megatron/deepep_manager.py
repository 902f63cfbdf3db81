"""`deepep`-style flex manager on megatron_ep: rank-major dispatch, then a local permute.

Same workflow and attributes as Megatron's `_DeepepManager`:
(1) setup_metadata(): routing map + probs -> top-k indices (-1 where not routed) and probs;
    `token_probs` / `token_indices` are what Megatron's CUDA-graph code captures.
(2) dispatch(): one row per (token, destination rank) with its local expert ids and probs;
    per-local-expert counts come back to the host (as DeepEP's do).
(3) get_permuted_hidden_states_by_experts(): local permute into expert-major segments.
(4) get_restored_hidden_states_by_experts(): sum each row's expert outputs back.
(5) combine(): rows back to their source tokens, summed per token.
Gradients (hidden states and routing probs) flow through megatron_ep's autograd functions.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.transformer.moe.token_dispatcher import _DispatchManager

from ..core import autograd as ep
from ..core.checks import routing_inputs_error, routing_tokens_error
from ..core.permute import padded_host_counts, routing_map_error, routing_map_to_topk
from . import compat
from .budget import env_factor
from .buffers import fail_dispatch, get_buffer
from .layouts import LocalPermute


class MegatronEPDeepepManager(_DispatchManager):
    """Drop-in for megatron.core.transformer.moe.token_dispatcher._DeepepManager."""

    backend_name = "deepep"

    def __init__(self, group: torch.distributed.ProcessGroup, num_local_experts: int, router_topk: int,
                 num_experts: int, config):
        self.group = group
        self.num_local_experts = num_local_experts
        self.router_topk = router_topk
        self.num_experts = num_experts
        self.config = config
        self.router_dtype = compat.cfg(config, "moe_router_dtype")
        self.num_sms = compat.flex_num_sms(config, "deepep")
        self.align = compat.deepep_align(config)
        env_factor("deepep")  # a static budget asked for this layer is refused, not ignored

        # Metadata (Megatron's CUDA-graph code captures token_probs / token_indices)
        self.token_indices: Optional[torch.Tensor] = None
        self.token_probs: Optional[torch.Tensor] = None
        self.routing_map: Optional[torch.Tensor] = None  # checked in dispatch (a host sync it has anyway)
        self._input_error: Optional[str] = None  # a routing_map / probs of the wrong kind or shape
        self.handle = None
        self.buffer = None
        self.dispatched_indices = None
        self.dispatched_probs = None
        self.tokens_per_expert = None
        self._permute: Optional[LocalPermute] = None

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor):
        # Shape-static tensor ops only: this runs inside Megatron's torch.compile'd
        # dispatch_preprocess.
        self._input_error = routing_inputs_error(routing_map, probs, self.num_experts)
        if self._input_error:  # raised at dispatch, where the peers can be told
            return
        num_tokens = routing_map.shape[0]
        self.routing_map = routing_map.reshape(num_tokens, self.num_experts)
        self.token_indices, self.token_probs = routing_map_to_topk(
            self.routing_map, probs.reshape(num_tokens, self.num_experts), self.router_topk)

    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> torch.Tensor:
        self.buffer = get_buffer(self.group, hidden_states, self.num_experts, self.router_topk, self.num_sms)
        # before any communication (this dispatch syncs the host anyway)
        error = self._input_error or routing_tokens_error(hidden_states, self.routing_map)
        if error is None and self.routing_map is not None:
            error = routing_map_error(self.routing_map, self.router_topk)
        if error:
            fail_dispatch(self.buffer, f"flex deepep: {error}")
        out = ep.dispatch(self.buffer, hidden_states, self.token_indices, self.token_probs,
                          num_experts=self.num_experts, permute=False, host_counts=True)
        self.handle = out.handle
        self.dispatched_indices = out.topk_idx
        self.dispatched_probs = out.topk_weights
        # DeepEP hands Megatron the per-expert counts as a CPU tensor; so do we.
        self.host_counts = out.tokens_per_expert_host
        self.tokens_per_expert = torch.tensor(out.tokens_per_expert_host, dtype=torch.int64)
        return out.x

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        return self.tokens_per_expert

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        self.hidden_shape_before_permute = hidden_states.shape
        self._permute = LocalPermute(self.dispatched_indices, self.num_local_experts, self.align, self.host_counts)
        hidden_states, permuted_probs = self._permute.permute(hidden_states, self.dispatched_probs)
        if self.align > 1:
            self.tokens_per_expert = torch.tensor(padded_host_counts(self.host_counts, self.align), dtype=torch.int64)
        if self.router_dtype == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        return hidden_states, permuted_probs

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self._permute.unpermute(hidden_states)
        self._permute = None
        return hidden_states

    def combine(self, hidden_states: torch.Tensor, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> torch.Tensor:
        out = ep.combine(self.buffer, hidden_states, self.handle)
        # Release per-iteration state (autograd keeps what backward needs).
        self.handle = None
        self.routing_map = None
        self.dispatched_indices = None
        self.dispatched_probs = None
        return out.x
