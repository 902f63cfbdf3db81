"""Benchmark of the intranode normal path (a script, not a test).

R processes share the GPU(s) (virtual ranks on one GPU: run under MPS), each with the training
shape: T tokens, hidden H, top-K of E experts (uniform random routing), bf16 and FP8 dispatch,
bf16 combine. Every figure is the median over --iters timed calls (CUDA events, after --warmup
calls, all ranks released together by a barrier), and is printed beside baselines measured in
the same run:
  copy     a plain device copy of the bytes this rank receives (the HBM roofline on one GPU)
  permute  an index_select of the received rows into the expert-major layout (a separate permute)
  deepep   DeepEP V1's intranode kernels at the same shape and SM count, if `deep_ep` imports
           (built on the GPU machine from a fetched snapshot; never part of this repository)
Bandwidth is DeepEP's accounting: received rows x row bytes / time (rows from the rank itself
included).

    python scripts/bench_normal.py --ranks 4 --num-sms 24
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_ep as mep  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--num-sms", type=int, default=24, help="SMs per rank for our kernels and DeepEP's (0: our default rule)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--alignment", type=int, default=128)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-deepep", action="store_true")
    p.add_argument("--json", default="", help="write all per-rank figures here")
    return p.parse_args()


class Timer:
    """Median of isolated calls (all ranks released together by a barrier before each call),
    and the mean over a back-to-back loop of calls (no barrier between calls: the ops' own
    handshakes keep the ranks in step, as in a training step). Returns (isolated, loop) in us."""

    def __init__(self, args):
        self.args = args

    def __call__(self, fn, setup=None):
        iso = self.isolated(fn, setup)
        if setup is not None:  # ops whose input must be refreshed each call: isolated only
            return iso, iso
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.args.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return iso, start.elapsed_time(end) * 1e3 / self.args.iters

    def isolated(self, fn, setup=None):
        times = []
        for i in range(self.args.warmup + self.args.iters):
            if setup is not None:
                setup()
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if i >= self.args.warmup:
                times.append(start.elapsed_time(end) * 1e3)  # us
        return statistics.median(times)


def phases(buf, timer, fn, setup=None):
    """Median time of each kernel phase of one op, from events the backend records on its
    communication stream (the gaps include waits for peers and for the host)."""
    impl = buf._impl
    samples = {}

    def traced():
        impl.trace = []
        fn()

    def collect():
        if impl.trace:
            torch.cuda.synchronize()
            for (_, a), (name, b) in zip(impl.trace, impl.trace[1:]):
                samples.setdefault(name, []).append(a.elapsed_time(b) * 1e3)
        if setup is not None:
            setup()

    timer.isolated(traced, setup=collect)
    iso = {k: statistics.median(v) for k, v in samples.items()}
    if setup is not None:
        impl.trace = None
        return iso
    # back to back: each call's kernels timed between events, no barrier between calls
    samples.clear()
    torch.cuda.synchronize()
    dist.barrier()
    traces = []
    for _ in range(timer.args.iters):
        impl.trace = []
        fn()
        traces.append(impl.trace)
    torch.cuda.synchronize()
    for tr in traces:
        for (_, a), (name, b) in zip(tr, tr[1:]):
            samples.setdefault(name + "(loop)", []).append(a.elapsed_time(b) * 1e3)
    impl.trace = None
    iso.update({k: statistics.median(v) for k, v in samples.items()})
    return iso


def our_runs(args, x, x_fp8, idx, w, timer, res):
    E, R, T, H, K = args.experts, dist.get_world_size(), args.tokens, args.hidden, args.topk
    L = E // R
    buf = mep.Buffer(dist.group.WORLD, backend="cuda", max_tokens_per_rank=T, hidden=H, num_experts=E, max_topk=K,
                     num_sms=args.num_sms or None, check_inputs=False)
    res["num_sms"] = buf.num_sms
    rm = buf.dispatch(x, idx, w, num_experts=E)
    em = buf.dispatch(x, idx, w, num_experts=E, permute=True, expert_alignment=args.alignment)
    N, M = rm.x.shape[0], em.x.shape[0]
    res.update(rows_rank_major=N, rows_expert_major=M)
    res["dispatch"] = timer(lambda: buf.dispatch(x, idx, w, num_experts=E))
    res["dispatch_cached"] = timer(lambda: buf.dispatch(x, handle=rm.handle))
    res["dispatch_fp8_cached"] = timer(lambda: buf.dispatch(x_fp8, handle=rm.handle))
    res["dispatch_expert"] = timer(lambda: buf.dispatch(x, idx, w, num_experts=E, permute=True, expert_alignment=args.alignment))
    res["dispatch_expert_cached"] = timer(lambda: buf.dispatch(x, handle=em.handle))
    y_rm = rm.x.clone()
    res["combine"] = timer(lambda: buf.combine(y_rm, rm.handle))
    zc = buf.get_combine_input(N, H)
    res["combine_zero_copy"] = timer(lambda: buf.combine(zc, rm.handle), setup=lambda: zc.copy_(y_rm))
    y_em = em.x.clone()
    res["combine_expert"] = timer(lambda: buf.combine(y_em, em.handle))
    zce = buf.get_combine_input(M, H)
    res["combine_expert_zero_copy"] = timer(lambda: buf.combine(zce, em.handle), setup=lambda: zce.copy_(y_em))
    # the notify kernel alone (count exchange + positions), and with no tokens (handshake only)
    impl = buf._impl
    rp, sp, ri = (torch.empty((T, R), dtype=torch.int32, device="cuda"), torch.empty((T, K), dtype=torch.int32, device="cuda"),
                  torch.empty(3 + 3 * L, dtype=torch.int32, device="cuda"))
    res["notify_kernel"] = timer(lambda: impl.rt.notify(idx, E, 1, rp, sp, ri, 0))
    res["notify_kernel_T0"] = timer(lambda: impl.rt.notify(idx[:0], E, 1, rp[:0], sp[:0], ri, 0))
    res["phases_dispatch"] = phases(buf, timer, lambda: buf.dispatch(x, idx, w, num_experts=E))
    res["phases_combine_zero_copy"] = phases(buf, timer, lambda: buf.combine(zc, rm.handle), setup=lambda: zc.copy_(y_rm))
    res["phases_combine"] = phases(buf, timer, lambda: buf.combine(y_rm, rm.handle))
    res["phases_dispatch_cached"] = phases(buf, timer, lambda: buf.dispatch(x, handle=rm.handle))
    res["phases_dispatch_expert_cached"] = phases(buf, timer, lambda: buf.dispatch(x, handle=em.handle))
    # baselines in the same run: the received bytes copied once, and a separate permute
    src, dst = rm.x.clone(), torch.empty_like(rm.x)
    res["copy"] = timer(lambda: dst.copy_(src))
    perm = _expert_major_perm(rm.topk_idx, L)
    res["permute"] = timer(lambda: rm.x.index_select(0, perm))
    buf.destroy()
    return N


def _expert_major_perm(recv_idx, L):
    """Rank-major row of every expert-major row (unpadded), for the separate-permute baseline."""
    rows, slots = (recv_idx >= 0).nonzero(as_tuple=True)
    order = torch.argsort(recv_idx[rows, slots], stable=True)
    return rows[order]


def deepep_runs(args, x, x_fp8, idx, w, timer, res):
    try:
        import deep_ep
    except ImportError as exc:
        res["deepep_error"] = str(exc)
        return
    E, R, H = args.experts, dist.get_world_size(), args.hidden
    buffer = deep_ep.Buffer(dist.group.WORLD, int(2e9), 0, explicitly_destroy=True)
    deep_ep.Buffer.set_num_sms(args.num_sms or 24)
    dcfg, ccfg = deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)
    idx_t = idx.to(deep_ep.topk_idx_t)

    def layout_and_dispatch(inp):
        ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idx_t, E)
        return buffer.dispatch(inp, num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
                               topk_idx=idx_t, topk_weights=w, config=dcfg)

    recv_x, recv_idx, _, _, handle, _ = layout_and_dispatch(x)
    res["deepep_dispatch"] = timer(lambda: layout_and_dispatch(x))
    res["deepep_dispatch_cached"] = timer(lambda: buffer.dispatch(x, handle=handle, config=dcfg))
    res["deepep_dispatch_fp8_cached"] = timer(lambda: buffer.dispatch(x_fp8, handle=handle, config=dcfg))
    perm = _expert_major_perm(recv_idx.long(), E // R)
    res["deepep_dispatch_cached_plus_permute"] = timer(lambda: buffer.dispatch(x, handle=handle, config=dcfg)[0].index_select(0, perm))
    y = recv_x.clone()
    res["deepep_combine"] = timer(lambda: buffer.combine(y, handle, config=ccfg))
    buffer.destroy()


def worker(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(1234 + rank)
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn((T, H), device="cuda").to(torch.bfloat16)
    x_fp8 = mep.per_token_cast_to_fp8(x)
    scores = torch.randn((T, E), device="cuda").abs() + 1
    idx = torch.topk(scores, K, dim=-1).indices
    w = torch.rand((T, K), device="cuda")
    timer = Timer(args)
    res = {"rank": rank}
    N = our_runs(args, x, x_fp8, idx, w, timer, res)
    if not args.no_deepep:
        deepep_runs(args, x, x_fp8, idx, w, timer, res)
    res["bytes_bf16"] = N * H * 2
    res["bytes_fp8"] = N * (H + H // 128 * 4)
    allres = [None] * args.ranks
    dist.all_gather_object(allres, res)
    if rank == 0:
        report(args, allres)
    dist.barrier()
    dist.destroy_process_group()


def report(args, allres):
    R = args.ranks
    mean = lambda k: sum(r[k] for r in allres) / R  # noqa: E731
    mean2 = lambda k, i: sum(r[k][i] for r in allres) / R  # noqa: E731
    have_deepep = "deepep_dispatch" in allres[0]
    print(f"\nbench_normal: {R} ranks x {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}, "
          f"SMs/rank ours {allres[0]['num_sms']} deepep {args.num_sms or 24}; rows/rank rank-major {mean('rows_rank_major'):.0f}, "
          f"expert-major {mean('rows_expert_major'):.0f}; median of {args.iters}")
    if not have_deepep:
        print(f"  (DeepEP not measured: {allres[0].get('deepep_error', 'disabled')})")
    print(f"{'operation':<34}{'us':>9}{'us loop':>9}{'us max':>9}{'GB/s':>7}{'vs copy':>9}{'vs DeepEP':>10}{'(loop)':>8}")
    pairs = [
        ("dispatch", "bytes_bf16", "deepep_dispatch"),
        ("dispatch_cached", "bytes_bf16", "deepep_dispatch_cached"),
        ("dispatch_fp8_cached", "bytes_fp8", "deepep_dispatch_fp8_cached"),
        ("dispatch_expert", "bytes_bf16", None),
        ("dispatch_expert_cached", "bytes_bf16", "deepep_dispatch_cached_plus_permute"),
        ("combine", "bytes_bf16", "deepep_combine"),
        ("combine_zero_copy", "bytes_bf16", "deepep_combine"),
        ("combine_expert", "bytes_bf16", None),
        ("combine_expert_zero_copy", "bytes_bf16", None),
        ("copy", "bytes_bf16", None),
        ("notify_kernel", "bytes_bf16", None),
        ("notify_kernel_T0", "bytes_bf16", None),
        ("permute", "bytes_bf16", None),
    ]
    if have_deepep:
        pairs += [(k, "bytes_bf16", None) for k in ("deepep_dispatch", "deepep_dispatch_cached", "deepep_dispatch_cached_plus_permute", "deepep_combine")]
        pairs += [("deepep_dispatch_fp8_cached", "bytes_fp8", None)]
    for name, bkey, peer in pairs:
        iso, loop = mean2(name, 0), mean2(name, 1)
        gbs = mean(bkey) / loop / 1e3
        vs_copy = loop / mean2("copy", 1)
        ratio = f"{iso / mean2(peer, 0):>9.2f}x{loop / mean2(peer, 1):>7.2f}x" if (peer and have_deepep) else f"{'':>18}"
        print(f"{name:<34}{iso:>9.1f}{loop:>9.1f}{max(r[name][0] for r in allres):>9.1f}{gbs:>7.0f}{vs_copy:>8.2f}x {ratio}")
    for key in ("phases_dispatch", "phases_dispatch_cached", "phases_dispatch_expert_cached", "phases_combine", "phases_combine_zero_copy"):
        names = allres[0][key].keys()
        print(f"  {key[7:]:<24} " + "  ".join(f"{n} {sum(r[key][n] for r in allres) / R:.0f}" for n in names) + " us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": allres}, f, indent=1)


def main():
    args = parse()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
