"""The one owner of the expert-major layout rules: segment alignment, where each (row, local
expert) pair lands, Megatron's routing map -> top-k slots, and the declared way dispatched rows
carry their layout to the experts. The torch backend, the Megatron managers and the grouped-GEMM
experts all import these; the kernels implement the same rules (csrc/intranode/) and
the test oracle re-derives them independently (tests/support/oracle.py).

Expert-major order: rows grouped by local expert; inside an expert, by source rank, then source
token (i.e. the order of the rank-major rows they come from); each expert's segment padded with
zero rows to a multiple of the alignment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

_ROWS_ATTR = "_mep_expert_rows"


# The expert-major layout's padding rule, for every caller (permute, experts, managers, budget):
# an expert's segment is its row count rounded up to a multiple of the alignment. The kernels
# apply the same rule on the device (csrc/intranode/notify.cu).
def round_up(n: int, alignment: int) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return -(-n // alignment) * alignment


def padded_counts(counts: torch.Tensor, alignment: int) -> torch.Tensor:
    """Segment lengths: each count rounded up to a multiple of `alignment`."""
    return (counts + alignment - 1) // alignment * alignment


def padded_host_counts(counts: List[int], alignment: int) -> List[int]:
    """padded_counts of counts held on the host."""
    return [round_up(int(c), alignment) for c in counts]


@dataclass
class Placement:
    """Where the (row, slot) pairs of a rank-major layout land in the expert-major one."""

    rows: torch.Tensor  # [P] rank-major row of each pair, in expert-major order
    slots: torch.Tensor  # [P] its top-k slot
    pos: torch.Tensor  # [P] its expert-major row
    counts: torch.Tensor  # [L] pairs per local expert
    padded: torch.Tensor  # [L] segment lengths
    num_rows: int  # M = sum(padded)


def place(local_idx: torch.Tensor, num_local_experts: int, alignment: int,
          host_counts: Optional[List[int]] = None) -> Placement:
    """local_idx [N, K]: local expert ids of the rank-major rows (-1 elsewhere). With the
    per-expert counts already on the host, the output size needs no device->host sync."""
    device = local_idx.device
    rows, slots = (local_idx >= 0).nonzero(as_tuple=True)  # (row, slot) order
    experts = local_idx[rows, slots]
    order = torch.argsort(experts, stable=True)  # by expert; rows keep their order inside
    rows, slots, experts = rows[order], slots[order], experts[order]
    if host_counts is not None:
        counts = torch.tensor(host_counts, dtype=torch.int64, device=device)
        num_rows = sum(padded_host_counts(host_counts, alignment))
    else:
        counts = torch.bincount(experts, minlength=num_local_experts)
        num_rows = None
    padded = padded_counts(counts, alignment)
    first = torch.cumsum(counts, 0) - counts
    seg_start = torch.cumsum(padded, 0) - padded
    pos = seg_start[experts] + torch.arange(experts.numel(), device=device) - first[experts]
    return Placement(rows, slots, pos, counts, padded, int(padded.sum()) if num_rows is None else num_rows)


def row_experts(placement: Placement, local_idx: torch.Tensor) -> torch.Tensor:
    """[M] int32 local expert of every expert-major row, -1 on pad rows (DeepGEMM's m_indices)."""
    out = torch.full((placement.num_rows,), -1, dtype=torch.int32, device=local_idx.device)
    out[placement.pos] = local_idx[placement.rows, placement.slots].to(torch.int32)
    return out


def clamp_segments(padded: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Segment lengths cut to the first `num_rows` rows (a worst-case sized output that some
    rows did not fit): every segment ends inside the output."""
    ends = torch.cumsum(padded, 0)
    return ends.clamp(max=num_rows) - (ends - padded).clamp(max=num_rows)


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's routing map [T, E] bool + probs [T, E] -> top-k ids [T, topk] (the routed
    experts in ascending id order, -1 past them) and their probs (0 there). Deterministic (no
    ties: the key is unique per routed expert) and shape-static (torch.compile-safe). A row that
    routes more than `topk` experts does not fit: callers reject it with `routing_map_error`
    before any communication, or count it with `routed_past_topk` where no host sync is allowed."""
    T, E = routing_map.shape
    rank_key = torch.arange(E, 0, -1, device=routing_map.device, dtype=torch.int32)
    keyed = torch.where(routing_map, rank_key, torch.zeros_like(rank_key))
    _, idx = torch.topk(keyed, topk, dim=-1)
    valid = routing_map.gather(1, idx)
    p = probs if probs.dtype in (torch.float32, torch.float64) else probs.float()
    weights = torch.where(valid, p.gather(1, idx), torch.zeros((), dtype=p.dtype, device=p.device))
    return idx.masked_fill(~valid, -1), weights


def routed_pairs(routing_map: torch.Tensor, probs: torch.Tensor, drop_and_pad: bool) -> torch.Tensor:
    """The (token, expert) pairs a dispatch delivers, from Megatron's router output [T, E]: the
    routing map, less -- in drop-and-pad mode (moe_pad_expert_input_to_capacity) -- the pairs the
    router added to fill every expert to its capacity. Those carry probability 0 (the router
    multiplies the map into the probs): they add 0 x the expert's output to their token and their
    gradient reaches no parameter, so leaving them out gives the same outputs and gradients as
    Megatron's alltoall, which computes them. Megatron's own _DeepepManager reads such a map the
    same way (a 0 prob is a -1 slot). Shape-static (no host sync)."""
    return routing_map & (probs != 0) if drop_and_pad else routing_map


def routed_past_topk(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """[T] int64: how many routed experts each row has past the first `topk` (0 on a valid map;
    shape-static, no host sync)."""
    return (routing_map.sum(dim=-1, dtype=torch.int64) - topk).clamp(min=0)


def routing_map_error(routing_map: torch.Tensor, topk: int) -> Optional[str]:
    """What is wrong with `routing_map` [T, E] for a top-k dispatch, naming the first row that
    routes more than `topk` experts (Megatron's alltoall would send it to all of them; keeping
    some would drop the others silently), or None. One device->host sync; None under CUDA-graph
    capture, which cannot sync."""
    from .checks import capturing

    if routing_map.numel() == 0 or capturing():
        return None
    past = routed_past_topk(routing_map, topk)
    if not bool((past > 0).any()):
        return None
    row = int((past > 0).nonzero()[0, 0])
    experts = routing_map[row].nonzero().flatten().tolist()
    return (f"routing map row {row} routes {len(experts)} experts {experts}, more than top-k = {topk} "
            f"({int((past > 0).sum())} of {routing_map.shape[0]} rows do): a top-k dispatch cannot route them all")


# ------------------------------------------------------------------------------ side channel
@dataclass
class ExpertRows:
    """What dispatched expert-major rows carry to the experts: each row's local expert (-1 on
    pad rows, DeepGEMM's m_indices), the alignment every segment is a multiple of, and -- for
    worst-case sized outputs, whose Megatron segments end in a tail of pad rows -- the real
    segments, so the GEMMs stop where the data ends (the tail's output is zeroed, not computed)."""

    row_expert: torch.Tensor
    alignment: int
    tokens_per_expert: Optional[torch.Tensor] = None


def attach_expert_rows(x: torch.Tensor, row_expert: torch.Tensor, alignment: int,
                       tokens_per_expert: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tag the tensor a dispatcher hands to the experts (Megatron passes this very tensor on)."""
    setattr(x, _ROWS_ATTR, ExpertRows(row_expert, alignment, tokens_per_expert))
    return x


def worst_case_segments(x: torch.Tensor, row_expert: torch.Tensor, tokens_per_expert: torch.Tensor,
                        alignment: int) -> torch.Tensor:
    """A worst-case sized expert-major output `x`: tag it with its real segments (the grouped
    GEMMs stop there, the pad tail's output is zeroed) and return the segment lengths Megatron's
    contract wants, which cover every row: the last segment takes the pad tail."""
    attach_expert_rows(x, row_expert, alignment, tokens_per_expert)
    full = tokens_per_expert.clone()
    full[-1] += x.shape[0] - full.sum()
    return full


def expert_rows_of(x: torch.Tensor) -> Optional[ExpertRows]:
    """The layout a dispatcher attached to `x`, if it still matches its row count."""
    rows = getattr(x, _ROWS_ATTR, None)
    if rows is None or rows.row_expert.shape[0] != x.shape[0]:
        return None
    return rows
