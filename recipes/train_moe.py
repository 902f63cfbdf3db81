"""Train a small megatron-core GPT with DeepSeek-V3-style MoE layers on synthetic tokens.

    python recipes/train_moe.py --nproc-per-node 2 --dispatcher hybridep
    torchrun --nproc-per-node 2 recipes/train_moe.py --dispatcher hybridep   # the same, under torchrun
    torchrun --nproc-per-node 8 recipes/train_moe.py --dispatcher deepep --backend cuda \\
        --hidden 1024 --experts 64 --topk 8 --seq-len 2048 --micro-batch 2

Model: first layer dense, the rest MoE (DeepSeek-V3 layout): sigmoid router scores,
group-limited top-k (one group per EP rank: device-limited routing), top-k probs normalised and
scaled, aux-loss-free expert bias updated every step (plus a small sequence aux loss), one
shared expert, SwiGLU experts run by megatron_ep.experts.GroupedGemmExperts on the dispatch
layout. Parallelism: EP = data parallel = world size (TP = PP = 1).

--dispatcher: alltoall (Megatron's own), deepep or hybridep (Megatron's flex dispatcher with
megatron_ep's managers installed). --backend: megatron_ep's Buffer backend (torch reference,
cuda kernels, auto; default MEGATRON_EP_BACKEND, else auto). Runs on CPU with gloo (reference
backend) and on GPUs with NCCL. Prints per step: loss, step time, tokens/s, dispatch and
combine time (fwd + bwd, summed over layers, max over ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_ep.tools import cli  # noqa: E402

PROG = "recipes/train_moe.py"
if __name__ == "__main__":
    cli.require("torch", "megatron.core", prog=PROG)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_ep.tools import resources  # noqa: E402
from megatron_ep.experts.overlap import MAX_CHUNKS  # noqa: E402
from megatron_ep.megatron import backend as backend_env  # noqa: E402
from recipes.comm_timer import CommTimer  # noqa: E402


# Options that act on training only (steps, optimiser, timers, chunked experts, shared-expert
# overlap), and their values for a command that runs no training (add_args(training=False)).
TRAINING_ONLY = {"steps": 6, "lr": 3e-3, "time_comm": True, "chunked_experts": 0, "shared_expert_overlap": False}


def add_args(p: argparse.ArgumentParser, dispatcher: bool = True, training: bool = True) -> argparse.ArgumentParser:
    """The recipe's options (model size, backend, steps, seed); `dispatcher=False` leaves out
    --dispatcher for tools that pick dispatchers themselves (scripts/ab_throughput.py);
    `training=False` leaves out TRAINING_ONLY's options (recipes/decode_moe.py) and sets their
    values."""
    if dispatcher:
        p.add_argument("--dispatcher", choices=("alltoall", "deepep", "hybridep"), default="hybridep",
                       help="alltoall: Megatron's own dispatcher; deepep / hybridep: Megatron's flex dispatcher with "
                            "megatron_ep's managers (rank-major + local permute / permute fused into dispatch)")
    p.add_argument("--nproc-per-node", type=cli.integer(), default=2,
                   help="ranks to start on this machine when run with plain python (as torchrun --nproc-per-node "
                        "would; one GPU each where there are GPUs); ignored under torchrun")
    p.add_argument("--backend", choices=backend_env.BACKENDS, default=None,
                   help="megatron_ep Buffer backend: torch (reference), cuda (our kernels: Hopper GPUs, extension "
                        f"built), auto (cuda where it can run, else torch); default: {backend_env.ENV}, else auto "
                        "(the option wins over the variable)")
    p.add_argument("--experts-impl", choices=("grouped", "sequential"), default="grouped",
                   help="megatron_ep GroupedGemmExperts, or Megatron's SequentialMLP")
    if training:
        p.add_argument("--steps", type=cli.integer(), default=TRAINING_ONLY["steps"], help="training steps")
    p.add_argument("--layers", type=cli.integer(2), default=3, help="transformer layers: the first dense, the rest MoE (at least 2)")
    p.add_argument("--hidden", type=cli.integer(), default=64, help="hidden size (a multiple of --heads)")
    p.add_argument("--heads", type=cli.integer(), default=4, help="attention heads")
    p.add_argument("--ffn", type=cli.integer(), default=128, help="dense-layer FFN size")
    p.add_argument("--expert-ffn", type=cli.integer(), default=32, help="FFN size of each expert and of the shared expert")
    p.add_argument("--experts", type=cli.integer(), default=8, help="routed experts per MoE layer (a multiple of the world size)")
    p.add_argument("--topk", type=cli.integer(), default=2,
                   help="experts per token (at most --group-topk x experts per rank: one router group per rank)")
    p.add_argument("--group-topk", type=cli.integer(), default=None,
                   help="router groups (= EP ranks) a token may use; default: half the ranks, at least 1")
    p.add_argument("--vocab", type=cli.integer(), default=256, help="vocabulary size of the synthetic tokens")
    p.add_argument("--seq-len", type=cli.integer(), default=32, help="sequence length")
    p.add_argument("--micro-batch", type=cli.integer(), default=2, help="sequences per rank and step")
    p.add_argument("--seed", type=cli.integer(0, 2**32 - 1), default=1234, help="seed of the weights and the synthetic data")
    if not training:
        p.set_defaults(**TRAINING_ONLY)
        _add_virtual_ranks(p)
        return p
    p.add_argument("--lr", type=cli.number(0, above=True), default=TRAINING_ONLY["lr"], help="AdamW learning rate")
    p.add_argument("--no-time-comm", dest="time_comm", action="store_false", help="skip the dispatch/combine timers")
    p.add_argument("--chunked-experts", type=cli.integer(0, MAX_CHUNKS), default=0, metavar="CHUNKS",
                   help="run each MoE layer's dispatch, experts and combine in this many pipelined token chunks "
                        "(megatron_ep.megatron.chunked; hybridep + grouped experts; 0: off, or "
                        "MEGATRON_EP_CHUNKED_EXPERTS)")
    p.add_argument("--shared-expert-overlap", action="store_true",
                   help="Megatron's moe_shared_expert_overlap: the shared expert runs on its own CUDA stream while "
                        "dispatch and combine are in flight (GPU only)")
    _add_virtual_ranks(p)
    return p


def _add_virtual_ranks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--virtual-ranks", action="store_true",
                   help="several processes share the GPU(s) (virtual EP on one GPU; run under MPS): gloo carries "
                        "Megatron's own collectives, megatron_ep's CUDA IPC transport the MoE tokens; flex dispatchers only "
                        "(NCCL refuses several ranks on one GPU, gloo has no GPU all-to-all)")


def build_parser() -> cli.ArgumentParser:
    p = add_args(cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0]))
    resources.add_force(p)
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def backend_choice(args):
    """(megatron_ep's Buffer backend for this run, the line saying that --backend overrides a
    different MEGATRON_EP_BACKEND, or None): --backend, else the variable, else auto. A bad value
    of the variable is refused (cli.UsageError, one line)."""
    return backend_env.resolve(args.backend, "--backend")


def use_backend(args) -> None:
    """In a rank: MEGATRON_EP_BACKEND (which the flex managers read) and args.backend set to the
    run's backend; rank 0 says when --backend overrides the variable."""
    args.backend, overridden = backend_choice(args)
    if overridden:
        cli.note(overridden)
    os.environ[backend_env.ENV] = args.backend


def validate(args, world: int) -> None:
    """Refuse, before any process group or model exists, what would fail later inside
    Megatron or the ranks (cli.UsageError, one line). `world`: the number of ranks."""
    from megatron_ep.megatron import check_environment

    try:  # the variables the managers read later (install() checks them again, inside the ranks)
        check_environment()
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    cli.check(args.hidden % args.heads == 0, f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    cli.check(args.experts % world == 0,
              f"--experts {args.experts} must be a multiple of the world size {world}: each rank owns the same "
              "number of experts")
    group_topk = args.group_topk or max(1, world // 2)
    cli.check(group_topk <= world, f"--group-topk {group_topk} is more than the {world} router groups (one per rank)")
    reachable = group_topk * (args.experts // world)
    cli.check(args.topk <= reachable,
              f"--topk {args.topk} is more than the {reachable} experts a token can reach: --group-topk {group_topk} "
              f"group(s) of {args.experts // world} experts (--experts {args.experts} over {world} ranks)")
    dispatcher = getattr(args, "dispatcher", None)
    cli.check(not (args.virtual_ranks and dispatcher == "alltoall"),
              "--virtual-ranks needs a flex dispatcher (deepep, hybridep): Megatron's alltoall dispatcher needs a GPU "
              "all-to-all, which gloo lacks and NCCL refuses for several ranks on one GPU")
    if args.shared_expert_overlap:
        import megatron.core

        version = tuple(int(x) for x in megatron.core.__version__.split(".")[:2])
        # flex here (train_moe's --dispatcher) or among the A/B tool's --backends
        flex = [d for d in [dispatcher] + str(getattr(args, "backends", "") or "").split(",") if d and d != "alltoall"]
        cli.check(not flex or version >= (0, 19),
                  f"--shared-expert-overlap with a flex dispatcher needs megatron-core >= 0.19 (this is "
                  f"{megatron.core.__version__}, whose config accepts moe_shared_expert_overlap with alltoall only)")
        cli.check(torch.cuda.is_available(),
                  "--shared-expert-overlap needs a CUDA GPU (Megatron runs the shared expert on its own CUDA stream)")
    backend, _ = backend_choice(args)
    if backend == "cuda":
        from megatron_ep.core.buffer import cuda_backend_available

        cli.check(torch.cuda.is_available(), "the cuda backend needs a CUDA GPU (none is visible); use --backend torch")
        cli.check(cuda_backend_available(), "the cuda backend: megatron_ep's CUDA extension is not built here "
                                            "(README, 'Use it in your own environment'); use --backend torch")
    if world == 1 and dispatcher in ("deepep", "hybridep"):
        import megatron.core

        major, minor = (int(x) for x in megatron.core.__version__.split(".")[:2])
        cli.check(dispatcher == "hybridep" and (major, minor) >= (0, 19),
                  f"megatron-core {megatron.core.__version__} refuses the flex dispatcher ({dispatcher}) at TP x EP = 1: "
                  "use 2 or more ranks, hybridep with megatron-core >= 0.19, or --dispatcher alltoall")


def check_resources(args, world: int) -> None:
    """Refuse, before any process starts, a run that does not fit this machine (--force skips
    it): the ranks run on the GPUs wherever CUDA is visible (init_distributed)."""
    need = resources.moe_gpt_need(args, world, on_gpu=torch.cuda.is_available())
    resources.refuse_unless_fits(need, force=args.force)


def init_distributed(virtual_ranks: bool = False):
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        if virtual_ranks:  # before CUDA starts: the ranks share one GPU (megatron_ep/backends/cuda/sharing.py)
            from megatron_ep.backends.cuda import sharing

            sharing.prepare_shared_gpu()
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local % torch.cuda.device_count() if virtual_ranks else local)
    dist.init_process_group("nccl" if on_gpu and not virtual_ranks else "gloo", timeout=datetime.timedelta(minutes=5))
    if not on_gpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
        from recipes import cpu_shims

        cpu_shims.apply()
    return on_gpu



@dataclasses.dataclass
class Started:
    """A rank's place once `start` joined it to the run."""
    rank: int
    world: int
    device: torch.device
    on_gpu: bool


def start(args, argv, script: str, prog: str, check) -> "int | Started":
    """How each command of the recipes starts (this one, recipes/decode_moe.py,
    scripts/ab_throughput.py). Under plain python (no launcher's environment): `check(args, n)`
    for the --nproc-per-node ranks, then those ranks started running `script` with `argv`; their
    exit code comes back. Inside a rank: `check(args, world)`, the process group joined, the
    backend chosen (use_backend); the rank's Started comes back."""
    world = cli.world_size_from_env()
    if world is None:
        check(args, args.nproc_per_node)
        return cli.launch(args.nproc_per_node, [sys.executable, os.path.abspath(script), *argv], prog=prog)
    check(args, world)
    on_gpu = init_distributed(args.virtual_ranks)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    use_backend(args)
    return Started(dist.get_rank(), dist.get_world_size(), device, on_gpu)

def build_config(args, world: int, on_gpu: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    flex = args.dispatcher != "alltoall"
    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16 if on_gpu else torch.float32, bf16=on_gpu, pipeline_dtype=torch.bfloat16 if on_gpu else torch.float32,
        use_cpu_initialization=not on_gpu, gradient_accumulation_fusion=False,
        expert_model_parallel_size=world,
        # DeepSeek-V3-style MoE
        num_moe_experts=args.experts, moe_layer_freq=[0] + [1] * (args.layers - 1), moe_ffn_hidden_size=args.expert_ffn,
        moe_router_topk=args.topk, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
        moe_router_num_groups=world, moe_router_group_topk=args.group_topk or max(1, world // 2),
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=args.expert_ffn,
        moe_shared_expert_overlap=bool(getattr(args, "shared_expert_overlap", False)),
        moe_token_dispatcher_type="flex" if flex else "alltoall",
        moe_flex_dispatcher_backend=args.dispatcher if flex else "deepep",
    )


def is_moe_spec(mlp) -> bool:
    """Whether a layer spec's MLP is an MoE layer (0.16 ModuleSpec or 0.19 builder)."""
    from megatron_ep.megatron import compat

    return hasattr(compat.moe_submodules(mlp) if hasattr(mlp, "submodules") or hasattr(mlp, "keywords") else None, "experts")


def decoder_block_spec(config, args):
    """Megatron's local (no TE) decoder block spec, MoE experts swapped for megatron_ep's
    GroupedGemmExperts unless --experts-impl sequential."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_ep.experts import GroupedGemmExperts
    from megatron_ep.megatron import compat

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if args.experts_impl == "grouped":
        layers = []
        for layer in block.layer_specs:
            mlp = layer.submodules.mlp
            if is_moe_spec(mlp):
                layer = dataclasses.replace(layer, submodules=dataclasses.replace(
                    layer.submodules, mlp=compat.with_experts(mlp, GroupedGemmExperts)))
            layers.append(layer)
        block = dataclasses.replace(block, layer_specs=layers)
    return block


def build_model(config, args):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=decoder_block_spec(config, args), vocab_size=args.vocab,
                    max_sequence_length=args.seq_len, position_embedding_type="rope")


def synthetic_batch(args, step: int, rank: int, device):
    """Sequences that follow t[i+1] = (5 t[i] + 3) mod V from a random start: learnable."""
    g = torch.Generator().manual_seed(args.seed + 1000 * step + rank)
    cols = [torch.randint(0, args.vocab, (args.micro_batch, 1), generator=g)]
    for _ in range(args.seq_len):
        cols.append((5 * cols[-1] + 3) % args.vocab)
    seq = torch.cat(cols, dim=1)  # [B, S + 1]
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    position_ids = torch.arange(args.seq_len).unsqueeze(0).expand(args.micro_batch, -1).contiguous()
    # explicit causal mask (True = masked): Megatron's default one is built on "cuda"
    mask = torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool), diagonal=1)[None, None]
    return tokens.to(device), labels.to(device), position_ids.to(device), mask.to(device)


def allreduce_non_expert_grads(model, group):
    """Data parallel = world: average replicated weights' grads; expert weights
    (allreduce=False) each live on one rank only (expert data-parallel size 1)."""
    world = dist.get_world_size(group)
    grads = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "allreduce", True)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def broadcast_non_expert_params(model):
    """Replicated weights start equal everywhere (expert weights stay per rank)."""
    with torch.no_grad():
        for p in model.parameters():
            if getattr(p, "allreduce", True):
                dist.broadcast(p.data, src=0)


@dataclasses.dataclass
class Trainer:
    """One training run's state: built by build_trainer, advanced by train_step."""

    args: argparse.Namespace
    config: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    timer: CommTimer
    moe_layers: list
    device: torch.device
    on_gpu: bool
    world: int

    @property
    def tokens_per_step(self) -> int:
        return self.args.micro_batch * self.args.seq_len * self.world


@dataclasses.dataclass
class StepStats:
    """One step, agreed over ranks: loss summed over ranks of loss / world, the rest max."""

    loss: float
    step_s: float
    dispatch_s: float
    combine_s: float


STEP_HEADER = f"{'step':>4} {'loss':>8} {'step ms':>9} {'tok/s':>9} {'dispatch ms':>12} {'combine ms':>11}"


def seed_everything(args, rank: int, on_gpu: bool) -> None:
    torch.manual_seed(args.seed + rank)  # expert weights differ per rank; the rest is broadcast
    if on_gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)


def build_trainer(args, device, on_gpu: bool) -> Trainer:
    """Seed, config, model (replicated weights broadcast from rank 0), AdamW, comm timers.
    Megatron's parallel state must be initialised, and megatron_ep installed for flex
    dispatchers, before this is called."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    world = dist.get_world_size()
    seed_everything(args, dist.get_rank(), on_gpu)
    config = build_config(args, world, on_gpu)
    model = build_model(config, args).to(device)
    from megatron_ep.megatron.chunked import apply_from_env

    apply_from_env(model, getattr(args, "chunked_experts", 0))
    broadcast_non_expert_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    timer = CommTimer(sync_cuda=on_gpu)
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if args.time_comm:
        for layer in moe_layers:
            timer.wrap(layer.token_dispatcher)
    return Trainer(args, config, model, optimizer, timer, moe_layers, device, on_gpu, world)


def describe(tr: Trainer) -> str:
    """The run's one-line header (dispatcher, manager, buffer backend, experts, sizes)."""
    from megatron_ep.megatron.buffers import choose_backend

    n_params = sum(p.numel() for p in tr.model.parameters())
    dispatcher = tr.moe_layers[0].token_dispatcher
    mgr = getattr(dispatcher, "_comm_manager", None)
    backend = choose_backend(tr.device) if mgr is not None else "-"
    return (f"world={tr.world} dispatcher={tr.args.dispatcher} manager={type(mgr).__name__ if mgr else type(dispatcher).__name__} "
            f"buffer_backend={backend} experts={type(tr.moe_layers[0].experts).__name__}"
            f"{' chunks=' + str(tr.moe_layers[0]._mep_chunks) if hasattr(tr.moe_layers[0], '_mep_chunks') else ''} "
            f"moe_layers={len(tr.moe_layers)} "
            f"params/rank={n_params} device={tr.device.type}")


def run_step(tr: Trainer, step: int):
    """One optimiser step on this rank, no collective outside the model's own:
    (local loss tensor, step seconds). The comm totals are left in tr.timer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    tokens, labels, position_ids, mask = synthetic_batch(tr.args, step, dist.get_rank(), tr.device)
    tr.timer.reset()
    if tr.on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tr.optimizer.zero_grad(set_to_none=True)
    loss = tr.model(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    allreduce_non_expert_grads(tr.model, ps.get_data_parallel_group())
    _update_router_expert_bias([tr.model], tr.config)
    tr.optimizer.step()
    if tr.on_gpu:
        torch.cuda.synchronize()
    return loss, time.perf_counter() - t0


def reduce_step_stats(loss: float, step_s: float, timer: CommTimer, device) -> StepStats:
    """Collective: mean loss over ranks, max step / dispatch / combine time over ranks."""
    world = dist.get_world_size()
    stats = torch.tensor([loss / world, step_s,
                          timer.totals["dispatch_fwd"] + timer.totals["dispatch_bwd"],
                          timer.totals["combine_fwd"] + timer.totals["combine_bwd"]], device=device, dtype=torch.float64)
    loss_sum = stats[:1].clone()
    dist.all_reduce(loss_sum)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return StepStats(loss_sum.item(), stats[1].item(), stats[2].item(), stats[3].item())


def train_step(tr: Trainer, step: int) -> StepStats:
    loss, step_s = run_step(tr, step)
    return reduce_step_stats(loss.item(), step_s, tr.timer, tr.device)


def format_step(step: int, st: StepStats, tokens_per_step: int, time_comm: bool) -> str:
    comm = f"{st.dispatch_s * 1e3:12.1f} {st.combine_s * 1e3:11.1f}" if time_comm else f"{'-':>12} {'-':>11}"
    return f"{step:4d} {st.loss:8.4f} {st.step_s * 1e3:9.1f} {tokens_per_step / st.step_s:9.0f} {comm}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = start(args, argv, __file__, PROG, lambda a, n: (validate(a, n), check_resources(a, n)))
    if not isinstance(started, Started):
        return started
    rank, world, device, on_gpu = started.rank, started.world, started.device, started.on_gpu

    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    if args.dispatcher != "alltoall":
        import megatron_ep.megatron

        feats = megatron_ep.megatron.install()
        if rank == 0:
            print(f"megatron_ep installed into megatron-core {feats.version}", flush=True)
    tr = build_trainer(args, device, on_gpu)
    if rank == 0:
        print(describe(tr), flush=True)
        print(STEP_HEADER, flush=True)
    for step in range(args.steps):
        stats = train_step(tr, step)
        if rank == 0:
            print(format_step(step, stats, tr.tokens_per_step, args.time_comm), flush=True)
    dist.barrier()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # drop Megatron's group handles before the groups go
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    cli.quiet()
    sys.exit(cli.run_main(main, prog=PROG))
