"""One megatron_ep.Buffer per communication group, shared by every MoE layer (as Megatron's
DeepEP integration shares one deep_ep.Buffer).

Backend choice: the `MEGATRON_EP_BACKEND` environment variable ("torch", "cuda", "auto";
default "auto" = "cuda" when the tokens live on a GPU and the extension is built, else
"torch"). The cuda backend sizes its communication memory for `max_tokens_per_rank`; that is
agreed across the group once, at creation (`MEGATRON_EP_MAX_TOKENS_PER_RANK`, else the largest
first-call token count of any rank), because re-creating it later is collective and ranks see
different token counts.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..buffer import Buffer, cuda_backend_available

_BUFFERS: Dict[Tuple[object, str], Buffer] = {}  # (group, backend); keeps the group alive


def choose_backend(device: torch.device) -> str:
    backend = os.environ.get("MEGATRON_EP_BACKEND", "auto").strip().lower()
    if backend not in ("torch", "cuda", "auto"):
        raise ValueError(f"MEGATRON_EP_BACKEND must be torch, cuda or auto, got {backend!r}")
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" and cuda_backend_available() else "torch"
    if backend == "cuda" and device.type != "cuda":
        raise ValueError("MEGATRON_EP_BACKEND=cuda but the MoE tokens are not on a GPU")
    return backend


def _agreed_max_tokens(group, num_tokens: int, device: torch.device) -> int:
    env = os.environ.get("MEGATRON_EP_MAX_TOKENS_PER_RANK")
    if env:
        return int(env)
    t = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _combine_rows(R: int, max_tokens: int, num_experts: int, topk: int, expert_major_align: int) -> Optional[int]:
    """Rows the combine area must hold. Rank-major (deepep): the Buffer's default (R * T).
    Expert-major (hybridep): a rank can receive one row per (token, local expert) from every
    rank, R * T * min(topk, local experts), plus each segment's padding; averages are far lower
    but a dropless layer must not fail on a skewed batch. MEGATRON_EP_COMBINE_ROWS overrides."""
    env = os.environ.get("MEGATRON_EP_COMBINE_ROWS")
    if env:
        return int(env)
    if not expert_major_align:
        return None
    L = num_experts // R
    return R * max_tokens * min(topk, L) + L * (expert_major_align - 1)


def get_buffer(group, x: torch.Tensor, num_experts: int, topk: int, num_sms: Optional[int],
               expert_major_align: int = 0) -> Buffer:
    """The group's Buffer, created on first use (a collective for the cuda backend).
    expert_major_align: 0 for rank-major dispatch, else the expert-major segment alignment
    (sizes the combine area for the expert-major worst case)."""
    backend = choose_backend(x.device)
    key = (group, backend)
    buf = _BUFFERS.get(key)
    # What the cuda buffer is sized for; all of it comes from the config (hidden, top-k,
    # experts, dtype), so every rank of the group re-creates it together when a layer needs more.
    need = (x.shape[-1], topk, num_experts, x.element_size(), expert_major_align)
    sized = getattr(buf, "_mep_sized_for", None)
    if buf is not None and backend == "cuda" and any(n > h for n, h in zip(need, sized)):
        buf.destroy()
        buf = None
    if buf is None:
        sized = need if sized is None else tuple(map(max, need, sized))  # never shrink on re-creation
        if backend == "torch":
            buf = Buffer(group, backend="torch")
        else:
            hidden, topk_max, experts, elem, align = sized
            max_tokens = _agreed_max_tokens(group, x.shape[0], x.device)
            check = os.environ.get("MEGATRON_EP_CHECK_INPUTS", "0") == "1"  # costs a host sync
            rows = _combine_rows(dist.get_world_size(group), max_tokens, experts, topk_max, align)
            buf = Buffer(group, backend="cuda", max_tokens_per_rank=max_tokens, hidden=hidden,
                         num_experts=experts, max_topk=topk_max, num_sms=num_sms, check_inputs=check,
                         dtype_bytes=elem, combine_bytes=elem, combine_rows=rows)
        buf._mep_sized_for = sized
        _BUFFERS[key] = buf
    if buf.max_tokens_per_rank is not None and x.shape[0] > buf.max_tokens_per_rank:
        raise ValueError(f"MoE layer got {x.shape[0]} tokens on this rank but the megatron_ep buffer was sized for "
                         f"{buf.max_tokens_per_rank}; set MEGATRON_EP_MAX_TOKENS_PER_RANK to the largest per-rank token count")
    return buf


def reset_buffers() -> None:
    """Drop every cached Buffer (collective for cuda buffers: call on all ranks)."""
    for buf in _BUFFERS.values():
        buf.destroy()
    _BUFFERS.clear()
