"""Benchmark of the normal path: intranode, or internode on virtual nodes with --ranks-per-node
(a script, not a test).

R processes, each with the training shape: T tokens, hidden H, top-K of E experts (uniform
random routing), bf16 and FP8 dispatch, bf16 combine. Rank r runs on GPU r % (GPUs visible):
one process per GPU when there are enough GPUs, else virtual ranks sharing a GPU (run those
under MPS, docs/design.md §5). A gloo group is the control group (barriers, IPC-handle exchange); our
kernels and DeepEP's move the data themselves.

Measured in the same run, at every SM count of --num-sms (a comma list: an SM sweep):
  ours     megatron_ep's cuda backend (public API; phase timings and the notify kernel alone
           through two marked internal hooks, "n/a" when those are missing)
  deepep   DeepEP V1's intranode kernels at the same SM count (`deep_ep.Buffer.set_num_sms`),
           if `deep_ep` imports (built on the GPU machine from a fetched snapshot, never part
           of this repository)
and once (no SM knob: NCCL picks its own channels):
  nccl     what Megatron-core's alltoall dispatcher does (MoEAlltoAllTokenDispatcher, non-fused
           path, no Transformer Engine): one row per (token, expert) pair permuted by expert
           (`moe_utils.permute`: index_select), count all-gather + device-to-host sync,
           `all_to_all_single` of rows and probs, `sort_chunks_by_idxs` into local-expert order;
           combine = the reverse sort, the reverse all-to-all and `unpermute` (bf16 scatter_add_,
           as Megatron does). Also the same all-to-all over the rank-major rows ours and DeepEP
           send (one row per (token, rank) pair), the all-to-alls alone, and FP8-byte variants
           (uint8 rows of H + H/128*4 bytes). Needs one GPU per process (NCCL refuses several
           ranks on one GPU): "skipped (virtual ranks)" otherwise. Uses megatron-core's own
           moe_utils when it imports, else a copy of 0.16.1's non-fused code.
  copy     a plain device copy of the bytes this rank receives (the HBM roofline on one GPU)
  permute  an index_select of the received rows into the expert-major layout
Each op is timed two ways with CUDA events: "us" = median of --iters isolated calls (all ranks
released together by a gloo barrier), "us loop" = mean over --iters calls back to back (the
ops' own handshakes keep the ranks in step). Ops whose input must be refreshed before each call
(zero-copy combine) have only the isolated figure. GB/s is DeepEP's accounting: received rows x
row bytes / loop time (rows from the rank itself included; Megatron's rows for its own ops).

With --ranks-per-node: a "model check" per SM count -- megatron_ep.tools.model's exact per-link bytes
of this run's routing (equal to the bench's own RDMA count and to the rows delivered, or the run
fails), and a time check: per-SM rates of the RDMA hop, the intranode stage and the local reorder,
calibrated on one op's phase marks per direction (bf16 cached rank-major dispatch; rank-major
combine), predict the other ops from the exact rows (FP8, with notify, expert-major), and those
of the first SM count predict the others; plus the SM split if the two copy stages were fused.
Below --ranks the intranode path runs too (its per-SM rate, for context).

Output: a console table per SM count, the NCCL table, baseline checks (the NCCL paths deliver
exactly our rows), and a markdown table for docs/performance.md (--markdown FILE also writes it).

    python3 scripts/bench normal --ranks 2 --num-sms 8,16,24            # 2 GPUs, one rank each
    python3 scripts/bench normal --ranks 4 --num-sms 8,16,24            # one GPU under MPS
    python3 scripts/bench normal --smoke                                # CPU: checks the script
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench import harness  # first: it sets the NCCL environment before torch loads

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_ep as mep  # noqa: E402
from megatron_ep.tools import model as MODEL  # noqa: E402

from bench import baselines, deepep, internals, nccl, normal_report, report  # noqa: E402
from megatron_ep.tools import tracing  # noqa: E402

FULL = dict(ranks=4, tokens=4096, hidden=7168, experts=256, topk=8, alignment=128, iters=25, warmup=5)
SMOKE = dict(ranks=2, tokens=64, hidden=256, experts=16, topk=4, alignment=8, iters=3, warmup=1)


def _sm_list(text: str):
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-sms takes a comma list of integers, got {text!r}")
    if not out or any(v < 0 for v in out):
        raise argparse.ArgumentTypeError(f"--num-sms takes non-negative integers, got {text!r}")
    return out


def parse(argv=None, description=None):
    """The options (`description`: the --help text above them), with the shape's defaults
    filled in (full or --smoke) and checked against each other."""
    p = argparse.ArgumentParser(prog="scripts/bench normal", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, help=f"processes (default {FULL['ranks']}; --smoke {SMOKE['ranks']})")
    p.add_argument("--num-sms", type=_sm_list, default=[24],
                   help="SMs per rank for our kernels and DeepEP's, a comma list for a sweep, e.g. 8,16,24 "
                        f"(0: our analytic default, DeepEP {deepep.DEFAULT_SMS}); NCCL has no SM knob and runs once")
    for name in ("tokens", "hidden", "experts", "topk", "alignment", "iters", "warmup"):
        p.add_argument(f"--{name}", type=int, help=f"default {FULL[name]} (--smoke {SMOKE[name]})")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="our Buffer's ranks_per_node: below --ranks, our path is the two-level internode one on "
                        "virtual nodes (RDMA domain over NVSHMEM, then NVLink inside each node); default: one node")
    p.add_argument("--no-deepep", action="store_true", help="skip DeepEP")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL (Megatron alltoall) baselines")
    report.json_option(p, "write all per-rank figures here", default="")
    p.add_argument("--profile", action="store_true",
                   help="also a per-kernel trace of our ops (torch.profiler): GPU µs per kernel and host µs per call")
    report.markdown_option(p, default="")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run of the script itself: torch reference backend, gloo for the Megatron baseline, "
                        "tiny shape; checks every code path and the baselines' rows, measures nothing meaningful")
    args = p.parse_args(argv)
    for k, v in (SMOKE if args.smoke else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.experts % args.ranks:
        p.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or args.ranks % args.ranks_per_node):
        p.error(f"--ranks-per-node {args.ranks_per_node} must divide --ranks {args.ranks}")
    return args


def node_pairs(idx: torch.Tensor, E: int, nodes: int) -> int:
    """(token, destination node) pairs: the rows a rank sends over the RDMA domain (DeepEP's
    accounting: each token once per distinct node among its experts; its own node included)."""
    valid = idx >= 0
    node = torch.where(valid, idx // (E // nodes), torch.full_like(idx, -1))
    hit = torch.zeros((idx.shape[0], nodes + 1), dtype=torch.bool, device=idx.device)
    hit.scatter_(1, node + 1, True)
    return int(hit[:, 1:].sum())


def phases(buf, timer, fn, setup=None):
    """Median time of each kernel phase of one op, from the events of `megatron_ep.tools.tracing.phases`
    (the gaps include waits for peers and for the host); "(loop)" keys: back to back."""
    samples = {}
    last = []

    def traced():
        with tracing.phases(buf) as marks:
            fn()
        last.append(marks)

    def collect():
        trace = last.pop() if last else None
        last.clear()
        if trace:
            torch.cuda.synchronize()
            for (_, a), (name, b) in zip(trace, trace[1:]):
                samples.setdefault(name, []).append(a.elapsed_time(b) * 1e3)
        if setup is not None:
            setup()

    timer.isolated(traced, setup=collect)
    last.clear()
    out = {k: statistics.median(v) for k, v in samples.items()}
    if setup is not None:
        return out
    samples.clear()
    torch.cuda.synchronize()
    dist.barrier()
    traces = []
    for _ in range(timer.args.iters):
        with tracing.phases(buf) as marks:
            fn()
        traces.append(marks)
    torch.cuda.synchronize()
    for tr in traces:
        for (_, a), (name, b) in zip(tr, tr[1:]):
            samples.setdefault(name + "(loop)", []).append(a.elapsed_time(b) * 1e3)
    out.update({k: statistics.median(v) for k, v in samples.items()})
    return out


# ------------------------------------------------------------------------------------- ours
def our_runs(args, n, inp, timer, out, first, ref):
    """Our backend at `n` SMs per rank; `first`: also the SM-independent baselines; `ref`: a dict
    to fill with our outputs for the baseline checks (None: not needed)."""
    E, R, T, H, K = args.experts, args.ranks, args.tokens, args.hidden, args.topk
    L = E // R
    x, x_fp8, idx, w = inp["x"], inp["x_fp8"], inp["idx"], inp["w"]
    extra = {"ranks_per_node": args.ranks_per_node} if args.ranks_per_node else {}
    buf = mep.Buffer(dist.group.WORLD, backend=inp["backend"], max_tokens_per_rank=T, hidden=H, num_experts=E,
                     max_topk=K, num_sms=n or None, check_inputs=False, **extra)
    t, ph = out["t"], out["phases"]
    try:
        out["num_sms"] = buf.num_sms
        out["push_sms"] = tracing.counters(buf).get("push_sms")
        out["path"] = repr(buf)
        if args.ranks_per_node and args.ranks_per_node < R:
            out["rdma_rows_sent"] = node_pairs(idx, E, R // args.ranks_per_node)
            out["rdma_blocks"] = tracing.counters(buf).get("rdma_blocks")
        if args.ranks_per_node:  # the model's exact count of this rank's routing (rows; summed in the report)
            lc = MODEL.link_count_from(idx, E, R, args.ranks_per_node, dist.get_rank())
            out["links"] = {f: getattr(lc, f) for f in MODEL.LINK_FIELDS}
        rm = buf.dispatch(x, idx, w, num_experts=E)
        em = buf.dispatch(x, idx, w, num_experts=E, permute=True, expert_alignment=args.alignment)
        N, M = rm.x.shape[0], em.x.shape[0]
        out.update(rows_rank_major=N, rows_expert_major=M)
        # keep copies and the handles only: a live rank-major output holds its block of the output
        # pool, and the timed calls would then find no room and stage and pull instead of pushing
        y_rm, y_em, rm_topk = rm.x.clone(), em.x.clone(), rm.topk_idx.clone()
        if ref is not None:
            ref.update(rm_x=rm.x.clone(), em_x=em.x.clone(), em_expert=em.row_expert.clone())
        rm_h, em_h = rm.handle, em.handle
        del rm, em
        t["layout"] = timer(lambda: buf.get_dispatch_layout(idx, E))
        out["pool"] = {}

        def pool_stats():  # the output pool's counters so far, by name (the runtime's order: waits, misses)
            return tracing.counters(buf).get("pool") or None

        def pooled_timer(key, fn):  # the timing, and what the output pool did meanwhile
            before = pool_stats()
            t[key] = timer(fn)
            if before is not None:
                after = pool_stats()
                out["pool"][key] = [after[name] - before[name] for name in before]  # waits, misses

        pooled_timer("dispatch", lambda: buf.dispatch(x, idx, w, num_experts=E))
        pooled_timer("dispatch_cached", lambda: buf.dispatch(x, handle=rm_h))
        pooled_timer("dispatch_fp8_cached", lambda: buf.dispatch(x_fp8, handle=rm_h))
        pooled_timer("dispatch_expert", lambda: buf.dispatch(x, idx, w, num_experts=E, permute=True,
                                                             expert_alignment=args.alignment))
        pooled_timer("dispatch_expert_cached", lambda: buf.dispatch(x, handle=em_h))
        pooled_timer("dispatch_expert_fp8_cached", lambda: buf.dispatch(x_fp8, handle=em_h))
        t["combine"] = timer(lambda: buf.combine(y_rm, rm_h))
        zc = buf.get_combine_input(N, H, device=x.device)
        t["combine_zero_copy"] = timer(lambda: buf.combine(zc, rm_h), setup=lambda: zc.copy_(y_rm))
        del zc  # a live zero-copy view keeps the expert-major push off the combine area (pool or pull then)
        t["combine_expert"] = timer(lambda: buf.combine(y_em, em_h))
        zce = buf.get_combine_input(M, H, device=x.device)
        t["combine_expert_zero_copy"] = timer(lambda: buf.combine(zce, em_h), setup=lambda: zce.copy_(y_em))
        del zce
        if ref is not None:
            ref.update(rm_y=buf.combine(y_rm, rm_h).x.clone(), em_y=buf.combine(y_em, em_h).x.clone())
        notify_run = tracing.notify_only(buf, idx, E)
        notify = (lambda: notify_run(idx.shape[0]), lambda: notify_run(0)) if notify_run else None
        t["notify_kernel"] = internals.guarded(lambda: timer(notify[0])) if notify else None
        t["notify_kernel_T0"] = internals.guarded(lambda: timer(notify[1])) if notify else None
        if notify and x.is_cuda:
            out["gpu_bound"] = {"notify_kernel": harness.gpu_bound(notify[0]),
                                "notify_kernel_T0": harness.gpu_bound(notify[1])}
        traced = buf.backend == "cuda"  # the torch backend has no phase marks
        for key, fn, setup in (
            ("dispatch", lambda: buf.dispatch(x, idx, w, num_experts=E), None),
            ("dispatch_cached", lambda: buf.dispatch(x, handle=rm_h), None),
            ("dispatch_fp8_cached", lambda: buf.dispatch(x_fp8, handle=rm_h), None),
            ("dispatch_expert_cached", lambda: buf.dispatch(x, handle=em_h), None),
            ("dispatch_expert_fp8_cached", lambda: buf.dispatch(x_fp8, handle=em_h), None),
            ("combine", lambda: buf.combine(y_rm, rm_h), None),
            ("combine_expert", lambda: buf.combine(y_em, em_h), None),
        ):
            ph[key] = internals.guarded(lambda: phases(buf, timer, fn, setup)) if traced else None
        if args.profile and x.is_cuda:
            prof = out["profile"]
            for key, fn in (
                ("notify_kernel", notify[0] if notify else None),
                ("dispatch", lambda: buf.dispatch(x, idx, w, num_experts=E)),
                ("dispatch_cached", lambda: buf.dispatch(x, handle=rm_h)),
                ("dispatch_expert", lambda: buf.dispatch(x, idx, w, num_experts=E, permute=True,
                                                         expert_alignment=args.alignment)),
                ("dispatch_expert_cached", lambda: buf.dispatch(x, handle=em_h)),
                ("combine", lambda: buf.combine(y_rm, rm_h)),
                ("combine_expert", lambda: buf.combine(y_em, em_h)),
            ):
                if fn is not None:
                    prof[key] = harness.kernel_profile(fn, args.iters)
        if first is not None:  # SM-independent baselines, once
            baselines.run(timer, y_rm, rm_topk, L, first)
    finally:
        buf.destroy()


def intranode_reference(args, n, inp, timer, out):
    """With --ranks-per-node below --ranks: the intranode path over all ranks at the same SM
    count, in the same run (its per-SM rate, beside the model check's calibrated rates): cached
    rank-major dispatch and combine, bf16."""
    E, T, H, K = args.experts, args.tokens, args.hidden, args.topk
    x, idx, w = inp["x"], inp["idx"], inp["w"]
    buf = mep.Buffer(dist.group.WORLD, backend=inp["backend"], max_tokens_per_rank=T, hidden=H, num_experts=E,
                     max_topk=K, num_sms=n or None, check_inputs=False, ranks_per_node=args.ranks)
    try:
        rm = buf.dispatch(x, idx, w, num_experts=E)
        y = rm.x.clone()
        out["intra_rows"] = rm.x.shape[0]
        out["intra_num_sms"] = buf.num_sms
        handle = rm.handle
        del rm  # the output's pool block free for the timed calls
        out["t"]["intra_dispatch_cached"] = timer(lambda: buf.dispatch(x, handle=handle))
        out["t"]["intra_combine"] = timer(lambda: buf.combine(y, handle))
    finally:
        buf.destroy()


# ----------------------------------------------------------------------------------- driver
def _sm_limit(args, n, cuda):
    """Why `n` SMs per rank cannot run (virtual ranks under MPS need every rank's blocks
    resident at once, docs/design.md §5), or None."""
    if not cuda or n == 0:
        return None
    per_gpu = harness.ranks_per_gpu(args.ranks)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if per_gpu > 1 and per_gpu * n > sms:
        return f"{per_gpu} ranks per GPU x {n} SMs > {sms} SMs: spinning kernels would deadlock under MPS"
    return None


def make_inputs(args, rank, dev, cuda):
    torch.manual_seed(1234 + rank)
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn((T, H), device=dev).to(torch.bfloat16)
    x_fp8 = mep.per_token_cast_to_fp8(x)
    scores = torch.randn((T, E), device=dev).abs() + 1
    idx = torch.topk(scores, K, dim=-1).indices
    w = torch.rand((T, K), device=dev)
    fp8_rows = torch.cat([x_fp8[0].view(torch.uint8), x_fp8[1].contiguous().view(torch.uint8)], dim=1)
    assert fp8_rows.shape[1] == harness.fp8_row_bytes(H)
    return dict(x=x, x_fp8=x_fp8, idx=idx, w=w, fp8_rows=fp8_rows, backend="cuda" if cuda else "torch")


def worker(rank, args, port):
    cuda = not args.smoke
    dev = harness.init_rank(rank, args.ranks, port, cuda, cpu_threads=1)
    inp = make_inputs(args, rank, dev, cuda)
    timer = harness.Timer(args, cuda)
    res = {"rank": rank, "sms": {}, "base": {}, "nccl": {"t": {}, "checks": {}}}
    group, res["nccl"]["status"] = nccl.group(args, cuda)
    ref = {} if group is not None else None
    deep = None
    if args.no_deepep:
        res["deepep_error"] = "disabled (--no-deepep)"
    else:
        deep = deepep.Intranode(args)
        res["deepep_error"], res["deepep_label"] = deep.error, deep.label
        if deep.error:
            deep = None
    for n in args.num_sms:
        out = res["sms"][str(n)] = {"t": {}, "phases": {}, "profile": {}}
        out["skipped"] = _sm_limit(args, n, cuda)
        if out["skipped"]:
            continue
        first = res["base"] if not res["base"] else None
        our_runs(args, n, inp, timer, out, first, ref if ref == {} else None)
        if args.ranks_per_node and args.ranks_per_node < args.ranks:
            intranode_reference(args, n, inp, timer, out)
        if deep is not None:
            out["deepep_skipped"] = _sm_limit(args, n or deepep.DEFAULT_SMS, cuda) or deep.run(n, inp, timer, out["t"])
    if deep is not None:
        deep.close()
    if group is not None:
        nccl.normal_runs(args, inp, timer, group, res["nccl"], ref)
    ref = None
    H = args.hidden
    res["bytes_row_bf16"], res["bytes_row_fp8"] = H * 2, harness.fp8_row_bytes(H)
    res["machine"] = normal_report.machine_line(args, cuda) if rank == 0 else None
    allres = [None] * args.ranks
    dist.all_gather_object(allres, res)
    if rank == 0:
        normal_report.report(args, allres)
    dist.barrier()
    dist.destroy_process_group()


def main(args):
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("scripts/bench normal: no GPU visible (use --smoke for the CPU check of the script)")
    harness.spawn(worker, (args, harness.free_port()), args.ranks)


if __name__ == "__main__":
    main(parse(description=__doc__))
