"""DeepEP V2's ElasticBuffer and EPHandle (deep_ep/buffers/elastic.py at deepseek-ai/DeepEP dd758ca)
on megatron_ep's Buffer: V2's constructor, dispatch (plain and expanded, bf16 and FP8, cached,
with or without the CPU sync), combine (weights, bias) and the handle fields its callers read, with
the edges V2's callers work around handled (docs/deep-ep.md, "DeepEP V2's ElasticBuffer").

Our rows already come in V2's deterministic order (rank-major: by source rank, then source token;
expanded: by local expert, then source rank, then source token), so `deterministic` costs nothing
here. What V2 has and this module has not (Engram, PP send/recv, all-gather (AGRS), CPU-backed
memory) raises NotImplementedError naming itself. allow_multiple_reduction=False across nodes on the
cuda backend keeps the per-rank order of the sum and says so once (a warning)."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..core import buffer as _mep
from ..core import envs
from ..core.types import DispatchHandle
from .buffer import (RANKS_PER_NODE, _group_of, _needs_row_major_copy, _row_major_scales, _rows, _unpacked_scales,
                     _uses_cuda)
from .config import flag
from .utils import EventHandle, EventOverlap, from_ours

log = logging.getLogger("megatron_ep.deep_ep")

_HUGE_PAGE = 2 << 20  # V2 sizes its buffer in 2 MiB units


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _event_of(ev) -> Optional[torch.cuda.Event]:
    """The CUDA event of a V2 `previous_event`: an EventHandle (what `capture()` returns), an
    EventOverlap around one, or None."""
    if ev is None:
        return None
    inner = getattr(ev, "event", None)
    if isinstance(ev, EventOverlap):
        inner = getattr(inner, "event", None)
    if inner is not None and not isinstance(inner, torch.cuda.Event):
        raise TypeError(f"previous_event must be an EventHandle (ElasticBuffer.capture()) or an EventOverlap, "
                        f"got {type(ev).__name__}")
    return inner


def _wait(*events) -> None:
    """The caller's stream waits for each given event (V2's previous_event and
    previous_event_before_epilogue: our call's kernels and its epilogue run after both)."""
    for ev in events:
        e = _event_of(ev)
        if e is not None:
            torch.cuda.current_stream().wait_event(e)


def _refuse_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"megatron_ep.deep_ep ElasticBuffer: {what} inside a CUDA-graph capture: it allocates "
                           f"communication memory and agrees sizes with the group, which capture forbids; create the "
                           f"buffer before capturing")


class EPHandle:
    """What a dispatch returns for its combine and cached dispatches (V2's EPHandle). The counts
    V2 keeps as tensors are made from ours on first read (a caller that never reads one pays
    nothing): `psum_num_recv_tokens_per_scaleup_rank` ([R] int32, inclusive prefix of the rows
    each source rank sent here; the last is the row count, on the GPU for a dispatch without CPU
    sync), `psum_num_recv_tokens_per_expert` ([L] int32; V2's two meanings: inclusive prefix of
    the aligned counts, or with do_expand each expert's aligned start plus its count) and
    `num_unaligned_recv_tokens_per_expert` ([L] int32, exact). `ours` is megatron_ep's handle."""

    token_metadata_at_forward = None  # (V2's hybrid mode only)
    channel_linked_list = None

    def __init__(self, ours: DispatchHandle, *, do_expand: bool, num_max_tokens_per_rank: int, num_sms: int,
                 topk_idx: torch.Tensor, num_recv_tokens: Optional[int], num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: List[int], tokens_per_expert: torch.Tensor, rank: int,
                 recv_topk_idx: Optional[torch.Tensor], row_expert: Optional[torch.Tensor]):
        self.ours = ours
        self.do_expand = do_expand
        self.num_experts = ours.num_experts
        self.expert_alignment = ours.expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self._num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.recv_topk_idx = recv_topk_idx  # (a cached dispatch returns the routing's received ids again)
        self._tpe, self._rank, self._row_expert = tokens_per_expert, rank, row_expert
        self.sms_asked = 0  # the dispatch's num_sms argument (0: automatic), which its combine's 0 means

    @property
    def num_recv_tokens(self) -> int:
        """Tokens received (one per source token and this rank; worst-case rows without the CPU
        sync). An expanded dispatch's is read from the device at first use (one sync)."""
        if self._num_recv_tokens is None:
            psum = self.psum_num_recv_tokens_per_scaleup_rank
            self._num_recv_tokens = int(psum[-1]) if psum.numel() else 0
        return self._num_recv_tokens

    @num_recv_tokens.setter
    def num_recv_tokens(self, value: int) -> None:
        self._num_recv_tokens = value

    @functools.cached_property
    def num_unaligned_recv_tokens_per_expert(self) -> torch.Tensor:
        if self._row_expert is None:  # plain: our counts are the copies per local expert
            return self._tpe.to(torch.int32)
        # expanded: ours are the padded lengths; the rows of each expert, counted on the device
        rows = self._row_expert
        return torch.zeros(self._tpe.numel(), dtype=torch.int32, device=rows.device).index_add_(
            0, rows.clamp(min=0).to(torch.int64), (rows >= 0).to(torch.int32))

    @functools.cached_property
    def psum_num_recv_tokens_per_expert(self) -> torch.Tensor:
        counts = self.num_unaligned_recv_tokens_per_expert.to(torch.int64)
        a = self.expert_alignment
        aligned = (counts + a - 1) // a * a
        psum = torch.cumsum(aligned, 0)
        if self.do_expand:
            psum = psum - aligned + counts  # each expert's aligned start plus its count
        return psum.to(torch.int32)

    @functools.cached_property
    def psum_num_recv_tokens_per_scaleup_rank(self) -> torch.Tensor:
        h = self.ours
        if h.recv_rank_prefix is not None:
            return h.recv_rank_prefix
        if h.rank_prefix is not None:
            return h.rank_prefix[:, self._rank].contiguous()
        if h.recv_rank_counts is not None:
            return torch.cumsum(h.recv_rank_counts, 0, dtype=torch.int32)
        return torch.cumsum(h.rank_counts[:, self._rank], 0, dtype=torch.int32)

    @functools.cached_property
    def recv_src_metadata(self) -> torch.Tensor:
        """[num_recv_tokens, K + 2] int32, V2's: per token received (rank-major row) its source
        rank * num_max_tokens_per_rank + its source index, its source rank * K + its first slot
        with an expert here, and (expanded) each slot's expanded row, -1 elsewhere (-1 in all K
        columns when plain). Rows past the tokens received (without the CPU sync) are -1. Made on
        first read, without a host sync, from the per-row source token the dispatch wrote (the
        torch backend's, our kernels')."""
        h = self.ours
        src = h.recv_src_token
        if src is None:
            raise RuntimeError("EPHandle.recv_src_metadata: the dispatch that made this handle wrote no source "
                               "tokens (Buffer.dispatch(source_index=True))")
        N, K = src.numel(), h.topk  # (N: the rows the backend wrote for, -1 past the real ones)
        counts = h.recv_rank_counts if h.recv_rank_counts is not None else h.rank_counts[:, self._rank]
        # rank-major rows come in source-rank order: a row's source rank is the segment it falls in
        ends = torch.cumsum(counts.to(torch.int64), 0)
        src_rank = torch.searchsorted(ends, torch.arange(N, device=src.device), right=True).to(torch.int32)
        real = src >= 0
        slots = h.recv_slot_row[:N] if self.do_expand else self.recv_topk_idx[:N]
        slots = torch.where(real.unsqueeze(1), slots.to(torch.int32), -1)
        here = slots >= 0
        meta = torch.full((max(self.num_recv_tokens, N), K + 2), -1, dtype=torch.int32, device=src.device)
        meta[:N, 0] = torch.where(real, src_rank * self.num_max_tokens_per_rank + src, -1)
        meta[:N, 1] = torch.where(here.any(1), src_rank * K + here.to(torch.int8).argmax(1).to(torch.int32), -1)
        if self.do_expand:
            meta[:N, 2:] = slots
        return meta[:self.num_recv_tokens] if self.num_recv_tokens < N else meta

    @functools.cached_property
    def dst_buffer_slot_idx(self) -> torch.Tensor:
        """[T, K] int32, V2's (one scale-up domain): in the first slot of each destination rank of
        a token, this rank * num_max_tokens_per_rank + the token's place among the tokens this rank
        sends to that rank, in token order; -1 in every other slot (a repeated rank, an id outside
        [0, num_experts)). V2 assigns places in arrival order unless deterministic; ours are always
        the token order, which is also where the token lands: its row on that rank is the start of
        this rank's block there plus its place. Made on first read from the routing, on its device,
        without a host sync; a cached dispatch's handle is the same handle, so the same tensor."""
        idx = self.topk_idx
        T, K = idx.shape
        E, R = self.num_experts, self.ours.num_ranks
        valid = (idx >= 0) & (idx < E)
        dst = torch.where(valid, idx // (E // R), -1).to(torch.int64)
        earlier = torch.ones(K, K, dtype=torch.bool, device=idx.device).tril(-1)  # [k, j]: j < k
        repeated = ((dst.unsqueeze(2) == dst.unsqueeze(1)) & earlier).any(2)
        first = valid & ~repeated
        safe = dst.clamp(min=0)
        sends = torch.zeros(T, R, dtype=torch.int32, device=idx.device).scatter_add_(1, safe, first.to(torch.int32))
        place = (torch.cumsum(sends, 0, dtype=torch.int32) - sends).gather(1, safe)
        return torch.where(first, self._rank * self.num_max_tokens_per_rank + place, -1).to(torch.int32)


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer on megatron_ep's Buffer (MEGATRON_EP_DEEP_EP_BACKEND: auto, cuda or
    torch, as DeepEP V1's Buffer here). Construction is collective: every rank's
    num_max_tokens_per_rank is agreed (the largest is kept, and said once if they differ), and
    our buffer is sized from the hints (num_max_tokens_per_rank, hidden, num_topk) when given.
    `num_bytes` is checked and otherwise unused: our Buffer sizes its own memory. Logical domain:
    one scale-out group of every rank (our rows are rank-major over the whole group)."""

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False):
        self._destroyed = True  # until constructed
        _refuse_capture("construction")
        if num_cpu_bytes:
            raise NotImplementedError(f"megatron_ep.deep_ep ElasticBuffer(num_cpu_bytes={num_cpu_bytes}): CPU-backed "
                                      f"memory (V2's Engram storage) is not supported; pass num_cpu_bytes=0")
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                            ("num_topk", num_topk), ("num_allocated_qps", num_allocated_qps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"megatron_ep.deep_ep ElasticBuffer: {name} must be an int >= 0, got {value!r}")
        if num_bytes is not None and (not isinstance(num_bytes, int) or num_bytes < 0):
            raise ValueError(f"megatron_ep.deep_ep ElasticBuffer: num_bytes must be an int >= 0 or None, got {num_bytes!r}")
        for name, t in (("num_cpu_timeout_secs", num_cpu_timeout_secs), ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            if not isinstance(t, (int, float)) or t <= 0:
                raise ValueError(f"megatron_ep.deep_ep ElasticBuffer: {name} must be > 0, got {t!r}")
        self.rank, self.group, self.num_ranks = _group_of(group)
        self.rank_idx = self.rank
        self.group_size = self.num_ranks
        self.deterministic, self.explicitly_destroy = bool(deterministic), bool(explicitly_destroy)
        self.allow_hybrid_mode, self.allow_multiple_reduction = bool(allow_hybrid_mode), bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute, self.sl_idx = bool(prefer_overlap_with_compute), sl_idx
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.num_max_tokens_per_rank = self._agreed(num_max_tokens_per_rank)
        self.num_bytes = num_bytes if num_bytes is not None else self.get_buffer_size_hint(
            group, self.num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        self.num_allocated_qps = num_allocated_qps or 17
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks
        backend = envs.text("MEGATRON_EP_DEEP_EP_BACKEND", "auto")
        nodes = dict(ranks_per_node=RANKS_PER_NODE) if self.num_ranks > RANKS_PER_NODE else {}
        hints = {k: v for k, v in (("max_tokens_per_rank", self.num_max_tokens_per_rank), ("hidden", hidden),
                                   ("max_topk", num_topk)) if v}
        if num_gpu_timeout_secs != 100 and _uses_cuda(backend):
            # our kernels' waits (V2's default, 100 s, leaves ours: MEGATRON_EP_TIMEOUT_S); the torch backend has none
            nodes["timeout_s"] = float(num_gpu_timeout_secs)
        # ids unchecked (no host sync, as V2): a repeated expert in a token is one more slot, and an id
        # outside [0, num_experts) an unused slot, on both backends
        self.runtime = _mep.Buffer(group, backend=backend, check_inputs=False, **hints, **nodes)
        self._sms_asked = 0
        self._worst_reserved = 0  # the most worst-case rows reserved for (_reserve)
        self._destroyed = False
        # allow_multiple_reduction=False: expanded combines sum every slot's row (single_reduction),
        # except on the cuda internode path, whose intranode stage sums per rank before the RDMA hop
        self._single_reduction = not self.allow_multiple_reduction and not (nodes and self.runtime.backend == "cuda")
        if self.rank == 0:
            log.info("megatron_ep.deep_ep: DeepEP V2's ElasticBuffer on megatron_ep (%s backend, %d ranks)",
                     self.runtime.backend, self.num_ranks)
            if not self.allow_multiple_reduction and not self._single_reduction:
                log.warning("megatron_ep.deep_ep: allow_multiple_reduction=False across nodes on the cuda backend: "
                            "expanded combines sum each rank's rows first (V2's allow_multiple_reduction=True "
                            "order; the rounding differs from V2's single reduction)")

    def _agreed(self, num_max_tokens_per_rank: int) -> int:
        """V2 needs one num_max_tokens_per_rank on every rank (its row indices and worst-case sizes
        derive from it); ranks that pass different ones get the largest, said once."""
        if self.num_ranks == 1:
            return num_max_tokens_per_rank
        every: list = [None] * self.num_ranks
        dist.all_gather_object(every, num_max_tokens_per_rank, group=self.group)
        agreed = max(every)
        if min(every) != agreed and self.rank == 0:
            log.warning("megatron_ep.deep_ep ElasticBuffer: ranks passed different num_max_tokens_per_rank (%s); "
                        "every rank uses the largest, %d", every, agreed)
        return agreed

    # ------------------------------------------------------------------------- lifecycle
    def _alive(self, method: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"megatron_ep.deep_ep ElasticBuffer.{method}: this buffer was destroyed; create a new one")

    def destroy(self) -> None:
        """V2's: needs explicitly_destroy; collective on our kernels."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._alive("destroy")
        self._destroyed = True
        self.runtime.destroy()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier over the group (after this rank's communication so far, with_cpu_sync: on the host too)."""
        self._alive("barrier")
        if with_cpu_sync and torch.cuda.is_available() and self.runtime.backend == "cuda":
            self.runtime.synchronize()
        dist.barrier(group=self.group)

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_comm_stream(self):
        self._alive("get_comm_stream")
        stream = self.runtime.comm_stream
        if stream is None and torch.cuda.is_available():
            stream = torch.cuda.current_stream()
        return stream

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scale-out, scale-up) ranks: (1, R), one domain of every rank, as our rows are ordered."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_physical_domain_size(self) -> Tuple[int, int]:
        nodes = self.num_ranks // RANKS_PER_NODE if self.num_ranks > RANKS_PER_NODE else 1
        return nodes, self.num_ranks // nodes

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes in 2 MiB units for the calls these sizes allow (the rows every rank may send here,
        both ways, with their top-k metadata). A number for callers that compare or pass it back:
        our Buffer sizes its own memory from the same hints."""
        R = dist.get_world_size(group)
        row = hidden * (1 if use_fp8_dispatch else 2) + (hidden // 128 * 4 if use_fp8_dispatch else 0)
        meta = max(num_topk, 1) * (8 + 4)
        rows = R * num_max_tokens_per_rank
        return _align(rows * (row + meta) + rows * hidden * 2, _HUGE_PAGE)

    def get_theoretical_num_sms(self, num_experts: int = 0, num_topk: int = 0, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """The SMs our normal kernels launch with on this rank (our budget's rule; the link model's
        arguments are accepted for V2's signature): what num_sms=0 means in every call."""
        return self.runtime.num_sms or 0

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """V2's count for a direct (non-hybrid) group, min(num_sms, 9): our kernels open no queue
        pairs, so num_qps is accepted and unused."""
        return min(max(int(num_sms), 1), 9, self.num_allocated_qps)

    def _hand_sms(self, num_sms: int) -> int:
        """num_sms=0: automatic (our budget's rule) in every call; else that count for our kernels
        (bounded by what this rank may keep resident). Returns the count the call runs with."""
        if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 0:
            raise ValueError(f"megatron_ep.deep_ep ElasticBuffer: num_sms must be an int >= 0 (0: automatic), got {num_sms!r}")
        if num_sms != self._sms_asked:
            self._sms_asked = num_sms
            limit = self.runtime.max_num_sms
            if limit is not None:
                self.runtime.set_num_sms(min(num_sms, limit) if num_sms else None)
        return self.runtime.num_sms or num_sms

    # --------------------------------------------------------------------------- dispatch
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, handle, event), as V2's. Plain: one row per
        (source token, this rank), by source rank then token; recv_topk_idx local ids, -1 for
        experts elsewhere (whose weights are 0 here, V2 passes the source's). do_expand: one row
        per (token, local expert), each expert's rows from its aligned start; recv_topk_idx None,
        recv_topk_weights [rows]. do_cpu_sync=False (and every cached dispatch): worst-case row
        counts, no host sync; the valid count is psum_num_recv_tokens_per_scaleup_rank[-1] (plain)."""
        self._alive("dispatch")
        return self.runtime.layer_call("dispatch", self._dispatch, x, topk_idx, topk_weights,
                                       cumulative_local_expert_recv_stats, num_experts, num_max_tokens_per_rank,
                                       expert_alignment, num_sms, previous_event, previous_event_before_epilogue,
                                       async_with_compute_stream, allocate_on_comm_stream, handle, do_handle_copy,
                                       do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf)

    def _dispatch(self, x, topk_idx, topk_weights, stats, num_experts, num_max_tokens_per_rank, expert_alignment,
                  num_sms, previous_event, before_epilogue, async_op, allocate_on_comm_stream, handle, do_handle_copy,
                  do_cpu_sync, do_expand, do_zero_padding, use_tma_sf):
        # V2's flags as its binding converts them (its own test passes 0 and 1)
        async_op, do_handle_copy = flag("async_with_compute_stream", async_op), flag("do_handle_copy", do_handle_copy)
        flag("allocate_on_comm_stream", allocate_on_comm_stream)
        do_cpu_sync = None if do_cpu_sync is None else flag("do_cpu_sync", do_cpu_sync)
        do_expand, do_zero_padding = flag("do_expand", do_expand), flag("do_zero_padding", do_zero_padding)
        use_tma_sf = flag("use_tma_aligned_col_major_sf", use_tma_sf)
        assert not do_zero_padding or do_expand, "do_zero_padding is for do_expand=True, as in V2"
        sms = self._hand_sms(num_sms)
        _wait(previous_event, before_epilogue)  # our kernels then follow the caller's stream
        x, packed = _unpacked_scales(x)
        x = _row_major_scales(x) if _needs_row_major_copy(x) else x
        rows = x[0] if isinstance(x, tuple) else x
        if handle is not None:
            assert topk_idx is None, "a cached dispatch takes its routing from the handle: pass topk_idx=None"
            assert not do_cpu_sync, "Cannot do CPU sync with cached handle"
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle must be an EPHandle from megatron_ep.deep_ep's ElasticBuffer.dispatch, got "
                                f"{type(handle).__name__}")
            for name, given, kept in (("num_experts", num_experts, handle.num_experts),
                                      ("expert_alignment", expert_alignment, handle.expert_alignment),
                                      ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
                                      ("do_expand", do_expand or None, handle.do_expand or None)):
                if given is not None and given != kept:
                    raise ValueError(f"megatron_ep.deep_ep ElasticBuffer.dispatch: {name}={given} differs from the "
                                     f"handle's {kept}")
            out = self.runtime.dispatch(x, handle=handle.ours, topk_weights=topk_weights, async_op=async_op)
            recv_idx = None if handle.do_expand else handle.recv_topk_idx
            return self._finish(out, recv_idx, handle, packed, do_zero_padding, use_tma_sf, stats=None)
        if topk_idx is None or num_experts is None:
            raise TypeError("megatron_ep.deep_ep ElasticBuffer.dispatch needs topk_idx and num_experts (or a handle)")
        T = rows.shape[0]
        tmax = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        if T > tmax:
            raise ValueError(f"megatron_ep.deep_ep ElasticBuffer.dispatch: {T} tokens exceed num_max_tokens_per_rank={tmax}")
        align = 1 if expert_alignment is None else expert_alignment
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        R, K = self.num_ranks, topk_idx.shape[1]
        L = num_experts // R if num_experts % R == 0 else 0
        worst = 0
        if not sync:  # V2's worst-case rows (every rank may send its num_max_tokens_per_rank here)
            worst = R * tmax * min(K, L) + (align - 1) * L if do_expand else R * tmax
            worst = max(worst, 1)
            if worst > self._worst_reserved:
                self._reserve(rows, K, num_experts, worst)
        # each row's source token for recv_src_metadata: our kernels write it (one int a row)
        out = self.runtime.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, permute=do_expand,
                                    expert_alignment=align, num_worst_tokens=worst, host_counts=sync,
                                    async_op=async_op, rank_counts=True, source_index=True)
        counts = list(out.tokens_per_expert_host) if sync else []  # (expanded: the padded lengths already)
        if sync and not do_expand and align > 1:
            counts = [_align(c, align) for c in counts]
        num_rows = _rows(out.x).shape[0]
        h = EPHandle(out.handle, do_expand=do_expand, num_max_tokens_per_rank=tmax, num_sms=sms,
                     topk_idx=out.handle.topk_idx if do_handle_copy else topk_idx,
                     num_recv_tokens=num_rows if not do_expand else (None if sync else R * tmax),
                     num_expanded_tokens=num_rows if do_expand else 0, num_recv_tokens_per_expert_list=counts,
                     tokens_per_expert=out.tokens_per_expert, rank=self.rank, recv_topk_idx=out.topk_idx,
                     row_expert=out.row_expert)
        h.sms_asked = num_sms
        if do_handle_copy and (h.topk_idx is topk_idx or h.topk_idx.data_ptr() == topk_idx.data_ptr() != 0):
            h.topk_idx = topk_idx.clone()  # (a backend that keeps the caller's tensor: V2's copy)
        return self._finish(out, None if do_expand else out.topk_idx, h, packed, do_zero_padding, use_tma_sf, stats)

    def _finish(self, out, recv_idx, handle: EPHandle, packed: bool, zero_padding: bool, use_tma_sf: bool, stats):
        """The 5-tuple from our DispatchOutput: the epilogue's work (statistics, zeroed padding,
        packed or column-major scales) after the call's event, on the stream its outputs are on."""
        ev = getattr(out.event, "event", None)
        stream = self.runtime.comm_stream if ev is not None else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        data, scales = (out.x if isinstance(out.x, tuple) else (out.x, None))
        weights = out.topk_weights
        with ctx:
            if stream is not None:
                stream.wait_event(ev)
            if stats is not None:
                stats.add_(handle.num_unaligned_recv_tokens_per_expert.to(stats.dtype))
            if zero_padding and out.row_expert is not None:
                pad = out.row_expert < 0
                # through the bytes: +0 is all-zero bits in every row dtype, and CPU tensors of an
                # FP8 dtype have no masked_fill
                data.view(torch.uint8).masked_fill_(pad.unsqueeze(1), 0)
                if scales is not None:
                    scales.masked_fill_(pad.unsqueeze(1), 0)
                if weights is not None:
                    weights.masked_fill_(pad, 0)
            if scales is not None and packed:
                from ..core.fp8 import pack_ue8m0

                scales = pack_ue8m0(scales, checked=False)
            if scales is not None and use_tma_sf:
                n = scales.shape[0]
                cm = torch.empty_strided(scales.shape, (1, _align(n, 4)), dtype=scales.dtype, device=scales.device)
                cm.copy_(scales)
                scales = cm
            done = None
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
        recv_x = (data, scales) if scales is not None else data
        # V2 always returns an event; a synchronous call's is recorded after it on the caller's stream
        return recv_x, recv_idx, weights, handle, EventOverlap(EventHandle(done))

    def _reserve(self, rows: torch.Tensor, K: int, num_experts: int, worst: int) -> None:
        """A dispatch without the CPU sync cannot grow our buffer (no host sync), so the first one
        with more worst-case rows than reserved reserves room for them first: a collective decided
        on the call's arguments alone, which V2 requires to be the same on every rank. Not under
        CUDA-graph capture: make one such call before capturing."""
        self.runtime.reserve(max_tokens=rows.shape[0], hidden=rows.shape[1], dtype_bytes=rows.element_size(), topk=K,
                             num_experts=num_experts, combine_rows=max(worst, self.num_ranks * rows.shape[0]))
        self._worst_reserved = worst

    # ---------------------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """(combined_x, combined_topk_weights, event): combined_x[t] = the biases + the rows that
        came from token t (unweighted), one fp32 accumulator in V2's reference order (ranks by
        their last top-k slot of t; expanded, each rank's rows summed in slot order and rounded
        to x's dtype first, or with allow_multiple_reduction=False every slot's row added in
        slot order), so the result is V2's bit for bit; topk_weights ([rows, K], or [rows]
        expanded) summed back to [T, K]. num_sms=0: the handle's."""
        self._alive("combine")
        return self.runtime.layer_call("combine", self._combine, x, handle, topk_weights, bias, num_sms, previous_event,
                                       previous_event_before_epilogue, async_with_compute_stream,
                                       allocate_on_comm_stream)

    def _combine(self, x, handle, topk_weights, bias, num_sms, previous_event, before_epilogue, async_op,
                 allocate_on_comm_stream):
        async_op = flag("async_with_compute_stream", async_op)  # (as V2's binding converts it)
        flag("allocate_on_comm_stream", allocate_on_comm_stream)
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle from megatron_ep.deep_ep's ElasticBuffer.dispatch, got "
                            f"{type(handle).__name__}")
        self._hand_sms(num_sms or handle.sms_asked)  # 0: what the dispatch asked (V2: the handle's count)
        _wait(previous_event, before_epilogue)
        out = self.runtime.combine(x, handle.ours, topk_weights, async_op=async_op, bias=bias,
                                   single_reduction=self._single_reduction)
        event = from_ours(out.event)
        return out.x, out.weights, event if event.event is not None else EventOverlap(EventHandle())

    # ------------------------------------------------------------------ V2's other parts
    def _absent(self, name: str):
        raise NotImplementedError(f"megatron_ep.deep_ep ElasticBuffer.{name}: V2's {name} is not supported "
                                  f"(Engram, pipeline send/recv and all-gather (AGRS) are not in megatron_ep; "
                                  f"docs/deep-ep.md)")

    def __getattr__(self, name: str):
        if name in _V2_ONLY:
            return functools.partial(self._absent, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_V2_ONLY = frozenset(("get_engram_storage_size_hint", "engram_write", "engram_fetch", "get_pp_buffer_size_hint",
                      "pp_set_config", "pp_send", "pp_recv", "get_agrs_num_max_session_bytes",
                      "get_agrs_buffer_size_hint", "agrs_set_config", "create_agrs_session", "destroy_agrs_session",
                      "agrs_new_session", "agrs_get_inplace_tensor", "all_gather"))

