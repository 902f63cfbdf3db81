"""The internode path's pieces that need no GPU: its RDMA-domain buffer layout (the one owner of
the buffer's size, in `_C_nvshmem`), the intranode stage's sizing, and the `ranks_per_node` checks."""

import pytest
import torch
import torch.distributed as dist

import megatron_ep as mep
from megatron_ep.backends.cuda.paths import internode as IN


@pytest.fixture(scope="module")
def ext():
    from megatron_ep.backends.cuda.extension import load_nvshmem

    try:
        return load_nvshmem()
    except RuntimeError as exc:
        pytest.skip(f"_C_nvshmem is not built here: {exc}")


SECTIONS = ["d_x", "d_s", "d_idx", "d_w", "c_y", "c_w", "s_x", "s_s", "s_idx", "s_w", "s_y", "s_cw"]


def test_the_internode_entries_compose_this_builds_intranode_ones(ext):
    """_C_nvshmem's cached dispatch and combine call _C's entries through the capsule _C publishes
    (csrc/intranode/composed.h): it finds them (loading _C) and both builds agree on their version."""
    from megatron_ep.backends.cuda.extension import load

    intra = load()
    assert ext.composed_api_version() == ext.COMPOSED_API_VERSION == intra.COMPOSED_API_VERSION


@pytest.mark.parametrize("staged", [False, True])
def test_layout_places_every_section(ext, staged):
    N, mt, K, H = 4, 4096, 8, 7168
    plan = ext.internode_plan(N, mt, K, 2 * H, H // 128, 2 * H, staged)
    offs = [plan[s] for s in SECTIONS]
    assert offs == sorted(offs) and all(o % 256 == 0 for o in offs)
    slots = N * mt
    assert plan["d_s"] - plan["d_x"] >= slots * 2 * H  # a slot per (source node, token)
    assert plan["scale_cols"] == H // 128  # the FP8 scales alone (the intranode stage needs no order key)
    assert plan["d_idx"] - plan["d_s"] >= slots * plan["scale_cols"] * 4
    assert plan["c_w"] - plan["c_y"] >= slots * 2 * H
    staging = plan["s_cw"] + (slots * K * 4 if staged else 0) - plan["s_x"]
    assert (staging > mt * 2 * H) == staged  # staging only where puts need it
    assert plan["total"] >= plan["s_cw"]


def test_layout_grows_with_nodes_and_tokens(ext):
    small = ext.internode_plan(2, 64, 8, 1024, 4, 1024, False)["total"]
    assert ext.internode_plan(4, 64, 8, 1024, 4, 1024, False)["total"] > small
    assert ext.internode_plan(2, 128, 8, 1024, 4, 1024, False)["total"] > small


def test_intranode_stage_sizing():
    h = IN.node_hints(num_nodes=4, max_tokens=4096, hidden=7168, dtype_bytes=1, combine_bytes=2, topk=8)
    assert h["max_tokens"] == 4 * 4096  # every forwarder handles N * max_tokens rows
    assert h["hidden"] == 7168 and h["dtype_bytes"] == 1 and h["max_topk"] == 8  # the rows as they are: no key column


@pytest.fixture()
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", [0, 2, "1"])
def test_ranks_per_node_is_checked(group, bad):
    with pytest.raises(ValueError, match="ranks_per_node"):
        mep.Buffer(group, backend="torch", ranks_per_node=bad)


def test_ranks_per_node_on_the_torch_backend(group):
    buf = mep.Buffer(group, backend="torch", ranks_per_node=1)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1]])
    out = buf.dispatch(x, idx, num_experts=2)
    assert torch.equal(out.x, x[:2])


def _start_up_collectives():
    """On every rank: the start-up helpers the cuda paths share (runtime.gather / largest, the
    cached host names)."""
    from megatron_ep.backends.cuda import hosts
    from megatron_ep.backends.cuda.collectives import gather, largest

    rank = dist.get_rank()
    errors = []
    if gather(rank * 10, None) != [0, 10]:
        errors.append(f"gather: {gather(rank * 10, None)}")
    got = largest(gather({"max_tokens": 4 + rank, "hidden": 256 - rank, **({"topk": 8} if rank else {})}, None))
    if got != {"max_tokens": 5, "hidden": 256, "topk": 8}:
        errors.append(f"largest: {got}")
    first = hosts.host_names(None)
    if len(first) != 2 or hosts.host_names(dist.group.WORLD) != first:  # the second comes from the cache
        errors.append(f"host_names: {first}")
    return errors


def test_start_up_collectives(pools):
    errors = [e for r in pools(2).run(_start_up_collectives) for e in r]
    assert not errors, "\n".join(errors)


def test_heap_error_names_what_holds_it(monkeypatch):
    """A second NVSHMEM buffer (the low-latency one beside the internode one) that does not fit the
    heap started for the first: the error names the heap, who holds it, NVSHMEM's share and the
    NVSHMEM_SYMMETRIC_SIZE that would fit both; a released buffer frees its bytes. NVSHMEM's own
    share is not counted against a need (a second buffer as large as the first fits, as it does
    in NVSHMEM: the margin the heap was sized with is far more than NVSHMEM takes)."""
    from megatron_ep.backends.cuda import nvshmem

    first, second = object(), object()
    margin = nvshmem.HEAP_MARGIN
    heap = 2 * 25_000_000 + margin
    monkeypatch.setattr(nvshmem, "_state", dict(n_pes=16, heap=heap, sized_by="the internode buffer",
                                                held={id(first): ("the internode buffer", 25_000_000)}))
    assert nvshmem.heap_short(25_000_000, "the low-latency buffer", heap, exclude=second) is None
    assert nvshmem.heap_short(heap - 25_000_000, "the low-latency buffer", heap, exclude=second) is None
    need = heap - 25_000_000 + 1
    msg = nvshmem.heap_short(need, "the low-latency buffer", heap, exclude=second)
    for part in (f"the low-latency buffer needs {need} bytes", f"{heap - 25_000_000} are free",
                 "the internode buffer: 25000000", f"allow {margin}",
                 f"NVSHMEM_SYMMETRIC_SIZE to at least {25_000_000 + need + margin}"):
        assert part in msg, (part, msg)
    # a buffer re-created by its owner replaces its own bytes; a released one frees them
    assert nvshmem.heap_short(heap, "the internode buffer", heap, exclude=first) is None
    nvshmem.release(first)
    assert nvshmem.heap_short(heap, "the low-latency buffer", heap, exclude=second) is None


def test_heap_starts_with_the_reserved_room(monkeypatch):
    """A process that will hold several NVSHMEM buffers (one Buffer's internode and low-latency
    ones) starts the heap with the room reserved for them, not twice its first buffer's need; a
    reservation smaller than that changes nothing; NVSHMEM_SYMMETRIC_SIZE set by the user wins,
    and the heap's error then says it sized the heap."""
    from megatron_ep.backends.cuda import nvshmem

    class Ext:
        def unique_id(self):
            return b"id"

        def init(self, *args):
            pass

        def n_pes(self):
            return 1

        def my_pe(self):
            return 0

    monkeypatch.setattr(nvshmem, "host_names", lambda group: ["h"])
    monkeypatch.setattr(nvshmem, "gather", lambda obj, group: [obj])
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    margin, dev = nvshmem.HEAP_MARGIN, torch.device("cpu", 0)

    def start(need, reserved=None):
        monkeypatch.setattr(nvshmem, "_state", {})
        monkeypatch.setattr(nvshmem, "_floor", {})
        monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
        if reserved:
            nvshmem.reserve(reserved, "Buffer(nvshmem_heap_bytes=...)")
        nvshmem.pes_for(None, 0, 1, dev, need, Ext(), "the internode buffer", object())
        return nvshmem._state

    st = start(10 << 20)
    assert st["heap"] == (20 << 20) + margin and st["sized_by"] == "the internode buffer, twice its need"
    st = start(10 << 20, reserved=1 << 30)
    assert st["heap"] == (1 << 30) + margin and st["sized_by"] == "Buffer(nvshmem_heap_bytes=...)"
    assert nvshmem.heap_short(900 << 20, "the low-latency buffer", st["heap"]) is None
    st = start(10 << 20, reserved=5 << 20)
    assert st["heap"] == (20 << 20) + margin
    # the user's size wins; the error names it as what sized the heap
    monkeypatch.setattr(nvshmem, "_state", {})
    monkeypatch.setattr(nvshmem, "_floor", {})
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "64M")
    nvshmem.reserve(1 << 30, "Buffer(nvshmem_heap_bytes=...)")
    owner = object()
    nvshmem.pes_for(None, 0, 1, dev, 10 << 20, Ext(), "the internode buffer", owner)
    assert nvshmem._state["heap"] == 64 << 20
    msg = nvshmem.heap_short(60 << 20, "the low-latency buffer", 64 << 20)
    assert "sized then by NVSHMEM_SYMMETRIC_SIZE, set before it started" in msg, msg


def test_deep_ep_buffer_reserves_heap_for_both_nvshmem_buffers(monkeypatch):
    """megatron_ep.deep_ep.Buffer(low_latency_mode=True) over more than one node of 8 ranks serves
    normal calls (the internode path) and low-latency ones: it asks our Buffer for a heap with room
    for both, DeepEP's num_rdma_bytes; within one node, or in normal mode, it asks nothing."""
    from megatron_ep.deep_ep import buffer as DB

    seen = []

    class Stop(Exception):
        pass

    def runtime(group, **kw):
        seen.append(kw)
        raise Stop

    monkeypatch.setattr(DB._mep, "Buffer", runtime)
    monkeypatch.setattr(DB._mep, "cuda_backend_available", lambda: True)
    monkeypatch.delenv("MEGATRON_EP_DEEP_EP_BACKEND", raising=False)
    for size, ll, heap in ((16, True, int(1e9)), (16, False, None), (8, True, None)):
        monkeypatch.setattr(DB, "_group_of", lambda group, size=size: (0, group, size))
        with pytest.raises(Stop):
            DB.Buffer(object(), int(1e9), int(1e9), low_latency_mode=ll, num_qps_per_rank=24)
        assert seen[-1].get("nvshmem_heap_bytes") == heap, (size, ll, seen[-1])
