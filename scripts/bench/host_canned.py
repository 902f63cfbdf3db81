"""`bench host --canned`: the Python of our native calls alone, on this machine's CPU, with no GPU.

The cuda intranode path runs over the recorder of tests/test_intranode_path.py, each extension
entry returning one saved result, so what is timed is Buffer's call scope, the replays, the path's
plan and the handle: everything of a call's host time but its crossing's own steps, its argument
and result conversions and the freeing of its outputs. One process, one rank, a small routing (the
Python does not depend on the sizes). Only ratios between ops, or between commits on one machine,
mean anything; the GPU machine's CPU runs this code a few times slower.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Patch:
    """monkeypatch's setattr, outside pytest (the recorder's constructor takes one)."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _buffer():
    """A one-rank Buffer whose cuda backend is the intranode path over the recorder, each entry
    returning its first result again."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import megatron_ep as mep
    from megatron_ep import buffer as B
    from megatron_ep.cuda.backend import CudaBackend
    import test_intranode_path as rec

    path = rec.make_path(_Patch())
    saved = {}
    for name in ("dispatch_first_call", "dispatch_call", "combine_call"):
        def canned(*args, _entry=getattr(path.fake, name), _name=name, **kw):
            if _name not in saved:
                saved[_name] = _entry(*args, **kw)
            return saved[_name]
        setattr(path.fake, name, canned)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    buf = mep.Buffer(dist.group.WORLD, backend="torch", check_inputs=False)
    be = CudaBackend.__new__(CudaBackend)
    be.path, be.rt, be._ll, be.rank, be.num_ranks, be.ranks_per_node = path, path.rt, None, 0, 1, 1
    buf._impl, buf.backend = be, "cuda"
    enter = B._CallScope.__enter__

    def entered(scope):  # the recorder reads the call in flight
        call = enter(scope)
        path.holder["call"] = call
        return call
    B._CallScope.__enter__ = entered
    return buf, rec


def run(reps: int = 15, loop: int = 200) -> str:
    buf, rec = _buffer()
    x = torch.randn(rec.T, rec.H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 5], [1, 2], [7, -1], [3, 4], [6, 0], [2, 5]])
    w = torch.rand(rec.T, rec.K)
    state = {}

    def dispatch():
        state["out"] = buf.dispatch(x, idx, w, num_experts=rec.E)

    dispatch()
    handle, rows = state["out"].handle, state["out"].x.clone()
    ops = {"dispatch": dispatch, "cached_dispatch": lambda: buf.dispatch(x, handle=handle),
           "combine": lambda: buf.combine(rows, handle)}
    lines = ["| op | Python µs per call (canned crossings, this CPU) |", "|---|---:|"]
    for name, fn in ops.items():
        for _ in range(loop):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(loop):
                fn()
            times.append((time.perf_counter() - t0) / loop * 1e6)
        lines.append(f"| {name} | {statistics.median(times):.1f} |")
    dist.destroy_process_group()
    return "\n".join(lines)
