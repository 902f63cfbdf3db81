"""What `Buffer` hands a backend for one normal call, after it checked every argument: one
object instead of a dozen positional arguments passed through Buffer, the backend and the path
(megatron_ep/core/buffer.py -> reference.py / cuda/backend.py -> cuda/paths/). The paths read the fields; none
changes them. Slotted, not frozen: a frozen dataclass sets each field through object.__setattr__,
which costs a few microseconds of host time per call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .types import Activation, DispatchHandle, EventOverlap


@dataclass(slots=True)
class DispatchRequest:
    x: Activation  # [T, H] bf16/fp32, or an FP8 (rows, scales) pair
    topk_idx: Optional[torch.Tensor]  # [T, K] int64, -1 = unused slot; None for a cached dispatch
    topk_weights: Optional[torch.Tensor]  # [T, K] fp32, moved along with the rows
    num_experts: int
    permute: bool  # expert-major rows (segments padded to `expert_alignment`) instead of rank-major
    expert_alignment: int
    handle: Optional[DispatchHandle] = None  # a cached dispatch: the routing of an earlier one
    host_counts: bool = False  # also return the per-expert counts as a host list
    num_worst_tokens: int = 0  # worst-case sized outputs, no host sync
    async_op: bool = False  # the caller's stream does not wait for the call
    previous_event: Optional[EventOverlap] = None  # what the communication waits for first
    # the cuda intranode path's notify orders a destination's rows by (expert or rank, group,
    # source rank, token), the T rows of every rank being this many contiguous groups of T /
    # token_groups: the internode path's intranode stage sets one per source node (that order is
    # then the contract's); Buffer leaves it at 1
    token_groups: int = 1
    # the cuda intranode path crosses into this entry instead of its own, with the same arguments:
    # the internode path's (csrc/intranode/composed.h): a cached dispatch's, whose kernel runs the
    # push, or a new routing's (not worst-case sized), which runs the RDMA hop first
    fused: Optional[Callable] = None
    # rows past num_worst_tokens: "drop" (counted in num_dropped) or "raise" (every rank raises
    # WorstCaseOverflowError before any row moves, where the backend learns the counts on the host)
    on_overflow: str = "drop"
    # check a new routing's ids (range, repeats in a token) before any row moves: Buffer's
    # check_inputs as a level (checks.IDS_*); each backend checks where it costs least (the cuda
    # intranode path in notify, which the host waits for anyway; elsewhere on the host, one sync,
    # which IDS_CHECKED_FREE does not spend)
    check_ids: int = 0
    # also keep every rank's tokens per destination in the handle (DispatchHandle.rank_counts)
    rank_counts: bool = False
    # a new routing's handle also keeps each rank-major row's source token
    # (DispatchHandle.recv_src_token; the torch backend always does): DeepEP V2's recv_src_metadata
    source_index: bool = False


@dataclass(slots=True)
class CombineRequest:
    x: torch.Tensor  # [rows the dispatch delivered, H]
    handle: DispatchHandle
    weights: Optional[torch.Tensor] = None  # per-row weights, scattered back to [T, K]
    async_op: bool = False
    previous_event: Optional[EventOverlap] = None
    # the cuda intranode path's combine crosses into this entry instead of its own, with the same
    # arguments: the internode path's, whose kernel runs the intranode combine into `out` (y,
    # weights) when given, then the RDMA hop (csrc/intranode/composed.h)
    fused: Optional[Callable] = None
    out: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None
    # (bias0, bias1): [T, H] tensors of x's dtype or None each, the start of every token's fp32
    # sum (Buffer.combine's `bias`, checked there)
    bias: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)
    # expert-major: every slot's row a term of its own in slot order, no per-rank partial rounded
    # first (Buffer.combine's `single_reduction`; DeepEP V2's allow_multiple_reduction=False)
    single_reduction: bool = False
