"""Worker bodies for megatron_ep.deep_ep's ElasticBuffer (DeepEP V2's API on our Buffer), run on
every rank of a DistPool: each call against an oracle of V2's documented semantics built from every
rank's inputs (regenerated from the seeds, as tests/support/deep_ep_cases.py does for V1)."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from deep_ep_cases import _backend, _expected, _in_rank, _inputs, _on
from refusals import refusals


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _inputs_v2(cfg: dict, rank: int):
    """The V1 cases' inputs; "dup": each token's slot 1 repeats slot 0's expert (V2 faults on it;
    every slot counts here)."""
    x, idx, w = _inputs(cfg, rank)
    if cfg.get("dup") and idx.shape[1] > 1:
        idx[:, 1] = idx[:, 0]
    return x, idx, w


def _expanded(cfg: dict, me: int, R: int):
    """V2's expanded dispatch on rank `me`: per local expert, its rows by source rank, source token
    and slot (V2's deterministic order), the expert's block from its aligned start; padding rows
    zero. Returns (x, weights, counts) with the rows [M, H], [M]."""
    L, a = cfg["E"] // R, cfg.get("align", 1)
    per = [[] for _ in range(L)]
    for src in range(R):
        x, idx, w = _inputs_v2(cfg, src)
        for t in range(x.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if me * L <= e < (me + 1) * L:
                    per[e - me * L].append((x[t], float(w[t, k])))
    H = cfg["H"]
    xs, ws, counts = [], [], []
    for rows in per:
        counts.append(len(rows))
        pad = _align(len(rows), a) - len(rows)
        xs += [r[0] for r in rows] + [torch.zeros(H)] * pad
        ws += [r[1] for r in rows] + [0.0] * pad
    x = torch.stack(xs) if xs else torch.zeros((0, H))
    return x, torch.tensor(ws, dtype=torch.float32), counts


def _expanded_of(cfg: dict, me: int, R: int, rows_of) -> torch.Tensor:
    """_expanded's rows of another per-token tensor (rows_of(src) -> [T, C]), padding zero."""
    L, a = cfg["E"] // R, cfg.get("align", 1)
    per = [[] for _ in range(L)]
    for src in range(R):
        _, idx, _ = _inputs_v2(cfg, src)
        rows = rows_of(src)
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if me * L <= e < (me + 1) * L:
                    per[e - me * L].append(rows[t])
    zero = torch.zeros(rows.shape[1:], dtype=rows.dtype)
    out = []
    for got in per:
        out += got + [zero] * (_align(len(got), a) - len(got))
    return torch.stack(out) if out else rows[:0]


def _fp8_section(cfg: dict, buf, x, idx, rank: int, R: int, tag: str) -> list:
    """FP8 input as V2's callers pass it: (e4m3 rows, fp32 scales [T, H/128]), plain and expanded
    with V2's column-major scales, and UE8M0 int32 scale words."""
    from megatron_ep.core.fp8 import pack_ue8m0, per_token_cast_to_fp8

    errors: list = []
    E, L = cfg["E"], cfg["E"] // R
    src = [_inputs_v2(cfg, r)[0] for r in range(R)]
    cast = [per_token_cast_to_fp8(xs) for xs in src]
    q, sc = _on(cfg, *cast[rank])
    (rq, rs), _, _, _, _ = buf.dispatch((q, sc), topk_idx=idx, num_experts=E)
    owner = [torch.where(_inputs_v2(cfg, r)[1] >= 0, _inputs_v2(cfg, r)[1] // L, -1) for r in range(R)]
    here = [(o == rank).any(dim=1) for o in owner]
    _check(errors, tag, "FP8 rows", rq.view(torch.uint8), torch.cat([c[0][m] for c, m in zip(cast, here)]).view(torch.uint8))
    _check(errors, tag, "FP8 scales", rs, torch.cat([c[1][m] for c, m in zip(cast, here)]))
    (xq, xs), _, _, _, _ = buf.dispatch((q, sc), topk_idx=idx, num_experts=E, expert_alignment=cfg.get("align", 1),
                                        do_expand=True, use_tma_aligned_col_major_sf=True)
    M = xq.shape[0]
    if xs.stride() != (1, _align(M, 4)):
        errors.append(f"{tag} use_tma_aligned_col_major_sf: scale strides {xs.stride()}, V2's {(1, _align(M, 4))}")
    _check(errors, tag, "expanded FP8 rows", xq.view(torch.uint8),
           _expanded_of(cfg, rank, R, lambda r: cast[r][0].view(torch.uint8)))
    _check(errors, tag, "expanded FP8 column-major scales", xs.contiguous(), _expanded_of(cfg, rank, R, lambda r: cast[r][1]))
    # V2's flags as its own test passes them (ints); the padding of FP8 rows zeroed
    (zq, _), _, _, _, _ = buf.dispatch((q, sc), topk_idx=idx, num_experts=E, expert_alignment=cfg.get("align", 1),
                                       do_expand=1, do_zero_padding=1, do_handle_copy=0, do_cpu_sync=1,
                                       async_with_compute_stream=0, allocate_on_comm_stream=0,
                                       use_tma_aligned_col_major_sf=0)
    _check(errors, tag, "expanded FP8 rows, padding zeroed, int flags", zq.view(torch.uint8),
           _expanded_of(cfg, rank, R, lambda r: cast[r][0].view(torch.uint8)))

    def ue8m0_of(xs_):
        q8, s8 = per_token_cast_to_fp8(torch.cat([xs_] * 4, dim=1), round_scale=True)
        return q8, pack_ue8m0(s8)

    packed = [ue8m0_of(xs_) for xs_ in src]
    q8, w8 = _on(cfg, *packed[rank])
    (_, rw8), _, _, _, _ = buf.dispatch((q8, w8), topk_idx=idx, num_experts=E)
    _check(errors, tag, "UE8M0 scale words", rw8, torch.cat([p[1][m] for p, m in zip(packed, here)]))
    return errors


def _src_metadata_section(cfg: dict, h, hx, hw, rank: int, R: int, Tmax: int, tag: str) -> list:
    """EPHandle.recv_src_metadata against V2's: per received token its source rank * Tmax + source
    index, its source rank * K + first slot here, and (expanded) each slot's expanded row, -1
    elsewhere; without the CPU sync (`hw`), the same rows first and -1 in every column of the rest.
    On both backends (the cuda intranode kernels write each row's source token)."""
    errors: list = []
    L, a = cfg["E"] // R, cfg.get("align", 1)
    K = cfg["K"]
    tokens, per = [], [[] for _ in range(L)]  # received (src, t), and each local expert's (src, t, k)
    for src in range(R):
        _, idx, _ = _inputs_v2(cfg, src)
        for t in range(idx.shape[0]):
            local = [k for k in range(K) if rank * L <= int(idx[t, k]) < (rank + 1) * L]
            if local:
                tokens.append((src, t, local[0]))
            for k in local:
                per[int(idx[t, k]) - rank * L].append((src, t, k))
    start, row_of = 0, {}
    for e in range(L):
        for i, key in enumerate(per[e]):
            row_of[key] = start + i
        start += _align(len(per[e]), a)
    want = torch.full((len(tokens), K + 2), -1, dtype=torch.int32)
    for r, (src, t, first) in enumerate(tokens):
        want[r, 0], want[r, 1] = src * Tmax + t, src * K + first
    _check(errors, tag, "recv_src_metadata (plain)", h.recv_src_metadata, want)
    worst = torch.full((R * Tmax, K + 2), -1, dtype=torch.int32)
    worst[:len(tokens)] = want
    _check(errors, tag, "recv_src_metadata (plain, no CPU sync)", hw.recv_src_metadata, worst)
    for r, (src, t, _) in enumerate(tokens):
        for k in range(K):
            want[r, 2 + k] = row_of.get((src, t, k), -1)
    _check(errors, tag, "recv_src_metadata (expanded)", hx.recv_src_metadata, want)
    return errors


def _slot_section(cfg: dict, h, hx, rank: int, R: int, Tmax: int, tag: str) -> list:
    """EPHandle.dst_buffer_slot_idx against V2's (deterministic order): in the first slot of each
    destination rank of a token, rank * Tmax + the token's place among this rank's tokens to that
    rank, -1 elsewhere; the same for an expanded dispatch's handle (the routing decides it)."""
    errors: list = []
    L = cfg["E"] // R
    _, idx, _ = _inputs_v2(cfg, rank)
    want = torch.full(idx.shape, -1, dtype=torch.int32)
    sent = [0] * R
    for t in range(idx.shape[0]):
        seen = set()
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if 0 <= e < cfg["E"] and e // L not in seen:
                seen.add(e // L)
                want[t, k] = rank * Tmax + sent[e // L]
                sent[e // L] += 1
    _check(errors, tag, "dst_buffer_slot_idx", h.dst_buffer_slot_idx, want)
    _check(errors, tag, "dst_buffer_slot_idx (expanded)", hx.dst_buffer_slot_idx, want)
    return errors


def _check(errors: list, tag: str, name: str, got, want) -> None:
    got = got.cpu()
    if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
        errors.append(f"{tag} {name}: {tuple(got.shape)} {got.flatten()[:8].tolist()} differs from V2's "
                      f"{tuple(want.shape)} {want.flatten()[:8].tolist()}")


def run_elastic_case(cfg: dict) -> list:
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[elastic R={R} rank={rank} seed={cfg['seed']}]"
    try:
        _backend(cfg)
        from megatron_ep import deep_ep

        errors: list = []
        E, L, a, Tmax = cfg["E"], cfg["E"] // R, cfg.get("align", 1), max(cfg["Ts"])
        # ranks pass different num_max_tokens_per_rank (V2 needs one): every rank keeps the largest
        buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=max(cfg["Ts"][rank], 1),
                                    hidden=cfg["H"], num_topk=cfg["K"], explicitly_destroy=True)
        if buf.num_max_tokens_per_rank != max(max(cfg["Ts"]), 1):
            errors.append(f"{tag} num_max_tokens_per_rank {buf.num_max_tokens_per_rank} is not the ranks' largest")
        Tmax = buf.num_max_tokens_per_rank
        if buf.get_logical_domain_size() != (1, R) or buf.num_ranks != R or buf.rank_idx != rank:
            errors.append(f"{tag} logical domain {buf.get_logical_domain_size()} / num_ranks / rank_idx")
        num_sms = buf.get_theoretical_num_sms(E, cfg["K"])
        if not isinstance(num_sms, int) or buf.get_theoretical_num_qps(num_sms) > buf.num_allocated_qps:
            errors.append(f"{tag} get_theoretical_num_sms / num_qps: {num_sms}")
        x, idx, w = _on(cfg, *_inputs_v2(cfg, rank))
        want_in_rank = _in_rank(idx.cpu(), L, R)

        # plain dispatch with the CPU sync
        stats = torch.zeros(L, dtype=torch.int32, device=x.device)
        rx, rid, rw, h, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=a,
                                          cumulative_local_expert_recv_stats=stats)
        ex, eid, ew, sent = _expected(cfg, rank, R, _inputs_v2)
        _check(errors, tag, "recv_x", rx, ex)
        _check(errors, tag, "recv_topk_idx", rid, eid)
        _check(errors, tag, "recv_topk_weights", rw, ew)
        exact = [0] * L
        for src in range(R):
            _, sidx, _ = _inputs_v2(cfg, src)
            for e in range(L):
                exact[e] += int((sidx == rank * L + e).sum())
        aligned = [_align(c, a) for c in exact]
        if h.num_recv_tokens_per_expert_list != aligned:
            errors.append(f"{tag} num_recv_tokens_per_expert_list {h.num_recv_tokens_per_expert_list}, V2's {aligned}")
        _check(errors, tag, "psum_num_recv_tokens_per_expert", h.psum_num_recv_tokens_per_expert,
               torch.cumsum(torch.tensor(aligned), 0).to(torch.int32))
        _check(errors, tag, "num_unaligned_recv_tokens_per_expert", h.num_unaligned_recv_tokens_per_expert,
               torch.tensor(exact, dtype=torch.int32))
        _check(errors, tag, "psum_num_recv_tokens_per_scaleup_rank", h.psum_num_recv_tokens_per_scaleup_rank,
               torch.cumsum(sent[:, rank], 0).to(torch.int32))
        _check(errors, tag, "cumulative_local_expert_recv_stats", stats, torch.tensor(exact, dtype=torch.int32))
        shares = h.topk_idx is idx or (idx.numel() > 0 and h.topk_idx.data_ptr() == idx.data_ptr())
        if h.num_recv_tokens != ex.shape[0] or h.do_expand or shares or not torch.equal(h.topk_idx, idx):
            errors.append(f"{tag} handle: num_recv_tokens {h.num_recv_tokens} (want {ex.shape[0]}), do_expand "
                          f"{h.do_expand}, or its topk_idx is not a copy of the routing "
                          f"({shares}, {torch.equal(h.topk_idx, idx)})")
        if ev is None or not hasattr(ev, "current_stream_wait"):
            errors.append(f"{tag} dispatch returned no EventOverlap: {ev!r}")
        # do_handle_copy=False keeps the caller's tensor
        _, _, _, h_nc, _ = buf.dispatch(x, topk_idx=idx, num_experts=E, do_handle_copy=False)
        if h_nc.topk_idx is not idx:
            errors.append(f"{tag} do_handle_copy=False: the handle's topk_idx is not the caller's tensor")

        # cached dispatch (the backward of combine): the same rows
        cx, cid, cw, ch, _ = buf.dispatch(x * 2, handle=h)
        _check(errors, tag, "cached recv_x", cx, ex * 2)
        if ch is not h or cw is not None:
            errors.append(f"{tag} cached dispatch: handle {ch is h}, weights {cw is not None}")

        # combine: the unweighted sum of the rows each token's dispatch delivered, plus the biases
        y, yw, _ = buf.combine(rx * (rank + 1), h, topk_weights=rw)
        scale = sum((r + 1) * want_in_rank[:, r].double() for r in range(R))
        want_y = x.cpu().double() * scale.unsqueeze(1)
        if not torch.allclose(y.cpu().double(), want_y, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} combined_x differs from V2's sum")
        want_w = _summed_weights(cfg, rank, R)
        if yw is None or not torch.allclose(yw.cpu(), want_w, rtol=0, atol=1e-6):
            errors.append(f"{tag} combined_topk_weights differ from the routed-back weights")
        bias, = _on(cfg, torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + rank)))
        yb, _, _ = buf.combine(rx, h, bias=(bias, bias))
        want_b = x.cpu().double() * want_in_rank.sum(1, keepdim=True).double() + 2 * bias.cpu().double()
        if not torch.allclose(yb.cpu().double(), want_b, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} combine with a bias pair differs from V2's")

        # expanded dispatch: expert blocks from their aligned starts, padding zeroed
        xx, xid, xw, hx, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=a,
                                          do_expand=True, do_zero_padding=True)
        want_xx, want_xw, counts = _expanded(cfg, rank, R)
        _check(errors, tag, "expanded recv_x", xx, want_xx)
        _check(errors, tag, "expanded recv_topk_weights", xw, want_xw)
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + _align(c, a))
        _check(errors, tag, "expanded psum_num_recv_tokens_per_expert", hx.psum_num_recv_tokens_per_expert,
               torch.tensor([s + c for s, c in zip(starts, counts)], dtype=torch.int32))
        if xid is not None or hx.num_expanded_tokens != want_xx.shape[0] or hx.num_recv_tokens != ex.shape[0] or \
                hx.num_recv_tokens_per_expert_list != [_align(c, a) for c in counts]:
            errors.append(f"{tag} expanded: recv_topk_idx {xid is not None}, num_expanded_tokens "
                          f"{hx.num_expanded_tokens}, num_recv_tokens {hx.num_recv_tokens} (want {ex.shape[0]}), "
                          f"list {hx.num_recv_tokens_per_expert_list}")
        # cached expanded dispatch with weights, zero padding; then the expanded combine
        cxx, _, cxw, _, _ = buf.dispatch(x, handle=hx, topk_weights=w, do_expand=True, do_zero_padding=True)
        _check(errors, tag, "cached expanded recv_x", cxx, want_xx)
        _check(errors, tag, "cached expanded weights", cxw, want_xw)
        ye, _, _ = buf.combine(xx, hx, async_with_compute_stream=0, allocate_on_comm_stream=0)  # (V2's test: ints)
        per_token = (torch.stack([(idx.cpu() >= 0) & (idx.cpu() // L == r) for r in range(R)]).sum((0, 2))).double()
        if not torch.allclose(ye.cpu().double(), x.cpu().double() * per_token.unsqueeze(1), rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} expanded combine differs from V2's sum over every slot")

        # without the CPU sync: worst-case rows, the real ones first, the list empty
        wx, _, _, hw, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_cpu_sync=False)
        n = ex.shape[0]
        if not (wx.shape[0] == R * Tmax and hw.num_recv_tokens_per_expert_list == []
                and torch.equal(wx[:n].cpu(), ex.to(wx.dtype))
                and int(hw.psum_num_recv_tokens_per_scaleup_rank[-1]) == n):
            errors.append(f"{tag} do_cpu_sync=False: {wx.shape[0]} rows (want {R * Tmax}), list "
                          f"{hw.num_recv_tokens_per_expert_list}")

        errors += _single_reduction_section(cfg, x, idx, rank, R, tag)
        if cfg["H"] % 128 == 0:
            errors += _fp8_section(cfg, buf, x, idx, rank, R, tag)
        # num_sms=0 is automatic in every call, a count is handed to our budget
        buf.dispatch(x, handle=h, num_sms=0)
        errors += _src_metadata_section(cfg, h, hx, hw, rank, R, Tmax, tag)
        errors += _slot_section(cfg, h, hx, rank, R, Tmax, tag)
        errors += refusals([(what, call, NotImplementedError, what)
                            for what, call in (("engram_write", buf.engram_write), ("pp_send", buf.pp_send))], f"{tag} ")
        buf.destroy()
        errors += refusals([("a destroyed ElasticBuffer's dispatch", lambda: buf.dispatch(x, topk_idx=idx, num_experts=E),
                             RuntimeError, "destroyed")], f"{tag} ")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def _single_reduction_section(cfg: dict, x: torch.Tensor, idx: torch.Tensor, rank: int, R: int, tag: str) -> list:
    """allow_multiple_reduction=False: an expanded combine adds every slot's row in slot order to
    one fp32 sum, rounded once (V2's single reduction), bit for bit. Each row is scaled by its
    expert, so a token's slots on one rank differ and a per-rank partial would round them."""
    from megatron_ep import deep_ep

    errors: list = []
    E, L, K, a = cfg["E"], cfg["E"] // R, cfg["K"], cfg.get("align", 1)
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=max(max(cfg["Ts"]), 1), hidden=cfg["H"],
                                num_topk=K, allow_multiple_reduction=False, explicitly_destroy=True)
    xx, _, _, hx, _ = buf.dispatch(x, topk_idx=idx, num_experts=E, expert_alignment=a, do_expand=True,
                                   do_zero_padding=True)
    y, start = xx.clone(), 0
    for e, end in enumerate(hx.psum_num_recv_tokens_per_expert.cpu().tolist()):
        y[start:end] = xx[start:end] * (1.0 + 0.37 * (rank * L + e))
        start = _align(end - start, a) + start
    got, _, _ = buf.combine(y, hx)
    want = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(idx[t, k])
            if 0 <= e < E:
                want[t] += (x[t] * (1.0 + 0.37 * e)).float()
    _check(errors, tag, "allow_multiple_reduction=False combine", got, want.to(x.dtype).cpu())
    buf.destroy()
    return errors


def _summed_weights(cfg: dict, me: int, R: int) -> torch.Tensor:
    """The weights a combine of the dispatched weights routes back to rank `me`'s tokens: each
    receiving rank passes its local experts' weights (0 elsewhere), summed over ranks."""
    _, idx, w = _inputs_v2(cfg, me)
    return torch.where(idx >= 0, w, 0.0)


def elastic_cases(R: int) -> list:
    """Uneven token counts with an empty rank and -1 slots; every token on one expert with an
    alignment; duplicate ids in a token."""
    Ts = ([6, 0, 9, 3, 7, 1, 4, 5] * 2)[:R]
    return [dict(seed=700 + R, E=2 * R, K=3, H=16, Ts=Ts, p_drop=0.2, align=3),
            dict(seed=710 + R, E=4 * R, K=2, H=32, Ts=[5] * R, pattern="hot", align=4),
            dict(seed=720 + R, E=2 * R, K=3, H=16, Ts=Ts[::-1], dup=True, align=1),
            dict(seed=730 + R, E=3 * R, K=2, H=256, Ts=Ts, p_drop=0.1, align=4)]


def run_elastic_cases(cfgs: list) -> list:
    return [e for cfg in cfgs for e in run_elastic_case(cfg)]


def run_elastic_callers_case(cfg: dict) -> list:
    """The call sequences of V2's callers, replayed: Megatron-LM dev's `deepepv2` flex backend
    (fused_a2a: size hint, capture() events, async calls, the list of counts, backward = cached
    dispatch and weighted combine), SGLang's `deepep_v2` dispatcher (theoretical SMs and QPs, the
    contiguous path sliced to psum[-1], the expanded decode path without CPU sync) and vLLM's
    `deepep_v2` prepare/finalize (expanded prefill, plain decode at a power-of-two token cap)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[elastic callers R={R} rank={rank} seed={cfg['seed']}]"
    try:
        _backend(cfg)
        from megatron_ep.deep_ep import ElasticBuffer

        errors: list = []
        E, L, H, K = cfg["E"], cfg["E"] // R, cfg["H"], cfg["K"]
        x, idx, w = _on(cfg, *_inputs_v2(cfg, rank))
        T = x.shape[0]
        ex, eid, ew, _ = _expected(cfg, rank, R, _inputs_v2)
        want_xx, want_xw, counts = _expanded(dict(cfg, align=1), rank, R)
        in_rank = _in_rank(idx.cpu(), L, R).sum(1, keepdim=True).double()

        # Megatron-LM dev (fused_a2a.get_elastic_buffer / DeepepV2Dispatch / DeepepV2Combine)
        group = dist.group.WORLD
        nbytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
        buf = ElasticBuffer(group, num_bytes=nbytes, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
        if buf.group is not group or buf.num_bytes < nbytes or buf.num_max_tokens_per_rank < T:
            errors.append(f"{tag} megatron: the buffer's group / num_bytes / num_max_tokens_per_rank")
        prev = buf.capture()
        rx, rid, rw, h, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w.float(), num_experts=E,
                                          num_max_tokens_per_rank=T, expert_alignment=1, num_sms=0,
                                          previous_event=prev, async_with_compute_stream=True,
                                          allocate_on_comm_stream=True)
        ev.current_stream_wait()
        tpe = torch.tensor(h.num_recv_tokens_per_expert_list)
        _check(errors, tag, "megatron recv_x", rx, ex)
        _check(errors, tag, "megatron recv_token_indices", rid, eid)
        _check(errors, tag, "megatron tokens_per_expert", tpe, torch.tensor([int((eid == e).sum()) for e in range(L)]))
        y, _, ev = buf.combine(rx, handle=h, num_sms=0, previous_event=buf.capture(), async_with_compute_stream=True,
                               allocate_on_comm_stream=True)
        ev.current_stream_wait()
        if not torch.allclose(y.cpu().double(), x.cpu().double() * in_rank, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} megatron combine differs from the sum")
        grad_x, _, _, _, ev = buf.dispatch(y.contiguous(), handle=h, num_sms=h.num_sms, previous_event=buf.capture(),
                                           async_with_compute_stream=True, allocate_on_comm_stream=True)
        ev.current_stream_wait()
        if grad_x.shape != rx.shape:
            errors.append(f"{tag} megatron backward dispatch: {tuple(grad_x.shape)} rows, want {tuple(rx.shape)}")
        gy, gw, ev = buf.combine(rx.contiguous(), handle=h, topk_weights=rw.float(), num_sms=h.num_sms,
                                 previous_event=buf.capture(), async_with_compute_stream=True,
                                 allocate_on_comm_stream=True)
        ev.current_stream_wait()
        if gw is None or not torch.allclose(gw.cpu(), _summed_weights(cfg, rank, R), rtol=0, atol=1e-6):
            errors.append(f"{tag} megatron backward combine: the probabilities' gradient is not the routed-back sum")

        # SGLang (DeepEPv2Buffer.get_buffer / _DeepEPv2Impl): a fixed cap on every rank
        cap = max(cfg["Ts"]) + 3
        sg = ElasticBuffer(group, num_max_tokens_per_rank=cap, hidden=H, num_topk=K, use_fp8_dispatch=False,
                           allow_hybrid_mode=False, sl_idx=0, prefer_overlap_with_compute=False)
        sms = sg.get_theoretical_num_sms(E, K)
        qps = sg.get_theoretical_num_qps(sms)
        sx, sid, sw, sh, ev = sg.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=cap,
                                          expert_alignment=1, num_sms=sms, num_qps=qps, do_cpu_sync=True,
                                          do_expand=False)
        if ev.event is not None:
            ev.current_stream_wait()
        n = int(sh.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        _check(errors, tag, "sglang contiguous rows", sx[:n], ex)
        _check(errors, tag, "sglang local ids", sid[:n], eid)
        if list(sh.num_recv_tokens_per_expert_list) != [int((eid == e).sum()) for e in range(L)]:
            errors.append(f"{tag} sglang: num_recv_tokens_per_expert_list {sh.num_recv_tokens_per_expert_list}")
        cx, _, ev = sg.combine(sx, handle=sh, topk_weights=sw, num_sms=sms, num_qps=qps)
        if ev.event is not None:
            ev.current_stream_wait()
        if not torch.allclose(cx.cpu().double(), x.cpu().double() * in_rank, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} sglang combine differs from the sum")
        # decode: expanded, no CPU sync (an empty rank is fine here)
        dx, did, dw, dh, _ = sg.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=cap,
                                         expert_alignment=1, num_sms=sms, num_qps=qps, do_cpu_sync=False, do_expand=True)
        psum = dh.psum_num_recv_tokens_per_expert.cpu()
        starts = [0] + psum.tolist()[:-1]
        got_counts = [int(p) - s for p, s in zip(psum.tolist(), starts)]
        if did is not None or dx.shape[0] != R * cap * min(K, L) or got_counts != counts:
            errors.append(f"{tag} sglang decode: ids {did is not None}, {dx.shape[0]} rows, counts {got_counts} want {counts}")
        elif sum(counts):
            _check(errors, tag, "sglang decode rows", dx[:sum(counts)], want_xx)

        # vLLM (DeepEPV2All2AllManager / DeepEPV2PrepareAndFinalize)
        vb = ElasticBuffer(group=group, num_max_tokens_per_rank=cap, hidden=H, num_topk=K, use_fp8_dispatch=False,
                           allow_hybrid_mode=False, prefer_overlap_with_compute=False, allow_multiple_reduction=False,
                           explicitly_destroy=True)
        vb.get_theoretical_num_sms(num_experts=E, num_topk=K)
        px, pid, pw, ph, _ = vb.dispatch(x=x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=None,
                                         do_expand=True, do_cpu_sync=True, async_with_compute_stream=False)
        if pid is not None or pw.dim() != 1 or ph.num_recv_tokens_per_expert_list != counts:
            errors.append(f"{tag} vllm prefill: ids {pid is not None}, weights {tuple(pw.shape)}, list "
                          f"{ph.num_recv_tokens_per_expert_list} want {counts}")
        _check(errors, tag, "vllm prefill rows", px, want_xx)
        vy, _, _ = vb.combine(x=px, handle=ph, topk_weights=None, async_with_compute_stream=False,
                              allocate_on_comm_stream=False)
        slots = torch.stack([(idx.cpu() >= 0) & (idx.cpu() // L == r) for r in range(R)]).sum((0, 2)).double()
        if not torch.allclose(vy.cpu().double(), x.cpu().double() * slots.unsqueeze(1), rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} vllm prefill combine differs from the sum over every slot")
        pow2 = 1 << max(max(cfg["Ts"]) - 1, 0).bit_length()
        qx, qid, _, qh, _ = vb.dispatch(x=x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=pow2,
                                        do_expand=False, do_cpu_sync=False, async_with_compute_stream=False)
        m = int(qh.psum_num_recv_tokens_per_scaleup_rank[-1])
        if qx.shape[0] != R * pow2 or m != ex.shape[0]:
            errors.append(f"{tag} vllm decode: {qx.shape[0]} rows (want {R * pow2}), psum[-1] {m} want {ex.shape[0]}")
        else:
            _check(errors, tag, "vllm decode rows", qx[:m], ex)
        vy2, _, ev = vb.combine(x=qx, handle=qh, topk_weights=None, async_with_compute_stream=True,
                                allocate_on_comm_stream=True)
        ev.current_stream_wait()  # (asynchronous: the caller's stream waits before it reads the rows)
        if not torch.allclose(vy2.cpu().double(), x.cpu().double() * in_rank, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag} vllm decode combine differs from the sum")
        vb.destroy()
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def run_elastic_callers_cases(cfgs: list) -> list:
    return [e for cfg in cfgs for e in run_elastic_callers_case(cfg)]
