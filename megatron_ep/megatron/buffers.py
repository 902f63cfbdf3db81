"""One megatron_ep.Buffer per communication group, shared by every MoE layer (as Megatron's
DeepEP integration shares one deep_ep.Buffer).

Backend choice: the `MEGATRON_EP_BACKEND` environment variable ("torch", "cuda", "auto"; read and
checked by backend.py, a bad value is an error; default "auto" = "cuda" when the tokens live on a
GPU and the extension is built, else "torch"). The cuda Buffer sizes its communication region at
the first dispatch (agreed over the group) and grows it collectively when a later dispatch needs
more; growing never invalidates tensors or handles that earlier layers keep for backward.
`MEGATRON_EP_MAX_TOKENS_PER_RANK` sizes it up front (and becomes a hard limit),
`MEGATRON_EP_COMBINE_ROWS` fixes its combine area,
`MEGATRON_EP_RANKS_PER_NODE` sets the ranks per NVLink domain (default: the ranks sharing a host;
fewer makes virtual nodes: the two-level internode path on one machine, for tests).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..core import envs
from ..core.buffer import Buffer, cuda_backend_available
from . import backend as backend_env

_BUFFERS: Dict[Tuple[object, str], Buffer] = {}  # (group, backend); keeps the group alive


def choose_backend(device: torch.device) -> str:
    backend = backend_env.from_env() or "auto"
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" and cuda_backend_available() else "torch"
    if backend == "cuda" and device.type != "cuda":
        raise ValueError("MEGATRON_EP_BACKEND=cuda but the MoE tokens are not on a GPU")
    return backend


def cuda_options_from_env() -> dict:
    """The cuda Buffer's options the environment sets (a bad value raises naming it)."""
    return dict(check_inputs=envs.flag("MEGATRON_EP_CHECK_INPUTS"),  # costs a host sync
                max_tokens_per_rank=envs.integer("MEGATRON_EP_MAX_TOKENS_PER_RANK", None, 1),
                combine_rows=envs.integer("MEGATRON_EP_COMBINE_ROWS", None, 1),
                ranks_per_node=envs.integer("MEGATRON_EP_RANKS_PER_NODE", None, 1))


def get_buffer(group, x: torch.Tensor, num_experts: int, topk: int, num_sms: Optional[int],
               expert_major_align: int = 0) -> Buffer:
    """The group's Buffer, created on first use (a collective for the cuda backend).
    expert_major_align: 0 for rank-major dispatch, else the expert-major segment alignment."""
    backend = choose_backend(x.device)
    key = (group, backend)
    buf = _BUFFERS.get(key)
    if buf is None:
        if backend == "torch":
            buf = Buffer(group, backend="torch")
        else:
            buf = Buffer(group, backend="cuda", hidden=x.shape[-1], num_experts=num_experts, max_topk=topk,
                         num_sms=num_sms, dtype_bytes=x.element_size(), combine_bytes=max(2, x.element_size()),
                         max_alignment=max(1, expert_major_align), **cuda_options_from_env())
        _BUFFERS[key] = buf
    if buf.max_tokens_per_rank is not None and x.shape[0] > buf.max_tokens_per_rank:
        raise ValueError(f"MoE layer got {x.shape[0]} tokens on this rank but MEGATRON_EP_MAX_TOKENS_PER_RANK is "
                         f"{buf.max_tokens_per_rank}; raise it, or unset it to let the buffer grow")
    return buf


def fail_call(buf: Buffer, op: str, error: BaseException) -> None:
    """Raise `error` as this rank's failure of its next `op` call on `buf` ("dispatch",
    "low_latency_dispatch", ...), before any communication: the failure is published to the
    peers, which raise PeerFailedError naming it instead of waiting for a call this rank never
    makes (the Buffer stays usable). Every refusal a layer makes after its peers may already be
    inside the call goes through here."""
    with buf._call(op):
        raise error


def fail_dispatch(buf: Buffer, message: str) -> None:
    """`fail_call` of a dispatch with ValueError(message)."""
    fail_call(buf, "dispatch", ValueError(message))


def reset_buffers() -> None:
    """Drop every cached Buffer (collective for cuda buffers: call on all ranks)."""
    for buf in _BUFFERS.values():
        buf.destroy()
    _BUFFERS.clear()
