"""Benchmark of the intranode normal path (a script, not a test).

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

With --ranks-per-node: a "model check" per SM count -- megatron_ep.model's exact per-link bytes
of this run's routing (equal to the bench's own RDMA count and to the rows delivered, or the run
fails), and a time check: per-SM rates of the RDMA hop, the in-node stage and the local reorder,
calibrated on one op's phase marks per direction (bf16 cached rank-major dispatch; rank-major
combine), predict the other ops from the exact rows (FP8, with notify, expert-major), and those
of the first SM count predict the others; plus the SM split if the two copy stages were fused.
Below --ranks the intranode path runs too (its per-SM rate, for context).

Output: a console table per SM count, the NCCL table, baseline checks (the NCCL paths deliver
exactly our rows), and a markdown table for docs/performance.md (--markdown FILE also writes it).

    python3 scripts/bench_normal.py --ranks 2 --num-sms 8,16,24            # 2 GPUs, one rank each
    python3 scripts/bench_normal.py --ranks 4 --num-sms 8,16,24            # one GPU under MPS
    python3 scripts/bench_normal.py --smoke                                # CPU: checks the script
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time

# NVLink SHARP (NVLS) multicast is unavailable on the GPU machines; NCCL must not try it.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import megatron_ep as mep  # noqa: E402
from megatron_ep import model as MODEL  # noqa: E402

FULL = dict(ranks=4, tokens=4096, hidden=7168, experts=256, topk=8, alignment=128, iters=25, warmup=5)
SMOKE = dict(ranks=2, tokens=64, hidden=256, experts=16, topk=4, alignment=8, iters=3, warmup=1)
DEEPEP_DEFAULT_SMS = 24  # DeepEP's SM count when --num-sms has 0 (our analytic default)


def _sm_list(text: str):
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--num-sms takes a comma list of integers, got {text!r}")
    if not out or any(v < 0 for v in out):
        raise argparse.ArgumentTypeError(f"--num-sms takes non-negative integers, got {text!r}")
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, help=f"processes (default {FULL['ranks']}; --smoke {SMOKE['ranks']})")
    p.add_argument("--num-sms", type=_sm_list, default=[24],
                   help="SMs per rank for our kernels and DeepEP's, a comma list for a sweep, e.g. 8,16,24 "
                        f"(0: our analytic default, DeepEP {DEEPEP_DEFAULT_SMS}); NCCL has no SM knob and runs once")
    for name in ("tokens", "hidden", "experts", "topk", "alignment", "iters", "warmup"):
        p.add_argument(f"--{name}", type=int, help=f"default {FULL[name]} (--smoke {SMOKE[name]})")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="our Buffer's ranks_per_node: below --ranks, our path is the two-level internode one on "
                        "virtual nodes (RDMA domain over NVSHMEM, then NVLink inside each node); default: one node")
    p.add_argument("--no-deepep", action="store_true", help="skip DeepEP")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL (Megatron alltoall) baselines")
    p.add_argument("--json", default="", help="write all per-rank figures here")
    p.add_argument("--profile", action="store_true",
                   help="also a per-kernel trace of our ops (torch.profiler): GPU µs per kernel and host µs per call")
    p.add_argument("--markdown", default="", help="also write the markdown table here")
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


# ------------------------------------------------------------------------------------ timing
class Timer:
    """(isolated median, loop mean, loop measured) in us for one op; CUDA events on GPUs,
    perf_counter in the CPU smoke run."""

    def __init__(self, args, cuda: bool):
        self.args, self.cuda = args, cuda

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def us(self, a, b) -> float:
        return a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6

    def __call__(self, fn, setup=None):
        iso = self.isolated(fn, setup)
        if setup is not None:  # ops whose input must be refreshed each call: isolated only
            return (iso, iso, False)
        self.sync()
        dist.barrier()
        a = self.mark()
        for _ in range(self.args.iters):
            fn()
        b = self.mark()
        self.sync()
        return (iso, self.us(a, b) / self.args.iters, True)

    def isolated(self, fn, setup=None):
        times = []
        for i in range(self.args.warmup + self.args.iters):
            if setup is not None:
                setup()
            self.sync()
            dist.barrier()
            a = self.mark()
            fn()
            b = self.mark()
            self.sync()
            if i >= self.args.warmup:
                times.append(self.us(a, b))
        return statistics.median(times)


def guarded(call):
    """For measurements through megatron_ep internals: None ("n/a") if the hook no longer fits."""
    try:
        return call()
    except (AttributeError, TypeError, KeyError, RuntimeError) as exc:
        print(f"[rank {dist.get_rank()}] internal hook failed, reported as n/a: {type(exc).__name__}: {exc}", flush=True)
        return None


# ----------------------------------------------------------------- megatron_ep internals
# INTERNAL ACCESS. The two functions below are the only places this script touches
# megatron_ep's internals (the runtime is being refactored). Each returns None when what it
# needs is missing; the report then says "n/a". Everything else uses the public API.
def _internal_tracer(buf):
    """INTERNAL: `buf._impl.rt.trace` -- while it is a list, the cuda runtime appends (phase
    name, CUDA event) pairs recorded on its communication stream. Returns begin()/end() or None."""
    rt = getattr(getattr(buf, "_impl", None), "rt", None)
    if rt is None or not hasattr(rt, "trace"):
        return None

    class Tracer:
        def begin(self):
            rt.trace = []

        def end(self):
            trace, rt.trace = rt.trace, None
            return trace or []

    return Tracer()


def _internal_pool_stats(buf):
    """INTERNAL: `buf._impl.rt.rt.pool_stats()` -- the output pool's (GPU-side waits, host waits,
    misses) so far (csrc/pool.h), or None when missing."""
    rt = getattr(getattr(getattr(buf, "_impl", None), "rt", None), "rt", None)
    return getattr(rt, "pool_stats", None)


def _internal_rdma_blocks(buf):
    """INTERNAL: `buf._impl.path.num_blocks` -- the blocks the internode path's RDMA-domain
    kernels run on (None when missing, or on another path)."""
    n = getattr(getattr(getattr(buf, "_impl", None), "path", None), "num_blocks", None)
    return int(n) if isinstance(n, int) else None


def _internal_notify(buf, idx, num_experts, num_ranks):
    """INTERNAL: the intranode notify kernels alone (chunk counts, the call exchange, row
    positions), launched as a dispatch call of `buf` would (its own sequence number and
    signature), on the buffer's communication stream. Returns (with T tokens, with no tokens)
    callables, or None."""
    impl = getattr(buf, "_impl", None)
    path, rt = getattr(impl, "path", None), getattr(impl, "rt", None)
    if path is None or rt is None or not hasattr(path, "kernels"):
        return None
    from megatron_ep import protocol as P

    T, K = idx.shape
    L = num_experts // num_ranks
    rp = torch.empty((T, num_ranks), dtype=torch.int32, device=idx.device)
    sp = torch.empty((T, K), dtype=torch.int32, device=idx.device)
    ri = torch.empty(P.RECV_INFO["header"] + 3 * L, dtype=torch.int32, device=idx.device)
    limits = torch.empty(num_ranks, dtype=torch.int32, device=idx.device)
    tpe = torch.empty(L, dtype=torch.int64, device=idx.device)
    dropped = torch.empty((), dtype=torch.int64, device=idx.device)

    def run(t):
        buf._seq += 1
        call = P.Call(P.OP["dispatch"], buf._seq).set(topk=K, num_experts=num_experts, expert_alignment=1)
        rt.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(rt.stream):
            path.kernels.notify(rt.rt, call.sig, idx[:t], num_experts, 1, False, 0, rp[:t], sp[:t], ri, limits, tpe,
                                dropped, 0)
        torch.cuda.current_stream().wait_stream(rt.stream)

    return (lambda: run(T), lambda: run(0))


def phases(tracer, timer, fn, setup=None):
    """Median time of each kernel phase of one op, from the events of `_internal_tracer` (the
    gaps include waits for peers and for the host); "(loop)" keys: back to back."""
    samples = {}

    def traced():
        tracer.begin()
        fn()

    def collect():
        trace = tracer.end()
        if trace:
            torch.cuda.synchronize()
            for (_, a), (name, b) in zip(trace, trace[1:]):
                samples.setdefault(name, []).append(a.elapsed_time(b) * 1e3)
        if setup is not None:
            setup()

    timer.isolated(traced, setup=collect)
    tracer.end()
    out = {k: statistics.median(v) for k, v in samples.items()}
    if setup is not None:
        return out
    samples.clear()
    torch.cuda.synchronize()
    dist.barrier()
    traces = []
    for _ in range(timer.args.iters):
        tracer.begin()
        fn()
        traces.append(tracer.end())
    torch.cuda.synchronize()
    for tr in traces:
        for (_, a), (name, b) in zip(tr, tr[1:]):
            samples.setdefault(name + "(loop)", []).append(a.elapsed_time(b) * 1e3)
    out.update({k: statistics.median(v) for k, v in samples.items()})
    return out


def gpu_bound(fn, n=25):
    """µs per call of `fn` when the GPU, not the host, sets the pace: a sleep kernel holds the
    stream while the host queues n calls, which then run back to back (ranks start together,
    so a handshake waits for the peer's kernel, not for the peer's host)."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(20_000_000)  # ~10 ms at ~2 GHz: longer than queueing n calls
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def kernel_profile(fn, iters):
    """Per-kernel trace of `fn` called back to back (torch.profiler, CUPTI): GPU µs per call of
    each kernel, and the host's µs per call (wall time of the loop without a sync inside: where
    the host is slower than the GPU, this is what a loop of calls costs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host = (time.perf_counter() - t0) / iters * 1e6
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA and e.count:
            total = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            kernels[e.key[:60]] = (total / iters, e.count / iters)
    dist.barrier()
    return {"host_us_per_call": host, "kernels": kernels}


# ------------------------------------------------------------------------------------- ours
def _expert_major_perm(recv_idx, L):
    """Rank-major row of every expert-major row (unpadded): the separate-permute baselines."""
    rows, slots = (recv_idx >= 0).nonzero(as_tuple=True)
    order = torch.argsort(recv_idx[rows, slots], stable=True)
    return rows[order]


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
        rt = getattr(getattr(buf, "_impl", None), "rt", None)  # INTERNAL: the push kernel's own SM cap
        out["push_sms"] = getattr(rt, "push_sms", None)
        out["path"] = repr(buf)
        if args.ranks_per_node and args.ranks_per_node < R:
            out["rdma_rows_sent"] = node_pairs(idx, E, R // args.ranks_per_node)
            out["rdma_blocks"] = _internal_rdma_blocks(buf)
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
        pool_stats, out["pool"] = _internal_pool_stats(buf), {}

        def pooled_timer(key, fn):  # the timing, and what the output pool did meanwhile
            before = pool_stats() if pool_stats else None
            t[key] = timer(fn)
            if before is not None:
                out["pool"][key] = [b - a for a, b in zip(before, pool_stats())]

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
        notify = _internal_notify(buf, idx, E, R)
        t["notify_kernel"] = guarded(lambda: timer(notify[0])) if notify else None
        t["notify_kernel_T0"] = guarded(lambda: timer(notify[1])) if notify else None
        if notify and x.is_cuda:
            out["gpu_bound"] = {"notify_kernel": gpu_bound(notify[0]), "notify_kernel_T0": gpu_bound(notify[1])}
        tracer = _internal_tracer(buf)
        for key, fn, setup in (
            ("dispatch", lambda: buf.dispatch(x, idx, w, num_experts=E), None),
            ("dispatch_cached", lambda: buf.dispatch(x, handle=rm_h), None),
            ("dispatch_fp8_cached", lambda: buf.dispatch(x_fp8, handle=rm_h), None),
            ("dispatch_expert_cached", lambda: buf.dispatch(x, handle=em_h), None),
            ("dispatch_expert_fp8_cached", lambda: buf.dispatch(x_fp8, handle=em_h), None),
            ("combine", lambda: buf.combine(y_rm, rm_h), None),
            ("combine_expert", lambda: buf.combine(y_em, em_h), None),
        ):
            ph[key] = guarded(lambda: phases(tracer, timer, fn, setup)) if tracer is not None else None
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
                    prof[key] = kernel_profile(fn, args.iters)
        if first is not None:  # SM-independent baselines, once
            src, dst = y_rm.clone(), torch.empty_like(y_rm)
            first["copy"] = timer(lambda: dst.copy_(src))
            perm = _expert_major_perm(rm_topk, L)
            first["permute"] = timer(lambda: y_rm.index_select(0, perm))
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


# ----------------------------------------------------------------------------------- DeepEP
class DeepEP:
    """DeepEP V1 intranode: one buffer for the whole sweep, `set_num_sms` per SM count."""

    def __init__(self, args):
        self.args, self.error, self.buffer, self.label = args, None, None, None
        try:
            import deep_ep
        except ImportError as exc:
            self.error = f"deep_ep not importable: {exc}"
            return
        self.deep_ep = deep_ep
        self.label = os.environ.get("MEP_DEEPEP_LABEL") or self._describe(deep_ep)
        try:
            self.buffer = deep_ep.Buffer(dist.group.WORLD, int(2e9), 0, explicitly_destroy=True)
        except Exception as exc:  # noqa: BLE001  (reported, the rest of the run goes on)
            self.error = f"deep_ep.Buffer failed: {type(exc).__name__}: {exc}"

    @staticmethod
    def _describe(deep_ep) -> str:
        """Where the package lives and, if its build left one, the commit in a DEEPEP_COMMIT file
        at the root of its source tree (MEP_DEEPEP_LABEL overrides)."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(deep_ep.__file__)))
        try:
            with open(os.path.join(root, "DEEPEP_COMMIT")) as f:
                commit = f.read().strip()[:12]
        except OSError:
            commit = "unknown"
        return f"DeepEP V1 from {root} (commit {commit})"

    def run(self, n, inp, timer, t):
        deep_ep, buffer = self.deep_ep, self.buffer
        E, R = self.args.experts, self.args.ranks
        L = E // R
        sms = n or DEEPEP_DEFAULT_SMS
        if sms % 2:
            return f"DeepEP needs an even SM count, got {sms}"
        deep_ep.Buffer.set_num_sms(sms)
        dcfg, ccfg = deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)
        x, x_fp8, w = inp["x"], inp["x_fp8"], inp["w"]
        idx = inp["idx"].to(getattr(deep_ep, "topk_idx_t", torch.int64))

        def layout_and_dispatch(data):
            ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idx, E)
            return buffer.dispatch(data, num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
                                   topk_idx=idx, topk_weights=w, config=dcfg)

        def full_plus_permute():
            recv_x, recv_idx = layout_and_dispatch(x)[:2]
            return recv_x.index_select(0, _expert_major_perm(recv_idx, L))

        recv_x, recv_idx, _, _, handle, _ = layout_and_dispatch(x)
        perm = _expert_major_perm(recv_idx, L)

        def fp8_cached_plus_permute():
            rx, rs = buffer.dispatch(x_fp8, handle=handle, config=dcfg)[0]
            return rx.index_select(0, perm), rs.index_select(0, perm)

        y = recv_x.clone()
        y_expert = recv_x.index_select(0, perm)  # expert-major rows as the experts return them

        def unpermute_plus_combine():  # a manager's unpermute (sum per received row), then combine
            rows = torch.zeros_like(y).index_add_(0, perm, y_expert)
            return buffer.combine(rows, handle, config=ccfg)

        t["deepep_layout"] = timer(lambda: buffer.get_dispatch_layout(idx, E))
        t["deepep_dispatch"] = timer(lambda: layout_and_dispatch(x))
        t["deepep_dispatch_plus_permute"] = timer(full_plus_permute)
        t["deepep_dispatch_cached"] = timer(lambda: buffer.dispatch(x, handle=handle, config=dcfg))
        t["deepep_dispatch_fp8_cached"] = timer(lambda: buffer.dispatch(x_fp8, handle=handle, config=dcfg))
        t["deepep_dispatch_cached_plus_permute"] = timer(
            lambda: buffer.dispatch(x, handle=handle, config=dcfg)[0].index_select(0, perm))
        t["deepep_dispatch_fp8_cached_plus_permute"] = timer(fp8_cached_plus_permute)
        t["deepep_combine"] = timer(lambda: buffer.combine(y, handle, config=ccfg))
        t["deepep_unpermute_plus_combine"] = timer(unpermute_plus_combine)
        return None

    def close(self):
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None


# --------------------------------------------------------------- NCCL: Megatron's alltoall
def _megatron_moe_ops():
    """(label, permute, unpermute, sort_chunks): megatron-core's own moe_utils functions on
    their non-fused path when megatron-core imports, else a copy of 0.16.1's non-fused code."""
    try:
        import megatron.core as mc
        from megatron.core.transformer.moe import moe_utils as mu

        def permute(tokens, routing_map, probs, num_out):
            out = mu.permute(tokens, routing_map, probs=probs, num_out_tokens=num_out, fused=False)
            return out[0], out[1], out[2]  # 0.16: 3 values, later: 5

        def unpermute(rows, sorted_indices, shape):
            return mu.unpermute(rows, sorted_indices, restore_shape=shape, fused=False)

        def sort_chunks(rows, split_sizes, sorted_idxs, probs=None):
            return mu.sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs=probs, fused=False)

        return f"megatron-core {mc.__version__} moe_utils, non-fused", permute, unpermute, sort_chunks
    except Exception as exc:  # noqa: BLE001  (not installed, or broken without its extras)
        why = f"{type(exc).__name__}"

    def permute(tokens, routing_map, probs, num_out):  # moe_utils.permute, dropless, non-fused
        num_tokens, num_experts = tokens.shape[0], routing_map.shape[1]
        routing_map = routing_map.bool().T.contiguous()
        token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
        sorted_indices = token_indices.masked_select(routing_map)
        permuted_probs = probs.T.contiguous().masked_select(routing_map) if probs is not None else None
        return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices

    def unpermute(rows, sorted_indices, shape):  # moe_utils.unpermute, no probs, non-deterministic mode
        out = torch.zeros(shape, dtype=rows.dtype, device=rows.device)
        out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, shape[1]), rows)
        return out

    def sort_chunks(rows, split_sizes, sorted_idxs, probs=None):  # moe_utils.sort_chunks_by_idxs
        parts = torch.split(rows, split_sizes.tolist(), dim=0)
        out = torch.cat([parts[i] for i in sorted_idxs.tolist()], dim=0)
        if probs is not None:
            pparts = torch.split(probs, split_sizes.tolist(), dim=0)
            probs = torch.cat([pparts[i] for i in sorted_idxs.tolist()], dim=0)
        return out, probs

    return f"copy of megatron-core 0.16.1 moe_utils, non-fused (megatron-core: {why})", permute, unpermute, sort_chunks


def nccl_runs(args, inp, timer, group, out, ref):
    """Megatron's alltoall dispatcher (dropless, TP 1, non-fused) and plain all-to-alls over
    `group`. Fills out["t"] (timings), out["rows"], out["checks"] (against `ref`)."""
    E, R, T, H, K = args.experts, args.ranks, args.tokens, args.hidden, args.topk
    L, rank = E // R, dist.get_rank()
    x, idx, w, fp8_rows = inp["x"], inp["idx"], inp["w"], inp["fp8_rows"]
    dev, cuda = x.device, x.is_cuda
    label, permute, unpermute, sort_chunks = _megatron_moe_ops()
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
        c["rank_major_combine_max_rel_diff"] = _rel_diff(rm_combine(), ref["rm_y"])
        c["megatron_combine_max_rel_diff"] = _rel_diff(meg_combine(), ref["em_y"])  # bf16 scatter_add_ vs fp32


def _rel_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


# ----------------------------------------------------------------------------------- driver
def _gpus_used(args) -> int:
    return min(args.ranks, torch.cuda.device_count())


def _sm_limit(args, n, cuda):
    """Why `n` SMs per rank cannot run (virtual ranks under MPS need every rank's blocks
    resident at once, docs/design.md §5), or None."""
    if not cuda or n == 0:
        return None
    per_gpu = math.ceil(args.ranks / _gpus_used(args))
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if per_gpu > 1 and per_gpu * n > sms:
        return f"{per_gpu} ranks per GPU x {n} SMs > {sms} SMs: spinning kernels would deadlock under MPS"
    return None


def _nccl_group(args, cuda):
    """(group, label) for the Megatron baseline, or (None, why not). Collective: every rank
    calls it and takes the same branch."""
    if args.no_nccl:
        return None, "skipped (--no-nccl)"
    if not cuda:
        return dist.group.WORLD, "gloo (CPU smoke run)"
    if torch.cuda.device_count() < args.ranks:
        return None, "skipped (virtual ranks)"
    return dist.new_group(backend="nccl"), "nccl"


def make_inputs(args, rank, dev, cuda):
    torch.manual_seed(1234 + rank)
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn((T, H), device=dev).to(torch.bfloat16)
    x_fp8 = mep.per_token_cast_to_fp8(x)
    scores = torch.randn((T, E), device=dev).abs() + 1
    idx = torch.topk(scores, K, dim=-1).indices
    w = torch.rand((T, K), device=dev)
    fp8_rows = torch.cat([x_fp8[0].view(torch.uint8), x_fp8[1].contiguous().view(torch.uint8)], dim=1)
    assert fp8_rows.shape[1] == H + H // 128 * 4
    return dict(x=x, x_fp8=x_fp8, idx=idx, w=w, fp8_rows=fp8_rows, backend="cuda" if cuda else "torch")


def worker(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    inp = make_inputs(args, rank, dev, cuda)
    timer = Timer(args, cuda)
    res = {"rank": rank, "sms": {}, "base": {}, "nccl": {"t": {}, "checks": {}}}
    group, res["nccl"]["status"] = _nccl_group(args, cuda)
    ref = {} if group is not None else None
    deepep = None
    if args.no_deepep:
        res["deepep_error"] = "disabled (--no-deepep)"
    else:
        deepep = DeepEP(args)
        res["deepep_error"], res["deepep_label"] = deepep.error, deepep.label
        if deepep.error:
            deepep = None
    for n in args.num_sms:
        out = res["sms"][str(n)] = {"t": {}, "phases": {}, "profile": {}}
        out["skipped"] = _sm_limit(args, n, cuda)
        if out["skipped"]:
            continue
        first = res["base"] if not res["base"] else None
        our_runs(args, n, inp, timer, out, first, ref if ref == {} else None)
        if args.ranks_per_node and args.ranks_per_node < args.ranks:
            intranode_reference(args, n, inp, timer, out)
        if deepep is not None:
            out["deepep_skipped"] = _sm_limit(args, n or DEEPEP_DEFAULT_SMS, cuda) or deepep.run(n, inp, timer, out["t"])
    if deepep is not None:
        deepep.close()
    if group is not None:
        nccl_runs(args, inp, timer, group, res["nccl"], ref)
    ref = None
    H = args.hidden
    res["bytes_row_bf16"], res["bytes_row_fp8"] = H * 2, H + H // 128 * 4
    res["machine"] = machine_line(args, cuda) if rank == 0 else None
    allres = [None] * args.ranks
    dist.all_gather_object(allres, res)
    if rank == 0:
        report(args, allres)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------- report
def _mps_running() -> bool:
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def machine_line(args, cuda) -> str:
    R = args.ranks
    if not cuda:
        return (f"CPU smoke run: {os.cpu_count()} cores, {R} processes, gloo, torch reference backend; "
                f"torch {torch.__version__}")
    used, visible = _gpus_used(args), torch.cuda.device_count()
    per_gpu = math.ceil(R / used)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        nccl = "?"
    share = "one process per GPU" if per_gpu == 1 else \
        f"{per_gpu} processes per GPU (virtual ranks, {'under MPS' if _mps_running() else 'MPS control pipe NOT found'})"
    return (f"{used} x {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
            f"{visible} visible), {R} processes, {share}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"NCCL {nccl}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")


def _code_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10)
        if rev.returncode == 0:
            return rev.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        pass
    return "unknown (no git metadata)"


def _mean_over_ranks(allres, get):
    """(isolated, loop, max isolated, loop measured) over ranks, or None if any rank lacks it."""
    vals = [get(r) for r in allres]
    if any(v is None for v in vals):
        return None
    R = len(vals)
    return (sum(v[0] for v in vals) / R, sum(v[1] for v in vals) / R, max(v[0] for v in vals), all(v[2] for v in vals))


OUR_ROWS = [  # (key, bytes per row, peer key for the ratio)
    ("layout", None, "deepep_layout"),
    ("dispatch", "bf16", "deepep_dispatch"),
    ("dispatch_cached", "bf16", "deepep_dispatch_cached"),
    ("dispatch_fp8_cached", "fp8", "deepep_dispatch_fp8_cached"),
    ("dispatch_expert", "bf16", "deepep_dispatch_plus_permute"),
    ("dispatch_expert_cached", "bf16", "deepep_dispatch_cached_plus_permute"),
    ("dispatch_expert_fp8_cached", "fp8", "deepep_dispatch_fp8_cached_plus_permute"),
    ("combine", "bf16", "deepep_combine"),
    ("combine_zero_copy", "bf16", "deepep_combine"),
    ("combine_expert", "bf16", "deepep_unpermute_plus_combine"),
    ("combine_expert_zero_copy", "bf16", "deepep_unpermute_plus_combine"),
    ("notify_kernel", None, None),
    ("notify_kernel_T0", None, None),
]
DEEPEP_ROWS = [("deepep_layout", None), ("deepep_dispatch", "bf16"), ("deepep_dispatch_plus_permute", "bf16"),
               ("deepep_dispatch_cached", "bf16"), ("deepep_dispatch_fp8_cached", "fp8"),
               ("deepep_dispatch_cached_plus_permute", "bf16"), ("deepep_dispatch_fp8_cached_plus_permute", "fp8"),
               ("deepep_combine", "bf16"), ("deepep_unpermute_plus_combine", "bf16")]
NCCL_ROWS = [  # (key, rows kind, bytes per row)
    ("meg_meta", None, None), ("meg_dispatch", "megatron", "bf16"), ("meg_dispatch_cached", "megatron", "bf16"),
    ("meg_dispatch_fp8_cached", "megatron", "fp8"), ("meg_combine", "megatron", "bf16"),
    ("meg_a2a", "megatron", "bf16"), ("meg_a2a_fp8", "megatron", "fp8"),
    ("rm_dispatch", "rank_major", "bf16"), ("rm_dispatch_cached", "rank_major", "bf16"),
    ("rm_dispatch_fp8_cached", "rank_major", "fp8"), ("rm_combine", "rank_major", "bf16"),
    ("rm_a2a", "rank_major", "bf16"), ("rm_a2a_fp8", "rank_major", "fp8"),
]
# markdown rows: (label, ours key, DeepEP key, NCCL key)
MD_ROWS = [
    ("layout kernel", "layout", "deepep_layout", None),
    ("notify kernel alone (count exchange + positions) [1]", "notify_kernel", None, "meg_meta"),
    ("dispatch incl. notify, rank-major [2]", "dispatch", "deepep_dispatch", "rm_dispatch"),
    ("cached dispatch, rank-major", "dispatch_cached", "deepep_dispatch_cached", "rm_dispatch_cached"),
    ("FP8 cached dispatch, rank-major", "dispatch_fp8_cached", "deepep_dispatch_fp8_cached", "rm_dispatch_fp8_cached"),
    ("expert-major dispatch incl. notify [3]", "dispatch_expert", "deepep_dispatch_plus_permute", "meg_dispatch"),
    ("expert-major cached dispatch (ours: fused permute) [3]", "dispatch_expert_cached",
     "deepep_dispatch_cached_plus_permute", "meg_dispatch_cached"),
    ("FP8 expert-major cached dispatch [3]", "dispatch_expert_fp8_cached", "deepep_dispatch_fp8_cached_plus_permute",
     "meg_dispatch_fp8_cached"),
    ("combine, rank-major, staged input", "combine", "deepep_combine", "rm_combine"),
    ("combine, rank-major, zero-copy input", "combine_zero_copy", "deepep_combine", "rm_combine"),
    ("expert-major combine, staged input [4]", "combine_expert", "deepep_unpermute_plus_combine", "meg_combine"),
    ("expert-major combine, zero-copy input [4]", "combine_expert_zero_copy", "deepep_unpermute_plus_combine",
     "meg_combine"),
    ("all_to_all_single alone, Megatron rows, bf16 [5]", None, None, "meg_a2a"),
    ("all_to_all_single alone, Megatron rows, FP8 bytes [5]", None, None, "meg_a2a_fp8"),
    ("all_to_all_single alone, rank-major rows, bf16 [5]", None, None, "rm_a2a"),
    ("all_to_all_single alone, rank-major rows, FP8 bytes [5]", None, None, "rm_a2a_fp8"),
]


def model_check(args, allres, key, row_bytes, ref_key=None) -> str:
    """The "model check" block (--ranks-per-node): megatron_ep.model's exact per-link bytes of
    this run's routing against the bench's own counts, and the time check (`_model_times`):
    rates calibrated on one measured op per direction predict the others; those of SM count
    `ref_key` predict this one. Raises after printing when an exact count disagrees (a bug, not
    a measurement); a time outside 25% is printed as OUTSIDE."""
    R, P = args.ranks, args.ranks_per_node
    sms_out = [r["sms"][key] for r in allres]
    lc = None
    for o in sms_out:
        c = MODEL.LinkCount(R, P, row_bytes, *[o["links"][f] for f in MODEL.LINK_FIELDS])
        lc = c if lc is None else lc + c
    mb = lambda v: f"{v / 1e6:.2f} MB"  # noqa: E731
    lines = [f"  model check (megatron_ep.model, {R // P} nodes x {P} ranks, bf16 rows of {row_bytes} B; per rank "
             f"mean [min, max]):"]

    def span(vals):
        return f"{mb(sum(vals) / R)} [{mb(min(vals))}, {mb(max(vals))}]"

    lines.append(f"    exact, link_count of this run's routing: RDMA domain sent {span(lc.rdma_bytes)}; DeepEP RDMA "
                 f"accounting (incl. own node) {span(lc.deepep_rdma_bytes)}; NVLink forwarded {span(lc.nvlink_bytes)}; "
                 f"rank-major rows received {span(lc.bytes('recv_rows'))}")
    bad = []
    bench_rows = [o.get("rdma_rows_sent") for o in sms_out]
    if all(v is not None for v in bench_rows):
        same = bench_rows == lc.deepep_rdma
        lines.append(f"    bench's own RDMA count x row bytes {span([v * row_bytes for v in bench_rows])}: "
                     f"{'equal on every rank' if same else 'DIFFERS'}")
        bad += [] if same else [f"RDMA rows: bench {bench_rows} vs model {lc.deepep_rdma}"]
    delivered = [o["rows_rank_major"] for o in sms_out]
    same = delivered == lc.recv_rows
    lines.append(f"    rank-major rows our path delivered: {'equal to the count on every rank' if same else 'DIFFER'}")
    bad += [] if same else [f"delivered rows {delivered} vs model {lc.recv_rows}"]
    if P == R:
        lines.append("    one node: no RDMA domain, no timing check (pass --ranks-per-node below --ranks)")
    else:
        lines += _model_times(args, allres, key, ref_key, lc)
    text = "\n".join(lines)
    if bad:
        print(text)
        raise AssertionError("bench_normal model check: exact counts disagree: " + "; ".join(bad))
    return text


def _phase_means(allres, key, op):
    """{mark: loop µs, mean over ranks} of `op`'s phase marks at SM count `key`, or None (not
    traced: torch backend, or the internal hook is missing)."""
    per = [r["sms"].get(key, {}).get("phases", {}).get(op) for r in allres]
    if any(not p for p in per):
        return None
    loops = [{k[:-len("(loop)")]: v for k, v in p.items() if k.endswith("(loop)")} for p in per]
    if not all(loops):
        return None
    names = list(dict.fromkeys(k for lp in loops for k in lp))
    return {k: sum(lp.get(k, 0.0) for lp in loops) / len(loops) for k in names}


def _stages_text(t, sep=" + ") -> str:
    return sep.join(f"{MODEL.STAGE_NAMES[s]} {t.of(s):.1f}" for s in MODEL.STAGES if t.of(s) or s != "fixed")


def _check_lines(chk, note="") -> list:
    """A prediction against the measured call (the verdict) and, when traced, its phases."""
    p = chk.predicted
    fixed = " (measured, no model term)" if p.fixed_us else ""
    out = [f"      {chk.name}{note}: predicted {_stages_text(p)}{fixed} = {p.total_us:.1f} vs measured "
           f"{chk.call_us:.1f} per call: {chk.ratio:.2f} ({MODEL.verdict(chk.ratio)})"]
    if chk.measured is None:
        out.append("        per phase: n/a (this op's phases not traced)")
        return out
    m = chk.measured
    ratios = ", ".join(f"{MODEL.STAGE_NAMES[s]} {chk.stage_ratio(s):.2f}" + ("" if MODEL.within(chk.stage_ratio(s))
                                                                             else " OUTSIDE")
                       for s in MODEL.STAGES if s != "fixed" and chk.stage_ratio(s) is not None)
    out.append(f"        measured phases {_stages_text(m, ', ')} (sum {m.total_us:.1f}: predicted/sum "
               f"{p.total_us / m.total_us:.2f}; {chk.outside_marks_us:.1f} of the call outside the marks); "
               f"predicted/measured per phase: {ratios}")
    return out


def _model_times(args, allres, key, ref_key, lc) -> list:
    """The time check: per-SM rates of the RDMA hop, the in-node stage and the local reorder
    calibrated on ONE measured operation per direction (its phase marks) predict the others
    from this run's exact rows (megatron_ep.model's stages); rates calibrated at the first SM
    count predict the others; the SM split if the two copy stages ran at once."""
    R, H = len(allres), args.hidden
    bf16, fp8 = 2 * H, H + H // 128 * 4
    rows = sum(lc.recv_rows) / R  # the in-node stage delivers the rank-major rows (own ones included)
    pairs = sum(lc.deepep_rdma) / R  # what the RDMA-domain kernels handle (the own node's copy local)
    erows = sum(r["sms"][key]["rows_expert_major"] for r in allres) / R

    def sizes(k):
        o = allres[0]["sms"][k]
        return o.get("num_sms"), (o.get("rdma_blocks") or o.get("num_sms")), bool(o.get("rdma_blocks"))

    def call(op, k=key):
        v = _mean_over_ranks(allres, lambda r: r["sms"][k]["t"].get(op))
        return v[1] if v else None

    sms, blocks, known = sizes(key)
    if not sms:
        return ["    times: n/a (no SM count: torch backend, no phase marks; tests/test_model.py checks the time check "
                "on recorded GPU figures)"]
    out = [f"    times (µs per call and rank, loop mode, mean over ranks; megatron_ep.model's stages): RDMA hop on "
           f"{blocks} blocks{'' if known else ' (assumed = SMs: internal hook n/a)'}, in-node stage on {sms} SMs, local "
           f"reorder / fan-out on the rank's GPU share; rates calibrated on ONE op per direction, the rest predicted "
           f"from this run's rows x row bytes"]
    checks, rates_of = [], {}
    dw = lambda row, sk=sms, bk=blocks, **kw: MODEL.dispatch_stage_work(pairs, rows, row, bk, sk, **kw)  # noqa: E731
    cw = lambda sk=sms, bk=blocks, **kw: MODEL.combine_stage_work(pairs, rows, H, bk, sk, **kw)  # noqa: E731

    def measured(op, k=key):
        ph = _phase_means(allres, k, op)
        return None if ph is None else MODEL.phase_stages(ph)

    def calibrate(label, op, what, work, unit_rows):
        m, c = measured(op), call(op)
        if m is None or c is None:
            out.append(f"    {label}: n/a (no phase marks of the {what}: the internal hook is missing)")
            return None
        try:
            r = MODEL.calibrate_stages(work, m)
        except ValueError as exc:  # a stage without a mark
            out.append(f"    {label}: n/a ({exc})")
            return None
        rates_of[op] = r
        out.append(f"    {label}: calibrated on the {what} (its phases {_stages_text(m, ', ')}; call "
                   f"{c:.1f}): RDMA hop {r.rdma_per_sm:.1f} GB/s per block ((token, node) pairs x {unit_rows} B), "
                   f"in-node stage {r.node_per_sm:.1f} GB/s per SM (rank-major rows x {unit_rows} B), local "
                   f"{r.local_gbps:.0f} GB/s (bytes read + written)")
        return r

    def predict(name, op, work, rates, note="", k=key):
        c = call(op, k)
        if c is None or work is None:
            out.append(f"      {name}: n/a (not measured)")
            return
        chk = MODEL.check_stages(name, work, rates, c, measured(op, k))
        checks.append(chk)
        out.extend(_check_lines(chk, note))

    rd = calibrate("dispatch", "dispatch_cached", "bf16 cached rank-major dispatch", dw(bf16), bf16)
    if rd is not None:
        notify = measured("dispatch")
        predict("FP8 cached, rank-major", "dispatch_fp8_cached", dw(fp8), rd, f" (same rows, {fp8} B)")
        predict("incl. notify, rank-major", "dispatch", dw(bf16, fixed_us=notify.fixed_us) if notify else None, rd,
                " (the first call also sorts the order keys and syncs with the host: no model term)")
        predict("cached, expert-major", "dispatch_expert_cached", dw(bf16, expert_rows=erows), rd,
                f" (fan-out + reorder of {erows:.0f} rows)")
        predict("FP8 cached, expert-major", "dispatch_expert_fp8_cached", dw(fp8, expert_rows=erows), rd)
    rc = calibrate("combine", "combine", "bf16 rank-major combine", cw(), bf16)
    if rc is not None:
        em = _phase_means(allres, key, "combine_expert")
        partials = em is None or "reduce" in em
        predict("expert-major", "combine_expert", cw(expert_rows=erows, partials=partials), rc,
                " (reorder of the expert rows; " + ("fp32 partials cross the in-node stage)" if partials
                                                   else "every expert row crosses the in-node stage)"))
    if ref_key is not None and ref_key != key:
        rsms, rblocks, _ = sizes(ref_key)
        out.append(f"    SM sweep: rates calibrated at {rsms} SMs ({rblocks} blocks) predict {sms} SMs ({blocks} blocks); "
                   f"the local work does not scale with the SMs")
        for label, op, wref, wnow in (("cached dispatch, rank-major", "dispatch_cached", dw(bf16, rsms, rblocks), dw(bf16)),
                                      ("combine, rank-major", "combine", cw(rsms, rblocks), cw())):
            m = measured(op, ref_key)
            try:
                rates = MODEL.calibrate_stages(wref, m) if m is not None else None
            except ValueError:
                rates = None
            if rates is None:
                out.append(f"      {label}: n/a (no phase marks of every stage at {rsms} SMs)")
                continue
            predict(label, op, wnow, rates)
    if checks:
        bad = [f"{c.name} {c.ratio:.2f}" for c in checks if not c.within]
        out.append(f"    time check: {len(checks) - len(bad)} of {len(checks)} predictions within "
                   f"{100 * MODEL.TIME_TOLERANCE:g}% of the measured call" + (f"; OUTSIDE: {', '.join(bad)}" if bad else ""))
    nic = MODEL.Machine().nic_gbps
    for label, op, work in (("dispatch", "dispatch_cached", dw(bf16)), ("combine", "combine", cw())):
        r = rates_of.get(op)
        if r is None:
            continue
        s = MODEL.split_sms(sms, work.rdma_bytes, work.node_bytes, r.rdma_per_sm, r.node_per_sm)
        remote = sum(lc.rdma_sent) / R * (work.rdma_bytes / pairs)
        sn = MODEL.split_sms(sms, work.rdma_bytes, work.node_bytes, r.rdma_per_sm, r.node_per_sm, nic_gbps=nic,
                             rdma_link_bytes=remote)
        seq = MODEL.predict_stages(work, r)
        out.append(f"    if the stages were fused/overlapped ({label}, calibrated rates): split {sms} SMs as {s.rdma_sms} "
                   f"RDMA hop / {s.node_sms} in-node stage -> {s.time_us:.1f} µs (ideal {s.ideal_us:.1f}; one after the "
                   f"other on all {sms}: {seq.rdma_us + seq.node_us:.1f}); bound by {s.bound.describe()}; over a "
                   f"{nic:g} GB/s NIC carrying the {remote / 1e6:.2f} MB of remote rows: {sn.rdma_sms} / {sn.node_sms} -> "
                   f"{sn.time_us:.1f} µs, bound by {sn.bound.describe()}")
    intra = call("intra_dispatch_cached")
    if rd is not None and intra is not None:
        rate = MODEL.per_sm_gbps(rows, bf16, intra, sms)
        out.append(f"    not a check: the intranode path (one node of all ranks, same run) cached dispatch {intra:.1f} µs -> "
                   f"{rate:.3g} GB/s per SM; the calibrated RDMA hop / in-node stage rates are {rd.rdma_per_sm / rate:.2f}x / "
                   f"{rd.node_per_sm / rate:.2f}x it")
    out.append("    assumptions: the stages run one after the other (the marks of one stream); hop and in-node stage "
               "SM-bound at their per-SM rates (virtual nodes: NVSHMEM P2P over NVLink, no NIC); local work at one "
               "per-GPU rate per direction (bytes read + written, independent of --num-sms); the expert-major combine's "
               "pre-reduction takes the staging copy's place (its read of the expert rows has no term); the first "
               "call's sort and host sync, and metadata, have no term")
    return out


def report(args, allres):
    R = args.ranks
    r0 = allres[0]
    rows_mean = lambda get: sum(get(r) for r in allres) / R  # noqa: E731
    row_bytes = {"bf16": r0["bytes_row_bf16"], "fp8": r0["bytes_row_fp8"], None: None}
    print(f"\nbench_normal: {R} ranks x {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}, "
          f"alignment {args.alignment}; median of {args.iters} isolated calls / mean of {args.iters} back to back")
    print(f"  machine: {r0['machine']}")
    if r0.get("deepep_error"):
        print(f"  DeepEP not measured: {r0['deepep_error']}")
    else:
        print(f"  DeepEP: {r0.get('deepep_label')}")
    base = {k: _mean_over_ranks(allres, lambda r, k=k: r["base"].get(k)) for k in ("copy", "permute")}
    ref_key = next((str(n) for n in args.num_sms if not r0["sms"][str(n)]["skipped"]), None)  # the SM sweep's calibration
    for n in args.num_sms:
        key = str(n)
        if r0["sms"][key]["skipped"]:
            print(f"\n--num-sms {n}: skipped: {r0['sms'][key]['skipped']}")
            continue
        get = lambda k: _mean_over_ranks(allres, lambda r: r["sms"][key]["t"].get(k))  # noqa: E731
        N = rows_mean(lambda r: r["sms"][key]["rows_rank_major"])
        M = rows_mean(lambda r: r["sms"][key]["rows_expert_major"])
        dskip = r0["sms"][key].get("deepep_skipped")
        ours_sms = r0["sms"][key]["num_sms"]
        print(f"\n  ours: {r0['sms'][key].get('path')}")
        if r0["sms"][key].get("rdma_rows_sent") is not None:
            rd = rows_mean(lambda r: r["sms"][key]["rdma_rows_sent"])
            print(f"  RDMA domain: {rd:.0f} rows sent per rank ((token, node) pairs, own node included): "
                  f"{rd * row_bytes['bf16'] / 1e6:.1f} MB bf16; NVLink stage rows as in the table below")
        print(f"\n--num-sms {n}: ours {ours_sms if ours_sms is not None else 'n/a (no SM knob)'} SMs/rank, DeepEP "
              f"{'not measured' if (r0.get('deepep_error') or dskip) else (n or DEEPEP_DEFAULT_SMS)}"
              f"{' (' + dskip + ')' if dskip else ''}; rows/rank rank-major {N:.0f}, expert-major {M:.0f}")
        print(f"{'operation':<42}{'us':>9}{'us loop':>9}{'us max':>9}{'GB/s':>7}{'vs copy':>9}{'vs DeepEP':>10}{'(loop)':>8}")
        copy = base["copy"]
        for name, bkind, peer in OUR_ROWS + [(k, b, None) for k, b in DEEPEP_ROWS]:
            v = get(name)
            if v is None:
                if not name.startswith("deepep") or get("deepep_dispatch") is not None:
                    print(f"{name:<42}{'n/a':>9}")
                continue
            iso, loop, mx, _ = v
            gbs = f"{N * row_bytes[bkind] / loop / 1e3:>7.0f}" if bkind else f"{'':>7}"
            vs_copy = f"{loop / copy[1]:>8.2f}x" if (copy and bkind) else f"{'':>9}"
            p = get(peer) if peer else None
            ratio = f" {iso / p[0]:>9.2f}x{loop / p[1]:>7.2f}x" if p else ""
            print(f"{name:<42}{iso:>9.1f}{loop:>9.1f}{mx:>9.1f}{gbs}{vs_copy}{ratio}")
        for pkey in ("dispatch", "dispatch_cached", "dispatch_fp8_cached", "dispatch_expert_cached",
                     "dispatch_expert_fp8_cached", "combine", "combine_expert"):
            per = [r["sms"][key]["phases"].get(pkey) for r in allres]
            if any(p is None for p in per):
                print(f"  phases {pkey:<26} n/a")
                continue
            names = per[0].keys()
            print(f"  phases {pkey:<26} " + "  ".join(f"{nm} {sum(p.get(nm, 0) for p in per) / R:.0f}" for nm in names) + " us")
        if args.ranks_per_node:
            print(model_check(args, allres, key, row_bytes["bf16"], ref_key))
        gb = [r["sms"][key].get("gpu_bound") for r in allres]
        if all(gb):
            print("  GPU-bound (host queued ahead behind a sleep kernel): " + "; ".join(
                f"{k} {sum(g[k] for g in gb) / R:.1f} us" for k in gb[0]))
        prof = r0["sms"][key].get("profile") or {}
        for op, pr in prof.items():  # rank 0's trace
            ks = sorted(pr["kernels"].items(), key=lambda kv: -kv[1][0])
            print(f"  trace {op:<25} host {pr['host_us_per_call']:.0f} us/call; GPU: " +
                  "; ".join(f"{k} {v[0]:.1f} us x{v[1]:.0f}" for k, v in ks[:6]))
    for k, v in base.items():
        if v is not None:
            print(f"baseline {k:<33}{v[0]:>9.1f}{v[1]:>9.1f}{v[2]:>9.1f}")

    nstat = r0["nccl"]["status"]
    print(f"\nNCCL baselines ({nstat}; NCCL has no SM knob, so measured once)")
    if r0["nccl"]["t"]:
        print(f"  Megatron ops: {r0['nccl']['megatron_ops']}")
        nrows = {kind: rows_mean(lambda r, kind=kind: r["nccl"]["rows"][kind]) for kind in ("megatron", "rank_major")}
        print(f"  rows received per rank: Megatron (one per token-expert pair) {nrows['megatron']:.0f}, "
              f"rank-major (one per token-rank pair) {nrows['rank_major']:.0f}")
        print(f"{'operation':<42}{'us':>9}{'us loop':>9}{'us max':>9}{'GB/s':>7}")
        for name, kind, bkind in NCCL_ROWS:
            v = _mean_over_ranks(allres, lambda r, name=name: r["nccl"]["t"].get(name))
            if v is None:
                print(f"{name:<42}{'n/a':>9}")
                continue
            gbs = f"{nrows[kind] * row_bytes[bkind] / v[1] / 1e3:>7.0f}" if kind else ""
            print(f"{name:<42}{v[0]:>9.1f}{v[1]:>9.1f}{v[2]:>9.1f}{gbs}")
        checks = [r["nccl"]["checks"] for r in allres]
        if checks[0]:
            eq = lambda k: "yes" if all(c[k] for c in checks) else "NO"  # noqa: E731
            mx = lambda k: max(c[k] for c in checks)  # noqa: E731
            print(f"  checks (all ranks): rank-major rows == ours: {eq('rank_major_rows_equal_ours')}; Megatron rows == "
                  f"ours expert-major without pad rows: {eq('megatron_rows_equal_ours_expert_major')}; combine max rel. "
                  f"diff vs ours: rank-major {mx('rank_major_combine_max_rel_diff'):.1e}, Megatron "
                  f"{mx('megatron_combine_max_rel_diff'):.1e} (bf16 scatter_add_)")
    else:
        print(f"  {nstat}")

    md = markdown(args, allres, base)
    print("\n" + md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "command": _command(), "ranks": allres}, f, indent=1)


def _command() -> str:
    return shlex.join(["python3"] + sys.argv)


def markdown(args, allres, base) -> str:
    R, r0 = args.ranks, allres[0]
    nstat = r0["nccl"]["status"]
    have_nccl = bool(r0["nccl"]["t"])
    sms = [n for n in args.num_sms if not r0["sms"][str(n)]["skipped"]]

    def ours(n, k):
        return _mean_over_ranks(allres, lambda r: r["sms"][str(n)]["t"].get(k)) if k else None

    def nccl(k):
        return _mean_over_ranks(allres, lambda r: r["nccl"]["t"].get(k)) if (k and have_nccl) else None

    def cell(v):
        if v is None:
            return "n/a"
        return f"{v[1]:.1f}" + ("" if v[3] else " †")

    def ratio(a, b):
        return f"{a[1] / b[1]:.2f}x" if (a is not None and b is not None) else ""

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    N = sum(r["sms"][str(sms[0])]["rows_rank_major"] for r in allres) / R if sms else float("nan")
    M = sum(r["sms"][str(sms[0])]["rows_expert_major"] for r in allres) / R if sms else float("nan")
    deepep = r0.get("deepep_error") or r0.get("deepep_label")
    lines = [
        f"### bench_normal, {now}",
        "",
        f"Command: `{_command()}`",
        "",
        f"* machine: {r0['machine']}",
        f"* code: {_code_revision()}",
        "* push kernel SMs per SM count: " + ", ".join(
            f"{n} -> {r0['sms'][str(n)].get('push_sms')}" for n in sms if not r0["sms"][str(n)].get("skipped")),
        f"* shape: {R} ranks x {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts} experts "
        f"(uniform random routing), bf16 / FP8 dispatch, bf16 combine, expert alignment {args.alignment}; rows "
        f"received per rank: rank-major {N:.0f}, expert-major {M:.0f} (with padding)"
        + (f", Megatron's {sum(r['nccl']['rows']['megatron'] for r in allres) / R:.0f}" if have_nccl else ""),
        f"* DeepEP: {deepep}; NCCL: {nstat}" + (f", {r0['nccl']['megatron_ops']}" if have_nccl else ""),
        f"* µs per call and rank, mean over ranks of the mean over {args.iters} calls back to back (loop mode); "
        f"† = median of {args.iters} isolated calls (input refreshed before each call). ours/best = ours / the "
        "faster of DeepEP and NCCL. NCCL has no SM knob: one column for every SM count.",
        "",
    ]
    head = ["operation", "NCCL"]
    for n in sms:
        lab = f"{n} SMs" if n else "default SMs"
        head += [f"ours {lab}", f"DeepEP {lab}", f"ours/DeepEP {lab}", f"ours/best {lab}"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---|" + "---:|" * (len(head) - 1))
    for label, ok, dk, nk in MD_ROWS:
        nv = nccl(nk)
        ncell = ("—" if nk is None else (cell(nv) if have_nccl else nstat))
        row = [label, ncell]
        for n in sms:
            o, d = ours(n, ok), ours(n, dk)
            best = min((v for v in (d, nv) if v is not None), key=lambda v: v[1], default=None)
            row += ["—" if ok is None else cell(o), "—" if dk is None else cell(d), ratio(o, d), ratio(o, best)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Notes:"]
    if any(r0["sms"][str(n)]["skipped"] for n in args.num_sms):
        for n in args.num_sms:
            if r0["sms"][str(n)]["skipped"]:
                lines.append(f"* --num-sms {n} skipped: {r0['sms'][str(n)]['skipped']}")
    lines += [
        "* [1] ours: the notify kernel alone (an internal hook; n/a if missing); NCCL: Megatron's preprocess "
        "(per-expert counts, count all-gather, device-to-host copy and sync).",
        "* [2] NCCL: the rank-major rows ours and DeepEP deliver (one per token and destination rank): layout, count "
        "all-to-all + host sync, index_select, all_to_all_single of rows, top-k ids and weights.",
        "* [3] ours: expert-major dispatch (permute fused, segments padded to the alignment); DeepEP: its dispatch "
        "then an index_select into expert order (the permute index built from its output where uncached); NCCL: "
        "Megatron's alltoall dispatcher (one row per token-expert pair: permute by expert, count all-gather + host "
        "sync, all_to_all_single of rows and probs, sort_chunks_by_idxs into local-expert order; cached: permute, "
        "rows, sort only). FP8: the same bytes as uint8 rows of H + H/128*4 (Megatron has no FP8 dispatch).",
        "* [4] DeepEP: a manager's unpermute (index_add_ of the expert rows into received rows) then its combine; "
        "NCCL: Megatron's combine (reverse sort_chunks_by_idxs, reverse all_to_all_single, unpermute = bf16 "
        "scatter_add_). Rank-major NCCL combine: reverse all_to_all_single, fp32 index_add_, cast to bf16.",
        "* [5] all_to_all_single of pre-permuted rows only; Megatron rows: one per token-expert pair, rank-major: one "
        "per token-rank pair.",
    ]
    copy, perm = base.get("copy"), base.get("permute")
    if copy or perm:
        lines.append(f"* same run, single-process baselines: device copy of the received rank-major bytes "
                     f"{cell(copy)} µs; index_select of them into expert order {cell(perm)} µs.")
    pool = {n: r0["sms"][str(n)].get("pool") for n in sms}
    if any(pool.values()):
        lines.append("* our output pool during each dispatch's timing (rank 0; GPU-side waits / host waits / no room, "
                     "then staged and pulled): " + "; ".join(
                         f"{n} SMs: " + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in pool[n].items())
                         for n in sms if pool[n]) + ".")
    checks = [r["nccl"]["checks"] for r in allres]
    if checks[0]:
        ok = all(c["rank_major_rows_equal_ours"] and c["megatron_rows_equal_ours_expert_major"] for c in checks)
        lines.append(f"* baseline checks, all ranks: NCCL rank-major rows and Megatron's rows "
                     f"{'equal' if ok else 'DIFFER FROM'} ours bit for bit; combine max rel. diff vs ours "
                     f"{max(c['rank_major_combine_max_rel_diff'] for c in checks):.1e} (rank-major), "
                     f"{max(c['megatron_combine_max_rel_diff'] for c in checks):.1e} (Megatron, bf16 accumulation).")
    return "\n".join(lines)


def main():
    args = parse()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_normal: no GPU visible (use --smoke for the CPU check of the script)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
