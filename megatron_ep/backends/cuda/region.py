"""The communication region of each rank (control block, handshake counters, staging, combine
area, output pool), shared by CUDA IPC and planned by the C++ `plan_region`
(megatron_ep._protocol): its sizing, its growth and the views into it.

Sized from the Buffer's hints, or -- without hints -- by the first call, agreed over the group;
then grown collectively whenever a synchronous dispatch finds (from notify's group-wide counts,
identical on every rank) that any rank needs more. Growing never frees memory a live tensor
points into: pooled outputs and zero-copy views keep their old region alive.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ...core import protocol
from ...core.errors import PeerFailedError
from .collectives import bounded_barrier, gather, largest

log = logging.getLogger("megatron_ep")

# The keys of a call's need that size the region (the hint names of csrc/ipc/region_layout.h).
_NEED_KEYS = ("max_tokens", "hidden", "dtype_bytes", "combine_bytes", "max_topk", "max_experts")


class Region:
    """One rank's region over `group`. `runtime` is the extension's Runtime over it (None until
    created, and after close)."""

    _CAPACITY = ("max_tokens", "x_row_bytes", "scale_cols", "max_topk", "max_experts", "comb_rows", "comb_row_bytes")

    def __init__(self, ext, group, rank: int, num_ranks: int, device: torch.device, timeout_s: float,
                 stream: torch.cuda.Stream, hints: dict):
        self.ext, self.group, self.rank, self.num_ranks = ext, group, rank, num_ranks
        self.device, self.timeout_s, self.stream = device, timeout_s, stream
        self.hints = {k: v for k, v in hints.items() if v is not None}
        self.hints["num_ranks"] = num_ranks
        self.runtime = None
        self.plan = None  # the RegionLayout (megatron_ep._protocol), once created
        self.error_word = None  # HostInfo::error in mapped host memory, once created (CallLedger.check)
        self.base = 0
        self.grown = 0
        self.closed = False
        self._fitted: set = set()  # needs known to fit this region
        self._comb_views: list = []  # weak references to zero-copy combine inputs handed out

    @property
    def ready(self) -> bool:
        return self.runtime is not None

    def create_if_hinted(self, num_sms: int) -> None:
        """Collective where the hints size it: the region now, not at the first call."""
        if "max_tokens" in self.hints and "hidden" in self.hints:
            self._create(self.hints, num_sms)

    def _create(self, hints: dict, num_sms: int = 0) -> None:
        """Collective: plan, allocate and open every rank's region."""
        plan = protocol.plan_region(hints)
        if plan.max_experts > protocol.MAX_EXPERTS:
            raise ValueError(f"num_experts={plan.max_experts} exceeds the cuda backend's {protocol.MAX_EXPERTS}")
        if not (1 <= plan.max_topk <= protocol.MAX_TOPK):
            raise ValueError(f"max_topk must be in 1..{protocol.MAX_TOPK}")
        # the allocation can fail on one rank (memory): every rank still reaches the gather, so
        # the others raise PeerFailedError naming it instead of waiting there
        try:
            runtime = self.ext.Runtime(self.device.index, self.rank, self.num_ranks, plan, self.timeout_s)
            mine = bytes(runtime.ipc_handle())
        except Exception as exc:
            gather({"failed": protocol.failure_message(exc)}, self.group)
            raise
        every = gather(mine, self.group)
        failed = [r for r, h in enumerate(every) if isinstance(h, dict)]
        if failed:
            runtime.close()
            raise PeerFailedError(f"megatron_ep: allocating the communication region: rank {failed[0]} failed: "
                                  f"{every[failed[0]]['failed']}")
        runtime.open_peers(every)
        runtime.set_comm_stream(self.stream)
        dist.barrier(group=self.group)
        self.runtime, self.plan, self.hints = runtime, plan, dict(hints)
        # the kernels' error word, read in place by every call's entry check (no crossing)
        self.error_word = ctypes.c_int.from_address(runtime.error_address())
        self._fitted = set()
        self.base = runtime.base_ptr()
        log.info("megatron_ep cuda buffer on rank %d: %.1f MiB region (tokens %d, row bytes %d, combine rows %d)%s",
                 self.rank, plan.total / 2**20, plan.max_tokens, plan.x_row_bytes, plan.comb_rows,
                 f", {num_sms} SMs" if num_sms else "")

    def first_use(self, needs: Optional[dict] = None, failure: Optional[BaseException] = None) -> None:
        """Without sizing hints, the first call sizes the region: every rank's needs, agreed over
        the group (collective; every rank's first call gets here -- a rank whose first call
        failed before that comes with its failure, and every peer raises it)."""
        if self.ready:
            return
        local = {"failed": protocol.failure_message(failure)} if failure is not None else merge_hints(self.hints, needs)
        every = gather(local, self.group)
        failed = [r for r, d in enumerate(every) if "failed" in d]
        if failed:
            if failure is not None:
                return  # the caller re-raises its own error
            raise protocol.peer_failed_error(protocol.Call(protocol.OP["dispatch"], 1), failed[0], every[failed[0]]["failed"])
        self._create(merge_hints(*every))

    def first_use_in(self, call: protocol.Call, needs: dict) -> None:
        """`first_use` inside `call`, before the call's own first exchange: the sizing exchange
        reports a failed rank to every rank itself (nothing is owed while it runs); after it, the
        peers wait for this rank at the call's first exchange again."""
        call.settle()
        self.first_use(needs)
        call.owe(protocol.Pending.FIRST)

    def fits(self, need: dict) -> Optional[str]:
        """None if a call with these needs (hint keys) fits the region as it is, else what does not
        (needs that fitted are remembered: the steady state plans nothing per call)."""
        # token and combine-row counts change every call: compared directly; the rest (row
        # widths, top-k, experts) is planned once per distinct value
        p = self.plan
        rest = dict(need)
        max_tokens, combine_rows = rest.pop("max_tokens", 0), rest.pop("combine_rows", 0)
        counts_fit = max_tokens <= p.max_tokens and combine_rows <= p.comb_rows
        key = tuple(rest.items())  # (in the order the caller built it: another order is one more plan, not an error)
        if counts_fit and key in self._fitted:
            return None
        new = protocol.plan_region(self._hints_for(need))
        short = [f"{k} {getattr(new, k)} > {getattr(p, k)}" for k in self._CAPACITY if getattr(new, k) > getattr(p, k)]
        if not short and len(self._fitted) < 4096:
            self._fitted.add(key)
        return ", ".join(short) or None

    def _hints_for(self, need: dict) -> dict:
        h = merge_hints(self.hints, {k: int(v) for k, v in need.items() if k in _NEED_KEYS})
        h["combine_rows"] = max(self.plan.comb_rows, int(need.get("combine_rows", 0)))
        return h

    def grow_if_needed(self, need: dict) -> bool:
        """At a synchronous point where every rank holds the same `need` (notify's group-wide
        counts and the agreed signature): re-create the region larger if anything does not fit.
        Collective, but every rank takes the same decision from the same numbers."""
        short = self.fits(need)
        if short is None:
            return False
        h = self._hints_for(need)
        new = protocol.plan_region(h)
        # headroom, so that a slowly growing need does not re-create the region every few calls
        if new.max_tokens > self.plan.max_tokens:
            h["max_tokens"] = _round_up(int(h["max_tokens"] * 1.25), 256)
        if new.comb_rows > self.plan.comb_rows:
            h["combine_rows"] = _round_up(int(h["combine_rows"] * 1.25), 256)
        self._replace(h, short)
        return True

    def reserve(self, need: dict) -> None:
        """Collective: size (or grow) the region for the largest of every rank's `need`."""
        if not self.ready:
            self.first_use(need)  # agrees on the largest needs itself
        else:
            self.grow_if_needed(merge_hints(*gather(dict(need), self.group)))

    def _replace(self, hints: dict, why: str) -> None:
        log.info("megatron_ep: growing the cuda buffer on rank %d (%s)", self.rank, why)
        self.stream.synchronize()
        dist.barrier(group=self.group)  # nobody reads the old regions any more
        old = self.runtime
        self._create(hints)
        old.close()  # unmaps the peers; this rank's old memory lives while tensors point into it
        self.grown += 1

    def close(self) -> None:
        """Collective: every rank stops using the regions; memory that live tensors point into
        (pooled outputs, views) is freed when they die."""
        if self.runtime is None:
            return
        self.stream.synchronize()
        bounded_barrier(self.group, self.timeout_s, "destroy")
        self.error_word = None  # before the memory behind it goes
        self.runtime.close()
        self.runtime = None
        self.closed = True

    # ------------------------------------------------------------------------------ views
    def scratch_free(self) -> bool:
        """Whether the combine area may serve as the expert-major push's rank-major buffer (no
        kernel uses it between calls, and every use is on our stream in call order): not while
        a zero-copy combine input handed out is alive."""
        return not any(r() is not None for r in self._comb_views)

    def holds(self, t: torch.Tensor, offset: int) -> bool:
        """Whether t starts at `offset` in this rank's region (a zero-copy input)."""
        return starts_at(t, self.base + offset)

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.runtime.view(offset, list(shape), dtype)

    def combine_view(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """A caller's tensor over the combine area (zero-copy combine input); while one is alive
        the area is not lent out as dispatch scratch."""
        t = self.view(self.plan.comb_x, [rows, hidden], dtype)
        self._comb_views = [r for r in self._comb_views if r() is not None] + [weakref.ref(t)]
        return t


def starts_at(t: torch.Tensor, address: int) -> bool:
    """Whether t's first element lies at `address`. An empty tensor's data_ptr() is 0 wherever its
    storage is, so a view of no rows over the region (a rank that received nothing) is placed by
    its storage: the ranks' combine variants depend on it and must agree."""
    ptr = t.data_ptr()
    if ptr == 0 and t.numel() == 0:
        ptr = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return ptr == address


def merge_hints(*hints: dict) -> dict:
    """Region hints that fit every one of `hints` (the owner of that rule): counts at their
    largest, and rows by their width in bytes. Taking the largest hidden size and, separately,
    the largest element size over-asks: a 7168-wide bf16 hint and a 256-wide fp32 call both fit
    14336-byte rows, not 7168 x 4 = 28672 (and a sync-free call would then raise that it does
    not fit). The element sizes become the widest row over the largest hidden size, rounded up."""
    merged = largest(list(hints))
    hidden = merged.get("hidden", 0)
    if hidden:
        for key in ("dtype_bytes", "combine_bytes"):
            widest = max((h.get("hidden", 0) or 0) * (h.get(key) or protocol.REGION_HINTS[key]) for h in hints)
            merged[key] = max(1, -(-widest // hidden))
    return merged


def _round_up(n: int, a: int) -> int:
    return (max(n, 1) + a - 1) // a * a
