"""What the cuda backend can tell a benchmark or a profiler about a Buffer, without reaching into
its internals. Every hook works on any Buffer: where the backend (torch) or the path has nothing
to report it yields an empty list, returns an empty dict or None.

    with tracing.phases(buf) as marks:     # [(phase name, torch.cuda.Event)], in order
        buf.dispatch(...)                  #   recorded on the buffer's communication stream
    tracing.counters(buf)                  # {"num_sms", "push_sms", "rdma_blocks", "pool": {...}}
    run = tracing.notify_only(buf, topk_idx, num_experts)   # the notify kernels alone, or None
    with tracing.low_latency_stamps(buf) as stamps: ...     # the decode kernels' %globaltimer stamps

Phase marks: each is the end of a kernel phase on the communication stream (the first, "start",
when the call's first kernel is about to be launched), so the time between two consecutive
events is that phase, waits for peers and for the host included. Enabling them costs one event
record per phase; nothing is recorded outside the `with`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch


def low_latency_points() -> Tuple[str, ...]:
    """The low-latency kernels' trace points, in order (LLTracePoint and its names in
    csrc/low_latency/api.h, read from the built extension)."""
    from ..backends.cuda import extension

    return tuple(extension.load_nvshmem().TRACE_POINT_NAMES)


def _runtime(buf):
    """The cuda runtime (region, stream, marks) of `buf`'s normal path, or None (torch backend)."""
    return getattr(buf._backend(), "rt", None)


@contextmanager
def phases(buf) -> Iterator[List[Tuple[str, "torch.cuda.Event"]]]:
    """Within the block, the cuda backend's normal paths append (phase, CUDA event) pairs to the
    yielded list as they launch their kernels. Read the events after a synchronize."""
    rt = _runtime(buf)
    marks: List[Tuple[str, "torch.cuda.Event"]] = []
    if rt is None:
        yield marks
        return
    before, rt.trace = rt.trace, marks
    try:
        yield marks
    finally:
        rt.trace = before


def counters(buf) -> Dict[str, object]:
    """SM counts and the output pool's counters so far (monotonic: subtract two readings for what
    happened in between). {} on the torch backend."""
    rt = _runtime(buf)
    if rt is None:
        return {}
    out: Dict[str, object] = {"num_sms": rt.budget.num_sms, "push_sms": rt.budget.push_sms}
    blocks = getattr(getattr(buf._backend(), "path", None), "num_blocks", None)
    out["rdma_blocks"] = int(blocks) if isinstance(blocks, int) else None
    if rt.region.ready:
        out["pool"] = dict(rt.region.runtime.pool_stats())  # named by the runtime (csrc/ipc/runtime.h)
    return out


@contextmanager
def host_steps(buf) -> Iterator[Dict[str, Dict[str, float]]]:
    """Within the block, the extension times the steps of each one-crossing entry of the
    intranode path (notify_call, dispatch_call, combine_call; csrc/ipc/host_clock.h; a new
    routing's dispatch_first_call charges its notify half to notify_call and the rest to
    dispatch_call): where a crossing's host time goes, which a Python profiler sees as one
    call. The yielded dict is filled when the block ends: {entry: {"calls": n, step: ns in all}}. It stays empty on the
    torch backend and for calls without such entries (low-latency)."""
    rt = getattr(buf._backend(), "rt", None)
    native = rt.region.runtime if rt is not None else None
    out: Dict[str, Dict[str, float]] = {}
    if native is None or not hasattr(native, "set_host_clock"):
        yield out
        return
    native.host_clock(True)
    native.set_host_clock(True)
    try:
        yield out
    finally:
        native.set_host_clock(False)
        out.update(native.host_clock(True))


def notify_only(buf, topk_idx: torch.Tensor, num_experts: int) -> Optional[Callable[[int], None]]:
    """The intranode path's notify kernels alone (per-rank counts, the call exchange, row
    positions, and the routing's copy a dispatch makes with them): what a dispatch pays before any
    row moves. Returns run(T), which makes one collective call of `buf` (its own call number and
    signature, so every rank must run it together) over the first T tokens, on the communication
    stream, the caller's stream waiting for it; None where the buffer has no such kernels (torch
    backend, other paths)."""
    from ..backends.cuda.paths.intranode import IntranodePath

    impl = buf._backend()
    path, rt = getattr(impl, "path", None), getattr(impl, "rt", None)
    if not isinstance(path, IntranodePath):
        return None
    notify = path.kernels.notify_call
    K = topk_idx.shape[1]

    def run(t: int) -> None:
        with buf._call("dispatch") as call:
            call.set(topk=K, num_experts=num_experts, expert_alignment=1)
            compute = torch.cuda.current_stream()
            call.sends(notify, runtime=rt.region.runtime, sig=call.sig, topk_idx=topk_idx[:t], num_experts=num_experts,
                       expert_alignment=1, permute=False, num_worst_tokens=0, token_groups=1, check_ids=False,
                       rank_counts=False, tag=0, previous_event=None, marks=None, wait_s=-1.0, async_op=False)
            compute.wait_stream(rt.stream)

    return run


@contextmanager
def low_latency_stamps(buf) -> Iterator[Optional[torch.Tensor]]:
    """Within the block, the low-latency kernels stamp %globaltimer (ns) per block and point into
    the yielded int64 tensor [2 (dispatch, combine), blocks, len(low_latency_points())] (0 where
    not stamped; csrc/low_latency/api.h). Yields None on the torch backend. The low-latency path
    is created (collectively) if it does not exist yet."""
    impl = buf._backend()
    make = getattr(impl, "_low_latency", None)
    if make is None:
        yield None
        return
    ll = make()
    stamps = torch.zeros(2, ll.ext.MAX_BLOCKS, ll.ext.TRACE_POINTS, dtype=torch.int64, device="cuda")
    ll.buf.set_trace(stamps)
    try:
        yield stamps
    finally:
        ll.buf.set_trace(None)
