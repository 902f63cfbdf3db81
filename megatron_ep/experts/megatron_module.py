"""`GroupedGemmExperts`: Megatron's `experts` submodule on megatron_ep's grouped GEMMs.

Same call as Megatron's grouped MLPs: `forward(tokens, tokens_per_expert, permuted_probs)` ->
`(output, None)`. It consumes the expert-major padded layout the hybridep manager delivers as
is (no re-permute; pad rows are zero with prob 0 and produce 0), and any other dispatcher's
expert-major output too. Use it in a layer spec with
`megatron_ep.megatron.compat.with_experts(mlp_spec, GroupedGemmExperts)` (a class works as
the experts entry in megatron-core 0.16 and 0.19 alike).

Weights: weight1 [L, F (2F with GLU), H], weight2 [L, H, F]; one shard of a global [E, ...]
tensor per expert-parallel rank in the distributed checkpoint. Expert tensor parallelism
(expert TP > 1) and biases are not supported (as in Megatron's legacy GroupedMLP).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.transformer.module import MegatronModule

from .layout import GroupedLayout
from .mlp import expert_mlp


class GroupedGemmExperts(MegatronModule):
    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: Optional[str] = None, backend: Optional[str] = None):
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        assert not config.add_bias_linear, "GroupedGemmExperts has no biases: set add_bias_linear=False"
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.expt_dp_group = getattr(pg_collection, "expt_dp", None)
        expt_tp = getattr(pg_collection, "expt_tp", None)
        assert expt_tp is None or expt_tp.size() == 1, "GroupedGemmExperts does not support expert tensor parallelism"
        self.backend = backend
        self.glu = bool(config.gated_linear_unit)
        self.activation = config.activation_func
        F, H = config.moe_ffn_hidden_size, config.hidden_size
        device = torch.device("cpu") if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.device("cuda", torch.cuda.current_device())
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, 2 * F if self.glu else F, H,
                                                      dtype=config.params_dtype, device=device))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, H, F, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            for e in range(num_local_experts):  # [out, in] slices, as Megatron's init methods expect
                config.init_method(self.weight1.data[e])
                config.output_layer_init_method(self.weight2.data[e])
        expert_parallel = self.ep_group.size() > 1
        for p in (self.weight1, self.weight2):
            # Megatron's DDP / optimizer read these: expert weights are not all-reduced over DP
            setattr(p, "allreduce", not expert_parallel)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, **unused):
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        layout = GroupedLayout.of(permuted_local_hidden_states, tokens_per_expert)
        out = expert_mlp(x, probs, self.weight1, self.weight2, layout, self.activation, self.glu, self.backend)
        return out, None

    def backward_dw(self):
        """Weight gradients are computed in the main backward (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        dp_rank = self.expt_dp_group.rank() if self.expt_dp_group is not None else 0
        axis = len(sharded_offsets)
        out = {}
        for name in ("weight1", "weight2"):
            out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", getattr(self, name), *sharded_offsets, (axis, ep_rank, ep_size),
                replica_id=(0, 0, dp_rank), prepend_axis_num=len(sharded_offsets))
        return out
