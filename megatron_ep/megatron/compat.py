"""What differs between the megatron-core versions we plug into (0.16.x and 0.19.x).

Every difference is detected from the installed code (an attribute, a config field, a function
signature), never assumed from the version string alone, and `features()` reports what was found
so a launcher can log it. An installed megatron-core that lacks what we rely on fails loudly in
`check_supported()` instead of half-working.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Optional, Tuple

MIN_VERSION = (0, 16)


def _version_tuple(text: str) -> Tuple[int, ...]:
    out = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


@dataclass(frozen=True)
class Features:
    """The megatron-core behaviours our managers depend on."""

    version: str
    # 0.19: one knob for every flex backend; 0.16: moe_deepep_num_sms / moe_hybridep_num_sms.
    unified_num_sms: bool
    # 0.19: static per-rank budget for HybridEP (drop-and-flag, no host sync).
    rank_capacity_factor: bool
    # 0.19: moe_utils.permute pads expert segments itself (align_size=, 5 return values);
    # 0.16: padding only through moe_router_padding_for_quantization (routing-map padding).
    permute_pads_segments: bool
    # 0.19: the dispatcher reports over_budget through check_over_budget().
    dispatcher_over_budget: bool
    # 0.19: MoESubmodules.experts is a builder called directly (no ModuleSpec/build_module).
    experts_builder_call: bool
    # 0.19: get_align_size_for_quantization returns 0 without FP8/FP4 (0.16: 16).
    align_default: int


@functools.lru_cache(maxsize=None)
def features() -> Features:
    import megatron.core as mc
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    permute_params = inspect.signature(moe_utils.permute).parameters
    from megatron.core.transformer.moe import moe_layer

    return Features(
        version=getattr(mc, "__version__", "unknown"),
        unified_num_sms="moe_flex_dispatcher_num_sms" in fields,
        rank_capacity_factor="moe_expert_rank_capacity_factor" in fields,
        permute_pads_segments="align_size" in permute_params,
        dispatcher_over_budget=hasattr(token_dispatcher.MoEFlexTokenDispatcher, "check_over_budget"),
        experts_builder_call=hasattr(moe_layer, "ExpertsBuilder"),
        align_default=_default_align(),
    )


def _default_align() -> int:
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    class _Plain:  # the fields get_align_size_for_quantization reads, all off
        fp8 = None
        fp4 = None
        use_transformer_engine_op_fuser = False

    return int(get_align_size_for_quantization(_Plain()))


def check_supported() -> None:
    """Raise if the installed megatron-core lacks what install() rebinds or relies on."""
    import megatron.core as mc
    from megatron.core.transformer.moe import token_dispatcher as td

    version = getattr(mc, "__version__", "0")
    if _version_tuple(version) < MIN_VERSION:
        raise RuntimeError(f"megatron_ep.megatron needs megatron-core >= {'.'.join(map(str, MIN_VERSION))}, found {version}")
    missing = [n for n in ("_DispatchManager", "_DeepepManager", "_HybridEPManager", "MoEFlexTokenDispatcher") if not hasattr(td, n)]
    if missing:
        raise RuntimeError(f"megatron-core {version}: token_dispatcher lacks {missing}; megatron_ep cannot plug in")
    # The dispatcher must still look the managers up as module globals at construction time
    # (rebinding the names is how we plug in); a version that imports them elsewhere would
    # silently keep its own managers.
    src = inspect.getsource(td.MoEFlexTokenDispatcher.__init__)
    for name in ("_DeepepManager(", "_HybridEPManager("):
        if name not in src:
            raise RuntimeError(f"megatron-core {version}: MoEFlexTokenDispatcher no longer constructs {name[:-1]} by name; "
                               "megatron_ep.megatron.install() would have no effect")


# ------------------------------------------------------------------------- config accessors
def cfg(config: Any, name: str, default=None):
    return getattr(config, name, default)


def flex_num_sms(config: Any, backend: str) -> Optional[int]:
    """SMs for our cuda kernels: moe_flex_dispatcher_num_sms (0.19) when set, else the
    per-backend knob (0.16 defaults: deepep 20, hybridep 16); None lets the kernels choose."""
    value = cfg(config, "moe_flex_dispatcher_num_sms")
    if value is None:
        value = cfg(config, "moe_deepep_num_sms" if backend == "deepep" else "moe_hybridep_num_sms")
    return int(value) if value else None


def quant_align(config: Any) -> int:
    """get_align_size_for_quantization(config) as a usable multiple (0.19 returns 0 for 'none')."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    return max(1, int(get_align_size_for_quantization(config)))


def deepep_align(config: Any) -> int:
    """Segment alignment Megatron's own DeepEP manager applies after its local permute:
    0.19 pads to get_align_size_for_quantization (0 -> none); 0.16 only when
    moe_router_padding_for_quantization is set."""
    if features().permute_pads_segments:
        return quant_align(config)
    return quant_align(config) if cfg(config, "moe_router_padding_for_quantization") else 1


def rank_capacity_factor(config: Any) -> Optional[float]:
    return cfg(config, "moe_expert_rank_capacity_factor") if features().rank_capacity_factor else None


# ---------------------------------------------------------------------------- layer specs
def moe_submodules(mlp_spec: Any):
    """MoESubmodules of an MoE layer spec: a ModuleSpec (0.16) or a functools.partial (0.19)."""
    if isinstance(mlp_spec, functools.partial):
        return mlp_spec.keywords["submodules"]
    return mlp_spec.submodules


def with_experts(mlp_spec: Any, experts: Any):
    """A copy of an MoE layer spec whose experts are `experts` (a class: both versions accept a
    class, 0.16 through build_module, 0.19 by calling it)."""
    sub = dataclasses.replace(moe_submodules(mlp_spec), experts=experts)
    if isinstance(mlp_spec, functools.partial):
        return functools.partial(mlp_spec.func, *mlp_spec.args, **{**mlp_spec.keywords, "submodules": sub})
    return dataclasses.replace(mlp_spec, submodules=sub)
