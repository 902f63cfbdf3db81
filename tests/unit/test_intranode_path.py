"""The host side of the cuda intranode path (megatron_ep/backends/cuda/paths/intranode.py) on CPU, with the
extension's one-crossing entries replaced by a recorder: which crossings a new routing, a cached
dispatch and a combine make, in order, and with what; the handle's state after each (its counts,
its combine map, its native binding, bound once); where the call's peers wait for this rank at
each crossing (a failure there is published at that handshake); a copied state binding again."""

import copy
import types

import pytest
import torch

from megatron_ep.core import protocol as P
from megatron_ep.backends.cuda.paths.intranode import IntranodePath
from megatron_ep.backends.cuda.region import starts_at
from megatron_ep.core.requests import CombineRequest, DispatchRequest
from megatron_ep.core.types import EventOverlap
from test_kernel_boundary import binding_arguments

R, E, K, H, T = 2, 8, 2, 64, 6
L = E // R
N, M = 5, 7  # rows the host learns from notify: rank-major, expert-major


class FakeKernels:
    """Stands in for _C.intranode: records each crossing (its arguments by the binding's names,
    csrc/intranode/binding.cpp, and where the call's peers wait for this rank at that moment) and
    returns what the entry returns."""

    NAMES = {name: names for name, (names, _) in binding_arguments().items()}

    @classmethod
    def _named(cls, entry: str, args: tuple, kw: dict) -> dict:
        """The call's arguments by name: positional ones take the binding's names in order."""
        names = cls.NAMES[entry]
        assert len(args) <= len(names) and not set(names[:len(args)]) & set(kw), (entry, len(args), sorted(kw))
        return {**dict(zip(names, args)), **kw}

    def __init__(self, call_of):
        self.calls = []
        self.call_of = call_of  # the P.Call in flight (the test's)
        self.fail_in = None
        self.stop_after_notify = False
        self.notified_tag = 0  # Runtime::notified_tag: the last notify launched

    class HandleState:
        def __init__(self, *args, **bound):
            self.bound = FakeKernels._named("HandleState", args, bound)

        def tensors(self):
            b = self.bound
            return b["topk_idx"], b["rank_pos"], b["slot_pos"], b["recv_info"], b["row_limits"], b["counts"], b["comb_map"]

    def _record(self, name, kw):
        self.calls.append((name, kw, self.call_of().pending))
        if self.fail_in == name:
            raise RuntimeError(f"{name} failed")

    def _notified(self, kw, waited):
        """What notify_call returns (its tuple) for these arguments."""
        counts = torch.zeros(L + 1, dtype=torch.int64)
        i32 = dict(dtype=torch.int32)
        sizes = dict(num_rows=N, num_perm_rows=M, counts=[1] * L, need_tokens=T, need_rows=N, need_perm_rows=M,
                     bad_slot=-1)
        made = (kw["topk_idx"].clone(), torch.zeros(T, R, **i32), torch.zeros(T, K, **i32), torch.zeros(4 + 3 * L, **i32),
                torch.zeros(R, **i32))
        native = self.HandleState(topk_idx=made[0], rank_pos=made[1], slot_pos=made[2], recv_info=made[3],
                                  row_limits=made[4], counts=counts, comb_map=None, num_experts=kw["num_experts"],
                                  permute=kw["permute"])
        rank_counts = rank_prefix = None
        if kw["rank_counts"]:
            rank_counts, rank_prefix = torch.zeros(R, R, **i32), torch.zeros(R, R, **i32)
        columns = (rank_counts[:, 0], rank_prefix[:, 0]) if kw["rank_counts"] else (None, None)
        return (*made, counts, counts[:L], counts[L], rank_counts, rank_prefix, *columns, waited,
                None if waited else sizes, native)

    def _dispatched(self, st, first, rows, comb_rows, x, topk_weights, want_src=False):
        """What dispatch_call returns (its tuple), the state updated as HandleState is."""
        permute = st.bound["permute"]
        if first:  # as HandleState does: the map made for a new expert-major routing, the counts kept
            st.bound["counts"] = torch.ones(L + 1, dtype=torch.int64)
            if permute:
                st.bound["comb_map"] = torch.full((comb_rows, K), -1, dtype=torch.int32)
        kept, comb_map = st.bound["counts"], st.bound["comb_map"]
        return (torch.zeros(rows, H, dtype=x.dtype), None,
                None if permute else torch.zeros(rows, K, dtype=torch.int64),
                None if topk_weights is None else torch.zeros((rows,) if permute else (rows, K)),
                torch.zeros(rows, dtype=torch.int32) if permute else None,
                torch.zeros(L, dtype=torch.int64), torch.zeros((), dtype=torch.int64), kept, kept[:L], kept[L], comb_map,
                torch.arange(comb_rows if permute else rows, dtype=torch.int32) if want_src else None)

    def notify_call(self, *args, **kw):
        kw = self._named("notify_call", args, kw)
        self._record("notify_call", kw)
        return self._notified(kw, -1 if kw["num_worst_tokens"] else 0)  # no host wait when worst-case sized

    def dispatch_first_call(self, *args, **kw):
        """As calls.h: notify (the runtime's notified tag set), the wait, then the dispatch half
        unless the host must act first (`stop_after_notify`, or the needs other than the counts do
        not fit); fail_in="dispatch half" raises there, past notify."""
        kw = self._named("dispatch_first_call", args, kw)
        self._record("dispatch_first_call", kw)
        # lean: the handle's index tensors and notify's counts stay in the HandleState
        notified = self._notified(kw, 0)
        notified = (notified[0], *[None] * 7, *notified[8:])
        self.notified_tag = kw["tag"]
        if self.stop_after_notify or not kw["fits"]:
            return 1, notified, None
        if self.fail_in == "dispatch half":
            raise RuntimeError("the dispatch half failed")
        permute = kw["permute"]
        res = self._dispatched(notified[-1], True, M if permute else N, N if permute else 0, kw["x"], kw["topk_weights"],
                               kw["want_src"])
        return 0, notified, res

    def dispatch_call(self, *args, **kw):
        """As calls.h (the internode path's composed entry crosses here with the same arguments:
        tests/unit/test_internode_path.py's FakeRdma)."""
        kw = self._named("dispatch_call", args, kw)
        self._record("dispatch_call", kw)
        return self._dispatched(kw["state"], kw["first"], kw["out_rows"], kw["comb_rows"], kw["x"], kw["topk_weights"],
                                kw["want_src"])

    def combine_call(self, *args, **kw):
        """y (and weights) made unless given (the internode path's composed entry crosses here with
        the same arguments: tests/unit/test_internode_path.py's FakeRdma)."""
        kw = self._named("combine_call", args, kw)
        self._record("combine_call", kw)
        y, w = ((kw["out"], kw["out_weights"]) if kw["out"] is not None
                else (torch.zeros(T, H, dtype=kw["x"].dtype), None))
        return y, w


@pytest.fixture
def path(monkeypatch):
    return make_path(monkeypatch)


def make_path(monkeypatch) -> IntranodePath:
    """An IntranodePath over FakeKernels and a stand-in runtime (tests/unit/test_internode_path.py's
    intranode stage too)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    holder = {}
    kernels = FakeKernels(lambda: holder["call"])
    published = []
    plan = types.SimpleNamespace(pool_bytes=1 << 20, max_tokens=64, stage_x=1 << 30, comb_x=1 << 31, comb_rows=1 << 16,
                                 comb_row_bytes=1 << 16)
    region = types.SimpleNamespace(
        runtime=types.SimpleNamespace(notified_tag=lambda: kernels.notified_tag), plan=plan, base=0, ready=True,
        fits=lambda need: None, grow_if_needed=lambda need: False, scratch_free=lambda: True,
        holds=lambda t, offset: starts_at(t, region.base + offset))
    ledger = types.SimpleNamespace(check=lambda call=None: None, host_wait_s=65.0,
                                   publish=lambda call, exc: published.append((call.seq, call.pending)),
                                   host_sizes=lambda call, waited, sizes: sizes)
    budget = types.SimpleNamespace(num_sms=8, normal=(8, 8, 16))
    rt = types.SimpleNamespace(ext=types.SimpleNamespace(intranode=kernels), device=torch.device("cpu"), num_ranks=R,
                               rank=0, trace=None, marks=lambda names, first=False: None, region=region, ledger=ledger,
                               budget=budget)
    p = IntranodePath(rt)
    p.published, p.holder, p.fake = published, holder, kernels
    return p


def _call(p, op, seq):
    call = P.Call(P.OP[op], seq)
    p.holder["call"] = call
    return call


def _dispatch(p, seq, permute, handle=None, previous_event=None, source_index=False):
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = None if handle is not None else torch.tensor([[0, 5], [1, 2], [7, -1], [3, 4], [6, 0], [2, 5]])
    req = DispatchRequest(x, idx, torch.rand(T, K), E, permute, 4 if permute else 1, handle,
                          previous_event=previous_event, rank_counts=handle is None, source_index=source_index)
    call = _call(p, "dispatch" if handle is None else "cached_dispatch", seq)
    with p.guard(call):
        return p.dispatch(call, req), call


@pytest.mark.parametrize("permute", [False, True])
def test_a_routing_then_its_calls_cross_once_each(path, permute):
    out, call = _dispatch(path, 1, permute)
    names = [c[0] for c in path.fake.calls]
    assert names == ["dispatch_first_call"], names
    (_, first, before_first), = path.fake.calls
    # notify is the call's first exchange: a failure before the crossing is published there
    assert before_first is P.Pending.FIRST and call.pending is P.Pending.NOTHING
    assert first["expert_alignment"] == (4 if permute else 1) and first["previous_event"] is None
    assert first["wait_s"] == 65.0 and first["fits"]  # the host waits for notify's sizes in the same crossing
    st = out.handle.state
    native = st.native
    assert native.bound["counts"] is st.device_counts  # the kept copy, on both sides
    assert torch.equal(st.device_counts, torch.ones(L + 1, dtype=torch.int64))
    assert st.tokens_per_expert.shape == (L,) and st.num_dropped.shape == ()
    assert (st.num_rows, st.num_perm_rows) == (N, M) and out.handle.num_recv_rows == (M if permute else N)
    assert (st.comb_map is not None) == permute and (not permute or st.comb_map.shape[0] == N)
    assert torch.equal(out.handle.topk_idx, first["topk_idx"])  # the handle keeps notify's copy's source

    event = torch.cuda.Event()
    _dispatch(path, 2, permute, handle=out.handle, previous_event=EventOverlap(event))
    _, cached, before_cached = path.fake.calls[-1]
    assert cached["state"] is native and not cached["first"] and cached["previous_event"] is event
    assert before_cached is P.Pending.FIRST  # a cached dispatch's first exchange is its move

    combine_call = _call(path, "combine", 3)
    with path.guard(combine_call):
        path.combine(combine_call, CombineRequest(torch.zeros(out.x.shape[0], H, dtype=torch.bfloat16), out.handle))
    name, comb, before_comb = path.fake.calls[-1]
    assert name == "combine_call" and comb["state"] is native and before_comb is P.Pending.FIRST
    assert comb["variant"] == (P.COMBINE_PARTIALS if permute else P.COMBINE_STAGED) and comb["out"] is None
    assert comb["sig"][P.FIELD["variant"]] == comb["variant"]  # the peers check the variant the kernel runs

    # single_reduction: the staged kernel summing every slot's row (expert-major; rank-major as before)
    single_call = _call(path, "combine", 4)
    with path.guard(single_call):
        path.combine(single_call, CombineRequest(torch.zeros(out.x.shape[0], H, dtype=torch.bfloat16), out.handle,
                                                 single_reduction=True))
    single = path.fake.calls[-1][1]
    assert single["variant"] == (P.COMBINE_SINGLE if permute else P.COMBINE_STAGED)
    assert single["sig"][P.FIELD["variant"]] == single["variant"]
    assert [c[0] for c in path.fake.calls] == ["dispatch_first_call", "dispatch_call", "combine_call", "combine_call"]
    assert not path.published


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("why", ["sizes", "needs"])
def test_a_routing_the_host_must_size_takes_a_second_crossing(path, permute, why):
    """Where the host acts between notify and the move -- the region must grow for the counts notify
    learned (`sizes`), or the call's other needs do not fit it as it is (`needs`: the extension is
    not asked to go on) -- the move is dispatch_call's, owed at notify's handshake, on the routing's
    state with the sizes the host read."""
    if why == "sizes":
        path.fake.stop_after_notify = True
    else:
        path.rt.region.fits = lambda need: "hidden 8192 > 7168"
    grown = []
    path.rt.region.grow_if_needed = lambda need: grown.append(need) or False
    out, call = _dispatch(path, 1, permute)
    assert [c[0] for c in path.fake.calls] == ["dispatch_first_call", "dispatch_call"]
    (_, first, _), (_, disp, before_move) = path.fake.calls
    assert first["fits"] == (why == "sizes")
    assert before_move is (P.Pending.OUT_LOC if disp["push"] else P.Pending.STAGED)
    assert disp["first"] and disp["previous_event"] is None and disp["out_rows"] == (M if permute else N)
    assert disp["comb_rows"] == (N if permute else 0) and disp["state"] is out.handle.state.native
    assert grown and grown[0]["max_tokens"] == T and grown[0]["combine_rows"] == (M if permute else N)
    assert call.pending is P.Pending.NOTHING and not path.published


@pytest.mark.parametrize("where", ["dispatch half", "dispatch_call"])
def test_a_failure_between_notify_and_the_move_is_published_where_the_peers_wait(path, where):
    """Past notify (the crossing's second half, or the second crossing) the peers wait at the rows'
    first handshake: the failure is published there, its exception unchanged; before notify (the
    crossing raised first) at the call's first exchange."""
    path.fake.fail_in = where
    path.fake.stop_after_notify = where == "dispatch_call"
    with pytest.raises(RuntimeError, match="dispatch half failed|dispatch_call failed"):
        _dispatch(path, 1, False)
    assert path.published == [(1, P.Pending.OUT_LOC)]
    path.fake.fail_in = "dispatch_first_call"  # (raises on entry, before notify)
    with pytest.raises(RuntimeError, match="dispatch_first_call failed"):
        _dispatch(path, 2, False)
    assert path.published[-1] == (2, P.Pending.FIRST)


def test_a_copied_state_binds_again_from_its_own_tensors(path):
    out, _ = _dispatch(path, 1, True)
    assert out.handle.state.rank_pos is None  # (the new routing's crossing left them in the binding)
    dup = copy.deepcopy(out.handle)
    assert dup.state.native is None
    kept = out.handle.state.native.tensors()
    for name, t in zip(("rank_pos", "slot_pos", "recv_info", "row_limits"), kept[1:5]):
        mine = getattr(dup.state, name)
        assert torch.equal(mine, t) and mine.data_ptr() != t.data_ptr(), name
    _dispatch(path, 2, True, handle=dup)
    _, kw, _ = path.fake.calls[-1]
    assert kw["state"] is dup.state.native and kw["state"] is not out.handle.state.native
    assert torch.equal(kw["state"].bound["counts"], out.handle.state.device_counts)
    assert kw["state"].bound["counts"].data_ptr() != out.handle.state.device_counts.data_ptr()


def test_each_routing_waits_for_its_own_tag(path):
    """The host waits for notify's sizes by tag: a fresh one per routing, so a stale size never reads as new."""
    for seq in (1, 2):
        _dispatch(path, seq, False)
    assert [kw["tag"] for name, kw, _ in path.fake.calls if name == "dispatch_first_call"] == [1, 2]


@pytest.mark.parametrize("permute", [False, True])
def test_a_worst_case_sized_routing_does_not_wait_for_sizes(path, permute):
    """num_worst_tokens: no host wait (notify_call's wait_s < 0), outputs of exactly that many rows,
    and an expert-major combine map sized for every rank's tokens (the host does not know N)."""
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 5], [1, 2], [7, -1], [3, 4], [6, 0], [2, 5]])
    call = _call(path, "dispatch", 1)
    with path.guard(call):
        out = path.dispatch(call, DispatchRequest(x, idx, None, E, permute, 1, num_worst_tokens=40))
    (_, notify, _), (_, disp, _) = path.fake.calls
    assert notify["wait_s"] < 0 and notify["num_worst_tokens"] == 40
    assert disp["out_rows"] == 40 and disp["comb_rows"] == (R * path.rt.region.plan.max_tokens if permute else 0)
    assert out.handle.num_recv_rows == 40


def test_the_composed_entry_crosses_in_place_of_the_path_s_own(path):
    """The internode path's cached dispatch and combine: the path crosses into its entry (`fused`)
    instead of its own, with the same arguments by name and in order (csrc/intranode/composed.h),
    and for the combine the symmetric outputs (`out`) it writes into; the call is settled there."""
    out, _ = _dispatch(path, 1, False)
    crossed = []

    def composed(name):
        def entry(*args):
            crossed.append((name, FakeKernels._named(name, args, {})))
            return getattr(path.fake, name)(*args)
        return entry

    x = torch.randn(T, H, dtype=torch.bfloat16)
    call = _call(path, "cached_dispatch", 2)
    with path.guard(call):
        path.dispatch(call, DispatchRequest(x, None, None, E, False, 1, out.handle, fused=composed("dispatch_call")))
    assert call.pending is P.Pending.NOTHING
    y, w = torch.zeros(T, H, dtype=torch.bfloat16), None
    call = _call(path, "combine", 3)
    with path.guard(call):
        path.combine(call, CombineRequest(torch.zeros(out.x.shape[0], H, dtype=torch.bfloat16), out.handle,
                                          fused=composed("combine_call"), out=(y, w)))
    assert [name for name, _ in crossed] == ["dispatch_call", "combine_call"]
    (_, d), (_, c) = crossed
    assert d["x"] is x and d["state"] is out.handle.state.native and d["want_src"] is False
    assert c["out"] is y and c["out_weights"] is None
    # every argument of the path's own entry, and only those
    assert set(d) == set(FakeKernels.NAMES["dispatch_call"]) and set(c) == set(FakeKernels.NAMES["combine_call"])


def test_a_grown_region_decides_again_where_the_rows_lie(path):
    """A zero-copy input lies in the region notify saw: when the host grows it between the two
    crossings, the move is told the input is not in the region any more (its rows are staged)."""
    path.fake.stop_after_notify = True
    x = torch.randn(T, H, dtype=torch.bfloat16)
    path.rt.region.base = x.data_ptr() - path.rt.region.plan.stage_x  # x is the region's staging (a dispatch_input)

    def grow(need):
        path.rt.region.base += 1 << 40  # a new region elsewhere
        return True

    path.rt.region.grow_if_needed = grow
    idx = torch.tensor([[0, 5], [1, 2], [7, -1], [3, 4], [6, 0], [2, 5]])
    call = _call(path, "dispatch", 1)
    with path.guard(call):
        path.dispatch(call, DispatchRequest(x, idx, None, E, False, 1))
    (_, first, _), (_, disp, _) = path.fake.calls
    assert first["zero_copy"] and not disp["zero_copy"]


@pytest.mark.parametrize("permute", [False, True])
def test_a_routing_asked_for_source_tokens_keeps_them_in_its_handle(path, permute):
    """source_index=True: the new routing's crossing asks the kernels for each rank-major row's
    source token (want_src) and the handle keeps what they wrote (expert-major, with its slot
    rows: the combine map); a cached dispatch along it asks for nothing; without it, nothing."""
    out, _ = _dispatch(path, 1, permute, source_index=True)
    first = path.fake.calls[-1][1]
    assert first["want_src"] is True
    src = out.handle.recv_src_token
    assert src is not None and src.dtype == torch.int32 and src.shape == (N,)
    assert (out.handle.recv_slot_row is out.handle.state.comb_map) if permute else out.handle.recv_slot_row is None
    _dispatch(path, 2, permute, handle=out.handle)
    assert path.fake.calls[-1][1]["want_src"] is False
    plain, _ = _dispatch(path, 3, permute)
    assert path.fake.calls[-1][1]["want_src"] is False and plain.handle.recv_src_token is None


def test_an_empty_input_is_placed_by_its_storage():
    """A view of no rows has data_ptr() 0; where it lies is its storage's address plus its offset,
    so a rank that received no rows agrees with its peers on a zero-copy combine input."""
    area = torch.zeros(16, H)
    none, some = area[4:4], area[4:6]
    at = area.data_ptr() + 4 * H * area.element_size()
    assert none.data_ptr() == 0 and starts_at(none, at) and starts_at(some, at)
    assert not starts_at(area[5:5], at) and not starts_at(torch.zeros(0, H), at)


def test_a_combine_variant_mismatch_says_what_the_caller_decides():
    """The combine's variant is the one a caller's choice decides (its input in the buffer or not):
    the error names the two kernels and what to pass."""
    call = P.Call(P.OP["combine"], 7)
    err = P.mismatch_error(call, P.FIELD["variant"], [0, 1])
    text = str(err)
    assert "rank 0 = staged rows, rank 1 = partials" in text and "get_combine_input(0, H)" in text, text
    assert err.field == "variant" and err.values == [0, 1]
    dispatch = str(P.mismatch_error(P.Call(P.OP["dispatch"], 7), P.FIELD["variant"], [0, 1]))
    assert "rank 0 = stage+pull, rank 1 = push" in dispatch and "get_combine_input" not in dispatch, dispatch
