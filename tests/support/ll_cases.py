"""Low-latency case bodies for the cuda backend (run on every rank of a DistPool; see
tests/cuda/test_cuda_low_latency.py): CUDA-graph replays, the recv hook interleaved with compute, both
buffer sets in flight, a timeout and a signature mismatch, and the decode MoE layer in one CUDA
graph (DeepGEMM's masked GEMMs or the torch fallback: `masked_gemm`, also used by
tests/unit/test_experts.py). Helpers shared with cases.run_low_latency_case: the process-wide buffer,
FP8 edge values, power-of-two scales.

Every rank builds the same global inputs from one seed and checks its own part; collectives run
before any check so a failing rank never leaves its peers waiting.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import torch.distributed as dist

import megatron_ep as mep
from megatron_ep.core.errors import BufferBrokenError, CallMismatchError, CommTimeoutError, PeerFailedFatalError
from megatron_ep.core.fp8 import per_token_cast_back, per_token_cast_to_fp8, unpack_ue8m0
from graph_capture import captured
from oracle import expected_low_latency, make_inputs, split_x
from refusals import refusals

# One low-latency buffer per process fits every case (E <= 32 per rank at R = 8, T <= 128, K <= 9).
LL_SIZING = dict(num_experts=256, max_tokens=128, hidden=7168, topk=9, fp8_only=False)
_buffer = {}


def ll_buffer(**sizing) -> mep.Buffer:
    key = tuple(sorted(sizing.items()))
    if key not in _buffer:
        if os.environ.get("MEP_POISON") == "1":
            from cases import poison_
            from megatron_ep.core import output_hook as hooks

            hooks.set_output_hook(poison_)
        _buffer[key] = mep.Buffer(dist.group.WORLD, backend="cuda", low_latency={**LL_SIZING, **sizing})
    return _buffer[key]


def pow2_cast(x):
    return per_token_cast_to_fp8(x, round_scale=True)


def edge_values_(inputs) -> None:
    """Overwrite tokens with values that stress the FP8 cast: all zeros (the amax floor), tiny
    values (subnormal e4m3 results), signed zeros, powers of two, huge values, alternating signs."""
    for inp in inputs:
        x = inp["x"]
        T, H = x.shape
        g = torch.Generator().manual_seed(T * 7 + H)
        kinds = [torch.zeros(H), torch.randn(H, generator=g) * 1e-6, -torch.zeros(H),
                 2.0 ** torch.randint(-20, 20, (H,), generator=g).float(), torch.randn(H, generator=g) * 1e30,
                 torch.linspace(-448, 448, H), torch.randn(H, generator=g) * 1e-3 + 1.0]
        for t in range(T):
            x[t] = kinds[t % len(kinds)].to(x.dtype)


def round_scale_expected_(exp: dict, inputs, R: int) -> None:
    """Replace the oracle's FP8 rows by power-of-two-scale casts (megatron_ep.core.fp8, the formula the
    kernel must match), using the oracle's own row placement."""
    casts = [pow2_cast(inp["x"]) for inp in inputs]
    L = exp["count"].shape[0]
    for e in range(L):
        for s in range(R):
            b, n = exp["layout_range"][e, s].tolist()
            tok = exp["src_token"][e, b:b + n].long()
            exp["x"][e, b:b + n] = casts[s][0][tok]
            exp["scales"][e, b:b + n] = casts[s][1][tok]


def ue8m0_scales(chk, packed: torch.Tensor, L: int, rows: int, H: int) -> torch.Tensor:
    """UE8M0 scales as DeepEP and DeepGEMM take them (int32 [L, rows, H/512], column-major per
    expert), unpacked to fp32 [L, rows, H/128] for the value checks."""
    n = H // 512
    if packed.dtype != torch.int32 or tuple(packed.shape) != (L, rows, n):
        chk.errors.append(f"UE8M0 scales: {packed.dtype} {tuple(packed.shape)}, expected int32 {(L, rows, n)}")
        return torch.zeros((L, rows, H // 128), device=packed.device)
    if not packed.transpose(1, 2).is_contiguous():
        chk.errors.append(f"UE8M0 scales: strides {packed.stride()}, expected column-major {(n * rows, 1, rows)}")
    return unpack_ue8m0(packed)  # on the rows' device: the combine below scales them


def check_wait_stats(chk, backend: str, stats: list, idx: torch.Tensor, E: int, R: int) -> None:
    """The wait-cost statistics ([R] int64, dispatch then combine, from zero): on the cuda backend
    every source of the dispatch counts (each local expert waits for every rank's count), and the
    combine counts exactly the ranks this rank's tokens went to; the torch backend measures no
    waits and leaves both as they were."""
    d, c = (t.cpu() for t in stats)
    if backend != "cuda":
        if d.any() or c.any():
            chk.errors.append(f"wait-cost stats changed on the {backend} backend: {d.tolist()}, {c.tolist()}")
        return
    ids = idx[(idx >= 0) & (idx < E)]
    sent_to = torch.zeros(R, dtype=torch.bool)
    sent_to[ids // (E // R)] = True
    if not (d > 0).all():
        chk.errors.append(f"dispatch wait-cost stats {d.tolist()}: every source must count")
    if not torch.equal(c > 0, sent_to):
        chk.errors.append(f"combine wait-cost stats {c.tolist()}: nonzero exactly for the ranks tokens went to {sent_to.tolist()}")


LOGFMT_SHRINK = 2.0 ** -7  # exact in bf16: the combine rows' magnitudes (below ~100 here) fall below 1


def logfmt_rows(rows: torch.Tensor) -> torch.Tensor:
    """bf16 rows (any leading shape) that LogFMT encodes block by block at its widest step: scaled by
    a power of two below magnitude 1, and one zero per 128 channels (the block's amin clips to
    2^-32 of its amax). Exact bf16 operations, so the oracle repeats them."""
    out = (rows.float() * LOGFMT_SHRINK).to(torch.bfloat16)
    out[..., ::128] = 0
    return out


def logfmt_combine_ref(idx, w, row_of, L: int, H: int, merged: bool) -> torch.Tensor:
    """float64 [T, H]: the combine of LogFMT rows as the receiver sums them. Per copy: w x the
    decoded row. Merged (the dispatch carried the weights): a rank holding one copy of the token
    sends the row itself (weighted here); holding several, their fp32 weighted sum (k ascending)
    rounded to bf16, encoded once."""
    from megatron_ep.core import logfmt

    T, K = idx.shape
    out = []
    for t in range(T):
        acc = None
        by_rank = {}
        for k in range(K):
            e = int(idx[t, k])
            if e >= 0:
                by_rank.setdefault(e // L, []).append((k, e))
        for r, copies in sorted(by_rank.items()):
            if merged and len(copies) > 1:
                s = torch.zeros_like(row_of(t, copies[0][1]).float())
                for k, e in copies:
                    s = s + float(w[t, k]) * row_of(t, e).float()
                part = logfmt.roundtrip(s.to(torch.bfloat16).unsqueeze(0))[0].double()
            else:
                part = sum(float(w[t, k]) * logfmt.roundtrip(row_of(t, e).unsqueeze(0))[0].double() for k, e in copies)
            acc = part if acc is None else acc + part
        out.append(acc if acc is not None else torch.zeros(H, dtype=torch.float64))
    return torch.stack(out) if out else torch.zeros((0, H), dtype=torch.float64)


def check_closer_than_bf16(chk, name: str, got: torch.Tensor, want: torch.Tensor, want_bf16: torch.Tensor) -> None:
    """The LogFMT combine is the LogFMT sum, not the bf16 one: its rms distance to the LogFMT
    oracle is well below the two oracles' (the rows' LogFMT error at the widest step is about 1%
    rms, the bf16 output's rounding about 0.1%)."""
    if want.numel() == 0:
        return
    got = got.cpu().double()
    d_got = (got - want).pow(2).mean().sqrt().item()
    d_fmt = (want_bf16 - want).pow(2).mean().sqrt().item()
    if not d_got < 0.3 * d_fmt:
        chk.errors.append(f"{chk.tag} {name}: rms distance {d_got:.3g} to the LogFMT sum, {d_fmt:.3g} between it "
                          f"and the bf16 sum: the rows did not travel as LogFMT")


def _dequant(x):
    data, scales = split_x(x)
    return per_token_cast_back(data, scales) if scales is not None else data


def _expected_counts(inputs, rank, R, E):
    """[L] counts and [L, R, 2] ranges for this rank, vectorised (cheap enough for every replay)."""
    L = E // R
    per = torch.stack([torch.bincount(inp["idx"][(inp["idx"] >= rank * L) & (inp["idx"] < (rank + 1) * L)] - rank * L,
                                      minlength=L) for inp in inputs], dim=1)  # [L, R]
    begin = torch.cumsum(per, dim=1) - per
    return per.sum(1).to(torch.int32), torch.stack([begin, per], dim=-1).to(torch.int32)


def _y_ref(me, use_fp8):
    """Combine of the dispatched rows themselves: y[t] = (sum of valid w[t]) * dequant(x[t])."""
    x = me["x"]
    if use_fp8:
        q, s = per_token_cast_to_fp8(x)
        x = per_token_cast_back(q, s)
    w = torch.where(me["idx"] >= 0, me["w"], torch.zeros_like(me["w"])).double().sum(1, keepdim=True)
    return w * x.double()


def _check_dispatch(chk, tag, out, inputs, rank, R, E, mt, use_fp8):
    exp = expected_low_latency(inputs, rank, R, E, mt, use_fp8)
    got_x, got_s = split_x(out.x)
    chk.equal(f"{tag} count", out.count, exp["count"])
    chk.equal(f"{tag} layout_range", out.handle.layout_range, exp["layout_range"])
    if out.handle.packed_layout is not None:  # DeepEP's form, from the same stores (cuda)
        lr = exp["layout_range"].to(torch.int64)
        chk.equal(f"{tag} packed layout_range", out.handle.packed_layout, (lr[..., 0] << 32) | lr[..., 1])
    for e in range(E // R):
        n = int(exp["count"][e])
        chk.equal(f"{tag} x[{e}]", got_x[e, :n], exp["x"][e, :n])
        if use_fp8:
            chk.equal(f"{tag} scales[{e}]", got_s[e, :n], exp["scales"][e, :n])
        chk.equal(f"{tag} src_token[{e}]", out.handle.src_token[e, :n], exp["src_token"][e, :n])


# --------------------------------------------------------------------------------- CUDA graph
def run_ll_graph_case(cfg: dict) -> list:
    """Dispatch + combine captured once, replayed `replays` times on new inputs (same shapes)."""
    from cases import Checker

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T, mt, fp8 = cfg["E"], cfg["K"], cfg["H"], cfg["T"], cfg["max_tokens"], cfg["fp8"]
    buf = ll_buffer()
    chk = Checker(f"[LL graph R={R} rank={rank}]")
    inputs = make_inputs(cfg["seed"], R, E, K, H, [T] * R, "bf16", "random", 0.2)
    x, idx, w = (inputs[rank][k].cuda() for k in ("x", "idx", "w"))

    def step():
        out = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=fp8)
        y = buf.low_latency_combine(_dequant(out.x), idx, w, out.handle)
        return out, y

    graph, (out, y) = captured(step)
    for it in range(cfg["replays"]):
        fresh = make_inputs(cfg["seed"] + 31 * (it + 1), R, E, K, H, [T] * R, "bf16", "random", 0.2)
        me = fresh[rank]
        x.copy_(me["x"])
        idx.copy_(me["idx"])
        w.copy_(me["w"])
        graph.replay()
        torch.cuda.synchronize()
        count, rng = _expected_counts(fresh, rank, R, E)
        chk.equal(f"replay {it} count", out.count, count)
        chk.equal(f"replay {it} layout_range", out.handle.layout_range, rng)
        chk.close(f"replay {it} combine", y, _y_ref(me, fp8), 2e-2)
        if it % 25 == 0:
            _check_dispatch(chk, f"replay {it}", out, fresh, rank, R, E, mt, fp8)
        if chk.errors:
            break
    buf.synchronize()
    return chk.errors


# ------------------------------------------------------------------------- hook + buffer sets
def run_ll_hook_case(cfg: dict) -> list:
    """The receive halves launched later by their hooks, a matmul on the same stream in between;
    then two dispatches in flight at once (both buffer sets), a third refused, hooks called in
    reverse order, everything exact; the buffer stays usable."""
    from cases import Checker

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, mt = cfg["E"], cfg["K"], cfg["H"], cfg["max_tokens"]
    buf = ll_buffer()
    chk = Checker(f"[LL hook R={R} rank={rank}]")
    g = torch.Generator().manual_seed(cfg["seed"])
    a = torch.randn((512, 512), generator=g).cuda()
    ref = a @ a

    def inputs_for(i):
        return make_inputs(cfg["seed"] + 100 * i, R, E, K, H, [cfg["T"] - i] * R, "bf16", "random", 0.2)

    # one call, hook mode both ways, compute in between
    inputs = inputs_for(0)
    me = {k: v.cuda() for k, v in inputs[rank].items()}
    out = buf.low_latency_dispatch(me["x"], me["idx"], num_experts=E, max_tokens_per_rank=mt, use_fp8=True,
                                   return_recv_hook=True)
    c1 = a @ a
    if out.hook is None:
        chk.errors.append("return_recv_hook=True gave no hook")
        return chk.errors
    out.hook()
    y, hook = buf.low_latency_combine(_dequant(out.x), me["idx"], me["w"], out.handle, return_recv_hook=True)
    c2 = a @ a
    hook()
    torch.cuda.synchronize()
    _check_dispatch(chk, "hook", out, inputs, rank, R, E, mt, True)
    chk.close("hook combine", y, _y_ref(inputs[rank], True), 2e-2)
    chk.close("matmul between send and hook", c1, ref.double().cpu(), 1e-5)
    chk.close("matmul between combine halves", c2, ref.double().cpu(), 1e-5)
    try:
        out.hook()
        chk.errors.append("a hook ran twice")
    except RuntimeError:
        pass

    # both buffer sets in flight; a third call is refused on every rank before anything moves
    ins = [inputs_for(1), inputs_for(2)]
    mes = [{k: v.cuda() for k, v in i[rank].items()} for i in ins]
    outs = [buf.low_latency_dispatch(m["x"], m["idx"], num_experts=E, max_tokens_per_rank=mt, use_fp8=False,
                                     return_recv_hook=True) for m in mes]
    try:
        buf.low_latency_dispatch(mes[0]["x"], mes[0]["idx"], num_experts=E, max_tokens_per_rank=mt)
        chk.errors.append("a third low-latency call with two hooks pending did not raise")
    except RuntimeError as exc:
        if "in flight" not in str(exc):
            chk.errors.append(f"third call: unexpected message {exc}")
    outs[1].hook()
    outs[0].hook()
    ys = [buf.low_latency_combine(o.x, m["idx"], m["w"], o.handle) for o, m in zip(outs, mes)]
    torch.cuda.synchronize()
    for i in range(2):
        _check_dispatch(chk, f"set {i}", outs[i], ins[i], rank, R, E, mt, False)
        chk.close(f"set {i} combine", ys[i], _y_ref(ins[i][rank], False), 2e-2)
    # usable afterwards, with an `out=` tensor
    y_out = torch.empty((me["x"].shape[0], H), dtype=torch.bfloat16, device="cuda")
    out = buf.low_latency_dispatch(me["x"], me["idx"], num_experts=E, max_tokens_per_rank=mt, use_fp8=True)
    got = buf.low_latency_combine(_dequant(out.x), me["idx"], me["w"], out.handle, out=y_out)
    buf.synchronize()
    if got.data_ptr() != y_out.data_ptr():
        chk.errors.append("combine(out=) did not write into out")
    chk.close("after both sets", y_out, _y_ref(inputs[rank], True), 2e-2)
    return chk.errors


# ------------------------------------------------------------------------------- failures
def run_ll_timeout_case(absent_rank: int) -> list:
    """One rank never calls: the others raise CommTimeoutError naming it and what they waited on,
    then BufferBrokenError; nobody hangs."""
    rank, R = dist.get_rank(), dist.get_world_size()
    E = 4 * R
    buf = mep.Buffer(dist.group.WORLD, backend="cuda", low_latency=dict(num_experts=E, max_tokens=8, hidden=256, topk=2))
    dist.barrier()
    if rank == absent_rank:
        return []
    x = torch.randn((4, 256), device="cuda").to(torch.bfloat16)
    idx = torch.tensor([[0, E - 1]] * 4, device="cuda")
    errors = []
    try:
        buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=8)
        buf.synchronize()
        errors.append(f"rank {rank}: low-latency dispatch without rank {absent_rank} did not raise")
    except CommTimeoutError as exc:
        if f"rank {absent_rank}" not in str(exc) or "waiting for" not in str(exc):
            errors.append(f"rank {rank}: unexpected message {exc}")
    try:
        buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=8)
        errors.append(f"rank {rank}: a broken low-latency buffer accepted a call")
    except BufferBrokenError:
        pass
    return errors


def run_ll_peer_failure_case(failing_rank: int) -> list:
    """A failure before the launch is published to the kernels. (1) Every rank fails the same call
    (an argument error): nothing waited, the buffer stays usable and the next call is exact. (2)
    Only `failing_rank` fails: it raises its own error, every other rank's kernel stops waiting
    for it at once (long before the 60 s timeout) and raises PeerFailedFatalError naming it, then
    BufferBrokenError."""
    import time

    rank, R = dist.get_rank(), dist.get_world_size()
    E, H = 4 * R, 256
    buf = mep.Buffer(dist.group.WORLD, backend="cuda", timeout_s=60.0,
                     low_latency=dict(num_experts=E, max_tokens=8, hidden=H, topk=2))
    inputs = make_inputs(91, R, E, 2, H, [6] * R, "bf16", "random", 0.0)
    me = {k: v.cuda() for k, v in inputs[rank].items()}
    errors = []
    try:  # (1) every rank: fp32 rows, which the cuda path refuses before launching
        buf.low_latency_dispatch(me["x"].float(), me["idx"], num_experts=E, max_tokens_per_rank=8)
        errors.append(f"rank {rank}: fp32 x did not raise")
    except TypeError:
        pass
    out = buf.low_latency_dispatch(me["x"], me["idx"], num_experts=E, max_tokens_per_rank=8, use_fp8=False)
    buf.synchronize()
    from cases import Checker

    chk = Checker(f"[LL peer failure rank={rank}]")
    _check_dispatch(chk, "after a call every rank failed", out, inputs, rank, R, E, 8, False)
    dist.barrier()
    # (2) one rank fails alone
    t0 = time.monotonic()
    x = me["x"].float() if rank == failing_rank else me["x"]
    try:
        buf.low_latency_dispatch(x, me["idx"], num_experts=E, max_tokens_per_rank=8, use_fp8=False)
        buf.synchronize()
        errors.append(f"rank {rank}: the call rank {failing_rank} failed did not raise here")
    except TypeError:
        if rank != failing_rank:
            errors.append(f"rank {rank}: raised the failing rank's TypeError")
    except PeerFailedFatalError as exc:
        if rank == failing_rank or f"rank {failing_rank}" not in str(exc):
            errors.append(f"rank {rank}: unexpected {exc}")
        if time.monotonic() - t0 > 20:
            errors.append(f"rank {rank}: stopped after {time.monotonic() - t0:.0f} s (the publication did not stop the wait)")
        try:
            buf.low_latency_dispatch(me["x"], me["idx"], num_experts=E, max_tokens_per_rank=8, use_fp8=False)
            errors.append(f"rank {rank}: a buffer broken by a peer's failure accepted a call")
        except BufferBrokenError:
            pass
    return errors + chk.errors


def run_ll_mismatch_case(_cfg=None) -> list:
    """Rank 0 passes a different max_tokens_per_rank: every rank raises CallMismatchError (the
    signature travels with the count signals); the protocol stays in step and the buffer usable."""
    rank, R = dist.get_rank(), dist.get_world_size()
    E, H = 4 * R, 256
    buf = ll_buffer()
    inputs = make_inputs(77, R, E, 2, H, [6] * R, "bf16", "random", 0.0)
    me = {k: v.cuda() for k, v in inputs[rank].items()}
    errors = []
    try:
        buf.low_latency_dispatch(me["x"], me["idx"], num_experts=E, max_tokens_per_rank=8 if rank == 0 else 16)
        buf.synchronize()
        errors.append(f"rank {rank}: mismatched calls did not raise")
    except CallMismatchError as exc:
        if "signature" not in str(exc):
            errors.append(f"rank {rank}: unexpected message {exc}")
    out = buf.low_latency_dispatch(me["x"], me["idx"], num_experts=E, max_tokens_per_rank=16, use_fp8=False)
    buf.synchronize()
    from cases import Checker

    chk = Checker(f"[LL after mismatch rank={rank}]")
    _check_dispatch(chk, "after", out, inputs, rank, R, E, 16, False)
    return errors + chk.errors


def run_ll_combine_out_case(backend: str = "torch", device: str = "cpu") -> list:
    """low_latency_combine(out=...) on our Buffer and through megatron_ep.deep_ep, either backend:
    an `out` of the wrong shape (the low-latency area's [max_tokens, H], or [T + 1, H]), dtype or
    kind is refused naming `out` on every rank before anything moves; a right one is written and
    returned, equal to the combine without it."""
    import os

    from megatron_ep import Buffer, deep_ep

    R, rank = dist.get_world_size(), dist.get_rank()
    E, T, H, mt = 2 * R, 3, 128, 8
    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn((T, H), generator=g).to(device=device, dtype=torch.bfloat16)
    idx = torch.randint(0, E, (T, 1), generator=g)
    idx = torch.cat([idx, (idx + 1) % E], dim=1).to(device)
    w = torch.rand((T, 2), generator=g).to(device)
    os.environ["MEGATRON_EP_DEEP_EP_BACKEND"] = backend
    ours = Buffer(backend=backend)
    theirs = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(mt, H, R, E),
                            low_latency_mode=True, explicitly_destroy=True)
    a = ours.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=False)
    recv, _, handle, _, _ = theirs.low_latency_dispatch(x, idx, mt, E, use_fp8=False)
    calls = {"Buffer": lambda o: ours.low_latency_combine(a.x, idx, w, a.handle, out=o),
             "deep_ep.Buffer": lambda o: theirs.low_latency_combine(recv, idx, w, handle, out=o)[0]}
    errors = []
    for name, call in calls.items():
        errors += refusals([
            ("out [max_tokens, H]", lambda: call(torch.empty((mt, H), dtype=x.dtype, device=device)), ValueError,
             "out must have shape"),
            ("out [T + 1, H]", lambda: call(torch.empty((T + 1, H), dtype=x.dtype, device=device)), ValueError,
             "out must have shape"),
            ("out fp32", lambda: call(torch.empty((T, H), dtype=torch.float32, device=device)), TypeError,
             "out must have x's dtype"),
            ("out a list", lambda: call([0.0] * T), TypeError, "out must be a tensor"),
        ], tag=f"[{backend} rank={rank} {name}] ")
        want = call(None)
        out = torch.full((T, H), float("nan"), dtype=x.dtype, device=device)
        got = call(out)
        if device == "cuda":
            torch.cuda.synchronize()
        if got.data_ptr() != out.data_ptr() or not torch.equal(out, want):
            errors.append(f"[{backend} rank={rank} {name}] combine(out=) did not write the combine into out")
    theirs.destroy()
    ours.destroy()
    return errors


def run_ll_bad_inputs(_cfg=None) -> list:
    """cuda-only refusals, raised on every rank before anything is sent."""
    R = dist.get_world_size()
    buf = ll_buffer()
    E = 2 * R
    x = torch.randn((4, 256), device="cuda").to(torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 4, device="cuda")
    errors = refusals([
        ("fp32 x", lambda: buf.low_latency_dispatch(x.float(), idx, num_experts=E), TypeError, "bf16"),
        ("over capacity", lambda: buf.low_latency_dispatch(torch.zeros((4, 8192), dtype=torch.bfloat16, device="cuda"), idx,
                                                            num_experts=E), ValueError, "sized for"),
        ("bf16 hidden", lambda: buf.low_latency_dispatch(x[:, :100].contiguous(), idx, num_experts=E, use_fp8=False),
         ValueError, "multiple of 8"),
    ])
    out = buf.low_latency_dispatch(x, idx, num_experts=E)  # still usable
    try:
        buf.low_latency_combine(out.x[0].float(), idx,
                                torch.ones((4, 2), device="cuda"), out.handle)
        errors.append("fp32 combine: did not raise")
    except TypeError:
        pass
    buf.synchronize()
    return errors


# ------------------------------------------------------------------------------ decode layer
MASKED_GEMMS = ("m_grouped_fp8_gemm_nt_masked", "m_grouped_bf16_gemm_nt_masked")


class DeepGemmSpy:
    """The real deep_gemm module, recording the name of every grouped GEMM our glue calls on it,
    the operands it passed (`args`) and DeepGEMM's SM count at the call (`sms`)."""

    def __init__(self, module):
        self.module, self.calls, self.args, self.sms = module, [], [], []

    def __getattr__(self, name):
        attr = getattr(self.module, name)
        if not name.startswith("m_grouped_"):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            self.args.append(args)
            self.sms.append(self.module.get_num_sms())
            return attr(*args, **kwargs)

        return call


@contextlib.contextmanager
def masked_gemm(kind: Optional[str]):
    """Which GEMMs megatron_ep.experts uses inside the block (this process only; restored after):
    'deepgemm': the real deep_gemm behind a DeepGemmSpy, which is yielded (raises if deep_gemm does
    not import); 'torch': DeepGEMM hidden, so the masked GEMMs take the batched-matmul fallback;
    None: whatever is importable (yields None)."""
    from megatron_ep.experts import backends as B

    if kind is None:
        yield None
        return
    saved = (B._deep_gemm, B._deep_gemm_checked)
    spy = None
    if kind == "deepgemm":
        real = B.deep_gemm_module()
        if real is None:
            raise RuntimeError("deep_gemm does not import in this process (PYTHONPATH / LD_PRELOAD from /tmp/deepgemm.env?)")
        spy = DeepGemmSpy(real)
    elif kind != "torch":
        raise ValueError(f"masked_gemm kind must be deepgemm, torch or None, got {kind!r}")
    B._deep_gemm, B._deep_gemm_checked = spy, True
    try:
        yield spy
    finally:
        B._deep_gemm, B._deep_gemm_checked = saved


def block_cast_back(w: torch.Tensor) -> torch.Tensor:
    """The fp32 weights DeepGEMM's FP8 GEMMs see: per_block_cast_to_fp8(w) multiplied back out."""
    from megatron_ep.experts import per_block_cast_to_fp8

    q, s = per_block_cast_to_fp8(w)
    N, K = w.shape[-2:]
    return q.float() * s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :N, :K]


def run_decode_layer_refuses_gradients(cfg: dict) -> list:
    """DecodeMoELayer runs without autograd: with grad on and x or the routing weights requiring
    grad, a derivative through its output raises naming it, by autograd.grad(..., inputs) and by
    .backward(), instead of coming out without the layer's part (torch backend)."""
    from cases import get_buffer
    from megatron_ep.experts.decode_layer import DecodeMoELayer
    from refusals import derivative, exact_or_refused

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, F, T, mt = cfg["E"], cfg["K"], cfg["H"], cfg["F"], cfg["T"], cfg["max_tokens"]
    L = E // R
    g = torch.Generator().manual_seed(cfg["seed"])
    w1 = (torch.randn((E, 2 * F, H), generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn((E, H, F), generator=g) / F ** 0.5).to(torch.bfloat16)
    layer = DecodeMoELayer(get_buffer("torch"), E, w1[rank * L:(rank + 1) * L], w2[rank * L:(rank + 1) * L],
                           max_tokens_per_rank=mt)
    me = make_inputs(cfg["seed"] + 1, R, E, K, H, [T] * R, "bf16", "random", 0.2)[rank]
    grad = torch.randn((T, H), generator=g).to(torch.bfloat16)
    errors = []
    for wanted in ([True, False], [False, True], [True, True]):
        for how in ("grad", "backward"):
            got = derivative(lambda x, w: layer(x, me["idx"], w), [me["x"], me["w"]], wanted, grad, how, order=1)
            errors += exact_or_refused(f"[decode layer gradient R={R} rank={rank} {wanted} {how}]", got, None,
                                       ("decode_moe", "not differentiable"))
            dist.barrier()
    return errors


def run_ll_decode_layer_case(cfg: dict, backend: str = "cuda", device: str = "cuda") -> list:
    """DecodeMoELayer (LL dispatch -> masked expert MLP -> LL combine) against a dense fp32
    reference with the same FP8 inputs and bf16 weights (fc1's cast to FP8 per 128x128 block when
    DeepGEMM runs it), eagerly and (cuda) replayed from one CUDA graph on fresh tokens and
    routings, each replay also against the eager layer on the same inputs (those eager calls run
    before the capture). On the torch backend (CPU) it checks the layer's own logic.
    cfg: seed, E, K, H, F, T, max_tokens; replays (3); gemm: 'deepgemm' | 'torch' | None
    (masked_gemm; with 'deepgemm' both masked GEMMs must have been called); keep_fp8: the layer
    keeps fc1's FP8 cast, and after the replays w1 is halved in place (as an optimizer writes),
    the cast refreshed, and one more replay must follow the new weights."""
    from cases import Checker, get_buffer
    from megatron_ep.experts import backends
    from megatron_ep.experts.decode_layer import DecodeMoELayer

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, F, T, mt = cfg["E"], cfg["K"], cfg["H"], cfg["F"], cfg["T"], cfg["max_tokens"]
    L = E // R
    gemm = cfg.get("gemm")
    chk = Checker(f"[decode layer R={R} rank={rank} {backend}{'' if gemm is None else ' ' + gemm}]")
    g = torch.Generator().manual_seed(cfg["seed"])
    w1 = (torch.randn((E, 2 * F, H), generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn((E, H, F), generator=g) / F ** 0.5).to(torch.bfloat16)
    buf = ll_buffer() if backend == "cuda" else get_buffer(backend)
    layer = DecodeMoELayer(buf, E, w1[rank * L:(rank + 1) * L].to(device), w2[rank * L:(rank + 1) * L].to(device),
                           max_tokens_per_rank=mt, use_fp8=True, keep_fp8_weights=cfg.get("keep_fp8", False))
    scale1 = [1.0]  # w1's factor since the start (the refresh check halves it)

    def inputs_for(i):
        return make_inputs(cfg["seed"] + i, R, E, K, H, [T] * R, "bf16", "random", 0.2)

    with masked_gemm(gemm) as spy:
        fc1 = block_cast_back(w1) if device != "cpu" and backends.deep_gemm_module() is not None else w1.float()

        def reference(me):
            xq = per_token_cast_back(*per_token_cast_to_fp8(me["x"])).float()
            y = torch.zeros((T, H), dtype=torch.float64)
            for e in me["idx"][me["idx"] >= 0].unique().tolist():
                t, k = (me["idx"] == e).nonzero(as_tuple=True)
                a, b = (xq[t] @ (fc1[e] * scale1[0]).T).chunk(2, dim=-1)
                h = torch.nn.functional.silu(a) * b
                y.index_add_(0, t, (me["w"][t, k].unsqueeze(1) * (h @ w2[e].float().T)).double())
            return y

        inputs = inputs_for(0)
        x, idx, w = (inputs[rank][k].to(device) for k in ("x", "idx", "w"))
        y = layer(x, idx, w)
        chk.close("eager", y, reference(inputs[rank]), 5e-2)
        if device == "cpu":
            return chk.errors
        fresh = [inputs_for(it + 1) for it in range(cfg.get("replays", 3))]
        eager = [layer(*(f[rank][k].cuda() for k in ("x", "idx", "w"))).double().cpu() for f in fresh]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x, idx, w)
        for it, f in enumerate(fresh):
            for dst, k in ((x, "x"), (idx, "idx"), (w, "w")):
                dst.copy_(f[rank][k])
            graph.replay()
            torch.cuda.synchronize()
            chk.close(f"replay {it}", y, reference(f[rank]), 5e-2)
            chk.close(f"replay {it} vs eager", y, eager[it], 1e-2)
        if cfg.get("keep_fp8"):
            layer.w1.data.mul_(0.5)  # exact in bf16, and the block cast's scales halve exactly
            scale1[0] = 0.5
            layer.refresh_fp8_weights()
            graph.replay()
            torch.cuda.synchronize()
            chk.close("replay after refresh_fp8_weights", y, reference(fresh[-1][rank]), 5e-2)
        layer.buffer.synchronize()
    if spy is not None and not set(MASKED_GEMMS) <= set(spy.calls):
        chk.errors.append(f"{chk.tag} DeepGEMM's masked GEMMs were not both called: {sorted(set(spy.calls))}")
    return chk.errors


def run_ll_logfmt_mismatch_case(backend: str = "torch", device: str = "cpu") -> list:
    """use_logfmt on rank 0 only: the ranks' combines would disagree on the wire format, so every
    rank raises CallMismatchError naming use_logfmt (the torch backend at the call, the cuda one
    from its kernels' signature check at synchronize) and the buffer takes the next combine."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[LL LogFMT mismatch R={R} rank={rank}]"
    buf = ll_buffer() if backend == "cuda" else mep.Buffer(dist.group.WORLD, backend=backend)
    E, T, H = 2 * R, 4, 256
    g = torch.Generator().manual_seed(5)
    x = (torch.randn((T, H), generator=g) * 0.01).to(torch.bfloat16).to(device)
    idx = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], dim=1).to(device)
    w = torch.full((T, 2), 0.5, device=device)
    out = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T, use_fp8=False)
    errors = []
    try:
        buf.low_latency_combine(out.x, idx, w, out.handle, use_logfmt=rank == 0)
        buf.synchronize()
        errors.append(f"{tag} combines with and without use_logfmt did not raise")
    except CallMismatchError as exc:
        if "use_logfmt" not in str(exc):
            errors.append(f"{tag} the mismatch error does not name use_logfmt: {exc}")
    try:
        y = buf.low_latency_combine(out.x, idx, w, out.handle, use_logfmt=True)
        buf.synchronize()
        if y.shape != (T, H):
            errors.append(f"{tag} the next combine returned {tuple(y.shape)}")
    except Exception as exc:  # noqa: BLE001 - any error here is the finding
        errors.append(f"{tag} the combine after the mismatch raised {type(exc).__name__}: {exc}")
    return errors


# ---------------------------------------------------------------------------------- rank mask
def _blocked_inputs(inputs, viewer: int, masked_at, R: int, E: int):
    """The inputs as rank `viewer` should see them under the rank mask: a copy of source s to
    `viewer` is dropped when either side masks the other (masked_at[r]: the ranks r masks), and
    `viewer`'s own slots on a rank it masks drop out of its combine."""
    L = E // R
    out = []
    for s, inp in enumerate(inputs):
        idx = inp["idx"].clone()
        owner = torch.where(idx >= 0, idx // L, torch.full_like(idx, -1))
        if s != viewer and (s in masked_at[viewer] or viewer in masked_at[s]):
            idx[owner == viewer] = -1
        if s == viewer:
            for r in masked_at[viewer]:
                idx[owner == r] = -1
        out.append({**inp, "idx": idx})
    return out


def run_ll_rank_mask_case(cfg: dict) -> list:
    """The rank mask (low_latency=dict(..., rank_mask=True)): (1) the last rank masks every other
    rank and they mask it: dispatch and combine exact for what each rank still talks to, the
    mask status as set; (2) the masks cleared and the barrier passed, the next round exact on
    every rank (the barrier's reset of the buffer sets lets the rank rejoin); (3) the last rank
    stops before a dispatch: the others' waits mask it after mask_timeout_s, and their dispatch
    and combine stay exact for the remaining ranks."""
    from cases import Checker

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, mt, T = cfg["E"], cfg["K"], cfg["H"], cfg["max_tokens"], cfg["T"]
    victim = R - 1
    chk = Checker(f"[LL rank mask R={R} rank={rank}]")
    buf = mep.Buffer(dist.group.WORLD, backend="cuda",
                     low_latency={**LL_SIZING, "rank_mask": True, "mask_timeout_s": cfg["mask_timeout_s"]})

    def round_(tag, seed, masked_at, skip=False):
        inputs = make_inputs(seed, R, E, K, H, [T] * R, "bf16", "random", 0.2)
        if skip:
            return
        me = {k: v.cuda() for k, v in inputs[rank].items()}
        out = buf.low_latency_dispatch(me["x"], me["idx"], num_experts=E, max_tokens_per_rank=mt, use_fp8=False)
        y = buf.low_latency_combine(out.x, me["idx"], me["w"], out.handle)
        buf.synchronize()
        seen = _blocked_inputs(inputs, rank, masked_at, R, E)
        _check_dispatch(chk, tag, out, seen, rank, R, E, mt, False)
        chk.close(f"{tag} combine", y, _y_ref(seen[rank], False), 2e-2)

    def status(tag, want):
        got = buf.low_latency_mask_status()
        torch.cuda.synchronize()
        exp = torch.zeros(R, dtype=torch.int32)
        exp[sorted(want)] = 1
        chk.equal(f"{tag} mask status", got.cpu(), exp)

    none = [set() for _ in range(R)]
    round_("unmasked", cfg["seed"], none)
    # (1) masked on purpose, every rank making every call
    masked_at = [set(range(R)) - {victim} if r == victim else {victim} for r in range(R)]
    for r in sorted(masked_at[rank]):
        buf.low_latency_mask(r)
    status("masked", masked_at[rank])
    round_("masked", cfg["seed"] + 1, masked_at)
    round_("masked again", cfg["seed"] + 2, masked_at)
    # (2) unmasked everywhere, the barrier, a full round
    buf.low_latency_clear_mask()
    buf.low_latency_barrier()
    status("cleared", set())
    round_("rejoined", cfg["seed"] + 3, none)
    round_("rejoined again", cfg["seed"] + 4, none)
    # (3) the last rank stops: the others mask it when their waits time out
    stopped = [set() if r == victim else {victim} for r in range(R)]
    round_("after a stop", cfg["seed"] + 5, stopped, skip=rank == victim)
    if rank != victim:
        status("after a stop", {victim})
        round_("after a stop, next call", cfg["seed"] + 6, stopped)
    try:
        buf.low_latency_mask(R)
        chk.errors.append("low_latency_mask(R) did not raise")
    except ValueError:
        pass
    buf.destroy()
    return chk.errors
