"""What differs between the megatron-core versions we plug into (0.16.x, 0.19.x, main).

Every difference is detected from the installed code (an attribute, a config field, a function
signature, what a function reads of a config that answers every field), never assumed from the
version string alone, and `features()` reports what was found so a launcher can log it. An
installed megatron-core that lacks what we rely on fails loudly in `check_supported()`, with
one IncompatibleMegatronError, instead of half-working.
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
    # main (0.20): the dispatcher's paged-stash rerun hooks (check_required_capacity,
    # grow_ep_recv_capacity, invalidate_ep_bootstrap), each used only if the manager has it.
    dispatcher_capacity_hooks: bool
    # 0.19: MoESubmodules.experts is a builder called directly (no ModuleSpec/build_module).
    experts_builder_call: bool
    # get_align_size_for_quantization with every config field off (0.16: 16; 0.19, main: 0).
    align_default: int
    # the config fields get_align_size_for_quantization reads (main adds moe_use_grouped_tensor).
    align_fields: Tuple[str, ...]


class IncompatibleMegatronError(RuntimeError):
    """The installed megatron-core lacks, or changed, something megatron_ep plugs into."""


class _AnyConfig:
    """A config that answers every field with `None` (off) except those in `on`, and records
    the fields it was asked for: a probe of what megatron-core reads, that a field added in a
    later release cannot break (a stub listing today's fields would)."""

    def __init__(self, on=()):
        object.__setattr__(self, "_on", dict(on))
        object.__setattr__(self, "read", [])

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.read.append(name)
        return self._on.get(name)


def _version() -> str:
    import megatron.core as mc

    return getattr(mc, "__version__", "unknown")


def _probe(what: str, fn, config: Optional[_AnyConfig] = None):
    """Run one probe; any failure becomes one error naming the version, the probe and the last
    config field it read."""
    try:
        return fn()
    except Exception as e:  # a probe must fail loudly and say where, whatever it raised
        field = f" (last config field read: {config.read[-1]!r})" if config is not None and config.read else ""
        raise IncompatibleMegatronError(
            f"megatron-core {_version()}: probing {what} failed{field}: {type(e).__name__}: {e}; "
            "megatron_ep.megatron cannot plug into this version") from e


@functools.lru_cache(maxsize=None)
def features() -> Features:
    """What the installed megatron-core does, probed once (cached after the first success; a
    failure raises IncompatibleMegatronError and is probed again next time)."""
    def modules():
        from megatron.core.transformer.moe import moe_layer, moe_utils, token_dispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig

        return moe_layer, moe_utils, token_dispatcher, {f.name for f in dataclasses.fields(TransformerConfig)}

    moe_layer, moe_utils, token_dispatcher, fields = _probe("the MoE modules and TransformerConfig's fields", modules)
    permute_params = _probe("moe_utils.permute's signature", lambda: inspect.signature(moe_utils.permute).parameters)
    flex = token_dispatcher.MoEFlexTokenDispatcher
    align_cfg = _AnyConfig()
    align_default = _probe("moe_utils.get_align_size_for_quantization",
                           lambda: int(moe_utils.get_align_size_for_quantization(align_cfg) or 0), align_cfg)
    return Features(
        version=_version(),
        unified_num_sms="moe_flex_dispatcher_num_sms" in fields,
        rank_capacity_factor="moe_expert_rank_capacity_factor" in fields,
        permute_pads_segments="align_size" in permute_params,
        dispatcher_over_budget=hasattr(flex, "check_over_budget"),
        dispatcher_capacity_hooks=all(hasattr(flex, n) for n in ("check_required_capacity", "grow_ep_recv_capacity",
                                                                 "invalidate_ep_bootstrap")),
        experts_builder_call=hasattr(moe_layer, "ExpertsBuilder"),
        align_default=align_default,
        align_fields=tuple(dict.fromkeys(align_cfg.read)),
    )


def check_supported() -> Features:
    """Raise IncompatibleMegatronError if the installed megatron-core lacks what install()
    rebinds or relies on; else return its features (every probe has run)."""
    from megatron.core.transformer.moe import token_dispatcher as td

    version = _version()
    if _version_tuple(version) < MIN_VERSION:
        raise IncompatibleMegatronError(f"megatron_ep.megatron needs megatron-core >= {'.'.join(map(str, MIN_VERSION))}, "
                                        f"found {version}")
    missing = [n for n in ("_DispatchManager", "_DeepepManager", "_HybridEPManager", "MoEFlexTokenDispatcher") if not hasattr(td, n)]
    if missing:
        raise IncompatibleMegatronError(f"megatron-core {version}: token_dispatcher lacks {missing}; megatron_ep cannot plug in")
    # The dispatcher must still look the managers up as module globals at construction time
    # (rebinding the names is how we plug in); a version that imports them elsewhere would
    # silently keep its own managers.
    src = _probe("MoEFlexTokenDispatcher.__init__'s source", lambda: inspect.getsource(td.MoEFlexTokenDispatcher.__init__))
    for name in ("_DeepepManager(", "_HybridEPManager("):
        if name not in src:
            raise IncompatibleMegatronError(f"megatron-core {version}: MoEFlexTokenDispatcher no longer constructs {name[:-1]} "
                                            "by name; megatron_ep.megatron.install() would have no effect")
    return features()


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
