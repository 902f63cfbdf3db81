"""The `cuda` backend, intranode normal path: our kernels (csrc/kernels/{layout,intranode}.cu)
over a communication region shared by CUDA IPC.

A dispatch is notify (counts, exchange, exact row positions) -> stage (inputs into the region)
-> [host reads the receive count from mapped memory, unless outputs are worst-case sized] ->
pull (every rank copies its rows from its peers' regions straight into its outputs). A combine
is stage -> pull-and-sum. Kernels run on the buffer's communication stream; outputs are
allocated on the caller's stream and tied to the communication stream with record_stream.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from . import _ext
from .checks import fail, is_fp8_tuple
from .region import CONTROL_BYTES, MAX_RANKS, default_num_sms, plan_region
from .types import CombineOutput, DispatchHandle, DispatchLayout, DispatchOutput, EventOverlap

SLOT_NAMES = {0: "notify (count exchange)", 1: "dispatch staging", 2: "end of dispatch", 3: "combine staging", 4: "end of combine"}
DEFAULT_TIMEOUT_S = float(os.environ.get("MEP_TIMEOUT_S", "60"))
POISON = os.environ.get("MEP_POISON", "0") == "1"  # tests: fill outputs with garbage first


@dataclass
class _CudaState:
    rank_pos: torch.Tensor  # [T, R] int32: row of each token in each rank's rank-major output
    slot_pos: torch.Tensor  # [T, K] int32: row of each (token, slot) in its rank's expert-major output
    recv_info: torch.Tensor  # [3 + 3L] int32: N, M, L, counts, padded counts, segment starts
    num_rows: Optional[int]  # N, when known on the host
    num_perm_rows: Optional[int]  # M, when known on the host
    counts: Optional[List[int]]  # raw per-local-expert counts, when known on the host


def _poison(t: Optional[torch.Tensor]) -> None:
    if t is None:
        return
    if t.dtype == torch.float8_e4m3fn or t.dtype == torch.uint8:
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-777)


class CudaBackend:
    name = "cuda"

    def __init__(self, buf, *, max_tokens_per_rank: Optional[int], hidden: Optional[int], num_experts: Optional[int],
                 max_topk: Optional[int], num_sms: Optional[int], dtype_bytes: int = 2, combine_bytes: int = 2,
                 combine_rows: Optional[int] = None, pool_bytes: Optional[int] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.ext = _ext.load()
        fail(torch.cuda.is_available(), "backend='cuda' needs a CUDA device", RuntimeError)
        fail(max_tokens_per_rank is not None and hidden is not None,
             "backend='cuda' sizes its buffers from max_tokens_per_rank= and hidden=; pass both", TypeError)
        self.group, self.rank, self.num_ranks = buf.group, buf.rank, buf.num_ranks
        fail(self.num_ranks <= MAX_RANKS, f"the intranode cuda path supports up to {MAX_RANKS} ranks, got {self.num_ranks}")
        fail(self.ext.CONTROL_BYTES <= CONTROL_BYTES, "extension control block larger than planned", RuntimeError)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_experts = num_experts or self.ext.MAX_EXPERTS
        fail(self.max_experts <= self.ext.MAX_EXPERTS, f"num_experts={self.max_experts} exceeds the cuda backend's {self.ext.MAX_EXPERTS}")
        self.max_topk = max_topk or 8
        fail(1 <= self.max_topk <= self.ext.MAX_TOPK, f"max_topk must be in 1..{self.ext.MAX_TOPK}")
        self.plan = plan_region(self.num_ranks, max_tokens_per_rank, hidden, self.max_topk, self.max_experts,
                                  dtype_bytes, combine_bytes, combine_rows, pool_bytes)
        self.timeout_s = timeout_s

        # who shares my GPU: virtual ranks share one HBM and one set of SMs
        props = torch.cuda.get_device_properties(self.device)
        me = (socket.gethostname(), str(getattr(props, "uuid", self.device.index)))
        peers: list = [None] * self.num_ranks
        dist.all_gather_object(peers, me, group=self.group)
        self.ranks_per_device = sum(p == me for p in peers)
        self.sm_count = props.multi_processor_count
        self.num_sms = num_sms or default_num_sms(self.ranks_per_device, self.sm_count)
        fail(1 <= self.num_sms <= self.sm_count, f"num_sms={self.num_sms} outside 1..{self.sm_count}")

        self.rt = self.ext.Runtime(self.device.index, self.rank, self.num_ranks, self.plan.as_dict(), timeout_s)
        handles: list = [None] * self.num_ranks
        dist.all_gather_object(handles, bytes(self.rt.ipc_handle()), group=self.group)
        self.rt.open_peers(handles)
        dist.barrier(group=self.group)
        self.base = self.rt.base_ptr()
        self.stream = torch.cuda.Stream(device=self.device)
        self.tags = itertools.count(1)
        self.broken: Optional[str] = None
        self.trace: Optional[list] = None  # benchmarks: (phase, event) pairs on the comm stream

    # ------------------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        if self.rt is None:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # nobody reads my region any more
        self.rt.close()
        self.rt = None

    # ------------------------------------------------------------------------ zero-copy views
    def dispatch_input(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """A [T, H] tensor inside this rank's dispatch staging: dispatching it skips one copy.
        Valid until the next dispatch on this buffer."""
        nbytes = hidden * torch.empty((), dtype=dtype).element_size()
        fail(num_tokens <= self.plan.max_tokens and nbytes <= self.plan.x_row_bytes, "dispatch_input larger than the buffer")
        return self.rt.view(self.plan.stage_x, [num_tokens, hidden], dtype)

    def combine_input(self, num_rows: int, hidden: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A [rows, H] tensor inside this rank's combine area: combining it skips one copy
        (experts can write their output there). Valid until the next combine on this buffer."""
        nbytes = hidden * torch.empty((), dtype=dtype).element_size()
        fail(num_rows <= self.plan.comb_rows and nbytes <= self.plan.comb_row_bytes, "combine_input larger than the buffer")
        return self.rt.view(self.plan.comb_x, [num_rows, hidden], dtype)

    # -------------------------------------------------------------------------------- checks
    def _check_alive(self) -> None:
        fail(self.rt is not None, "this Buffer was destroyed", RuntimeError)
        err = self.rt.host_error()
        if err is not None:
            self.broken = self._describe(err)
        if self.broken:
            raise RuntimeError(f"megatron_ep: communication failed earlier and the buffer cannot be reused: {self.broken}")

    def _describe(self, err) -> str:
        code, rank, peer, slot, expected, observed = err
        what = SLOT_NAMES.get(slot, f"slot {slot}")
        if code == 1:
            return (f"rank {rank} timed out after {self.timeout_s:.0f}s waiting for rank {peer} at '{what}' "
                    f"(counter {observed}, expected {expected})")
        return f"rank {rank} stopped waiting at '{what}' because rank {peer} had timed out"

    def _wait_counts(self, tag: int, L: int):
        deadline = time.monotonic() + self.timeout_s + 5
        spins = 0
        while self.rt.host_tag() != tag:
            spins += 1
            if spins % 64 == 0:
                err = self.rt.host_error()
                if err is not None:
                    self.broken = self._describe(err)
                    raise RuntimeError(f"megatron_ep dispatch: {self.broken}")
                if time.monotonic() > deadline:
                    self.broken = f"rank {self.rank}: no receive count from the notify kernel within {self.timeout_s + 5:.0f}s"
                    raise RuntimeError(f"megatron_ep dispatch: {self.broken}")
        return self.rt.host_counts(L)

    def _check_rows(self, what: str, row_bytes: int, limit: int) -> None:
        fail(row_bytes % 16 == 0, f"{what}: rows of {row_bytes} bytes; the cuda backend needs a multiple of 16 (hidden * element size)")
        fail(row_bytes <= limit, f"{what}: rows of {row_bytes} bytes exceed the {limit} bytes the buffer was sized for (Buffer(hidden=..., dtype_bytes=...))")

    def _mark(self, name: str) -> None:
        if self.trace is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self.trace.append((name, ev))

    # --------------------------------------------------------------------------- stream glue
    def _enter(self, previous_event: Optional[EventOverlap]):
        compute = torch.cuda.current_stream(self.device)
        if previous_event is not None and previous_event.event is not None:
            self.stream.wait_event(previous_event.event)
        else:
            self.stream.wait_stream(compute)
        return compute

    def _leave(self, compute, tensors, async_op: bool) -> EventOverlap:
        # Synchronous calls make the caller's stream wait for ours right away, so anything it
        # frees afterwards is reused in stream order; only async callers need record_stream.
        if async_op and not torch.cuda.is_current_stream_capturing():
            for t in tensors:
                if t is not None:
                    t.record_stream(self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        if not async_op:
            compute.wait_event(event)
        return EventOverlap(event)

    # -------------------------------------------------------------------------------- layout
    def layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        T, R = topk_idx.shape[0], self.num_ranks
        tpr = torch.zeros(R, dtype=torch.int64, device=topk_idx.device)
        tpe = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
        tir = torch.empty((T, R), dtype=torch.bool, device=topk_idx.device)
        self.ext.layout(topk_idx, num_experts, R, tpr, tpe, tir)
        return DispatchLayout(tpr, tpe, tir)

    # ------------------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx, topk_weights, num_experts, permute, alignment, handle, host_counts,
                 num_worst_tokens, async_op=False, previous_event=None) -> DispatchOutput:
        self._check_alive()
        R, L = self.num_ranks, num_experts // self.num_ranks
        data, scales = (x[0], x[1]) if is_fp8_tuple(x) else (x, None)
        T, H = data.shape
        row_bytes = H * data.element_size()
        self._check_rows("dispatch", row_bytes, self.plan.x_row_bytes)
        fail(T <= self.plan.max_tokens, f"x has {T} tokens, more than the buffer was sized for (max_tokens_per_rank={self.plan.max_tokens})")
        fail(num_experts <= self.max_experts, f"num_experts={num_experts} exceeds the buffer's {self.max_experts}")
        fail(data.device == self.device, f"x is on {data.device}, the buffer on {self.device}")
        if topk_weights is not None:
            fail(topk_weights.dtype == torch.float32, f"topk_weights must be float32 for the cuda backend, got {topk_weights.dtype}", TypeError)
        if handle is None:
            K = topk_idx.shape[1]
            fail(K <= self.max_topk, f"topk_idx has K={K}, more than the buffer was sized for (max_topk={self.max_topk})")
            topk_idx = topk_idx.clone()  # the handle keeps its own routing (the caller may reuse theirs)
        else:
            K = handle.topk
            topk_idx = handle.topk_idx
        scale_cols = scales.shape[1] if scales is not None else 0

        # rank-major rows are pushed straight into pooled outputs when every rank has room
        push = not permute and not num_worst_tokens and self.plan.pool_bytes > 0 and not torch.cuda.is_current_stream_capturing()
        compute = self._enter(previous_event)
        with torch.cuda.stream(self.stream):
            self._mark("start")
            if handle is None:
                st = _CudaState(
                    rank_pos=torch.empty((T, R), dtype=torch.int32, device=self.device),
                    slot_pos=torch.empty((T, K), dtype=torch.int32, device=self.device),
                    recv_info=torch.empty(3 + 3 * L, dtype=torch.int32, device=self.device),
                    num_rows=None, num_perm_rows=None, counts=None)
                tag = next(self.tags)
                self.rt.notify(topk_idx, num_experts, alignment, st.rank_pos, st.slot_pos, st.recv_info, tag)
                self._mark("notify")
            else:
                st = handle.state
            if not push:
                zero_copy = data.data_ptr() == self.base + self.plan.stage_x
                self.rt.stage(None if zero_copy else data, T, row_bytes, scales, scale_cols, topk_idx, topk_weights,
                              st.rank_pos, st.slot_pos, self.num_sms)
                self._mark("stage")
            if handle is None and not num_worst_tokens:
                st.num_rows, st.num_perm_rows, st.counts = self._wait_counts(tag, L)
            valid = st.num_perm_rows if permute else st.num_rows
            out_rows = num_worst_tokens or valid
            if num_worst_tokens and valid is not None:
                fail(valid <= num_worst_tokens, f"dispatch received {valid} rows, more than num_worst_tokens={num_worst_tokens}", RuntimeError)

        # outputs live on the caller's stream (record_stream below ties them to ours)
        with torch.cuda.stream(compute):
            pooled = None
            if push:
                pooled = self.rt.pool_rank_major(out_rows, H, data.dtype, row_bytes, scale_cols, K,
                                                 topk_weights is not None, compute.cuda_stream)
            if pooled is not None:
                out_x, out_s, out_idx, out_w = pooled[:4]
                offsets = list(pooled[4:])
            else:
                out_x = torch.empty((out_rows, H), dtype=data.dtype, device=self.device)
                out_s = torch.empty((out_rows, scale_cols), dtype=torch.float32, device=self.device) if scales is not None else None
                out_idx = None if permute else torch.empty((out_rows, K), dtype=torch.int64, device=self.device)
                out_w = None
                if topk_weights is not None:
                    out_w = torch.empty((out_rows,) if permute else (out_rows, K), dtype=torch.float32, device=self.device)
                offsets = [-1, -1, -1, -1]
            out_re = torch.empty(out_rows, dtype=torch.int32, device=self.device) if permute else None
            tpe = torch.empty(L, dtype=torch.int64, device=self.device)
            if POISON:
                for t in (out_x, out_s, out_idx, out_w, out_re):
                    _poison(t)
        if POISON:
            self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            if push:
                self.rt.dispatch_push(data, T, row_bytes, scales, scale_cols, topk_idx, topk_weights, st.rank_pos,
                                      st.slot_pos, num_experts, out_rows, st.recv_info, out_x, out_s, out_idx, out_w,
                                      offsets, self.num_sms)
            else:
                self.rt.dispatch(row_bytes, scale_cols, K, num_experts, permute, topk_weights is not None, out_rows,
                                 st.recv_info, out_x, out_s, out_idx, out_w, out_re, self.num_sms)
            self._mark("pull" if not push else "push")
            tpe.copy_(st.recv_info[3 + L:3 + 2 * L] if permute else st.recv_info[3:3 + L])
        event = self._leave(compute, [data, scales, topk_idx, topk_weights, st.rank_pos, st.slot_pos, st.recv_info,
                                      out_x, out_s, out_idx, out_w, out_re, tpe], async_op)

        out = DispatchOutput((out_x, out_s) if scales is not None else out_x, out_idx, out_w, out_re, tpe, None,
                             event=event if async_op else None)
        if handle is None:
            handle = DispatchHandle(backend=self.name, num_ranks=R, rank=self.rank, num_experts=num_experts,
                                    num_tokens=T, topk=K, permute=permute, expert_alignment=alignment,
                                    num_recv_rows=out_rows, tokens_per_expert=tpe, topk_idx=topk_idx,
                                    num_worst_tokens=num_worst_tokens, state=st)
        out.handle = handle
        if host_counts:
            if st.counts is not None:
                out.tokens_per_expert_host = [(c + alignment - 1) // alignment * alignment for c in st.counts] if permute else list(st.counts)
            else:
                out.tokens_per_expert_host = tpe.tolist()
        return out

    # ------------------------------------------------------------------------------- combine
    def combine(self, x, handle: DispatchHandle, weights, async_op=False, previous_event=None) -> CombineOutput:
        self._check_alive()
        fail(handle.backend == self.name, "handle comes from another backend")
        fail(x.dtype in (torch.bfloat16, torch.float32), f"the cuda backend combines bf16 or fp32 rows, got {x.dtype}", TypeError)
        fail(x.device == self.device, f"x is on {x.device}, the buffer on {self.device}")
        st: _CudaState = handle.state
        rows, H = x.shape
        row_bytes = H * x.element_size()
        self._check_rows("combine", row_bytes, self.plan.comb_row_bytes)
        fail(rows <= self.plan.comb_rows, f"combine input has {rows} rows; the buffer's combine area holds {self.plan.comb_rows} (Buffer(combine_rows=...))")
        if weights is not None:
            fail(weights.dtype == torch.float32, f"weights must be float32 for the cuda backend, got {weights.dtype}", TypeError)
        T, K = handle.num_tokens, handle.topk
        w_cols = 1 if handle.permute else K
        compute = self._enter(previous_event)
        with torch.cuda.stream(compute):
            y = torch.empty((T, H), dtype=x.dtype, device=self.device)
            w_out = torch.empty((T, K), dtype=torch.float32, device=self.device) if weights is not None else None
            if POISON:
                _poison(y)
                _poison(w_out)
        if POISON:
            self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._mark("start")
            zero_copy = x.data_ptr() == self.base + self.plan.comb_x
            self.rt.stage_combine(None if zero_copy else x, rows, row_bytes, weights, w_cols, self.num_sms)
            self._mark("stage")
            self.rt.combine(T, H, K, handle.num_experts, handle.permute, x.dtype == torch.float32, weights is not None,
                            handle.topk_idx, st.rank_pos, st.slot_pos, y, w_out, self.num_sms)
            self._mark("pull")
        event = self._leave(compute, [x, weights, y, w_out, handle.topk_idx, st.rank_pos, st.slot_pos], async_op)
        return CombineOutput(y, w_out, event if async_op else None)

    # --------------------------------------------------------------------------- low latency
    def low_latency_dispatch(self, *args, **kwargs):
        raise NotImplementedError("the cuda backend has no low-latency kernels yet (a later issue); use backend='torch'")

    def low_latency_combine(self, *args, **kwargs):
        raise NotImplementedError("the cuda backend has no low-latency kernels yet (a later issue); use backend='torch'")

    def synchronize(self) -> None:
        """Wait for this buffer's kernels and raise if any of them reported a failure."""
        self.stream.synchronize()
        self._check_alive()
