"""Worker bodies for megatron_ep.deep_ep (DeepEP's Python API on our Buffer), run on every rank of
a DistPool: each call against an oracle of DeepEP's documented semantics built from every rank's
inputs (each rank regenerates all of them from the seeds, so the oracle needs no communication)."""

from __future__ import annotations

import os
import traceback

import numpy as np
import torch
import torch.distributed as dist

from refusals import refusals


def _inputs(cfg: dict, rank: int):
    E, K, H = cfg["E"], cfg["K"], cfg["H"]
    T = cfg["Ts"][rank]
    g = torch.Generator().manual_seed(cfg["seed"] + rank)
    x = torch.randn((T, H), generator=g)
    if cfg.get("pattern") == "hot":
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = 0
    else:
        idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
        idx = torch.where(torch.rand((T, K), generator=g) < cfg.get("p_drop", 0.0), -1, idx)
    w = torch.rand((T, K), generator=g)
    return x, idx, w


def _on(cfg: dict, *ts):
    """The case's tensors on its device (cfg "device", default CPU; the expected values stay on CPU)."""
    dev = cfg.get("device", "cpu")
    return tuple(t.to(dev) for t in ts)


def _backend(cfg: dict) -> None:
    """The backend megatron_ep.deep_ep's Buffer serves the case with (cfg "backend", default torch)."""
    os.environ["MEGATRON_EP_DEEP_EP_BACKEND"] = cfg.get("backend", "torch")


def _in_rank(idx: torch.Tensor, L: int, R: int) -> torch.Tensor:
    """[T, R] bool: the ranks holding at least one of each token's experts (rank r: r*L ..)."""
    owner = torch.where(idx >= 0, idx // L, -1)
    return torch.stack([(owner == r).any(dim=1) for r in range(R)], dim=1)


def _expected(cfg: dict, me: int, R: int, inputs=None):
    """DeepEP's dispatch on rank `me`: rows by (source rank, source token), one per token with an
    expert here; local ids, -1 (weight 0) for experts elsewhere. `inputs(cfg, rank)`: each rank's
    (x, topk_idx, topk_weights), _inputs by default."""
    L = cfg["E"] // R
    xs, ids, ws = [], [], []
    sent = torch.zeros((R, R), dtype=torch.int64)  # [source, destination] tokens
    for src in range(R):
        x, idx, w = (inputs or _inputs)(cfg, src)
        owner = torch.where(idx >= 0, idx // L, -1)
        for dst in range(R):
            sent[src, dst] = int((owner == dst).any(dim=1).sum())
        here = (owner == me).any(dim=1)
        local = torch.where(owner == me, idx - me * L, -1)[here]
        xs.append(x[here])
        ids.append(local)
        ws.append(torch.where(local >= 0, w[here], 0.0))
    return torch.cat(xs), torch.cat(ids), torch.cat(ws), sent


def _no_host_collective(counts):
    raise AssertionError("megatron_ep.deep_ep dispatch gathered counts with a host collective")


def run_deep_ep_normal_case(cfg: dict) -> list:
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep normal R={R} rank={rank} seed={cfg['seed']}]"
    try:
        _backend(cfg)
        from megatron_ep import deep_ep

        errors = []
        E, L, a = cfg["E"], cfg["E"] // R, cfg.get("align", 1)
        buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20)
        stream = buf.get_comm_stream()  # ours on our kernels; the caller's on the torch backend, None without CUDA
        if cfg.get("backend") == "cuda":
            if not (isinstance(stream, torch.cuda.Stream) and stream != torch.cuda.current_stream()):
                errors.append(f"{tag} get_comm_stream() is {stream!r}, not our kernels' stream")
        elif stream != (torch.cuda.current_stream() if torch.cuda.is_available() else None):
            errors.append(f"{tag} get_comm_stream() on the torch backend is {stream!r}")
        x, idx, w = _on(cfg, *_inputs(cfg, rank))
        per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E)
        want_in_rank = _in_rank(idx, L, R)
        if not (torch.equal(in_rank, want_in_rank) and per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32
                and per_rank.tolist() == want_in_rank.sum(0).tolist() and ev.event is None
                # per node of 8 ranks past 8 (DeepEP's RDMA ranks), else None
                and (per_rdma is None if R <= 8 else
                     per_rdma.tolist() == want_in_rank.view(-1, R // 8, 8).any(dim=2).sum(0).tolist())
                and per_expert.tolist() == [int((idx == e).sum()) for e in range(E)]):
            errors.append(f"{tag} get_dispatch_layout differs from DeepEP's: {per_rank.tolist()} {per_expert.tolist()}")
        # the handle's rank prefix sums come from the dispatch's own count exchange
        buf._gathered = _no_host_collective
        rx, rid, rw, counts, handle, ev = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                                       expert_alignment=a)
        buf.__dict__.pop("_gathered", None)
        ex, eid, ew, sent = _expected(cfg, rank, R)
        for name, got, want in (("recv_x", rx, ex), ("recv_topk_idx", rid, eid), ("recv_topk_weights", rw, ew)):
            if got.shape != want.shape or not torch.equal(got.cpu(), want.to(got.dtype)):
                errors.append(f"{tag} {name}: {tuple(got.shape)} differs from DeepEP's {tuple(want.shape)}")
        want_counts = [(int((eid == e).sum()) + a - 1) // a * a for e in range(L)]
        if counts != want_counts:
            errors.append(f"{tag} num_recv_tokens_per_expert_list {counts}, DeepEP's {want_counts}")
        prefix = torch.cumsum(sent, 0).to(torch.int32)
        if R <= 8 and not (isinstance(handle, tuple) and len(handle) == 6 and torch.equal(handle[0].cpu(), prefix)
                           and handle[4] is in_rank):
            errors.append(f"{tag} handle[0] (rank_prefix_matrix) {handle[0]} or handle[4] differ from DeepEP's")
        # past 8 ranks DeepEP's internode handle: is_token_in_rank first, recv_gbl_rank_prefix_sum at -4
        if R > 8 and not (isinstance(handle, tuple) and len(handle) == 10 and handle[0] is in_rank
                          and torch.equal(handle[-4].cpu(), prefix[:, rank])):
            errors.append(f"{tag} the internode handle's is_token_in_rank or recv_gbl_rank_prefix_sum differ from DeepEP's")
        # cached dispatch (the backward of combine): the same rows, no list, no handle
        again = buf.dispatch(x * 2, handle=handle)
        if not (torch.equal(again[0].cpu(), ex * 2) and again[1:5] == (None, None, None, None)):
            errors.append(f"{tag} cached dispatch differs from DeepEP's")
        # DeepEP's SM count reaches our kernels' budget: Buffer.set_num_sms for calls without a
        # Config, a call's Config before it (the torch backend has no budget)
        limit = buf.runtime.max_num_sms
        try:
            deep_ep.Buffer.set_num_sms(4)
            rows4 = buf.dispatch(x, handle=handle)[0]
            sms4 = buf.runtime.num_sms
            y6, _, _ = buf.combine(rx, handle, config=deep_ep.Config(6, 6, 256, 6, 128))
            sms6 = buf.runtime.num_sms
        finally:
            deep_ep.Buffer.set_num_sms(20)
        want_sms = (None, None) if limit is None else (min(4, limit), min(6, limit))
        want_y6 = x.double() * want_in_rank.sum(1, keepdim=True).double()
        if (sms4, sms6) != want_sms or not torch.equal(rows4.cpu(), ex) or \
                not torch.allclose(y6.double(), want_y6, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} set_num_sms(4) / Config(6): our budget {sms4} / {sms6}, want {want_sms}, or the "
                          f"rows differ")
        # combine: the plain sum of the rows each token's dispatch delivered (one per rank)
        y, yw, ev = buf.combine(rx * (rank + 1), handle, topk_weights=rw)
        scale = sum((r + 1) * want_in_rank[:, r].double() for r in range(R))
        want_y = x.double() * scale.unsqueeze(1)
        if not torch.allclose(y.double(), want_y, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} combined_x differs from DeepEP's sum (max diff {(y.double() - want_y).abs().max():.3g})")
        want_w = torch.where(idx >= 0, w, 0.0)
        if not torch.allclose(yw, want_w, rtol=0, atol=1e-7):
            errors.append(f"{tag} combined_topk_weights differ from the original weights of the selected experts")
        # DeepEP sums all K weights each receiving rank passes (its test fills the -1 slots, then
        # divides by the receiving ranks): every other receiving rank adds its fill to a slot
        fill = 0.5
        _, yw2, _ = buf.combine(rx, handle, topk_weights=torch.where(rid >= 0, rw, fill))
        others = want_in_rank.sum(1, keepdim=True).double() - (idx >= 0).double()
        if not torch.allclose(yw2.double(), want_w.double() + fill * others, rtol=0, atol=1e-6):
            errors.append(f"{tag} combined_topk_weights are not DeepEP's sum over the receiving ranks")
        bias, = _on(cfg, torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + rank)))
        yb, _, _ = buf.combine(rx, handle, bias=(bias, bias))
        want_b = x.double() * want_in_rank.sum(1, keepdim=True).double() + 2 * bias.double()
        if not torch.allclose(yb.double(), want_b, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} combine with a bias pair differs from DeepEP's")
        # worst-case sized: exactly num_worst_tokens rows, the real ones first, an empty list
        worst = cfg["worst"]
        wx, wid, _, wcounts, _, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                                 num_worst_tokens=worst)
        n = ex.shape[0]
        if not (wx.shape[0] == worst and wcounts == [] and torch.equal(wx[:n].cpu(), ex) and torch.all(wid[n:] == -1)):
            errors.append(f"{tag} num_worst_tokens={worst}: {wx.shape[0]} rows, list {wcounts}")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def normal_cases(R: int) -> list:
    """Uneven token counts with an empty rank and -1 slots; every token on one expert; an alignment."""
    Ts = ([6, 0, 9, 3, 7, 1, 4, 5] * 2)[:R]
    return [dict(seed=600 + R, E=2 * R, K=3, H=16, Ts=Ts, p_drop=0.2, worst=R * 9, align=3),
            dict(seed=610 + R, E=4 * R, K=2, H=32, Ts=[5] * R, pattern="hot", worst=R * 5, align=4)]


def run_deep_ep_normal_cases(cfgs: list) -> list:
    return [e for cfg in cfgs for e in run_deep_ep_normal_case(cfg)]


def _by_rank_inputs(cfg: dict, rank: int):
    """A dispatch without topk_idx: (x, is_token_in_rank, num_tokens_per_expert). "layout": both
    from the tokens' top-k experts (as DeepEP's tests build them); "random": a random mask and
    random per-expert counts, unrelated to it (DeepEP's list is the sum of what the callers pass)."""
    R, E = cfg["R"], cfg["E"]
    x, idx, _ = _inputs(cfg, rank)
    if cfg["mask"] == "layout":
        return x, _in_rank(idx, E // R, R), torch.stack([(idx == e).sum() for e in range(E)]).to(torch.int32)
    g = torch.Generator().manual_seed(cfg["seed"] + 100 + rank)
    return x, torch.rand((x.shape[0], R), generator=g) < 0.5, torch.randint(0, 9, (E,), generator=g, dtype=torch.int32)


def run_deep_ep_by_rank_case(cfg: dict) -> list:
    """dispatch without topk_idx (routing by is_token_in_rank alone) against DeepEP's semantics:
    the rows by source rank then source token, one per token marked for this rank; recv_topk_idx
    and recv_topk_weights None; the list every rank's num_tokens_per_expert summed for this
    rank's experts, aligned; the handle's rank prefix matrix; cached dispatch and combine. With
    several experts per rank, a stand-in id sent to any expert but one of the marked rank's
    delivers rows elsewhere and fails the row check. FP8 input with DeepEP's column-major scales,
    and with UE8M0 scales packed in int32 words. On cfg's backend and device (torch on CPU by
    default); the expected values are computed on CPU."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep by rank R={R} rank={rank} seed={cfg['seed']} {cfg['mask']} {cfg.get('backend', 'torch')}]"
    try:
        _backend(cfg)
        from megatron_ep import deep_ep
        from megatron_ep.core.fp8 import pack_ue8m0, per_token_cast_to_fp8

        errors = []
        cfg = dict(cfg, R=R)
        E, L, a = cfg["E"], cfg["E"] // R, cfg["align"]
        buf = deep_ep.Buffer(dist.group.WORLD)
        x, in_rank, per_expert = _by_rank_inputs(cfg, rank)
        per_rank = in_rank.sum(0).to(torch.int32)
        xd, in_rank_d, per_expert_d, per_rank_d = _on(cfg, x, in_rank, per_expert, per_rank)
        layout = dict(num_tokens_per_rank=per_rank_d, is_token_in_rank=in_rank_d, num_tokens_per_expert=per_expert_d)
        rx, rid, rw, counts, handle, _ = buf.dispatch(xd, expert_alignment=a, **layout)
        every = [_by_rank_inputs(cfg, src) for src in range(R)]
        want_x = torch.cat([xs[m[:, rank]] for xs, m, _ in every])
        sent = torch.stack([m.sum(0) for _, m, _ in every]).to(torch.int64)  # [source, destination]
        total = torch.stack([pe for _, _, pe in every]).sum(0)[rank * L:(rank + 1) * L]
        want_counts = [(int(c) + a - 1) // a * a for c in total]
        if rx.shape != want_x.shape or not torch.equal(rx.cpu(), want_x):
            errors.append(f"{tag} recv_x {tuple(rx.shape)} differs from DeepEP's rows {tuple(want_x.shape)}")
        if rid is not None or rw is not None:
            errors.append(f"{tag} recv_topk_idx / recv_topk_weights are not None without topk_idx")
        if counts != want_counts:
            errors.append(f"{tag} num_recv_tokens_per_expert_list {counts}, DeepEP's {want_counts}")
        if not torch.equal(handle[0].cpu(), torch.cumsum(sent, 0).to(torch.int32)) or handle[4] is not in_rank_d:
            errors.append(f"{tag} handle[0] (rank_prefix_matrix) {handle[0]} or handle[4] differ from DeepEP's")
        again = buf.dispatch(xd * 2, handle=handle)
        if not torch.equal(again[0].cpu(), want_x * 2):
            errors.append(f"{tag} cached dispatch differs from DeepEP's")
        y, yw, _ = buf.combine(rx * (rank + 1), handle)
        want_y = x.double() * sum((r + 1) * in_rank[:, r].double() for r in range(R)).unsqueeze(1)
        if yw is not None or not torch.allclose(y.cpu().double(), want_y, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} combine differs from DeepEP's sum over the marked ranks")
        # FP8 as DeepEP's tests pass it: scales a column-major view (x_scales.T.contiguous().T)
        q, scales = _on(cfg, *per_token_cast_to_fp8(x))
        strided = scales.T.contiguous().T
        if x.shape[0] > 1 and strided.is_contiguous():
            errors.append(f"{tag} the FP8 case does not exercise strided scales")
        (rq, rs), *_ = buf.dispatch((q, strided), **layout)
        want_q = torch.cat([per_token_cast_to_fp8(xs)[0][m[:, rank]] for xs, m, _ in every])
        want_s = torch.cat([per_token_cast_to_fp8(xs)[1][m[:, rank]] for xs, m, _ in every])
        if not (torch.equal(rq.cpu().view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(rs.cpu(), want_s)):
            errors.append(f"{tag} FP8 rows or scales differ from the sources'")

        # UE8M0 x_scales (int32, four exponent bytes per word, H 512): the words arrive as sent
        def ue8m0_of(xs):
            q8, s8 = per_token_cast_to_fp8(torch.cat([xs, -xs], dim=1), round_scale=True)
            return q8, pack_ue8m0(s8)

        q8, w8 = _on(cfg, *ue8m0_of(x))
        (rq8, rw8), *_ = buf.dispatch((q8, w8), **layout)
        want_w8 = torch.cat([ue8m0_of(xs)[1][m[:, rank]] for xs, m, _ in every])
        want_q8 = torch.cat([ue8m0_of(xs)[0][m[:, rank]] for xs, m, _ in every])
        if rw8.dtype != torch.int32 or not torch.equal(rw8.cpu(), want_w8) or \
                not torch.equal(rq8.cpu().view(torch.uint8), want_q8.view(torch.uint8)):
            errors.append(f"{tag} UE8M0 x_scales: got {rw8.dtype} {tuple(rw8.shape)}, not the sources' packed words")
        (_, cw8), *_ = buf.dispatch((q8, w8), handle=handle)
        if not torch.equal(cw8.cpu(), want_w8):
            errors.append(f"{tag} cached dispatch with UE8M0 x_scales differs from the sources' words")
        errors += _by_rank_refusals(buf, xd, q, scales, per_rank_d, in_rank_d, per_expert_d, tag)
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def _by_rank_refusals(buf, x, q, scales, per_rank, in_rank, per_expert, tag) -> list:
    """What DeepEP refuses, or we do not serve, each raises naming its argument."""
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    def dispatch(*args, **kwargs):
        return lambda: buf.dispatch(*args, **{**layout, **kwargs})

    return refusals([
        ("topk_weights", dispatch(x, topk_weights=torch.ones((x.shape[0], 1), device=x.device)), ValueError, "topk_weights"),
        ("num_worst_tokens", dispatch(x, num_worst_tokens=64), ValueError, "num_worst_tokens"),
        ("is_token_in_rank", dispatch(x, is_token_in_rank=in_rank.int()), ValueError, "is_token_in_rank"),
        ("x_scales", dispatch((q, scales.view(torch.int32))), ValueError, "x_scales"),  # H 256: no whole int32 of four
    ], f"{tag} ")


def by_rank_cases(R: int) -> list:
    """Three experts per rank (a stand-in on the wrong expert lands on another rank), uneven
    token counts with an empty rank; H = 256 gives two FP8 scale columns."""
    Ts = [6, 0, 9, 3][:R]
    return [dict(seed=800 + R, E=3 * R, K=2, H=256, Ts=Ts, mask="layout", align=4),
            dict(seed=810 + R, E=3 * R, K=2, H=256, Ts=Ts, mask="random", align=1)]


def run_deep_ep_by_rank_cases(cfgs: list) -> list:
    return [e for cfg in cfgs for e in run_deep_ep_by_rank_case(cfg)]


def run_deep_ep_cpu_event_case(cfg: dict) -> list:
    """On a process without CUDA, EventHandle() holds no event and waiting on it does nothing, so
    the asynchronous calls run as Megatron's fused_a2a makes them: an EventOverlap(EventHandle())
    as previous_event, async_finish and allocate_on_comm_stream, then current_stream_wait() on
    the returned events."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep CPU events R={R} rank={rank}]"
    try:
        os.environ["MEGATRON_EP_DEEP_EP_BACKEND"] = "torch"
        from megatron_ep import deep_ep

        errors = []
        if torch.cuda.is_initialized():
            return [f"{tag} CUDA is initialized in this worker: the case needs a process without it"]
        handle = deep_ep.EventHandle()
        if handle.event is not None:
            errors.append(f"{tag} EventHandle() holds {handle.event!r} on a process without CUDA")
        handle.current_stream_wait()
        buf = deep_ep.Buffer(dist.group.WORLD)
        x, idx, w = _inputs(cfg, rank)
        kw = dict(async_finish=True, allocate_on_comm_stream=True)
        per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(
            idx, cfg["E"], previous_event=deep_ep.EventOverlap(deep_ep.EventHandle()), **kw)
        rx, _, rw, _, h, ev = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                           num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                           previous_event=ev, **kw)
        ev.current_stream_wait()
        # (ints, as DeepEP's binding converts them)
        y, _, ev = buf.combine(rx, h, previous_event=deep_ep.EventOverlap(deep_ep.EventHandle()), async_finish=1,
                               allocate_on_comm_stream=1)
        ev.current_stream_wait()
        if not torch.allclose(y, x * _in_rank(idx, cfg["E"] // R, R).sum(1, keepdim=True), rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} the asynchronous dispatch and combine differ from DeepEP's sum")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def run_deep_ep_low_latency_case(cfg: dict) -> list:
    """low_latency_dispatch (bf16, then FP8) and low_latency_combine against DeepEP's semantics:
    per local expert, count[e] rows, blocks per source rank as layout_range says (begin << 32 |
    count), src_info the source token of each row, the rows the source's (FP8: its per-128 cast);
    the combine the weighted sum over the token's experts; unsupported arguments named."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep low latency R={R} rank={rank} seed={cfg['seed']}]"
    try:
        _backend(cfg)
        from megatron_ep import deep_ep
        from megatron_ep.core import logfmt
        from megatron_ep.core.fp8 import per_token_cast_to_fp8, unpack_ue8m0

        errors = []
        E, L, T, H = cfg["E"], cfg["E"] // R, cfg["T"], cfg["H"]
        buf = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                             low_latency_mode=True)
        x, idx, w = _on(cfg, *_inputs(cfg, rank))
        x = x.to(torch.bfloat16)
        srcs = [_inputs(cfg, j) for j in range(R)]
        for use_fp8 in (False, True):
            stats = torch.zeros(L, dtype=torch.int32, device=x.device)
            recv, count, handle, ev, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=use_fp8, return_recv_hook=True,
                                                                     cumulative_local_expert_recv_stats=stats)
            hook()
            if not torch.equal(stats, count):  # DeepEP's test asserts this
                errors.append(f"{tag} fp8={use_fp8}: cumulative_local_expert_recv_stats {stats.tolist()}, count {count.tolist()}")
            data = recv[0] if use_fp8 else recv
            src_info, layout = handle[0], handle[1]
            if not (len(handle) == 5 and handle[2:] == (T, H, E) and data.shape == (L, R * T, H)
                    and count.dtype == torch.int32 and layout.dtype == torch.int64 and layout.shape == (L, R)):
                errors.append(f"{tag} fp8={use_fp8}: shapes or handle differ from DeepEP's")
                continue
            for e in range(L):
                g = rank * L + e
                want_count = sum(int((sj[1] == g).any(dim=1).sum()) for sj in srcs)
                if int(count[e]) != want_count:
                    errors.append(f"{tag} fp8={use_fp8} expert {e}: count {int(count[e])}, DeepEP's {want_count}")
                    continue
                for j, (xj, idxj, _) in enumerate(srcs):
                    begin, n = int(layout[e, j]) >> 32, int(layout[e, j]) & 0xFFFFFFFF
                    tokens = src_info[e, begin:begin + n].tolist()
                    want = (idxj == g).any(dim=1).nonzero().flatten().tolist()
                    if sorted(tokens) != want:
                        errors.append(f"{tag} fp8={use_fp8} expert {e} from rank {j}: tokens {tokens}, DeepEP's {want}")
                        continue
                    rows = xj.to(torch.bfloat16)[tokens]
                    if use_fp8:
                        q, s = per_token_cast_to_fp8(rows)
                        ok = torch.equal(recv[0][e, begin:begin + n].view(torch.uint8).cpu(), q.view(torch.uint8)) and \
                            torch.equal(recv[1][e, begin:begin + n].cpu(), s)
                    else:
                        ok = torch.equal(recv[e, begin:begin + n].cpu(), rows)
                    if not ok:
                        errors.append(f"{tag} fp8={use_fp8} expert {e} from rank {j}: rows differ from the source's")
        # combine: expert g returns its rows times (g + 1); the sum is weighted by topk_weights
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        scaled = torch.stack([recv[e].float() * (rank * L + e + 1) for e in range(L)]).to(torch.bfloat16)
        y, ev, hook = buf.low_latency_combine(scaled, idx, w, handle)
        factor = (torch.where(idx >= 0, w * (idx + 1).float(), 0.0)).sum(1, keepdim=True).double()
        want_y = x.double() * factor
        if not torch.allclose(y.double(), want_y, rtol=2e-2, atol=2e-2):
            errors.append(f"{tag} low_latency_combine differs from DeepEP's weighted sum "
                          f"(max diff {(y.double() - want_y).abs().max():.3g})")
        # flags as DeepEP's binding takes them: a number or numpy bool by its truth value, a string
        # refused naming the flag (every rank makes the same call, so every rank refuses it; on the
        # torch backend only: there the refusal leaves the buffer as it was)
        y_num, _, _ = buf.low_latency_combine(scaled, idx, w, handle, use_logfmt=0, async_finish=np.bool_(False))
        if not torch.equal(y_num, y):
            errors.append(f"{tag} low_latency_combine with flags 0 and numpy False differs from the bools' result")
        errors += [] if buf.runtime.backend == "cuda" else refusals([
            ("use_fp8='False'", lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8="False"), TypeError,
             "use_fp8 must be a bool"),
            ("use_logfmt='False'", lambda: buf.low_latency_combine(scaled, idx, w, handle, use_logfmt="False"), TypeError,
             "use_logfmt must be a bool")], f"{tag} ")
        # zero-copy: the expert outputs written into the buffer the module gives, x unused (zeros)
        zc = buf.get_next_low_latency_combine_buffer(handle)
        if zc.shape != (L, R * T, H) or zc.dtype != torch.bfloat16:
            errors.append(f"{tag} get_next_low_latency_combine_buffer: {zc.dtype} {tuple(zc.shape)}")
        else:
            zc.copy_(scaled)
            y_zc, _, _ = buf.low_latency_combine(torch.zeros_like(scaled), idx, w, handle, zero_copy=True)
            if not torch.equal(y_zc, y):
                errors.append(f"{tag} the zero-copy combine differs from the combine of the same rows")
        # LogFMT: rows below magnitude 1 (scaled by 2^-8, exact in bf16) travel encoded; the sum is
        # that of the rows as decoded (megatron_ep.core.logfmt), and not the bf16 sum
        small = (scaled.float() * 2.0 ** -8).to(torch.bfloat16)
        y_fmt, _, _ = buf.low_latency_combine(small, idx, w, handle, use_logfmt=1)  # (an int, as DeepEP converts)
        y_plain, _, _ = buf.low_latency_combine(small, idx, w, handle)
        want_fmt = torch.zeros((x.shape[0], H), dtype=torch.float64)
        for t in range(x.shape[0]):
            for k in range(idx.shape[1]):
                g = int(idx[t, k])
                if g >= 0:
                    row = ((x[t].float() * (g + 1)).to(torch.bfloat16).float() * 2.0 ** -8).to(torch.bfloat16)
                    want_fmt[t] += float(w[t, k]) * logfmt.roundtrip(row.cpu().unsqueeze(0))[0].double()
        if x.shape[0]:  # (a rank without tokens combines nothing)
            err = (y_fmt.cpu().double() - want_fmt).abs().max().item()
            if err > 1e-2 * (want_fmt.abs().max().item() + 1e-6):
                errors.append(f"{tag} use_logfmt: the combine differs from the LogFMT sum by {err:.3g}")
        if x.shape[0] and torch.equal(y_fmt, y_plain):
            errors.append(f"{tag} use_logfmt: the combine equals the bf16 one (the rows did not travel as LogFMT)")
        # UE8M0: the same call's power-of-two scales, packed four to an int32, column-major
        (q8, s32), _, _, _, _ = buf.low_latency_dispatch(x, idx, T, E, round_scale=True)
        (q_u, s_u), _, _, _, _ = buf.low_latency_dispatch(x, idx, T, E, round_scale=True, use_ue8m0=True)
        if not (s_u.dtype == torch.int32 and s_u.shape == (L, R * T, H // 512) and s_u.transpose(1, 2).is_contiguous()):
            errors.append(f"{tag} UE8M0 scales {s_u.dtype} {tuple(s_u.shape)} strides {s_u.stride()}")
        else:
            for e in range(L):
                n = int(count[e])
                if not (torch.equal(unpack_ue8m0(s_u[e, :n]), s32[e, :n])
                        and torch.equal(q_u[e, :n].view(torch.uint8), q8[e, :n].view(torch.uint8))):
                    errors.append(f"{tag} expert {e}: the UE8M0 dispatch differs from the fp32-scale one")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def low_latency_cases(R: int) -> list:
    return [dict(seed=700 + R, E=2 * R, K=3, H=512, T=8, Ts=[8, 0, 5, 3][:R], p_drop=0.2)]  # H: UE8M0 needs 512


def run_deep_ep_low_latency_cases(cfgs: list) -> list:
    return [e for cfg in cfgs for e in run_deep_ep_low_latency_case(cfg)]


def run_deep_ep_clean_case(cfg: dict) -> list:
    """clean_low_latency_buffer is collective and needs low_latency_mode, as DeepEP's; the next
    dispatch after it works."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep clean R={R} rank={rank}]"
    try:
        os.environ["MEGATRON_EP_DEEP_EP_BACKEND"] = "torch"
        from megatron_ep import deep_ep

        errors = []
        normal = deep_ep.Buffer(dist.group.WORLD)
        try:
            normal.clean_low_latency_buffer(8, 256, 2 * R)
            errors.append(f"{tag} a normal-mode Buffer cleaned a low-latency buffer")
        except AssertionError:
            pass
        buf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)
        buf.clean_low_latency_buffer(8, 256, 2 * R)
        x, idx, _ = _inputs(dict(cfg, Ts=[4] * R), rank)
        _, count, _, _, _ = buf.low_latency_dispatch(x.to(torch.bfloat16), idx, 8, cfg["E"], use_fp8=False)
        if int(count.sum()) != sum(int((_inputs(dict(cfg, Ts=[4] * R), j)[1] // (cfg["E"] // R) == rank).sum()) for j in range(R)):
            errors.append(f"{tag} the dispatch after a clean received {int(count.sum())} copies")
        # the rank mask is the cuda kernels': on the torch backend each entry raises naming why
        errors += refusals([
            ("enable_shrink", lambda: deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True),
             NotImplementedError, "torch backend"),
            ("enable_shrink, normal mode", lambda: deep_ep.Buffer(dist.group.WORLD, enable_shrink=True), ValueError,
             "low_latency_mode=True"),
            ("update mask", lambda: buf.low_latency_update_mask_buffer(0, True), RuntimeError, "rank_mask=True"),
            ("query mask", lambda: buf.low_latency_query_mask_buffer(torch.zeros(R, dtype=torch.int32)), RuntimeError,
             "rank_mask"),
            ("clean mask", lambda: buf.low_latency_clean_mask_buffer(), RuntimeError, "rank_mask"),
            # DeepEP's raw buffer: ours is laid out for our kernels, so it is refused, named
            ("get_local_buffer_tensor", lambda: buf.get_local_buffer_tensor(torch.bfloat16), NotImplementedError,
             "get_local_buffer_tensor")], f"{tag} ")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


SLEEP_CYCLES = 50_000_000  # about 25 ms of the caller's stream at the H200's clock


def run_deep_ep_stream_order_case(cfg: dict) -> list:
    """previous_event marks the inputs ready while the caller's stream is still busy (a sleep
    kernel queued after the event): each call with async_finish then returns what the same call
    returns without an event. Anything the module or our Buffer queues on the caller's stream
    during the call (the handle's copy of topk_idx, the stand-in ids of a dispatch without
    topk_idx, row-major copies of column-major FP8 scales, the combine's weight rows) must be
    waited for by our kernels; a kernel that waits only for the event reads it unwritten."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep stream order R={R} rank={rank} seed={cfg['seed']}]"
    try:
        _backend(cfg)
        from megatron_ep import deep_ep
        from megatron_ep.core.fp8 import per_token_cast_to_fp8

        errors = []
        E = cfg["E"]
        buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20)
        x, idx, w = _on(cfg, *_inputs(cfg, rank))
        x = x.to(torch.bfloat16)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

        def busy():
            ev = deep_ep.Buffer.capture()  # the inputs are ready here
            torch.cuda._sleep(SLEEP_CYCLES)
            return ev

        def same(name, got, want):
            for i, (g, wt) in enumerate(zip(got, want)):
                if isinstance(wt, torch.Tensor):
                    if not (g.shape == wt.shape and torch.equal(_bits(g), _bits(wt))):
                        errors.append(f"{tag} {name}: output {i} differs from the same call without previous_event")
                elif g != wt:
                    errors.append(f"{tag} {name}: output {i} is {g}, without previous_event {wt}")

        # the handle's copy of topk_idx (our Buffer's dispatch)
        want = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
        got = buf.dispatch(x, topk_idx=idx, topk_weights=w, previous_event=busy(), async_finish=True, **kw)
        got[5].current_stream_wait()
        same("dispatch with topk_idx", got[:4], want[:4])
        # the stand-in ids of a dispatch without topk_idx
        want_r = buf.dispatch(x, **kw)
        got_r = buf.dispatch(x, previous_event=busy(), async_finish=True, **kw)
        got_r[5].current_stream_wait()
        same("dispatch without topk_idx", got_r[:1] + got_r[3:4], want_r[:1] + want_r[3:4])
        # a cached FP8 dispatch with column-major scales (DeepEP's tests pass them so)
        q, s = per_token_cast_to_fp8(x)
        want_c = buf.dispatch((q, s), handle=want[4])
        got_c = buf.dispatch((q, s.T.contiguous().T), handle=want[4], previous_event=busy(), async_finish=True)
        got_c[5].current_stream_wait()
        same("cached FP8 dispatch", list(got_c[0]), list(want_c[0]))
        # the combine's weight rows
        want_y = buf.combine(want[0], want[4], topk_weights=want[2])
        got_y = buf.combine(want[0], want[4], topk_weights=want[2], previous_event=busy(), async_finish=True)
        got_y[2].current_stream_wait()
        same("combine with topk_weights", got_y[:2], want_y[:2])
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def stream_order_cases(R: int) -> list:
    return [dict(seed=800 + R, E=4 * R, K=4, H=256, Ts=([96, 40, 128, 7] * 2)[:R], p_drop=0.1)]


def run_deep_ep_stream_order_cases(cfgs: list) -> list:
    return [e for cfg in cfgs for e in run_deep_ep_stream_order_case(cfg)]


# ---------------------------------------------------------------------- hostile use of the module
def _hostile_setup(cfg: dict, **kwargs):
    """A Buffer (cfg "backend", default torch) with the case's inputs and their layout on this rank."""
    _backend(cfg)
    from megatron_ep import deep_ep

    R, rank = dist.get_world_size(), dist.get_rank()
    buf = deep_ep.Buffer(dist.group.WORLD, **kwargs)
    x, idx, w = _on(cfg, *_inputs(cfg, rank))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, cfg["E"])
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w)
    return deep_ep, buf, x, idx, w, layout, R, rank


def run_deep_ep_worst_overflow_case(cfg: dict) -> list:
    """num_worst_tokens below the rows a rank receives (DeepEP's precondition): every rank raises
    a ValueError (megatron_ep.core.errors.WorstCaseOverflowError) naming num_worst_tokens, the rank and
    its count, at once, before any row moves; the Buffer works afterwards."""
    from hostile_cases import raises

    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep num_worst_tokens overflow R={R} rank={rank}]"
    try:
        deep_ep, buf, x, idx, w, layout, R, rank = _hostile_setup(cfg)
        received = _received(cfg, R)
        worst, hot = max(received), received.index(max(received))
        errors = raises(f"{tag} num_worst_tokens={worst - 2}",
                        lambda: buf.dispatch(x, num_worst_tokens=worst - 2, **layout), ValueError,
                        f"rank {hot} receives {worst} rows, its num_worst_tokens={worst - 2}")
        return errors + _worst_below_r_times_t(cfg, buf, x, layout, worst, tag)
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def run_deep_ep_bad_ids_case(cfg: dict) -> list:
    """An expert id out of range on every rank: get_dispatch_layout does not check the ids' values
    (DeepEP's does not either; ours would cost a host sync), the dispatch with them refuses them on
    every rank (ValueError naming num_experts) before any row moves, and the Buffer works after."""
    from hostile_cases import raises

    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep bad ids R={R} rank={rank}]"
    try:
        deep_ep, buf, x, idx, w, layout, R, rank = _hostile_setup(cfg)
        bad = idx.clone()
        bad[0, 0] = cfg["E"] + 1
        errors = []
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(bad, cfg["E"])  # must not raise
        errors += raises(f"{tag} dispatch", lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                                 num_tokens_per_expert=per_expert, topk_idx=bad,
                                                                 topk_weights=w), ValueError, "num_experts")
        rx, *_ = buf.dispatch(x, **layout)
        if not torch.equal(rx.cpu(), _expected(cfg, rank, R)[0]):
            errors.append(f"{tag} the dispatch after the refused one differs from DeepEP's")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def _received(cfg: dict, R: int) -> list:
    """Rows each rank receives in the case's rank-major dispatch (one per token with an expert there)."""
    return [sum(int((_inputs(cfg, src)[1] // (cfg["E"] // R) == r).any(dim=1).sum()) for src in range(R))
            for r in range(R)]


def _worst_below_r_times_t(cfg: dict, buf, x, layout: dict, worst: int, tag: str) -> list:
    """A worst-case sized dispatch whose num_worst_tokens is what the busiest rank receives, below
    R x T (the rank-major rows a rank could receive): DeepEP's rows on every rank."""
    R, rank = dist.get_world_size(), dist.get_rank()
    if worst >= R * max(cfg["Ts"]):
        return [f"{tag} the case does not put num_worst_tokens={worst} below R x T = {R * max(cfg['Ts'])}"]
    rx, *_ = buf.dispatch(x, num_worst_tokens=worst, **layout)
    want = _expected(cfg, rank, R)[0]
    rx = rx.cpu()
    if not (rx.shape[0] == worst and torch.equal(rx[:want.shape[0]], want)):
        return [f"{tag} the dispatch with num_worst_tokens={worst} differs from DeepEP's rows"]
    return []


def run_deep_ep_worst_below_rt_case(cfg: dict) -> list:
    """On our kernels (a worst-case sized dispatch cannot grow the buffer): num_worst_tokens below
    R x T, as DeepEP's callers may pass it, fits (megatron_ep.deep_ep reserves R x T combine rows
    too) and delivers DeepEP's rows."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep num_worst_tokens below R x T R={R} rank={rank} {cfg.get('backend', 'torch')}]"
    try:
        deep_ep, buf, x, idx, w, layout, R, rank = _hostile_setup(cfg)
        return _worst_below_r_times_t(cfg, buf, x, layout, max(_received(cfg, R)), tag)
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def run_deep_ep_destroyed_on_one_rank_case(cfg: dict) -> list:
    """Rank 0 destroys its Buffer, then every rank makes each collective call on it: rank 0
    raises that it was destroyed, its peers PeerFailedError with that message, at once (not at
    the process group's timeout)."""
    from hostile_cases import raises
    from megatron_ep.core.errors import PeerFailedError

    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep destroyed on rank 0 R={R} rank={rank}]"
    try:
        deep_ep, buf, x, idx, w, layout, R, rank = _hostile_setup(cfg, low_latency_mode=True, explicitly_destroy=True)
        E, T = cfg["E"], max(cfg["Ts"])
        rx, _, _, _, handle, _ = buf.dispatch(x, **layout)
        xb = x.to(torch.bfloat16)
        recv, _, ll_handle, _, _ = buf.low_latency_dispatch(xb, idx, T, E, use_fp8=False)
        if rank == 0:
            buf.destroy()
        want = RuntimeError if rank == 0 else PeerFailedError
        calls = [("dispatch", lambda: buf.dispatch(x, **layout)),
                 ("cached dispatch", lambda: buf.dispatch(x, handle=handle)),
                 ("combine", lambda: buf.combine(rx, handle)),
                 ("low_latency_dispatch", lambda: buf.low_latency_dispatch(xb, idx, T, E, use_fp8=False)),
                 ("low_latency_combine", lambda: buf.low_latency_combine(recv, idx, w, ll_handle)),
                 ("clean_low_latency_buffer", lambda: buf.clean_low_latency_buffer(T, x.shape[1], E))]
        errors = []
        for name, call in calls:
            errors += raises(f"{tag} {name}", call, want, "this Buffer was destroyed")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def run_deep_ep_use_after_destroy_case(cfg: dict) -> list:
    """After destroy() every public method of the Buffer (and a second destroy, which DeepEP's
    runtime asserts against) raises RuntimeError naming the method and that the Buffer was
    destroyed; the list of methods is the class's own, so a new one is checked too."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep use after destroy R={R} rank={rank}]"
    try:
        deep_ep, buf, x, idx, w, layout, R, rank = _hostile_setup(cfg, low_latency_mode=True, explicitly_destroy=True)
        E, T, H = cfg["E"], max(cfg["Ts"]), x.shape[1]
        rx, _, _, _, handle, _ = buf.dispatch(x, **layout)
        xb = x.to(torch.bfloat16)
        recv, _, ll_handle, _, _ = buf.low_latency_dispatch(xb, idx, T, E, use_fp8=False)
        buf.destroy()
        calls = {
            "destroy": lambda: buf.destroy(),
            "get_dispatch_layout": lambda: buf.get_dispatch_layout(idx, E),
            "dispatch": lambda: buf.dispatch(x, **layout),
            "combine": lambda: buf.combine(rx, handle),
            "low_latency_dispatch": lambda: buf.low_latency_dispatch(xb, idx, T, E, use_fp8=False),
            "low_latency_combine": lambda: buf.low_latency_combine(recv, idx, w, ll_handle),
            "clean_low_latency_buffer": lambda: buf.clean_low_latency_buffer(T, H, E),
            "low_latency_update_mask_buffer": lambda: buf.low_latency_update_mask_buffer(0, True),
            "low_latency_query_mask_buffer": lambda: buf.low_latency_query_mask_buffer(torch.zeros(R, dtype=torch.int32)),
            "low_latency_clean_mask_buffer": lambda: buf.low_latency_clean_mask_buffer(),
            "get_comm_stream": lambda: buf.get_comm_stream(),
            "get_local_buffer_tensor": lambda: buf.get_local_buffer_tensor(torch.bfloat16),
            "get_next_low_latency_combine_buffer": lambda: buf.get_next_low_latency_combine_buffer(ll_handle),
        }
        public = sorted(n for n, v in vars(deep_ep.Buffer).items()
                        if callable(v) and not n.startswith("_") and not isinstance(v, staticmethod))
        errors = [] if public == sorted(calls) else [f"{tag} the case's methods {sorted(calls)} are not the class's {public}"]
        return errors + refusals([(name, call, RuntimeError, f"Buffer.{name}: this Buffer was destroyed")
                                  for name, call in calls.items()], f"{tag} ")
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def run_deep_ep_handle_copy_case(cfg: dict) -> list:
    """copy.copy and copy.deepcopy of a normal and a low-latency handle (DeepEP's are tuples,
    which both copy): the same type and entries (deepcopy: equal tensors, not the same ones),
    and a cached dispatch, combine and low-latency combine with the deep copy give what they
    give with the original."""
    import copy

    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep handle copies R={R} rank={rank}]"
    try:
        deep_ep, buf, x, idx, w, layout, R, rank = _hostile_setup(cfg, low_latency_mode=True)
        E, T = cfg["E"], max(cfg["Ts"])
        rx, _, _, _, handle, _ = buf.dispatch(x, **layout)
        xb = x.to(torch.bfloat16)
        recv, _, ll_handle, _, _ = buf.low_latency_dispatch(xb, idx, T, E, use_fp8=False)
        errors = []
        for name, h in (("normal", handle), ("low-latency", ll_handle)):
            shallow, deep = copy.copy(h), copy.deepcopy(h)
            if not (type(shallow) is type(h) and len(shallow) == len(h) and all(a is b for a, b in zip(shallow, h))):
                errors.append(f"{tag} copy.copy of the {name} handle differs from it")
            same = all((torch.equal(a, b) and a is not b) if isinstance(b, torch.Tensor) else a == b
                       for a, b in zip(deep, h))
            if not (type(deep) is type(h) and len(deep) == len(h) and same):
                errors.append(f"{tag} copy.deepcopy of the {name} handle does not hold equal copies of its entries")
        deep = copy.deepcopy(handle)
        if not torch.equal(buf.dispatch(x * 2, handle=deep)[0], buf.dispatch(x * 2, handle=handle)[0]):
            errors.append(f"{tag} a cached dispatch with the deep copy differs")
        if not torch.equal(buf.combine(rx, deep)[0], buf.combine(rx, handle)[0]):
            errors.append(f"{tag} a combine with the deep copy differs")
        ll_deep = copy.deepcopy(ll_handle)
        if not torch.equal(buf.low_latency_combine(recv, idx, w, ll_deep)[0], buf.low_latency_combine(recv, idx, w, ll_handle)[0]):
            errors.append(f"{tag} a low-latency combine with the deep copy differs")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def run_deep_ep_zero_copy_other_handle_case(cfg: dict) -> list:
    """A zero-copy combine whose buffer was asked for (and filled) with another handle, of
    another shape: ValueError naming both shapes, on every rank at once; with the mistake on one
    rank only, its peers raise PeerFailedError naming it instead of waiting. Asked for with the
    right handle afterwards, the zero-copy combine gives the plain combine's result."""
    from hostile_cases import raises
    from megatron_ep.core.errors import PeerFailedError

    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep zero-copy buffer of another handle R={R} rank={rank}]"
    try:
        deep_ep, buf, x, idx, w, layout, R, rank = _hostile_setup(cfg, low_latency_mode=True)
        E, T, H, L = cfg["E"], max(cfg["Ts"]), x.shape[1], cfg["E"] // R
        xb = x.to(torch.bfloat16)
        recv_a, _, handle_a, _, _ = buf.low_latency_dispatch(xb, idx, 2 * T, E, use_fp8=False)
        recv_b, _, handle_b, _, _ = buf.low_latency_dispatch(xb, idx, T, E, use_fp8=False)
        shapes = f"[{L}, {R * 2 * T}, {H}]", f"[{L}, {R * T}, {H}]"
        buf.get_next_low_latency_combine_buffer(handle_a).copy_(recv_a)
        errors = raises(f"{tag} on every rank", lambda: buf.low_latency_combine(torch.zeros_like(recv_b), idx, w, handle_b,
                                                                            zero_copy=True),
                        ValueError, f"belongs to another handle, of shape {shapes[0]}")
        errors += raises(f"{tag} on every rank, this combine's shape",
                         lambda: buf.low_latency_combine(torch.zeros_like(recv_b), idx, w, handle_b, zero_copy=True),
                         ValueError, f"this combine's handle is of shape {shapes[1]}")
        buf.get_next_low_latency_combine_buffer(handle_a if rank == 0 else handle_b).copy_(recv_a if rank == 0 else recv_b)
        errors += raises(f"{tag} on rank 0 only",
                         lambda: buf.low_latency_combine(torch.zeros_like(recv_b), idx, w, handle_b, zero_copy=True),
                         ValueError if rank == 0 else PeerFailedError, "belongs to another handle")
        buf.get_next_low_latency_combine_buffer(handle_b).copy_(recv_b)
        y_zc, _, _ = buf.low_latency_combine(torch.zeros_like(recv_b), idx, w, handle_b, zero_copy=True)
        if not torch.equal(y_zc, buf.low_latency_combine(recv_b, idx, w, handle_b)[0]):
            errors.append(f"{tag} the zero-copy combine with the right buffer differs from the plain one")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def run_deep_ep_buffer_argument_case(cfg: dict) -> list:
    """Buffer's arguments that DeepEP asserts on (or that it takes as ints and flags), refused at
    the call naming the argument, its value and the allowed range; a dispatch's config too."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep Buffer arguments R={R} rank={rank}]"
    try:
        deep_ep, buf, x, idx, w, layout, R, rank = _hostile_setup(cfg)
        g = dist.group.WORLD

        def make(**kwargs):
            return lambda: deep_ep.Buffer(kwargs.pop("group", g), **kwargs)

        return refusals([
            ("num_nvl_bytes 100", make(num_nvl_bytes=100), ValueError, "num_nvl_bytes=100 must be a multiple of 128"),
            ("num_nvl_bytes -128", make(num_nvl_bytes=-128), ValueError, "num_nvl_bytes=-128 is outside its range: it must be >= 0"),
            ("num_nvl_bytes 1.5e6", make(num_nvl_bytes=1.5e6), TypeError, "num_nvl_bytes must be an int, got float"),
            ("num_rdma_bytes 129", make(num_rdma_bytes=129, low_latency_mode=True), ValueError,
             "num_rdma_bytes=129 must be a multiple of 128"),
            ("num_rdma_bytes without low_latency_mode", make(num_rdma_bytes=128), ValueError,
             f"num_rdma_bytes=128 must be 0 on a group of {R} ranks without low_latency_mode"),
            ("low_latency_mode 'False'", make(low_latency_mode="False"), TypeError, "low_latency_mode must be a bool, got str"),
            ("explicitly_destroy 1", make(explicitly_destroy=1), TypeError, "explicitly_destroy must be a bool, got int"),
            ("num_qps_per_rank 0", make(low_latency_mode=True, num_qps_per_rank=0), ValueError,
             "num_qps_per_rank=0 is outside its range: it must be in 1..2147483647"),
            ("group", make(group="world"), TypeError, "group must be a torch.distributed process group"),
            ("dispatch config", lambda: buf.dispatch(x, config=(20, 6, 256), **layout), TypeError,
             "config must be a megatron_ep.deep_ep.Config or None, got tuple"),
        ], f"{tag} ")
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]
