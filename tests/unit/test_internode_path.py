"""The host side of the cuda internode path (megatron_ep/backends/cuda/paths/internode.py) on CPU: its RDMA
buffer replaced by a recorder, its intranode stage an IntranodePath over tests/unit/test_intranode_path.py's
FakeKernels. Which crossings a new routing makes, in order; what the intranode stage is asked; the
handle's source tokens mapped back from the forwarders' receive slots; what the path refuses."""

import contextlib
import ctypes
import types

import pytest
import torch

from megatron_ep.core import protocol as P
from megatron_ep.backends.cuda.paths.internode import InternodePath, _source_tokens
from megatron_ep.core.requests import CombineRequest, DispatchRequest
from test_intranode_path import H, K, N as INNODE_ROWS, T as STAGE_ROWS, make_path

NODES, RANKS_PER_NODE = 2, 2
MT = STAGE_ROWS // NODES  # max tokens per rank: the intranode stage's rows are NODES * MT (the fake's T)
E = 16  # 8 per node: the fake intranode stage's experts
T = 3


class FakeRdma:
    """Stands in for _C_nvshmem.InternodeBuffer: records each call by name and keyword."""

    def __init__(self):
        self.calls = []
        self.code = ctypes.c_int(0)  # the error record's code (error_address)

    def _record(self, name, **kw):
        self.calls.append((name, kw))

    def set_call(self, seq):
        self._record("set_call", seq=seq)

    def dispatch_send(self, **kw):
        self._record("dispatch_send", **kw)

    def dispatch_recv(self, **kw):
        self._record("dispatch_recv", **kw)

    def release(self, dir):  # noqa: A002 - the binding's name
        self._record("release", dir=dir)

    # the composed entries: the intranode stage's entry (its fake, `inner`) with this kernel's launch
    def dispatch_first_call(self, *intranode, **kw):
        """As the entry: the RDMA send and receive, the intranode stage's new routing, and where it
        moved the rows (status 0) the receive area's release (recorded as `released`)."""
        out = self.inner.dispatch_first_call(*intranode)
        self._record("dispatch_first_call", released=out[0] == 0, **kw)
        return out

    def dispatch_cached_call(self, *intranode, **kw):
        self._record("dispatch_cached_call", **kw)
        return self.inner.dispatch_call(*intranode)

    def combine_call(self, *intranode, **kw):
        self._record("combine_call", **kw)
        return self.inner.combine_call(*intranode)

    def view(self, offset, nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)

    def error_address(self):
        return ctypes.addressof(self.code)

    def error(self):
        self._record("error")
        return None


class _Stream:
    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


@pytest.fixture
def path(monkeypatch):
    intra = make_path(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    rt = intra.rt
    rt.stream, rt.mark, rt.new_outputs = _Stream(), lambda name, stream: None, lambda outs: False
    rt.budget.blocks = lambda kind, most: 8
    p = InternodePath.__new__(InternodePath)  # the path's state without NVSHMEM: what its calls read
    p.kind, p.broken, p.published = "internode", None, False
    p.group, p.rank, p.num_ranks, p.device, p.timeout_s = None, 0, NODES * RANKS_PER_NODE, torch.device("cpu"), 5.0
    p.ext = types.SimpleNamespace(INTERNODE_MAX_BLOCKS=32)
    p.buf = FakeRdma()
    p.error_word = ctypes.c_int.from_address(p.buf.error_address())
    p.buf.inner = intra.fake
    p.cap = dict(max_tokens=MT, hidden=H, x_row=H * 2, c_row=H * 4, topk=K)
    p.plan = {s: 0 for s in ("d_x", "d_s", "d_w", "s_x", "s_s", "s_idx", "s_w", "s_y", "s_cw")}
    p._fitted = set()
    p.rt, p.intra = rt, intra
    p.ranks_per_node, p.N, p.node, p.local = RANKS_PER_NODE, NODES, 0, 0
    p.staged, p.inner_seq, p.inner_of = False, 0, -1
    p._views, p._views_of = {}, None
    return p


def _dispatch(p, seq, permute=False, source_index=False):
    call = P.Call(P.OP["dispatch"], seq)
    p.intra.holder["call"] = call
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 9], [15, -1], [3, 4]])
    req = DispatchRequest(x, idx, torch.rand(T, K), E, permute, 4 if permute else 1, None, rank_counts=True,
                          source_index=source_index)
    return p.dispatch(call, req), call


@pytest.mark.parametrize("permute", [False, True])
def test_a_new_routing_crosses_once(path, permute):
    """A new routing is one crossing, into the composed entry: the intranode stage's
    dispatch_first_call arguments (its ids the receive's output), then the RDMA send's and
    receive's; the entry releases the receive area once the rows moved, so Python does not."""
    out, call = _dispatch(path, 1, permute)
    assert [c[0] for c in path.buf.calls] == ["dispatch_first_call"]
    first = path.buf.calls[0][1]
    assert first["released"] and first["seq"] == 1 and first["send_num_experts"] == E and not call.owes
    assert first["out_tokens"] is out.handle.state.tokens and first["send_idx"] is out.handle.topk_idx
    assert [c[0] for c in path.intra.fake.calls] == ["dispatch_first_call"]
    inner = path.intra.fake.calls[0][1]
    assert inner["topk_idx"] is out.handle.state.local_idx
    assert inner["want_src"] is False and inner["num_experts"] == E // NODES
    assert out.handle.recv_src_token is None and out.handle.recv_slot_row is None


def test_a_new_routing_that_grows_the_region_releases_after_its_rows(path):
    """Status 1 (the host acts between notify and the rows: the region grows): the intranode
    stage's rows move in its own dispatch_call, and only then is the receive area released."""
    path.intra.fake.stop_after_notify = True
    _dispatch(path, 1)
    assert [(c[0], c[1].get("released")) for c in path.buf.calls] == [("dispatch_first_call", False),
                                                                      ("release", None)]
    assert [c[0] for c in path.intra.fake.calls] == ["dispatch_first_call", "dispatch_call"]


def test_a_worst_case_sized_routing_sends_and_receives_first(path):
    """num_worst_tokens: no host wait to ride on, so the RDMA hop is its own crossings, then the
    intranode stage's notify and rows, then the release."""
    call = P.Call(P.OP["dispatch"], 1)
    path.intra.holder["call"] = call
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 9], [15, -1], [3, 4]])
    path.dispatch(call, DispatchRequest(x, idx, torch.rand(T, K), E, False, 1, None, num_worst_tokens=T * NODES * RANKS_PER_NODE))
    assert [c[0] for c in path.buf.calls] == ["set_call", "dispatch_send", "dispatch_recv", "release"]
    assert path.buf.calls[0][1]["seq"] == 1
    assert [c[0] for c in path.intra.fake.calls] == ["notify_call", "dispatch_call"]


@pytest.mark.parametrize("permute", [False, True])
def test_source_tokens_come_back_from_the_forwarders_slots(path, permute):
    """source_index=True: the intranode stage writes each row's source, a forwarder receive slot
    (source node * max_tokens + token); the handle keeps the token on its source rank."""
    out, _ = _dispatch(path, 1, permute, source_index=True)
    inner = path.intra.fake.calls[0][1]
    assert inner["want_src"] is True
    slots = torch.arange(INNODE_ROWS, dtype=torch.int32)  # what the fake intranode stage wrote
    assert torch.equal(out.handle.recv_src_token, slots % MT)
    if permute:  # each slot's output row: the intranode stage's
        assert out.handle.recv_slot_row is out.handle.state.inner.recv_slot_row is not None
    else:
        assert out.handle.recv_slot_row is None


@pytest.mark.parametrize("permute", [False, True])
def test_a_cached_dispatch_and_a_combine_run_the_fused_kernels(path, permute):
    """A cached dispatch crosses once, into the internode path's composed entry: the intranode
    stage's dispatch_call arguments, then the fused kernel's (the RDMA send of x with the
    routing's ids); a combine likewise, with its rows and the handle's node-local ids. Each
    settles the call (the peers learn its outcome from that kernel)."""
    out, _ = _dispatch(path, 1, permute)
    path.buf.calls.clear()
    call = P.Call(P.OP["cached_dispatch"], 2)
    path.intra.holder["call"] = call
    x = torch.randn(T, H, dtype=torch.bfloat16)
    path.dispatch(call, DispatchRequest(x, None, None, E, permute, 4 if permute else 1, out.handle))
    assert [c[0] for c in path.buf.calls] == ["dispatch_cached_call"]
    cached = path.buf.calls[0][1]
    assert cached["send_idx"] is out.handle.topk_idx and cached["send_x"] is x and cached["seq"] == 2
    assert cached["num_experts"] == E and not call.owes
    inner = path.intra.fake.calls[-1]  # the intranode stage's arguments, through the one crossing
    assert inner[0] == "dispatch_call" and inner[1]["first"] is False and inner[1]["want_src"] is False

    path.buf.calls.clear()
    call = P.Call(P.OP["combine"], 3)
    path.intra.holder["call"] = call
    rows = torch.zeros(out.x.shape[0], H, dtype=torch.bfloat16)
    y = path.combine(call, CombineRequest(rows, out.handle))
    assert [c[0] for c in path.buf.calls] == ["combine_call"]
    comb = path.buf.calls[0][1]
    assert comb["seq"] == 3 and comb["local_idx"] is out.handle.state.local_idx and comb["topk_idx"] is out.handle.topk_idx
    assert comb["y"] is y.x and comb["y"].shape == (T, H) and not call.owes
    inner = path.intra.fake.calls[-1]
    assert inner[0] == "combine_call" and inner[1]["x"] is rows and inner[1]["bias0"] is None


def test_single_reduction_is_refused_across_nodes(path):
    out, _ = _dispatch(path, 1, permute=True)
    call = P.Call(P.OP["combine"], 2)
    path.intra.holder["call"] = call
    rows = torch.zeros(out.x.shape[0], H, dtype=torch.bfloat16)
    path.buf.calls.clear()
    with pytest.raises(NotImplementedError, match="single_reduction=True.*internode"):
        path.combine(call, CombineRequest(rows, out.handle, single_reduction=True))
    assert path.buf.calls == []  # nothing of the combine was launched


def test_a_slot_maps_to_its_token_and_no_row_stays_no_row():
    slots = torch.tensor([-1, 0, 2, 3, 5, 7, -1], dtype=torch.int32)
    assert _source_tokens(slots, 3).tolist() == [-1, 0, 2, 0, 2, 1, -1]
    assert _source_tokens(None, 3) is None


def test_a_call_reads_the_error_record_only_where_its_word_is_set(path):
    """Each call checks the kernels' error record: the word in mapped host memory, read without
    a crossing; error() crosses only when the word is set."""
    _dispatch(path, 1)
    assert "error" not in [c[0] for c in path.buf.calls]
    path.buf.code.value = P.ERROR["mismatch"]
    path.check()
    assert [c[0] for c in path.buf.calls][-1] == "error"
