"""Decode steps of megatron-core MoE layers on megatron_ep's low-latency path (opt-in).

    import megatron_ep.megatron.decode as mep_decode
    mep_decode.enable_decode(model, max_tokens_per_rank=128)   # after the model is built
    with torch.no_grad(), mep_decode.decode_step():            # a decode step (every EP rank)
        logits = model(tokens, position_ids, attention_mask, inference_context=ctx)

Inside a decode step every wrapped `MoELayer` runs router -> low-latency dispatch (one kernel,
no host sync; `Buffer.low_latency_dispatch`) -> masked grouped expert MLP on the layer's own
expert weights -> low-latency combine (applies the routing probs) -> + shared expert: the
computation of `megatron_ep.experts.decode_layer.DecodeMoELayer`. Outside one (training,
prefill, evaluation) the layer's own forward runs, with whatever dispatcher it was built with.

Why a wrapper: megatron-core has no hook a dispatcher plugin can use for decode.
* 0.16: `MoELayer.forward` does not know about inference at all; `TransformerLayer._forward_mlp`
  sees `inference_context` but calls `self.mlp(x, padding_mask=...)` without it.
* 0.19: `MoELayer.forward` swaps `token_dispatcher` for `_inference_token_dispatcher` while
  `megatron.core.inference.utils.InferenceMode.is_active()`, but only for
  `transformer_impl="inference_optimized"`, whose dispatchers (`NCCLAllGatherDispatcher`,
  `NVLSAllGatherVDispatcher`, token_dispatcher_inference.py) are all-gather based and feed
  `InferenceGroupedMLP` (TE, no GLU) a routing map over all gathered tokens; the low-latency
  layout (`[local experts, R * max_tokens, H]` with per-expert counts) fits neither.
So `enable_decode` replaces `forward` on the layer instances (nothing global is patched;
`disable_decode` restores them).

When a step is a decode step (the choice must be the same on every rank of the EP group: the
low-latency calls are collectives):
* `decode_step()` (context manager) or `set_decode_step(True/False)`: explicit, process-wide;
* `follow_inference_context=True` (default): a forward pre-hook on `model` (a `GPTModel` or
  `TransformerBlock`: anything whose forward takes `inference_context`) turns decode on for that
  forward when `inference_context.is_decode_only()`, gradients are off, and every EP rank
  agrees, including that its tokens fit `max_tokens_per_rank` (`agree=True`: one all-reduce of
  two ints over the EP group per model forward, outside any CUDA graph of the layers; Megatron's
  dynamic engine makes the same agreement when it picks decode CUDA graphs).
A module in training mode always takes its normal path. A decode step is not differentiable: with
autograd on and the layer or its input requiring grad it is refused (run it under
`torch.no_grad()` / `torch.inference_mode()`). Every refusal of a step (gradients, more tokens than
`max_tokens_per_rank`, partial CUDA graphs) is raised through the layer's Buffer, so every EP rank
raises (the others PeerFailedError naming it) instead of waiting for this rank's part. The decode
Buffer is the flex managers' (one per EP group): a rank in a decode step while another runs the
normal forward raises CallMismatchError on both, within the Buffer's timeout.

Expert weights (this rank's local experts, `[L, F or 2F, H]` and `[L, H, F]`): read in place
from megatron_ep's `GroupedGemmExperts` and 0.16's legacy `GroupedMLP` (views); stacked from
`SequentialMLP` (`local_experts[i].linear_fc{1,2}.weight`) and `TEGroupedMLP` (`weight{i}`):
one extra copy of the local experts, made at every decode forward by default. A key such as
(address, `_version`) cannot tell when to re-stack: Megatron's optimizers write the new weights
through tensors that share the parameter's memory (`param.data.copy_`, the distributed
optimizer's buffer views), which changes neither, so a train-then-decode loop (RL rollouts)
would decode with the previous step's weights. `enable_decode(keep_weights=True)` keeps the stack
(static weights, e.g. a serving process); `refresh_decode_weights(model)` then re-stacks it in
place after the weights change (in place, so a captured CUDA graph sees the new weights). What
the parameters' objects, dtype, device and shape tell is followed without a refresh: a replaced
Parameter (`load_state_dict(assign=True)`) or `layer.to(dtype)` makes a new stack at the next
decode forward (and a refresh makes a new one rather than copying into the old). The view
layouts are never kept: they are the parameters.
Not supported (raise naming the setting): expert tensor parallelism, attention TP > 1, expert
biases, MoE latent projections, `glu_linear_offset`, `activation_func_clamp_value`,
`transformer_impl="inference_optimized"`.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.checks import fail
from ..experts.decode_layer import decode_moe
from ..core.permute import routing_map_to_topk
from . import compat
from .buffers import fail_call, get_buffer

_DECODE = {"active": False}


def is_decode_step() -> bool:
    return _DECODE["active"]


def set_decode_step(active: bool) -> None:
    """Process-wide: wrapped MoE layers (not in training mode) take the low-latency path."""
    _DECODE["active"] = bool(active)


@contextlib.contextmanager
def decode_step(active: bool = True):
    """`with decode_step():` the wrapped MoE layers run the low-latency path (all EP ranks)."""
    before = _DECODE["active"]
    _DECODE["active"] = bool(active)
    try:
        yield
    finally:
        _DECODE["active"] = before


# -------------------------------------------------------------------------- expert weights
def _params_of(experts) -> Tuple[str, List[torch.Tensor]]:
    """(kind, the parameters the weights come from)."""
    L = experts.num_local_experts
    if hasattr(experts, "local_experts"):  # SequentialMLP
        mlps = list(experts.local_experts)
        for m in mlps:
            fail(getattr(m.linear_fc1, "bias", None) is None and getattr(m.linear_fc2, "bias", None) is None,
                 "decode path: expert biases are not supported (add_bias_linear=False)")
        return "sequential", [m.linear_fc1.weight for m in mlps] + [m.linear_fc2.weight for m in mlps]
    fc1 = getattr(experts, "linear_fc1", None)
    if fc1 is not None and hasattr(fc1, "weight0"):  # TEGroupedMLP: TE GroupedLinear, weight{i} per expert
        fc2 = experts.linear_fc2
        fail(not getattr(fc1, "single_grouped_weight", False) and not getattr(fc2, "single_grouped_weight", False),
             "decode path: TEGroupedMLP with a single grouped weight is not supported")
        fail(not getattr(fc1, "use_bias", False) and not getattr(fc2, "use_bias", False),
             "decode path: expert biases are not supported (add_bias_linear=False)")
        return "te_grouped", [getattr(fc1, f"weight{i}") for i in range(L)] + [getattr(fc2, f"weight{i}") for i in range(L)]
    if hasattr(experts, "weight1") and hasattr(experts, "weight2"):
        # megatron_ep's GroupedGemmExperts: [L, F|2F, H] / [L, H, F]; 0.16's GroupedMLP: [H, L*(F|2F)] / [L*F, H]
        kind = "ours" if experts.weight1.dim() == 3 else "legacy_grouped"
        return kind, [experts.weight1, experts.weight2]
    raise TypeError(f"decode path: experts of type {type(experts).__name__} are not supported "
                    "(SequentialMLP, TEGroupedMLP, GroupedMLP, megatron_ep GroupedGemmExperts are)")


def expert_weights(experts, hidden_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's expert weights as w1 [L, F or 2F, H], w2 [L, H, F] (megatron_ep.experts.mlp's
    layout: y = w2 @ act(w1 @ x)); views where the module stores them that way, else stacked."""
    kind, params = _params_of(experts)
    L = experts.num_local_experts
    if kind == "ours":
        return params[0], params[1]
    if kind == "legacy_grouped":  # x @ weight1.view(L, H, -1)[e] in GroupedMLP.forward
        return (params[0].view(L, hidden_size, -1).transpose(1, 2),
                params[1].view(L, -1, hidden_size).transpose(1, 2))
    return torch.stack([p.detach() for p in params[:L]]), torch.stack([p.detach() for p in params[L:]])


# ------------------------------------------------------------------------------ the layer
def _stacked(kind: str) -> bool:
    """Whether decode reads a copy of the weights (stacked from per-expert tensors) rather than
    views of the parameters (GroupedGemmExperts, 0.16's GroupedMLP: read in place each forward)."""
    return kind in ("sequential", "te_grouped")


def _weights_key(params: List[torch.Tensor]) -> tuple:
    """What a kept stack was made from: the parameters themselves (a replaced Parameter, as
    load_state_dict(assign=True) makes, is another object) and their dtype, device and shape
    (layer.to(dtype) keeps the objects and changes these). Not their values: an optimizer writes
    those in place, which only refresh_decode_weights() can tell (see the module docstring)."""
    return tuple((id(p), p.dtype, p.device, tuple(p.shape)) for p in params)


@dataclass
class DecodeState:
    """What `enable_decode` keeps on a layer (`layer.megatron_ep_decode`)."""

    max_tokens_per_rank: int
    use_fp8: bool
    expected_m: Optional[int]
    normal_forward: object
    group: object
    decode_calls: int = 0
    normal_calls: int = 0
    keep_weights: bool = False
    _weights: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    _key: Optional[tuple] = None  # _weights_key of the parameters the kept stack was made from

    def weights(self, layer) -> Tuple[torch.Tensor, torch.Tensor]:
        """w1, w2 for this forward: views of the parameters where the module stores them stacked
        (always the module's current parameters); otherwise a fresh stack, or under keep_weights
        the kept one -- made anew when the parameters were replaced or changed dtype, device or
        shape since it was made."""
        kind, params = _params_of(layer.experts)
        if not _stacked(kind) or not self.keep_weights:
            self._weights = self._key = None
            return expert_weights(layer.experts, layer.config.hidden_size)
        self._restack_if_changed(layer, params)
        return self._weights

    def _restack_if_changed(self, layer, params: List[torch.Tensor]) -> bool:
        """A new kept stack where there is none or the parameters' objects, dtype, device or shape
        changed since it was made (_weights_key); whether it made one."""
        key = _weights_key(params)
        if self._weights is not None and key == self._key:
            return False
        self._weights, self._key = expert_weights(layer.experts, layer.config.hidden_size), key
        return True

    @torch.no_grad()
    def refresh(self, layer) -> None:
        """Re-stack the kept weights in place (the same tensors: CUDA graphs follow); made anew
        where the parameters' objects, dtype, device or shape changed (a graph captured with the
        old stack must then be captured again)."""
        if self._weights is None:
            return
        if self._restack_if_changed(layer, _params_of(layer.experts)[1]):
            return
        w1, w2 = expert_weights(layer.experts, layer.config.hidden_size)
        for kept, new in ((self._weights[0], w1), (self._weights[1], w2)):
            kept.copy_(new)


def check_layer(layer) -> None:
    """Raise naming what the decode path cannot run for this MoELayer."""
    cfg = layer.config
    fail(compat.cfg(cfg, "transformer_impl") != "inference_optimized",
         "decode path: transformer_impl='inference_optimized' has its own inference dispatcher")
    fail(not compat.cfg(cfg, "moe_latent_size"), "decode path: MoE latent projections are not supported")
    fail(not compat.cfg(cfg, "add_bias_linear", False), "decode path: expert biases are not supported (add_bias_linear=False)")
    fail(compat.cfg(cfg, "glu_linear_offset", 0.0) == 0.0, "decode path: glu_linear_offset != 0 is not supported")
    fail(compat.cfg(cfg, "activation_func_clamp_value") is None, "decode path: activation_func_clamp_value is not supported")
    fail(not compat.cfg(cfg, "moe_apply_probs_on_input", False) or cfg.moe_router_topk == 1,
         "moe_apply_probs_on_input needs moe_router_topk == 1")
    tp = getattr(layer, "tp_group", None)
    fail(tp is None or tp.size() == 1, "decode path: tensor parallelism (TP > 1) is not supported")
    expt_tp = getattr(getattr(layer.token_dispatcher, "tp_group", None), "size", lambda: 1)()
    fail(expt_tp == 1, "decode path: expert tensor parallelism is not supported")
    _params_of(layer.experts)
    R = layer.token_dispatcher.ep_group.size()
    L = layer.num_local_experts
    ep_rank = layer.token_dispatcher.ep_group.rank()
    fail(list(layer.local_expert_indices) == list(range(ep_rank * L, (ep_rank + 1) * L)),
         f"decode path: local experts {list(layer.local_expert_indices)} are not rank-contiguous over the EP group")
    fail(L * R == cfg.num_moe_experts, f"decode path: {L} local experts x {R} EP ranks != {cfg.num_moe_experts} experts")


def _refusal(layer, hidden_states: torch.Tensor, intermediate) -> Optional[BaseException]:
    """Why this rank cannot run the decode step it was asked to (None: it can). Raised through
    the layer's Buffer (`fail_call`), so the peers, which may already wait in the step's
    low-latency dispatch, raise PeerFailedError naming it instead of waiting."""
    st: DecodeState = layer.megatron_ep_decode
    T = hidden_states.shape[0] * hidden_states.shape[1]
    if intermediate is not None:
        return ValueError("decode path: partial MoE CUDA graphs (intermediate_tensors) are not supported")
    if T > st.max_tokens_per_rank:
        return ValueError(f"decode path: {T} tokens on this rank, more than max_tokens_per_rank="
                          f"{st.max_tokens_per_rank} (enable_decode(max_tokens_per_rank=...))")
    if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters())):
        # the decode step is not differentiable: a backward through it would leave the experts'
        # and the router's gradients out in silence
        return RuntimeError("decode path: a decode step runs without gradients, but autograd is on and the layer "
                            "or its input requires grad; run decode steps under torch.no_grad() or "
                            "torch.inference_mode(), or outside decode_step() for a differentiable forward")
    return None


def _buffer(layer, x: torch.Tensor):
    cfg = layer.config
    return get_buffer(layer.megatron_ep_decode.group, x, cfg.num_moe_experts, cfg.moe_router_topk,
                      compat.flex_num_sms(cfg, compat.cfg(cfg, "moe_flex_dispatcher_backend", "deepep")))


def decode_forward(layer, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                   intermediate=None):
    """One MoELayer forward on the low-latency path: (output [S, B, H], None), as MoELayer.forward.
    A step this rank cannot run raises on every rank of the EP group (`_refusal`)."""
    st: DecodeState = layer.megatron_ep_decode
    S, B, H = hidden_states.shape
    error = _refusal(layer, hidden_states, intermediate)
    if error is not None:
        fail_call(_buffer(layer, hidden_states.reshape(S * B, H)), "low_latency_dispatch", error)
    with torch.no_grad():
        out = _decode(layer, hidden_states, padding_mask)
    st.decode_calls += 1
    return out, None


def _decode(layer, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    st: DecodeState = layer.megatron_ep_decode
    cfg = layer.config
    S, B, H = hidden_states.shape
    T = S * B
    shared = layer.shared_experts(hidden_states) if getattr(layer, "use_shared_expert", False) else None
    if padding_mask is not None:
        padding_mask = padding_mask.transpose(0, 1).bool()
    E, K = cfg.num_moe_experts, cfg.moe_router_topk
    if T == 0:  # an idle rank still serves its experts; Megatron's router cannot take 0 tokens
        topk_idx = torch.empty((0, K), dtype=torch.int64, device=hidden_states.device)
        topk_w = torch.empty((0, K), dtype=torch.float32, device=hidden_states.device)
    else:
        probs, routing_map = layer.route(hidden_states, padding_mask)
        topk_idx, topk_w = routing_map_to_topk(routing_map.reshape(T, E), probs.reshape(T, E), K)
    topk_w = topk_w.float().contiguous()
    x = hidden_states.reshape(T, H)
    if compat.cfg(cfg, "moe_apply_probs_on_input", False):  # top-1: the prob scales the expert's input
        x = (x * topk_w.to(x.dtype)).to(x.dtype)
        topk_w = (topk_idx >= 0).float()
    buf = _buffer(layer, x)
    if buf.backend == "cuda":
        x = x.to(torch.bfloat16)  # the kernels move bf16 (or FP8 cast from it)
    w1, w2 = st.weights(layer)
    y = decode_moe(buf, x.contiguous(), topk_idx.contiguous(), topk_w, w1, w2, num_experts=E,
                   max_tokens_per_rank=st.max_tokens_per_rank, activation=cfg.activation_func,
                   glu=bool(cfg.gated_linear_unit), use_fp8=st.use_fp8, expected_m=st.expected_m)
    out = y.to(hidden_states.dtype).view(S, B, H)
    return out if shared is None else out + shared


def _wrapped_forward(layer, hidden_states, *args, **kwargs):
    st: DecodeState = layer.megatron_ep_decode
    if layer.training or not is_decode_step():
        st.normal_calls += 1
        return st.normal_forward(hidden_states, *args, **kwargs)
    intermediate = kwargs.get("intermediate_tensors", args[0] if args else None)
    return decode_forward(layer, hidden_states, kwargs.get("padding_mask", args[1] if len(args) > 1 else None),
                          intermediate)


def decode_group(layer):
    """The EP group of the layer's decode Buffer: its flex manager's (the dispatcher's
    `tp_ep_group`, the same ranks as `ep_group` wherever decode runs: TP = expert TP = 1), so a
    decode step on some ranks and a normal forward on others are calls of one Buffer, which
    raises CallMismatchError on every rank instead of each waiting in a Buffer of its own."""
    disp = layer.token_dispatcher
    tp_ep = getattr(disp, "tp_ep_group", None)
    if tp_ep is not None and dist.get_process_group_ranks(tp_ep) == dist.get_process_group_ranks(disp.ep_group):
        return tp_ep
    return disp.ep_group


def moe_layers(model: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def enable_decode(model: torch.nn.Module, *, max_tokens_per_rank: int = 128, use_fp8: bool = False,
                  expected_m: Optional[int] = None, follow_inference_context: bool = True, agree: bool = True,
                  keep_weights: bool = False) -> list:
    """Wrap every MoELayer in `model` (idempotent); returns them.

    max_tokens_per_rank: the low-latency capacity (tokens per rank in a decode step);
    use_fp8: FP8 dispatch (per-128-channel scales; H a multiple of 128), else the layer's bf16;
    expected_m: DeepGEMM's masked-GEMM hint of rows per expert (default from the capacity);
    follow_inference_context / agree: see the module docstring;
    keep_weights: keep the stacked expert weights of SequentialMLP / TEGroupedMLP between decode
    forwards instead of stacking them at each one; call `refresh_decode_weights(model)` after
    every change of the weights (an optimizer step), or decode runs on the old ones."""
    fail(isinstance(max_tokens_per_rank, int) and max_tokens_per_rank >= 1,
         f"max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}")
    layers = moe_layers(model)
    fail(bool(layers), f"enable_decode: no megatron-core MoELayer in {type(model).__name__}")
    for layer in layers:
        check_layer(layer)
        if isinstance(getattr(layer, "megatron_ep_decode", None), DecodeState):
            st = layer.megatron_ep_decode
            st.max_tokens_per_rank, st.use_fp8, st.expected_m = max_tokens_per_rank, use_fp8, expected_m
            if st.keep_weights != keep_weights:
                st.keep_weights, st._weights, st._key = keep_weights, None, None
            continue
        layer.megatron_ep_decode = DecodeState(max_tokens_per_rank, use_fp8, expected_m, layer.forward,
                                               decode_group(layer), keep_weights=keep_weights)
        layer.forward = types.MethodType(_wrapped_forward, layer)
    if follow_inference_context and getattr(model, "_megatron_ep_decode_hooks", None) is None:
        params = inspect.signature(model.forward).parameters
        if "inference_context" in params or "inference_params" in params:
            group = layers[0].megatron_ep_decode.group
            pre = model.register_forward_pre_hook(_context_pre_hook(model, group, max_tokens_per_rank, agree),
                                                  with_kwargs=True)
            post = model.register_forward_hook(_context_post_hook, always_call=True)  # also when forward raises
            model._megatron_ep_decode_hooks = (pre, post)
    return layers


def refresh_decode_weights(model: torch.nn.Module) -> None:
    """After the expert weights changed (an optimizer step), re-stack the weights that
    `enable_decode(keep_weights=True)` keeps, in place. Without keep_weights there is nothing kept."""
    for layer in moe_layers(model):
        st = getattr(layer, "megatron_ep_decode", None)
        if isinstance(st, DecodeState):
            st.refresh(layer)


def disable_decode(model: torch.nn.Module) -> None:
    """Restore the layers' own forward and remove the inference-context hooks."""
    for layer in moe_layers(model):
        st = getattr(layer, "megatron_ep_decode", None)
        if isinstance(st, DecodeState):
            del layer.forward  # the instance attribute; the class's forward is back
            del layer.megatron_ep_decode
    for hook in getattr(model, "_megatron_ep_decode_hooks", None) or ():
        hook.remove()
    model._megatron_ep_decode_hooks = None


# ------------------------------------------------------------- following inference_context
_HOOK_SAVED: list = []


def _agreed(local_ok: bool, group, agree: bool) -> bool:
    if not agree or dist.get_world_size(group) == 1:
        return local_ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    flag = torch.tensor([0 if local_ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) == 0


def _context_pre_hook(model, group, max_tokens: int, agree: bool):
    sig = inspect.signature(model.forward)

    def hook(module, args, kwargs):
        bound = sig.bind_partial(*args, **kwargs).arguments
        ctx = bound.get("inference_context") or bound.get("inference_params")
        _HOOK_SAVED.append(is_decode_step())
        if ctx is None or module.training or torch.is_grad_enabled():
            return  # not inference (the same on every rank): no agreement, the explicit flag stands
        decode = hasattr(ctx, "is_decode_only") and bool(ctx.is_decode_only())
        first = next((v for v in bound.values() if torch.is_tensor(v)), None)  # input_ids [B, S] / hidden [S, B, H]
        tokens = 0 if first is None else (first.numel() if first.dim() <= 2 else first.shape[0] * first.shape[1])
        set_decode_step(_agreed(decode and tokens <= max_tokens, group, agree))

    return hook


def _context_post_hook(module, args, output):
    if _HOOK_SAVED:
        set_decode_step(_HOOK_SAVED.pop())


__all__ = ["DecodeState", "check_layer", "decode_forward", "decode_step", "disable_decode", "enable_decode",
           "expert_weights", "is_decode_step", "moe_layers", "refresh_decode_weights", "set_decode_step"]
