"""The host side of the cuda low-latency path (megatron_ep/backends/cuda/paths/low_latency.py) on CPU, with the
extension's buffer replaced by a recorder: buffer-set alternation, the recv-hook bookkeeping
(two results in flight, a third refused before anything launches), capacity errors, and the
decoding of what the kernels report (timeouts name the rank and the wait; mismatches clear)."""

import ctypes
import os
import types

import pytest
import torch
import torch.distributed as dist

from megatron_ep.backends.cuda import extension as _ext
from megatron_ep.backends.cuda import nvshmem
from megatron_ep.core import protocol as P
from megatron_ep.core.errors import BufferBrokenError, CallMismatchError, CommTimeoutError
from megatron_ep.backends.cuda.paths import low_latency as LL
from megatron_ep.backends.cuda.sm_budget import SmBudget


class FakeBuffer:
    """Stands in for _C_nvshmem.LowLatencyBuffer: records launches, reports a settable error
    (`err`, whose code the error word at error_address() holds, as the mapped record's does)."""

    def __init__(self, device, rank, pes, E, mt, H, K, fp8_only, timeout_s, shrink):
        self.cap = (E, mt, H, K, fp8_only)
        self.R = len(pes)
        self.timeout_s, self.shrink = timeout_s, shrink
        self.launches = []  # (op, set, phases), ("mask", ...), ("barrier",)
        self.code = ctypes.c_int(0)
        self.err = None
        self.cleared = 0
        self.reads = 0  # error() crossings

    @property
    def err(self):
        return self._err

    @err.setter
    def err(self, value):
        self._err = value
        self.code.value = 0 if value is None else value["code"]

    def error_address(self):
        return ctypes.addressof(self.code)

    def dispatch(self, x, idx, E, fp8, round_scale, s, phases, sig, *outs_and_blocks):
        self.launches.append(("dispatch", s, phases))

    def dispatch_call(self, x, idx, E, fp8, round_scale, ue8m0, s, phases, sig, seq, mt, w, recv_stats, wait_stats,
                      num_blocks, launch):
        """The outputs the extension's dispatch_call makes (their shapes), and the launch if asked."""
        L, cap, H, K = E // self.R, self.R * mt, x.shape[1], idx.shape[1]
        i32 = dict(dtype=torch.int32, device=x.device)
        outs = (torch.empty((L, cap, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=x.device),
                torch.empty((L, cap, H // 128), device=x.device) if fp8 and not ue8m0 else None,
                torch.empty((L, H // 512, cap), **i32) if ue8m0 else None,
                torch.empty(L, **i32), torch.empty((L, self.R, 2), **i32),
                torch.empty((L, self.R), dtype=torch.int64, device=x.device), torch.empty((L, cap), **i32),
                torch.empty((L, cap), **i32),
                torch.empty((L, cap), device=x.device) if w is not None else None,
                torch.empty((self.R, mt, K), **i32) if w is not None else None)
        if launch:
            self.dispatch(x, idx, E, fp8, round_scale, s, phases, sig)
        return outs

    def combine(self, x, rng, src, slot, idx, w, E, s, phases, sig, seq, y, pairs, row_w, wait_stats, use_logfmt, num_blocks):
        self.launches.append(("combine", s, phases))
        self.merged, self.logfmt = pairs is not None, use_logfmt

    def combine_call(self, x, rng, src, slot, idx, w, E, s, phases, sig, seq, out, pairs, row_w, wait_stats, use_logfmt,
                     num_blocks):
        y = out if out is not None else torch.empty((idx.shape[0], x.shape[2]), dtype=x.dtype, device=x.device)
        self.combine(x, rng, src, slot, idx, w, E, s, phases, sig, seq, y, pairs, row_w, wait_stats, use_logfmt, num_blocks)
        return y

    def set_mask(self, rank, masked):
        self.launches.append(("mask", rank, masked))

    def query_mask(self, out):
        self.launches.append(("query",))

    def clear_mask(self):
        self.launches.append(("clear",))

    def barrier(self):
        self.launches.append(("barrier",))

    def error(self):
        self.reads += 1
        return self.err

    def clear_error(self):
        self.err, self.cleared = None, self.cleared + 1


@pytest.fixture()
def path(monkeypatch):
    try:
        real = _ext.load_nvshmem()
    except RuntimeError as exc:
        pytest.skip(f"_C_nvshmem not built here ({exc})")
    fake = types.SimpleNamespace(plan=real.plan, MAX_BLOCKS=real.MAX_BLOCKS, MAX_RANKS=real.MAX_RANKS, SEND=real.SEND,
                                 RECV=real.RECV, my_pe=lambda: 0, LowLatencyBuffer=FakeBuffer)
    monkeypatch.setattr(_ext.NVSHMEM, "module", fake)
    monkeypatch.setattr(nvshmem, "init", lambda *a: 1 << 40)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    rt = types.SimpleNamespace(group=dist.group.WORLD, rank=0, num_ranks=1, device=torch.device("cpu"),
                               ranks_per_device=1, sm_count=132, timeout_s=5.0, new_outputs=lambda ts: False,
                               budget=SmBudget(1, 1, 132))  # the runtime's own rule
    try:
        yield LL.LowLatencyPath(rt, dict(num_experts=8, max_tokens=16, hidden=256, topk=4))
    finally:
        dist.destroy_process_group()


def _inputs(T=5, H=256, E=8, K=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx, torch.rand((T, K), generator=g)


def _call(op, seq):
    return P.Call(P.OP[op], seq)


def test_sets_alternate_and_hooks_hold_them(path):
    x, idx, w = _inputs()
    seq = iter(range(1, 100))
    out = path.dispatch(_call("low_latency_dispatch", next(seq)), x, idx, 8, 16, True, False)
    assert out.hook is None and out.x[0].shape == (8, 16, 256) and out.x[1].shape == (8, 16, 2)
    y = path.combine(_call("low_latency_combine", next(seq)), torch.zeros((8, 16, 256), dtype=torch.bfloat16), idx, w,
                     out.handle)
    assert y.shape == (5, 256) and y.dtype == torch.bfloat16
    both = path.ext.SEND | path.ext.RECV
    assert path.buf.launches == [("dispatch", 0, both), ("combine", 1, both)]

    a = path.dispatch(_call("low_latency_dispatch", next(seq)), x, idx, 8, 16, False, False, return_recv_hook=True)
    b = path.dispatch(_call("low_latency_dispatch", next(seq)), x, idx, 8, 16, False, False, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="in flight"):
        path.dispatch(_call("low_latency_dispatch", next(seq)), x, idx, 8, 16, True, False)
    b.hook()  # set 1 is free again, but the next call needs set 0, still held by `a`
    with pytest.raises(RuntimeError, match="hook of call #3"):
        path.dispatch(_call("low_latency_dispatch", next(seq)), x, idx, 8, 16, True, False)
    a.hook()
    with pytest.raises(RuntimeError, match="already called"):
        a.hook()
    y, hook = path.combine(_call("low_latency_combine", next(seq)), torch.zeros((8, 16, 256), dtype=torch.bfloat16), idx,
                           w, a.handle, return_recv_hook=True)
    hook()
    send, recv = path.ext.SEND, path.ext.RECV
    assert path.buf.launches[2:] == [("dispatch", 0, send), ("dispatch", 1, send), ("dispatch", 1, recv),
                                     ("dispatch", 0, recv), ("combine", 0, send), ("combine", 0, recv)]


def test_capacity_and_argument_errors(path):
    x, idx, w = _inputs(H=512)
    with pytest.raises(ValueError, match="sized for.*hidden 512 > 256"):
        path.dispatch(_call("low_latency_dispatch", 1), x, idx, 8, 16, True, False)
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="bf16 rows in a buffer sized for FP8|sized for"):
        path.dispatch(_call("low_latency_dispatch", 1), x, idx, 8, 32, True, False)
    with pytest.raises(TypeError, match="bf16"):
        path.dispatch(_call("low_latency_dispatch", 1), x.float(), idx, 8, 16, True, False)
    assert path.buf.launches == [] and path.next_set == 0  # nothing launched, every rank still on set 0
    with pytest.raises(TypeError, match="unknown keys"):
        LL.LowLatencyPath(path.rt, dict(max_tokens_per_rank=16))


def test_kernel_reports_become_named_errors(path):
    x, idx, w = _inputs()
    path.dispatch(_call("low_latency_dispatch", 1), x, idx, 8, 16, True, False)  # (the buffer made)
    path.check()
    assert path.buf.reads == 0  # a clear error word: no crossing to read the record
    path.buf.err = dict(code=P.ERROR["mismatch"], op=P.OP["low_latency_dispatch"], what=1, expert=2, peer=0, set=0,
                        sig_expected=0x1234, sig_got=0x99)
    with pytest.raises(CallMismatchError, match="signature hash 0x99 vs 0x1234"):
        path.check()
    assert path.buf.cleared == 1 and path.buf.reads == 1
    path.check()  # cleared: usable
    path.buf.err = dict(code=P.ERROR["timeout"], op=P.OP["low_latency_dispatch"], what=1, expert=3, peer=0, set=1,
                        sig_expected=0, sig_got=0)
    with pytest.raises(CommTimeoutError, match="rank 0's token count for local expert 3 .* buffer set 1"):
        path.check()
    with pytest.raises(BufferBrokenError):
        path.check()


def test_size_syntax():
    p = nvshmem.parse_size
    assert p("2G") == 2 << 30 and p("512m") == 512 << 20 and p("4096") == 4096 and p("1.5g") == 3 << 29


def test_decode_layer_on_the_torch_backend(pools):
    """DecodeMoELayer's own logic (dispatch -> masked MLP -> combine) on 2 gloo ranks against a
    dense reference; the cuda run of the same case is in tests/cuda/test_cuda_low_latency.py."""
    import ll_cases

    cfg = dict(seed=3, E=8, K=3, H=256, F=128, T=6, max_tokens=8)
    errors = [e for r in pools(2).run(ll_cases.run_ll_decode_layer_case, cfg, backend="torch", device="cpu") for e in r]
    assert not errors, "\n".join(errors)


def test_combine_out_is_checked_on_the_torch_backend(pools):
    """low_latency_combine(out=): a wrong shape, dtype or kind refused naming `out` (on our Buffer
    and through megatron_ep.deep_ep); a right one written and returned."""
    import ll_cases

    errors = [e for r in pools(2).run(ll_cases.run_ll_combine_out_case) for e in r]
    assert not errors, "\n".join(errors[:20])


def test_decode_layer_refuses_gradients(pools):
    """It runs without autograd: a derivative through it must raise, not miss the layer."""
    import ll_cases

    cfg = dict(seed=4, E=4, K=2, H=128, F=64, T=5, max_tokens=8)
    errors = [e for r in pools(2).run(ll_cases.run_decode_layer_refuses_gradients, cfg) for e in r]
    assert not errors, "\n".join(errors)


def test_round_scale_and_edge_value_cases_on_the_torch_backend(pools):
    """The GPU suite's extra low-latency cases (power-of-two scales, FP8 edge values) hold on the
    torch backend, so a failure on the GPU points at the kernels, not at the case helpers."""
    import cases

    cfgs = [dict(seed=11, E=8, K=4, H=256, fp8=True, pattern="hot", Ts=[5, 3], max_tokens=8, round_scale=True),
            dict(seed=12, E=8, K=4, H=512, fp8=True, pattern="random", Ts=[7, 7], max_tokens=8, x_edge=True)]
    errors = [e for r in pools(2).run(cases.run_low_latency_cases, cfgs) for e in r]
    assert not errors, "\n".join(errors)


def test_combine_merges_only_with_the_dispatchs_weights(path):
    """The merged combine (one row per token and rank, weighted at the expert side) runs only
    when the dispatch got the weights and the combine gets that very tensor, unchanged since;
    anything else takes the per-copy combine, which weights at the source."""
    x, idx, w = _inputs()
    seq = iter(range(1, 100))
    rows = torch.zeros((8, 16, 256), dtype=torch.bfloat16)

    def merged(dispatch_w, combine_w, change=None):
        out = path.dispatch(_call("low_latency_dispatch", next(seq)), x, idx, 8, 16, True, False, topk_weights=dispatch_w)
        if change is not None:
            change()
        path.combine(_call("low_latency_combine", next(seq)), rows, idx, combine_w, out.handle)
        return path.buf.merged

    assert merged(w, w)
    assert not merged(None, w)
    assert not merged(w, w.clone())  # equal values, another tensor
    assert not merged(w, w, change=lambda: w.mul_(1.0))  # changed in place after the dispatch
    with torch.inference_mode():  # no version counter: the same tensor still merges
        wi = w.clone()
    assert merged(wi, wi)


def test_the_combine_signature_carries_logfmt_and_the_merge(path):
    """Every rank's sender writes what the others' receivers read: use_logfmt and the merged
    combine go into the call's signature (`variant`), so ranks that differ abort instead of
    reading each other's rows in the wrong format; use_logfmt reaches the kernel."""
    x, idx, w = _inputs()
    rows = torch.zeros((8, 16, 256), dtype=torch.bfloat16)
    variants = []
    for seq, (dispatch_w, logfmt) in enumerate([(None, False), (None, True), (w, False), (w, True)]):
        out = path.dispatch(_call("low_latency_dispatch", 2 * seq + 1), x, idx, 8, 16, True, False, topk_weights=dispatch_w)
        call = _call("low_latency_combine", 2 * seq + 2).set(variant=P.LL_COMBINE_LOGFMT if logfmt else 0)
        path.combine(call, rows, idx, w, out.handle, use_logfmt=logfmt)
        assert path.buf.logfmt == logfmt
        variants.append(call.get("variant"))
    assert variants == [0, P.LL_COMBINE_LOGFMT, P.LL_COMBINE_MERGED, P.LL_COMBINE_LOGFMT | P.LL_COMBINE_MERGED]


def test_rank_mask_entries(path):
    """The rank mask's host side: off unless asked for (each entry raises naming the option); on,
    the kernels get mask_timeout_s (the host keeps its timeout), the entries check their
    arguments, and the barrier refuses while a receive hook is pending and restarts at set 0."""
    with pytest.raises(RuntimeError, match="rank_mask=True"):
        path.set_mask(0, True)
    with pytest.raises(ValueError, match="mask_timeout_s needs rank_mask=True"):
        LL.LowLatencyPath(path.rt, dict(num_experts=8, max_tokens=16, hidden=256, topk=4, mask_timeout_s=2))
    p = LL.LowLatencyPath(path.rt, dict(num_experts=8, max_tokens=16, hidden=256, topk=4, rank_mask=True,
                                        mask_timeout_s=2))
    assert p.buf.shrink and p.buf.timeout_s == 2.0 and p.timeout_s == 5.0
    assert not path.buf.shrink and path.buf.timeout_s == 5.0
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 1\)"):
        p.set_mask(1, True)
    with pytest.raises(ValueError, match="int32 tensor of 1 elements"):
        p.mask_status(torch.zeros(1, dtype=torch.int64))
    p.set_mask(0, True)
    p.mask_status(torch.zeros(1, dtype=torch.int32))
    p.clear_mask()
    x, idx, w = _inputs()
    out = p.dispatch(_call("low_latency_dispatch", 1), x, idx, 8, 16, False, False, return_recv_hook=True)
    assert p.next_set == 1
    with pytest.raises(RuntimeError, match=r"receive hooks of calls \[1\] were not called"):
        p.barrier()
    out.hook()
    p.barrier()
    assert p.next_set == 0
    assert p.buf.launches == [("mask", 0, True), ("query",), ("clear",), ("dispatch", 0, p.ext.SEND),
                              ("dispatch", 0, p.ext.RECV), ("barrier",)]


@pytest.fixture()
def ll_buf(path, monkeypatch):
    """A Buffer of one rank whose cuda backend's low-latency path is `path` (over the recorder);
    `entries` lists which of the path's dispatch entries each call took, `crossings` the
    arguments of each crossing."""
    import megatron_ep as mep
    from megatron_ep.backends.cuda.backend import CudaBackend

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (no driver here)

    b = mep.Buffer(dist.group.WORLD, backend="torch", check_inputs=False)
    be = CudaBackend.__new__(CudaBackend)
    be.path, be.rt, be._ll, be.rank, be.num_ranks, be.ranks_per_node = None, path.rt, path, 0, 1, 1
    b._impl, b.backend = be, "cuda"
    b.entries, b.crossings, b.returns = [], [], []
    for name in ("dispatch", "_replay_dispatch", "combine", "_replay_combine"):
        def entry(*args, _f=getattr(path, name), _n=name, **kwargs):
            b.entries.append(_n)
            return _f(*args, **kwargs)
        setattr(path, name, entry)
    real = path.buf.dispatch_call
    path.buf.dispatch_call = lambda *a: b.crossings.append(a) or real(*a)
    real_combine = path.buf.combine_call
    path.buf.combine_call = lambda *a: b.returns.append(a) or real_combine(*a)
    return b


def _same_crossing(a: tuple, b: tuple) -> bool:
    """Every argument of two dispatch_call crossings the same (tensors: the same object), but the
    buffer set, the signature hash and the sequence number (positions 6, 8 and 9)."""
    return len(a) == len(b) and all(i in (6, 8, 9) or (u is v if isinstance(u, torch.Tensor) else u == v)
                                    for i, (u, v) in enumerate(zip(a, b)))


def test_a_low_latency_dispatch_of_the_same_shape_replays_the_same_crossing(ll_buf):
    """A decode step's dispatch of the last one's shape and options, into the same statistics
    tensors, skips Buffer's checks and the path's (megatron_ep/core/replay.py) and crosses with what
    the full call crossed with, on the next buffer set, under its own sequence number, with the
    full call's signature."""
    x, idx, w = _inputs()
    stats = torch.zeros(8, dtype=torch.int32)
    kw = dict(num_experts=8, max_tokens_per_rank=16, topk_weights=w, cumulative_local_expert_recv_stats=stats)
    outs = [ll_buf.low_latency_dispatch(x, idx, **kw) for _ in range(3)]
    assert ll_buf.entries == ["dispatch", "_replay_dispatch", "_replay_dispatch"]
    first, *rest = ll_buf.crossings
    assert all(_same_crossing(first, c) for c in rest)
    assert [c[6] for c in ll_buf.crossings] == [0, 1, 0]  # the buffer sets alternate
    assert [c[9] for c in ll_buf.crossings] == [1, 2, 3]
    assert [o.handle.call_seq for o in outs] == [1, 2, 3]
    assert len({c[8] for c in ll_buf.crossings}) == 3  # the hash covers the sequence number
    for o in outs:
        assert o.handle.buffer_id == ll_buf.id and o.handle.topk_idx is idx and o.x[0].shape == (8, 16, 256)
    y = ll_buf.low_latency_combine(torch.zeros((8, 16, 256), dtype=torch.bfloat16), idx, w, outs[-1].handle)
    assert y.shape == (5, 256)


def test_a_low_latency_handle_has_each_value_in_its_named_field(ll_buf):
    """The path builds the handle positionally (host time): each field holds its own value, in the
    full call and in its replay."""
    from fields import check_fields

    x, idx, w = _inputs()
    for seq in (1, 2):
        out = ll_buf.low_latency_dispatch(x, idx, num_experts=8, max_tokens_per_rank=16, topk_weights=w)
        h = out.handle
        want = dict(backend="cuda", num_ranks=ll_buf.num_ranks, rank=ll_buf.rank, num_experts=8, num_tokens=5, topk=4,
                    max_tokens_per_rank=16, hidden=256, topk_idx=idx, buffer_id=ll_buf.id, call_seq=seq)
        check_fields(h, want, {"layout_range", "packed_layout", "src_token", "topk_idx_version", "state"})
        assert h.layout_range.dtype == torch.int32 and tuple(h.layout_range.shape) == (8, 1, 2)
        assert h.packed_layout.dtype == torch.int64 and tuple(h.packed_layout.shape) == (8, 1)
        assert h.src_token.dtype == torch.int32 and tuple(h.src_token.shape) == (8, 16)
        assert h.topk_idx_version == idx._version and h.state.weights is w and h.state.set == seq - 1


@pytest.mark.parametrize("change", ["tokens", "hidden", "experts", "max_tokens", "bf16", "round_scale", "weights",
                                    "weights_dtype", "stats", "hook", "idx_int32", "grad", "kwarg", "capture"])
def test_a_low_latency_dispatch_that_differs_takes_the_full_call(ll_buf, change, monkeypatch):
    """What differs from the replayed call in shape, option or statistics tensor is checked again
    (and refused where the full call refuses it)."""
    x, idx, w = _inputs()
    stats = torch.zeros(8, dtype=torch.int32)
    kw = dict(num_experts=8, max_tokens_per_rank=16, topk_weights=w, cumulative_local_expert_recv_stats=stats)
    ll_buf.low_latency_dispatch(x, idx, **kw)
    x2, idx2, kw2 = x, idx, dict(kw)
    if change == "tokens":
        x2, idx2, w2 = _inputs(T=4)
        kw2["topk_weights"] = w2
    elif change == "hidden":
        x2 = torch.zeros((5, 128), dtype=torch.bfloat16)
    elif change == "experts":
        kw2["num_experts"] = 4
    elif change == "max_tokens":
        kw2["max_tokens_per_rank"] = 8
    elif change == "bf16":
        kw2["use_fp8"] = False
    elif change == "round_scale":
        kw2["round_scale"] = True
    elif change == "weights":
        kw2["topk_weights"] = None
    elif change == "weights_dtype":
        kw2["topk_weights"] = w.double()
    elif change == "stats":
        kw2["cumulative_local_expert_recv_stats"] = torch.zeros(8, dtype=torch.int32)
    elif change == "hook":
        kw2["return_recv_hook"] = True
    elif change == "idx_int32":
        idx2 = idx.int()
    elif change == "grad":
        x2 = x.clone().requires_grad_()
    elif change == "kwarg":
        kw2["use_ue8m0"] = 1  # not a bool: the full call's check refuses it
    elif change == "capture":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    try:
        out = ll_buf.low_latency_dispatch(x2, idx2, **kw2)
        if out.hook is not None:
            out.hook()
    except (TypeError, ValueError, RuntimeError):
        pass  # refused by the full call's checks, as without a replay
    assert ll_buf.entries[1:] in ([], ["dispatch"]) and "_replay_dispatch" not in ll_buf.entries


def test_a_low_latency_combine_of_the_same_shape_replays_the_same_crossing(ll_buf, monkeypatch):
    """A decode step's combine along a new handle of the last one's shape skips Buffer's checks
    and the path's; its signature names its own dispatch (routing) and the merge is decided
    again each call (the same weights the dispatch got: merged; others: per copy)."""
    signed = []
    real_hash = LL.signature_hash
    monkeypatch.setattr(LL, "signature_hash", lambda call: signed.append(list(call.sig)) or real_hash(call))
    x, idx, w = _inputs()
    rows = torch.zeros((8, 16, 256), dtype=torch.bfloat16)
    kw = dict(num_experts=8, max_tokens_per_rank=16, topk_weights=w)
    sigs = []
    for weights in (w, w, w.clone(), w):
        out = ll_buf.low_latency_dispatch(x, idx, **kw)
        y = ll_buf.low_latency_combine(rows, idx, weights, out.handle)
        assert y.shape == (5, 256)
        sigs.append((out.handle.call_seq, ll_buf._impl._ll.buf.merged))
    combines = [e for e in ll_buf.entries if "combine" in e]
    assert combines == ["combine", "_replay_combine", "_replay_combine", "_replay_combine"]
    assert [m for _, m in sigs] == [True, True, False, True]
    first, *rest = ll_buf.returns
    for c in rest:  # the same tensors but the routing's and the call's own (set, phases, hash, seq)
        assert c[0] is first[0] and c[4] is first[4] and c[6] == first[6] and c[16] == first[16]
    assert len({c[9] for c in ll_buf.returns}) == 4  # each call's own signature hash
    combined = [sig for sig in signed if sig[P.FIELD["op"]] == P.OP["low_latency_combine"]]
    assert [sig[P.FIELD["routing"]] for sig in combined] == [seq for seq, _ in sigs]
    assert [bool(sig[P.FIELD["variant"]] & P.LL_COMBINE_MERGED) for sig in combined] == [True, True, False, True]
    for sig in combined[1:]:  # the rest of the signature: the full call's
        assert [v for i, v in enumerate(sig) if i not in (P.FIELD["seq"], P.FIELD["routing"], P.FIELD["variant"])] == \
            [v for i, v in enumerate(combined[0]) if i not in (P.FIELD["seq"], P.FIELD["routing"], P.FIELD["variant"])]


@pytest.mark.parametrize("change", ["handle_shape", "weights_dtype", "stats", "hook", "out", "logfmt", "x_dtype",
                                    "grad", "other_buffer"])
def test_a_low_latency_combine_that_differs_takes_the_full_call(ll_buf, change):
    x, idx, w = _inputs()
    rows = torch.zeros((8, 16, 256), dtype=torch.bfloat16)
    out = ll_buf.low_latency_dispatch(x, idx, num_experts=8, max_tokens_per_rank=16)
    ll_buf.low_latency_combine(rows, idx, w, out.handle)
    x2, idx2, w2, rows2, kw = x, idx, w, rows, {}
    if change == "handle_shape":
        x2, idx2, w2 = _inputs(T=4)
    out2 = ll_buf.low_latency_dispatch(x2, idx2, num_experts=8, max_tokens_per_rank=16)
    if change == "weights_dtype":
        w2 = w2.double()
    elif change == "stats":
        kw["combine_wait_recv_cost_stats"] = torch.zeros(1, dtype=torch.int64)
    elif change == "hook":
        kw["return_recv_hook"] = True
    elif change == "out":
        kw["out"] = torch.empty((5, 256), dtype=torch.bfloat16)
    elif change == "logfmt":
        kw["use_logfmt"] = True
    elif change == "x_dtype":
        rows2 = rows.float()
    elif change == "grad":
        w2 = w2.clone().requires_grad_()
    elif change == "other_buffer":
        out2.handle.buffer_id = -1
    before = list(ll_buf.entries)
    try:
        res = ll_buf.low_latency_combine(rows2, idx2, w2, out2.handle, **kw)
        if change == "hook":
            res[1]()
    except (TypeError, ValueError, RuntimeError):
        pass  # refused by the full call's checks, as without a replay
    assert "_replay_combine" not in ll_buf.entries[len(before):]


def test_a_replayed_low_latency_combine_still_checks_its_routing(ll_buf):
    """Buffer(check_inputs=True): a combine must get its dispatch's routing; a combine that would
    replay is checked as the full call is (values compared with one sync)."""
    from megatron_ep.core import checks as C

    ll_buf._ids_level = C.IDS_CHECKED
    x, idx, w = _inputs()
    rows = torch.zeros((8, 16, 256), dtype=torch.bfloat16)
    out = ll_buf.low_latency_dispatch(x, idx, num_experts=8, max_tokens_per_rank=16)
    ll_buf.low_latency_combine(rows, idx, w, out.handle)
    ll_buf.low_latency_combine(rows, idx.clone(), w, out.handle)  # equal values, another tensor: accepted
    other = idx.flip(1).contiguous()
    with pytest.raises(ValueError, match="differs from the routing its dispatch got"):
        ll_buf.low_latency_combine(rows, other, w, out.handle)
