"""The `torch` backend: the whole API in plain PyTorch + torch.distributed.

It is the oracle for every kernel test and the default wherever no GPU is present, so it is
written for clarity: each step is one vectorised tensor operation, rows travel as packed bytes
through `all_to_all_single` (so dispatch is bit-exact for every dtype, gloo or NCCL), and the
row orders are exactly docs/design.md §2:

* rank-major: rows grouped by source rank, then source token index;
* expert-major: rows grouped by local expert, then source rank, then source token index, each
  expert's segment padded with zero rows to `expert_alignment`;
* low-latency: per local expert, rows grouped by source rank, then source token index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..core import logfmt
from ..core import permute as placement
from ..core import protocol
from ..core.checks import check_topk_values, is_fp8_tuple
from ..core.fp8 import column_major, pack_ue8m0, per_token_cast_to_fp8
from ..core.output_hook import new_outputs
from ..core.requests import CombineRequest, DispatchRequest
from ..core.types import (
    CombineOutput,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    EventOverlap,
    LowLatencyDispatchOutput,
    LowLatencyHandle,
)


# --------------------------------------------------------------------------------------------
# Packing rows of several tensors into one byte matrix, so one collective moves them all.
# --------------------------------------------------------------------------------------------
def _per_row(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    width = _per_row(t.shape[1:]) * t.element_size()
    return t.contiguous().view(-1).view(torch.uint8).view(t.shape[0], width)


def pack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_row_bytes(p) for p in parts], dim=1)


def unpack_rows(rows: torch.Tensor, like: Sequence[Tuple[torch.dtype, Tuple[int, ...]]]) -> List[torch.Tensor]:
    """Inverse of pack_rows: `like` gives (dtype, per-row shape) of each part."""
    out, col, n = [], 0, rows.shape[0]
    for dtype, shape in like:
        width = _per_row(shape) * dtype.itemsize
        chunk = rows[:, col:col + width].clone(memory_format=torch.contiguous_format)  # aligned for any dtype
        out.append(chunk.view(dtype).reshape((n,) + tuple(shape)))
        col += width
    return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _NormalState:
    send_tok: torch.Tensor  # [S] source token of each sent row, rows grouped by destination rank
    send_slot_local: torch.Tensor  # [S, K] bool: slot k of sent row i is an expert on its destination
    send_counts: List[int]  # [R] rows sent to each rank
    recv_counts: List[int]  # [R] rows received from each rank
    recv_topk_idx: torch.Tensor  # [N, K] local expert ids, -1 elsewhere
    # expert-major only: the (received row, slot) pair behind each valid output row
    perm_rows: Optional[torch.Tensor] = None
    perm_slots: Optional[torch.Tensor] = None
    perm_pos: Optional[torch.Tensor] = None
    row_expert: Optional[torch.Tensor] = None  # [M] int32
    padded: Optional[torch.Tensor] = None  # [L] segment lengths
    # num_worst_tokens: output rows past it were not delivered (rank-major: received rows past
    # it; expert-major: (row, slot) pairs whose position is past it)
    kept: Optional[torch.Tensor] = None  # [N] bool (rank-major) or [#pairs] bool (expert-major)


@dataclass
class _LowLatencyState:
    send_tok: torch.Tensor  # [P] token of each sent copy, ordered by global expert then token
    send_slot: torch.Tensor  # [P] its topk slot
    send_counts: List[int]
    recv_counts: List[int]
    recv_expert: torch.Tensor  # [Q] local expert of each received copy, in arrival order
    recv_pos: torch.Tensor  # [Q] its row inside that expert's receive area


class TorchBackend:
    name = "torch"
    num_sms = None

    def set_num_sms(self, num_sms: Optional[int]) -> None:
        """No kernels here: a budget set for the cuda backend is accepted and has no effect."""

    def __init__(self, group, num_ranks: int, rank: int):
        self.group, self.num_ranks, self.rank = group, num_ranks, rank
        nccl = num_ranks > 1 and dist.get_backend(group) == "nccl"
        self.ctl_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def describe(self) -> str:
        return "torch reference (torch.distributed collectives)"

    def destroy(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def reserve(self, need: dict) -> None:
        pass  # collectives size themselves

    def begin(self, call: protocol.Call) -> None:
        pass  # nothing reported between calls: every collective raises where it fails

    def failed(self, call: protocol.Call, exc: BaseException) -> None:
        """A failure on this rank before the call's first collective, or between it and the data
        collective (an allocation, say), is published at the collective the peers wait in next,
        so they raise it instead of waiting for one this rank never joins."""
        if call.pending is protocol.Pending.FIRST:
            self._exchange(call, failure=exc)
        elif call.pending is protocol.Pending.COMMIT:
            self._commit(call, failure=exc)

    def dispatch_input(self, num_tokens: int, hidden: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        return torch.empty((num_tokens, hidden), dtype=dtype, device=device)

    def combine_input(self, num_rows: int, hidden: int, dtype: torch.dtype = torch.bfloat16, device=None) -> torch.Tensor:
        return torch.empty((num_rows, hidden), dtype=dtype, device=device)

    # ---------------------------------------------------------------------------- collectives
    def _exchange(self, call: protocol.Call, counts: Optional[torch.Tensor] = None, failure: Optional[BaseException] = None,
                  limit: int = 0):
        """The first collective of every call: each rank's status, signature, (dispatch) row
        counts per destination and the most rows it takes (`limit`: a rank-major dispatch's
        num_worst_tokens with on_overflow="raise", else 0), gathered everywhere (one fixed-size
        vector, whatever the op, so ranks in different calls still meet here). Raises on every
        rank alike on a mismatch, a failed rank, or a rank whose limit is below the rows sent
        to it; returns the [source, destination] counts."""
        R, F = self.num_ranks, len(protocol.SIG_FIELDS)
        call.settle()
        vec = torch.zeros(1 + F + R + 1, dtype=torch.int64)
        vec[1:1 + F] = torch.tensor(call.sig, dtype=torch.int64)
        if counts is not None:
            vec[1 + F:1 + F + R] = counts.to(torch.int64).cpu()
        vec[-1] = limit
        rows = self._gather_status(call, vec, failure)
        if rows is None:
            return None  # this rank failed: the caller re-raises its own error
        f = protocol.first_mismatch(rows[:, 1:1 + F].tolist())
        if f is not None:
            values = rows[:, 1 + f].tolist()
            # every rank sees every rank's signature here, so call numbers can be realigned: a
            # call on different Buffers counts on none of them; ranks at different calls of one
            # Buffer continue from the furthest
            resync = {"buffer": call.seq - 1, "seq": max(values)}.get(protocol.SIG_FIELDS[f])
            raise protocol.mismatch_error(call, f, values, rows[:, 1 + protocol.FIELD["op"]].tolist(), resync=resync)
        counts_all, limits = rows[:, 1 + F:1 + F + R], rows[:, -1]
        received = counts_all.sum(0)
        if bool(((limits > 0) & (received > limits)).any()):  # every rank sees the same rows: all raise alike
            raise protocol.worst_overflow_error(call, received.tolist(), limits.tolist())
        call.owe(protocol.Pending.COMMIT)  # until the data collective: a failure here is published by _commit
        return counts_all

    def _commit(self, call: protocol.Call, failure: Optional[BaseException] = None) -> None:
        """Right before a call's data collective: every rank says it is ready (its receive
        buffers allocated) or that it failed since the first exchange, so its peers raise
        PeerFailedError instead of waiting in the data collective."""
        call.settle()
        self._gather_status(call, torch.zeros(1, dtype=torch.int64), failure)

    def _gather_status(self, call: protocol.Call, vec: torch.Tensor, failure: Optional[BaseException]):
        """All-gather `vec` with this rank's status in its first element: every rank's vector, or
        None on a rank that failed itself; a peer's failure raises PeerFailedError naming it."""
        R = self.num_ranks
        vec[0] = protocol.CALL_FAILED if failure is not None else 0
        if R == 1:
            rows = vec.unsqueeze(0)
        else:
            parts = [torch.empty_like(vec, device=self.ctl_device) for _ in range(R)]
            dist.all_gather(parts, vec.to(self.ctl_device), group=self.group)
            rows = torch.stack(parts).cpu()
        if bool((rows[:, 0] != 0).any()):
            msgs: list = [None] * R
            mine = protocol.failure_message(failure) if failure is not None else None
            if R > 1:
                dist.all_gather_object(msgs, mine, group=self.group)
            if failure is not None:
                return None
            r = int((rows[:, 0] != 0).nonzero()[0, 0])
            raise protocol.peer_failed_error(call, r, msgs[r] or "(no message)")
        return rows

    def _exchange_rows(self, call: protocol.Call, rows: torch.Tensor, send_counts: List[int], recv_counts: List[int]) -> torch.Tensor:
        """The call's data collective: rows to every rank, after every rank confirmed it can
        take its share (_commit)."""
        if self.num_ranks == 1:
            self._commit(call)
            return rows
        out = rows.new_empty((sum(recv_counts), rows.shape[1]))
        new_outputs([out])
        self._commit(call)
        dist.all_to_all_single(out, rows, recv_counts, send_counts, group=self.group)
        return out

    # --------------------------------------------------------------------------------- layout
    def layout(self, topk_idx: torch.Tensor, num_experts: int, counts_dtype: torch.dtype = torch.int64) -> DispatchLayout:
        R, L = self.num_ranks, num_experts // self.num_ranks
        topk_idx = _valid_ids(topk_idx, num_experts)
        valid = topk_idx >= 0
        dst = torch.where(valid, topk_idx.div(L, rounding_mode="floor"), -1)
        token_in_rank = (dst.unsqueeze(-1) == torch.arange(R, device=topk_idx.device)).any(dim=1)
        return DispatchLayout(
            tokens_per_rank=token_in_rank.sum(dim=0).to(counts_dtype),
            tokens_per_expert=torch.bincount(topk_idx[valid], minlength=num_experts).to(counts_dtype),
            token_in_rank=token_in_rank,
        )

    # ------------------------------------------------------------------------------- dispatch
    def dispatch(self, call: protocol.Call, req: DispatchRequest) -> DispatchOutput:
        x, topk_idx, topk_weights, num_experts, permute, expert_alignment = (
            req.x, req.topk_idx, req.topk_weights, req.num_experts, req.permute, req.expert_alignment)
        handle, host_counts, num_worst_tokens = req.handle, req.host_counts, req.num_worst_tokens
        async_op, previous_event = req.async_op, req.previous_event
        R, L = self.num_ranks, num_experts // self.num_ranks
        is_fp8 = is_fp8_tuple(x)
        data, scales = (x[0], x[1]) if is_fp8 else (x, None)
        device = data.device
        _wait(previous_event)

        if handle is None:
            if req.check_ids:
                check_topk_values(topk_idx, num_experts)
            K = topk_idx.shape[1]
            topk_idx = _valid_ids(topk_idx, num_experts)
            lay = self.layout(topk_idx, num_experts)
            valid = topk_idx >= 0
            dst = torch.where(valid, topk_idx.div(L, rounding_mode="floor"), -1)
            send_rank, send_tok = lay.token_in_rank.t().nonzero(as_tuple=True)  # by (rank, token)
            send_slot_local = dst[send_tok] == send_rank.unsqueeze(1)
            send_counts = lay.tokens_per_rank.tolist()
            limit = num_worst_tokens if req.on_overflow == "raise" and not permute else 0
            every = self._exchange(call, counts=lay.tokens_per_rank, limit=limit)
            recv_counts = every[:, self.rank].tolist()
            rank_counts = every.to(device=device, dtype=torch.int32)
            local_idx = torch.where(send_slot_local, topk_idx[send_tok] - send_rank.unsqueeze(1) * L, -1)
            meta = [local_idx.to(torch.int32), send_tok.to(torch.int32).unsqueeze(1)]  # (ids, source token)
        else:
            self._exchange(call)
            st: _NormalState = handle.state
            K = handle.topk
            send_tok, send_slot_local = st.send_tok, st.send_slot_local
            send_counts, recv_counts = st.send_counts, st.recv_counts
            meta = []

        parts = [data[send_tok]] + ([scales[send_tok]] if is_fp8 else []) + meta
        if topk_weights is not None:
            parts.append(torch.where(send_slot_local, topk_weights[send_tok], 0))
        like = [(data.dtype, tuple(data.shape[1:]))] + ([(torch.float32, tuple(scales.shape[1:]))] if is_fp8 else [])
        like += [(torch.int32, (K,)), (torch.int32, (1,))] if meta else []
        like += [(topk_weights.dtype, (K,))] if topk_weights is not None else []
        recv = unpack_rows(self._exchange_rows(call, pack_rows(parts), send_counts, recv_counts), like)
        recv_x = recv.pop(0)
        recv_scales = recv.pop(0) if is_fp8 else None
        recv_topk_idx = recv.pop(0).to(torch.int64) if handle is None else handle.state.recv_topk_idx
        recv_src_token = recv.pop(0)[:, 0].contiguous() if handle is None else None
        recv_w = recv.pop(0) if topk_weights is not None else None

        if handle is None:
            state = _NormalState(send_tok, send_slot_local, send_counts, recv_counts, recv_topk_idx)
            if permute:
                self._plan_permute(state, L, expert_alignment, device)
            if num_worst_tokens:
                N = recv_topk_idx.shape[0]
                state.kept = (state.perm_pos < num_worst_tokens) if permute else (torch.arange(N, device=device) < num_worst_tokens)
        else:
            state = handle.state
        W = num_worst_tokens

        if not permute:
            N = recv_x.shape[0]
            rows_kept = recv_topk_idx if not W else recv_topk_idx[:W]
            tpe = torch.bincount(rows_kept[rows_kept >= 0], minlength=L) if handle is None else handle.tokens_per_expert
            out = DispatchOutput((recv_x, recv_scales) if is_fp8 else recv_x, recv_topk_idx, recv_w, None, tpe, None)
            num_rows, dropped = N, max(0, N - W) if W else 0
        else:
            M = state.row_expert.shape[0]
            pos, rows = state.perm_pos, state.perm_rows
            perm_x = recv_x.new_zeros((M,) + tuple(recv_x.shape[1:]))
            perm_x[pos] = recv_x[rows]
            if is_fp8:
                perm_s = recv_scales.new_zeros((M,) + tuple(recv_scales.shape[1:]))
                perm_s[pos] = recv_scales[rows]
                perm_x = (perm_x, perm_s)
            perm_w = None
            if recv_w is not None:
                perm_w = recv_w.new_zeros(M)
                perm_w[pos] = recv_w[rows, state.perm_slots]
            if handle is None:
                tpe = placement.clamp_segments(state.padded, W) if W else state.padded
            else:
                tpe = handle.tokens_per_expert
            out = DispatchOutput(perm_x, None, perm_w, state.row_expert, tpe, None)
            num_rows, dropped = M, int((~state.kept).sum()) if W else 0

        if W:
            num_rows = self._fit_to_worst(out, num_rows, W, is_fp8, permute)
        out.num_dropped = torch.tensor(dropped, dtype=torch.int64, device=device)
        if handle is None:
            handle = DispatchHandle(
                backend=self.name, num_ranks=R, rank=self.rank, num_experts=num_experts,
                num_tokens=data.shape[0], topk=K, permute=permute, expert_alignment=expert_alignment,
                num_recv_rows=num_rows, tokens_per_expert=out.tokens_per_expert, topk_idx=topk_idx,
                num_worst_tokens=num_worst_tokens, state=state, call_seq=call.seq, rank_counts=rank_counts,
                recv_rank_counts=rank_counts[:, self.rank], rank_prefix=(prefix := rank_counts.cumsum(0, dtype=torch.int32)),
                recv_rank_prefix=prefix[:, self.rank], recv_src_token=recv_src_token,
                recv_slot_row=self._slot_rows(state, recv_topk_idx.shape, device) if permute else None,
            )
        out.handle = handle
        # the outputs are the caller's: what the handle keeps (the routing's ids, counts and row
        # experts, which a cached dispatch returns again) goes out as copies
        out.tokens_per_expert = out.tokens_per_expert.clone()
        out.topk_idx = None if out.topk_idx is None else out.topk_idx.clone()
        out.row_expert = None if out.row_expert is None else out.row_expert.clone()
        if host_counts:
            out.tokens_per_expert_host = out.tokens_per_expert.tolist()
        if async_op:
            out.event = EventOverlap(None)
        return out

    @staticmethod
    def _slot_rows(state: "_NormalState", shape, device) -> torch.Tensor:
        """[N, K] int32: each (rank-major row, slot)'s expert-major output row, -1 where none
        (a slot elsewhere, or dropped past num_worst_tokens)."""
        rows = torch.full(tuple(shape), -1, dtype=torch.int32, device=device)
        keep = state.kept if state.kept is not None else torch.ones_like(state.perm_pos, dtype=torch.bool)
        rows[state.perm_rows[keep], state.perm_slots[keep]] = state.perm_pos[keep].to(torch.int32)
        return rows

    @staticmethod
    def _fit_to_worst(out: DispatchOutput, num_rows: int, worst: int, is_fp8: bool, permute: bool) -> int:
        """Worst-case sized outputs (as the graph-capturable cuda path returns them): the rows
        that fit, then zero rows (-1 ids, 0 weights) up to `worst`; rows past it are dropped."""

        def fit(t, value=0):
            if t is None:
                return None
            if t.shape[0] >= worst:
                return t[:worst].contiguous()
            extra = t.new_full((worst - t.shape[0],) + tuple(t.shape[1:]), value)
            return torch.cat([t, extra])

        out.x = (fit(out.x[0]), fit(out.x[1])) if is_fp8 else fit(out.x)
        out.topk_weights = fit(out.topk_weights)
        if permute:
            out.row_expert = fit(out.row_expert, -1)
        else:
            out.topk_idx = fit(out.topk_idx, -1)
        return worst

    @staticmethod
    def _plan_permute(state: _NormalState, L: int, alignment: int, device) -> None:
        """Expert-major placement (megatron_ep.core.permute: one owner of the rule)."""
        pl = placement.place(state.recv_topk_idx, L, alignment)
        state.perm_rows, state.perm_slots, state.perm_pos = pl.rows, pl.slots, pl.pos
        state.row_expert = placement.row_experts(pl, state.recv_topk_idx)
        state.padded = pl.padded

    # -------------------------------------------------------------------------------- combine
    def combine(self, call: protocol.Call, req: CombineRequest) -> CombineOutput:
        """The kernels' order (docs/design.md, "Combine"), one operation per term so every
        backend gives the same bits: y[t] starts at the biases (b0, then + b1, in the
        accumulation dtype); each rank the token went to adds one row, ranks in the order of
        their last top-k slot of t; expert-major, that row is the rank's expert rows summed in
        slot order and rounded to x's dtype. One rounding at the end. `single_reduction`
        (expert-major): every slot's row is a term of its own, added in slot order."""
        x, handle, weights, async_op, previous_event = req.x, req.handle, req.weights, req.async_op, req.previous_event
        st: _NormalState = handle.state
        _wait(previous_event)
        single = handle.permute and req.single_reduction
        call.set_variant(protocol.COMBINE_SINGLE if single else protocol.COMBINE_STAGED)
        self._exchange(call)
        acc = _acc_dtype(x.dtype)
        K = handle.topk
        N = st.recv_topk_idx.shape[0]
        if handle.permute:
            # each received row's expert rows, slot by slot (a row holds one expert per slot);
            # rows that were not delivered (past num_worst_tokens) contribute nothing
            rows, slots, pos = st.perm_rows, st.perm_slots, st.perm_pos
            if st.kept is not None:
                rows, slots, pos = rows[st.kept], slots[st.kept], pos[st.kept]
            if single:
                # every slot's row crosses on its own ([N, K, H], zeros where the slot has no row:
                # adding +0 to a sum that started at +0 leaves its bits as they are)
                rows_x = x.new_zeros((N, K) + tuple(x.shape[1:]))
                rows_x[rows, slots] = x[pos]
            else:  # summed per received row (one add per element and slot)
                part = x.new_zeros((N,) + tuple(x.shape[1:]), dtype=acc)
                for k in range(K):
                    sel = slots == k
                    part.index_add_(0, rows[sel], x[pos[sel]].to(acc))
                rows_x = part.to(x.dtype)  # the rank's term, rounded as it crosses the link
            rows_w = None
            if weights is not None:
                rows_w = weights.new_zeros((N, K))
                rows_w[rows, slots] = weights[pos]
        else:
            n = min(N, x.shape[0])  # rows past N are padding; rows past num_worst_tokens were dropped
            rows_x = x.new_zeros((N,) + tuple(x.shape[1:]), dtype=x.dtype)
            rows_x[:n] = x[:n]
            rows_w = None
            if weights is not None:
                rows_w = weights.new_zeros((N, K))
                rows_w[:n] = weights[:n]
        parts = [rows_x] + ([rows_w] if rows_w is not None else [])
        like = [(rows_x.dtype, tuple(rows_x.shape[1:]))] + ([(rows_w.dtype, (K,))] if rows_w is not None else [])
        back = unpack_rows(self._exchange_rows(call, pack_rows(parts), st.recv_counts, st.send_counts), like)
        T = handle.num_tokens
        y = back[0].new_zeros((T,) + tuple(x.shape[1:]), dtype=acc)
        for b in req.bias:
            if b is not None:
                y += b.to(acc)
        if single:  # every slot's row in slot order (DeepEP V2's allow_multiple_reduction=False)
            for k in range(K):
                sel = st.send_slot_local[:, k]
                y.index_add_(0, st.send_tok[sel], back[0][sel, k].to(acc))
        else:  # sent row i is added at its destination's last slot of its token: one row per token and slot
            last = K - 1 - st.send_slot_local.flip(1).to(torch.int8).argmax(1)
            for k in range(K):
                sel = last == k
                y.index_add_(0, st.send_tok[sel], back[0][sel].to(acc))
        w_out = None
        if weights is not None:
            w_out = back[1].new_zeros((T, K))
            i, k = st.send_slot_local.nonzero(as_tuple=True)
            w_out[st.send_tok[i], k] = back[1][i, k]
        return CombineOutput(y.to(x.dtype), w_out, EventOverlap(None) if async_op else None)

    # ---------------------------------------------------------------------------- low latency
    def low_latency_dispatch(self, call: protocol.Call, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                             max_tokens_per_rank: int, use_fp8: bool, round_scale: bool,
                             topk_weights: Optional[torch.Tensor] = None, use_ue8m0: bool = False,
                             recv_stats: Optional[torch.Tensor] = None,
                             wait_stats: Optional[torch.Tensor] = None) -> LowLatencyDispatchOutput:
        # wait_stats: this backend exchanges with collectives and measures no per-rank waits
        # topk_weights: accepted for the API; the reference combine always weights at the source
        R, L = self.num_ranks, num_experts // self.num_ranks
        T, K = topk_idx.shape
        H = x.shape[1]
        device = x.device
        topk_idx = _valid_ids(topk_idx, num_experts)
        tok, slot = (topk_idx >= 0).nonzero(as_tuple=True)
        expert = topk_idx[tok, slot]
        order = torch.argsort(expert * max(T, 1) + tok)  # by (global expert, token): unique keys
        tok, slot, expert = tok[order], slot[order], expert[order]
        dst = expert.div(L, rounding_mode="floor")
        send_counts_t = torch.bincount(dst, minlength=R)
        send_counts = send_counts_t.tolist()
        recv_counts = self._exchange(call, counts=send_counts_t)[:, self.rank].tolist()

        if use_fp8:
            q, s = per_token_cast_to_fp8(x, round_scale)
            payload = [q[tok], s[tok]]
            like = [(q.dtype, (H,)), (torch.float32, (H // 128,))]
        else:
            payload, like = [x[tok]], [(x.dtype, (H,))]
        payload += [(expert - dst * L).to(torch.int32), tok.to(torch.int32)]
        like += [(torch.int32, ()), (torch.int32, ())]
        recv = unpack_rows(self._exchange_rows(call, pack_rows(payload), send_counts, recv_counts), like)
        le, src_tok = recv[-2].to(torch.int64), recv[-1]
        src_rank = torch.repeat_interleave(torch.arange(R, device=device), torch.tensor(recv_counts, device=device))

        # arrival order is (source, expert, token); stable sort by expert gives (expert, source, token)
        order2 = torch.argsort(le, stable=True)
        le_s = le[order2]
        per = torch.bincount(le * R + src_rank, minlength=L * R).view(L, R)
        count = per.sum(dim=1)
        begin = torch.cumsum(per, dim=1) - per
        pos_s = torch.arange(le_s.numel(), device=device) - (torch.cumsum(count, 0) - count)[le_s]
        pos = torch.empty_like(pos_s)
        pos[order2] = pos_s

        cap = R * max_tokens_per_rank
        outs = []
        for part in recv[:-2]:
            buf = part.new_zeros((L, cap) + tuple(part.shape[1:]))
            buf[le, pos] = part
            outs.append(buf)
        src_token = torch.full((L, cap), -1, dtype=torch.int32, device=device)
        src_token[le, pos] = src_tok
        handle = LowLatencyHandle(
            backend=self.name, num_ranks=R, rank=self.rank, num_experts=num_experts, num_tokens=T,
            topk=K, max_tokens_per_rank=max_tokens_per_rank, hidden=H,
            layout_range=torch.stack([begin, per], dim=-1).to(torch.int32), src_token=src_token,
            state=_LowLatencyState(tok, slot, send_counts, recv_counts, le, pos), call_seq=call.seq,
        )
        out_x = outs[0]
        if use_fp8:
            out_x = (outs[0], column_major(pack_ue8m0(outs[1])) if use_ue8m0 else outs[1])
        if recv_stats is not None:
            recv_stats += count.to(torch.int32)
        return LowLatencyDispatchOutput(out_x, count.to(torch.int32), handle, None, None)

    def low_latency_combine(self, call: protocol.Call, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, wait_stats: Optional[torch.Tensor] = None,
                            use_logfmt: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        st: _LowLatencyState = handle.state  # (wait_stats: no per-rank waits measured here)
        self._exchange(call)
        rows = x[st.recv_expert, st.recv_pos]  # back in arrival order, i.e. each source's send order
        back = unpack_rows(self._exchange_rows(call, pack_rows([rows]), st.recv_counts, st.send_counts), [(x.dtype, (x.shape[-1],))])[0]
        # LogFMT: each row as the receiver decodes it (the bf16 rows travel here, their decoding is the same)
        back = logfmt.roundtrip(back) if use_logfmt else back.float()
        w = topk_weights[st.send_tok, st.send_slot].float().unsqueeze(1)
        y = torch.zeros((handle.num_tokens, x.shape[-1]), dtype=torch.float32, device=x.device)
        y.index_add_(0, st.send_tok, back * w)
        return y.to(x.dtype) if out is None else out.copy_(y)


def _valid_ids(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Ids outside [0, num_experts) are unused slots (what the kernels do with unchecked ids)."""
    return torch.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx, torch.full_like(topk_idx, -1))


def _wait(previous_event: Optional[EventOverlap]) -> None:
    if previous_event is not None:
        previous_event.current_stream_wait()
