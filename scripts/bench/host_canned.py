"""`bench host --canned`: the Python of our calls alone, natively and through megatron_ep.deep_ep,
on this machine's CPU, with no GPU.

The cuda intranode path runs over the recorder of tests/unit/test_intranode_path.py (a path per Buffer),
and the low-latency path over tests/unit/test_low_latency_path.py's, each extension entry returning one
saved result, so what is timed is the DeepEP layer, Buffer's call scope, the replays, the path's
plan and the handle: everything of a call's host time but its crossings' own steps, their argument
and result conversions and the freeing of their outputs. One process, one rank, a small routing
(the Python does not depend on the sizes). Only ratios between ops, or between commits on one
machine, mean anything; the GPU machine's CPU runs this code a few times slower.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Patch:
    """monkeypatch's setattr, outside pytest (the recorder's constructor takes one)."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _canned(entries, names) -> None:
    """Each of `entries`' methods `names` returns its first result again (a recorder's entries: no
    new outputs per call, so only the Python around them is timed)."""
    saved = {}
    for name in names:
        def canned(*args, _entry=getattr(entries, name), _name=name, **kw):
            if _name not in saved:
                saved[_name] = _entry(*args, **kw)
            return saved[_name]
        setattr(entries, name, canned)


def _buffers():
    """A one-rank Buffer, and a megatron_ep.deep_ep Buffer, whose cuda backends are the intranode
    path over the recorder, each entry returning its first result again."""
    sys.path[:0] = [os.path.join(ROOT, "tests", "unit"), os.path.join(ROOT, "tests", "support")]  # the recorders, their helpers
    import megatron_ep as mep
    from megatron_ep.core import buffer as B
    from megatron_ep import deep_ep
    from megatron_ep.backends.cuda.backend import CudaBackend
    import test_intranode_path as rec

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    os.environ["MEGATRON_EP_DEEP_EP_BACKEND"] = "torch"
    bufs = (mep.Buffer(dist.group.WORLD, backend="torch", check_inputs=False),
            deep_ep.Buffer(dist.group.WORLD, int(1e8), 0, explicitly_destroy=True))
    paths = {}
    for buf in (bufs[0], bufs[1].runtime):  # a path each: each its own saved results
        path = rec.make_path(_Patch())
        _canned(path.fake, ("dispatch_first_call", "dispatch_call", "combine_call"))
        i32 = dict(dtype=torch.int32)
        layout = (torch.zeros(1, **i32), torch.zeros(rec.E, **i32), torch.ones(rec.T, 1, dtype=torch.bool))
        path.rt.ext.layout = lambda topk_idx, num_experts, num_ranks, counts_int32, _out=layout: _out
        be = CudaBackend.__new__(CudaBackend)
        be.path, be.rt, be._ll, be.rank, be.num_ranks, be.ranks_per_node = path, path.rt, None, 0, 1, 1
        buf._impl, buf.backend = be, "cuda"
        paths[id(buf)] = path
    enter = B._CallScope.__enter__

    def entered(scope):  # the recorder reads the call in flight
        call = enter(scope)
        paths[id(scope.buf)].holder["call"] = call
        return call
    B._CallScope.__enter__ = entered
    return bufs, rec


def _low_latency_path():
    """The cuda low-latency path over tests/unit/test_low_latency_path.py's recorder (8 experts, 16
    tokens, hidden 256, top-4 on one rank), each crossing returning its first result again."""
    import types

    from megatron_ep.backends.cuda import extension as ext, nvshmem
    from megatron_ep.backends.cuda.paths import low_latency as LL
    from megatron_ep.backends.cuda.sm_budget import SmBudget
    import test_low_latency_path as llrec

    real = ext.load_nvshmem()
    ext.NVSHMEM.module = types.SimpleNamespace(plan=real.plan, MAX_BLOCKS=real.MAX_BLOCKS, MAX_RANKS=real.MAX_RANKS,
                                               SEND=real.SEND, RECV=real.RECV, my_pe=lambda: 0,
                                               LowLatencyBuffer=llrec.FakeBuffer)
    nvshmem.init = lambda *a: 1 << 40
    rt = types.SimpleNamespace(group=dist.group.WORLD, rank=0, num_ranks=1, device=torch.device("cpu"),
                               ranks_per_device=1, sm_count=132, timeout_s=5.0, new_outputs=lambda ts: False,
                               budget=SmBudget(1, 1, 132))
    path = LL.LowLatencyPath(rt, dict(num_experts=8, max_tokens=16, hidden=256, topk=4))
    _canned(path.buf, ("dispatch_call", "combine_call"))
    return path, llrec


def _ops_ours(buf, rec, x, idx, w) -> dict:
    state = {}

    def dispatch():
        state["out"] = buf.dispatch(x, idx, w, num_experts=rec.E)

    dispatch()
    handle, rows = state["out"].handle, state["out"].x.clone()
    ops = {"dispatch": dispatch, "cached_dispatch": lambda: buf.dispatch(x, handle=handle),
           "combine": lambda: buf.combine(rows, handle)}
    buf._impl._ll, llrec = _low_latency_path()
    lx, lidx, lw = llrec._inputs()
    ll = buf.low_latency_dispatch(lx, lidx, num_experts=8, max_tokens_per_rank=16, use_fp8=True)
    ll_rows = torch.zeros(ll.x[0].shape, dtype=torch.bfloat16)
    ops["ll_dispatch"] = lambda: buf.low_latency_dispatch(lx, lidx, num_experts=8, max_tokens_per_rank=16, use_fp8=True)
    ops["ll_combine"] = lambda: buf.low_latency_combine(ll_rows, lidx, lw, ll.handle)
    return ops


def _ops_deep_ep(buf, rec, x, idx, w) -> dict:
    """DeepEP V1's calls, as scripts/bench/host.py makes them."""
    def dispatch():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, rec.E)
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert)

    recv_x, _, _, _, handle, _ = dispatch()
    recv_x = recv_x.clone()
    ops = {"dispatch": dispatch, "cached_dispatch": lambda: buf.dispatch(x, handle=handle),
           "combine": lambda: buf.combine(recv_x, handle)}
    # the low-latency calls over a canned path of their own (the Buffer was made without
    # low_latency_mode: its NVSHMEM part is the canned path)
    buf.runtime._impl._ll, llrec = _low_latency_path()
    buf.low_latency_mode = True
    lx, lidx, lw = llrec._inputs()
    ll_x, _, ll_handle, _, _ = buf.low_latency_dispatch(lx, lidx, 16, 8, use_fp8=True)
    ll_rows = torch.zeros(ll_x[0].shape, dtype=torch.bfloat16)
    ops["ll_dispatch"] = lambda: buf.low_latency_dispatch(lx, lidx, 16, 8, use_fp8=True)
    ops["ll_combine"] = lambda: buf.low_latency_combine(ll_rows, lidx, lw, ll_handle)
    return ops


def run(reps: int = 15, loop: int = 200) -> str:
    import types

    from bench.host import time_op

    (buf, dbuf), rec = _buffers()
    timing = types.SimpleNamespace(warmup=loop, reps=reps, loop=loop)

    def issue_us(fn) -> float:  # (one rank, on CPU: the issue time is the whole call)
        return time_op(fn, timing, torch.device("cpu"), dist.group.WORLD)["issue"]

    x = torch.randn(rec.T, rec.H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 5], [1, 2], [7, -1], [3, 4], [6, 0], [2, 5]])
    w = torch.rand(rec.T, rec.K)
    ours, layer = _ops_ours(buf, rec, x, idx, w), _ops_deep_ep(dbuf, rec, x, idx, w)
    lines = ["| op | ours: Python µs per call | deep_ep | deep_ep / ours |", "|---|---:|---:|---:|"]
    for name in ours:
        a = issue_us(ours[name])
        if name not in layer:
            lines.append(f"| {name} | {a:.1f} | - | |")
            continue
        b = issue_us(layer[name])
        lines.append(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    lines.append("(canned crossings: what the calls cost in Python on this CPU, their crossings' own steps left out)")
    dist.destroy_process_group()
    return "\n".join(lines)
