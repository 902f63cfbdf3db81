"""The internode path's pieces that need no GPU: its RDMA-domain buffer layout (the one owner of
the buffer's size, in `_C_nvshmem`), the in-node stage's sizing, and the `ranks_per_node` checks."""

import pytest
import torch
import torch.distributed as dist

import megatron_ep as mep
from megatron_ep.cuda.paths import internode as IN


@pytest.fixture(scope="module")
def ext():
    from megatron_ep.cuda.extension import load_nvshmem

    try:
        return load_nvshmem()
    except RuntimeError as exc:
        pytest.skip(f"_C_nvshmem is not built here: {exc}")


SECTIONS = ["d_x", "d_s", "d_idx", "d_w", "c_y", "c_w", "s_x", "s_s", "s_idx", "s_w", "s_y", "s_cw"]


@pytest.mark.parametrize("staged", [False, True])
def test_layout_places_every_section(ext, staged):
    N, mt, K, H = 4, 4096, 8, 7168
    plan = ext.internode_plan(N, mt, K, 2 * H, H // 128, 2 * H, staged)
    offs = [plan[s] for s in SECTIONS]
    assert offs == sorted(offs) and all(o % 256 == 0 for o in offs)
    slots = N * mt
    assert plan["d_s"] - plan["d_x"] >= slots * 2 * H  # a slot per (source node, token)
    assert plan["scale_cols"] == H // 128  # the FP8 scales alone (the in-node stage needs no order key)
    assert plan["d_idx"] - plan["d_s"] >= slots * plan["scale_cols"] * 4
    assert plan["c_w"] - plan["c_y"] >= slots * 2 * H
    staging = plan["s_cw"] + (slots * K * 4 if staged else 0) - plan["s_x"]
    assert (staging > mt * 2 * H) == staged  # staging only where puts need it
    assert plan["total"] >= plan["s_cw"]


def test_layout_grows_with_nodes_and_tokens(ext):
    small = ext.internode_plan(2, 64, 8, 1024, 4, 1024, False)["total"]
    assert ext.internode_plan(4, 64, 8, 1024, 4, 1024, False)["total"] > small
    assert ext.internode_plan(2, 128, 8, 1024, 4, 1024, False)["total"] > small


def test_in_node_stage_sizing():
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
    from megatron_ep.cuda import hosts
    from megatron_ep.cuda.runtime import gather, largest

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
    from megatron_ep.cuda import nvshmem

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
