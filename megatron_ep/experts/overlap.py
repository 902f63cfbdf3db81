"""Routed experts with their communication under the expert GEMMs: the tokens cut into chunks,
each chunk its own dispatch, expert MLP and combine, issued so that chunk c + 1's dispatch runs
on the buffer's communication stream while chunk c's GEMMs run on the caller's stream, and chunk
c's combine while chunk c + 1's GEMMs run (megatron_ep/model/overlap.py, mechanism "chunks":
every chunk pays a call's fixed cost, in exchange for no kernel change).

Backward overlaps the same way without anything more: the backward of a combine is a cached
dispatch and the backward of a dispatch a combine (megatron_ep.autograd), each on the buffer's
stream, and autograd reaches the chunks' nodes interleaved, so one chunk's gradient transfers
run while another chunk's GEMM backward computes.

The overlap needs the host to issue ahead. Without ``num_worst_tokens`` each chunk's dispatch
tells the host its row counts (a host sync at its notify), so the host issues chunk c's GEMMs
only once chunk c + 1's counts are in: the chunks overlap partly. With ``num_worst_tokens``
every chunk is worst-case sized (that many rows per rank, pad rows after the real ones, rows past
it dropped and counted in each chunk's ``num_dropped``): no host sync, the host runs ahead.

Every rank must pass the same ``chunks``: each chunk is one collective call. A rank with fewer
tokens (or none) makes the same calls with smaller (or empty) chunks.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from .. import autograd
from ..checks import check_int, fail
from ..permute import worst_case_segments
from .layout import GroupedLayout
from .mlp import expert_mlp


def chunk_bounds(num_tokens: int, chunks: int) -> List[tuple]:
    """[start, end) of each chunk: ``chunks`` contiguous pieces, sizes differing by at most one."""
    base, extra = divmod(num_tokens, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def chunked_expert_mlp(buffer, x: torch.Tensor, topk_idx: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor,
                       w2: torch.Tensor, num_experts: int, chunks: int = 4, expert_alignment: int = 1,
                       activation: Callable = F.gelu, glu: bool = False, backend: Optional[str] = None,
                       num_worst_tokens: Optional[int] = None,
                       mark: Optional[Callable[[str, int], None]] = None,
                       on_dispatch: Optional[Callable[[int, object], None]] = None) -> torch.Tensor:
    """MoE experts over ``chunks`` pipelined dispatch / expert MLP / combine rounds.

    x [T, H], topk_idx [T, K] (int64, -1 = unused slot), probs [T, K] (the routing weights,
    applied inside the experts as Megatron does), w1 [L, F or 2F, H], w2 [L, H, F] for this rank's
    L local experts -> [T, H]: the same as one round (``chunks=1``) up to the order of
    floating-point sums in the GEMMs. Differentiable in x, probs, w1 and w2.

    ``mark(point, chunk)``, when given, is called on the host right after each chunk's
    ``"dispatched"`` (its rows are usable on the caller's stream from here), ``"computed"`` (its
    expert MLP issued) and ``"combined"`` (its combine issued): a timeline hook, e.g. recording a
    CUDA event on the current stream (scripts/bench_overlap.py does). ``on_dispatch(chunk, out)``
    sees each chunk's DispatchOutput (e.g. to count ``out.num_dropped`` of a worst-case sized one).
    """
    check_int("chunks", chunks, 1)
    if num_worst_tokens is not None:
        check_int("num_worst_tokens", num_worst_tokens, 1)
    options = {} if num_worst_tokens is None else {"num_worst_tokens": num_worst_tokens}
    fail(x.dim() == 2 and topk_idx.dim() == 2 and topk_idx.shape[0] == x.shape[0],
         f"x must be [T, H] and topk_idx [T, K] with the same T, got {tuple(x.shape)} and {tuple(topk_idx.shape)}")
    fail(probs.shape == topk_idx.shape, f"probs must have topk_idx's shape {tuple(topk_idx.shape)}, got "
         f"{tuple(probs.shape)}")

    def dispatch(start: int, end: int):
        return autograd.dispatch(buffer, x[start:end], topk_idx[start:end], probs[start:end], num_experts=num_experts,
                                 permute=True, expert_alignment=expert_alignment, **options)

    def note(point: str, c: int) -> None:
        if mark is not None:
            mark(point, c)

    def experts_and_combine(out, c: int) -> torch.Tensor:
        if on_dispatch is not None:
            on_dispatch(c, out)
        tpe = out.tokens_per_expert
        if num_worst_tokens:  # the GEMMs stop at the real segments; the pad tail has zero probs
            tpe = worst_case_segments(out.x, out.row_expert, tpe, expert_alignment)
        layout = GroupedLayout.of(out.x, tpe)
        y = expert_mlp(out.x, out.topk_weights, w1, w2, layout, activation, glu, backend)
        note("computed", c)
        y = autograd.combine(buffer, y, out.handle).x
        note("combined", c)
        return y

    bounds = chunk_bounds(x.shape[0], chunks)
    ahead = dispatch(*bounds[0])
    note("dispatched", 0)
    results = []
    for c in range(chunks):
        current = ahead
        # the next chunk's dispatch is issued before this chunk's GEMMs: it runs under them
        if c + 1 < chunks:
            ahead = dispatch(*bounds[c + 1])
            note("dispatched", c + 1)
        results.append(experts_and_combine(current, c))
    return torch.cat(results) if chunks > 1 else results[0]
