"""`Buffer`: the one entry point of the API. It checks every argument, builds the call's signature
(megatron_ep/core/protocol.py), then hands the call to a backend -- the `torch` reference or the
`cuda` kernels -- that implements exactly the same contract and the same backend protocol:

    call(call) -> context manager   entry check; publishes a failure on this rank to its peers
    reserve(need)                   collective sizing ahead of sync-free calls
    layout / dispatch / combine         (dispatch and combine take a checked request: requests.py)
    low_latency_dispatch / low_latency_combine
    dispatch_input / combine_input  zero-copy inputs (plain tensors where there is no region)
    synchronize / destroy / describe / num_sms

so `Buffer` never branches on a backend's name.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from . import checks
from . import logfmt
from . import protocol
from .errors import BufferBusyError, CallMismatchError
from .replay import low_latency_combine_shape
from ..backends.torch import TorchBackend
from .requests import CombineRequest, DispatchRequest
from .types import (
    Activation,
    CombineOutput,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    EventOverlap,
    LowLatencyDispatchOutput,
    LowLatencyHandle,
)

BACKENDS = ("torch", "cuda", "auto")
_BUFFER_FIELD = protocol.FIELD["buffer"]
log = logging.getLogger("megatron_ep")
_ids = iter(range(1, 1 << 62))
_ordinals: dict = {}  # ranks of a group -> Buffers this process created on it so far


def _next_ordinal(group) -> int:
    """The Buffer's number among the Buffers created on the same ranks, in creation order: equal
    on every rank when every rank creates its Buffers in the same order (as collective set-up
    does), so calls on different Buffers are told apart (the signature's `buffer` field)."""
    key = tuple(dist.get_process_group_ranks(group)) if group is not dist.group.WORLD else "world"
    _ordinals[key] = _ordinals.get(key, 0) + 1
    return _ordinals[key]


def cuda_backend_available() -> bool:
    """True when the extension is built, importable, and a Hopper (or newer) GPU is visible."""
    if not torch.cuda.is_available():
        return False
    from ..backends.cuda import extension as _ext

    return _ext.available() and torch.cuda.get_device_capability()[0] >= 9


def _why_not_cuda() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from ..backends.cuda import extension as _ext

    if not _ext.available():
        return f"the extension is not usable ({_ext.import_error()})"
    return f"the GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}, the kernels need sm_90"


def _tensors(a) -> tuple:
    return tuple(a) if isinstance(a, (tuple, list)) else (a,)


def _needs_refusal(*inputs) -> bool:
    """A call outside autograd whose inputs require grad, with grad mode on: its outputs would
    carry none of it (the cheap test every call makes; the refusal itself is rare)."""
    if not torch.is_grad_enabled():
        return False
    for a in inputs:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif a is not None and any(t is not None and t.requires_grad for t in a):  # an FP8 pair
            return True
    return False


def _refusing(op: str, outputs, inputs):
    """`outputs` (tensors, FP8 tuples or None) tied to the graph of `inputs` through a node whose
    backward raises: a Buffer call is not differentiable, so a gradient through its outputs would
    silently leave out its part (the call under an autograd function's backward with
    create_graph=True, e.g. Megatron's fused_a2a on megatron_ep.deep_ep, or called directly)."""
    from .autograd import refuse_gradient

    message = (f"Buffer.{op} is not differentiable (its outputs carry no gradient to its inputs), so a "
               f"derivative through it would leave its part out: use megatron_ep.dispatch / megatron_ep.combine, "
               f"which are differentiable to any order, or call it under torch.no_grad()")
    anchors = [t for a in inputs if a is not None for t in _tensors(a)]
    out = []
    for o in outputs:
        if o is None:
            out.append(None)
        else:
            guarded = refuse_gradient(message, _tensors(o), anchors)
            out.append(guarded if isinstance(o, tuple) else guarded[0])
    return out


def _weights_code(w: Optional[torch.Tensor]) -> int:
    """Signature field "weights": their dtype (it sets the bytes on the wire), 0 without."""
    return protocol.dtype_code(w.dtype) if w is not None else 0


class Buffer:
    """Expert-parallel dispatch/combine over `group`.

    Args:
        group: the EP process group (None: the default group). gloo and NCCL both work for
            the torch backend; the cuda backend uses the group only for control (IPC handles,
            sizing agreement).
        backend: "torch", "cuda", or "auto" (cuda when the extension is built and a Hopper GPU
            is visible, else torch; the choice is in `repr(buf)` and logged once).
        max_tokens_per_rank: largest T any call may pass (enforced on every backend; with the
            cuda backend it also sizes the region up front).
        hidden, num_experts, max_topk, dtype_bytes, combine_bytes, combine_rows, pool_bytes,
            max_alignment: cuda sizing hints. Without them the region is sized by the first
            dispatch (agreed over the group) and grows collectively when a synchronous dispatch
            needs more; sync-free calls (num_worst_tokens, CUDA graphs) must fit what exists.
        num_sms: SMs per rank for the normal paths' cuda kernels (None: an analytic default;
            bounded by what the ranks sharing a GPU can keep resident). The low-latency kernels
            take every SM those ranks leave this rank, whatever num_sms says (as DeepEP's).
        check_inputs: also check expert-id ranges and duplicates in a new routing, before any row
            moves. The cuda intranode path checks a dispatch's ids in its notify kernel, which the
            host waits for anyway (no extra sync); elsewhere -- the torch backend, the internode
            path, a worst-case sized dispatch, get_dispatch_layout, low_latency_dispatch -- it
            costs one device->host sync, as does a low-latency combine's comparison of a routing
            tensor other than its dispatch's. "no_sync": only the checks that add no sync (the
            intranode notify's; the torch backend's, whose dispatch syncs anyway), as DeepEP's
            callers expect of their calls (megatron_ep.deep_ep uses it). Skipped under CUDA graph
            capture. Unchecked ids outside [0, num_experts) are unused slots on both backends.
        timeout_s (cuda): how long a kernel waits for a peer before it reports (MEGATRON_EP_TIMEOUT_S).
        low_latency (cuda): dict(num_experts=, max_tokens=, hidden=, topk=, fp8_only=) sizes the
            low-latency buffer now (collectively) instead of at its first call; rank_mask=True
            (every rank alike) turns on the rank mask (low_latency_mask and the methods after
            it), mask_timeout_s= how long its waits last before they mask a peer.
        ranks_per_node: ranks per NVLink domain (None: the ranks sharing a host). A group of
            several nodes runs the cuda backend's two-level path (RDMA to the same-index rank
            of each node, then NVLink inside it); a smaller value makes virtual nodes. The torch
            backend checks it and has no hierarchy (one all-to-all over the whole group).
        nvshmem_heap_bytes (cuda): the NVSHMEM symmetric heap this process starts with, at least,
            when one of this Buffer's calls starts NVSHMEM: room for every NVSHMEM buffer the
            process will hold (a group of several nodes that also makes low-latency calls holds
            two). Without it the first NVSHMEM buffer sizes the heap (twice its need); the heap
            cannot grow once started, and a later buffer that does not fit raises naming it.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, backend: str = "auto", *,
                 max_tokens_per_rank: Optional[int] = None, hidden: Optional[int] = None,
                 num_experts: Optional[int] = None, max_topk: Optional[int] = None,
                 num_sms: Optional[int] = None, check_inputs: Union[bool, str] = True, ranks_per_node: Optional[int] = None,
                 **backend_options):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if group is None:
            checks.fail(dist.is_initialized(), "Buffer needs an initialized torch.distributed process group (or pass group=)", RuntimeError)
            group = dist.group.WORLD
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if max_tokens_per_rank is not None:
            checks.check_int("max_tokens_per_rank", max_tokens_per_rank, 0)
        self.max_tokens_per_rank = max_tokens_per_rank
        self._ids_level = checks.check_inputs_level(check_inputs)
        self._ll_shapes: set = set()  # low-latency dispatch shapes whose sizes were checked
        # (shape, device, options) of the last get_dispatch_layout whose checks passed, or None
        self._layout_shape: Optional[tuple] = None
        self.check_inputs = check_inputs
        if ranks_per_node is not None:
            if not (isinstance(ranks_per_node, int) and 1 <= ranks_per_node <= self.num_ranks
                    and self.num_ranks % ranks_per_node == 0):
                raise ValueError(f"ranks_per_node={ranks_per_node!r} must divide the group's {self.num_ranks} ranks")
        self.id = next(_ids)
        self._seq = 0
        # one call at a time per process: (thread name, op) of the call in progress
        self._busy_lock = threading.Lock()
        self._busy: Optional[tuple] = None
        self._entered = 0  # calls entered (_call, refuse): layer_call tells whether one began
        self._destroyed = False
        requested = backend
        if backend == "auto":
            backend = "cuda" if cuda_backend_available() else "torch"
        self.backend = backend
        if backend == "torch":
            if backend_options:
                raise TypeError(f"unknown Buffer options for the torch backend: {sorted(backend_options)}")
            self._impl = TorchBackend(group, self.num_ranks, self.rank)
        else:
            from ..backends.cuda.backend import CudaBackend

            self._impl = CudaBackend(group, self.rank, self.num_ranks, max_tokens_per_rank=max_tokens_per_rank,
                                     hidden=hidden, num_experts=num_experts, max_topk=max_topk, num_sms=num_sms,
                                     ranks_per_node=ranks_per_node, **backend_options)
        self.ordinal = _next_ordinal(group)  # once the Buffer exists (a failed creation takes no number)
        if self.rank == 0:
            why = f" ({_why_not_cuda()})" if requested == "auto" and backend == "torch" else ""
            log.info("megatron_ep.Buffer: %d ranks, backend=%s%s: %s", self.num_ranks, backend, why, self._impl.describe())

    # ----------------------------------------------------------------------------- lifetime
    def destroy(self) -> None:
        """Release communication memory now (collective for the cuda backend). Tensors that
        point into it (pooled outputs, zero-copy views) keep their part alive until they die.
        A later call on this Buffer raises, and tells its peers (they raise PeerFailedError)."""
        impl = getattr(self, "_impl", None)
        if impl is not None and not self._destroyed:
            with self._exclusive("destroy"):
                self._destroyed = True
                impl.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def _backend(self):
        checks.fail(not self._destroyed, "this Buffer was destroyed", RuntimeError)
        return self._impl

    def _acquire(self, op: str) -> None:
        """The host side of one call, alone: a second thread's call meanwhile raises
        BufferBusyError at once, before it sends anything, naming both callers."""
        if not self._busy_lock.acquire(blocking=False):
            ident, busy_op = self._busy or (None, "a call")
            thread = next((t.name for t in threading.enumerate() if t.ident == ident), "another thread")
            raise BufferBusyError(
                f"{op} from thread {threading.current_thread().name!r} on Buffer #{self.ordinal} (rank "
                f"{self.rank}/{self.num_ranks}, backend {self.backend}) while thread {thread!r} is inside its "
                f"{busy_op}: one rank's calls on a Buffer are one sequence, matched call by call with its peers'; "
                f"issue them from one thread at a time (this call was not made; the other goes on)")
        # (the thread's id: its name is looked up only when another thread needs it)
        self._busy = (threading.get_ident(), op)

    def _release(self) -> None:
        self._busy = None
        self._busy_lock.release()

    @contextmanager
    def _exclusive(self, op: str):
        self._acquire(op)
        try:
            yield
        finally:
            self._release()

    def _next_call(self, op: str, sig: Optional[list] = None) -> protocol.Call:
        self._seq += 1
        self._entered += 1
        call = protocol.Call(protocol.OP[op], self._seq, sig)
        call.sig[_BUFFER_FIELD] = self.ordinal
        return call

    def _call(self, op: str, sig: Optional[list] = None) -> "_CallScope":
        """One collective call: a sequence number, a signature (filled by the caller, or a replayed
        call's), and the backend's entry check and failure publication around the whole host side
        -- also for a destroyed Buffer, whose call raises inside it, so the peers learn of it
        instead of waiting (protocol.guarded's sequence, with the call's exclusivity: _CallScope)."""
        return _CallScope(self, op, sig)

    def _replayed(self, op: str, replay, *args):
        """A call whose arguments match `replay` (megatron_ep/core/replay.py): the call's numbers and
        scope as every call's, its signature the replayed call's, then the backend's call without
        the checks that shape passed, `replay.run(call, *args)`."""
        with _CallScope(self, op, replay.sig) as call:
            return replay.run(call, *args)

    def refuse(self, op: str, exc: BaseException) -> None:
        """Fail this rank's call `op` (a key of protocol.OP) with `exc` where its peers wait for it:
        for a layer above Buffer (megatron_ep.deep_ep) whose own check fails before it reaches
        Buffer's call. The failure is published at the call's first exchange, as a failure inside
        one of Buffer's calls is (the peers raise PeerFailedError with its message instead of
        waiting), then `exc` is raised here. It counts as a call on every rank, as theirs does."""
        if op not in protocol.OP:
            raise ValueError(f"op must be one of {sorted(protocol.OP)}, got {op!r}")
        with self._exclusive(op), protocol.guarded(self._impl, self._next_call(op)):
            raise exc

    def layer_call(self, op: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """fn(*args, **kwargs): the body of a layer's collective method whose first collective is
        one of Buffer's calls (`op`). A failure in it before that call began (the layer's own
        checks) is published as refuse() publishes it, so the peers waiting in that call raise
        PeerFailedError instead of waiting for this rank; once one of Buffer's calls began, it
        published its own outcome and nothing more is owed. (A function, not a context manager:
        it wraps every call of megatron_ep.deep_ep, where a context costs host time per call.)"""
        entered = self._entered
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if self._entered == entered:
                self.refuse(op, exc)
            raise

    # ------------------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, *,
                            check_values: bool = True, counts_dtype: torch.dtype = torch.int64) -> DispatchLayout:
        """Local routing summary (no communication). check_values=False leaves the ids' values
        (range, repeats) to the dispatch that follows with the same ids, which checks them
        (check_inputs): here the check costs a host sync; ids outside [0, num_experts) unchecked
        count as unused slots. counts_dtype: torch.int64 or torch.int32 (DeepEP's) for the two
        count tensors."""
        memo = self._layout_shape
        if memo is not None and type(topk_idx) is torch.Tensor and (check_values is False or check_values is True) \
                and type(num_experts) is int and memo[0] == topk_idx.shape and memo[1] == topk_idx.device \
                and memo[2] == (num_experts, check_values, counts_dtype) and topk_idx.dtype == torch.int64 \
                and topk_idx.is_contiguous() and not self._destroyed:
            # the shape and options of the last layout, whose checks passed (no value check then)
            return self._impl.layout(topk_idx, num_experts, counts_dtype)
        checks.check_num_experts(num_experts, self.num_ranks)
        checks.fail(isinstance(topk_idx, torch.Tensor), "topk_idx must be a tensor", TypeError)
        checks.check_topk_idx(topk_idx, topk_idx.shape[0] if topk_idx.dim() else -1, topk_idx.device)
        checks.check_token_limit(topk_idx.shape[0], self.max_tokens_per_rank)
        checks.check_bool("check_values", check_values)
        if counts_dtype not in (torch.int64, torch.int32):
            raise TypeError(f"counts_dtype must be torch.int64 or torch.int32, got {counts_dtype}")
        if self._ids_level == checks.IDS_CHECKED and check_values:
            checks.check_topk_values(topk_idx, num_experts)
            self._layout_shape = None  # (each such layout checks its values: a host sync)
        else:
            self._layout_shape = (topk_idx.shape, topk_idx.device, (num_experts, check_values, counts_dtype))
        return self._backend().layout(topk_idx, num_experts, counts_dtype)

    # ---------------------------------------------------------------------------- dispatch
    def dispatch(self, x: Activation, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 permute: Optional[bool] = None, expert_alignment: Optional[int] = None,
                 handle: Optional[DispatchHandle] = None, *, host_counts: bool = False,
                 num_worst_tokens: int = 0, async_op: bool = False,
                 previous_event: Optional[EventOverlap] = None, on_overflow: str = "drop",
                 rank_counts: bool = False, source_index: bool = False) -> DispatchOutput:
        """Send each token to the ranks owning its experts (docs/design.md §2).

        permute=False (default): rank-major rows; permute=True: expert-major rows, each
        expert's segment padded to `expert_alignment` (1..1024, default 1). With `handle`, the
        routing of an earlier dispatch is reused (cached dispatch): topk_idx must be None, and
        topk_weights, if given, are moved along that routing.
        num_worst_tokens > 0: outputs have exactly that many rows and no host sync happens
        (CUDA-graph capturable on the cuda backend): the valid rows, then padding. Rows whose
        position falls past it are not delivered: `out.num_dropped` (a device scalar) counts
        them on the receiving rank, tokens_per_expert covers only delivered rows, and combine
        skips them. R * T_max rank-major, or R * T_max * min(topk, local experts) + local
        experts * (alignment - 1) expert-major, never drops. on_overflow="raise" (rank-major)
        makes such rows a caller error instead: where the backend learns every rank's counts on
        the host before the rows move (the torch backend, at its count exchange), every rank
        raises WorstCaseOverflowError naming each rank that would receive more rows than its
        num_worst_tokens, and nothing moves. The cuda backend's worst-case sized dispatch keeps
        the counts on the GPU (that is what makes it sync-free), so there such rows are dropped
        and counted as with "drop".

        rank_counts=True (a new routing): the handle also keeps every rank's tokens per
        destination rank, [R, R] int32 on the device (`handle.rank_counts`), and its inclusive
        prefix over source ranks (`handle.rank_prefix`, DeepEP's rank_prefix_matrix), from the
        count exchange the call makes anyway; the cuda backend's internode path leaves both None
        and keeps their columns of this rank (`recv_rank_counts`, `recv_rank_prefix`).

        source_index=True (a new routing): the handle also keeps each rank-major row's source token,
        its index on its source rank (`handle.recv_src_token`, [rows] int32, -1 past the rows that
        arrived; expert-major also `handle.recv_slot_row`, [rows, K] int32, the output row of each
        slot or -1): what DeepEP V2's recv_src_metadata is made of. The torch backend keeps them
        always; the cuda kernels write them where asked (one int per row; on the internode path
        the intranode stage's, its forwarder's receive slots mapped back to the source's tokens).
        """
        if handle is not None and topk_idx is None and num_experts is None and permute is None \
                and expert_alignment is None and type(num_worst_tokens) is int and num_worst_tokens == 0 and on_overflow == "drop" and host_counts is False \
                and rank_counts is False and source_index is False and (async_op is False or async_op is True) \
                and (previous_event is None or type(previous_event) is EventOverlap):
            # a cached dispatch of the shape of the last one along this handle: its checks passed
            replay = getattr(handle, "dispatch_replay", None)
            if replay is not None and handle.buffer_id == self.id and not self._destroyed \
                    and replay.matches(x, topk_weights):
                return self._replayed("cached_dispatch", replay, handle, x, topk_weights, async_op, previous_event)
        elif handle is None and type(num_experts) is int and (permute is None or permute is True or permute is False) \
                and (expert_alignment is None or type(expert_alignment) is int) and type(num_worst_tokens) is int \
                and num_worst_tokens == 0 and (on_overflow == "drop" or on_overflow == "raise") and source_index is False \
                and (host_counts is False or host_counts is True) and (rank_counts is False or rank_counts is True) \
                and (async_op is False or async_op is True) \
                and (previous_event is None or type(previous_event) is EventOverlap):
            # a new routing of the shape and options of the last one: its checks passed
            replay = getattr(self._impl, "routing_replay", None)
            if replay is not None and not self._destroyed and replay.matches_routing(
                    x, topk_idx, topk_weights, (num_experts, bool(permute), 1 if expert_alignment is None else
                                                expert_alignment, host_counts, rank_counts, self._ids_level,
                                                on_overflow)):
                out = self._replayed("dispatch", replay, x, topk_idx, topk_weights, async_op, previous_event,
                                     host_counts)
                out.handle.buffer_id = self.id
                return out
        op = "dispatch" if handle is None else "cached_dispatch"
        with self._call(op) as call:
            impl = self._impl
            T, H, is_fp8 = checks.check_activation("x", x)
            device = checks.act_device(x)
            checks.check_token_limit(T, self.max_tokens_per_rank)
            # (each argument left at its default needs no check: a call's host time counts)
            if num_worst_tokens != 0 or type(num_worst_tokens) is not int:
                checks.check_int("num_worst_tokens", num_worst_tokens, 0, checks.MAX_ROWS)
            if on_overflow != "drop" and on_overflow != "raise":
                raise ValueError(f"on_overflow must be 'drop' or 'raise', got {on_overflow!r}")
            if permute is not None:
                checks.check_bool("permute", permute)
            if host_counts is not False or rank_counts is not False or async_op is not False or source_index is not False:
                checks.check_bool("host_counts", host_counts)
                checks.check_bool("rank_counts", rank_counts)
                checks.check_bool("async_op", async_op)
                checks.check_bool("source_index", source_index)
            if previous_event is not None:
                checks.check_event("previous_event", previous_event)
            if handle is not None:
                self._check_handle(handle, DispatchHandle)
                checks.fail(topk_idx is None, "cached dispatch (handle given) takes its routing from the handle: pass topk_idx=None")
                if T != handle.num_tokens:
                    raise ValueError(f"x has {T} tokens but the handle was built for {handle.num_tokens}")
                if num_experts not in (None, handle.num_experts):
                    raise ValueError(f"num_experts={num_experts} differs from the handle's {handle.num_experts}")
                if permute not in (None, handle.permute):
                    raise ValueError(f"permute={permute} differs from the handle's {handle.permute}")
                if expert_alignment not in (None, handle.expert_alignment):
                    raise ValueError(f"expert_alignment={expert_alignment} differs from the handle's {handle.expert_alignment}")
                if num_worst_tokens not in (0, handle.num_worst_tokens):
                    raise ValueError(f"num_worst_tokens={num_worst_tokens} differs from the handle's {handle.num_worst_tokens}")
                num_experts, permute, expert_alignment, K = handle.num_experts, handle.permute, handle.expert_alignment, handle.topk
                num_worst_tokens = handle.num_worst_tokens
            else:
                checks.fail(topk_idx is not None, "dispatch needs topk_idx (or a handle for a cached dispatch)", TypeError)
                checks.fail(num_experts is not None, "dispatch needs num_experts", TypeError)
                checks.check_num_experts(num_experts, self.num_ranks)
                permute = bool(permute)
                checks.fail(on_overflow == "drop" or not permute, "on_overflow='raise' is for rank-major dispatches "
                       "(permute=False): the counts exchanged before the rows move are per rank, not per expert")
                expert_alignment = 1 if expert_alignment is None else expert_alignment
                checks.check_alignment(expert_alignment)
                K = checks.check_topk_idx(topk_idx, T, device)
                # the ids' values (range, repeats) are checked by the backend, where it costs
                # least (DispatchRequest.check_ids)
            if topk_weights is not None:
                checks.check_topk_weights(topk_weights, T, K, device)
            data = x[0] if is_fp8 else x
            call.set_normal(handle.call_seq if handle is not None else 0, protocol.dtype_code(data.dtype), H,
                            H * data.element_size(), K, num_experts, permute, expert_alignment, num_worst_tokens > 0,
                            _weights_code(topk_weights))
            out = impl.dispatch(call, DispatchRequest(x, topk_idx, topk_weights, num_experts, permute, expert_alignment,
                                                      handle, host_counts, num_worst_tokens, async_op, previous_event,
                                                      on_overflow=on_overflow,
                                                      check_ids=self._ids_level if handle is None else checks.IDS_UNCHECKED,
                                                      rank_counts=rank_counts and handle is None,
                                                      source_index=source_index and handle is None))
        out.handle.buffer_id = self.id
        if _needs_refusal(x, topk_weights):  # each output on the graph of the input it moves
            (out.x,) = _refusing(op, [out.x], [x])
            (out.topk_weights,) = _refusing(op, [out.topk_weights], [topk_weights])
        return out

    # ----------------------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, weights: Optional[torch.Tensor] = None, *,
                async_op: bool = False, previous_event: Optional[EventOverlap] = None,
                bias=None, single_reduction: bool = False) -> CombineOutput:
        """y[t] = bias + sum of the rows that came from token t: one fp32 accumulator, x's dtype
        out, in a fixed order (docs/design.md, "Combine": ranks by their last top-k slot of t;
        expert-major, each rank's rows summed in slot order and rounded to x's dtype first).

        weights (rank-major [N, K], expert-major [M]) are scattered back to [T, K]. bias: None,
        a [T, H] tensor of x's dtype and device, or a tuple of two (added in fp32 first).
        single_reduction (expert-major handles; no effect on rank-major ones): no per-rank
        partial, every slot's row added to the token's sum in slot order, one rounding in all
        (DeepEP V2's allow_multiple_reduction=False: up to K rows per token cross the link
        instead of one per rank). Every rank passes the same value."""
        if bias is None and single_reduction is False and (async_op is False or async_op is True) \
                and (previous_event is None or type(previous_event) is EventOverlap):
            # a combine of the shape of the last one along this handle: its checks passed
            replay = getattr(handle, "combine_replay", None)
            if replay is not None and handle.buffer_id == self.id and not self._destroyed and replay.matches(x, weights):
                return self._replayed("combine", replay, handle, x, weights, async_op, previous_event)
        with self._call("combine") as call:
            self._check_handle(handle, DispatchHandle)
            checks.check_bool("async_op", async_op)
            checks.check_bool("single_reduction", single_reduction)
            checks.check_event("previous_event", previous_event)
            checks.check_activation("x", x)
            checks.fail(not checks.is_fp8_tuple(x), "combine takes bf16/fp32 rows, not FP8", TypeError)
            if x.shape[0] != handle.num_recv_rows:
                raise ValueError(f"x has {x.shape[0]} rows but the dispatch delivered {handle.num_recv_rows}")
            if weights is not None:
                checks.fail(isinstance(weights, torch.Tensor), "weights must be a tensor", TypeError)
                if weights.dtype not in checks.WEIGHT_DTYPES:
                    raise TypeError(f"weights must have dtype in {[str(d) for d in checks.WEIGHT_DTYPES]}, got {weights.dtype}")
                shape = (handle.num_recv_rows,) if handle.permute else (handle.num_recv_rows, handle.topk)
                if tuple(weights.shape) != shape:
                    raise ValueError(f"weights must have shape {shape}, got {tuple(weights.shape)}")
                checks.fail(weights.is_contiguous(), "weights must be contiguous")
                if weights.device != x.device:
                    raise ValueError(f"weights is on {weights.device} but x is on {x.device}")
            biases = checks.check_bias(bias, handle.num_tokens, x.shape[1], x.dtype, x.device) if bias is not None else checks.NO_BIAS
            call.set_normal(handle.call_seq, protocol.dtype_code(x.dtype), x.shape[1], x.shape[1] * x.element_size(),
                            handle.topk, handle.num_experts, handle.permute, handle.expert_alignment,
                            handle.num_worst_tokens > 0, _weights_code(weights))
            out = self._impl.combine(call, CombineRequest(x, handle, weights, async_op, previous_event, bias=biases,
                                                          single_reduction=single_reduction))
        if _needs_refusal(x, weights, biases):
            (out.x,) = _refusing("combine", [out.x], [x, *(b for b in biases if b is not None)])
            (out.weights,) = _refusing("combine", [out.weights], [weights])
        return out

    # ------------------------------------------------------------------------- low latency
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                             max_tokens_per_rank: int = 128, use_fp8: bool = True,
                             round_scale: bool = False, topk_weights: Optional[torch.Tensor] = None,
                             use_ue8m0: bool = False, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             **kwargs) -> LowLatencyDispatchOutput:
        """Every (token, expert) copy to its expert's fixed receive area (docs/design.md §2).

        `use_ue8m0` (with `use_fp8` and `round_scale`, hidden a multiple of 512, num_ranks *
        max_tokens_per_rank a multiple of 4): the scales come as int32 [L, R*T, H/512], each
        scale's exponent byte packed four to an int32 along hidden, stored column-major per
        expert, the layout DeepGEMM's FP8 GEMMs read (fp8.pack_ue8m0 owns the format).
        `cumulative_local_expert_recv_stats` ([L] int32) gets each local expert's received rows
        added; `dispatch_wait_recv_cost_stats` ([R] int64) the SM clock cycles the receive half
        waited for each source rank's rows (cuda backend; the torch backend has no such waits
        and leaves it as it is).

        `topk_weights` ([T, K], optional): the weights the combine will take. Given here, they
        travel with the copies, and a combine passed the same tensor (unchanged since) sends one
        row per token and rank (its copies' weighted sum, rounded to bf16) instead of one per
        copy (cuda backend; the reference backend ignores them here)."""
        recv_hook = kwargs.get("return_recv_hook", False) if kwargs else False
        if type(recv_hook) is bool and (not kwargs or len(kwargs) == 1 and "return_recv_hook" in kwargs) \
                and self._ids_level != checks.IDS_CHECKED and type(num_experts) is int and type(max_tokens_per_rank) is int \
                and type(use_fp8) is bool and type(round_scale) is bool and type(use_ue8m0) is bool:
            # a dispatch of the shape and options of the last one (its checks passed), into the same
            # statistics tensors: megatron_ep/core/replay.py
            replay = getattr(self._impl, "ll_dispatch_replay", None)
            if replay is not None and not self._destroyed and replay.held[0] is cumulative_local_expert_recv_stats \
                    and replay.held[1] is dispatch_wait_recv_cost_stats and replay.matches_routing(
                        x, topk_idx, topk_weights,
                        (num_experts, max_tokens_per_rank, use_fp8, round_scale, use_ue8m0, recv_hook)):
                with _CallScope(self, "low_latency_dispatch", replay.sig) as call:
                    out = replay.run(call, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                                     dispatch_wait_recv_cost_stats)
                handle = out.handle
                handle.buffer_id = self.id
                handle.topk_idx, handle.topk_idx_version = topk_idx, checks.tensor_version(topk_idx)  # combine checks it
                return out
        with self._call("low_latency_dispatch") as call:
            T, H, is_fp8 = checks.check_activation("x", x, allowed=(torch.bfloat16, torch.float32))
            checks.fail(not is_fp8, "low_latency_dispatch takes bf16/fp32 x and casts to FP8 itself (use_fp8=True)", TypeError)
            if type(use_fp8) is not bool or type(round_scale) is not bool or type(use_ue8m0) is not bool:
                checks.check_bool("use_fp8", use_fp8)
                checks.check_bool("round_scale", round_scale)
                checks.check_bool("use_ue8m0", use_ue8m0)
            # the sizes' checks, once per shape (a call's host time counts; the same shape passes again)
            shape = (num_experts, max_tokens_per_rank, H, use_fp8, x.dtype)
            if type(num_experts) is not int or type(max_tokens_per_rank) is not int or shape not in self._ll_shapes:
                checks.check_num_experts(num_experts, self.num_ranks)
                checks.check_low_latency_capacity(max_tokens_per_rank, num_experts, H, 1 if use_fp8 else x.element_size())
                if use_fp8 and H % checks.FP8_BLOCK != 0:
                    raise ValueError(f"x: hidden size {H} must be a multiple of {checks.FP8_BLOCK} for FP8")
                if len(self._ll_shapes) < 64:
                    self._ll_shapes.add(shape)
            checks.check_token_limit(T, max_tokens_per_rank)
            if use_ue8m0:
                checks.fail(use_fp8 and round_scale, "use_ue8m0 needs use_fp8=True and round_scale=True (power-of-two scales)")
                if H % (checks.FP8_BLOCK * 4) != 0:
                    raise ValueError(f"x: hidden size {H} must be a multiple of {checks.FP8_BLOCK * 4} for UE8M0 "
                                     f"scales (four per int32)")
                if self.num_ranks * max_tokens_per_rank % 4 != 0:
                    raise ValueError(f"use_ue8m0: num_ranks * max_tokens_per_rank = {self.num_ranks * max_tokens_per_rank} must be a "
                                     f"multiple of 4 (the column-major scales are TMA-aligned)")
            if cumulative_local_expert_recv_stats is not None:
                checks.check_stats("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                              num_experts // self.num_ranks, torch.int32, x.device, "local expert")
            if dispatch_wait_recv_cost_stats is not None:
                checks.check_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, self.num_ranks, torch.int64,
                              x.device, "rank")
            kwargs.update(use_ue8m0=use_ue8m0, recv_stats=cumulative_local_expert_recv_stats,
                          wait_stats=dispatch_wait_recv_cost_stats)
            K = checks.check_topk_idx(topk_idx, T, x.device)
            if self._ids_level == checks.IDS_CHECKED:  # (no kernel of this path reads ids for the host: a sync)
                checks.check_topk_values(topk_idx, num_experts)
            if topk_weights is not None:
                checks.check_topk_weights(topk_weights, T, K, x.device)
                kwargs["topk_weights"] = topk_weights
            wire = checks.FP8_DTYPE if use_fp8 else x.dtype
            call.set_low_latency(0, protocol.dtype_code(wire), H, H * wire.itemsize, K, num_experts, max_tokens_per_rank, 0)
            out = self._impl.low_latency_dispatch(call, x, topk_idx, num_experts, max_tokens_per_rank, use_fp8,
                                                  round_scale, **kwargs)
        out.handle.buffer_id = self.id
        out.handle.topk_idx, out.handle.topk_idx_version = topk_idx, checks.tensor_version(topk_idx)  # combine checks it
        if _needs_refusal(x):  # (topk_weights ride along for the combine: the rows do not depend on them)
            (out.x,) = _refusing("low_latency_dispatch", [out.x], [x])
        return out

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                            use_logfmt: bool = False, out: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        """y[t] = sum_k w[t, k] * x[e_k][row(t, e_k)] over valid slots (fp32 accumulation).
        `out` ([T, H], x's dtype and device, contiguous): written and returned instead of a new y.
        `combine_wait_recv_cost_stats` ([R] int64): the SM clock cycles the receive half waited
        for each rank's rows are added (cuda backend; the torch backend leaves it as it is).
        `use_logfmt` (bf16 x, every rank alike): the rows travel as LogFMT-10 where a 128-channel
        block allows, and the sum adds their decoded values (megatron_ep.core.logfmt says how close)."""
        recv_hook = kwargs.get("return_recv_hook", False) if kwargs else False
        if out is None and use_logfmt is False and type(recv_hook) is bool and type(handle) is LowLatencyHandle \
                and (not kwargs or len(kwargs) == 1 and "return_recv_hook" in kwargs):
            # a combine along a handle of the shape of the last one's, with arguments of the last
            # one's shapes, into the same statistics tensor: megatron_ep/core/replay.py
            replay = getattr(self._impl, "ll_combine_replay", None)
            if replay is not None and not self._destroyed and handle.buffer_id == self.id \
                    and replay.held[0] is combine_wait_recv_cost_stats and replay.matches_routing(
                        x, topk_idx, topk_weights, low_latency_combine_shape(handle, recv_hook)):
                with _CallScope(self, "low_latency_combine", replay.sig) as call:
                    if self._ids_level != checks.IDS_UNCHECKED:
                        checks.check_same_routing(topk_idx, handle.topk_idx, handle.topk_idx_version,
                                             may_sync=self._ids_level == checks.IDS_CHECKED)
                    call.set_routing(handle.call_seq)
                    return replay.run(call, x, topk_idx, topk_weights, handle, combine_wait_recv_cost_stats)
        with self._call("low_latency_combine") as call:
            self._check_handle(handle, LowLatencyHandle)
            checks.fail(isinstance(x, torch.Tensor), "x must be a tensor", TypeError)
            if x.dtype not in (torch.bfloat16, torch.float32):
                raise TypeError(f"x must be bf16 or fp32, got {x.dtype}")
            shape = (handle.num_local_experts, handle.num_ranks * handle.max_tokens_per_rank, handle.hidden)
            if tuple(x.shape) != shape:
                raise ValueError(f"x must have shape {shape}, got {tuple(x.shape)}")
            checks.fail(x.is_contiguous(), "x must be contiguous")
            K = checks.check_topk_idx(topk_idx, handle.num_tokens, x.device)
            if K != handle.topk:
                raise ValueError(f"topk_idx has K={K} but the dispatch used K={handle.topk}")
            if self._ids_level != checks.IDS_UNCHECKED:
                checks.check_same_routing(topk_idx, handle.topk_idx, handle.topk_idx_version,
                                     may_sync=self._ids_level == checks.IDS_CHECKED)
            checks.check_topk_weights(topk_weights, handle.num_tokens, K, x.device)
            checks.check_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, self.num_ranks, torch.int64,
                          x.device, "rank")
            if combine_wait_recv_cost_stats is not None:
                kwargs["wait_stats"] = combine_wait_recv_cost_stats
            if out is not None:
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"out must be a tensor, got {type(out).__name__}")
                want = (handle.num_tokens, handle.hidden)
                if tuple(out.shape) != want:
                    raise ValueError(f"out must have shape {want} (the dispatch's tokens x hidden), got "
                                     f"{tuple(out.shape)}")
                if out.dtype != x.dtype:
                    raise TypeError(f"out must have x's dtype {x.dtype}, got {out.dtype}")
                if out.device != x.device:
                    raise ValueError(f"out is on {out.device} but x is on {x.device}")
                checks.fail(out.is_contiguous(), "out must be contiguous")
                kwargs["out"] = out
            checks.check_bool("use_logfmt", use_logfmt)
            if use_logfmt:
                if x.dtype != torch.bfloat16:
                    raise TypeError(f"use_logfmt encodes bf16 expert outputs, got {x.dtype}")
                if handle.hidden % logfmt.BLOCK != 0:
                    raise ValueError(f"use_logfmt: hidden size {handle.hidden} must be a multiple of {logfmt.BLOCK}")
                kwargs["use_logfmt"] = True
            call.set_low_latency(handle.call_seq, protocol.dtype_code(x.dtype), handle.hidden, handle.hidden * x.element_size(), K,
                                 handle.num_experts, handle.max_tokens_per_rank, protocol.LL_COMBINE_LOGFMT if use_logfmt else 0)
            y = self._impl.low_latency_combine(call, x, topk_idx, topk_weights, handle, **kwargs)
        return _refusing("low_latency_combine", [y], [x, topk_weights])[0] if _needs_refusal(x, topk_weights) else y

    # ---------------------------------------------------------------------------- rank mask
    # Elastic EP on the low-latency path (DeepEP's shrink mode), cuda backend, a Buffer made with
    # low_latency=dict(..., rank_mask=True[, mask_timeout_s=]): a rank masked here is skipped by
    # this rank's low-latency kernels (its tokens count as 0, its experts' slots drop out of the
    # combine's sum), and a wait longer than mask_timeout_s masks the rank it waited for instead
    # of raising. docs/low-latency.md, "The rank mask".
    def _mask_path(self, what: str):
        impl = self._backend()
        path = impl.low_latency_path() if hasattr(impl, "low_latency_path") else None
        if not (path is not None and path.rank_mask):
            raise RuntimeError(f"{what} needs the cuda backend and a Buffer made with "
                               f"low_latency=dict(..., rank_mask=True)")
        return path

    def low_latency_mask(self, rank: int, masked: bool = True) -> None:
        """Mask (masked=False: unmask) `rank` for this rank's later low-latency calls (stream-ordered
        on the current stream; no communication: each rank keeps its own mask)."""
        with self._exclusive("low_latency_mask"):
            self._mask_path("low_latency_mask").set_mask(rank, masked)

    def low_latency_mask_status(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int32 [R] on this device, 1 where a rank is masked here (written on the current stream)."""
        with self._exclusive("low_latency_mask_status"):
            path = self._mask_path("low_latency_mask_status")
            if out is None:
                out = torch.empty(self.num_ranks, dtype=torch.int32, device=path.device)
            return path.mask_status(out)

    def low_latency_clear_mask(self) -> None:
        """Unmask every rank (here, on the current stream). A rank rejoins at the next barrier."""
        with self._exclusive("low_latency_clear_mask"):
            self._mask_path("low_latency_clear_mask").clear_mask()

    def low_latency_barrier(self) -> None:
        """Collective over the ranks not masked here, on the current stream: a GPU barrier (a rank
        that does not enter within mask_timeout_s is masked) that also restarts the low-latency
        buffer sets' bookkeeping, so ranks unmasked on every rank before it rejoin after it. No
        receive hook may be pending."""
        with self._exclusive("low_latency_barrier"):
            self._mask_path("low_latency_barrier").barrier()

    # --------------------------------------------------------------------- zero-copy inputs
    def get_dispatch_input(self, num_tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16,
                           device=None) -> torch.Tensor:
        """A [T, H] tensor to fill and pass to dispatch: with the cuda backend it lies in the
        communication region, so dispatch skips its staging copy. Valid until the next dispatch."""
        return self._backend().dispatch_input(num_tokens, hidden, dtype, device)

    def get_combine_input(self, num_rows: int, hidden: int, dtype: torch.dtype = torch.bfloat16,
                          device=None) -> torch.Tensor:
        """A [rows, H] tensor for the experts to write their output into before combine: with
        the cuda backend it lies in the communication region, so combine skips its staging copy
        and peers read it directly. Valid until the next combine."""
        return self._backend().combine_input(num_rows, hidden, dtype, device)

    def reserve(self, *, max_tokens: Optional[int] = None, hidden: Optional[int] = None, dtype_bytes: Optional[int] = None,
                topk: Optional[int] = None, num_experts: Optional[int] = None, combine_rows: Optional[int] = None) -> None:
        """Collective (every rank at the same point, each with its own needs): make the buffer
        hold the largest of every rank's needs, so that later sync-free calls (num_worst_tokens,
        CUDA graphs), which cannot grow it, fit. `combine_rows`: rows a combine input may have
        (a worst-case sized dispatch's num_worst_tokens). Nothing to do on the torch backend."""
        need = dict(max_tokens=max_tokens, hidden=hidden, dtype_bytes=dtype_bytes, combine_bytes=max(2, dtype_bytes or 2),
                    max_topk=topk, max_experts=num_experts, combine_rows=combine_rows)
        with self._exclusive("reserve"):
            self._backend().reserve({k: int(v) for k, v in need.items() if v is not None})

    def synchronize(self) -> None:
        """Wait for this buffer's communication and raise if a kernel reported a failure
        (a timeout names the rank, the peer and the handshake it waited on; an aborted call
        names the field the ranks disagreed on, or the rank that failed and its message)."""
        self._backend().synchronize()

    @property
    def num_sms(self) -> Optional[int]:
        """SMs per rank the normal paths' cuda kernels launch with now (None: torch backend)."""
        return getattr(self._impl, "num_sms", None)

    @property
    def max_num_sms(self) -> Optional[int]:
        """The most num_sms may be here: what each rank sharing this GPU can keep resident
        (None: torch backend, which has no kernels)."""
        return getattr(self._backend(), "max_num_sms", None)

    def set_num_sms(self, num_sms: Optional[int]) -> None:
        """The normal paths' SM budget from the next call on (not collective: a rank's count
        need not match its peers'); None goes back to the default rule. 1..max_num_sms, or
        ValueError naming the bound. The low-latency kernels keep every SM they may have. No
        effect on the torch backend."""
        if num_sms is not None:
            checks.check_int("num_sms", num_sms, 1)
        with self._exclusive("set_num_sms"):
            self._backend().set_num_sms(num_sms)

    @property
    def comm_stream(self):
        """The CUDA stream the normal-mode kernels run on (cuda backend; the low-latency kernels
        run on the caller's stream); None on the torch backend, which communicates on the
        caller's stream."""
        return getattr(self._impl, "comm_stream", None)

    # ----------------------------------------------------------------------------- helpers
    def _check_handle(self, handle, cls) -> None:
        if not isinstance(handle, cls):
            raise TypeError(f"handle must be a {cls.__name__}, got {type(handle).__name__}")
        checks.fail(handle.buffer_id == self.id, "handle was produced by a different Buffer")

    def __repr__(self) -> str:
        what = "destroyed" if self._destroyed else self._impl.describe()
        return f"Buffer(backend={self.backend!r}, rank={self.rank}/{self.num_ranks}, {what})"


class _CallScope:
    """Buffer._call as a context object (a generator-based context manager costs several times
    the host time of these few steps, and every call of a Buffer enters one): the Buffer's
    exclusivity around protocol.guarded over its backend, and the call numbers realigned where the
    backend says so."""

    __slots__ = ("buf", "op", "sig", "guard")

    def __init__(self, buf: Buffer, op: str, sig: Optional[list] = None):
        self.buf, self.op, self.sig = buf, op, sig

    def __enter__(self) -> protocol.Call:
        buf = self.buf
        buf._acquire(self.op)
        exc = None
        try:
            self.guard = protocol.guarded(buf._impl, buf._next_call(self.op, self.sig))
            call = self.guard.__enter__()  # the entry check; its failure is published there
        except BaseException as e:
            exc = e
            raise
        finally:
            if exc is not None:
                self._done(exc)
        try:
            buf._backend()  # a destroyed Buffer's call raises inside the guard: its peers learn of it
        except BaseException as e:
            self.__exit__(type(e), e, None)
            raise
        return call

    def __exit__(self, typ, exc, tb) -> bool:
        try:
            self.guard.__exit__(typ, exc, tb)
        finally:
            self._done(exc)
        return False

    def _done(self, exc: Optional[BaseException]) -> None:
        buf = self.buf
        if isinstance(exc, CallMismatchError) and getattr(exc, "resync", None) is not None:
            buf._seq = exc.resync  # the backend realigned the call numbers
        buf._release()
