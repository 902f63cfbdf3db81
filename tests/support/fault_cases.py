"""Faults of a collective call, run on every rank of a DistPool, on either backend.

Each fault is something a rank does differently from its peers (another hidden size, dtype,
top-k, expert count or op; a check that fails on one rank only; a bad handle). The contract:
every rank raises a named error within 2 s, nothing is written into a peer, and the buffer
then works for the next agreed call (checked after every fault with a full dispatch + combine
against the oracle). Every rank makes the same number of calls, so the pools stay in step.
"""

from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from cases import make_buffer
from megatron_ep.core.errors import CallMismatchError, PeerFailedError
from oracle import expected_expert_major, expected_rank_major, make_inputs, num_destinations, split_x

LIMIT_S = 2.0


class Faults:
    def __init__(self, buf, backend, device):
        R, rank = dist.get_world_size(), dist.get_rank()
        self.buf, self.backend, self.device, self.R, self.rank = buf, backend, device, R, rank
        self.errors = []
        self.E, self.K, self.H, self.T = 4 * R, 3, 256, 6
        self.inputs = make_inputs(91, R, self.E, self.K, self.H, [self.T] * R, "bf16", "random", 0.2)
        me = self.inputs[rank]
        self.x, self.idx, self.w = me["x"].to(device), me["idx"].to(device), me["w"].to(device)

    def tag(self, name):
        return f"[{self.backend} R={self.R} rank={self.rank}] {name}"

    def expect(self, name, fn, errors, text, sync=False):
        """fn must raise one of `errors` mentioning `text` on this rank, within LIMIT_S (async
        cuda calls report at synchronize(), so `sync` adds it)."""
        start = time.monotonic()
        try:
            fn()
            if sync:
                self.buf.synchronize()
            self.errors.append(f"{self.tag(name)}: no error")
        except errors as exc:
            took = time.monotonic() - start
            if text not in str(exc):
                self.errors.append(f"{self.tag(name)}: {type(exc).__name__} {str(exc)!r} does not mention {text!r}")
            if took > LIMIT_S:
                self.errors.append(f"{self.tag(name)}: raised after {took:.1f}s (limit {LIMIT_S}s)")
        except Exception as exc:  # noqa: BLE001 - a wrong error type is a failure too
            self.errors.append(f"{self.tag(name)}: unexpected {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        self.still_works(name)

    def still_works(self, after):
        """A full agreed round: dispatch bit-exact, round trip of all-ones exact."""
        try:
            out = self.buf.dispatch(self.x, self.idx, self.w, num_experts=self.E)
            exp = expected_rank_major(self.inputs, self.rank, self.R, self.E)
            if not torch.equal(out.x.cpu().view(torch.int16), exp["x"].view(torch.int16)):
                self.errors.append(f"{self.tag(after)}: next dispatch not exact")
            back = self.buf.combine(torch.ones_like(out.x), out.handle)
            want = num_destinations(self.inputs[self.rank], self.R, self.E, False).unsqueeze(1).expand(-1, self.H)
            if not torch.equal(back.x.cpu().double(), want):
                self.errors.append(f"{self.tag(after)}: buffer unusable afterwards")
            self.buf.synchronize()
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"{self.tag(after)}: buffer unusable afterwards: {type(exc).__name__}: {exc}")


def run_disagreements(backend: str = "torch", device: str = "cpu") -> list:
    """Ranks that disagree on the call: every rank raises CallMismatchError naming the field."""
    buf = make_buffer(backend, max_tokens_per_rank=64)
    f = Faults(buf, backend, device)
    R, rank, E, K, T = f.R, f.rank, f.E, f.K, f.T
    x, idx, w = f.x, f.idx, f.w
    mine = rank == 0
    good = buf.dispatch(x, idx, w, num_experts=E)
    g = torch.Generator().manual_seed(7 + rank)

    x_h = torch.randn((T, 256 if mine else 512), generator=g).to(torch.bfloat16).to(device)
    f.expect("hidden", lambda: buf.dispatch(x_h, idx, w, num_experts=E), CallMismatchError, "hidden")
    # same bytes per row, different dtype (fp32 H=128 vs bf16 H=256): must not pass as equal
    x_d = torch.randn((T, 128), generator=g).to(device) if mine else torch.randn((T, 256), generator=g).to(torch.bfloat16).to(device)
    f.expect("dtype", lambda: buf.dispatch(x_d, idx, w, num_experts=E), CallMismatchError, "dtype")
    idx_k = idx[:, :K - 1].contiguous() if mine else idx
    w_k = w[:, :K - 1].contiguous() if mine else w
    f.expect("topk", lambda: buf.dispatch(x, idx_k, w_k, num_experts=E), CallMismatchError, "topk")
    f.expect("num_experts", lambda: buf.dispatch(x, idx, w, num_experts=2 * E if mine else E), CallMismatchError, "num_experts")
    f.expect("permute", lambda: buf.dispatch(x, idx, w, num_experts=E, permute=mine), CallMismatchError, "permute")
    f.expect("weights", lambda: buf.dispatch(x, idx, w if mine else None, num_experts=E), CallMismatchError, "weights")

    def other_ops():
        if mine:
            buf.dispatch(x, idx, w, num_experts=E)
        else:
            buf.combine(torch.ones_like(split_x(good.x)[0]), good.handle)
    f.expect("op", other_ops, CallMismatchError, "different operations", sync=True)

    def combine_hidden():
        rows = split_x(good.x)[0]
        y = torch.ones((rows.shape[0], 512 if mine else 256), dtype=torch.bfloat16, device=device)
        buf.combine(y, good.handle)
    f.expect("combine hidden", combine_hidden, CallMismatchError, "hidden", sync=True)

    other = buf.dispatch(x, idx, w, num_experts=E)

    def combine_handles():  # same shapes, handles of two different dispatches
        h = good.handle if mine else other.handle
        buf.combine(torch.ones((h.num_recv_rows, f.H), dtype=torch.bfloat16, device=device), h)
    if R > 1:
        f.expect("handles", combine_handles, CallMismatchError, "handles from different dispatches", sync=True)
    buf.destroy()
    return f.errors


def run_one_rank_fails(backend: str = "torch", device: str = "cpu") -> list:
    """A check that fails on one rank only: that rank raises its own error, every other rank
    raises PeerFailedError with its message (not a timeout), and the next call works."""
    buf = make_buffer(backend, max_tokens_per_rank=64)
    f = Faults(buf, backend, device)
    R, rank, E, T = f.R, f.rank, f.E, f.T
    x, idx, w = f.x, f.idx, f.w
    bad = rank == R - 1
    good = buf.dispatch(x, idx, w, num_experts=E)
    permuted = buf.dispatch(x, idx, w, num_experts=E, permute=True, expert_alignment=4)

    hi = idx.clone()
    hi[0, 0] = E + 5
    errs = ValueError if bad else PeerFailedError
    text = "num_experts" if bad else f"rank {R - 1} failed"
    f.expect("bad id on one rank", lambda: buf.dispatch(x, hi if bad else idx, w, num_experts=E), errs, text)
    # the other checks of the ids: below -1, an expert twice in a token; expert-major; worst-case
    # sized (the cuda intranode path checks a sync dispatch's ids in notify, a sync-free one's on the
    # host; a sync-free call's peers learn of the failure on the device: at synchronize())
    lo, dup = idx.clone(), idx.clone()
    lo[1, 2] = -3
    dup[2, 0] = dup[2, 1] = 1
    f.expect("id below -1 on one rank", lambda: buf.dispatch(x, lo if bad else idx, w, num_experts=E), errs,
             ">= -1" if bad else text)
    f.expect("an expert twice on one rank", lambda: buf.dispatch(x, dup if bad else idx, w, num_experts=E), errs,
             "twice" if bad else text)
    f.expect("bad id on one rank, expert-major", lambda: buf.dispatch(x, hi if bad else idx, w, num_experts=E,
                                                                      permute=True, expert_alignment=4), errs, text)
    f.expect("bad id on one rank, worst-case sized", lambda: buf.dispatch(x, hi if bad else idx, w, num_experts=E,
                                                                          num_worst_tokens=R * T), errs, text, sync=True)
    w_bad = w[:, :-1].contiguous() if bad else w
    f.expect("bad weights on one rank, cached", lambda: buf.dispatch(x, handle=good.handle, topk_weights=w_bad),
             ValueError if bad else PeerFailedError, "topk_weights", sync=True)
    if backend == "torch":  # fp64 weights are valid there, and change the bytes on the wire
        f.expect("weights dtype", lambda: buf.dispatch(x, handle=good.handle, topk_weights=w.double() if bad else w),
                 CallMismatchError, "weights", sync=True)
    else:  # the cuda backend takes fp32 weights only: a one-rank check
        f.expect("weights dtype", lambda: buf.dispatch(x, handle=good.handle, topk_weights=w.double() if bad else w),
                 TypeError if bad else PeerFailedError, "float32", sync=True)

    def bad_combine_weights():
        rows = split_x(permuted.x)[0]
        wts = torch.zeros((rows.shape[0], 2) if bad else (rows.shape[0],), device=device)
        buf.combine(torch.ones_like(rows), permuted.handle, weights=wts)
    f.expect("bad combine weights on one rank", bad_combine_weights, ValueError if bad else PeerFailedError,
             "weights must have shape" if bad else "weights must have shape", sync=True)

    def one_rank_too_many_tokens():
        big = torch.zeros((65, f.H), dtype=torch.bfloat16, device=device)
        big_idx = torch.full((65, f.K), -1, dtype=torch.int64, device=device)
        buf.dispatch(big if bad else x, big_idx if bad else idx, None, num_experts=E)
    f.expect("too many tokens on one rank", one_rank_too_many_tokens, ValueError if bad else PeerFailedError,
             "sized for" if bad else "sized for")
    buf.destroy()
    return f.errors


def run_exact_faults(backend: str = "torch", device: str = "cpu") -> list:
    """Unchecked ids outside [0, E) (check_inputs=False) are unused slots on every backend:
    dispatch equals the oracle with those slots -1, and combine reads nothing else."""
    R, rank = dist.get_world_size(), dist.get_rank()
    buf = make_buffer(backend, max_tokens_per_rank=64, check_inputs=False)
    errors = []
    E, K, H, T = 4 * R, 4, 128, 12
    inputs = make_inputs(17, R, E, K, H, [T] * R, "bf16", "random", 0.1)
    clean = [dict(i, idx=_mark(i["idx"], -1, -1)) for i in inputs]
    me = inputs[rank]
    x, w, idx = me["x"].to(device), me["w"].to(device), _mark(me["idx"], E + 3, -7).to(device)
    for permute in (False, True):
        tag = f"[{backend} rank {rank} permute={permute}] out-of-range ids"
        out = buf.dispatch(x, idx, w, num_experts=E, permute=permute, expert_alignment=8 if permute else 1)
        exp = expected_expert_major(clean, rank, R, E, 8) if permute else expected_rank_major(clean, rank, R, E)
        if not torch.equal(out.x.cpu().view(torch.int16), exp["x"].view(torch.int16)):
            errors.append(f"{tag}: dispatch differs from the oracle with those slots unused")
        if not permute and not torch.equal(out.topk_idx.cpu(), exp["idx"]):
            errors.append(f"{tag}: topk_idx differs")
        back = buf.combine(torch.ones_like(out.x), out.handle)
        want = num_destinations(clean[rank], R, E, permute).unsqueeze(1).expand(-1, H)
        if not torch.equal(back.x.cpu().double(), want):
            errors.append(f"{tag}: combine read rows it should not")
    buf.synchronize()
    buf.destroy()
    return errors


def run_no_sync_checks(backend: str = "torch", device: str = "cpu") -> list:
    """Buffer(check_inputs="no_sync"): the ids are checked only where that adds no host sync. A
    dispatch with an id out of range raises on the torch backend (its dispatch syncs for its counts
    anyway) and on the cuda intranode path (its notify reads the ids); get_dispatch_layout and the
    low-latency dispatch (torch backend here) take it as an unused slot, as check_inputs=False does."""
    R, rank = dist.get_world_size(), dist.get_rank()
    buf = make_buffer(backend, max_tokens_per_rank=64, check_inputs="no_sync")
    errors = []
    E, K, H, T = 4 * R, 4, 128, 12
    me = make_inputs(23, R, E, K, H, [T] * R, "bf16", "random", 0.1)[rank]
    x, w = me["x"].to(device), me["w"].to(device)
    bad, clean = _mark(me["idx"], E + 3, -1).to(device), _mark(me["idx"], -1, -1).to(device)
    tag = f"[{backend} rank {rank}] check_inputs='no_sync'"
    try:
        buf.dispatch(x, bad, w, num_experts=E)
        if backend == "torch" or "intranode" in buf._impl.describe():
            errors.append(f"{tag}: a dispatch with id {E + 3} did not raise")
    except ValueError as e:
        if "num_experts" not in str(e):
            errors.append(f"{tag}: the dispatch's error does not name num_experts: {e}")
    got = buf.get_dispatch_layout(bad, E)
    want = buf.get_dispatch_layout(clean, E)
    if not torch.equal(got.tokens_per_expert.cpu(), want.tokens_per_expert.cpu()):
        errors.append(f"{tag}: get_dispatch_layout counted the out-of-range id")
    if backend == "torch":
        ll = buf.low_latency_dispatch(x, bad, num_experts=E, max_tokens_per_rank=T, use_fp8=False)
        ll_clean = buf.low_latency_dispatch(x, clean, num_experts=E, max_tokens_per_rank=T, use_fp8=False)
        if not torch.equal(ll.count.cpu(), ll_clean.count.cpu()):
            errors.append(f"{tag}: the low-latency dispatch delivered the out-of-range id's copy")
    ok = buf.dispatch(x, clean, w, num_experts=E)  # usable after the refusal
    back = buf.combine(torch.ones_like(ok.x), ok.handle)
    want = num_destinations(dict(me, idx=clean.cpu()), R, E, False).unsqueeze(1).expand(-1, H)
    if not torch.equal(back.x.cpu().double(), want):
        errors.append(f"{tag}: the Buffer is not usable after the refused dispatch")
    buf.synchronize()
    buf.destroy()
    return errors


def _mark(idx, first, second):
    """Row 0 slot 0 and row 1 slot 1 set to the given ids (bad ids, or -1 for the oracle)."""
    out = idx.clone()
    out[0, 0] = first
    out[1, 1] = second
    return out


def run_alignment_bound(backend: str = "torch", device: str = "cpu") -> list:
    R, rank = dist.get_world_size(), dist.get_rank()
    buf = make_buffer(backend, max_tokens_per_rank=64)
    f = Faults(buf, backend, device)
    f.expect("alignment 2**20", lambda: buf.dispatch(f.x, f.idx, f.w, num_experts=f.E, permute=True,
                                                     expert_alignment=2 ** 20), ValueError, "expert_alignment")
    buf.destroy()
    return f.errors


def run_all_faults(backend: str = "torch", device: str = "cpu") -> list:
    errors = []
    for fn in (run_disagreements, run_one_rank_fails, run_exact_faults, run_no_sync_checks, run_alignment_bound):
        try:
            errors += fn(backend, device)
        except Exception:  # noqa: BLE001 - report, keep the ranks going
            errors.append(f"{fn.__name__} raised:\n{traceback.format_exc()}")
    return errors
