"""NVSHMEM for both NVSHMEM paths of the cuda backend (low-latency, and internode's RDMA domain): started
once per process from a torch group, with the unique-id bootstrap (rank 0's id broadcast over
that group), from the pip package nvidia-nvshmem-cu13 through the extension `_C_nvshmem`.

Environment defaults, set only where the user has not: the settings known to work with several
PEs per GPU under MPS (docs/design.md §5), no InfiniBand probing when every rank is on one host, and a
symmetric heap sized by the first buffer, or by reserve() where the process will hold more than one.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ...core.checks import fail
from .hosts import host_names
from .collectives import gather

ENV = {"NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "NVSHMEM_DISABLE_MNNVL": "1"}
HEAP_MARGIN = 64 << 20  # NVSHMEM's own symmetric allocations (barriers, signals)
_state: dict = {}  # once per process: {"n_pes": int, "heap": bytes, "sized_by": what, "held": {owner: (what, bytes)}}
_floor: dict = {}  # reserve()'s largest ask before NVSHMEM starts: {"bytes": int, "what": str}


def reserve(heap_bytes: int, what: str) -> None:
    """Ask that NVSHMEM, when it starts in this process, start with a symmetric heap of at least
    `heap_bytes` (`what` asks, for the error): for a caller that will hold several NVSHMEM
    buffers, whose first would otherwise size the heap for itself alone (the heap cannot grow
    once started). No effect once NVSHMEM has started or where NVSHMEM_SYMMETRIC_SIZE is set."""
    if heap_bytes > _floor.get("bytes", 0):
        _floor.update(bytes=int(heap_bytes), what=what)


def pes_for(group, rank: int, num_ranks: int, device: torch.device, need_bytes: int, ext, what: str,
            owner: object) -> list:
    """Collective: NVSHMEM started (once per process) with room for a symmetric buffer of
    `need_bytes` (`what`, for the error), held by `owner` until release(owner); and every rank's
    PE in group rank order."""
    # room for two buffers: a re-created Buffer allocates before the old one is freed
    floor = _floor.get("bytes", 0)
    heap = init(group, rank, num_ranks, device, max(2 * need_bytes, floor), ext,
                f"{what}, twice its need" if 2 * need_bytes >= floor else _floor["what"])
    short = heap_short(need_bytes, what, heap, exclude=owner)
    fail(short is None, short, RuntimeError)
    _state.setdefault("held", {})[id(owner)] = (what, need_bytes)
    return gather(ext.my_pe(), group)


def release(owner: object) -> None:
    """`owner`'s buffer was freed: its bytes of the heap are free again."""
    _state.get("held", {}).pop(id(owner), None)


def heap_short(need_bytes: int, what: str, heap: int, exclude: object = None) -> Optional[str]:
    """None when `need_bytes` more may fit a heap of `heap` bytes beside the buffers held now (but
    `exclude`'s, which it replaces), else the error: what holds the heap, and the variable to set.
    NVSHMEM's own share is not counted against the need (HEAP_MARGIN is what the heap is sized
    with for it, far more than it takes): where that share is what leaves too little,
    nvshmem_malloc's own error says so."""
    held = {k: v for k, v in _state.get("held", {}).items() if k != id(exclude)}
    used = sum(b for _, b in held.values())
    free = heap - used
    if need_bytes <= free:
        return None
    holders = "; ".join(f"{w}: {b} bytes" for w, b in held.values()) or "no buffer"
    return (f"{what} needs {need_bytes} bytes of NVSHMEM's symmetric heap and {max(free, 0)} are free. The heap has "
            f"{heap} bytes, fixed when NVSHMEM started in this process (sized then by {_state.get('sized_by', 'its first use')}); "
            f"it holds {holders}, and NVSHMEM keeps some for itself "
            f"(allow {HEAP_MARGIN}). Set NVSHMEM_SYMMETRIC_SIZE to at least {used + need_bytes + HEAP_MARGIN} before this "
            f"process's first NVSHMEM buffer (a Buffer's first internode or low-latency call)")


def init(group, rank: int, num_ranks: int, device: torch.device, heap_bytes: int, ext, what: str = "") -> int:
    """Start NVSHMEM over `group` unless this process already did (collective the first time),
    its heap of heap_bytes (`what` sized it, for the error) unless NVSHMEM_SYMMETRIC_SIZE says;
    returns the symmetric heap's size in bytes."""
    if _state:
        fail(_state["n_pes"] == num_ranks, f"NVSHMEM was started for {_state['n_pes']} PEs by an earlier group; an "
                                           f"NVSHMEM buffer must span all of them (this group has {num_ranks})", RuntimeError)
        return _state["heap"]
    hosts = host_names(group)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if len(set(hosts)) == 1:  # one node: P2P carries everything; skip probing InfiniBand
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    if "NVSHMEM_SYMMETRIC_SIZE" in os.environ:
        what = "NVSHMEM_SYMMETRIC_SIZE, set before it started"
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap_bytes + HEAP_MARGIN))
    ids = gather(ext.unique_id() if rank == 0 else None, group)
    ext.init(ids[0], rank, num_ranks, device.index)
    _state.update(n_pes=ext.n_pes(), heap=parse_size(os.environ["NVSHMEM_SYMMETRIC_SIZE"]), sized_by=what or "its first use",
                  held={})
    return _state["heap"]


def parse_size(text: str) -> int:
    """NVSHMEM's size syntax: a number with an optional K/M/G/T suffix (powers of 1024)."""
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)

