"""Host collectives over a Buffer's control group (gloo or NCCL), for the runtime's rare
agreements (sizing, creation, destroy): never inside a call."""

from __future__ import annotations

import time

import torch.distributed as dist

from ...core.errors import CommTimeoutError


def bounded_barrier(group, timeout_s: float, what: str) -> None:
    """A barrier that gives up: a rank that never joins (it called something else, or died)
    raises CommTimeoutError here after `timeout_s` instead of a hang (gloo's own timeout is 30
    minutes). Polling the barrier's work, so it behaves the same on gloo and NCCL groups."""
    work = dist.barrier(group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"megatron_ep: {what} is collective, and not every rank of the group joined it within "
                                   f"{timeout_s:.0f}s; this rank keeps its communication memory")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    work.wait()


def gather(obj, group) -> list:
    """Every rank's `obj` in `group` rank order (collective)."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def largest(needs: list) -> dict:
    """Every key of the ranks' needs, at its largest value."""
    return {k: max(d.get(k, 0) or 0 for d in needs) for k in set().union(*needs)}
