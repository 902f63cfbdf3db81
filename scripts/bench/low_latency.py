"""Benchmark of the low-latency (decode) path (a script, not a test).

R processes, decode shape: T tokens per rank (a comma list, default 128,32,1), hidden 7168, top-8
of 256 experts (uniform random routing, distinct experts per token), FP8 dispatch (--bf16-dispatch: bf16 rows), bf16 combine.
Rank r runs on GPU r % (GPUs visible): one process per GPU when there are enough GPUs, else
virtual ranks sharing a GPU (run those under MPS, docs/design.md §5). Each implementation runs in its own
set of processes (DeepEP and ours both start NVSHMEM, once per process):

  ours     megatron_ep's cuda low-latency path (public API): dispatch, combine, dispatch+combine,
           and dispatch+combine with recv hooks (send half, then the hook), each captured as a
           CUDA graph of --loop back-to-back calls (GPU time, no Python launch overhead; the
           kernels' own signals keep the ranks in step)
  torch    the torch backend's low-latency path over NCCL (eager: it syncs with the host)
  nccl     all_to_all_single of the same messages (one FP8 message of H + H/128*4 + 16 bytes per
           valid (token, expert), 2H bf16 bytes back), splits known in advance (eager)
  deepep   DeepEP V1's low-latency kernels, if `deep_ep` imports (never part of this repository):
           eager loops of the same four calls (its graph capture failed here; the table marks
           these rows "eager": at 1-32 tokens they include its host launch overhead)
torch, nccl and deepep need one GPU per process (NCCL refuses several ranks on one GPU).

Kernel time (ours and deepep): the kernels of about --kernel-iters calls under torch.profiler (ours:
replays of the CUDA graphs above; deepep: eager calls), median per kernel (DeepEP's own
accounting), with the hook's send and receive halves apart.

Each figure is the median over --reps repetitions of (time of --loop back-to-back calls) / loop,
timed with CUDA events after --warmup calls. GB/s is DeepEP's accounting per rank: valid
(token, expert) pairs x (H + H/128*4 + 16) bytes for dispatch, x 2H for combine, / time.

    python3 scripts/bench low-latency --ranks 2 --markdown /tmp/ll.md   # 2 GPUs, one rank each
    python3 scripts/bench low-latency --ranks 4                         # one GPU under MPS
    python3 scripts/bench low-latency --smoke                           # CPU: checks the script
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

from bench import harness  # first: it sets the NCCL environment before torch loads

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_ep as mep  # noqa: E402
from megatron_ep.core.fp8 import per_token_cast_back  # noqa: E402

from bench import deepep, nccl, report  # noqa: E402
from megatron_ep.tools import tracing  # noqa: E402
from megatron_ep.tools.tracing import low_latency_points  # noqa: E402
from bench.report import md_line, md_rule  # noqa: E402

# ours-merged: the weights given at dispatch; ours-mask: the rank mask on (nobody masked), the
# kernels' rank-mask mode against the plain one
IMPLS = ("ours", "ours-merged", "ours-mask", "torch", "nccl", "deepep")


def parse(argv=None, description=None):
    """The options (`description`: the --help text above them); --smoke sets its small shape."""
    p = argparse.ArgumentParser(prog="scripts/bench low-latency", description=description)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[128, 32, 1])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--loop", type=int, default=20, help="back-to-back calls per timed repetition")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--bf16-dispatch", dest="fp8", action="store_false",
                   help="bf16 dispatch rows instead of FP8 (twice the bytes: with the FP8 run, tells bytes from latency)")
    p.add_argument("--kernel-iters", type=int, default=50, help="eager calls traced for the kernel-time table")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="ours: N eager calls per kernel with the kernels' trace stamps (where the time goes)")
    p.add_argument("--timeout", type=float, default=600)
    report.markdown_option(p)
    report.json_option(p, "also write the raw figures here")
    p.add_argument("--smoke", action="store_true", help="CPU: the torch path end to end at a small shape, no timing")
    a = p.parse_args(argv)
    if a.smoke:
        a.ranks, a.tokens, a.hidden, a.experts, a.topk, a.impls = 2, [4, 1], 256, 16, 4, "torch"
    return a


def routing(T, E, K, H, seed, device):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty((0, K), dtype=torch.int64)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    w = torch.rand((T, K), generator=g) + 0.5
    return x.to(device), idx.to(device), w.to(device)


def graph_figures(a, fns, group):
    """Per-call µs of each of `fns` (dispatch, combine, both, hook: one call each) from a CUDA
    graph of --loop back-to-back calls (GPU time, no Python launch overhead; the kernels' own
    signals keep the ranks in step), and the kernel times from replays of those graphs (an eager
    loop's kernels would mostly wait for the other rank's launch overhead)."""
    res, graphs = {}, {}
    for name, fn in fns.items():
        g = harness.graph_of(fn, a.loop)
        dist.barrier(group=group)
        res[name] = harness.median_us(g.replay, a.reps, 2) / a.loop
        if name != "both":
            graphs[name] = g
        del g
    dist.barrier(group=group)
    iters = max(1, a.kernel_iters // a.loop)
    res.update(harness.kernel_figures(graphs["dispatch"].replay, graphs["combine"].replay, graphs["hook"].replay, iters))
    del graphs  # their pools hold `loop` calls' outputs
    torch.cuda.empty_cache()
    return res


def trace_figures(buf, fns, iters, group):
    """Where our kernels' time goes: each of `fns` ({"dispatch": fn, "combine": fn}) is called
    `iters` times eagerly with the kernels' trace stamps attached (csrc/low_latency/api.h);
    per call, every point's time from the earliest block's entry (latest block, as the kernel
    ends when its last block does), then the mean over calls. Eager: the "wait" span includes the
    ranks' launch skew."""
    out = {}
    with tracing.low_latency_stamps(buf) as trace:
        for kernel, (name, fn) in enumerate(fns.items()):
            rows, block_rows = [], []
            for _ in range(iters):
                trace.zero_()
                dist.barrier(group=group)
                fn()
                torch.cuda.synchronize()
                t = trace[kernel].cpu().double()
                used = t[:, 0] > 0
                t = t[used]
                start = t[:, 0].min()
                rows.append([float((t[:, p][t[:, p] > 0] - start).max()) / 1e3 if (t[:, p] > 0).any() else float("nan")
                             for p in range(len(low_latency_points()))])
                # the median block, each from its own entry: a block's own latency, without the
                # spread of the blocks' start times and the slowest block's contention
                block_rows.append([float((t[:, p][t[:, p] > 0] - t[:, 0][t[:, p] > 0]).median()) / 1e3
                                   if (t[:, p] > 0).any() else float("nan") for p in range(len(low_latency_points()))])
            out[name] = [statistics.fmean(r[p] for r in rows) for p in range(len(low_latency_points()))]
            out[name + " block"] = [statistics.fmean(r[p] for r in block_rows) for p in range(len(low_latency_points()))]
    return out


def trace_table(a, res) -> str:
    """Per T and kernel: µs from the first block's entry to each trace point (latest block, slowest
    rank), then each point's span since the latest point stamped before it."""
    lines = ["", "Kernel trace (ours, eager, mean of --trace calls; µs from the first block's entry to each point "
             "(latest block; 'block' rows: the median block from its own entry); in brackets the span since the "
             "latest earlier point):", "",
             md_line(["tokens/rank", "kernel", *low_latency_points()[1:]]), md_rule(1 + len(low_latency_points()), right_aligned=False)]
    for T in a.tokens:
        for kernel in ("dispatch", "dispatch block", "combine", "combine block"):
            pts = res[T].get("trace", {}).get(kernel)
            if pts is None:
                continue
            cells = []
            for v in pts[1:]:
                if v != v:  # a point this kernel does not stamp
                    cells.append("-")
                    continue
                # span since the latest point stamped before it (the dispatch casts before it
                # waits for the release, so the columns are not in time order)
                prev = max([p for p in pts if p == p and p < v], default=pts[0])
                cells.append(f"{v:.1f} ({v - prev:+.1f})")
            lines.append(md_line([str(T), kernel, *cells]))
    return "\n".join(lines) + "\n"


def rows_of(x):
    """The dispatched rows as bf16 (the combine's input): FP8 rows cast back, bf16 as they are."""
    return per_token_cast_back(*x) if isinstance(x, tuple) else x


# ------------------------------------------------------------------------------ impls
def bench_ours(a, T, x, idx, w, E, K, H, gloo, merged=False, rank_mask=False):
    """merged: the weights go with the dispatch, so the combine sends a token's copies on a rank
    as one row (megatron_ep's API extension; DeepEP's dispatch takes no weights). rank_mask: the
    buffer made with the rank mask (DeepEP's shrink mode), no rank masked."""
    buf = mep.Buffer(gloo, backend="cuda", low_latency=dict(num_experts=E, max_tokens=max(a.tokens), hidden=H, topk=K,
                                                            fp8_only=a.fp8, rank_mask=rank_mask))
    mt = max(a.tokens)
    dw = w if merged else None
    out = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=a.fp8, topk_weights=dw)
    rows = rows_of(out.x)
    handle = out.handle

    def d():
        buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=a.fp8, topk_weights=dw)

    def c():
        buf.low_latency_combine(rows, idx, w, handle)

    def dc():
        o = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=a.fp8, topk_weights=dw)
        buf.low_latency_combine(rows, idx, w, o.handle)

    def dc_hook():
        o = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=a.fp8, return_recv_hook=True,
                                     topk_weights=dw)
        o.hook()
        _, hook = buf.low_latency_combine(rows, idx, w, o.handle, return_recv_hook=True)
        hook()

    res = graph_figures(a, {"dispatch": d, "combine": c, "both": dc, "hook": dc_hook}, gloo)
    if a.trace:
        res["trace"] = trace_figures(buf, {"dispatch": d, "combine": c}, a.trace, gloo)
    buf.synchronize()
    buf.destroy()
    return res


def bench_torch(a, T, x, idx, w, E, K, H, nccl_group):
    """megatron_ep's torch backend over NCCL (eager loops of --loop / 4 calls: it syncs with the
    host)."""
    buf = mep.Buffer(nccl_group, backend="torch")
    mt = max(a.tokens)
    out = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=a.fp8)
    rows = rows_of(out.x)
    loop = max(1, a.loop // 4)

    def d():
        for _ in range(loop):
            buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=a.fp8)

    def c():
        for _ in range(loop):
            buf.low_latency_combine(rows, idx, w, out.handle)

    def dc():
        for _ in range(loop):
            o = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=mt, use_fp8=a.fp8)
            buf.low_latency_combine(rows, idx, w, o.handle)

    return {name: harness.median_us(fn, a.reps, 1) / loop for name, fn in (("dispatch", d), ("combine", c), ("both", dc))}


# ------------------------------------------------------------------------------ workers
def worker(rank, a, impl, queue):
    R = a.ranks
    cuda = torch.cuda.is_available() and not a.smoke
    device = harness.init_rank(rank, R, a.port, cuda, rank_env=True)
    gloo = dist.group.WORLD
    results = {}
    try:
        nccl_group = dist.new_group(backend="nccl") if cuda and not impl.startswith("ours") else gloo
        for T in a.tokens:
            x, idx, w = routing(T, a.experts, a.topk, a.hidden, 1000 * rank + T, device)
            args_ = (a, T, x, idx, w, a.experts, a.topk, a.hidden)
            if a.smoke:  # CPU: the torch backend's path end to end, no timing
                buf = mep.Buffer(gloo, backend="torch")
                out = buf.low_latency_dispatch(x, idx, num_experts=a.experts, max_tokens_per_rank=max(a.tokens), use_fp8=a.fp8)
                buf.low_latency_combine(rows_of(out.x), idx, w, out.handle)
                res = {"dispatch": 0.0, "combine": 0.0, "both": 0.0}
            else:
                res = {"ours": lambda: bench_ours(*args_, gloo), "ours-merged": lambda: bench_ours(*args_, gloo, merged=True),
                       "ours-mask": lambda: bench_ours(*args_, gloo, rank_mask=True),
                       "torch": lambda: bench_torch(*args_, nccl_group),
                       "nccl": lambda: nccl.low_latency_runs(*args_, nccl_group),
                       "deepep": lambda: deepep.low_latency(*args_, nccl_group)}[impl]()
            res["pairs"] = int((idx >= 0).sum())
            results[T] = res
        queue.put((rank, results, None))
    except Exception:  # noqa: BLE001 - reported in the table
        queue.put((rank, None, traceback.format_exc(limit=3).strip().splitlines()[-1]))
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def run_impl(a, impl):
    """One implementation in its own set of --ranks processes: ({T: figures of the slowest
    rank}, None), or (None, why it has none)."""
    a.port += 1
    per_rank, error = harness.run_ranks(worker, a.ranks, (a, impl), a.timeout)
    if per_rank is None:
        return None, error

    # the slowest rank sets the figure (the trace: point by point)
    def slowest(vals):
        if isinstance(vals[0], dict):
            return {k: [max(v) for v in zip(*(d[k] for d in vals))] for k in vals[0]}
        return max(vals)
    return {T: {k: slowest([r[T][k] for r in per_rank]) for k in per_rank[0][T]} for T in a.tokens}, None


def table(a, results) -> str:
    H = a.hidden
    d_bytes, c_bytes = harness.msg_bytes(H, a.fp8), 2 * H
    lines = [md_line(["impl", "tokens/rank", "dispatch us", "combine us", "dispatch+combine us", "with hook us",
                      "dispatch GB/s", "combine GB/s"]), md_rule(8, right_aligned=False)]
    kernels = ["", "Kernel time (torch.profiler, median per kernel; ours from graph replays, deepep eager; hook: send + receive halves):", "",
               md_line(["impl", "tokens/rank", "dispatch us", "combine us", "hook dispatch send + recv us",
                        "hook combine send + recv us"]), md_rule(6, right_aligned=False)]
    for impl, (res, err) in results.items():
        if res is None:
            lines.append(f"| {impl} | - | {err} | | | | | |")
            continue
        for T in a.tokens:
            r = res[T]

            def us(k):
                return f"{r[k]:.1f}" if k in r and r[k] > 0 else "-"

            def gbs(k, b):
                return f"{r['pairs'] * b / (r[k] * 1e-6) / 1e9:.1f}" if r.get(k, 0) > 0 else "-"

            name = impl + (" (eager)" if r.get("timing") == "eager" else "")
            lines.append(md_line([name, str(T), us("dispatch"), us("combine"), us("both"), us("hook"),
                                  gbs("dispatch", d_bytes), gbs("combine", c_bytes)]))
            if "k_dispatch" in r:
                kernels.append(md_line([name, str(T), us("k_dispatch"), us("k_combine"),
                                        f"{us('k_d_send')} + {us('k_d_recv')}", f"{us('k_c_send')} + {us('k_c_recv')}"]))
    return "\n".join(lines + (kernels if len(kernels) > 5 else []))


def main(a) -> int:
    """Every implementation of --impls in turn (its table printed as soon as it ends), then the
    markdown, --markdown and --json. Exit status 1 only when our own path failed (the baselines
    are optional and reported in the table)."""
    a.port = 29500 + os.getpid() % 1000
    ngpu = torch.cuda.device_count()
    results = {}
    for impl in a.impls.split(","):
        if not impl.startswith("ours") and not a.smoke and a.ranks > ngpu:
            results[impl] = (None, f"skipped (virtual ranks: {a.ranks} ranks on {ngpu} GPU(s); NCCL needs one GPU per rank)")
            continue
        if impl == "deepep" and deepep.load()[0] is None:
            results[impl] = (None, "skipped (deep_ep not importable)")
            continue
        results[impl] = run_impl(a, impl)
        print(f"{impl}: {'ok' if results[impl][0] else results[impl][1]}", flush=True)
        print(table(a, {impl: results[impl]}), flush=True)  # now: a later impl may crash the run
    md = (f"Low latency, {a.ranks} ranks on {max(ngpu, 1)} GPU(s), H {a.hidden}, top-{a.topk} of {a.experts}, {'FP8' if a.fp8 else 'bf16'} dispatch, "
          f"bf16 combine; median of {a.reps} x {a.loop} back-to-back calls; slowest rank\n\n" + table(a, results))
    for impl in ("ours", "ours-merged", "ours-mask"):
        if a.trace and results.get(impl, (None,))[0]:
            md += f"\n{impl}:\n" + trace_table(a, results[impl][0])
    print(md)
    report.write_markdown(a.markdown, md)
    report.write_json(a.json, {k: v[0] for k, v in results.items()})
    return 1 if results.get("ours", (True, None))[0] is None and not results["ours"][1].startswith("skipped") else 0


if __name__ == "__main__":
    sys.exit(main(parse(description=__doc__.split("\n")[0])))
