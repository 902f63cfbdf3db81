"""A call replayed: a cached dispatch or a combine whose arguments have the shape of the last such
call along the same handle, or a new routing whose arguments have the shape and options of the
last new routing (which passed every check then), skips the checks that depend only on that shape
(Buffer's and its backend's) and the plan they decide, and crosses into the backend's kernels
with what it bound then.

The backend makes the replay after a call that passed (it alone knows which of its decisions hold
for every call of that shape) and keeps it: on the handle, or for a new routing on its path
(`routing_replay`); Buffer takes it when the call's other arguments allow it and `matches` holds,
else checks everything again. What can
change between two calls of one shape -- the region (grown, a zero-copy input), the SM budget,
the output hook, a CUDA-graph capture, the Buffer's state -- is decided again at every call by
the same code the full call runs."""

from __future__ import annotations

from typing import Callable, List, Optional

import torch


class Replay:
    """The shape of one call's arguments (x: a tensor, or an FP8 (data, scales) pair; the weights,
    or None), the call's signature then, and `run(handle, call, x, weights, async_op,
    previous_event)`, the backend's call without its checks. (It holds no handle: a handle that
    held a replay holding it would live until the cycle collector ran, and its tensors with it.)"""

    __slots__ = ("sig", "run", "shape", "dtype", "device", "scales_shape", "w_shape", "w_dtype", "idx_shape",
                 "options", "held")

    def __init__(self, sig: List[int], run: Callable, x, weights: Optional[torch.Tensor],
                 topk_idx: Optional[torch.Tensor] = None, options: tuple = (), held: tuple = ()):
        data = x[0] if type(x) is tuple else x
        self.sig, self.run = list(sig), run
        # tensors the call took by identity (statistics the kernels add to), kept alive here: the
        # replay serves those very tensors only, so their checks hold
        self.held = held
        # a new routing's (Buffer keeps one, the backend's): the ids' shape and the call's options
        self.idx_shape, self.options = (None if topk_idx is None else topk_idx.shape), options
        self.shape, self.dtype, self.device = data.shape, data.dtype, data.device
        self.scales_shape = x[1].shape if type(x) is tuple else None
        self.w_shape = None if weights is None else weights.shape
        self.w_dtype = None if weights is None else weights.dtype

    def matches(self, x, weights: Optional[torch.Tensor]) -> bool:
        """Whether (x, weights) have the shape of the call that made this replay: the same types,
        sizes, dtypes and device, contiguous, outside a CUDA-graph capture (a captured call
        decides otherwise) and, with grad mode on, requiring no grad (Buffer refuses to carry it)."""
        if type(x) is tuple:
            if self.scales_shape is None or len(x) != 2:
                return False
            data, scales = x
            if type(scales) is not torch.Tensor or scales.shape != self.scales_shape or scales.dtype != torch.float32 \
                    or not scales.is_contiguous() or scales.device != self.device or scales.requires_grad:
                return False
        else:
            if self.scales_shape is not None:
                return False
            data = x
        if type(data) is not torch.Tensor or data.shape != self.shape or data.dtype != self.dtype \
                or not data.is_contiguous() or data.device != self.device:
            return False
        if weights is None:
            if self.w_shape is not None:
                return False
        elif type(weights) is not torch.Tensor or weights.shape != self.w_shape or weights.dtype != self.w_dtype \
                or not weights.is_contiguous() or weights.device != self.device:
            return False
        if torch.is_grad_enabled() and (data.requires_grad or (weights is not None and weights.requires_grad)):
            return False
        return not torch.cuda.is_current_stream_capturing()

    def matches_routing(self, x, topk_idx, weights: Optional[torch.Tensor], options: tuple) -> bool:
        """`matches` for a new routing (RoutingReplay): topk_idx of the replayed call's shape too
        (int64, contiguous, on x's device), and the call's other options the same."""
        return options == self.options and type(topk_idx) is torch.Tensor and topk_idx.shape == self.idx_shape \
            and topk_idx.dtype == torch.int64 and topk_idx.is_contiguous() and topk_idx.device == self.device \
            and self.matches(x, weights)

    def __deepcopy__(self, memo):
        """A copied handle has no replay: the copy's first calls check everything and make their own
        (the backend's bound objects do not copy)."""
        return None


def low_latency_combine_shape(handle, return_recv_hook: bool) -> tuple:
    """What a low-latency combine's checks read of its handle (a LowLatencyHandle) and the receive
    hook: the backend's replay keeps it, Buffer matches a call's against it (handles of one shape
    pass those checks alike)."""
    return (handle.backend, handle.num_experts, handle.max_tokens_per_rank, handle.hidden, handle.topk,
            handle.num_tokens, handle.num_ranks, return_recv_hook)
