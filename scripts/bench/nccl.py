"""NCCL baselines: what Megatron-core's alltoall dispatcher does (normal path), plain
all_to_all_single of the same rows, and all_to_all_single of the low-latency path's messages.
NCCL refuses several ranks on one GPU: these need one GPU per process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench import harness
from bench.megatron_ops import moe_ops


def group(args, cuda):
    """(group, label) for the normal path's NCCL baselines, or (None, why not). Collective: every
    rank calls it and takes the same branch."""
    if args.no_nccl:
        return None, "skipped (--no-nccl)"
    if not cuda:
        return dist.group.WORLD, "gloo (CPU smoke run)"
    if torch.cuda.device_count() < args.ranks:
        return None, "skipped (virtual ranks)"
    return dist.new_group(backend="nccl"), "nccl"


def rel_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def normal_runs(args, inp, timer, group, out, ref):
    """Megatron's alltoall dispatcher (dropless, TP 1, non-fused) and plain all-to-alls over
    `group`. Fills out["t"] (timings), out["rows"], out["checks"] (against `ref`)."""
    E, R, T, H, K = args.experts, args.ranks, args.tokens, args.hidden, args.topk
    L, rank = E // R, dist.get_rank()
    x, idx, w, fp8_rows = inp["x"], inp["idx"], inp["w"], inp["fp8_rows"]
    dev, cuda = x.device, x.is_cuda
    label, permute, unpermute, sort_chunks = moe_ops()
    out["megatron_ops"] = label
    t = out["t"]

    def a2a(rows, out_splits, in_splits):
        recv = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(recv, rows, out_splits, in_splits, group=group)
        return recv

    # The router's outputs (not timed): routing map [T, E] bool and dense probs [T, E] fp32.
    routing_map = torch.zeros((T, E), dtype=torch.bool, device=dev).scatter_(1, idx, True)
    probs = torch.zeros((T, E), dtype=torch.float32, device=dev).scatter_(1, idx, w)
    chunk_ids = torch.arange(R * L)
    sort_by_local_expert = chunk_ids.reshape(-1, L).T.ravel()  # MoEAlltoAllTokenDispatcher.__init__
    restore_by_local_expert = chunk_ids.reshape(L, -1).T.ravel()
    host = torch.empty(2 * R + R * L, dtype=torch.long, pin_memory=cuda)
    ready = torch.cuda.Event() if cuda else None

    def meta_start():  # preprocess(): counts, count all-gather, non-blocking device-to-host copy
        per_expert = routing_map.sum(dim=0).long()
        gathered = torch.empty(R * E, dtype=torch.long, device=dev)
        dist.all_gather_into_tensor(gathered, per_expert, group=group)
        per_local = gathered.view(R, E)[:, rank * L:(rank + 1) * L]  # num_global_tokens_per_local_expert
        host.copy_(torch.cat([per_expert.view(R, L).sum(1), per_local.sum(1), per_local.reshape(-1)]), non_blocking=cuda)
        if cuda:
            ready.record()

    def meta_wait():  # the sync before the EP all-to-all
        if cuda:
            ready.synchronize()
        return host[:R].tolist(), host[R:2 * R].tolist(), host[2 * R:]

    def meg_dispatch():  # dispatch_preprocess + token_dispatch + dispatch_postprocess
        meta_start()
        rows, pprobs, _ = permute(x, routing_map, probs, T * K)
        in_s, out_s, per_local = meta_wait()
        recv, rprobs = a2a(rows, out_s, in_s), a2a(pprobs, out_s, in_s)
        if L > 1:
            recv, rprobs = sort_chunks(recv, per_local, sort_by_local_expert, probs=rprobs)
        return recv, rprobs

    meta_start()
    meg_in, meg_out, per_local = meta_wait()
    per_local = per_local.clone()
    _, _, sorted_indices = permute(x, routing_map, probs, T * K)
    restore_splits = per_local.view(R, L).T.ravel()

    def meg_cached(src):  # the same with the routing known: permute, all-to-all, sort by expert
        recv = a2a(src.index_select(0, sorted_indices), meg_out, meg_in)
        return sort_chunks(recv, per_local, sort_by_local_expert)[0] if L > 1 else recv

    y_meg = meg_cached(x)

    def meg_combine():  # combine_preprocess + token_combine + combine_postprocess
        rows = sort_chunks(y_meg, restore_splits, restore_by_local_expert)[0] if L > 1 else y_meg
        return unpermute(a2a(rows, meg_in, meg_out), sorted_indices, torch.Size((T, H)))

    # Rank-major rows (what ours and DeepEP send): one row per (token, destination rank), by
    # destination rank then token; the receiver gets them by source rank then token.
    ranks = torch.arange(R, device=dev)
    dst = torch.where(idx >= 0, idx.div(L, rounding_mode="floor"), -1)

    def rm_layout():
        in_rank = (dst.unsqueeze(-1) == ranks).any(dim=1)  # [T, R]
        send = in_rank.sum(dim=0)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        counts = torch.cat([send, recv]).tolist()  # device-to-host sync
        return counts[:R], counts[R:], in_rank.t().nonzero(as_tuple=True)[1]

    def rm_dispatch():  # layout, count exchange, permute, rows + local top-k ids + weights
        in_s, out_s, tok = rm_layout()
        recv = a2a(x.index_select(0, tok), out_s, in_s)
        ids, wts = a2a(idx.index_select(0, tok), out_s, in_s), a2a(w.index_select(0, tok), out_s, in_s)
        ids = torch.where(ids.div(L, rounding_mode="floor") == rank, ids - rank * L, -1)
        return recv, ids, wts

    rm_in, rm_out, send_tok = rm_layout()
    y_rm = a2a(x.index_select(0, send_tok), rm_out, rm_in)

    def rm_combine():  # the reverse all-to-all, then the sum per token in fp32
        back = a2a(y_rm, rm_in, rm_out)
        acc = torch.zeros((T, H), dtype=torch.float32, device=dev)
        return acc.index_add_(0, send_tok, back.float()).to(x.dtype)

    out["rows"] = dict(megatron=sum(meg_out), rank_major=sum(rm_out))
    meg_rows, meg_rows8 = x.index_select(0, sorted_indices), fp8_rows.index_select(0, sorted_indices)
    rm_rows, rm_rows8 = x.index_select(0, send_tok), fp8_rows.index_select(0, send_tok)
    t["meg_meta"] = timer(lambda: (meta_start(), meta_wait()))
    t["meg_dispatch"] = timer(meg_dispatch)
    t["meg_dispatch_cached"] = timer(lambda: meg_cached(x))
    t["meg_dispatch_fp8_cached"] = timer(lambda: meg_cached(fp8_rows))
    t["meg_combine"] = timer(meg_combine)
    t["meg_a2a"] = timer(lambda: a2a(meg_rows, meg_out, meg_in))
    t["meg_a2a_fp8"] = timer(lambda: a2a(meg_rows8, meg_out, meg_in))
    t["rm_dispatch"] = timer(rm_dispatch)
    t["rm_dispatch_cached"] = timer(lambda: a2a(x.index_select(0, send_tok), rm_out, rm_in))
    t["rm_dispatch_fp8_cached"] = timer(lambda: a2a(fp8_rows.index_select(0, send_tok), rm_out, rm_in))
    t["rm_combine"] = timer(rm_combine)
    t["rm_a2a"] = timer(lambda: a2a(rm_rows, rm_out, rm_in))
    t["rm_a2a_fp8"] = timer(lambda: a2a(rm_rows8, rm_out, rm_in))

    if ref:  # the baselines deliver exactly our rows; their combines match ours
        c = out["checks"]
        em_rows = ref["em_x"][ref["em_expert"] >= 0]
        c["rank_major_rows_equal_ours"] = bool(torch.equal(y_rm, ref["rm_x"]))
        c["megatron_rows_equal_ours_expert_major"] = bool(torch.equal(meg_dispatch()[0], em_rows))
        c["rank_major_combine_max_rel_diff"] = rel_diff(rm_combine(), ref["rm_y"])
        c["megatron_combine_max_rel_diff"] = rel_diff(meg_combine(), ref["em_y"])  # bf16 scatter_add_ vs fp32


def low_latency_runs(a, T, x, idx, w, E, K, H, nccl):
    """all_to_all_single of the low-latency path's messages over `nccl`: one message of
    harness.msg_bytes per valid (token, expert) out, 2H bf16 bytes back, splits known in
    advance; eager loops of --loop / 4 calls (µs per call)."""
    R = dist.get_world_size(nccl)
    L = E // R
    msg = harness.msg_bytes(H, a.fp8)
    dst = idx[idx >= 0] // L
    send = torch.bincount(dst, minlength=R)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=nccl)
    send, recv = send.tolist(), recv.tolist()
    d_in = torch.empty((sum(send), msg), dtype=torch.uint8, device=x.device)
    d_out = torch.empty((sum(recv), msg), dtype=torch.uint8, device=x.device)
    c_in = torch.empty((sum(recv), H), dtype=torch.bfloat16, device=x.device)
    c_out = torch.empty((sum(send), H), dtype=torch.bfloat16, device=x.device)
    loop = max(1, a.loop // 4)

    def d():
        for _ in range(loop):
            dist.all_to_all_single(d_out, d_in, recv, send, group=nccl)

    def c():
        for _ in range(loop):
            dist.all_to_all_single(c_out, c_in, send, recv, group=nccl)

    def dc():
        for _ in range(loop):
            dist.all_to_all_single(d_out, d_in, recv, send, group=nccl)
            dist.all_to_all_single(c_out, c_in, send, recv, group=nccl)

    return {name: harness.median_us(fn, a.reps, 2) / loop for name, fn in (("dispatch", d), ("combine", c), ("both", dc))}
