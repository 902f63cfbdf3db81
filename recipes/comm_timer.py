"""Per-step dispatch / combine time of every MoE layer, forward and backward.

Wraps each dispatcher's `token_dispatch` and `token_combine` (the communication steps of every
Megatron dispatcher: alltoall and flex alike). Forward time is measured around the call; the
backward of the same step is bracketed by two pass-through autograd markers, one on the output
(its backward starts the clock) and one on the input (its backward stops it). On GPU every mark
synchronises the device, which serialises overlap: the numbers are for attribution, the step
time without `--time-comm` is the throughput figure.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, timer, key, edge):
        ctx.timer, ctx.key, ctx.edge = timer, key, edge
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.backward_edge(ctx.key, ctx.edge)
        return grad, None, None, None


class CommTimer:
    def __init__(self, sync_cuda: bool):
        self.sync_cuda = sync_cuda
        self.totals = defaultdict(float)
        self._open = defaultdict(list)

    def now(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def reset(self) -> None:
        self.totals.clear()

    def backward_edge(self, key: str, edge: str) -> None:
        if edge == "start":
            self._open[key].append(self.now())
        elif self._open[key]:
            self.totals[key + "_bwd"] += self.now() - self._open[key].pop()

    def _mark(self, x, key, edge):
        return _Mark.apply(x, self, key, edge) if torch.is_tensor(x) and x.requires_grad else x

    def wrap(self, dispatcher) -> None:
        dispatch, combine = dispatcher.token_dispatch, dispatcher.token_combine

        def token_dispatch(hidden_states, probs, *args, **kwargs):
            hidden_states = self._mark(hidden_states, "dispatch", "end")
            t0 = self.now()
            out, out_probs = dispatch(hidden_states, probs, *args, **kwargs)
            self.totals["dispatch_fwd"] += self.now() - t0
            return self._mark(out, "dispatch", "start"), out_probs

        def token_combine(hidden_states, *args, **kwargs):
            hidden_states = self._mark(hidden_states, "combine", "end")
            t0 = self.now()
            out = combine(hidden_states, *args, **kwargs)
            self.totals["combine_fwd"] += self.now() - t0
            return self._mark(out, "combine", "start")

        dispatcher.token_dispatch = token_dispatch
        dispatcher.token_combine = token_combine
