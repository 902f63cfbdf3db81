"""The two-level internode normal path: the RDMA domain (csrc/internode/kernels.cu, NVSHMEM,
extension `_C_nvshmem`) composed with the intranode path inside each node.

Rank (node n, local l) of R = N x P ranks:

dispatch  1. RDMA send: each token once to rank (m, l) of every node m owning one of its experts,
             into that rank's fixed slot (n, token); ids and weights of every token to every node.
          2. RDMA receive: wait for every node, then the forwarder's view of its receive area:
             N * max_tokens rows, node-local expert ids (-1 where a token has none on this node).
          3. Intranode stage: the intranode path over the node's P ranks dispatches those rows to
             the ranks owning their experts (NVLink), fused permute included, straight into the
             outputs. Its notify takes one token group per source node (the forwarder's rows are
             N groups of max_tokens), so a destination's rows come in the order (expert or rank,
             source node, forwarder = source rank inside the node, token): the contract's
             (source rank, token) order, inside each expert segment when permuted, with no
             reorder afterwards (sorting per-row keys and gathering every output costs a sort
             plus a full extra HBM pass over the rows, about a sixth of a cached rank-major
             dispatch's time; docs/performance.md).
          A cached dispatch (handle=) keeps the ids the receivers laid out and runs as two kernels
          (csrc/internode/fused.cu): cached_notify (the send's release wait, the intranode push's
          announcement), then one dispatch kernel doing 1 and 3 with the wait between them inside.
combine   the intranode combine of the caller's rows (each forwarder sums a token's rows of its
          node), then the RDMA hop back and a sum over the token's nodes in fp32: cached_notify,
          then one combine kernel for all of it (a grid barrier between the intranode sums and the
          hop).

Sizes: the RDMA buffer has one slot per (source node, token) up to `max_tokens_per_rank` (a
Buffer hint, or the first call's largest T over the group; later calls must fit). Worst-case
sized calls (num_worst_tokens) pass it to the intranode stage, whose rows past it are then
exactly the contract's dropped rows (its order is the contract's).

All kernels of this path run on the caller's stream or are ordered with it: async_op returns an
event that is already in the caller's stream order. A rank whose host side raises before its
RDMA send of a call publishes that into its same-index peers' buffers (`publish`): their
waits for that call stop at once and raise PeerFailedFatalError naming it (their buffers must
then be re-created). A rank that dies or hangs without publishing leaves them to time out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ....core import envs
from ....core import protocol
from ....core.checks import FP8_BLOCK, IDS_CHECKED, check_topk_values, fail
from ..hosts import host_names
from ....core.requests import CombineRequest, DispatchRequest
from ..collectives import largest
from ..runtime import CudaRuntime
from ....core.types import CombineOutput, DispatchHandle, DispatchOutput, EventOverlap
from .interface import NormalPath
from .intranode import IntranodePath, combine_rows, dispatch_rows
from .nvshmem_path import NvshmemPath, signature_hash


@dataclass
class InternodeState:
    inner: DispatchHandle  # the intranode stage's handle (its rows are the contract's, in its order)
    local_idx: torch.Tensor  # [N * mt, K] int64 node-local ids of the forwarder's rows
    tokens: torch.Tensor  # [N] int32 tokens each source node sent to this forwarder


def node_hints(num_nodes: int, max_tokens: int, hidden: int, dtype_bytes: int = 2, combine_bytes: int = 2,
               topk: Optional[int] = None) -> dict:
    """Sizing of the node runtime's region for the intranode stage: every forwarder handles
    N * max_tokens rows."""
    h = dict(max_tokens=num_nodes * max_tokens, hidden=hidden, dtype_bytes=dtype_bytes, combine_bytes=combine_bytes)
    if topk:
        h["max_topk"] = topk
    return h


def node_group(group, rank: int, ranks_per_node: int):
    """This rank's node as a process group (only its members synchronise to create it)."""
    first = rank - rank % ranks_per_node
    ranks = [dist.get_global_rank(group, first + i) for i in range(ranks_per_node)]
    return dist.new_group(ranks, backend=dist.get_backend(group), use_local_synchronization=True)


class WholeGroup:
    """What the low-latency path needs of a runtime, over the whole group (the internode path's
    runtime spans one node)."""

    def __init__(self, group, rank: int, num_ranks: int, node_rt: CudaRuntime):
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.device, self.ranks_per_device, self.sm_count = node_rt.device, node_rt.ranks_per_device, node_rt.sm_count
        self.timeout_s, self.new_outputs = node_rt.timeout_s, node_rt.new_outputs
        self.budget = node_rt.budget  # one SM budget decides every path's block count


class InternodePath(NvshmemPath, NormalPath):
    KIND = "internode"
    SIZE_UP_FRONT = "pass max_tokens_per_rank= and hidden= to Buffer"
    FIT_REMEDY = "create the Buffer with max_tokens_per_rank=, hidden=, max_topk= large enough"
    SENDS = "its RDMA send in"
    PENDING = protocol.Pending.RDMA  # until its RDMA send, the same-index peers wait for this rank

    def __init__(self, rt: CudaRuntime, group, rank: int, num_ranks: int, ranks_per_node: int, hints: dict):
        super().__init__(group, rank, num_ranks, rt.device, rt.timeout_s)
        # its cached dispatch and combine call _C's entries (csrc/intranode/composed.h): the two
        # extensions must agree on them, checked here rather than at the first such call
        self.ext.composed_api_version()
        self.rt = rt  # the node's runtime (its group: this node's ranks)
        self.world = WholeGroup(group, rank, num_ranks, rt)
        self.intra = IntranodePath(rt)
        self.ranks_per_node = ranks_per_node
        self.N = num_ranks // ranks_per_node
        self.node, self.local = rank // ranks_per_node, rank % ranks_per_node
        self.staged = False  # every RDMA-domain transfer an NVSHMEM put from symmetric staging (set with the buffer)
        self.inner_seq = 0
        self.inner_of = -1  # the (outer) call whose intranode stage call was made last
        self._views, self._views_of = {}, None  # view()'s, and the buffer they point into
        if hints.get("max_tokens") and hints.get("hidden"):
            self._create(self._agree(self._need(hints["max_tokens"], hints["hidden"], hints.get("dtype_bytes", 2),
                                                hints.get("combine_bytes", 2), hints.get("max_topk") or 8)))

    @property
    def num_blocks(self) -> int:
        """The RDMA kernels' blocks: the runtime's SM budget at this launch (set_num_sms)."""
        return self.rt.budget.blocks("copy", self.ext.INTERNODE_MAX_BLOCKS)

    @classmethod
    def open(cls, group, rank: int, num_ranks: int, ranks_per_node: int, hints: dict, num_sms: Optional[int],
             timeout_s: float) -> "InternodePath":
        """Collective: the node's runtime (sized for the intranode stage: N * max_tokens forwarded
        rows, 1/N of the experts), then the path over the whole group."""
        N = num_ranks // ranks_per_node
        num_experts = hints.get("max_experts")
        node_h = dict(hints, max_experts=None if num_experts is None else num_experts // N)
        if hints.get("max_tokens") is not None and hints.get("hidden") is not None:
            node_h.update(node_hints(N, hints["max_tokens"], hints["hidden"], hints["dtype_bytes"], hints["combine_bytes"],
                                     hints.get("max_topk")))
        rt = CudaRuntime(node_group(group, rank, ranks_per_node), rank % ranks_per_node, ranks_per_node, hints=node_h,
                         num_sms=num_sms, timeout_s=timeout_s, device_group=group, kind="internode intranode stage")
        return cls(rt, group, rank, num_ranks, ranks_per_node, hints)

    def describe(self) -> str:
        rt = self.rt
        size = f"{rt.region.plan.total / 2**20:.0f} MiB region" if rt.region.ready else "sized on first use"
        return (f"cuda internode, {self.N} nodes x {self.ranks_per_node} ranks, {rt.budget.num_sms} SMs/rank, "
                f"{rt.ranks_per_device} rank(s)/GPU, {size} per node stage")

    # ------------------------------------------------------------------------------ buffer
    @staticmethod
    def _need(T: int, H: int, elem: int, comb_elem: int, K: int) -> dict:
        return dict(max_tokens=int(T), hidden=int(H), x_row=int(H * elem), c_row=int(H * max(2, comb_elem)), topk=int(K))

    def _merge(self, every: List[dict]) -> dict:
        return largest(every)

    @staticmethod
    def _scale_cols(cap: dict) -> int:
        return (cap["hidden"] + FP8_BLOCK - 1) // FP8_BLOCK

    def _plan(self, cap: dict) -> dict:
        """The RDMA buffer's layout; puts from symmetric staging where a same-index peer is on
        another host (or when forced)."""
        self.staged = len(set(host_names(self.group))) > 1 or envs.flag("MEGATRON_EP_INTERNODE_FORCE_PUTS")
        return self.ext.internode_plan(self.N, cap["max_tokens"], cap["topk"], cap["x_row"], self._scale_cols(cap),
                                       cap["c_row"], self.staged)

    def _open(self, cap: dict, plan: dict, pes: list):
        peers = [pes[m * self.ranks_per_node + self.local] for m in range(self.N)]
        return self.ext.InternodeBuffer(self.device.index, self.node, self.local, self.ranks_per_node, peers,
                                        cap["max_tokens"], cap["topk"], cap["x_row"], self._scale_cols(cap), cap["c_row"],
                                        self.staged, self.timeout_s)

    def _opened(self) -> None:
        fail(self.staged or all(self.buf.p2p()), "megatron_ep internode: a same-index peer on this host is not load/store "
                                                 "reachable (no P2P); set MEGATRON_EP_INTERNODE_FORCE_PUTS=1 to send everything as NVSHMEM "
                                                 "puts", RuntimeError)

    def _created(self, cap: dict) -> None:
        # the intranode stage: N * max_tokens rows per forwarder
        self.rt.region.reserve(node_hints(self.N, cap["max_tokens"], cap["hidden"], max(1, cap["x_row"] // cap["hidden"]),
                                   cap["c_row"] // cap["hidden"], cap["topk"]))

    def _short(self, need: dict, cap: dict) -> List[str]:
        return [f"{k} {need[k]} > {cap[k]}" for k in ("max_tokens", "x_row", "topk") if need[k] > cap[k]]

    def _sized_for(self, c: dict) -> str:
        return f"max_tokens_per_rank={c['max_tokens']}, {c['x_row']} bytes per row, topk={c['topk']}"

    def close(self) -> None:
        """Collective: the RDMA buffer (see NvshmemPath.close), then the node's runtime."""
        self._views, self._views_of = {}, None  # they point into the buffer
        super().close()
        self.rt.close()

    def view(self, section: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """`rows` x `cols` of `dtype` over a section of the RDMA buffer. The same views recur every
        call: kept per buffer (a view is valid until the buffer it points into is closed or
        replaced), so a call does not cross into C++ for them."""
        if self._views_of is not self.buf or len(self._views) > 64:  # (token counts may vary call to call)
            self._views, self._views_of = {}, self.buf
        key = (section, rows, cols, dtype)
        t = self._views.get(key)
        if t is None:
            t = self.buf.view(self.plan[section], rows * cols * dtype.itemsize).view(dtype).view(rows, cols)
            self._views[key] = t
        return t

    # ------------------------------------------------------------------------------ calls
    def begin(self, call: protocol.Call) -> None:
        # the intranode calls check and publish for themselves; the node's earlier reports first
        self.rt.ledger.check(call)
        super().begin(call)

    def synchronize(self) -> None:
        self.rt.stream.synchronize()
        self.rt.ledger.check()
        super().synchronize()

    # ------------------------------------------------------------------------------ errors
    def _op(self, op: int) -> str:
        return f"internode {protocol.op_name(op)}"

    def _peer(self, err: dict) -> str:
        return f"rank {err['peer']} (node {err['node']})"

    def _waited(self, err: dict) -> str:
        direction = "dispatch" if err["direction"] == 0 else "combine"
        return {0: f"waiting for rank {err['peer']} (node {err['node']}) to finish reading this rank's previous {direction} "
                   f"rows (its release signal)",
                1: f"waiting for rank {err['peer']}'s (node {err['node']}) {direction} rows (its signal)",
                2: f"waiting for this rank's other blocks at the fused {direction}'s grid barrier (after the intranode "
                   f"stage)"}.get(err["what"],
                                                                                                             "waiting")

    def publish(self, call: protocol.Call, exc: BaseException) -> None:
        """This rank raised before its RDMA send of `call`: the same-index peers' receives would wait
        for it until their timeout; tell them now (their buffers break). The node's other ranks
        wait for it at the intranode stage's handshake: unless this rank's own intranode call already
        published there, a failed record for the intranode call it will not make (they raise
        PeerFailedError; the node's buffer stays usable)."""
        if self.inner_of != call.seq:  # (each rank's intranode sequence advances alike)
            self.rt.ledger.publish(self._inner_call(call, 0, 0), exc)
        super().publish(call, exc)

    def _inner_call(self, call: protocol.Call, num_experts: int, routing: int) -> protocol.Call:
        """The intranode stage's call: the same signature on the node's own call sequence."""
        self.inner_seq += 1
        self.inner_of = call.seq
        inner = protocol.Call(call.op, self.inner_seq)
        inner.sig = list(call.sig)
        inner.set(seq=self.inner_seq, num_experts=num_experts, routing=routing)
        return inner

    # ---------------------------------------------------------------------------- dispatch
    def dispatch(self, call: protocol.Call, req: DispatchRequest) -> DispatchOutput:
        rt, N = self.rt, self.N
        x, topk_idx, topk_weights, num_experts, permute, expert_alignment = (
            req.x, req.topk_idx, req.topk_weights, req.num_experts, req.permute, req.expert_alignment)
        handle, host_counts, num_worst_tokens = req.handle, req.host_counts, req.num_worst_tokens
        async_op, previous_event = req.async_op, req.previous_event
        data, scales, T, H, elem, _ = dispatch_rows(rt, x, topk_weights, num_experts)
        if num_experts % N != 0:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the {N} nodes")
        if handle is not None:
            st: InternodeState = handle.state
            K, topk_idx = handle.topk, handle.topk_idx
        else:
            K = topk_idx.shape[1]
            if K > protocol.MAX_TOPK:
                raise ValueError(f"topk_idx has K={K}; the cuda backend takes at most {protocol.MAX_TOPK}")
            if req.check_ids == IDS_CHECKED:  # on the host (one sync): the intranode stage sees only the node-local ids
                check_topk_values(topk_idx, num_experts, previous_event)
            topk_idx = topk_idx.contiguous().clone()
        if previous_event is not None and previous_event.event is not None:
            torch.cuda.current_stream(rt.device).wait_event(previous_event.event)
        self._fit(self._need(T, H, elem, 2, K))
        mt, sc = self.cap["max_tokens"], (scales.shape[1] if scales is not None else 0)
        sig = signature_hash(call)
        data = data.contiguous()
        src_x, src_s, src_i, src_w = data, scales, topk_idx, topk_weights
        cur = torch.cuda.current_stream(rt.device)
        rt.mark("start", cur)  # benchmarks' phases: rdma, the intranode stage's
        if self.staged:  # puts read symmetric memory
            src_x = self.view("s_x", T, H, data.dtype)
            src_x.copy_(data)
            src_i = self.view("s_idx", T, K, torch.int64)
            src_i.copy_(topk_idx)
            if scales is not None:
                src_s = self.view("s_s", T, sc, torch.float32)
                src_s.copy_(scales)
            if topk_weights is not None:
                src_w = self.view("s_w", T, K, torch.float32)
                src_w.copy_(topk_weights)
        # (each entry below sets the call the waits of its kernels stop on when a peer publishes
        # that it failed: `seq`, set_call's)
        fused, released = None, []
        # cached: one crossing, the RDMA send and the intranode push in one kernel (csrc/internode/fused.cu)
        if handle is not None:
            def fused(*intranode):  # the intranode stage's dispatch_call arguments, in its order
                return call.sends(self.buf.dispatch_cached_call, *intranode, seq=call.seq, send_x=src_x,
                                  send_scales=src_s, send_idx=src_i, send_weights=src_w, num_experts=num_experts,
                                  send_sig=sig, send_blocks=self.num_blocks)
        else:  # a new routing: the RDMA send and receive, then the intranode stage's own launches
            local_idx = torch.empty((N * mt, K), dtype=torch.int64, device=rt.device)
            tokens = torch.empty(N, dtype=torch.int32, device=rt.device)
            if not num_worst_tokens:  # one crossing: the intranode stage's notify waits on the host anyway
                rdma_marks = rt.marks(("rdma",))

                def fused(*intranode):  # the intranode stage's dispatch_first_call arguments, in its order
                    out = call.sends(self.buf.dispatch_first_call, *intranode, seq=call.seq, send_x=src_x,
                                     send_scales=src_s, send_idx=src_i, send_weights=src_w,
                                     send_num_experts=num_experts, send_sig=sig, out_tokens=tokens,
                                     rdma_marks=rdma_marks, send_blocks=self.num_blocks)
                    released.append(out[0] == 0)  # (status 0: the entry released the receive area)
                    return out
            else:
                self.buf.set_call(call.seq)
                call.sends(self.buf.dispatch_send, x=src_x, scales=src_s, topk_idx=src_i, weights=src_w,
                           num_experts=num_experts, sig=sig, num_blocks=self.num_blocks)
                self.buf.dispatch_recv(topk=K, num_experts=num_experts, sig=sig, out_idx=local_idx,
                                       out_tokens=tokens, num_blocks=self.num_blocks)
                rt.mark("rdma", cur)

        # the intranode stage over the forwarder's rows, one token group per source node: it delivers
        # them in the contract's order, straight into the outputs
        fx = self.view("d_x", N * mt, H, data.dtype)
        rows = (fx, self.view("d_s", N * mt, sc, torch.float32)) if scales is not None else fx
        fw = self.view("d_w", N * mt, K, torch.float32) if topk_weights is not None else None
        L_node = num_experts // N
        inner_call = self._inner_call(call, L_node, handle.state.inner.call_seq if handle is not None else 0)
        with self.intra.guard(inner_call):
            inner = self.intra.dispatch(inner_call, DispatchRequest(
                rows, local_idx if handle is None else None, fw, L_node, permute, expert_alignment,
                handle.state.inner if handle is not None else None, host_counts=host_counts,
                num_worst_tokens=num_worst_tokens, token_groups=N, fused=fused, rank_counts=req.rank_counts,
                source_index=req.source_index and handle is None))
        if handle is None and not any(released):
            with torch.cuda.stream(rt.stream):  # the intranode stage has read the receive area: free it
                self.buf.release(0)
        torch.cuda.current_stream(rt.device).wait_stream(rt.stream)  # joined (CUDA-graph capture needs it)
        self.check(call)

        if handle is None:
            st = InternodeState(inner=inner.handle, local_idx=local_idx, tokens=tokens)
            handle = DispatchHandle(backend="cuda", num_ranks=self.num_ranks, rank=self.rank, num_experts=num_experts,
                                    num_tokens=T, topk=K, permute=permute, expert_alignment=expert_alignment,
                                    num_recv_rows=inner.handle.num_recv_rows, tokens_per_expert=inner.handle.tokens_per_expert,
                                    topk_idx=topk_idx, num_worst_tokens=num_worst_tokens, state=st, call_seq=call.seq,
                                    # the intranode stage's rows are (source node, its rank of this
                                    # rank's index): global source ranks, node-major
                                    recv_rank_counts=inner.handle.recv_rank_counts,
                                    recv_rank_prefix=inner.handle.recv_rank_prefix,
                                    recv_src_token=_source_tokens(inner.handle.recv_src_token, mt),
                                    recv_slot_row=inner.handle.recv_slot_row)
        out = DispatchOutput(inner.x, inner.topk_idx, inner.topk_weights, inner.row_expert, inner.tokens_per_expert, None,
                             event=_finished(rt.device) if async_op else None, num_dropped=inner.num_dropped)
        out.handle = handle
        out.tokens_per_expert_host = inner.tokens_per_expert_host
        return out

    # ----------------------------------------------------------------------------- combine
    def combine(self, call: protocol.Call, req: CombineRequest) -> CombineOutput:
        rt, N = self.rt, self.N
        x, handle, weights, async_op, previous_event = req.x, req.handle, req.weights, req.async_op, req.previous_event
        st: InternodeState = handle.state
        if req.single_reduction and handle.permute:
            raise NotImplementedError("combine(single_reduction=True) on the cuda internode path: its intranode stage "
                                      "sums each rank's rows before the RDMA hop (the intranode path and the torch "
                                      "backend sum every slot's row)")
        _, H, row_bytes = combine_rows(rt, x, weights)
        if row_bytes > self.cap["c_row"]:
            raise ValueError(f"combine: rows of {row_bytes} bytes exceed the "
                             f"{self.cap['c_row']} the internode buffer holds (Buffer(hidden=, combine_bytes=))")
        if previous_event is not None and previous_event.event is not None:
            torch.cuda.current_stream(rt.device).wait_event(previous_event.event)
        T, K = handle.num_tokens, handle.topk
        cur = torch.cuda.current_stream(rt.device)
        rt.mark("start", cur)  # benchmarks' phases: the whole call (one kernel)
        y = torch.empty((T, H), dtype=x.dtype, device=rt.device)
        w_out = torch.empty((T, K), dtype=torch.float32, device=rt.device) if weights is not None else None
        rt.new_outputs((y, w_out))
        # the intranode combine writes the forwarder's rows where the RDMA send reads them: symmetric
        # staging when every transfer is a put, else a tensor it allocates
        out = None
        if self.staged:
            rows = st.inner.num_tokens
            out = (self.view("s_y", rows, H, x.dtype),
                   self.view("s_cw", rows, K, torch.float32) if weights is not None else None)
        sig = signature_hash(call)

        def fused(*intranode):  # the intranode stage's combine_call arguments, in its order
            # one crossing, one kernel (csrc/internode/fused.cu): the intranode combine, the RDMA hop, the
            # sum over nodes, which the biases start (the intranode stage takes none)
            return call.sends(self.buf.combine_call, *intranode, seq=call.seq, local_idx=st.local_idx, tokens=st.tokens,
                              topk_idx=handle.topk_idx, num_experts=handle.num_experts, send_sig=sig, y=y, w=w_out,
                              sum_bias0=req.bias[0], sum_bias1=req.bias[1], send_blocks=self.num_blocks)

        inner_call = self._inner_call(call, handle.num_experts // N, st.inner.call_seq)
        with self.intra.guard(inner_call):  # synchronous: this stream waits for the kernel's stream
            self.intra.combine(inner_call, CombineRequest(x, st.inner, weights, fused=fused, out=out))
        rt.mark("rdma", cur)
        self.check(call)
        return CombineOutput(y, w_out, _finished(rt.device) if async_op else None)


def _source_tokens(rows: Optional[torch.Tensor], mt: int) -> Optional[torch.Tensor]:
    """Each row's token on its source rank, from the intranode stage's source tokens: the
    forwarder's receive rows, slot (source node, token) at node * mt + token. One launch: fmod
    keeps the dividend's sign, so -1 (no row) stays -1."""
    return None if rows is None else rows.fmod(mt)


def _finished(device: torch.device) -> EventOverlap:
    """An asynchronous call's event: recorded on the current stream, which the call joined (a
    synchronous call makes none: creating and destroying a CUDA event costs host time)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return EventOverlap(event)
