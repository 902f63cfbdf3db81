"""Differentiable dispatch/combine.

The backward of dispatch is combine along the same handle, and the backward of combine is a
cached dispatch: the symmetry every EP library keeps. Gradients flow to x and to the routing
weights (the per-row weights of a dispatch come back to [T, K] through combine's weight path).
"""

from __future__ import annotations

from typing import Optional

import torch

from .buffer import Buffer
from .checks import is_fp8_tuple
from .types import CombineOutput, DispatchHandle, DispatchOutput


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _contig(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf: Buffer, box: dict, kwargs: dict, x, topk_weights):
        out = buf.dispatch(x, topk_weights=topk_weights, **kwargs)
        ctx.buf, ctx.handle = buf, out.handle
        ctx.rows_meta = (out.x.shape, out.x.dtype, out.x.device)
        ctx.has_weights = topk_weights is not None
        box["out"] = out
        return out.x, out.topk_weights

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        if grad_x is None:
            shape, dtype, device = ctx.rows_meta
            grad_x = torch.zeros(shape, dtype=dtype, device=device)
        w = _contig(grad_w) if ctx.has_weights and grad_w is not None else None
        res = ctx.buf.combine(grad_x.contiguous(), ctx.handle, weights=w)
        return None, None, None, res.x, (res.weights if ctx.has_weights else None)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf: Buffer, handle: DispatchHandle, x, weights):
        res = buf.combine(x, handle, weights=weights)
        ctx.buf, ctx.handle, ctx.has_weights = buf, handle, weights is not None
        ctx.y_meta = (res.x.shape, res.x.dtype, res.x.device)
        return res.x, res.weights

    @staticmethod
    def backward(ctx, grad_y, grad_w):
        if grad_y is None:
            shape, dtype, device = ctx.y_meta
            grad_y = torch.zeros(shape, dtype=dtype, device=device)
        w = _contig(grad_w) if ctx.has_weights and grad_w is not None else None
        d = ctx.buf.dispatch(grad_y.contiguous(), handle=ctx.handle, topk_weights=w)
        grad_weights = d.topk_weights if ctx.has_weights else None
        return None, None, d.x, grad_weights


def dispatch(buf: Buffer, x, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
             num_experts: Optional[int] = None, permute: Optional[bool] = None,
             expert_alignment: Optional[int] = None, handle: Optional[DispatchHandle] = None,
             **options) -> DispatchOutput:
    """`buf.dispatch` with autograd: differentiable in x and topk_weights (FP8 x is not)."""
    kwargs = dict(topk_idx=topk_idx, num_experts=num_experts, permute=permute,
                  expert_alignment=expert_alignment, handle=handle, **options)
    if is_fp8_tuple(x) or not _needs_grad(x, topk_weights):
        return buf.dispatch(x, topk_weights=topk_weights, **kwargs)
    box: dict = {}
    out_x, out_w = _Dispatch.apply(buf, box, kwargs, x, topk_weights)
    out = box["out"]
    out.x, out.topk_weights = out_x, out_w
    return out


def combine(buf: Buffer, x: torch.Tensor, handle: DispatchHandle, weights: Optional[torch.Tensor] = None) -> CombineOutput:
    """`buf.combine` with autograd: differentiable in x and weights."""
    if not _needs_grad(x, weights):
        return buf.combine(x, handle, weights=weights)
    y, w = _Combine.apply(buf, handle, x, weights)
    return CombineOutput(y, w, None)
