"""The intranode normal path (csrc/intranode/) on the shared runtime.

A dispatch is notify (counts, the call exchange, exact row positions) -> [host reads the sizes
from mapped memory, grows the region if any rank needs more -- unless outputs are worst-case
sized] -> stage + pull, or push into pooled outputs. A cached dispatch and a combine start with
their own exchange (stage, or push, publishes the call record). Kernels run on the runtime's
communication stream; outputs are allocated on the caller's stream. The runtime keeps the
path's failure state: its checks, and the publication of a failure at the handshake the peers
wait on next (`call.pending`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch

from ....core import output_hook as hooks
from ....core import protocol
from ....core.checks import IDS_CHECKED, IDS_UNCHECKED, bad_slot_error, check_topk_values, fail, is_fp8_tuple
from ....core.errors import PeerFailedError
from ....core.permute import padded_host_counts
from ....core.replay import Replay
from ....core.requests import CombineRequest, DispatchRequest
from ..runtime import CudaRuntime
from ....core.types import CombineOutput, DispatchHandle, DispatchOutput, EventOverlap
from .interface import NormalPath

SLOT = protocol.SLOT


@dataclass(slots=True)
class IntranodeState:
    # (the four index tensors: None where `native` holds them, after a new routing's one crossing)
    rank_pos: Optional[torch.Tensor]  # [T, R] int32: row of each token in each rank's rank-major output (-1: none)
    slot_pos: Optional[torch.Tensor]  # [T, K] int32: row of each (token, slot) in its rank's expert-major output
    recv_info: Optional[torch.Tensor]  # int32, csrc/ipc/region_layout.h RecvInfo: N, M, L, dropped, counts, padded, seg starts
    row_limits: Optional[torch.Tensor]  # [R] int32: rows each rank delivers at most (its num_worst_tokens, or INT_MAX)
    tokens_per_expert: torch.Tensor  # [L] int64 (what every dispatch along this routing returns)
    num_dropped: torch.Tensor  # 0-d int64
    num_rows: Optional[int]  # N, when known on the host
    num_perm_rows: Optional[int]  # M, when known on the host
    counts: Optional[List[int]]  # raw per-local-expert counts, when known on the host
    comb_map: Optional[torch.Tensor] = None  # expert-major: [>= N, K] int32 row of each (rank-major row, slot)
    rank_counts: Optional[torch.Tensor] = None  # [groups * R, R] int32: tokens (group, rank s) sends to rank d (when asked)
    rank_prefix: Optional[torch.Tensor] = None  # [groups * R, R] int32: its inclusive prefix over the rows
    recv_rank_counts: Optional[torch.Tensor] = None  # [groups * R] int32: rank_counts' column of this rank
    recv_rank_prefix: Optional[torch.Tensor] = None  # [groups * R] int32: rank_prefix's column of this rank
    topk_idx: Optional[torch.Tensor] = None  # [T, K] int64: the routing (the handle's copy)
    device_counts: Optional[torch.Tensor] = None  # [L + 1] int64: tokens_per_expert and num_dropped are its views
    permute: bool = False
    native: Any = None  # the same state as the one-crossing entries take it (native_state)
    fitted: Optional[tuple] = None  # (hidden, element bytes) of a cached dispatch that fitted (the region only grows)

    def __deepcopy__(self, memo):
        """A copy replays the same routing: its tensors copied, its native binding made again from
        them at its first use (a compiled object does not copy). A new routing's crossing leaves
        the index tensors in the native binding only (dispatch_first_call): they come from it here."""
        if self.rank_pos is None and self.native is not None:
            _, self.rank_pos, self.slot_pos, self.recv_info, self.row_limits, _, _ = self.native.tensors()
        return type(self)(**{f.name: None if f.name == "native" else copy.deepcopy(getattr(self, f.name), memo)
                             for f in dataclasses.fields(self)})


@dataclass(slots=True)
class DispatchPlan:
    """What a dispatch decided before any kernel runs (IntranodePath._plan)."""

    data: torch.Tensor  # the rows (FP8 data, or bf16 / fp32)
    scales: Optional[torch.Tensor]  # FP8: [T, scale_cols] fp32
    topk_idx: torch.Tensor  # the routing the handle keeps (a copy of the caller's, or the handle's)
    topk_weights: Optional[torch.Tensor]
    num_experts: int
    permute: bool
    expert_alignment: int
    num_worst_tokens: int
    groups: int
    T: int
    H: int
    K: int
    L: int  # local experts
    row_bytes: int
    scale_cols: int
    need: dict  # the region's needs (hint keys) of this call
    first: bool  # a new routing: notify runs (else a cached dispatch on the handle's state)
    push: bool  # rows pushed into pooled outputs (else staged here and pulled by the receivers)
    check_ids: bool = False  # notify checks the ids (range, repeats) and the host raises before rows move
    rank_counts: bool = False  # notify writes every rank's tokens per destination (IntranodeState.rank_counts)
    fused: Optional[Callable] = None  # the internode path's entry instead of ours (DispatchRequest.fused)
    want_src: bool = False  # the kernels write each rank-major row's source token (DispatchRequest.source_index)


def dispatch_rows(rt: CudaRuntime, x, topk_weights, num_experts: int):
    """The cuda backend's own checks of a dispatch's inputs (Buffer checked the contract);
    returns (data, scales, T, H, element bytes, row bytes)."""
    data, scales = (x[0], x[1]) if is_fp8_tuple(x) else (x, None)
    T, H = data.shape
    elem = data.element_size()
    row_bytes = H * elem
    if row_bytes % 16 != 0:
        raise ValueError(f"dispatch: rows of {row_bytes} bytes; the cuda backend needs a multiple of 16 (hidden * element size)")
    if data.device != rt.device:
        raise ValueError(f"x is on {data.device}, the buffer on {rt.device}")
    if num_experts > protocol.MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts} exceeds the cuda backend's {protocol.MAX_EXPERTS}")
    if topk_weights is not None:
        if topk_weights.dtype != torch.float32:
            raise TypeError(f"topk_weights must be float32 for the cuda backend, got {topk_weights.dtype}")
    return data, scales, T, H, elem, row_bytes


def combine_rows(rt: CudaRuntime, x, weights):
    """The cuda backend's own checks of a combine's inputs (Buffer checked the contract);
    returns (rows, H, row bytes). Whether the rows fit is each path's check (its buffer)."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"the cuda backend combines bf16 or fp32 rows, got {x.dtype}")
    if x.device != rt.device:
        raise ValueError(f"x is on {x.device}, the buffer on {rt.device}")
    rows, H = x.shape
    row_bytes = H * x.element_size()
    if row_bytes % 16 != 0:
        raise ValueError(f"combine: rows of {row_bytes} bytes; the cuda backend needs a multiple of 16 (hidden * element size)")
    if weights is not None:
        if weights.dtype != torch.float32:
            raise TypeError(f"weights must be float32 for the cuda backend, got {weights.dtype}")
    return rows, H, row_bytes


def max_rank_major_rows(rt: CudaRuntime) -> int:
    """The most rank-major rows any rank can receive: every rank's tokens (same on every rank)."""
    return rt.num_ranks * rt.region.plan.max_tokens


class IntranodePath(NormalPath):
    def __init__(self, rt: CudaRuntime):
        self.rt = rt
        self.kernels = rt.ext.intranode
        self.tags = itertools.count(1)
        # the last new routing's replay and its plan without tensors (megatron_ep/core/replay.py)
        self.routing_replay: Optional[Replay] = None
        self._routing_plan: Optional[DispatchPlan] = None
        self._fitted_need: Optional[dict] = None  # the last new routing's need that fitted the region

    @classmethod
    def open(cls, group, rank: int, num_ranks: int, ranks_per_node: int, hints: dict, num_sms: Optional[int],
             timeout_s: float) -> "IntranodePath":
        """Collective: the runtime over the whole group (one node), then the path."""
        return cls(CudaRuntime(group, rank, num_ranks, hints=hints, num_sms=num_sms, timeout_s=timeout_s))

    @property
    def world(self) -> CudaRuntime:
        return self.rt  # the runtime spans the whole group

    def describe(self) -> str:
        rt = self.rt
        size = f"{rt.region.plan.total / 2**20:.0f} MiB region" if rt.region.ready else "sized on first use"
        return f"cuda intranode, {rt.budget.num_sms} SMs/rank, {rt.ranks_per_device} rank(s)/GPU, {size}"

    # ------------------------------------------------------------------------------ calls
    def begin(self, call: protocol.Call) -> None:
        self.rt.ledger.check(call)

    def failed(self, call: protocol.Call, exc: BaseException) -> None:
        self.rt.ledger.publish(call, exc)

    def check(self, call: Optional[protocol.Call] = None) -> None:
        self.rt.ledger.check(call)

    def synchronize(self) -> None:
        self.rt.stream.synchronize()
        self.rt.ledger.check()

    def close(self) -> None:
        self.rt.close()

    # ------------------------------------------------------------------------------ dispatch
    def dispatch(self, call: protocol.Call, req: DispatchRequest) -> DispatchOutput:
        """plan (every decision, before any kernel) -> one crossing: a new routing's notify, the host
        wait for its sizes and the rest (calls.h dispatch_first_call), or a cached dispatch's rest
        (outputs, the rows moved: push [+ fan-out] or stage + pull, the counts, the event:
        dispatch_call) -> the caller's DispatchOutput. A new routing takes two crossings where the
        host must act between them (the region grows, or the call failed at notify's exchange),
        or where it is worst-case sized (notify_call, then dispatch_call without a host wait)."""
        plan = self._plan(call, req)
        out = self._planned(call, plan, req.previous_event, req.async_op, req.handle, req.host_counts)
        if plan.fused is None and plan.groups == 1:
            if plan.first:  # Buffer's new routing (Buffer asks only where its own options allow)
                if not (plan.num_worst_tokens or plan.want_src):  # (on_overflow acts only with num_worst_tokens)
                    self.routing_replay = Replay(call.sig, self._replay_routing, req.x, req.topk_weights, req.topk_idx,
                                                 (plan.num_experts, plan.permute, plan.expert_alignment,
                                                  req.host_counts, req.rank_counts, req.check_ids, req.on_overflow))
                    self._routing_plan = _plan_with(plan, None, None, None, None)
            else:  # Buffer's cached dispatch
                handle = req.handle
                handle.dispatch_replay = Replay(call.sig, self._replay_dispatch, req.x, req.topk_weights)
        return out

    def _replay_routing(self, call: protocol.Call, x, topk_idx, topk_weights, async_op: bool, previous_event,
                        host_counts: bool) -> DispatchOutput:
        """A new routing replayed (megatron_ep/core/replay.py): the plan of the last new routing, whose
        shape and options these are (the replay matched them), with this call's tensors, and what
        depends on the region decided again; then the same crossings."""
        data, scales = (x[0], x[1]) if type(x) is tuple else (x, None)
        plan = _plan_with(self._routing_plan, data, scales, topk_idx, topk_weights)
        plan.push = _pushes(self.rt.region, plan.permute, 0)
        call.set_variant(int(plan.push))
        return self._planned(call, plan, previous_event, async_op, None, host_counts)

    def _planned(self, call: protocol.Call, plan: "DispatchPlan", previous_event: Optional[EventOverlap], async_op: bool,
                 handle: Optional[DispatchHandle], host_counts: bool) -> DispatchOutput:
        """dispatch after its plan (and the request's arguments the plan does not hold): the
        crossings and the caller's DispatchOutput."""
        rt = self.rt
        region, budget = rt.region, rt.budget
        previous = _event(previous_event)
        comb_rows = 0
        event = torch.cuda.Event() if async_op else None  # (a synchronous call joins through the runtime's own)
        # benchmarks' phase marks, in the order they are recorded: notify's first
        notify_marks = rt.marks(("start", "notify"), first=True) if plan.first else None
        # (a cached dispatch's fused entry pushes; a new routing's moves the rows as ours does)
        fused_push = plan.fused is not None and not plan.first
        marks = _move_marks(rt, plan.push or fused_push, plan.permute)
        if plan.first and not plan.num_worst_tokens:
            zero_copy, scratch = self._placement(plan.data, plan.push, plan.permute)
            # the region fits the call's needs but its counts (a plan remembered per need), so the
            # extension needs to compare only the counts notify learns; a replayed routing carries
            # the need that fitted before (the region only grows)
            need = plan.need
            fits = need is self._fitted_need or rt.region.fits(dict(need, max_tokens=0, combine_rows=0)) is None
            if fits:
                self._fitted_need = need
            tag = next(self.tags)
            x, token_groups, previous_event, wait_s = plan.data, plan.groups, previous, rt.ledger.host_wait_s
            hook = hooks.current()
            num_blocks, push_blocks, local_blocks = budget.normal  # blocks("copy"), ("push"), ("local")
            # the internode path's composed entry takes the same arguments first (one crossing)
            dispatch_first_call = self.kernels.dispatch_first_call if plan.fused is None else plan.fused
            try:
                # (by position, each argument named as its parameter: tests/unit/test_kernel_boundary.py)
                status, notified, res = call.sends(
                    dispatch_first_call, region.runtime, call.sig, plan.topk_idx, plan.num_experts,
                    plan.expert_alignment, plan.permute, token_groups, plan.check_ids, plan.rank_counts, tag,
                    previous_event, notify_marks, wait_s, fits, x, plan.scales, plan.topk_weights, plan.push, scratch,
                    zero_copy, event, async_op, hook, marks, num_blocks, push_blocks, local_blocks, plan.want_src)
            except BaseException:
                if region.runtime.notified_tag() == tag:  # raised past notify: the peers wait at the rows' first handshake
                    call.owe(protocol.Pending.OUT_LOC if plan.push else protocol.Pending.STAGED)
                raise
            # (status 0: the rows moved in the same crossing, so nothing is owed after it)
            st, comb_rows = self._notified(call, plan, notified, grow=status == 1, owed=status != 0)
            if status == 0:
                return self._dispatched(call, plan, handle, host_counts, st, res, event,
                                        _out_rows(st, plan.num_worst_tokens))
            previous = None  # the streams are ordered: the call was entered
        elif plan.first:
            st, comb_rows = self._notify(call, plan, previous, notify_marks, async_op)
            previous = None  # the streams are ordered: notify_call entered the call
        else:
            st = handle.state
        out_rows = _out_rows(st, plan.num_worst_tokens)
        res = self._send_rows(call, st, plan.num_experts, plan.first, plan.data, plan.scales, plan.topk_weights,
                              plan.push, out_rows, plan.num_worst_tokens, comb_rows, previous, event, async_op,
                              plan.fused if fused_push else None, marks, plan.want_src)
        return self._dispatched(call, plan, handle, host_counts, st, res, event, out_rows)

    def _send_rows(self, call: protocol.Call, st: IntranodeState, num_experts: int, first: bool, x, scales, topk_weights,
                   push: bool, out_rows: int, num_worst_tokens: int, comb_rows: int, previous_event, event,
                   async_op: bool, fused, marks, want_src: bool) -> tuple:
        """The rows moved along `st` (calls.h dispatch_call, one crossing: the outputs, push [+
        fan-out] or stage + pull, the counts, the event), placed for the region as it is now."""
        rt = self.rt
        region = rt.region
        zero_copy, scratch = self._placement(x, push, st.permute)
        state, hook = native_state(self.kernels, st, num_experts), hooks.current()
        num_blocks, push_blocks, local_blocks = rt.budget.normal  # blocks("copy"), ("push"), ("local")
        # the internode path's composed entry takes the same arguments first (one crossing)
        dispatch_call = self.kernels.dispatch_call if fused is None else fused
        # (by position, each argument named as its parameter: tests/unit/test_kernel_boundary.py)
        return call.sends(dispatch_call, region.runtime, state, call.sig, first, x, scales, topk_weights, push, scratch,
                          zero_copy, out_rows, num_worst_tokens, comb_rows, previous_event, event, async_op, hook, marks,
                          num_blocks, push_blocks, local_blocks, want_src)

    def _replay_dispatch(self, call: protocol.Call, handle: DispatchHandle, x, topk_weights, async_op: bool,
                         previous_event) -> DispatchOutput:
        """A cached dispatch replayed (megatron_ep/core/replay.py): what dispatch decides for a cached call
        of the shape that passed its checks along `handle`, then the same crossing."""
        st: IntranodeState = handle.state
        data, scales = (x[0], x[1]) if type(x) is tuple else (x, None)
        push = _pushes(self.rt.region, st.permute, handle.num_worst_tokens)
        call.set_variant(int(push))
        event = torch.cuda.Event() if async_op else None
        marks = _move_marks(self.rt, push, st.permute)
        out_rows = _out_rows(st, handle.num_worst_tokens)
        res = self._send_rows(call, st, handle.num_experts, False, data, scales, topk_weights, push, out_rows,
                              handle.num_worst_tokens, 0, _event(previous_event), event, async_op, None, marks, False)
        out, _ = self._output(st, res, scales is not None, event)
        out.handle = handle
        return out

    def _placement(self, data: torch.Tensor, push: bool, permute: bool) -> tuple:
        """(zero_copy: the rows already lie in this region's staging, scratch: the expert-major push
        may use the combine area as its rank-major buffer), for the region as it is now."""
        region = self.rt.region
        return region.holds(data, region.plan.stage_x), push and permute and region.scratch_free()

    @staticmethod
    def _output(st: IntranodeState, res: tuple, fp8: bool, event) -> tuple:
        """The caller's DispatchOutput (without its handle) and the rows' source tokens (or None)
        from what dispatch_call (or the second half of dispatch_first_call) returned; the handle's
        counts follow the call's."""
        (x, scales, topk_idx, weights, row_expert, tpe, dropped, st.device_counts, st.tokens_per_expert, st.num_dropped,
         st.comb_map, src) = res
        return DispatchOutput((x, scales) if fp8 else x, topk_idx, weights, row_expert, tpe, None,
                              event=EventOverlap(event) if event is not None else None, num_dropped=dropped), src

    def _dispatched(self, call: protocol.Call, plan: "DispatchPlan", handle: Optional[DispatchHandle], host_counts: bool,
                    st: IntranodeState, res: tuple, event, out_rows: int) -> DispatchOutput:
        """The caller's DispatchOutput from what dispatch_call (or the second half of
        dispatch_first_call) returned."""
        out, src = self._output(st, res, plan.scales is not None, event)
        return self._result(call, plan, handle, host_counts, st, out, out_rows, src)

    def _plan(self, call: protocol.Call, req: DispatchRequest) -> "DispatchPlan":
        """The cuda checks of the inputs, the first call's sizing, whether the call fits as the
        region is, and push or stage: everything decided before a kernel runs."""
        rt = self.rt
        region = rt.region
        num_experts, handle, num_worst_tokens = req.num_experts, req.handle, req.num_worst_tokens
        data, scales, T, H, elem, row_bytes = dispatch_rows(rt, req.x, req.topk_weights, num_experts)
        groups = req.token_groups
        if groups != 1:  # (one group, every Buffer call's, passes these: dispatch_rows bounds num_experts)
            if not (1 <= groups <= protocol.MAX_TOKEN_GROUPS):
                raise ValueError(f"token_groups={groups} outside 1..{protocol.MAX_TOKEN_GROUPS}")
            if T % groups != 0:
                raise ValueError(f"{T} tokens are not {groups} equal token groups")
            if groups * num_experts > protocol.MAX_EXPERTS:
                raise ValueError(f"{groups} token groups of {num_experts} experts exceed the "
                                 f"notify counts' {protocol.MAX_EXPERTS}")
        if handle is None:
            K = req.topk_idx.shape[1]
            if K > protocol.MAX_TOPK:
                raise ValueError(f"topk_idx has K={K}; the cuda backend takes at most {protocol.MAX_TOPK}")
            topk_idx = req.topk_idx  # the handle keeps its own copy, made by notify_call
        else:
            K, topk_idx = handle.topk, handle.topk_idx
        # rows this wide fitted along this routing before (the region only grows): nothing to size
        fitted = handle is not None and handle.state.fitted == (H, elem) and region.ready
        need = None if fitted else dict(max_tokens=T, hidden=H, dtype_bytes=elem, combine_bytes=max(2, elem), max_topk=K,
                                        max_experts=num_experts, combine_rows=max(rt.num_ranks * T, num_worst_tokens))
        capturing = torch.cuda.is_current_stream_capturing()
        fail(not capturing or num_worst_tokens or handle is not None, "a dispatch captured in a CUDA graph needs "
             "num_worst_tokens= (or a handle): exact output sizes need a host sync, which capture forbids", RuntimeError)
        if not region.ready:
            fail(not capturing, "the first call of a cuda Buffer without sizing hints "
                 "cannot be captured in a CUDA graph (it allocates); run one call before capturing", RuntimeError)
            region.first_use_in(call, need)
        if fitted:
            pass
        elif num_worst_tokens or capturing or handle is not None:  # nothing can grow without the host sync: it must fit now
            short = region.fits({k: v for k, v in need.items() if k != "combine_rows" or num_worst_tokens})
            if short is not None:
                raise ValueError(f"dispatch does not fit the buffer ({short}) and a "
                                 f"{'cached' if handle is not None else 'worst-case sized'} dispatch cannot grow it (no host sync): create "
                                 f"the Buffer with max_tokens_per_rank=, hidden=, combine_rows= large enough, or run one ordinary dispatch first")
            if handle is not None:
                handle.state.fitted = (H, elem)
        # rows are pushed straight into pooled rank-major buffers when every rank has room: the
        # outputs themselves (rank-major), or what the fan-out spreads into expert segments
        push = not capturing and _pushes(region, req.permute, num_worst_tokens)
        fail(req.fused is None or handle is not None or not num_worst_tokens,
             "a fused intranode new routing crosses once with its host wait (not worst-case sized)", RuntimeError)
        # the ids' check rides on notify where the host waits for its sizes anyway; a sync-free
        # dispatch has no such wait, so it checks on the host (one sync) before any kernel
        check_on_device = req.check_ids != IDS_UNCHECKED and not num_worst_tokens and not capturing
        if req.check_ids == IDS_CHECKED and not check_on_device:
            check_topk_values(req.topk_idx, num_experts, req.previous_event)
        call.set_variant(int(push))
        # (positional, in DispatchPlan's field order: its 21 keywords cost 2 µs of host time per call)
        return DispatchPlan(data, scales, topk_idx, req.topk_weights, num_experts, req.permute, req.expert_alignment,
                            num_worst_tokens, groups, T, H, K, num_experts // rt.num_ranks, row_bytes,
                            scales.shape[1] if scales is not None else 0, need, handle is None, push, check_on_device,
                            req.rank_counts, req.fused, req.source_index and handle is None)

    def _notify(self, call: protocol.Call, plan: "DispatchPlan", previous, marks, async_op: bool) -> tuple:
        """A worst-case sized routing's counts, exchange and row positions (one crossing: calls.h
        notify_call, which also enters the call's streams), without a host wait. Returns what
        _notified does."""
        rt = self.rt
        token_groups, tag, previous_event, wait_s = plan.groups, next(self.tags), previous, -1.0
        notified = call.sends(
            self.kernels.notify_call, rt.region.runtime, call.sig, plan.topk_idx, plan.num_experts, plan.expert_alignment,
            plan.permute, plan.num_worst_tokens, token_groups, plan.check_ids, plan.rank_counts, tag, previous_event,
            marks, wait_s, async_op)
        return self._notified(call, plan, notified, grow=False, owed=True)

    def _notified(self, call: protocol.Call, plan: "DispatchPlan", notified: tuple, grow: bool, owed: bool) -> tuple:
        """The handle's state from notify's outputs (notify_call's tuple); unless sync-free, the
        sizes the host waited for, or the call's error, and -- `grow`: the rows are not moved yet --
        the region grown if any rank needs more. `owed` (the rows are not moved yet): after it the
        peers wait for this rank at the rows' first handshake (the push's output locations, or the
        staging). Returns the handle's state and the rows of its combine map (expert-major)."""
        rt = self.rt
        (idx, rank_pos, slot_pos, recv_info, row_limits, counts, tpe, dropped, rank_counts, rank_prefix, recv_rank_counts,
         recv_rank_prefix, waited, sizes, native) = notified
        plan.topk_idx = idx
        # (positional, in IntranodeState's field order: keywords cost host time per new routing)
        st = IntranodeState(rank_pos, slot_pos, recv_info, row_limits, tpe, dropped, None, None, None, None, rank_counts,
                            rank_prefix, recv_rank_counts, recv_rank_prefix, idx, counts, plan.permute, native)
        rows_bound = max_rank_major_rows(rt)  # the host learns N below unless sync-free
        if not plan.num_worst_tokens:
            try:
                info = rt.ledger.host_sizes(call, waited, sizes)
            except PeerFailedError:
                # ids notify found bad here (check_ids) failed this rank's record at the exchange, so
                # every rank aborted the call (the peers raise PeerFailedError): this rank says why
                bad = rt.region.runtime.host_counts(0)["bad_slot"] if plan.check_ids else -1
                if bad >= 0:
                    raise bad_slot_error(plan.topk_idx, bad, plan.num_experts) from None
                raise
            st.num_rows, st.num_perm_rows, st.counts = info["num_rows"], info["num_perm_rows"], info["counts"]
            if grow:
                rt.region.grow_if_needed(dict(plan.need, max_tokens=info["need_tokens"],
                                       combine_rows=info["need_perm_rows"] if plan.permute else info["need_rows"]))
            rows_bound = st.num_rows
        if owed:
            call.owe(protocol.Pending.OUT_LOC if plan.push else protocol.Pending.STAGED)
        return st, (rows_bound if plan.permute else 0)

    def _result(self, call: protocol.Call, plan: "DispatchPlan", handle: Optional[DispatchHandle], host_counts: bool,
                st: IntranodeState, res: DispatchOutput, out_rows: int, src=None) -> DispatchOutput:
        """res with its handle (a cached dispatch's, or a new routing's made here) and, where
        asked, the host counts."""
        tpe, event = res.tokens_per_expert, res.event
        if plan.first:
            one = plan.groups == 1
            # (positional, in DispatchHandle's field order -- backend, num_ranks, rank, num_experts,
            # num_tokens, topk, permute, expert_alignment, num_recv_rows, tokens_per_expert, topk_idx,
            # num_worst_tokens, state, buffer_id, call_seq, rank_counts, recv_rank_counts, rank_prefix,
            # recv_rank_prefix, recv_src_token, recv_slot_row: keywords cost 0.6 us of host time here;
            # tests/unit/test_replay.py checks every field)
            handle = DispatchHandle("cuda", self.rt.num_ranks, self.rt.rank, plan.num_experts, plan.T, plan.K, plan.permute,
                                    plan.expert_alignment, out_rows, st.tokens_per_expert, plan.topk_idx,
                                    plan.num_worst_tokens, st, 0, call.seq, st.rank_counts if one else None,
                                    st.recv_rank_counts, st.rank_prefix if one else None, st.recv_rank_prefix, src,
                                    st.comb_map if src is not None and plan.permute else None)
        res.handle = handle
        if host_counts:
            if st.counts is not None and not plan.num_worst_tokens:
                res.tokens_per_expert_host = (padded_host_counts(st.counts, plan.expert_alignment) if plan.permute
                                              else list(st.counts))
            else:
                if event is not None:
                    event.synchronize()  # an asynchronous call's counts are written on our stream
                res.tokens_per_expert_host = tpe.tolist()
        return res

    # ------------------------------------------------------------------------------- combine
    def combine(self, call: protocol.Call, req: CombineRequest) -> CombineOutput:
        """The checks and decisions here, then one crossing (calls.h combine_call): y on the
        caller's stream; on ours the staging and the pull-and-sum in one launch, or the
        expert-major pre-reduction and the partials' sum."""
        rt = self.rt
        region = rt.region
        x, handle, weights = req.x, req.handle, req.weights
        st: IntranodeState = handle.state
        rows, H, row_bytes = combine_rows(rt, x, weights)
        if row_bytes > region.plan.comb_row_bytes:
            raise ValueError(f"combine: rows of {row_bytes} bytes exceed the {region.plan.comb_row_bytes} "
                             f"bytes the buffer holds (combine rows wider than any dispatch so far: create the Buffer with hidden= and "
                             f"combine_bytes={x.element_size()})")
        if rows > region.plan.comb_rows:
            raise ValueError(f"combine input has {rows} rows; the buffer's combine area holds {region.plan.comb_rows} "
                             f"(Buffer(combine_rows=...))")
        T = handle.num_tokens
        y = w_out = None
        if req.out is not None:
            y, w_out = req.out
            fail(tuple(y.shape) == (T, H) and y.dtype == x.dtype and (w_out is None) == (weights is None),
                 "combine: the given outputs do not match the call", RuntimeError)
        bias0, bias1 = req.bias
        single = handle.permute and req.single_reduction
        out = self._combined(call, handle, x, weights, bias0, bias1, y, w_out, _event(req.previous_event), req.async_op,
                             req.fused, single)
        if req.out is None and req.fused is None and bias0 is None and not single:  # Buffer's combine, without a bias
            handle.combine_replay = Replay(call.sig, self._replay_combine, x, weights)
        return out

    def _replay_combine(self, call: protocol.Call, handle: DispatchHandle, x, weights, async_op: bool,
                        previous_event) -> CombineOutput:
        """A combine replayed (megatron_ep/core/replay.py): the crossing of a combine of the shape that
        passed its checks along `handle`."""
        return self._combined(call, handle, x, weights, None, None, None, None, _event(previous_event), async_op, None,
                              False)

    def _combined(self, call: protocol.Call, handle: DispatchHandle, x: torch.Tensor, weights, bias0, bias1, out, out_weights,
                  previous_event, async_op: bool, fused, single: bool) -> CombineOutput:
        """What a combine decides for the region as it is now, then its crossing."""
        rt = self.rt
        region = rt.region
        st: IntranodeState = handle.state
        zero_copy = region.holds(x, region.plan.comb_x)
        # expert-major: sum each token's rows per rank locally first, so one row per (token, rank),
        # rounded to x's dtype, crosses the link instead of one per (token, expert) (the staged
        # kernel rounds each rank's sum alike: the two give the same bits). Needs the dispatch's
        # map and room for every rank's partials (the group-wide bound, so the ranks agree) where
        # the input is not; a rank whose input lies there (zero copy) takes the staged kernel,
        # and the signature's variant turns that disagreement into CallMismatchError.
        # single_reduction: the staged kernel, every slot's row a term of its own
        partials = (handle.permute and not single and st.comb_map is not None and not zero_copy
                    and max_rank_major_rows(rt) * x.shape[1] * x.element_size()
                    <= region.plan.comb_rows * region.plan.comb_row_bytes)
        variant = protocol.COMBINE_SINGLE if single else protocol.COMBINE_PARTIALS if partials else protocol.COMBINE_STAGED
        call.set_variant(variant)
        event = torch.cuda.Event() if async_op else None  # (a synchronous call joins through the runtime's own)
        # (the staging runs in the pull's launch: its time is the pull's; the pre-reduction has its own)
        marks = rt.marks(("start", "reduce" if partials and fused is None else None, "pull"), first=True)
        state, hook = native_state(self.kernels, st, handle.num_experts), hooks.current()
        num_blocks, _, local_blocks = rt.budget.normal  # blocks("copy"), blocks("local")
        # the internode path's composed entry takes the same arguments first (one crossing)
        combine_call = self.kernels.combine_call if fused is None else fused
        # (by position, each argument named as its parameter: tests/unit/test_kernel_boundary.py)
        y, w_out = call.sends(combine_call, region.runtime, state, call.sig, x, weights, bias0, bias1, variant, zero_copy,
                              out, out_weights, previous_event, event, async_op, hook, marks, num_blocks, local_blocks)
        return CombineOutput(y, w_out, EventOverlap(event) if event is not None else None)


def _out_rows(st: IntranodeState, num_worst_tokens: int) -> int:
    """A dispatch's output rows along `st`: num_worst_tokens, or the rows notify counted."""
    return num_worst_tokens or (st.num_perm_rows if st.permute else st.num_rows)


def _move_marks(rt: CudaRuntime, push: bool, permute: bool):
    """Benchmarks' marks of a dispatch's move: push [+ fan-out], or stage + pull."""
    return rt.marks(("push", "fanout" if permute else None) if push else ("stage", "pull"))


def _plan_with(t: DispatchPlan, data, scales, topk_idx, topk_weights) -> DispatchPlan:
    """Plan `t` with other tensors: a replayed new routing's (positional: a copy by field name costs
    more host time than the call it serves)."""
    return DispatchPlan(data, scales, topk_idx, topk_weights, t.num_experts, t.permute, t.expert_alignment,
                        t.num_worst_tokens, t.groups, t.T, t.H, t.K, t.L, t.row_bytes, t.scale_cols, t.need, t.first,
                        t.push, t.check_ids, t.rank_counts, t.fused, t.want_src)


def _pushes(region, permute: bool, num_worst_tokens: int) -> bool:
    """Rows are pushed straight into pooled rank-major buffers (outside a CUDA-graph capture) when
    every rank has room: the outputs themselves (rank-major), or what the fan-out spreads into
    expert segments; a worst-case sized rank-major dispatch is staged and pulled instead."""
    return (permute or not num_worst_tokens) and region.plan.pool_bytes > 0


def _event(ev: Optional[EventOverlap]):
    """The torch.cuda.Event an EventOverlap holds, or None."""
    return None if ev is None else ev.event


def native_state(kernels, st: IntranodeState, num_experts: int):
    """The handle's state as the one-crossing entries take it (calls.h HandleState), bound at the
    first call that needs it and kept: its counts follow the handle's."""
    if st.native is None:
        # (by position, in the binding's order: keywords cost host time; tests/unit/test_kernel_boundary.py)
        counts = st.device_counts
        st.native = kernels.HandleState(st.topk_idx, st.rank_pos, st.slot_pos, st.recv_info, st.row_limits, counts,
                                        st.comb_map, num_experts, st.permute)
    return st.native
