"""Chunked experts in Megatron's MoELayer (opt-in): the layer's dispatch, routed-experts compute
and combine become one call of the hybridep manager that runs them in pipelined token chunks
(megatron_ep.experts.chunked_expert_mlp), so one chunk's communication moves under another
chunk's expert GEMMs, forward and backward (docs/design.md §4.1).

    from megatron_ep.megatron.chunked import enable_chunked_experts
    enable_chunked_experts(model, chunks=4)   # every eligible MoELayer of the model

Or set `MEGATRON_EP_CHUNKED_EXPERTS=<chunks>` for code that calls `apply_from_env(model)` after
building its model (recipes/train_moe.py and scripts/ab_throughput.py do).

A layer qualifies when its dispatcher is flex with megatron_ep's hybridep manager and its experts
are megatron_ep's GroupedGemmExperts. With the static budget (moe_expert_rank_capacity_factor)
every chunk is worst-case sized for its share of the tokens: no host sync, so the host runs
ahead and the chunks overlap fully. Not yet with drop-and-pad, shared-expert overlap or probs
applied on the input: those raise naming the setting. Router, shared experts and the layer's postprocess are
Megatron's, unchanged.

Megatron's combined 1F1B schedule (`overlap_moe_expert_parallel_comm`) runs the layer's dispatch,
routed-experts compute and combine as separate schedule nodes, each on detached inputs: the
dispatch and combine nodes pass their tokens through, the experts node runs the whole chunked
pipeline with the probs it is handed (their gradient goes back through the dispatch node to the
router), so the layer's communication hides under its own chunks there, not under the other
micro-batch. Same losses and gradients as the ordinary schedule (CPU, megatron-core 0.16.1 and
0.19.2: tests/megatron/test_megatron_layer.py::test_ep_overlap_schedule_with_chunked_experts_matches). Not
with fp8 / fp4 there (refused): megatron-core 0.19's schedule then frees the experts node's input,
here the layer's normalized tokens, which the router and shared experts still need.
"""

from __future__ import annotations

import types

import torch

from ..core import envs
from ..core.checks import check_int
from ..experts.overlap import MAX_CHUNKS


def _eligibility(layer) -> str:
    """Why `layer` cannot take chunked experts ("" when it can)."""
    from ..experts.megatron_module import GroupedGemmExperts
    from .hybridep_manager import MegatronEPHybridEPManager

    mgr = getattr(getattr(layer, "token_dispatcher", None), "_comm_manager", None)
    if not isinstance(mgr, MegatronEPHybridEPManager):
        return (f"its dispatcher is {type(getattr(layer, 'token_dispatcher', None)).__name__} with "
                f"{type(mgr).__name__}: chunked experts need flex with megatron_ep's hybridep manager")
    if not isinstance(getattr(layer, "experts", None), GroupedGemmExperts):
        return (f"its experts are {type(getattr(layer, 'experts', None)).__name__}: chunked experts need "
                "megatron_ep.experts.GroupedGemmExperts")
    config = layer.config
    if mgr.drop_and_pad:
        return "moe_pad_expert_input_to_capacity (drop-and-pad) is set: not supported with chunked experts yet"
    if getattr(layer, "shared_expert_overlap", False):
        return "moe_shared_expert_overlap is set: the chunks do not run the shared experts inside the dispatch"
    if getattr(config, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input is set: chunked experts apply the probs inside the experts"
    low_precision = [f for f in ("fp8", "fp4") if getattr(config, f, None) is not None]
    if getattr(config, "overlap_moe_expert_parallel_comm", False) and low_precision:
        return (f"overlap_moe_expert_parallel_comm is set with {'/'.join(low_precision)}: the combined 1F1B "
                "schedule's experts node then frees its input after the forward (megatron-core 0.19), and with "
                "chunked experts that input is the layer's own normalized tokens (the dispatch passes them "
                "through), which the router and shared experts still need in the backward")
    return ""


def _dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
    # The chunks move the tokens themselves. In the combined 1F1B schedule these are the
    # dispatch node's own (detached) inputs: its backward accumulates the experts node's
    # gradients of them straight into those inputs, which is what the node hands back.
    return hidden_states, probs


def _routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
    # `probs` (what dispatch passed on): the same tensor as the manager's token_probs in the
    # ordinary forward; in the combined 1F1B schedule the moe node's detached copy, whose
    # gradient the dispatch node hands back to the router.
    out = self.token_dispatcher._comm_manager.chunked_experts(hidden_states, self.experts, self._mep_chunks,
                                                              probs=probs)
    return out, None


def _combine(self, output: torch.Tensor):
    return output  # combined chunk by chunk already


def enable_chunked_experts(module: torch.nn.Module, chunks: int) -> int:
    """Give every MoELayer in `module` (or `module` itself) chunked experts with `chunks` chunks;
    returns how many layers it changed. Raises ValueError naming the first MoELayer that does not
    qualify, and TypeError / ValueError for a bad `chunks`, before changing any layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    check_int("chunks", chunks, 1, MAX_CHUNKS)
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"enable_chunked_experts: no MoELayer in {type(module).__name__}")
    for i, layer in enumerate(layers):
        why = _eligibility(layer)
        if why:
            raise ValueError(f"enable_chunked_experts: MoELayer {i} of {len(layers)} cannot take chunked experts: {why}")
    for layer in layers:
        layer._mep_chunks = chunks
        layer.dispatch = types.MethodType(_dispatch, layer)
        layer.routed_experts_compute = types.MethodType(_routed_experts_compute, layer)
        layer.combine = types.MethodType(_combine, layer)
    return len(layers)


ENV = "MEGATRON_EP_CHUNKED_EXPERTS"


def chunks_from_env() -> int:
    """MEGATRON_EP_CHUNKED_EXPERTS as a chunk count (0: unset or empty); a bad value raises."""
    return envs.integer(ENV, 0, minimum=1, maximum=MAX_CHUNKS)


def apply_from_env(module: torch.nn.Module, chunks: int = 0) -> int:
    """enable_chunked_experts(module, chunks or MEGATRON_EP_CHUNKED_EXPERTS) when either is set;
    returns how many layers it changed (0 when neither is set)."""
    chunks = chunks or chunks_from_env()
    return enable_chunked_experts(module, chunks) if chunks else 0
