"""Result and handle types shared by every backend.

Field names are part of the public API (docs/design.md §2): other teams' tests read them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple, Union

import torch

# bf16/fp32 tensor, or (fp8 [T, H], scales [T, H/128] fp32)
Activation = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


class EventOverlap:
    """A recorded CUDA event (or nothing on CPU) that a caller can make its stream wait on.

    Returned by async operations so callers overlap their own compute with communication.
    """

    def __init__(self, event: Optional["torch.cuda.Event"] = None):
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def __repr__(self) -> str:
        return f"EventOverlap({'cuda' if self.event is not None else 'none'})"


@dataclass
class DispatchLayout:
    """Routing summary of one rank's tokens; counts take each token once per rank."""

    tokens_per_rank: torch.Tensor  # [R] int64
    tokens_per_expert: torch.Tensor  # [E] int64, (token, expert) pairs
    token_in_rank: torch.Tensor  # [T, R] bool


@dataclass
class _Routing:
    """What every handle records about the routing it was built from."""

    backend: str
    num_ranks: int
    rank: int
    num_experts: int
    num_tokens: int  # T on this rank (source side)
    topk: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


@dataclass
class DispatchHandle(_Routing):
    """Everything combine and cached dispatch need to replay one routing.

    Public fields describe the routing; `state` holds the backend's private data.
    """

    permute: bool = False
    expert_alignment: int = 1
    num_recv_rows: int = 0  # rows of the dispatch output: N (rank-major) or M (expert-major)
    tokens_per_expert: Optional[torch.Tensor] = None  # [E_local] int64 on the device
    topk_idx: Optional[torch.Tensor] = None  # [T, K] the source-side routing of this handle
    num_worst_tokens: int = 0  # >0: outputs were worst-case sized (valid prefix + padding)
    state: Any = field(default=None, repr=False)
    buffer_id: int = 0
    call_seq: int = 0  # the call that built it (combine and cached dispatch name it in their signature)
    # From the count exchange (no extra communication), int32 on the device: [R, R] tokens rank s
    # sends to rank d in this routing (the torch backend; the cuda intranode path when the dispatch
    # asked, rank_counts=True), and its column of this rank, [R] tokens each rank sends here (the
    # cuda internode path too); else None
    rank_counts: Optional[torch.Tensor] = None
    recv_rank_counts: Optional[torch.Tensor] = None
    # their inclusive prefix sums over source ranks (DeepEP's rank_prefix_matrix, and its column of
    # this rank), where rank_counts (recv_rank_counts) are given
    rank_prefix: Optional[torch.Tensor] = None
    recv_rank_prefix: Optional[torch.Tensor] = None
    # [N] int32: the source token (its index on its source rank) of each rank-major row received
    # here, before any worst-case drop; and, expert-major, [N, K] int32: the output row of each
    # (rank-major row, slot), -1 for slots elsewhere or dropped. The torch backend fills both; the
    # cuda intranode path where the dispatch asked (source_index=True; its rank-major rows past
    # the real ones, without a host sync, -1), else None
    recv_src_token: Optional[torch.Tensor] = None
    recv_slot_row: Optional[torch.Tensor] = None
    # the backend's replays of the last cached dispatch and combine along this routing
    # (megatron_ep/core/replay.py; None until one passed, and on a copy)
    dispatch_replay: Any = field(default=None, repr=False, compare=False)
    combine_replay: Any = field(default=None, repr=False, compare=False)


@dataclass
class DispatchOutput:
    x: Activation  # rows received on this rank; same kind (tensor or fp8 tuple) as the input
    topk_idx: Optional[torch.Tensor]  # rank-major: [N, K] local ids / -1; expert-major: None
    topk_weights: Optional[torch.Tensor]  # rank-major: [N, K]; expert-major: [M] (0 on pad rows)
    row_expert: Optional[torch.Tensor]  # expert-major: [M] int32 local id, -1 on pad; else None
    tokens_per_expert: torch.Tensor  # [E_local] int64 on x's device
    handle: DispatchHandle
    tokens_per_expert_host: Optional[List[int]] = None  # only when asked (host_counts=True)
    event: Optional[EventOverlap] = None
    # rows this rank did not receive because they fell past num_worst_tokens (0-d int64 on x's
    # device; always 0 without num_worst_tokens)
    num_dropped: Optional[torch.Tensor] = None


@dataclass
class CombineOutput:
    x: torch.Tensor  # [T, H] sum of the rows that came from each token
    weights: Optional[torch.Tensor] = None  # [T, K] per-row weights scattered back, or None
    event: Optional[EventOverlap] = None


@dataclass
class LowLatencyHandle(_Routing):
    max_tokens_per_rank: int = 0
    hidden: int = 0
    layout_range: Optional[torch.Tensor] = None  # [E_local, R, 2] int32: (begin, count) per source
    # the same as DeepEP's layout_range, [E_local, R] int64 begin << 32 | count, where the backend
    # writes it with the rest (the cuda kernels; None on the torch backend)
    packed_layout: Optional[torch.Tensor] = None
    src_token: Optional[torch.Tensor] = None  # [E_local, R * max_tokens_per_rank] int32, -1 unused
    topk_idx: Optional[torch.Tensor] = field(default=None, repr=False)  # the routing the dispatch got
    topk_idx_version: Optional[int] = None  # its version counter then (the combine checks both)
    state: Any = field(default=None, repr=False)
    buffer_id: int = 0
    call_seq: int = 0


@dataclass
class LowLatencyDispatchOutput:
    x: Activation  # [E_local, R * max_tokens_per_rank, H] (fp8 tuple or bf16); rows past count unspecified
    count: torch.Tensor  # [E_local] int32
    handle: LowLatencyHandle
    event: Optional[EventOverlap] = None
    hook: Optional[Any] = None  # receive half, when the send half returned early (recv hook)
