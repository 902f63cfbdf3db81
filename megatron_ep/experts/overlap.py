"""Routed experts with their communication under the expert GEMMs: the tokens cut into chunks,
each chunk its own dispatch, expert MLP and combine (megatron_ep/tools/model/overlap.py, mechanism
"chunks": every chunk pays a call's fixed cost, in exchange for no kernel change).

Every call is asynchronous (``async_op=True``): the communication runs on the buffer's stream and
the caller's stream waits only for the call whose rows it is about to use. The host issues, per
chunk c, the next chunk's dispatch, then chunk c's GEMMs, then chunk c's combine::

    D0 | D1 G0 C0 | D2 G1 C1 | ... | G(n-1) C(n-1)

(D: dispatch, G: expert MLP, C: combine). Each call's communication waits for what the caller's
stream issued before it (its outputs are allocated there, so a block freed by earlier work is not
written under it): D(c + 1) waits for G(c - 1), C(c) for G(c). So on the communication stream
C(c - 1) and D(c + 1) run under G(c), and G(c) waits only for D(c).

The chunks' GEMMs leave ``comm_sms`` SMs free (``backends.sms_left_free``): a persistent GEMM
kernel sizes its grid to the SMs it may take and holds them until it ends, so without the
carveout a transfer issued beside it waits for SMs instead of running under it. The buffer's
stream has a high priority for the same reason (megatron_ep/backends/cuda/runtime.py, COMM_STREAM_PRIORITY).

Backward is one autograd node for the whole layer (``_ChunkedExperts``) that runs the same
schedule on the gradients: the backward of a combine (a cached dispatch of the output gradient),
the chunk's MLP backward (data and weight gradients, from the graph its forward kept), the
backward of a dispatch (a combine of the rows' and probs' gradients). Autograd would otherwise
run the chunks' nodes one at a time, each transfer followed by a wait for it. A cached dispatch
and a combine need no host sync, so the backward pipelines fully. That backward is not itself
differentiable: under ``create_graph=True`` its gradients come out through a node that raises,
tied to the layer's inputs and the output gradient, so a second derivative through the layer
raises naming it, taken by ``.backward()`` or by ``torch.autograd.grad(..., inputs)`` alike.

Without ``num_worst_tokens`` each dispatch tells the host its row counts (a host sync at its
notify): the host issues G(c) only once D(c + 1)'s counts are in, which come after C(c - 1), so
the forward overlaps only the dispatches' transfers. With ``num_worst_tokens`` every chunk is
worst-case sized (that many rows per rank, pad rows after the real ones, rows past it dropped
and counted in each chunk's ``num_dropped``): no host sync at all, which a CUDA graph needs.

Every rank must pass the same ``chunks``: each chunk is one collective call, and every rank
issues them in the order above. A rank with fewer tokens (or none) makes the same calls with
smaller (or empty) chunks.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from ..core.autograd import refuse_second_derivative
from ..core.checks import WEIGHT_DTYPES, check_int, fail
from ..core.permute import worst_case_segments
from ..core.types import EventOverlap
from .backends import sms_left_free
from .layout import GroupedLayout
from .mlp import expert_mlp


# The most chunks a layer may take. Each chunk pays a dispatch's and a combine's fixed price (the
# calls' launches and their handshakes with every peer, also for an empty chunk), while what the
# chunks hide is at most the layer's communication: past a handful of chunks the fixed prices grow
# faster than the hidden time shrinks (megatron_ep.tools.model.overlap searches 1..16 pieces for the
# same reason), so a larger count only costs.
MAX_CHUNKS = 16


def chunk_bounds(num_tokens: int, chunks: int) -> List[tuple]:
    """[start, end) of each chunk: ``chunks`` contiguous pieces, sizes differing by at most one."""
    base, extra = divmod(num_tokens, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def schedule(chunks: int) -> List[tuple]:
    """The host's issue order as (op, chunk) pairs, op in "dispatch", "compute", "combine": the
    one order every rank follows (the calls are collective) and the forward and backward share."""
    order = [("dispatch", 0)]
    for c in range(chunks):
        if c + 1 < chunks:
            order.append(("dispatch", c + 1))
        order += [("compute", c), ("combine", c)]
    return order


def _wait(event: Optional[EventOverlap]) -> None:
    if event is not None:
        event.current_stream_wait()


@dataclass
class _Plan:
    """What every chunk of one call shares."""

    buffer: object
    topk_idx: torch.Tensor
    bounds: List[tuple]
    num_experts: int
    alignment: int
    activation: Callable
    glu: bool
    backend: Optional[str]
    num_worst_tokens: Optional[int]
    mark: Optional[Callable[[str, int], None]]
    on_dispatch: Optional[Callable[[int, object], None]]
    comm_sms: int  # SMs the GEMMs leave to the communication kernels running beside them

    def note(self, point: str, c: int) -> None:
        if self.mark is not None:
            self.mark(point, c)


class _Chunk:
    """One chunk's state between its calls: the dispatch's handle, its rows and, when gradients
    are wanted, the graph of its expert MLP (on detached leaves, so backward runs it alone)."""

    def __init__(self):
        self.handle = None
        self.out = None  # the DispatchOutput until the GEMMs read it
        self.leaves: List[Optional[torch.Tensor]] = []  # rows, row probs (graph leaves)
        self.y_rows: Optional[torch.Tensor] = None
        self.result = None  # the combine's output


def _forward(plan: _Plan, x, probs, w1, w2, graph: bool) -> tuple:
    """The chunked layer's forward over `schedule`; returns (y, chunks). With `graph`, each
    chunk's MLP is recorded for `_backward` on its own leaves (rows, row probs) and w1, w2."""
    chunks = [_Chunk() for _ in plan.bounds]
    options = {"num_worst_tokens": plan.num_worst_tokens} if plan.num_worst_tokens else {}
    for op, c in schedule(len(chunks)):
        ch, (start, end) = chunks[c], plan.bounds[c]
        if op == "dispatch":
            ch.out = plan.buffer.dispatch(x[start:end], plan.topk_idx[start:end], probs[start:end],
                                          num_experts=plan.num_experts, permute=True,
                                          expert_alignment=plan.alignment, async_op=True, **options)
            ch.handle = ch.out.handle
            plan.note("dispatched", c)
        elif op == "compute":
            out, ch.out = ch.out, None
            _wait(out.event)  # first: on_dispatch may read the outputs on this stream (drop counts)
            if plan.on_dispatch is not None:
                plan.on_dispatch(c, out)
            plan.note("started", c)
            tpe = out.tokens_per_expert
            if plan.num_worst_tokens:  # the GEMMs stop at the real segments; the pad tail has zero probs
                tpe = worst_case_segments(out.x, out.row_expert, tpe, plan.alignment)
            layout = GroupedLayout.of(out.x, tpe)
            rows, row_probs = out.x, out.topk_weights
            if graph:
                rows, row_probs = rows.detach().requires_grad_(), row_probs.detach().requires_grad_()
                ch.leaves = [rows, row_probs]
            with torch.enable_grad() if graph else nullcontext(), sms_left_free(plan.comm_sms):
                ch.y_rows = expert_mlp(rows, row_probs, w1, w2, layout, plan.activation, plan.glu, plan.backend)
            plan.note("computed", c)
        else:
            ch.result = plan.buffer.combine(ch.y_rows.detach(), ch.handle, async_op=True)
            plan.note("combined", c)
    for ch in chunks:
        _wait(ch.result.event)
    y = torch.cat([ch.result.x for ch in chunks]) if len(chunks) > 1 else chunks[0].result.x
    for ch in chunks:  # the combines' inputs stayed referenced until their transfers were waited for
        ch.result = None
        if not graph:
            ch.y_rows = None
    return y, chunks


def _backward(plan: _Plan, chunks: List[_Chunk], grad_y: torch.Tensor, weights: List[torch.Tensor],
              want: tuple) -> tuple:
    """Gradients of (x, probs, *weights) over the same schedule as the forward: per chunk a
    cached dispatch of grad_y, the chunk's MLP backward, a combine of the rows' gradients (their
    probs' gradients ride along as the combine's weights)."""
    want_x, want_probs, want_w = want
    grad_w: List[Optional[torch.Tensor]] = [None] * len(weights)
    for op, c in schedule(len(chunks)):
        ch, (start, end) = chunks[c], plan.bounds[c]
        if op == "dispatch":
            ch.out = plan.buffer.dispatch(grad_y[start:end], handle=ch.handle, async_op=True)
        elif op == "compute":
            out, ch.out = ch.out, None
            _wait(out.event)
            rows, row_probs = ch.leaves
            grads = [None, None] + [None] * len(weights)
            inputs = [t for t, w in zip([rows, row_probs, *weights], [True, True, *want_w]) if w]
            if ch.y_rows.requires_grad and inputs:  # (an empty chunk's MLP may not touch its weights)
                with sms_left_free(plan.comm_sms):
                    got = iter(torch.autograd.grad(ch.y_rows, inputs, out.x, allow_unused=True))
                grads = [next(got) if w else None for w in [True, True, *want_w]]
            ch.y_rows = ch.leaves = None
            for i, g in enumerate(grads[2:]):
                if g is not None:
                    grad_w[i] = g if grad_w[i] is None else grad_w[i] + g
            g_rows = grads[0] if grads[0] is not None else torch.zeros_like(rows)
            g_probs = grads[1] if grads[1] is not None else torch.zeros_like(row_probs)
            ch.out = (g_rows.contiguous(), g_probs.contiguous())  # referenced until waited for; probs' dtype kept
        else:
            g_rows, g_probs = ch.out
            ch.result = plan.buffer.combine(g_rows, ch.handle, weights=g_probs if want_probs else None,
                                            async_op=True)
    for ch in chunks:
        _wait(ch.result.event)
    grad_x = torch.cat([ch.result.x for ch in chunks]) if want_x else None
    grad_probs = torch.cat([ch.result.weights for ch in chunks]) if want_probs else None
    return grad_x, grad_probs, grad_w


class _ChunkedExperts(torch.autograd.Function):
    """The whole chunked layer as one node, so its backward keeps the pipeline (see the module)."""

    @staticmethod
    def forward(ctx, plan: _Plan, x, probs, w1, w2):
        w = [w1.detach().requires_grad_(w1.requires_grad), w2.detach().requires_grad_(w2.requires_grad)]
        y, chunks = _forward(plan, x, probs, w[0], w[1], graph=True)
        ctx.plan, ctx.chunks, ctx.weights = plan, chunks, w
        ctx.probs_dtype = probs.dtype
        # An empty second output, saved: unpacked in backward it has this node as its grad_fn,
        # so it leads to every input that requires grad, and holds no memory (see backward).
        anchor = x.new_empty(0)
        ctx.save_for_backward(anchor)
        return y, anchor

    @staticmethod
    def backward(ctx, grad_y, _):
        fail(ctx.chunks is not None, "chunked_expert_mlp: this layer's backward already ran; a second backward "
             "through it (retain_graph=True) is not supported: its chunks' graphs are freed as the first one "
             "pipelines them. Run the layer's forward again", RuntimeError)
        _, want_x, want_probs, want_w1, want_w2 = ctx.needs_input_grad
        grad_x, grad_probs, (g1, g2) = _backward(ctx.plan, ctx.chunks, grad_y.contiguous(), ctx.weights,
                                                 (want_x, want_probs, (want_w1, want_w2)))
        ctx.chunks = ctx.weights = None  # one backward: the chunks' graphs are spent
        if grad_probs is not None:
            grad_probs = grad_probs.to(ctx.probs_dtype)
        grads = (grad_x, grad_probs, g1, g2)
        if torch.is_grad_enabled():  # create_graph=True: no second derivative may come out silently wrong
            # The refusing node must lie on every path from these gradients to what they depend
            # on: the layer's inputs (through the saved anchor, whose grad_fn is this node) and
            # whatever grad_y depends on. autograd.grad(..., inputs) visits only such paths.
            (anchor,) = ctx.saved_tensors
            grads = refuse_second_derivative("chunked_expert_mlp", grads, (anchor, grad_y))
        return (None,) + grads


def chunked_expert_mlp(buffer, x: torch.Tensor, topk_idx: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor,
                       w2: torch.Tensor, num_experts: int, chunks: int = 4, expert_alignment: int = 1,
                       activation: Callable = F.gelu, glu: bool = False, backend: Optional[str] = None,
                       num_worst_tokens: Optional[int] = None,
                       mark: Optional[Callable[[str, int], None]] = None,
                       on_dispatch: Optional[Callable[[int, object], None]] = None,
                       comm_sms: Optional[int] = None) -> torch.Tensor:
    """MoE experts over ``chunks`` pipelined dispatch / expert MLP / combine rounds.

    x [T, H], topk_idx [T, K] (int64, -1 = unused slot), probs [T, K] (the routing weights,
    applied inside the experts as Megatron does), w1 [L, F or 2F, H], w2 [L, H, F] for this rank's
    L local experts -> [T, H]: the same as one round (``chunks=1``) up to the order of
    floating-point sums in the GEMMs. Differentiable in x, probs, w1 and w2.

    ``mark(point, chunk)``, when given, is called on the host right after each chunk's
    ``"dispatched"`` (its dispatch issued), ``"started"`` (the caller's stream made to wait for
    its rows: what the stream runs next is its GEMMs), ``"computed"`` (its expert MLP issued) and
    ``"combined"`` (its combine issued), in the order of ``schedule(chunks)``: a timeline hook,
    e.g. recording a CUDA event on the current stream (scripts/bench overlap does).
    ``on_dispatch(chunk, out)`` sees each chunk's DispatchOutput once the caller's stream waits for
    it, before its GEMMs: work it queues on the current stream reads the finished outputs (e.g. to
    count ``out.num_dropped`` of a worst-case sized one).

    ``comm_sms``: SMs the chunks' GEMMs (forward and backward) leave free for the communication
    kernels that run beside them (``experts.backends.sms_left_free``); default: the buffer's
    ``num_sms`` with more than one chunk, 0 with one chunk or a buffer without SMs (torch).
    """
    check_int("chunks", chunks, 1, MAX_CHUNKS)
    if comm_sms is None:
        comm_sms = (getattr(buffer, "num_sms", None) or 0) if chunks > 1 else 0
    check_int("comm_sms", comm_sms, 0)
    if num_worst_tokens is not None:
        check_int("num_worst_tokens", num_worst_tokens, 1)
    fail(x.dim() == 2 and topk_idx.dim() == 2 and topk_idx.shape[0] == x.shape[0],
         f"x must be [T, H] and topk_idx [T, K] with the same T, got {tuple(x.shape)} and {tuple(topk_idx.shape)}")
    fail(probs.shape == topk_idx.shape, f"probs must have topk_idx's shape {tuple(topk_idx.shape)}, got "
         f"{tuple(probs.shape)}")
    fail(probs.is_floating_point(), f"probs must be a floating-point tensor, got {probs.dtype}", TypeError)
    fail(probs.device == x.device and topk_idx.device == x.device, f"x, topk_idx and probs must be on one device, got "
         f"{x.device}, {topk_idx.device} and {probs.device}")
    if probs.dtype not in WEIGHT_DTYPES:  # bf16 / fp16 router probs travel as fp32; their gradient comes back cast
        probs = probs.float()
    plan = _Plan(buffer, topk_idx, chunk_bounds(x.shape[0], chunks), num_experts, expert_alignment, activation, glu,
                 backend, num_worst_tokens, mark, on_dispatch, comm_sms)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, probs, w1, w2)):
        return _ChunkedExperts.apply(plan, x, probs, w1, w2)[0]
    return _forward(plan, x, probs, w1, w2, graph=False)[0]
