"""DeepEP V1's Buffer (deep_ep/buffer.py at deepseek-ai/DeepEP 567632d) on megatron_ep's Buffer:
the same arguments, defaults, return tuples and dtypes for the normal mode (get_dispatch_layout,
dispatch, cached dispatch, combine). What differs is listed in docs/deep-ep.md."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..core import buffer as _mep
from ..core import envs
from ..core.checks import check_bool
from ..core.errors import PeerFailedError
from ..core.fp8 import UE8M0_PACK, pack_ue8m0, unpack_ue8m0
from ..core.protocol import MAX_TOPK, failure_message
from ..core.types import DispatchHandle
from .config import (BUFFER_ALIGNMENT, COMBINE_CONFIGS, DISPATCH_CONFIGS, INT_MAX, Config, InvalidArgument, _align_up,
                     check_int, check_num_ranks, flag)
from .utils import EventOverlap, from_ours, to_ours

log = logging.getLogger("megatron_ep.deep_ep")

RANKS_PER_NODE = 8  # DeepEP's fixed node size: num_tokens_per_rdma_rank counts by rank // 8

# What each get_low_latency_rdma_size_hint answer of this process was asked for: bytes ->
# (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts). An enable_shrink Buffer is
# sized at creation from the shape its num_rdma_bytes came from (see Buffer.__init__).
_HINTS: Dict[int, Tuple[int, int, int, int]] = {}


class _HandleTuple(tuple):
    """DeepEP's handles are plain tuples, which copy.copy, copy.deepcopy and pickle rebuild from
    their entries. Ours are tuples with attributes and constructors of their own, so they are
    rebuilt here from the entries and the attributes, never through those constructors.
    deepcopy copies the entries (the tensors DeepEP's tuple holds) and the attributes but shares
    `ours`: our Buffer's record of the routing, which our calls only read and which may view our
    communication memory, so the copy replays the same routing in a cached dispatch or combine."""

    def __reduce__(self):
        return _rebuilt, (type(self), tuple(self), dict(self.__dict__))

    def __copy__(self):
        return _rebuilt(type(self), tuple(self), dict(self.__dict__))

    def __deepcopy__(self, memo):
        ours = self.__dict__.get("ours")
        memo.setdefault(id(ours), ours)
        h = _rebuilt(type(self), copy.deepcopy(tuple(self), memo), copy.deepcopy(self.__dict__, memo))
        memo[id(self)] = h
        return h


def _rebuilt(cls, entries: tuple, attrs: dict):
    h = tuple.__new__(cls, entries)
    h.__dict__.update(attrs)
    return h


class Handle(_HandleTuple):
    """A normal dispatch's handle: DeepEP's intranode 6-tuple `(rank_prefix_matrix,
    channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
    send_head)` with the entries our kernels have no counterpart of (per-channel matrices, the
    ring-buffer heads) as None; `ours` is megatron_ep's handle, which combine and a cached
    dispatch use."""

    ours: DispatchHandle

    def __new__(cls, ours: DispatchHandle, rank_prefix_matrix, recv_src_idx, is_token_in_rank):
        h = super().__new__(cls, (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None))
        h.ours = ours
        return h


class InternodeHandle(Handle):
    """A normal dispatch's handle on a group of more than 8 ranks: DeepEP's internode 10-tuple
    `(is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
    recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
    recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)` with
    `is_token_in_rank` and `recv_gbl_rank_prefix_sum` ([R] int32: tokens ranks 0..i send to this
    rank, inclusive) filled and the entries of DeepEP's channels, RDMA forwarding and heads None."""

    def __new__(cls, ours: DispatchHandle, recv_prefix, is_token_in_rank):
        h = tuple.__new__(cls, (is_token_in_rank, None, None, None, None, None, recv_prefix, None, None, None))
        h.ours = ours
        return h


class LowLatencyHandle(_HandleTuple):
    """DeepEP's low-latency handle `(src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts)`; `ours` is megatron_ep's handle, which the combine uses."""

    ours: object

    def __new__(cls, ours, src_info, layout_range, T: int, H: int, E: int):
        h = super().__new__(cls, (src_info, layout_range, T, H, E))
        h.ours = ours
        return h


def _public(op: Optional[str] = None):
    """A public method of Buffer: its body runs after Buffer._alive (the destroyed rule) and, for
    a collective method (`op`: the call of our Buffer its first collective is), inside our
    Buffer's layer_call, which publishes a failure of the module's own checks before that call to
    the peers waiting in it (they raise PeerFailedError naming this rank at once)."""
    def wrap(fn):
        name = fn.__name__

        def alive_then(self, args, kwargs):
            self._alive(name)
            return fn(self, *args, **kwargs)

        if op is None:
            @functools.wraps(fn)
            def method(self, *args, **kwargs):
                return alive_then(self, args, kwargs)
        else:
            @functools.wraps(fn)
            def method(self, *args, **kwargs):
                return self.runtime.layer_call(op, alive_then, self, args, kwargs)
        return method
    return wrap


class Buffer:
    """DeepEP's Buffer. `group` is a torch.distributed group; the backend is megatron_ep's
    (MEGATRON_EP_DEEP_EP_BACKEND: auto, cuda or torch; auto picks cuda where it is built and a
    Hopper GPU is visible). The byte counts are checked as DeepEP checks them and otherwise
    unused: our Buffer sizes its own memory."""

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None) -> None:
        self._destroyed = False
        if group is None and comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        if group is None:
            raise NotImplementedError("megatron_ep.deep_ep.Buffer(comm=...): an mpi4py communicator is not supported; "
                                      "pass a torch.distributed group")
        self.rank, self.group, self.group_size = _group_of(group)
        _check_buffer_args(self.group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                           dict(allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode,
                                allow_mnnvl=allow_mnnvl, use_fabric=use_fabric, explicitly_destroy=explicitly_destroy,
                                enable_shrink=enable_shrink))
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = low_latency_mode, explicitly_destroy, enable_shrink
        if low_latency_mode or self.group_size > RANKS_PER_NODE:
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        backend = envs.text("MEGATRON_EP_DEEP_EP_BACKEND", "auto")
        # past 8 ranks DeepEP runs its internode kernels over nodes of 8: ours the two-level path
        nodes = dict(ranks_per_node=RANKS_PER_NODE) if self.group_size > RANKS_PER_NODE else {}
        if enable_shrink:
            nodes["low_latency"] = self._shrink_capacity(backend, low_latency_mode, num_rdma_bytes)
        if low_latency_mode and self.group_size > RANKS_PER_NODE and num_rdma_bytes and _uses_cuda(backend):
            # normal calls across nodes and low-latency calls on one Buffer hold two NVSHMEM buffers
            # (DeepEP's one RDMA buffer serves both): the heap starts with room for both, from
            # the RDMA bytes DeepEP would take from it
            nodes["nvshmem_heap_bytes"] = int(num_rdma_bytes)
        # ids checked only where it adds no host sync (the intranode notify): DeepEP's calls have none
        self.runtime = _mep.Buffer(group, backend=backend, check_inputs="no_sync", **nodes)
        self._combine_buffers, self._next_combine = _CombineBuffers(), 0  # the zero-copy combine's
        self._worst_reserved = 0  # the largest num_worst_tokens the buffer was reserved for
        self._sms_asked = None  # the SM count last handed to our budget (_hand_sms)
        self._sms_capped: set = set()  # the counts already said to be past this rank's share
        if self.rank == 0:
            log.info("megatron_ep.deep_ep: DeepEP's Buffer API on megatron_ep (%s backend, %d ranks)",
                     self.runtime.backend, self.group_size)

    def _shrink_capacity(self, backend: str, low_latency_mode: bool, num_rdma_bytes: int) -> dict:
        """enable_shrink: our rank mask, with the low-latency buffer sized now. Our first low-latency
        call would otherwise size it collectively, and a rank that stopped would never join that."""
        if not low_latency_mode:
            raise ValueError("megatron_ep.deep_ep.Buffer(enable_shrink=True) needs low_latency_mode=True (the rank mask "
                             "is the low-latency kernels')")
        if not _uses_cuda(backend):
            raise NotImplementedError("megatron_ep.deep_ep.Buffer(enable_shrink=True): the rank mask is in the cuda "
                                      "backend's kernels; the torch backend has none")
        shape = _HINTS.get(num_rdma_bytes)
        if shape is None or shape[2] != self.group_size:
            raise ValueError(f"megatron_ep.deep_ep.Buffer(enable_shrink=True): num_rdma_bytes={num_rdma_bytes} is not a "
                             f"Buffer.get_low_latency_rdma_size_hint(...) answer for {self.group_size} ranks in this "
                             f"process; pass one, so the buffer can be sized at creation for its tokens, hidden and experts")
        T, H, _, E = shape
        cap = dict(num_experts=E, max_tokens=T, hidden=H, topk=MAX_TOPK, fp8_only=False, rank_mask=True)
        timeout = envs.number("MEGATRON_EP_MASK_TIMEOUT_S", None, above=0)
        if timeout is not None:
            cap["mask_timeout_s"] = timeout
        return cap

    # ------------------------------------------------------------------------- lifecycle
    def _alive(self, method: str) -> None:
        """The one rule for a destroyed Buffer, first in every public method: RuntimeError naming
        the method (inside layer_call for a collective one, so the peers learn of it)."""
        if self._destroyed:
            raise RuntimeError(f"megatron_ep.deep_ep Buffer.{method}: this Buffer was destroyed (destroy() was "
                               f"called on it); create a new Buffer")

    @_public()
    def destroy(self) -> None:
        """DeepEP's: needs explicitly_destroy; collective on our kernels. A second destroy raises
        (DeepEP's runtime asserts it runs once), as every later call does. `runtime` stays our
        destroyed Buffer, whose failure publication tells the peers of such a call."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._destroyed = True
        self.runtime.destroy()

    @staticmethod
    def is_sm90_compiled() -> bool:
        return _mep.cuda_backend_available()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM count of the normal kernels (even: channels of two SMs), for every Buffer
        of this process: each normal dispatch and combine without a Config hands it to our
        kernels' budget (_hand_sms)."""
        n = check_int("new_num_sms", new_num_sms, 2, rule=" and even (channels of two SMs)")
        if n % 2:
            raise InvalidArgument(f"new_num_sms={n}: the SM count must be even (channels of two SMs), in 2..{INT_MAX}")
        Buffer.num_sms = n

    @staticmethod
    def capture() -> EventOverlap:
        from .utils import EventHandle

        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, *_table_entry(DISPATCH_CONFIGS, num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, *_table_entry(COMBINE_CONFIGS, num_ranks))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """DeepEP's formula (two buffer halves of send, receive and signalling areas)."""
        T = check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        H, E = check_int("hidden", hidden, 1), check_int("num_experts", num_experts, 1)
        num_ranks = check_int("num_ranks", num_ranks, 1)
        S = H // 128
        d = 16 + max(2 * H, H + 4 * S)
        c = 4 * S + 2 * H
        send, recv = max(T * d, E * T * c), max(E * T * d, E * T * c)
        total = 2 * send + 2 * recv + 2 * ((4 * E + 127) // 128 * 128)
        size = (total + 128) // 128 * 128
        _HINTS[size] = (T, H, num_ranks, E)  # (an enable_shrink Buffer is sized from it)
        return size

    # ------------------------------------------------------------------------ normal mode
    @_public()
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [R / 8] int32 or None for at
        most 8 ranks, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event).
        Computed on the caller's stream (no communication)."""
        async_finish, allocate_on_comm_stream = _stream_args(previous_event, async_finish, allocate_on_comm_stream)
        if getattr(previous_event, "event", None) is not None:  # DeepEP's rule: an EventOverlap(None) waits for nothing
            previous_event.current_stream_wait()
        # (DeepEP's layout checks no ids; our dispatch that follows checks them before rows move)
        lay = self.runtime.get_dispatch_layout(topk_idx, num_experts, check_values=False, counts_dtype=torch.int32)
        per_rdma = None
        if self.group_size > RANKS_PER_NODE:
            nodes = self.group_size // RANKS_PER_NODE
            per_rdma = lay.token_in_rank.view(-1, nodes, RANKS_PER_NODE).any(dim=2).sum(0).to(torch.int32)
        return lay.tokens_per_rank, per_rdma, lay.tokens_per_expert, lay.token_in_rank, _finished(None, async_finish)

    @_public("dispatch")
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], Optional[List[int]], Optional[Tuple], EventOverlap]:
        """Rank-major dispatch: rows ordered by source rank, then source token; received top-k
        ids local (-1 where the expert is on another rank, whose weight is 0); the per-expert
        counts a list rounded up to `expert_alignment` ([] with num_worst_tokens > 0). Without
        topk_idx the tokens go where is_token_in_rank says and the received top-k are None. With
        a handle (cached dispatch) only the rows move and the list and handle come back None."""
        async_finish, allocate_on_comm_stream = _stream_args(previous_event, async_finish, allocate_on_comm_stream)
        _check_config(config)
        self._hand_sms(config)
        prev = None if previous_event is None else to_ours(previous_event)
        pair = isinstance(x, tuple)  # (a bf16 tensor needs none of the FP8 pair's steps below)
        if (pair and _needs_row_major_copy(x)) or (handle is None and topk_idx is None):
            # the wrapper's own work on this stream (the scales' copy, the stand-in ids) must come
            # after previous_event, and our kernels after that work: this stream waits for the
            # event, then ours for this stream
            prev = _join(previous_event)
        packed = False
        if pair:
            x, packed = _unpacked_scales(x)
            x = _row_major_scales(x)
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            assert isinstance(handle, Handle), "handle must come from megatron_ep.deep_ep's dispatch"
            out = self.runtime.dispatch(x, handle=handle.ours, async_op=async_finish, previous_event=prev)
            if packed:
                out = self._repacked(out, packed)
            return out.x, None, None, None, None, _finished(out.event, async_finish)
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        E = num_tokens_per_expert.numel()
        assert E % self.group_size == 0
        if topk_idx is None:
            out = self._dispatch_by_rank(x, is_token_in_rank, E, topk_weights, num_worst_tokens, async_finish, prev)
            counts = self._recv_per_expert(num_tokens_per_expert, expert_alignment)
            recv_idx = recv_w = None  # DeepEP returns none without topk_idx
        else:
            if num_worst_tokens > self._worst_reserved:
                self._reserve_worst(x, topk_idx, E, num_worst_tokens)
            # DeepEP's num_worst_tokens is a precondition: rows past it are an error on every rank, not drops
            out = self.runtime.dispatch(x, topk_idx, topk_weights, num_experts=E, permute=False,
                                        num_worst_tokens=num_worst_tokens, host_counts=not num_worst_tokens,
                                        async_op=async_finish, previous_event=prev, on_overflow="raise",
                                        rank_counts=True)
            counts = [] if num_worst_tokens else _aligned(out.tokens_per_expert_host, expert_alignment)
            recv_idx, recv_w = out.topk_idx, out.topk_weights
        if packed:
            out = self._repacked(out, packed)
        internode = self.group_size > RANKS_PER_NODE  # DeepEP's internode_dispatch and its handle
        prefix, out = self._rank_prefix(out, num_tokens_per_rank, bool(num_worst_tokens), column=internode)
        h = InternodeHandle(out.handle, prefix, is_token_in_rank) if internode else \
            Handle(out.handle, prefix, None, is_token_in_rank)
        return out.x, recv_idx, recv_w, counts, h, _finished(out.event, async_finish)

    def _repacked(self, out, packed: bool):
        """int32 UE8M0 x_scales came in: the received fp32 scales packed back (_after)."""
        if not packed or not isinstance(out.x, tuple):
            return out
        data, scales = out.x
        words, out = self._after(out, lambda: pack_ue8m0(scales, checked=False))
        return dataclasses.replace(out, x=(data, words))

    def _after(self, out, fn: Callable[[], torch.Tensor]):
        """(fn(), out): the tensor fn makes from a dispatch's outputs, made where they are ready --
        after an async call's event on our communication stream (the returned out's event then
        follows fn's work), else on the caller's stream. No host sync."""
        ev = getattr(out.event, "event", None)
        stream = self.runtime.comm_stream if ev is not None else None
        if stream is None:
            return fn(), out
        caller = torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            stream.wait_event(ev)
            made = fn()
            done = torch.cuda.Event()
            done.record(stream)
        made.record_stream(caller)  # the caller's stream uses it after the event
        return made, dataclasses.replace(out, event=type(out.event)(done))

    def _reserve_worst(self, x, topk_idx: torch.Tensor, num_experts: int, num_worst_tokens: int) -> None:
        """DeepEP sizes its buffer from num_nvl_bytes, so callers pass num_worst_tokens freely; our
        buffer sizes itself from the calls it sees, and a worst-case sized dispatch (no host sync)
        cannot grow it. So the first such dispatch with a larger num_worst_tokens reserves room
        for it first: a collective, decided on num_worst_tokens alone, which DeepEP requires to be
        the same on every rank (a decision on this rank's own fit could leave it alone in the
        collective). Not under CUDA-graph capture: make one such call before capturing."""
        rows = _rows(x)
        # the combine area holds a rank-major dispatch's R x T rows as well as num_worst_tokens
        self.runtime.reserve(max_tokens=rows.shape[0], hidden=rows.shape[1], dtype_bytes=rows.element_size(),
                             topk=topk_idx.shape[1], num_experts=num_experts,
                             combine_rows=max(num_worst_tokens, self.group_size * rows.shape[0]))
        self._worst_reserved = num_worst_tokens

    def _dispatch_by_rank(self, x, is_token_in_rank: torch.Tensor, num_experts: int, topk_weights, num_worst_tokens: int,
                          async_finish: bool, prev):
        """DeepEP's dispatch without topk_idx: each token goes to the ranks is_token_in_rank marks.
        Our kernels route by expert id, so each marked rank gets a stand-in id (_stand_in_topk);
        the rows are DeepEP's: one per token and marked rank, by source rank then token."""
        if topk_weights is not None:
            raise ValueError("megatron_ep.deep_ep dispatch: topk_weights given without topk_idx "
                             "(DeepEP takes both or neither)")
        if num_worst_tokens:
            raise ValueError(f"megatron_ep.deep_ep dispatch: num_worst_tokens={num_worst_tokens} needs topk_idx and "
                             "topk_weights, as in DeepEP")
        T, R = _rows(x).shape[0], self.group_size
        if not (isinstance(is_token_in_rank, torch.Tensor) and is_token_in_rank.dtype == torch.bool
                and tuple(is_token_in_rank.shape) == (T, R)):
            raise ValueError(f"megatron_ep.deep_ep dispatch: is_token_in_rank must be a [{T}, {R}] torch.bool tensor "
                             f"(num_tokens, num_ranks), got {getattr(is_token_in_rank, 'dtype', type(is_token_in_rank))} "
                             f"{tuple(getattr(is_token_in_rank, 'shape', ()))}")
        idx = _stand_in_topk(is_token_in_rank, num_experts // R)  # after the caller's join (dispatch)
        return self.runtime.dispatch(x, idx, None, num_experts=num_experts, permute=False, async_op=async_finish,
                                     previous_event=prev, rank_counts=True)

    def _recv_per_expert(self, num_tokens_per_expert: torch.Tensor, expert_alignment: int) -> List[int]:
        """DeepEP's num_recv_tokens_per_expert_list (its notify_dispatch): every rank's
        num_tokens_per_expert summed, this rank's experts, each rounded up to expert_alignment."""
        L = num_tokens_per_expert.numel() // self.group_size
        total = self._gathered(num_tokens_per_expert).sum(0)[self.rank * L:(self.rank + 1) * L]
        return _aligned(total.tolist(), expert_alignment)

    @_public("combine")
    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """combined_x[t] = the biases + the rows token t's dispatch delivered (one per rank it went
        to; unweighted), one fp32 accumulator that starts at the biases, as DeepEP's kernel does
        (ranks added in the order of their last top-k slot of t, where DeepEP V1 adds them by
        rank: the same sum up to fp32 rounding); combined_topk_weights [N, K] the sum of
        the K weights each of those ranks passes for the token, as DeepEP sums them (the
        weights a dispatch returned are 0 for experts elsewhere, so that sum gives back the
        selected experts' weights)."""
        async_finish, allocate_on_comm_stream = _stream_args(previous_event, async_finish, allocate_on_comm_stream)
        _check_config(config)
        self._hand_sms(config)
        assert isinstance(handle, Handle), "handle must come from megatron_ep.deep_ep's dispatch"
        out = self.runtime.combine(x, handle.ours, async_op=async_finish, previous_event=to_ours(previous_event),
                                   bias=bias)
        y = out.x
        weights = None
        if topk_weights is not None:  # a second combine, of the weight rows (fp32, padded to 16 bytes)
            _join(previous_event)  # the rows below read topk_weights on this stream: after the event
            K = topk_weights.shape[1]
            rows = torch.zeros((topk_weights.shape[0], -(-K // 4) * 4), dtype=torch.float32, device=topk_weights.device)
            rows[:, :K] = topk_weights
            # previous_event None: our stream waits for the caller's, where `rows` was just written
            # (the first combine's event would not cover it); our stream runs that combine first
            back = self.runtime.combine(rows, handle.ours, async_op=async_finish, previous_event=None)
            weights, out = back.x[:, :K], back
        return y, weights, _finished(out.event, async_finish)

    # ----------------------------------------------------------------------- low latency
    @_public("low_latency_dispatch")
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """(recv_x [L, R*T, H] bf16, or (FP8 rows, fp32 scales [L, R*T, H/128]), recv_count [L]
        int32, handle (src_info [L, R*T] int32, layout_range [L, R] int64 = begin << 32 | count,
        T, H, E), event, hook). With return_recv_hook the outputs are valid after hook()."""
        assert self.low_latency_mode
        if not (type(use_fp8) is bool and type(round_scale) is bool and type(use_ue8m0) is bool
                and type(async_finish) is bool and type(return_recv_hook) is bool):  # (bools: nothing to convert)
            use_fp8, round_scale = flag("use_fp8", use_fp8), flag("round_scale", round_scale)
            use_ue8m0 = flag("use_ue8m0", use_ue8m0)
            async_finish, return_recv_hook = flag("async_finish", async_finish), flag("return_recv_hook", return_recv_hook)
        assert not (async_finish and return_recv_hook)
        assert not use_ue8m0 or round_scale
        hooked = return_recv_hook and self.runtime.backend == "cuda"
        out = self.runtime.low_latency_dispatch(x, topk_idx, num_experts, max_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                                use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                                                dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats,
                                                **({"return_recv_hook": True} if hooked else {}))
        ours = out.handle
        lr, packed = ours.layout_range, ours.packed_layout  # (our kernels write DeepEP's form with ours)
        made = packed is None
        if made:
            packed = torch.empty(lr.shape[:-1], dtype=torch.int64, device=lr.device)
        handle = LowLatencyHandle(ours, ours.src_token, packed, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        hook = out.hook if hooked else None
        if made and hooked:  # the layout exists once the receive half ran: packed after it, on the hook's stream
            hook = _then(out.hook, lambda: _pack_layout(lr, packed))
        elif made:
            _pack_layout(lr, packed)
        if return_recv_hook and hook is None:
            hook = lambda: None  # noqa: E731 - the torch backend has received already
        return out.x, out.count, handle, _finished(out.event, async_finish), hook

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective, as DeepEP's. Our low-latency buffers need no cleaning (each call's last
        block clears the signal words it used, and the normal paths use other memory), so this
        is the group's barrier, which carries a rank's failure of this call (a destroyed Buffer,
        say) to its peers; with enable_shrink the GPU barrier over the unmasked ranks (a rank
        that does not join in time is masked), which also lets ranks unmasked since rejoin."""
        try:
            self._alive("clean_low_latency_buffer")
            assert self.low_latency_mode
        except Exception as exc:
            if not self.enable_shrink:  # (with enable_shrink the peers' barrier masks a rank that does not come)
                self._barrier("clean_low_latency_buffer", exc)
            raise
        if self.enable_shrink:
            self.runtime.low_latency_barrier()
        else:
            self._barrier("clean_low_latency_buffer")

    def _barrier(self, method: str, failure: Optional[BaseException] = None) -> None:
        """A barrier over the group in which each rank says whether its call failed: the peers of
        a rank that failed (`failure`, which it then raises) raise PeerFailedError with its message
        instead of going on without it."""
        nccl = self.group_size > 1 and dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        flags = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(self.group_size)]
        dist.all_gather(flags, torch.tensor([int(failure is not None)], device=device), group=self.group)
        failed = [r for r, f in enumerate(torch.cat(flags).tolist()) if f]
        if not failed:
            return
        messages: list = [None] * self.group_size
        dist.all_gather_object(messages, None if failure is None else failure_message(failure), group=self.group)
        if failure is not None:
            raise failure
        raise PeerFailedError(f"megatron_ep.deep_ep Buffer.{method} aborted on every rank: rank {failed[0]} failed: "
                              f"{messages[failed[0]]}")

    # ------------------------------------------------------------------ elastic EP (shrink)
    @_public()
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask a rank for this rank's low-latency dispatch, combine and clean."""
        self.runtime.low_latency_mask(rank_to_mask, mask)

    @_public()
    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """mask_status ([num_ranks] torch.int on this GPU) = 1 where a rank is masked, else 0."""
        self.runtime.low_latency_mask_status(mask_status)

    @_public()
    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self.runtime.low_latency_clear_mask()

    @_public("low_latency_combine")
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """(combined_x [M, H]: sum over k of topk_weights[t, k] x the row expert topk_idx[t, k]
        computed for token t, event, hook)."""
        assert self.low_latency_mode
        if not (type(use_logfmt) is bool and type(zero_copy) is bool and type(async_finish) is bool
                and type(return_recv_hook) is bool):  # (bools: nothing to convert)
            use_logfmt, zero_copy = flag("use_logfmt", use_logfmt), flag("zero_copy", zero_copy)
            async_finish, return_recv_hook = flag("async_finish", async_finish), flag("return_recv_hook", return_recv_hook)
        assert not (async_finish and return_recv_hook)
        assert isinstance(handle, LowLatencyHandle), "handle must come from megatron_ep.deep_ep's low_latency_dispatch"
        assert not (zero_copy and use_logfmt), "zero_copy and use_logfmt are exclusive, as in DeepEP"
        if zero_copy:  # the expert outputs were written into the buffer get_next_low_latency_combine_buffer gave
            x = self._combine_buffers.filled(_combine_shape(handle, self.group_size), self._next_combine)
        self._next_combine ^= 1
        cuda = self.runtime.backend == "cuda"
        kwargs = {}
        if combine_wait_recv_cost_stats is not None:
            kwargs["combine_wait_recv_cost_stats"] = combine_wait_recv_cost_stats
        if use_logfmt:
            kwargs["use_logfmt"] = True
        if cuda and return_recv_hook:
            kwargs["return_recv_hook"] = True
        if out is not None:  # checked (shape, dtype, device) by our Buffer on both backends
            kwargs["out"] = out
        res = self.runtime.low_latency_combine(x, topk_idx, topk_weights, handle.ours, **kwargs)
        y, hook = res if (cuda and return_recv_hook) else (res, None)
        if return_recv_hook and hook is None:
            hook = lambda: None  # noqa: E731 - the torch backend has combined already
        return y, _finished(None, async_finish), hook

    @_public()
    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The stream our normal-mode kernels run on: what `async_finish` calls overlap with and
        `allocate_on_comm_stream` refers to. The torch backend communicates on the caller's stream:
        that one where CUDA is present, else None (CPU processes)."""
        stream = self.runtime.comm_stream
        if stream is None and torch.cuda.is_available():
            stream = torch.cuda.current_stream()
        return stream

    @_public()
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """DeepEP hands out its raw NVLink (or RDMA) buffer. Ours is laid out for our kernels, which
        own its bytes between calls, so a view of it would differ from DeepEP's in silence: this
        raises, naming the call."""
        raise NotImplementedError("megatron_ep.deep_ep: get_local_buffer_tensor is not supported: our communication "
                                  "buffer's layout is not DeepEP's and our kernels own its bytes between calls "
                                  "(docs/deep-ep.md, 'Not yet here')")

    @_public()
    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The [L, R*T, H] bf16 tensor the next low_latency_combine(zero_copy=True) reads its
        expert outputs from. Our combine reads expert outputs in place (it has no send buffer
        to copy them into), so these are two tensors of this Buffer taken in turn by successive
        combines, as DeepEP alternates its two buffers: two combines in flight never share one."""
        assert self.low_latency_mode
        assert isinstance(handle, LowLatencyHandle), "handle must come from megatron_ep.deep_ep's low_latency_dispatch"
        return self._combine_buffers.get(_combine_shape(handle, self.group_size), self._next_combine, handle[0].device)

    # ---------------------------------------------------------------------------- helpers
    def _hand_sms(self, config: Optional[Config]) -> None:
        """DeepEP's SM count for a normal call -- the call's Config, else Buffer.num_sms
        (set_num_sms; DeepEP's default 20) -- as our kernels' budget (0: our default rule).
        Past what this rank may keep resident (ranks sharing one GPU) it gets that bound, said
        once per count: DeepEP's blocks would not all be resident there either."""
        want = config.num_sms if config is not None else Buffer.num_sms
        if want == self._sms_asked:
            return
        self._sms_asked = want
        limit = self.runtime.max_num_sms
        if limit is None:  # the torch backend: no kernels
            return
        n = want or None
        if n is not None and n > limit:
            if n not in self._sms_capped:
                self._sms_capped.add(n)
                log.warning("megatron_ep.deep_ep: num_sms=%d is above the %d SMs each rank sharing this GPU may keep "
                            "resident; our kernels use %d", n, limit, limit)
            n = limit
        self.runtime.set_num_sms(n)

    def _rank_prefix(self, out, num_tokens_per_rank: torch.Tensor, sync_free: bool, column: bool):
        """(prefix, out): DeepEP's rank_prefix_matrix, [R, R] int32, [i][j] = tokens ranks 0..i
        send to rank j (inclusive prefix over sources); with `column`, only its column of this
        rank ([R], the internode handle's recv_gbl_rank_prefix_sum). From the dispatch's own count
        exchange (the handle's rank_counts / recv_rank_counts: no communication), made where the
        dispatch's outputs are ready (_after); a backend without those counts falls back to
        gathering every rank's num_tokens_per_rank -- None then for a sync-free dispatch on a
        group that cannot gather device tensors without a host round trip."""
        prefix = out.handle.recv_rank_prefix if column else out.handle.rank_prefix
        if prefix is not None:  # (the backend's, from the same exchange; DeepEP's column is contiguous)
            return (prefix.contiguous() if column else prefix), out
        counts = out.handle.recv_rank_counts if column else out.handle.rank_counts
        if counts is not None:
            return self._after(out, lambda: torch.cumsum(counts, dim=0, dtype=torch.int32))
        if sync_free and num_tokens_per_rank.is_cuda and dist.get_backend(self.group) != "nccl":
            return None, out
        matrix = torch.cumsum(self._gathered(num_tokens_per_rank), dim=0).to(torch.int32)
        return (matrix[:, self.rank].contiguous() if column else matrix), out

    def _gathered(self, counts: torch.Tensor) -> torch.Tensor:
        """[R, *counts.shape] int64 on counts' device: every rank's counts (through the host
        where the group cannot gather device tensors: gloo with CUDA tensors)."""
        local = counts.to(torch.int64)
        if local.is_cuda and dist.get_backend(self.group) != "nccl":
            local = local.cpu()
        every = [torch.empty_like(local) for _ in range(self.group_size)]
        dist.all_gather(every, local.contiguous(), group=self.group)
        return torch.stack(every).to(counts.device)


def _group_of(group) -> Tuple[int, object, int]:
    """(rank, group, size) of a torch.distributed group this process is in; TypeError naming
    `group` for anything else."""
    try:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        raise TypeError(f"group must be a torch.distributed process group (initialized), got "
                        f"{type(group).__name__}: {exc}") from exc
    if not isinstance(rank, int) or rank < 0:
        raise ValueError("group: this process is not one of the group's ranks")
    return rank, group, size


def _uses_cuda(backend: str) -> bool:
    """Whether a Buffer of MEGATRON_EP_DEEP_EP_BACKEND=`backend` runs on our cuda kernels."""
    return backend == "cuda" or (backend == "auto" and _mep.cuda_backend_available())


def _check_buffer_args(num_ranks: int, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                       flags: dict) -> None:
    """DeepEP's rules on Buffer's arguments (deep_ep/buffer.py and csrc/deep_ep.cpp at 567632d),
    each refused at the call by name: TypeError for a wrong type, InvalidArgument (a ValueError
    and an AssertionError, as DeepEP asserts) naming the value and the allowed range."""
    check_bool("low_latency_mode", low_latency_mode)
    for name, value in flags.items():
        check_bool(name, value)
    check_num_ranks("the group's size (num_ranks)", num_ranks)
    nvl = check_int("num_nvl_bytes", num_nvl_bytes, 0, None)
    rdma = check_int("num_rdma_bytes", num_rdma_bytes, 0, None)
    for name, value in (("num_nvl_bytes", nvl), ("num_rdma_bytes", rdma)):
        if value % BUFFER_ALIGNMENT:
            raise InvalidArgument(f"{name}={value} must be a multiple of {BUFFER_ALIGNMENT} (>= 0); "
                                  f"{_align_up(value, BUFFER_ALIGNMENT)} is the next one")
        if value // 16 >= INT_MAX:
            raise InvalidArgument(f"{name}={value} is outside its range: it must be below {16 * INT_MAX}")
    if nvl > INT_MAX and rdma:
        raise InvalidArgument(f"num_nvl_bytes={nvl} is above {INT_MAX}, which DeepEP allows only with "
                              f"num_rdma_bytes=0 (it is {rdma})")
    if rdma > INT_MAX and not low_latency_mode:
        raise InvalidArgument(f"num_rdma_bytes={rdma} is above {INT_MAX}, which DeepEP allows only with "
                              f"low_latency_mode=True")
    if rdma and not (num_ranks > 8 or low_latency_mode):
        raise InvalidArgument(f"num_rdma_bytes={rdma} must be 0 on a group of {num_ranks} ranks without "
                              f"low_latency_mode: DeepEP's RDMA buffer is for more than 8 ranks or the "
                              f"low-latency mode")
    # DeepEP asserts num_qps_per_rank > 0 where it opens RDMA queue pairs: low-latency mode or past 8 ranks
    check_int("num_qps_per_rank", num_qps_per_rank, 1 if low_latency_mode or num_ranks > 8 else 0)


def _table_entry(table: dict, num_ranks) -> tuple:
    """DeepEP's default chunk sizes for `num_ranks`; InvalidArgument naming the sizes it has."""
    n = check_int("num_ranks", num_ranks, 1)
    if n not in table:
        raise InvalidArgument(f"Unsupported number of EP ranks: {n} (num_ranks must be one of {sorted(table)}, "
                              f"DeepEP's tables)")
    return table[n]


def _check_config(config) -> None:
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a megatron_ep.deep_ep.Config or None, got {type(config).__name__}")


def _stand_in_topk(is_token_in_rank: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """[N, K] int64 expert ids that send each token to exactly the ranks it is marked for: the
    first expert of each marked rank (rank r holds experts r * L ..), marked ranks first, -1
    after them. K = R up to our kernels' top-k limit: the same on every rank, as our calls
    require of K."""
    N, R = is_token_in_rank.shape
    K = min(R, MAX_TOPK)
    if K < R and N and int(is_token_in_rank.sum(1).max()) > K:
        raise ValueError(f"megatron_ep.deep_ep dispatch: is_token_in_rank marks a token for more than {K} ranks; "
                         f"without topk_idx our kernels send a token to at most {K}")
    first = torch.arange(R, dtype=torch.int64, device=is_token_in_rank.device) * experts_per_rank
    ids = torch.where(is_token_in_rank, first, torch.full_like(first, -1))
    marked_first = torch.sort((~is_token_in_rank).to(torch.int8), dim=1, stable=True).indices[:, :K]
    return ids.gather(1, marked_first).contiguous()


def _pack_layout(layout_range: torch.Tensor, packed: torch.Tensor) -> None:
    """DeepEP's layout_range [L, R] int64 (begin << 32 | count) from ours ([L, R, 2] int32)."""
    torch.bitwise_or(layout_range[..., 0].to(torch.int64) << 32, layout_range[..., 1].to(torch.int64), out=packed)


def _then(hook, after):
    """A receive hook that runs `after` once the receive half is launched (same stream)."""
    def run() -> None:
        hook()
        after()
    return run


def _combine_shape(handle: tuple, num_ranks: int) -> Tuple[int, int, int]:
    _, _, T, H, E = handle
    return E // num_ranks, num_ranks * T, H


class _CombineBuffers:
    """The zero-copy combine's two bf16 buffers (made on first use, remade for another shape)."""

    def __init__(self):
        self._bufs: List[Optional[torch.Tensor]] = [None, None]

    def get(self, shape: Tuple[int, int, int], i: int, device: torch.device) -> torch.Tensor:
        """Buffer i for a handle of `shape` (get_next_low_latency_combine_buffer)."""
        b = self._bufs[i]
        if b is None or tuple(b.shape) != shape or b.device != device:
            b = self._bufs[i] = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return b

    def filled(self, shape: Tuple[int, int, int], i: int) -> torch.Tensor:
        """Buffer i, which the caller filled for this combine, whose handle is of `shape`."""
        b = self._bufs[i]
        if b is None:
            raise ValueError("low_latency_combine(zero_copy=True) reads the expert outputs from the buffer "
                             "get_next_low_latency_combine_buffer(handle) gives, and none was asked for this combine: "
                             "ask for it with this combine's handle and fill it first")
        if tuple(b.shape) != shape:
            raise ValueError(f"low_latency_combine(zero_copy=True): the buffer get_next_low_latency_combine_buffer gave "
                             f"for this combine belongs to another handle, of shape {list(b.shape)} ([local experts, "
                             f"ranks * num_max_dispatch_tokens_per_rank, hidden]); this combine's handle is of shape "
                             f"{list(shape)}: ask for the buffer with this combine's handle and fill it")
        return b


def _aligned(counts: List[int], alignment: int) -> List[int]:
    """DeepEP's per-expert list: each count rounded up to `alignment` (one pass, no call per expert)."""
    if alignment == 1:
        return list(counts)
    return [(int(c) + alignment - 1) // alignment * alignment for c in counts]


def _rows(x) -> torch.Tensor:
    return x[0] if isinstance(x, tuple) else x


def _finished(ours, async_finish: bool) -> EventOverlap:
    """The event DeepEP returns: ours when the call gave one; with async_finish where the call
    gave none (it finished on the caller's stream: the torch backend, our low-latency kernels),
    an EventHandle made after it (on the caller's stream; none on a process without CUDA), so
    `current_stream_wait()` works as DeepEP's callers expect; None without async_finish, as
    DeepEP."""
    ev = from_ours(ours)
    if ev.event is None and async_finish:
        from .utils import EventHandle

        ev = EventOverlap(EventHandle())
    return ev


def _unpacked_scales(x):
    """(x, True) with int32 UE8M0 x_scales ([T, H/512]: each 128-channel block's power-of-two scale
    as its exponent byte, four to an int32 along hidden, as DeepGEMM takes them) unpacked into the
    fp32 scales they stand for (exact; packed back after the dispatch); (x, False) otherwise."""
    if not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor) and x[1].dtype == torch.int32):
        return x, False
    data, words = x
    T, H = (data.shape[0], data.shape[1]) if data.dim() == 2 else (-1, -1)
    want = (T, H // (128 * UE8M0_PACK))
    if data.dim() != 2 or H % (128 * UE8M0_PACK) or tuple(words.shape) != want:
        raise ValueError(f"megatron_ep.deep_ep dispatch: int32 x_scales must be UE8M0 exponents packed four to an int32, "
                         f"[num_tokens, hidden // 512] = {list(want)} for x {list(data.shape)} (hidden a multiple of "
                         f"512), got {list(words.shape)}; or pass float32 scales [num_tokens, hidden // 128]")
    return (data, unpack_ue8m0(words)), True


def _row_major_scales(x):
    """An FP8 pair with its scales row-major: DeepEP reads the scales through their strides (its
    tests pass a column-major view, `x_scales.T.contiguous().T`); our kernels read [T, H/128]
    rows."""
    if not isinstance(x, tuple) or len(x) != 2 or not isinstance(x[1], torch.Tensor):
        return x  # a plain tensor, or a malformed pair our Buffer's checks name
    data, scales = x
    return data, scales.contiguous()


def _needs_row_major_copy(x) -> bool:
    """The wrapper makes the scales row-major (a copy) or unpacks int32 ones on the caller's stream."""
    return (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor)
            and (x[1].dtype == torch.int32 or not x[1].is_contiguous()))


def _join(previous_event: Optional[EventOverlap]) -> None:
    """The caller's stream waits for previous_event (DeepEP's: when the inputs are ready, on any
    stream); returns the previous_event for our Buffer's call: None, so our kernels wait for the
    caller's stream, which now covers both the event and what the wrapper queued after it."""
    if getattr(previous_event, "event", None) is not None:
        previous_event.current_stream_wait()
    return None


def _stream_args(previous_event, async_finish, allocate_on_comm_stream) -> Tuple[bool, bool]:
    """The two stream flags as DeepEP's binding takes them (config.flag), checked as DeepEP checks them."""
    if async_finish is False and allocate_on_comm_stream is False:  # (the common call: nothing to convert)
        return False, False
    async_finish = flag("async_finish", async_finish)
    allocate_on_comm_stream = flag("allocate_on_comm_stream", allocate_on_comm_stream)
    if allocate_on_comm_stream:
        assert previous_event is not None and async_finish
    return async_finish, allocate_on_comm_stream
