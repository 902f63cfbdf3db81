"""Differentiable dispatch/combine.

The backward of dispatch is combine along the same handle, and the backward of combine is a
cached dispatch: the symmetry every EP library keeps. Gradients flow to x and to the routing
weights (the per-row weights of a dispatch come back to [T, K] through combine's weight path).
Both are linear maps, each the other's adjoint, so each backward is itself the differentiable
other: second derivatives (double backward, gradgradcheck) are exact.

FP8 x carries no gradient; its topk_weights still do (their backward is a combine of the
weights alone, with narrow zero rows instead of the rows' width).
"""

from __future__ import annotations

from typing import Optional

import torch

from .buffer import Buffer
from .checks import is_fp8_tuple
from .types import CombineOutput, DispatchHandle, DispatchOutput

# The rows of a weights-only combine (the weights' gradient of an FP8 dispatch): zero rows of 16
# bytes (the kernels' narrowest row), so it costs a call's fixed price, not the rows' width.
_NARROW = (8, torch.bfloat16)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _contig(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


class _Dispatch(torch.autograd.Function):
    """Outputs (rows, row weights); with FP8 x (passed in `box`, x None) the row weights alone.
    Undefined output gradients arrive as zeros (autograd's default): every rank then makes the
    same backward call whatever its graph used."""

    @staticmethod
    def forward(ctx, buf: Buffer, box: dict, kwargs: dict, x, topk_weights):
        fp8 = x is None
        out = buf.dispatch(box.pop("fp8") if fp8 else x, topk_weights=topk_weights, **kwargs)
        ctx.buf, ctx.handle, ctx.fp8 = buf, out.handle, fp8
        ctx.has_weights = topk_weights is not None
        box["out"] = out
        return out.topk_weights if fp8 else (out.x, out.topk_weights)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.fp8:  # the weights alone, along zero rows
            (grad_w,) = grads
            rows = torch.zeros((ctx.handle.num_recv_rows, _NARROW[0]), dtype=_NARROW[1], device=grad_w.device)
            return None, None, None, None, combine(ctx.buf, rows, ctx.handle, weights=grad_w.contiguous()).weights
        grad_rows, grad_w = grads
        res = combine(ctx.buf, grad_rows.contiguous(), ctx.handle, weights=_contig(grad_w) if ctx.has_weights else None)
        return None, None, None, res.x, (res.weights if ctx.has_weights else None)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf: Buffer, handle: DispatchHandle, x, weights):
        res = buf.combine(x, handle, weights=weights)
        ctx.buf, ctx.handle, ctx.has_weights = buf, handle, weights is not None
        return res.x, res.weights

    @staticmethod
    def backward(ctx, grad_y, grad_w):
        w = _contig(grad_w) if ctx.has_weights else None
        d = dispatch(ctx.buf, grad_y.contiguous(), handle=ctx.handle, topk_weights=w)
        return None, None, d.x, (d.topk_weights if ctx.has_weights else None)


def dispatch(buf: Buffer, x, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
             num_experts: Optional[int] = None, permute: Optional[bool] = None,
             expert_alignment: Optional[int] = None, handle: Optional[DispatchHandle] = None,
             **options) -> DispatchOutput:
    """`buf.dispatch` with autograd: differentiable in x and topk_weights, to any order (FP8 x
    carries no gradient; its topk_weights do)."""
    kwargs = dict(topk_idx=topk_idx, num_experts=num_experts, permute=permute,
                  expert_alignment=expert_alignment, handle=handle, **options)
    fp8 = is_fp8_tuple(x)
    if not _needs_grad(None if fp8 else x, topk_weights):
        return buf.dispatch(x, topk_weights=topk_weights, **kwargs)
    box: dict = {"fp8": x} if fp8 else {}
    res = _Dispatch.apply(buf, box, kwargs, None if fp8 else x, topk_weights)
    out = box["out"]
    if fp8:
        out.topk_weights = res
    else:
        out.x, out.topk_weights = res
    return out


def combine(buf: Buffer, x: torch.Tensor, handle: DispatchHandle, weights: Optional[torch.Tensor] = None) -> CombineOutput:
    """`buf.combine` with autograd: differentiable in x and weights, to any order."""
    if not _needs_grad(x, weights):
        return buf.combine(x, handle, weights=weights)
    y, w = _Combine.apply(buf, handle, x, weights)
    return CombineOutput(y, w, None)


class _Refused(torch.autograd.Function):
    """Identity on the first `n` tensors; the rest (anchors) only put this node on the graph, so
    that the identity's outputs lead back to them. Any backward that reaches this node raises
    `message`: what stands for a graph that was not recorded (a backward that is not itself
    differentiable, a call outside autograd) then fails loudly instead of leaving its part out.
    The anchors must be the tensors the outputs really depend on (or tensors whose graph leads
    to them): a derivative taken with `torch.autograd.grad(..., inputs)` runs only the nodes on a
    path from its outputs to its inputs, so an anchor off that path (a fresh leaf) is never
    visited."""

    @staticmethod
    def forward(ctx, message: str, n: int, *tensors):
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


def refuse_gradient(message: str, tensors, anchors):
    """`tensors` (tensors or None) as views whose differentiation raises `message`, on the graph
    through every anchor that requires grad (None allowed). Unchanged with grad mode off or no
    such anchor: nothing then can differentiate them."""
    anchors = [a for a in anchors if a is not None and a.requires_grad]
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not (present and anchors and torch.is_grad_enabled()):
        return tuple(tensors)
    guarded = _Refused.apply(message, len(present), *(tensors[i] for i in present), *anchors)
    out = list(tensors)
    for i, g in zip(present, guarded):
        out[i] = g
    return tuple(out)


def refuse_second_derivative(what: str, grads, anchors):
    """What a backward that is not itself differentiable returns under create_graph=True: its
    gradients (tensors or None), tied to `anchors` (tensors whose graph reaches the node's inputs,
    and its incoming gradients), so a second derivative through it raises naming `what`,
    whether taken by `.backward()` or by `torch.autograd.grad(..., inputs)`."""
    return refuse_gradient(f"{what}: second derivatives are not supported (its backward is one node that is not "
                           f"itself differentiable); a double backward through it would miss that node's part",
                           grads, anchors)

