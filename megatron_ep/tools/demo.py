"""The main job: a small MoE layer on R processes, end to end.

Each rank routes its tokens (softmax top-k router), dispatches them expert-major to the ranks
that own the experts, runs the experts (2-layer MLPs, probs applied by the experts as Megatron
does), combines, and back-propagates. Every rank also evaluates the same layer densely on its
own tokens (all expert weights are known everywhere), so the table shows how far the
distributed result and its gradients are from the dense ones.

    python -m megatron_ep.tools.demo                       # 4 CPU processes, reference backend
    python -m megatron_ep.tools.demo --ranks 2 --rank-major
    torchrun --nproc-per-node 4 -m megatron_ep.tools.demo  # under an existing launcher (NCCL on GPUs)
"""

from __future__ import annotations

import os
import sys
import time

from megatron_ep.tools import cli

PROG = "python -m megatron_ep.tools.demo"
if __name__ == "__main__":
    cli.require("torch", prog=PROG, alternative="`bash scripts/run_demo.sh`, which sets it up and runs the demo")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_ep as mep  # noqa: E402
from megatron_ep.tools import resources  # noqa: E402


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--ranks", type=cli.integer(), default=4,
                   help="processes to start on this machine (gloo, CPU tensors); ignored under torchrun, which sets them")
    p.add_argument("--backend", default="auto", choices=["torch", "cuda", "auto"],
                   help="megatron_ep Buffer backend: torch (reference, anywhere), cuda (our kernels: a Hopper GPU, the "
                        "extension built, ranks on GPUs via torchrun), auto (cuda where it can run, else torch)")
    p.add_argument("--tokens", type=cli.integer(), default=96, help="tokens on rank 0 (the others get uneven counts)")
    p.add_argument("--hidden", type=cli.integer(), default=256, help="hidden size of a token")
    p.add_argument("--ffn", type=cli.integer(), default=128, help="intermediate size of each expert's MLP")
    p.add_argument("--experts", type=cli.integer(), default=16, help="experts in all (a multiple of the number of ranks)")
    p.add_argument("--topk", type=cli.integer(), default=4, help="experts per token (at most --experts)")
    p.add_argument("--alignment", type=cli.integer(), default=16, help="expert-major segments are padded to a multiple of this")
    p.add_argument("--rank-major", action="store_true", help="rank-major dispatch + local permute instead of the fused permute")
    p.add_argument("--steps", type=cli.integer(), default=3, help="forward + backward steps (the table shows the best time)")
    resources.add_force(p)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def validate(args, world: int) -> None:
    """Refuse, before any process starts, what would fail inside the ranks or not fit on this
    machine (option types and ranges are the parser's)."""
    cli.check(args.experts % world == 0,
              f"--experts {args.experts} must be a multiple of the number of ranks ({world}): each rank owns "
              "the same number of experts")
    cli.check(args.topk <= args.experts, f"--topk {args.topk} is more than the {args.experts} experts (--experts)")
    if args.backend == "cuda":
        # what this machine lacks first: torchrun is suggested only where the cuda backend can run
        cli.check(torch.cuda.is_available(), "--backend cuda needs a CUDA GPU (none is visible); use --backend torch")
        major, minor = torch.cuda.get_device_capability()
        cli.check(major == 9, f"--backend cuda: megatron_ep's kernels are built for Hopper (sm_90) only; this GPU is "
                              f"sm_{major}{minor}: use --backend torch")
        cli.check(mep.cuda_backend_available(), "--backend cuda: megatron_ep's CUDA extension is not built here (see the "
                                                "README, 'Use it in your own environment'); use --backend torch")
        cli.check(cli.world_size_from_env() is not None,
                  "--backend cuda: the demo's own processes keep their tokens on the CPU (gloo); launch it with "
                  "torchrun (NCCL, one GPU per rank): torchrun --nproc-per-node N -m megatron_ep.tools.demo --backend cuda")
    # the demo's own ranks are gloo on the CPU; under torchrun, NCCL on GPUs unless --backend torch
    on_gpu = cli.world_size_from_env() is not None and args.backend != "torch" and torch.cuda.is_available()
    resources.refuse_unless_fits(resources.demo_need(args, world, on_gpu), force=args.force)


def expert_mlp(x, w1, w2):
    return torch.nn.functional.gelu(x @ w1) @ w2


def moe_distributed(buf, x, idx, probs, w1, w2, args, timings):
    E, R = args.experts, buf.num_ranks
    L, first = E // R, buf.rank * (E // R)
    t0 = time.perf_counter()
    if args.rank_major:
        out = mep.dispatch(buf, x, idx, probs, num_experts=E)
        t1 = time.perf_counter()
        y_rows = torch.zeros(out.x.shape, dtype=torch.float32, device=x.device)
        for e in range(L):  # local permute: rows naming expert e, weighted by their prob
            rows, slots = (out.topk_idx == e).nonzero(as_tuple=True)
            h = expert_mlp(out.x[rows].float(), w1[first + e], w2[first + e])
            y_rows = y_rows.index_add(0, rows, h * out.topk_weights[rows, slots].unsqueeze(1))
        y_rows = y_rows.to(x.dtype)
    else:
        out = mep.dispatch(buf, x, idx, probs, num_experts=E, permute=True, expert_alignment=args.alignment)
        t1 = time.perf_counter()
        pieces, start = [], 0
        for e, n in enumerate(out.tokens_per_expert.tolist()):  # padded segments, pad weight 0
            seg = slice(start, start + n)
            h = expert_mlp(out.x[seg].float(), w1[first + e], w2[first + e])
            pieces.append(h * out.topk_weights[seg].unsqueeze(1))
            start += n
        y_rows = torch.cat(pieces).to(x.dtype) if pieces else out.x.new_zeros(out.x.shape)
    t2 = time.perf_counter()
    y = mep.combine(buf, y_rows, out.handle).x
    t3 = time.perf_counter()
    timings.append((t1 - t0, t3 - t2))
    return y, out


def moe_dense(x, idx, probs, w1, w2):
    # 0 * x, not a fresh zeros tensor: y stays in x's graph when no row picks an expert (a rank
    # with no tokens), so its backward gives x a zero gradient instead of failing
    y = x.double() * 0
    for k in range(idx.shape[1]):
        for e in idx[:, k].unique().tolist():
            if e < 0:
                continue
            rows = (idx[:, k] == e).nonzero().flatten()
            h = expert_mlp(x[rows].double(), w1[e].double(), w2[e].double())
            y = y.index_add(0, rows, h * probs[rows, k].double().unsqueeze(1))
    return y


def rel_err(a, b):
    """|a - b| / |b|; inf when a is missing or of another shape (a gradient that never reached
    x), 0 for two empty tensors (a rank with no tokens)."""
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run(args):
    rank, R = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    gen = torch.Generator().manual_seed(1234)  # the same expert weights on every rank
    E, H, F, K = args.experts, args.hidden, args.ffn, args.topk
    w1 = (torch.randn((E, H, F), generator=gen) / H ** 0.5).to(device)
    w2 = (torch.randn((E, F, H), generator=gen) / F ** 0.5).to(device)
    router = (torch.randn((H, E), generator=gen) / H ** 0.5).to(device)
    T = max(0, args.tokens - 17 * rank) if rank != R - 1 or R == 1 else args.tokens // 3  # uneven
    local = torch.Generator().manual_seed(99 + rank)
    # "auto" follows the tokens: the cuda backend only where they live on a GPU (torchrun + NCCL)
    backend = "torch" if args.backend == "auto" and device.type != "cuda" else args.backend
    buf = mep.Buffer(dist.group.WORLD, backend=backend, max_tokens_per_rank=args.tokens)
    timings, errs = [], []
    for step in range(args.steps):
        x = torch.randn((T, H), generator=local).to(device=device, dtype=torch.bfloat16).requires_grad_()
        probs_all = torch.softmax(x.float() @ router, dim=-1)
        probs, idx = probs_all.topk(K, dim=-1)
        y, out = moe_distributed(buf, x, idx, probs, w1, w2, args, timings)
        (y.float() ** 2).sum().backward()
        # dense fp64 reference on the same tokens and routing; the gradient reaches x through
        # the experts and through the router probs (which ride along the dispatch)
        xd = x.detach().double().requires_grad_()
        probs_d = torch.softmax(xd @ router.double(), dim=-1).gather(1, idx)
        yd = moe_dense(xd, idx, probs_d, w1, w2)
        (yd ** 2).sum().backward()
        errs.append((rel_err(y, yd), rel_err(x.grad, xd.grad)))
    stats = dict(rank=rank, tokens=T, rows=out.handle.num_recv_rows,
                 per_expert=out.tokens_per_expert.tolist(), dispatch_ms=1e3 * min(t[0] for t in timings),
                 combine_ms=1e3 * min(t[1] for t in timings), fwd_err=max(e[0] for e in errs),
                 grad_err=max(e[1] for e in errs))
    gathered = [None] * R
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        layout = "rank-major + local permute" if args.rank_major else f"expert-major (fused permute, alignment {args.alignment})"
        print(f"megatron_ep demo: {R} ranks, backend={buf.backend}, {E} experts top-{K}, hidden {H}, {layout}, {args.steps} steps")
        print(f"{'rank':>4} {'tokens':>6} {'rows in':>7} {'rows per local expert':<24} {'dispatch ms':>11} {'combine ms':>10} {'y rel err':>9} {'dx rel err':>10}")
        for s in gathered:
            pe = ",".join(str(n) for n in s["per_expert"])
            print(f"{s['rank']:>4} {s['tokens']:>6} {s['rows']:>7} {pe:<24} {s['dispatch_ms']:>11.2f} {s['combine_ms']:>10.2f} {s['fwd_err']:>9.1e} {s['grad_err']:>10.1e}")
        worst = max(max(s["fwd_err"], s["grad_err"]) for s in gathered)
        verdict = "OK" if worst < 2e-2 else "MISMATCH"
        print(f"distributed vs dense fp64 (bf16 activations): worst relative error {worst:.1e} -> {verdict}")
    buf.destroy()
    return gathered


def _init_process_group(args) -> None:
    if cli.launched_by_us():  # our own ranks (main below): gloo and CPU tensors, as documented
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        return
    use_nccl = torch.cuda.is_available() and args.backend != "torch"  # under torchrun
    if use_nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_nccl else "gloo")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    world = cli.world_size_from_env()
    if world is None:  # start --ranks processes of this same command
        validate(args, args.ranks)
        return cli.launch(args.ranks, [sys.executable, "-m", "megatron_ep.tools.demo", *argv], prog=PROG)
    validate(args, world)  # under torchrun: every rank checks, rank 0 says it
    _init_process_group(args)
    try:
        run(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    cli.quiet()
    sys.exit(cli.run_main(main, prog=PROG))
