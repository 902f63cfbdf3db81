"""Our experts and chunked experts in the MoE layers a training script builds, its code unchanged:
what `megatron_ep.megatron.launch --ep-experts grouped --ep-chunks N` turns on before it runs
Megatron-LM's pretrain_gpt.py.

`use_in_moe_layers(experts=..., chunks=...)` wraps `MoELayer.__init__` once: every MoELayer built
afterwards (the decoder's and the multi-token-prediction layers') takes `GroupedGemmExperts` as
its experts entry in place of the spec's (Megatron's own experts are never built), and, with
`chunks`, gets chunked experts at the end of its construction (megatron_ep.megatron.chunked: a
layer that does not qualify raises naming why, before training starts). Both megatron-core 0.19
and main build the experts as `submodules.experts(num_local_experts, config, pg_collection=,
name=)`, which GroupedGemmExperts takes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

EXPERTS = ("megatron", "grouped")
_STATE: dict = {}


def use_in_moe_layers(experts: str = "megatron", gemm: Optional[str] = None, chunks: int = 0) -> None:
    """From now on, every MoELayer built takes `experts` ("megatron": the spec's own, "grouped":
    megatron_ep's GroupedGemmExperts, its GEMMs from `gemm`: None picks, or "deepgemm",
    "grouped_mm", "loop") and, with `chunks` >= 1, chunked experts. Calling it again replaces the
    earlier choice."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from ..core.checks import check_int, fail

    fail(experts in EXPERTS, f"experts must be one of {EXPERTS}, got {experts!r}")
    from ..experts.overlap import MAX_CHUNKS

    check_int("chunks", chunks, 0, MAX_CHUNKS)
    fail(not chunks or experts == "grouped", "chunked experts need megatron_ep's experts (experts='grouped')")
    _STATE.update(experts=experts, gemm=gemm, chunks=chunks)
    if getattr(MoELayer.__init__, "_mep_layer_options", False):
        return
    original = MoELayer.__init__

    @functools.wraps(original)
    def __init__(self, config, submodules=None, *args, **kwargs):
        if _STATE["experts"] == "grouped" and submodules is not None:
            from ..experts.megatron_module import GroupedGemmExperts

            cls = functools.partial(GroupedGemmExperts, backend=_STATE["gemm"]) if _STATE["gemm"] else GroupedGemmExperts
            submodules = dataclasses.replace(submodules, experts=cls)
        original(self, config, submodules, *args, **kwargs)
        if _STATE["chunks"]:
            from .chunked import enable_chunked_experts

            enable_chunked_experts(self, _STATE["chunks"])

    __init__._mep_layer_options = True
    MoELayer.__init__ = __init__


def describe() -> str:
    """What use_in_moe_layers put in place, for the launcher's first line."""
    if not _STATE:
        return "experts=megatron"
    gemm = f" ({_STATE['gemm']})" if _STATE.get("gemm") else ""
    chunks = f", chunked experts x{_STATE['chunks']}" if _STATE.get("chunks") else ""
    return f"experts={_STATE['experts']}{gemm}{chunks}"
