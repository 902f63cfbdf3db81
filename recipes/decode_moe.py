"""One decode step of a small megatron-core GPT with MoE layers on megatron_ep's low-latency path,
checked against Megatron's own forward of the same step.

    python recipes/decode_moe.py --nproc-per-node 2                      # CPU: gloo, torch backend
    torchrun --nproc-per-node 2 recipes/decode_moe.py --dispatcher hybridep --backend cuda

The model is recipes/train_moe.py's (DeepSeek-V3-style MoE layers; same options). Each rank
prefills its own prompts (--micro-batch sequences of --seq-len tokens) through Megatron's
`StaticInferenceContext` (KV cache) with the normal dispatcher, then runs one decode step (one
new token per sequence) twice: Megatron's own MoE forward, and with
`megatron_ep.megatron.decode.enable_decode(model)`, whose pre-hook sees
`inference_context.is_decode_only()` and sends every MoE layer through low-latency dispatch ->
masked expert MLP -> low-latency combine. Prints the largest logit difference and fails if it
is above --tol (fp32 on CPU; bf16 on GPUs).

The default tolerance and why: TOLERANCE below (printed by --help).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_ep.tools import cli  # noqa: E402

PROG = "recipes/decode_moe.py"
if __name__ == "__main__":
    cli.require("torch", "megatron.core", prog=PROG)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_ep.tools import resources  # noqa: E402
from megatron_ep.core.checks import FP8_DTYPE  # noqa: E402
from megatron_ep.core.protocol import FP8_BLOCK  # noqa: E402
from recipes import train_moe  # noqa: E402

TOLERANCE = """\
Default --tol (max |logit difference| / max |logit|): 1e-4 in fp32 (CPU), 3e-2 in bf16 (GPUs);
with --fp8 that plus 2^-4, FP8's rounding:
* e4m3 keeps 3 mantissa bits (torch.finfo(float8_e4m3fn).eps = 2^-3), and the cast scales each
  128-channel block of a row by its own amax / 448, so every dispatched element is rounded to
  nearest within 2^-4 of itself (relative);
* an expert's first GEMM sums those elements times its weights, so its output moves by at most
  2^-4 of the sum of the terms' magnitudes; to first order the MoE layer's output moves by that
  relative amount, and the logits, projected from the residual stream that output is added to,
  by no more, if the layers after it do not amplify a relative change (an assumption: the
  SwiGLU product and, on DeepGEMM, FP8 weights can each add another 2^-4 in the worst case);
* the rounding errors are independent and of either sign, so they mostly cancel in those sums:
  the runs stay an order of magnitude under 2^-4 (0.005 on CPU at --hidden 128; 0.0074 on
  2 H200s at --hidden 256, docs/performance.md), while a token sent to a wrong expert or a lost
  scale moves the logits by a large fraction of their scale.
"""
DTYPE_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # Megatron's forward vs ours, unquantized
FP8_ROUNDING = torch.finfo(FP8_DTYPE).eps / 2  # 2^-4: round to nearest with 3 mantissa bits


def default_tol(dtype: torch.dtype, fp8: bool) -> float:
    """The dtype's tolerance, plus FP8's rounding bound with --fp8 (TOLERANCE says why)."""
    return DTYPE_TOL[dtype] + (FP8_ROUNDING if fp8 else 0.0)


def build_parser() -> cli.ArgumentParser:
    p = train_moe.add_args(cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=TOLERANCE),
                          training=False)
    p.add_argument("--max-tokens-per-rank", type=cli.integer(), default=128,
                   help="low-latency capacity (decode tokens per rank)")
    p.add_argument("--fp8", action="store_true",
                   help=f"FP8 low-latency dispatch (--hidden a multiple of {FP8_BLOCK}: one scale per {FP8_BLOCK} channels)")
    p.add_argument("--tol", type=cli.number(0, above=True), default=None,
                   help=f"largest allowed |logit difference| / max |logit|; default {DTYPE_TOL[torch.float32]:g} fp32 "
                        f"(CPU), {DTYPE_TOL[torch.bfloat16]:g} bf16 (GPUs), each plus {FP8_ROUNDING:g} with --fp8 "
                        "(e4m3's rounding: see below)")
    resources.add_force(p)
    p.set_defaults(seq_len=8, dispatcher="deepep", time_comm=False)
    return p


def validate(args, world: int) -> None:
    """train_moe's checks and the decode step's own, before any process or model exists."""
    train_moe.validate(args, world)
    cli.check(not args.fp8 or args.hidden % FP8_BLOCK == 0,
              f"--fp8 needs --hidden a multiple of {FP8_BLOCK} (one FP8 scale per {FP8_BLOCK} channels), got "
              f"--hidden {args.hidden}")
    cli.check(args.micro_batch <= args.max_tokens_per_rank,
              f"--micro-batch {args.micro_batch} is more than --max-tokens-per-rank {args.max_tokens_per_rank} "
              "(one decode token per sequence)")
    train_moe.check_resources(args, world)


def prefill_and_decode(model, tokens, ctx):
    """Prefill the prompts into ctx's KV cache, then one decode forward on the last token;
    returns the decode step's logits (the cache's decode slot is rewritten identically on a rerun)."""
    B, P = tokens.shape
    position_ids = torch.arange(P, device=tokens.device).unsqueeze(0).expand(B, -1)
    mask = torch.triu(torch.ones(P, P, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
    model(tokens, position_ids, mask, inference_context=ctx, runtime_gather_output=True)
    ctx.sequence_len_offset += P
    ctx.enable_decode_mode()
    nxt = tokens[:, -1:]  # the "new" token (any id works for the comparison)
    return model(nxt, torch.full((B, 1), P, device=tokens.device), None, inference_context=ctx, runtime_gather_output=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    started = train_moe.start(args, argv, __file__, PROG, validate)
    if not isinstance(started, train_moe.Started):
        return started
    rank, world, device, on_gpu = started.rank, started.world, started.device, started.on_gpu

    from megatron.core import parallel_state as ps
    from megatron.core.inference.contexts import StaticInferenceContext

    import megatron_ep.megatron
    import megatron_ep.megatron.decode as mep_decode

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    if args.dispatcher != "alltoall":
        megatron_ep.megatron.install()
    tr = train_moe.build_trainer(args, device, on_gpu)
    model = tr.model.eval()
    g = torch.Generator().manual_seed(args.seed + rank)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=g).to(device)

    with torch.no_grad():
        ctx = StaticInferenceContext(args.micro_batch, args.seq_len + 1)
        want = prefill_and_decode(model, tokens, ctx)  # Megatron's own MoE forward throughout
        layers = mep_decode.enable_decode(model, max_tokens_per_rank=args.max_tokens_per_rank, use_fp8=args.fp8)
        ctx = StaticInferenceContext(args.micro_batch, args.seq_len + 1)
        got = prefill_and_decode(model, tokens, ctx)  # prefill: normal path; decode step: low latency
    decode_calls = sum(layer.megatron_ep_decode.decode_calls for layer in layers)
    scale = want.float().abs().max().item()
    diff = (got.float() - want.float()).abs().max().item() / max(scale, 1e-6)
    stats = torch.tensor([diff, float(decode_calls != len(layers))], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    tol = args.tol if args.tol is not None else default_tol(want.dtype, args.fp8)
    if rank == 0:
        print(f"{train_moe.describe(tr)}\ndecode step: {len(layers)} MoE layers on the low-latency path "
              f"(fp8={args.fp8}); logits {tuple(want.shape)} {want.dtype}; max |diff| / max |logit| over ranks = "
              f"{stats[0].item():.3g} (tolerance {tol:g})", flush=True)
    ok = stats[0].item() <= tol and stats[1].item() == 0
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    if not ok:  # run_main prefixes the command's name
        raise SystemExit("the decode step differs from Megatron's forward by more than the tolerance"
                         if stats[1].item() == 0 else "a MoE layer skipped the decode path")
    if rank == 0:
        print("OK", flush=True)
    return 0


if __name__ == "__main__":
    cli.quiet()
    sys.exit(cli.run_main(main, prog=PROG))
