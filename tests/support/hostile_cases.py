"""Hostile use of a Buffer, run on every rank of a DistPool, on either backend: handles and calls
of two Buffers mixed up, an allocation that fails on one rank in the middle of a call, a call
on a Buffer one rank destroyed, arguments that must be refused by name. Each case says what
every rank must raise (and how fast), and that the Buffers work afterwards where the README's
failure table says they do.

The cuda backend gives each Buffer its own memory, so calls on different Buffers cannot meet at
one handshake there: they wait for each other until the timeout (run_cuda_timeouts).
"""

from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from cases import make_buffer, poison_
from fault_cases import Faults
from megatron_ep.core import output_hook as hooks
from megatron_ep.core.errors import CallMismatchError, CommTimeoutError, PeerFailedError
from oracle import split_x


def _restore_hook():
    import os

    hooks.set_output_hook(poison_ if os.environ.get("MEP_POISON") == "1" else None)


def run_two_buffers(backend: str = "torch", device: str = "cpu") -> list:
    """Two Buffers on one group, used in step, then rank 0 calls one while its peers call the
    other (a combine with each Buffer's own handle, then a dispatch): every rank raises
    CallMismatchError naming the Buffers, and both Buffers work afterwards (the aborted call
    counts on neither). Torch backend (shared collectives); see run_cuda_timeouts for cuda."""
    a = Faults(make_buffer(backend, max_tokens_per_rank=64), backend, device)
    b = Faults(make_buffer(backend, max_tokens_per_rank=64), backend, device)
    R, rank = a.R, a.rank
    if R == 1:
        return []
    out_a = a.buf.dispatch(a.x, a.idx, a.w, num_experts=a.E)
    out_b = b.buf.dispatch(b.x, b.idx, b.w, num_experts=b.E)
    mine, out = (a.buf, out_a) if rank == 0 else (b.buf, out_b)

    a.expect("combine on different Buffers", lambda: mine.combine(torch.ones_like(split_x(out.x)[0]), out.handle),
             CallMismatchError, "different Buffers", sync=True)
    b.still_works("combine on different Buffers")
    a.expect("dispatch on different Buffers", lambda: mine.dispatch(a.x, a.idx, a.w, num_experts=a.E),
             CallMismatchError, "different Buffers")
    b.still_works("dispatch on different Buffers")
    for f in (a, b):
        f.buf.destroy()
    return a.errors + b.errors


def run_alloc_fails_mid_call(backend: str = "torch", device: str = "cpu") -> list:
    """An allocation that fails on the last rank after the count exchange (the first receive
    buffer or output of the call): that rank raises its own error, every other rank raises
    PeerFailedError naming it within the fault limit (not the process group's timeout), and the
    Buffer works afterwards."""
    f = Faults(make_buffer(backend, max_tokens_per_rank=64), backend, device)
    R, rank = f.R, f.rank
    if R == 1:
        return []
    bad = rank == R - 1

    def fail_once(t):
        hooks.set_output_hook(None)
        raise torch.OutOfMemoryError("out of memory (injected by the test)")

    def dispatch():
        if bad:
            hooks.set_output_hook(fail_once)
        try:
            f.buf.dispatch(f.x, f.idx, f.w, num_experts=f.E)
        finally:
            _restore_hook()

    f.expect("allocation fails on one rank after the exchange", dispatch,
             torch.OutOfMemoryError if bad else PeerFailedError, "injected by the test" if bad else f"rank {R - 1} failed",
             sync=True)  # (cuda: the peers' push kernel stops at the handshake; synchronize() raises)
    f.buf.destroy()
    return f.errors


def run_destroyed_on_one_rank(backend: str = "torch", device: str = "cpu") -> list:
    """Rank 0 destroys its Buffer, then every rank calls it: rank 0 raises that it was destroyed,
    and its peers raise PeerFailedError with that message, at once (torch backend: destroy is
    local there; the cuda backend's collective destroy is in run_cuda_timeouts)."""
    f = Faults(make_buffer(backend, max_tokens_per_rank=64), backend, device)
    R, rank = f.R, f.rank
    if rank == 0:
        f.buf.destroy()
    if R == 1:
        return []
    errors = raises(f.tag("call after a destroy on one rank"), lambda: f.buf.dispatch(f.x, f.idx, f.w, num_experts=f.E),
                    RuntimeError if rank == 0 else PeerFailedError, "was destroyed")
    f.buf.destroy()
    return errors


def raises(tag: str, fn, errors, text: str, limit_s: float = 2.0) -> list:
    """fn must raise one of `errors` mentioning `text` within `limit_s`."""
    start = time.monotonic()
    try:
        fn()
        return [f"{tag}: no error"]
    except errors as exc:
        if text not in str(exc):
            return [f"{tag}: {type(exc).__name__} {str(exc)!r} does not mention {text!r}"]
        took = time.monotonic() - start
        return [f"{tag}: raised after {took:.1f}s (limit {limit_s}s)"] if took > limit_s else []
    except Exception as exc:  # noqa: BLE001 - a wrong error type is a failure too
        return [f"{tag}: unexpected {type(exc).__name__}: {exc}\n{traceback.format_exc()}"]


def run_bad_arguments(backend: str = "torch", device: str = "cpu") -> list:
    """Arguments that must be refused by name, on every rank alike, before anything is sent; the
    Buffer works afterwards."""
    f = Faults(make_buffer(backend, max_tokens_per_rank=64), backend, device)
    x, idx, w, E, T = f.x, f.idx, f.w, f.E, f.T
    buf = f.buf
    empty_h = torch.zeros((T, 0), dtype=torch.bfloat16, device=device)
    f.expect("hidden 0", lambda: buf.dispatch(empty_h, idx, w, num_experts=E), ValueError, "hidden size 0")
    f.expect("num_experts 1e12", lambda: buf.dispatch(x, idx, w, num_experts=1e12), TypeError, "num_experts")
    f.expect("num_experts 2**62", lambda: buf.dispatch(x, idx, w, num_experts=2 ** 62), ValueError, "num_experts")
    f.expect("num_worst_tokens 10**12", lambda: buf.dispatch(x, idx, w, num_experts=E, num_worst_tokens=10 ** 12),
             ValueError, "num_worst_tokens")
    f.expect('permute="False"', lambda: buf.dispatch(x, idx, w, num_experts=E, permute="False"), TypeError, "permute")
    f.expect("x as a list", lambda: buf.dispatch([x] * 6, idx, w, num_experts=E), TypeError, "x must be a tensor")
    if backend == "torch":  # the same checks of Buffer on cuda, where the low-latency suite has its own
        f.expect("low-latency max_tokens_per_rank 1e9",
                 lambda: buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=10 ** 9, use_fp8=False),
                 ValueError, "max_tokens_per_rank")
        f.errors += _low_latency_routing(f)
    buf.synchronize()
    buf.destroy()
    return f.errors


def _low_latency_routing(f) -> list:
    """A low-latency combine given another routing than its dispatch is refused; an equal one (a
    copy) is accepted."""
    buf, x, idx, w, E, T = f.buf, f.x, f.idx, f.w, f.E, f.T
    ll = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T, use_fp8=False)
    y = ll.x if not isinstance(ll.x, tuple) else ll.x[0]
    other = idx.flip(0).contiguous()
    if not torch.equal(other, idx):
        f.expect("low-latency combine with another routing",
                 lambda: buf.low_latency_combine(y.to(torch.bfloat16), other, w, ll.handle), ValueError,
                 "differs from the routing its dispatch got")
    back = buf.low_latency_combine(y.to(torch.bfloat16), idx.clone(), w, ll.handle)  # equal values: accepted
    if back.shape != (T, x.shape[1]):
        return [f.tag(f"low-latency combine with an equal routing: shape {tuple(back.shape)}")]
    return []


def run_all(backend: str = "torch", device: str = "cpu") -> list:
    errors = []
    for fn in (run_two_buffers, run_alloc_fails_mid_call, run_destroyed_on_one_rank, run_bad_arguments):
        if backend == "cuda" and fn in (run_two_buffers, run_destroyed_on_one_rank):
            continue  # the cuda backend's answer is a timeout: run_cuda_timeouts, in a pool of its own
        try:
            errors += fn(backend, device)
        except Exception:  # noqa: BLE001 - report, keep the ranks going
            errors.append(f"{fn.__name__} raised on rank {dist.get_rank()}:\n{traceback.format_exc()}")
    return errors


def run_cuda_timeouts(_cfg=None) -> list:
    """cuda backend, short timeout (MEGATRON_EP_TIMEOUT_S in the pool): (1) rank 0 combines on Buffer A
    while its peers combine on B: each rank's kernel waits for the others in its own Buffer's
    memory, and every rank raises CommTimeoutError within the timeout (no wrong rows, no hang);
    (2) rank 0 destroys Buffer C alone (destroy is collective) while its peers dispatch on it:
    the peers raise CommTimeoutError naming the handshake, and rank 0's destroy raises
    CommTimeoutError instead of waiting for them."""
    R, rank = dist.get_world_size(), dist.get_rank()
    errors = []
    tag = f"[cuda R={R} rank={rank}]"
    limit = float(__import__("os").environ.get("MEGATRON_EP_TIMEOUT_S", "3")) + 20

    def timed(name, fn):
        start = time.monotonic()
        try:
            fn()
            errors.append(f"{tag} {name}: no error")
        except CommTimeoutError:
            if time.monotonic() - start > limit:
                errors.append(f"{tag} {name}: CommTimeoutError after {time.monotonic() - start:.0f}s (limit {limit:.0f}s)")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{tag} {name}: {type(exc).__name__}: {exc}")

    a = Faults(make_buffer("cuda", max_tokens_per_rank=64), "cuda", "cuda")
    b = Faults(make_buffer("cuda", max_tokens_per_rank=64), "cuda", "cuda")
    out_a = a.buf.dispatch(a.x, a.idx, a.w, num_experts=a.E)
    out_b = b.buf.dispatch(b.x, b.idx, b.w, num_experts=b.E)
    mine, out = (a.buf, out_a) if rank == 0 else (b.buf, out_b)

    def mixed_combine():
        mine.combine(torch.ones_like(split_x(out.x)[0]), out.handle)
        mine.synchronize()
    timed("combine on different Buffers", mixed_combine)

    c = Faults(make_buffer("cuda", max_tokens_per_rank=64), "cuda", "cuda")
    dist.barrier()
    if rank == 0:
        timed("destroy on one rank", c.buf.destroy)
    else:
        timed("dispatch while rank 0 destroys", lambda: c.buf.dispatch(c.x, c.idx, c.w, num_experts=c.E))
        time.sleep(float(__import__("os").environ.get("MEGATRON_EP_TIMEOUT_S", "3")) + 5)  # until rank 0's destroy gave up
        dist.barrier()  # the barrier rank 0's destroy left behind
    return errors
