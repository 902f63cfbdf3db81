"""Single-process baselines of the normal path, timed once per run (no SM knob): a plain
device copy of the bytes a rank receives (the HBM roofline on one GPU), and an index_select
of the received rows into the expert-major layout (a separate permute)."""

from __future__ import annotations

import torch


def expert_major_perm(recv_idx: torch.Tensor, L: int) -> torch.Tensor:
    """Rank-major row of every expert-major row (unpadded): the separate-permute baselines."""
    rows, slots = (recv_idx >= 0).nonzero(as_tuple=True)
    order = torch.argsort(recv_idx[rows, slots], stable=True)
    return rows[order]


def run(timer, rows: torch.Tensor, recv_idx: torch.Tensor, L: int, out: dict) -> None:
    """out["copy"]: copy of `rows` (the received rank-major rows); out["permute"]: their
    index_select into expert order (`recv_idx`: their local top-k expert ids, -1 elsewhere)."""
    src, dst = rows.clone(), torch.empty_like(rows)
    out["copy"] = timer(lambda: dst.copy_(src))
    perm = expert_major_perm(recv_idx, L)
    out["permute"] = timer(lambda: rows.index_select(0, perm))
