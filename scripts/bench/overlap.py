"""One MoE layer's experts with their communication under the GEMMs: megatron_ep.experts.
chunked_expert_mlp at several chunk counts, forward and forward + backward, against one round
(chunks = 1), and a per-chunk timeline of the forward (when each chunk's rows arrive, when its
GEMMs start and end, when the layer's output is usable, from CUDA events) with the communication
it left exposed, next to what the analytic model predicts for the same shape
(megatron_ep/tools/model/overlap.py).

    python3 scripts/bench overlap --ranks 2                       # GPUs (one process per GPU)
    python3 scripts/bench overlap --ranks 4 --tokens 1024         # virtual ranks (under MPS)
    python3 scripts/bench overlap --cpu                           # smoke run: CPU processes, small sizes

Ranks sharing a GPU (virtual ranks) test the mechanics only: their times are not speed claims,
and the script says so in its output. Timing: CUDA events, --warmup untimed runs, the median of
--iters, every rank released together by a barrier before each run. `--cpu` runs the torch
backend on CPU processes at small default sizes (a smoke run of the mechanics, no timeline):
seconds, with a line per chunk count as it finishes. Before any process starts, the run's
processes and memory are estimated (megatron_ep/tools/resources.py) and refused in one line when they
exceed this machine (--force skips the estimate).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from megatron_ep.tools import cli  # noqa: E402

PROG = "scripts/bench overlap"

from bench import harness  # noqa: E402  (sets the NCCL environment before torch loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import megatron_ep as mep  # noqa: E402
from megatron_ep.tools import resources  # noqa: E402
from megatron_ep.experts import chunked_expert_mlp  # noqa: E402
from megatron_ep.experts.overlap import MAX_CHUNKS  # noqa: E402

# Sizes on GPUs (one DeepSeek-V3-like layer's share per rank) and in a --cpu smoke run.
GPU_SIZES = dict(tokens=4096, hidden=7168, ffn=2048, experts=64, topk=8, chunks=[1, 2, 4, 8], warmup=3, iters=10)
CPU_SIZES = dict(tokens=64, hidden=256, ffn=128, experts=16, topk=4, chunks=[1, 2, 4], warmup=1, iters=3)


def _sizes(name: str) -> str:
    show = lambda v: " ".join(map(str, v)) if isinstance(v, list) else str(v)  # noqa: E731
    return f"(default: {show(GPU_SIZES[name])} on GPUs, {show(CPU_SIZES[name])} with --cpu)"


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=cli.integer(), default=2, help="EP ranks (processes)")
    p.add_argument("--cpu", action="store_true",
                   help="torch backend on CPU processes: a smoke run at small sizes (no timeline, no speed claim)")
    p.add_argument("--tokens", type=cli.integer(), default=None, help=f"tokens per rank {_sizes('tokens')}")
    p.add_argument("--hidden", type=cli.integer(), default=None, help=f"hidden size {_sizes('hidden')}")
    p.add_argument("--ffn", type=cli.integer(), default=None,
                   help=f"expert MLP intermediate size (SwiGLU: 2x in fc1) {_sizes('ffn')}")
    p.add_argument("--experts", type=cli.integer(), default=None,
                   help=f"routed experts (a multiple of --ranks) {_sizes('experts')}")
    p.add_argument("--topk", type=cli.integer(), default=None, help=f"experts per token {_sizes('topk')}")
    p.add_argument("--chunks", type=cli.integer(1, MAX_CHUNKS), nargs="+", default=None,
                   help=f"chunk counts to time (1, the baseline, is always added) {_sizes('chunks')}")
    p.add_argument("--num-sms", type=cli.integer(), default=None,
                   help="SMs of the communication kernels (Buffer num_sms; default: the Buffer's own choice)")
    p.add_argument("--comm-sms", type=cli.integer(0), default=None,
                   help="SMs the chunks' GEMMs leave free (chunked_expert_mlp comm_sms; default: the Buffer's num_sms; "
                        "0: the GEMMs take every SM)")
    p.add_argument("--budget", type=cli.number(0), default=0.0,
                   help="static budget: every chunk worst-case sized to this factor x its tokens x top-k rows per "
                        "rank (no host sync; rows past it dropped and counted); 0: exact sizes (a host sync per chunk)")
    p.add_argument("--profile", action="store_true",
                   help="GPU: one forward at the largest chunk count under torch.profiler: how long our kernels "
                        "ran, and how much of it beside a kernel of another stream (the GEMMs)")
    p.add_argument("--warmup", type=cli.integer(0), default=None, help=f"untimed runs before each timing {_sizes('warmup')}")
    p.add_argument("--iters", type=cli.integer(), default=None, help=f"timed runs (their median) {_sizes('iters')}")
    p.add_argument("--timeout", type=cli.number(0, above=True), default=600.0, help="seconds before every rank is stopped")
    resources.add_force(p)
    return p


def parse(argv=None) -> argparse.Namespace:
    """The options, sizes filled in for the device (GPU_SIZES, or CPU_SIZES with --cpu), checked
    (cli.UsageError, one line) before any process starts."""
    a = build_parser().parse_args(argv)
    for name, value in (CPU_SIZES if a.cpu else GPU_SIZES).items():
        if getattr(a, name) is None:
            setattr(a, name, list(value) if isinstance(value, list) else value)
    cli.check(a.experts % a.ranks == 0, f"--experts {a.experts} must be a multiple of --ranks {a.ranks}")
    cli.check(a.topk <= a.experts, f"--topk {a.topk} is more than --experts {a.experts}")
    if 1 not in a.chunks:
        a.chunks = [1] + a.chunks  # the baseline every ratio is against
    cli.check(a.cpu or torch.cuda.is_available(),
              "no CUDA GPU here: --cpu runs a smoke run on CPU processes (torch backend, small sizes)")
    resources.refuse_unless_fits(resources.expert_layer_need(a, a.ranks, on_gpu=not a.cpu), force=a.force)
    return a


def _layer(a, device):
    rank, R = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32 if a.cpu else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    x = torch.randn((a.tokens, a.hidden), generator=g).to(device, dtype)
    idx = torch.rand((a.tokens, a.experts), generator=g).topk(a.topk, dim=1).indices.to(device)
    probs = torch.rand((a.tokens, a.topk), generator=g).to(device)
    L = a.experts // R
    w1 = (torch.randn((L, 2 * a.ffn, a.hidden), generator=g) / a.hidden ** 0.5).to(device, dtype)
    w2 = (torch.randn((L, a.hidden, a.ffn), generator=g) / a.ffn ** 0.5).to(device, dtype)
    return x, idx, probs, w1, w2


def worst_rows(a, chunks: int) -> int:
    """--budget: the rows a chunk's worst-case sized dispatch delivers per rank (its share of
    the tokens x top-k x the factor)."""
    return math.ceil(a.budget * -(-a.tokens // chunks) * a.topk)


def layer_options(a, chunks: int, on_dispatch=None) -> dict:
    """chunked_expert_mlp's options for this run (with --budget, every chunk worst-case sized)."""
    opts = dict(chunks=chunks, activation=F.silu, glu=True, comm_sms=a.comm_sms, on_dispatch=on_dispatch)
    if a.budget:
        opts["num_worst_tokens"] = worst_rows(a, chunks)
    return opts


def _timeline(a, buf, inputs, chunks) -> list:
    """(point, chunk, ms since the layer's start) of one forward, from CUDA events: "arrived" (the
    chunk's dispatch finished, seen from an idle side stream waiting for the dispatch's event; that
    wait is issued when the host reaches the chunk's GEMMs, so without --budget, where the host
    waits for each dispatch's counts, the mark can be late by the host's own wait),
    "started" and "computed" (its GEMMs start and end on the compute stream), and "end" (the
    layer's output is usable, every combine waited for)."""
    x, idx, probs, w1, w2 = inputs
    events = []
    start = torch.cuda.Event(enable_timing=True)
    side = torch.cuda.Stream()

    def timed(point, c, stream=None):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        events.append((point, c, ev))

    def arrived(c, out):
        side.wait_event(out.event.event)
        timed("arrived", c, side)

    def mark(point, c):
        if point in ("started", "computed"):  # the others are host issue points, not GPU times
            timed(point, c)

    torch.cuda.synchronize()
    dist.barrier()
    start.record()
    chunked_expert_mlp(buf, x, idx, probs, w1, w2, a.experts, mark=mark, **layer_options(a, chunks, arrived))
    timed("end", -1)
    torch.cuda.synchronize()
    return [(p, c, start.elapsed_time(ev)) for p, c, ev in events]


def exposed_ms(timeline: list) -> tuple:
    """(layer ms, GEMM ms, exposed ms) of a timeline: the compute stream's time not in a chunk's
    GEMMs is what the communication (and the host) left exposed."""
    at = {(p, c): ms for p, c, ms in timeline}
    end = at[("end", -1)]
    gemm = sum(at[("computed", c)] - at[("started", c)] for p, c, _ in timeline if p == "started")
    return end, gemm, end - gemm


def worker(rank, a, port, queue):
    try:
        device = harness.init_rank(rank, a.ranks, port, not a.cpu, cpu_threads=1 if a.cpu else None)
        sizing = {} if a.cpu or not a.budget else {"combine_rows": worst_rows(a, 1)}
        buf = mep.Buffer(dist.group.WORLD, backend="torch" if a.cpu else "cuda", num_sms=a.num_sms,
                         max_tokens_per_rank=a.tokens, hidden=a.hidden, num_experts=a.experts, max_topk=a.topk,
                         **sizing)
        inputs = _layer(a, device)
        x, idx, probs, w1, w2 = inputs
        leaves = (x.detach().requires_grad_(), idx, probs.detach().requires_grad_(), w1.detach().requires_grad_(),
                  w2.detach().requires_grad_())
        timer = harness.Timer(a, not a.cpu)
        out = {"sms": (buf.num_sms, buf.num_sms if a.comm_sms is None else a.comm_sms)}
        dropped = []
        count = (lambda c, o: dropped.append(o.num_dropped)) if a.budget else None  # every chunk's drops
        start = time.monotonic()
        for chunks in a.chunks:
            def forward():
                with torch.no_grad():
                    chunked_expert_mlp(buf, *inputs, a.experts, **layer_options(a, chunks, count))

            def forward_backward():
                y = chunked_expert_mlp(buf, *leaves, a.experts, **layer_options(a, chunks, count))
                y.backward(torch.ones_like(y))

            out[chunks] = {"fwd_us": timer.isolated(forward), "fwd_bwd_us": timer.isolated(forward_backward)}
            out[chunks]["dropped"] = int(sum(int(d) for d in dropped))  # (a host sync, after the timing)
            dropped.clear()
            if rank == 0:  # progress: a run can take minutes at GPU sizes
                print(f"  chunks {chunks}: timed on rank 0 (fwd {out[chunks]['fwd_us'] / 1e3:.3f} ms, fwd+bwd "
                      f"{out[chunks]['fwd_bwd_us'] / 1e3:.3f} ms; {time.monotonic() - start:.0f} s so far)", flush=True)
            if not a.cpu:
                out[chunks]["timeline"] = _timeline(a, buf, inputs, chunks)
        if a.profile and not a.cpu:
            n = max(a.chunks)

            def profiled():
                with torch.no_grad():
                    chunked_expert_mlp(buf, *inputs, a.experts, **layer_options(a, n, count))

            out["profile"] = harness.kernel_streams(profiled)
        buf.destroy()
        queue.put((rank, out, None))
    except Exception:  # noqa: BLE001 - reported by the launcher, with the rank
        import traceback

        queue.put((rank, None, f"rank {rank}: {traceback.format_exc()}"))


def _model(a):
    """The model's prediction for this shape and EP (per rank, us): no overlap vs chunks."""
    from megatron_ep.tools.model import costs_of_layer, layer_times

    costs = costs_of_layer(a.tokens, a.hidden, a.topk, a.experts, a.ranks, a.ffn)
    return {n: (layer_times(costs, "none") if n == 1 else layer_times(costs, "chunks", n)) for n in a.chunks}


def main(argv=None) -> int:
    a = parse(argv)
    virtual = not a.cpu and harness.ranks_per_gpu(a.ranks) > 1
    print(f"{PROG}: starting {a.ranks} ranks ({'CPU, torch backend' if a.cpu else 'cuda backend'}); chunk counts "
          f"{', '.join(map(str, a.chunks))}, each {a.warmup} warm-up + {a.iters} timed runs of fwd and of fwd+bwd",
          flush=True)
    results, why = harness.run_ranks(worker, a.ranks, (a, harness.free_port()), a.timeout)
    if results is None:
        print(f"{PROG}: error: {why}", file=sys.stderr)
        return 1
    where = ("CPU, torch backend (smoke run)" if a.cpu else
             f"{harness.gpus_used(a.ranks)} GPU(s), {harness.ranks_per_gpu(a.ranks)} rank(s) per GPU")
    print(f"one MoE layer's routed experts, {a.ranks} ranks, {a.tokens} tokens/rank, hidden {a.hidden}, "
          f"SwiGLU FFN {a.ffn}, top-{a.topk} of {a.experts} experts; {where}")
    if virtual or a.cpu:
        print("  ranks share a GPU (or run on CPU): these times test the mechanics and are not speed claims")
    if not a.cpu:
        comm, free = results[0]["sms"]
        print(f"  communication kernels on {comm} SMs per rank; the chunks' GEMMs leave {free} SMs free")
    if a.budget:
        drops = sum(r[n]["dropped"] for r in results for n in a.chunks)
        print(f"  static budget: each chunk worst-case sized to {a.budget} x its tokens x top-{a.topk} rows per rank "
              f"(no host sync); rows dropped over every run: {drops}")
    model = _model(a)
    print(f"{'chunks':>6} {'fwd ms':>8} {'fwd+bwd ms':>11} {'vs 1 round':>10} {'model fwd+bwd ms':>17}")
    for n in a.chunks:
        fwd = statistics.mean(r[n]["fwd_us"] for r in results) / 1e3
        fb = statistics.mean(r[n]["fwd_bwd_us"] for r in results) / 1e3
        ref = statistics.mean(r[1]["fwd_bwd_us"] for r in results) / 1e3
        print(f"{n:>6} {fwd:>8.3f} {fb:>11.3f} {ref / fb:>9.2f}x {model[n].total_us / 1e3:>17.3f}")
    if not a.cpu:
        print("\nforward, rank 0, one run per chunk count: the compute stream's time outside the chunks' GEMMs "
              "is the exposed communication")
        print(f"{'chunks':>6} {'layer ms':>9} {'GEMMs ms':>9} {'exposed ms':>11} {'hidden vs 1 round':>18}")
        base = exposed_ms(results[0][1]["timeline"])[2]
        for n in a.chunks:
            end, gemm, exposed = exposed_ms(results[0][n]["timeline"])
            hidden = f"{100 * (1 - exposed / base):.0f}%" if base > 0 else "n/a"
            print(f"{n:>6} {end:>9.3f} {gemm:>9.3f} {exposed:>11.3f} {hidden:>18}")
        if a.profile:
            print(f"\nkernels of one forward at {max(a.chunks)} chunks (torch.profiler; 'beside': our kernels' time while "
                  f"a kernel of another stream ran)")
            for r, res in enumerate(results):
                p = res["profile"]
                share = f"{100 * p['beside_us'] / p['ours_us']:.0f}%" if p["ours_us"] else "n/a"
                print(f"  rank {r}: our kernels {p['ours_us'] / 1e3:.3f} ms, other kernels {p['other_us'] / 1e3:.3f} ms, "
                      f"ours beside others {p['beside_us'] / 1e3:.3f} ms ({share}); {p['kernels']} kernels")
        n = max(a.chunks)
        print(f"\nforward timeline, {n} chunks, rank 0 (ms since the layer's start; 'arrived': the chunk's dispatch "
              f"finished; 'started' / 'computed': its GEMMs on the compute stream; 'end': the output usable)")
        for point, c, ms in sorted(results[0][n]["timeline"], key=lambda e: e[2]):
            print(f"  {ms:8.3f}  {'chunk ' + str(c) if c >= 0 else 'layer':<8}  {point}")
    return 0


if __name__ == "__main__":
    cli.quiet()
    sys.exit(cli.run_main(main, prog=PROG))
