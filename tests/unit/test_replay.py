"""A cached dispatch or a combine of the shape of the last one along its handle is replayed
(megatron_ep/core/replay.py): Buffer skips the checks that shape passed and the cuda intranode path's
plan, and the crossing gets what the full call gives it. On CPU, the extension's entries replaced
by tests/unit/test_intranode_path.py's recorder; what must not replay (another shape, other options,
grad, a CUDA-graph capture, another Buffer, a destroyed one, a copied handle) takes the full call."""

import copy
import threading

import pytest
import torch
import torch.distributed as dist

import megatron_ep as mep
from megatron_ep.core import protocol as P
from megatron_ep.backends.cuda.backend import CudaBackend
from megatron_ep.core.errors import BufferBusyError
from megatron_ep.core.types import EventOverlap
from test_intranode_path import E, H, K, T, path  # noqa: F401  (the fixture)

IDX = torch.tensor([[0, 5], [1, 2], [7, -1], [3, 4], [6, 0], [2, 5]])


@pytest.fixture
def buf(path):  # noqa: F811
    """A Buffer of one rank whose cuda backend is `path` over the recorder."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        b = mep.Buffer(dist.group.WORLD, backend="torch")
        be = CudaBackend.__new__(CudaBackend)
        be.path, be.rt, be._ll, be.rank, be.num_ranks, be.ranks_per_node = path, path.rt, None, 0, 1, 1
        b._impl, b.backend = be, "cuda"
        for name in ("dispatch", "combine"):  # the recorder reads the call in flight
            def entry(call, req, _f=getattr(path, name)):
                path.holder["call"] = call
                return _f(call, req)
            setattr(path, name, entry)
        for name in ("_replay_dispatch", "_replay_combine", "_replay_routing"):
            def replay(call, *args, _f=getattr(path, name)):
                path.holder["call"] = call
                return _f(call, *args)
            setattr(path, name, replay)
        b.path, b.planned = path, []
        plan = path._plan
        path._plan = lambda call, req: b.planned.append(call.seq) or plan(call, req)
        yield b
    finally:
        dist.destroy_process_group()


def _x(dtype=torch.bfloat16):
    return torch.randn(T, H, dtype=dtype)


def _crossings(b, name):
    return [(kw, pending) for n, kw, pending in b.path.fake.calls if n == name]


def _same_crossing(a: dict, b: dict, *data):
    """Every argument equal (the same object, or equal values), but the call's data and signature."""
    for key in a:
        if key in data or key == "sig":
            continue
        assert a[key] is b[key] or a[key] == b[key], key


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("weights", [False, True])
def test_a_cached_dispatch_of_the_same_shape_replays_the_same_crossing(buf, permute, weights):
    w = torch.rand(T, K) if weights else None
    first = buf.dispatch(_x(), IDX, w, num_experts=E, permute=permute)
    h = first.handle
    full = buf.dispatch(_x(), topk_weights=w, handle=h)
    assert buf.planned == [1, 2] and h.dispatch_replay is not None
    x2, w2 = _x(), None if w is None else torch.rand(T, K)
    again = buf.dispatch(x2, topk_weights=w2, handle=h)
    assert buf.planned == [1, 2]  # no plan: replayed
    (a, pa), (b, pb) = _crossings(buf, "dispatch_call")
    _same_crossing(a, b, "x", "topk_weights")
    assert b["x"] is x2 and b["topk_weights"] is w2 and pa is pb is P.Pending.FIRST
    assert a["sig"][:P.FIELD["seq"]] + a["sig"][P.FIELD["seq"] + 1:] == \
        b["sig"][:P.FIELD["seq"]] + b["sig"][P.FIELD["seq"] + 1:]
    assert (a["sig"][P.FIELD["seq"]], b["sig"][P.FIELD["seq"]]) == (2, 3)
    assert again.handle is h and full.handle is h
    for f in ("x", "topk_idx", "topk_weights", "row_expert", "tokens_per_expert", "num_dropped",
              "tokens_per_expert_host"):
        assert type(getattr(again, f)) is type(getattr(full, f)), f
    assert again.event is None and again.tokens_per_expert is not full.tokens_per_expert  # its own


def test_a_combine_of_the_same_shape_replays_the_same_crossing(buf):
    out = buf.dispatch(_x(), IDX, num_experts=E, permute=True)
    rows = out.x.shape[0]
    buf.combine(torch.zeros(rows, H, dtype=torch.bfloat16), out.handle)
    y = torch.ones(rows, H, dtype=torch.bfloat16)
    event = torch.cuda.Event()
    res = buf.combine(y, out.handle, async_op=True, previous_event=EventOverlap(event))
    (a, _), (b, pb) = _crossings(buf, "combine_call")
    _same_crossing(a, b, "x", "async_op", "event", "previous_event")
    assert b["x"] is y and b["previous_event"] is event and b["async_op"] is True and pb is P.Pending.FIRST
    assert res.event is not None and res.event.event is b["event"]
    assert b["sig"][P.FIELD["seq"]] == 3 and b["sig"][P.FIELD["op"]] == P.OP["combine"]


@pytest.mark.parametrize("change", ["dtype", "weights", "tokens", "contiguity", "grad", "capture", "option"])
def test_what_differs_from_the_replayed_call_takes_the_full_call(buf, monkeypatch, change):
    h = buf.dispatch(_x(), IDX, num_experts=E).handle
    buf.dispatch(_x(), handle=h)
    kwargs, x = {}, _x()
    if change == "dtype":
        x = _x(torch.float32)
    elif change == "weights":
        kwargs["topk_weights"] = torch.rand(T, K)
    elif change == "tokens":
        x = torch.randn(T + 1, H, dtype=torch.bfloat16)
    elif change == "contiguity":
        x = torch.randn(H, T, dtype=torch.bfloat16).t()
    elif change == "grad":
        x.requires_grad_(True)
    elif change == "capture":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    else:
        kwargs["host_counts"] = True
    crossed = len(_crossings(buf, "dispatch_call"))
    if change in ("tokens", "contiguity"):  # the full call's checks refuse it, before any crossing
        with pytest.raises(ValueError, match="tokens but the handle|contiguous"):
            buf.dispatch(x, handle=h, **kwargs)
        assert len(_crossings(buf, "dispatch_call")) == crossed
    else:
        buf.dispatch(x, handle=h, **kwargs)
        assert buf.planned == [1, 2, 3]


def test_a_failed_replay_is_published_where_the_peers_wait_and_the_calls_go_on(buf):
    h = buf.dispatch(_x(), IDX, num_experts=E).handle
    buf.dispatch(_x(), handle=h)
    buf.path.fake.fail_in = "dispatch_call"
    with pytest.raises(RuntimeError, match="dispatch_call failed"):
        buf.dispatch(_x(), handle=h)
    assert buf.path.published == [(3, P.Pending.FIRST)]
    buf.path.fake.fail_in = None
    buf.dispatch(_x(), handle=h)
    assert _crossings(buf, "dispatch_call")[-1][0]["sig"][P.FIELD["seq"]] == 4 and buf.planned == [1, 2]


def test_another_buffer_a_destroyed_one_and_a_copied_handle_take_the_full_call(buf):
    h = buf.dispatch(_x(), IDX, num_experts=E).handle
    buf.dispatch(_x(), handle=h)
    dup = copy.deepcopy(h)
    assert dup.dispatch_replay is None and dup.combine_replay is None
    h.buffer_id += 1
    with pytest.raises(ValueError, match="different Buffer"):
        buf.dispatch(_x(), handle=h)
    h.buffer_id -= 1
    buf.destroy = lambda: None
    buf._destroyed = True
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.dispatch(_x(), handle=h)


def test_a_replay_from_a_second_thread_meanwhile_is_refused(buf):
    h = buf.dispatch(_x(), IDX, num_experts=E).handle
    buf.dispatch(_x(), handle=h)
    buf._acquire("combine")  # another thread's call in progress
    caught = []
    t = threading.Thread(target=lambda: caught.append(pytest.raises(BufferBusyError, buf.dispatch, _x(), handle=h)))
    t.start()
    t.join()
    buf._release()
    assert caught and "combine" in str(caught[0].value)
    assert f"while thread {threading.current_thread().name!r} is inside its combine" in str(caught[0].value)


def _idx(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


@pytest.mark.parametrize("permute", [False, True])
def test_a_new_routing_of_the_same_shape_and_options_replays_the_same_crossing(buf, permute):
    w = torch.rand(T, K)
    first = buf.dispatch(_x(), _idx(1), w, num_experts=E, permute=permute, host_counts=True)
    idx, x2 = _idx(2), _x()
    again = buf.dispatch(x2, idx, torch.rand(T, K), num_experts=E, permute=permute, host_counts=True)
    assert buf.planned == [1]  # no plan: replayed
    (a, _), (b, pb) = _crossings(buf, "dispatch_first_call")
    _same_crossing(a, b, "x", "topk_idx", "topk_weights", "tag")
    assert b["x"] is x2 and b["topk_idx"] is idx and b["tag"] == a["tag"] + 1 and pb is P.Pending.FIRST
    assert b["sig"][P.FIELD["seq"]] == 2 and b["sig"][P.FIELD["op"]] == P.OP["dispatch"]
    h = again.handle
    assert h is not first.handle and h.buffer_id == first.handle.buffer_id and h.call_seq == 2
    assert again.tokens_per_expert_host is not None and h.permute == permute
    buf.dispatch(_x(), handle=h)  # the replayed routing's handle serves its cached dispatches
    assert buf.planned == [1, 3]


def test_a_replayed_routing_asks_the_region_nothing_and_a_full_one_asks_again(buf, monkeypatch):
    """The region only grows: the need a new routing's replay carries fitted when its full call
    asked, so the replay does not ask again; a full call (its own need) does."""
    region, asked = buf.path.rt.region, []
    monkeypatch.setattr(region, "fits", lambda need: asked.append(dict(need)) or None)
    buf.dispatch(_x(), _idx(1), num_experts=E)
    buf.dispatch(_x(), _idx(2), num_experts=E)
    buf.dispatch(_x(), _idx(3), num_experts=E)
    assert buf.planned == [1] and len(asked) == 1 and asked[0]["max_tokens"] == 0
    buf.dispatch(_x(), _idx(4), num_experts=E, permute=True)  # other options: the full call
    assert buf.planned == [1, 4] and len(asked) == 2


@pytest.mark.parametrize("change", ["experts", "permute", "alignment", "host_counts", "rank_counts", "weights",
                                    "overflow", "worst", "source", "ids_dtype", "ids_layout", "grad"])
def test_a_new_routing_that_differs_from_the_last_takes_the_full_call(buf, change):
    buf.dispatch(_x(), _idx(1), num_experts=E)
    kwargs, idx, x = {"num_experts": E}, _idx(2), _x()
    if change == "experts":
        kwargs["num_experts"] = 2 * E
        idx = idx * 2
    elif change == "permute":
        kwargs["permute"] = True
    elif change == "alignment":
        kwargs["expert_alignment"] = 4
    elif change == "host_counts":
        kwargs["host_counts"] = True
    elif change == "rank_counts":
        kwargs["rank_counts"] = True
    elif change == "weights":
        kwargs["topk_weights"] = torch.rand(T, K)
    elif change == "overflow":
        kwargs["on_overflow"] = "raise"
    elif change == "worst":
        kwargs["num_worst_tokens"] = 64
    elif change == "source":
        kwargs["source_index"] = True
    elif change == "grad":
        x.requires_grad_(True)
    if change in ("ids_dtype", "ids_layout"):  # the full call's checks refuse it, before any crossing
        idx = idx.to(torch.int32) if change == "ids_dtype" else torch.cat([idx, idx], 1)[:, ::2]
        with pytest.raises((TypeError, ValueError), match="int64|contiguous"):
            buf.dispatch(x, idx, **kwargs)
    else:
        buf.dispatch(x, idx, **kwargs)
        assert buf.planned == [1, 2]


def test_a_failed_routing_replay_is_published_at_the_first_exchange_and_the_calls_go_on(buf):
    buf.dispatch(_x(), _idx(1), num_experts=E)
    buf.path.fake.fail_in = "dispatch_first_call"
    with pytest.raises(RuntimeError, match="dispatch_first_call failed"):
        buf.dispatch(_x(), _idx(2), num_experts=E)
    assert buf.path.published == [(2, P.Pending.FIRST)]
    buf.path.fake.fail_in = None
    out = buf.dispatch(_x(), _idx(3), num_experts=E)
    assert out.handle.call_seq == 3 and buf.planned == [1]


def test_the_routing_replay_keeps_no_tensor_of_the_call_it_replays(buf):
    x = _x()
    buf.dispatch(x, _idx(1), torch.rand(T, K), num_experts=E)
    t = buf.path._routing_plan
    assert t.data is None and t.scales is None and t.topk_idx is None and t.topk_weights is None


@pytest.mark.parametrize("check_inputs", [True, False])
def test_a_layout_of_the_same_shape_and_options_skips_its_checks_and_another_is_checked(check_inputs, monkeypatch):
    """Buffer.get_dispatch_layout (torch backend, one rank): a layout of the shape, device and
    options of the last one that passed goes straight to the backend; anything else -- another
    dtype, layout, num_experts or option, or a call that checks the ids' values -- is checked in
    full and refused as before."""
    from megatron_ep.core import checks

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        b = mep.Buffer(dist.group.WORLD, backend="torch", check_inputs=check_inputs)
        seen = []
        full = checks.check_topk_idx
        monkeypatch.setattr(checks, "check_topk_idx", lambda *a: seen.append(1) or full(*a))
        first = b.get_dispatch_layout(IDX, E, check_values=False)
        again = b.get_dispatch_layout(IDX.clone(), E, check_values=False)
        assert len(seen) == 1  # the second took the memo
        for name in ("tokens_per_rank", "tokens_per_expert", "token_in_rank"):
            assert torch.equal(getattr(first, name), getattr(again, name)), name
        b.get_dispatch_layout(IDX, E, check_values=False, counts_dtype=torch.int32)
        b.get_dispatch_layout(IDX[:3].contiguous(), E, check_values=False)
        assert len(seen) == 3  # other options, another shape: checked
        b.get_dispatch_layout(IDX[:3].contiguous(), E, check_values=False)
        assert len(seen) == 3
        with pytest.raises(TypeError, match="int64"):
            b.get_dispatch_layout(IDX[:3].to(torch.int32), E, check_values=False)
        with pytest.raises(ValueError, match="contiguous"):
            b.get_dispatch_layout(torch.cat([IDX, IDX], 1)[:, ::2][:3], E, check_values=False)
        with pytest.raises(TypeError, match="check_values must be a bool"):
            b.get_dispatch_layout(IDX[:3].contiguous(), E, check_values=0)
        with pytest.raises(TypeError, match="num_experts must be an int"):
            b.get_dispatch_layout(IDX[:3].contiguous(), float(E), check_values=False)
        bad = IDX.clone()
        bad[0, 0] = 99
        b.get_dispatch_layout(IDX, E)  # check_values=True: with check_inputs=True every such call checks
        if check_inputs:
            with pytest.raises(ValueError, match="99"):
                b.get_dispatch_layout(bad, E)
        else:  # (nothing checks values: an unknown id counts as an unused slot)
            assert int(b.get_dispatch_layout(bad, E).tokens_per_expert.sum()) == int((IDX >= 0).sum()) - 1
        b.destroy()
        with pytest.raises(RuntimeError, match="destroyed"):
            b.get_dispatch_layout(IDX, E, check_values=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("source_index", [False, True])
def test_a_new_routings_handle_has_each_value_in_its_named_field(buf, permute, source_index):
    """The intranode path builds the handle positionally (host time): each field holds its own value."""
    from fields import check_fields

    align = 4 if permute else 1
    for seq in (1, 2):  # the full call, then (without source_index) the replay
        out = buf.dispatch(_x(), _idx(seq), torch.rand(T, K), num_experts=E, permute=permute, expert_alignment=align,
                           rank_counts=True, source_index=source_index)
        h, st = out.handle, out.handle.state
        rows = (out.x[0] if isinstance(out.x, tuple) else out.x).shape[0]
        want = dict(backend="cuda", num_ranks=buf.path.rt.num_ranks, rank=buf.path.rt.rank, num_experts=E, num_tokens=T, topk=K, permute=permute,
                    expert_alignment=align, num_recv_rows=rows, tokens_per_expert=st.tokens_per_expert,
                    topk_idx=st.topk_idx, num_worst_tokens=0, state=st, buffer_id=buf.id, call_seq=seq,
                    rank_counts=st.rank_counts, recv_rank_counts=st.recv_rank_counts, rank_prefix=st.rank_prefix,
                    recv_rank_prefix=st.recv_rank_prefix)
        check_fields(h, want, {"recv_src_token", "recv_slot_row", "dispatch_replay", "combine_replay"})
        assert isinstance(h.tokens_per_expert, torch.Tensor) and h.topk_idx is not None and h.rank_counts is not None
        assert (h.recv_src_token is not None) == source_index
        assert (h.recv_slot_row is not None) == (source_index and permute)
        if source_index:
            assert h.recv_slot_row is None or h.recv_slot_row is st.comb_map
