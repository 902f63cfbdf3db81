"""INTERNAL ACCESS: the only place benchmarks touch megatron_ep internals (and the one private
attribute of megatron-core they read). Everything else in the benchmarks uses public APIs.

Each accessor returns None when what it needs is missing (the runtime changes under it; the
torch backend has none of it), and the report then says "n/a"; `guarded` does the same for a
call that fails inside. A public tracing hook in megatron_ep would replace this module.

    tracer(buf)            `buf._impl.rt.trace`: the cuda runtime's phase marks (CUDA events)
    pool_stats(buf)        `buf._impl.rt.rt.pool_stats`: the output pool's counters
    rdma_blocks(buf)       `buf._impl.path.num_blocks`: the internode RDMA-domain kernels' blocks
    push_sms(buf)          `buf._impl.rt.push_sms`: the push kernel's own SM cap
    notify_kernels(...)    `buf._impl.path.kernels.notify` launched alone (bumps `buf._seq`)
    low_latency_trace(buf) `buf._impl._low_latency()`: the decode kernels' trace stamps
    comm_manager(disp)     megatron-core's `token_dispatcher._comm_manager`
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# Trace points of csrc/low_latency/api.h (LLTracePoint), in order.
TRACE_POINTS = ("entry", "released", "zero", "cast", "sent", "arrived", "copied", "end", "scanned", "stored")


def guarded(call):
    """For measurements through megatron_ep internals: None ("n/a") if the hook no longer fits."""
    try:
        return call()
    except (AttributeError, TypeError, KeyError, RuntimeError) as exc:
        print(f"[rank {dist.get_rank()}] internal hook failed, reported as n/a: {type(exc).__name__}: {exc}", flush=True)
        return None


def _runtime(buf):
    return getattr(getattr(buf, "_impl", None), "rt", None)


def tracer(buf):
    """INTERNAL: `buf._impl.rt.trace` -- while it is a list, the cuda runtime appends (phase
    name, CUDA event) pairs recorded on its communication stream. Returns begin()/end() or None."""
    rt = _runtime(buf)
    if rt is None or not hasattr(rt, "trace"):
        return None

    class Tracer:
        def begin(self):
            rt.trace = []

        def end(self):
            trace, rt.trace = rt.trace, None
            return trace or []

    return Tracer()


def pool_stats(buf):
    """INTERNAL: `buf._impl.rt.rt.pool_stats()` -- the output pool's (GPU-side waits, host waits,
    misses) so far (csrc/ipc/pool.h), or None when missing."""
    rt = getattr(_runtime(buf), "rt", None)
    return getattr(rt, "pool_stats", None)


def rdma_blocks(buf):
    """INTERNAL: `buf._impl.path.num_blocks` -- the blocks the internode path's RDMA-domain
    kernels run on (None when missing, or on another path)."""
    n = getattr(getattr(getattr(buf, "_impl", None), "path", None), "num_blocks", None)
    return int(n) if isinstance(n, int) else None


def push_sms(buf):
    """INTERNAL: `buf._impl.rt.push_sms` -- the push kernel's own SM cap, or None."""
    return getattr(_runtime(buf), "push_sms", None)


def notify_kernels(buf, idx, num_experts, num_ranks):
    """INTERNAL: the intranode notify kernels alone (chunk counts, the call exchange, row
    positions), launched as a dispatch call of `buf` would (its own sequence number and
    signature), on the buffer's communication stream. Returns (with T tokens, with no tokens)
    callables, or None."""
    impl = getattr(buf, "_impl", None)
    path, rt = getattr(impl, "path", None), getattr(impl, "rt", None)
    if path is None or rt is None or not hasattr(path, "kernels"):
        return None
    from megatron_ep import protocol as P

    T, K = idx.shape
    L = num_experts // num_ranks
    rp = torch.empty((T, num_ranks), dtype=torch.int32, device=idx.device)
    sp = torch.empty((T, K), dtype=torch.int32, device=idx.device)
    ri = torch.empty(P.RECV_INFO["header"] + 3 * L, dtype=torch.int32, device=idx.device)
    limits = torch.empty(num_ranks, dtype=torch.int32, device=idx.device)
    tpe = torch.empty(L, dtype=torch.int64, device=idx.device)
    dropped = torch.empty((), dtype=torch.int64, device=idx.device)

    def run(t):
        buf._seq += 1  # a call number of its own, as Buffer._call takes one: the peers' signatures match on it
        call = P.Call(P.OP["dispatch"], buf._seq).set(topk=K, num_experts=num_experts, expert_alignment=1)
        rt.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(rt.stream):
            path.kernels.notify(rt.rt, call.sig, idx[:t], num_experts, 1, False, 0, rp[:t], sp[:t], ri, limits, tpe,
                                dropped, 0)
        torch.cuda.current_stream().wait_stream(rt.stream)

    return (lambda: run(T), lambda: run(0))


@contextlib.contextmanager
def low_latency_trace(buf):
    """INTERNAL: `buf._impl._low_latency()` -- the low-latency kernels' trace stamps attached
    for the block: yields a zeroed int64 tensor [2 (dispatch, combine), blocks, len(TRACE_POINTS)]
    the kernels stamp (%globaltimer ns per block and point, 0 where not stamped;
    csrc/low_latency/api.h), detached on exit."""
    ll = buf._impl._low_latency()
    trace = torch.zeros(2, ll.ext.MAX_BLOCKS, ll.ext.TRACE_POINTS, dtype=torch.int64, device="cuda")
    ll.buf.set_trace(trace)
    try:
        yield trace
    finally:
        ll.buf.set_trace(None)


def comm_manager(dispatcher):
    """megatron-core's private `token_dispatcher._comm_manager`: the flex dispatcher's manager
    (megatron_ep's or Megatron's own), or None (another dispatcher, or none)."""
    return getattr(dispatcher, "_comm_manager", None)
