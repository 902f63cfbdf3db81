"""A/B throughput of MoE token dispatchers in megatron-core: interleaved runs, medians, a table.

    python scripts/ab_throughput.py --nproc-per-node 2 --backend torch --reps 2 --steps 2
    torchrun --nproc-per-node 2 scripts/ab_throughput.py --backend torch --reps 2 --steps 2   # the same
    torchrun --nproc-per-node 8 scripts/ab_throughput.py --mode layer --backend cuda \\
        --hidden 7168 --experts 256 --topk 8 --seq-len 4096 --micro-batch 1 \\
        --png ab.png --append-doc docs/performance.md

Backends (--backends, comma separated, default all):
  alltoall  Megatron's MoEAlltoAllTokenDispatcher;
  deepep    Megatron's flex dispatcher + megatron_ep's deepep-style manager;
  hybridep  Megatron's flex dispatcher + megatron_ep's hybridep-style manager;
  hybridep-budget  the same with a static budget of --budget-factor (1.5) x tokens x topk rows per rank
            (MEGATRON_EP_RANK_CAPACITY_FACTOR): the dispatch never syncs the host; rows past
            the budget are dropped and counted (uniform routing rarely gets near it);
  hybridep-chunked  hybridep with each MoE layer's dispatch, experts and combine in --chunks (4)
            pipelined token chunks (megatron_ep.megatron.chunked): communication under the expert
            GEMMs, which leave the communication kernels' SMs free; those kernels take the SMs
            the model's split gives (printed in the header); its dispatch / combine are not
            measured (the chunks bypass the dispatcher calls the timers wrap; the table says "-");
  hybridep-chunked-budget  the same with the static budget of --budget-factor: every chunk
            worst-case sized for its share of the tokens, no host sync (its drop count is read
            after each chunk's dispatch has finished);
  DeepEP    Megatron's flex dispatcher + Megatron's own _DeepepManager (the deep_ep package);
  HybridEP  Megatron's flex dispatcher + Megatron's own _HybridEPManager (deep_ep.HybridEPBuffer).
--backend picks megatron_ep's Buffer backend (torch reference, cuda kernels, auto) for deepep and
hybridep; it does not touch the others.

--mode train: train_moe.py's model and training step (forward, backward, grad all-reduce, expert
bias update, AdamW). --mode layer: one MoELayer built like train_moe's MoE layers, a fixed random
input [seq, batch, hidden], forward + backward of mean(out^2) timed (no optimiser).

Every backend's model is built once (same seed, then the first model's weights and buffers
copied into the others) and reused; each repetition runs every backend in turn for --warmup
untimed then --steps timed steps (A B C A B C ...), each backend on its own sequence of batches
0, 1, 2, ... so they all see the same data. By default every repetition starts again from the
initial weights (a copy kept on the device), a fresh optimiser state and batch 0, so repetitions
repeat the same work and their spread is the timing's: trained on, the router changes the load
balance from one repetition to the next, and each backend's own rounding drives its training
apart (--continue-reps keeps training across repetitions, as before). Figures are medians over repetitions of each
repetition's median. Step 0 (identical weights and data) must give the same loss on every
backend within --loss-rtol (they compute the same function).

Unavailable (skipped, exit status unaffected): a precondition fails before building, e.g. deep_ep
not importable, no GPU for deep_ep or --backend cuda, one rank only (flex needs TPxEP > 1).
Failed (exit status 1): the backend was available but raised while building or stepping, or its
step-0 loss disagreed. Exit status 3: nothing was measured (every selected backend skipped).
(These are the ranks' exit statuses: `python scripts/ab_throughput.py --nproc-per-node N` exits
with them; torchrun itself exits 1 for any non-zero one.)
All ranks agree on every failure (a flag all-reduced after each step), so a backend that raises
on every rank does not leave the others waiting; one that dies inside a collective on some ranks
only still leaves its peers waiting until the process-group timeout (5 min).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import importlib.util
import os
import platform
import resource
import shlex
import statistics
import sys
import time
import traceback
from typing import Callable, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]  # run from a checkout; the bench package beside this file

from megatron_ep.tools import cli  # noqa: E402

PROG = "scripts/ab_throughput.py"
if __name__ == "__main__":
    cli.require("torch", "megatron.core", prog=PROG)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import internals, report  # noqa: E402
from megatron_ep.tools import resources  # noqa: E402
from megatron_ep.experts.overlap import MAX_CHUNKS  # noqa: E402
from recipes import train_moe  # noqa: E402
from recipes.comm_timer import CommTimer  # noqa: E402


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    key: str
    dispatcher: str  # train_moe's --dispatcher: alltoall | deepep | hybridep
    ours: Optional[bool]  # flex: True = megatron_ep's manager, False = Megatron's own (deep_ep); None: alltoall
    about: str
    env: tuple = ()  # (name, value) pairs set while the model is built (read by the managers)
    untimed: str = ""  # why the comm timers cannot see its dispatch / combine ("": they can)

    @property
    def budget(self) -> bool:
        """Whether it runs under a static budget (and so may drop rows)."""
        return any(name == "MEGATRON_EP_RANK_CAPACITY_FACTOR" for name, _ in self.env)


CHUNKS_UNTIMED = "the chunks move the tokens inside the experts' call, past the dispatcher calls that the timers wrap"

BACKENDS = {b.key: b for b in (
    BackendSpec("alltoall", "alltoall", None, "Megatron alltoall dispatcher"),
    BackendSpec("deepep", "deepep", True, "flex + megatron_ep deepep-style manager"),
    BackendSpec("hybridep", "hybridep", True, "flex + megatron_ep hybridep-style manager"),
    BackendSpec("hybridep-budget", "hybridep", True, "flex + megatron_ep hybridep, static budget --budget-factor x T "
                "x topk rows (no host sync; rows past it dropped and counted)",
                (("MEGATRON_EP_RANK_CAPACITY_FACTOR", "{budget_factor}"),)),
    BackendSpec("hybridep-chunked", "hybridep", True, "flex + megatron_ep hybridep, dispatch / experts / combine in "
                "--chunks pipelined token chunks (megatron_ep.megatron.chunked; grouped experts)",
                (("MEGATRON_EP_CHUNKED_EXPERTS", "{chunks}"),), CHUNKS_UNTIMED),
    BackendSpec("hybridep-chunked-budget", "hybridep", True, "hybridep-chunked with the static budget: every chunk "
                "worst-case sized for its share of --budget-factor x T x topk rows (no host sync)",
                (("MEGATRON_EP_CHUNKED_EXPERTS", "{chunks}"), ("MEGATRON_EP_RANK_CAPACITY_FACTOR", "{budget_factor}")),
                CHUNKS_UNTIMED),
    BackendSpec("DeepEP", "deepep", False, "flex + Megatron's _DeepepManager on deep_ep"),
    BackendSpec("HybridEP", "hybridep", False, "flex + Megatron's _HybridEPManager on deep_ep"),
)}


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--budget-factor", type=cli.number(0, above=True), default=1.5,
                   help="hybridep-budget: rows per rank = factor x tokens x topk")
    p.add_argument("--chunks", type=cli.integer(1, MAX_CHUNKS), default=4, help="hybridep-chunked: token chunks per MoE layer")
    p.add_argument("--mode", choices=("train", "layer"), default="train",
                   help="train: train_moe.py's model and training step; layer: one MoE layer, forward + backward")
    p.add_argument("--backends", default="all", help=f"comma-separated subset of {','.join(BACKENDS)}, or all")
    p.add_argument("--reps", type=cli.integer(), default=3, help="repetitions (each runs every backend in turn)")
    p.add_argument("--warmup", type=cli.integer(0), default=2, help="untimed steps per backend per repetition")
    p.add_argument("--continue-reps", action="store_true",
                   help="train on across repetitions (default: each repetition restarts from the initial weights, "
                        "a fresh optimiser state and batch 0)")
    p.add_argument("--loss-rtol", type=cli.number(0), default=None,
                   help="step-0 loss tolerance relative to the reference backend (default 1e-4 fp32, 5e-3 bf16)")
    p.add_argument("--png", default=None, help="write a bar chart here (default: none)")
    p.add_argument("--append-doc", default=None, metavar="MD",
                   help="append a dated section with the table to this Markdown file (default: none)")
    train_moe.add_args(p, dispatcher=False)
    resources.add_force(p)
    p.set_defaults(steps=5)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    keys = list(BACKENDS) if args.backends.strip() == "all" else [k.strip() for k in args.backends.split(",") if k.strip()]
    bad = [k for k in keys if k not in BACKENDS]
    if bad or not keys:
        p.error(f"--backends: unknown {bad} (choose from {', '.join(BACKENDS)} or all)")
    args.backend_keys = list(dict.fromkeys(keys))
    return args


def validate(args, world: int) -> None:
    """train_moe's checks (model shape against the world size), the output paths, and whether
    the run fits this machine, before any process group (option types and ranges are the
    parser's)."""
    train_moe.validate(args, world)
    if any(BACKENDS[k].budget for k in args.backend_keys):
        rows = args.budget_factor * args.seq_len * args.micro_batch * args.topk
        cli.check(rows >= 1, f"--budget-factor {args.budget_factor:g} gives a budget of {rows:g} rows per rank "
                             "(factor x seq-len x micro-batch x topk): less than one row, so no budget at all")
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise cli.UsageError("--png needs matplotlib (pip install matplotlib)") from None
    for path in filter(None, (args.png, args.append_doc)):
        folder = os.path.dirname(os.path.abspath(path))
        cli.check(os.path.isdir(folder), f"{path}: no such directory {folder}")
    # train_moe.init_distributed: the ranks use the GPUs wherever CUDA is visible
    resources.refuse_unless_fits(resources_needed(args, world, torch.cuda.is_available()), force=args.force)


def resources_needed(args, world: int, on_gpu: bool) -> resources.Need:
    """Every backend built keeps its model and optimiser: count only those sure to build
    (unavailable_reason: deep_ep's need it installed and GPUs, flex ones 2 or more ranks,
    --virtual-ranks ours only)."""
    deep_ep = on_gpu and importlib.util.find_spec("deep_ep") is not None

    def builds(spec: BackendSpec) -> bool:
        if args.virtual_ranks:
            return bool(spec.ours) and world >= 2
        return spec.ours is None or (world >= 2 and (spec.ours or deep_ep))

    models = sum(builds(BACKENDS[k]) for k in args.backend_keys)
    budget = args.budget_factor if any(BACKENDS[k].budget for k in args.backend_keys) else None
    return resources.moe_gpt_need(args, world, on_gpu, mode=args.mode, models=models,
                                  initial_copy=not args.continue_reps, budget_factor=budget)


# ------------------------------------------------------------------------------ availability
def model_costs(args, world: int):
    """The analytic model's cost terms of one MoE layer of this shape at EP = world."""
    from megatron_ep.tools.model import costs_of_layer

    return costs_of_layer(args.seq_len * args.micro_batch, args.hidden, args.topk, args.experts, world, args.expert_ffn)


def model_split(args, world: int) -> str:
    """What the analytic model says of this shape at EP = world (H200 link rates): the SMs the
    communication kernels need, what the GEMMs keep, and the layer with chunks against without."""
    from megatron_ep.tools.model import layer_times

    costs = model_costs(args, world)
    none, chunked = layer_times(costs, "none"), layer_times(costs, "chunks", args.chunks)
    return (f"model (megatron_ep.tools.model, H200 rates, EP {world}): communication needs {costs.comm_sms} of {costs.sms} SMs, "
            f"the expert GEMMs keep {costs.sms - costs.comm_sms}; one MoE layer fwd + bwd {none.total_us / 1e3:.3f} ms "
            f"without overlap, {chunked.total_us / 1e3:.3f} ms in {args.chunks} chunks (a prediction, not a measurement)")


def unavailable_reason(spec: BackendSpec, args, on_gpu: bool, world: int) -> Optional[str]:
    """Why this backend cannot run here (checked before building), or None."""
    if getattr(args, "virtual_ranks", False) and not spec.ours:
        return ("--virtual-ranks (several ranks on one GPU, gloo control): Megatron's alltoall and DeepEP need a GPU "
                "all-to-all over NCCL, which refuses several ranks on one GPU")
    if spec.ours is None:
        return None
    if world < 2:
        return "Megatron's flex dispatcher needs TPxEP > 1 (run on 2 or more ranks)"
    if spec.ours:
        try:
            import megatron_ep.megatron
            from megatron_ep.core.buffer import cuda_backend_available

            megatron_ep.megatron.compat.check_supported()
        except Exception as e:  # noqa: BLE001 - any import/compat problem means "not here"
            return f"megatron_ep.megatron not usable: {type(e).__name__}: {e}"
        if spec.key.startswith("hybridep-chunked") and args.experts_impl != "grouped":
            return "chunked experts run megatron_ep's GroupedGemmExperts (--experts-impl grouped)"
        if spec.key.startswith("hybridep-chunked") and args.shared_expert_overlap:
            return "chunked experts do not run the shared expert inside the dispatch (--shared-expert-overlap)"
        if args.backend == "cuda" and not on_gpu:
            return "--backend cuda needs a GPU"
        if args.backend == "cuda" and not cuda_backend_available():
            return "--backend cuda: megatron_ep's CUDA extension is not built"
        return None
    try:
        import deep_ep
    except Exception as e:  # noqa: BLE001
        return f"deep_ep not importable: {type(e).__name__}: {e}"
    if spec.dispatcher == "hybridep" and not hasattr(deep_ep, "HybridEPBuffer"):
        return "deep_ep has no HybridEPBuffer (HybridEP needs DeepEP's hybrid-ep branch)"
    from megatron.core.transformer.moe import fused_a2a

    flag = "HAVE_HYBRIDEP" if spec.dispatcher == "hybridep" else "HAVE_DEEP_EP"
    if not getattr(fused_a2a, flag, False):
        return f"megatron-core's fused_a2a could not import deep_ep ({flag} is False)"
    if not on_gpu:
        return "deep_ep needs CUDA GPUs"
    return None


def set_managers(spec: BackendSpec, rank: int) -> None:
    """Megatron's flex dispatcher picks its manager class when it is built: ours or its own."""
    if spec.ours is None:
        return
    import megatron_ep.megatron

    if spec.ours:
        was = megatron_ep.megatron.is_installed()
        feats = megatron_ep.megatron.install()
        if rank == 0 and not was:
            print(f"megatron_ep installed into megatron-core {feats.version}", flush=True)
    else:
        megatron_ep.megatron.uninstall()


# ------------------------------------------------------------------------------------ runs
@dataclasses.dataclass
class LayerModel:
    """--mode layer: one MoE layer, a fixed input and output weighting."""

    args: argparse.Namespace
    config: object
    layer: torch.nn.Module
    x: torch.Tensor
    timer: CommTimer
    device: torch.device
    on_gpu: bool
    world: int

    @property
    def model(self):
        return self.layer

    @property
    def moe_layers(self):
        return [self.layer]

    @property
    def tokens_per_step(self) -> int:
        return self.args.micro_batch * self.args.seq_len * self.world


def build_layer(args, device, on_gpu: bool) -> LayerModel:
    """train_moe's config and decoder-block spec; the first MoE layer's spec built on its own
    (as TransformerLayer builds its mlp), replicated weights broadcast from rank 0."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    rank, world = dist.get_rank(), dist.get_world_size()
    train_moe.seed_everything(args, rank, on_gpu)
    config = train_moe.build_config(args, world, on_gpu)
    from megatron_ep.megatron.chunked import apply_from_env, chunks_from_env

    chunks = getattr(args, "chunked_experts", 0) or chunks_from_env()
    if chunks:  # chunked experts: the communication kernels take the SMs the model gives them (the header's split)
        knob = "moe_flex_dispatcher_num_sms" if hasattr(config, "moe_flex_dispatcher_num_sms") else "moe_hybridep_num_sms"
        setattr(config, knob, model_costs(args, world).comm_sms)
    block = train_moe.decoder_block_spec(config, args)
    number, mlp = next((i + 1, spec.submodules.mlp) for i, spec in enumerate(block.layer_specs)
                       if train_moe.is_moe_spec(spec.submodules.mlp))
    layer = build_module(mlp, config=config, pg_collection=None) if isinstance(mlp, ModuleSpec) else mlp(config=config, pg_collection=None)
    layer.set_layer_number(number)
    layer = layer.to(device)
    apply_from_env(layer, chunks)
    train_moe.broadcast_non_expert_params(layer)
    g = torch.Generator().manual_seed(args.seed + 7919 * (rank + 1))
    x = torch.randn(args.seq_len, args.micro_batch, args.hidden, generator=g).to(device=device, dtype=config.params_dtype)
    timer = CommTimer(sync_cuda=on_gpu)
    if args.time_comm:
        timer.wrap(layer.token_dispatcher)
    return LayerModel(args, config, layer, x, timer, device, on_gpu, world)


def layer_step(lm: LayerModel, step: int):
    """Forward + backward of mean(out^2) on the fixed input: (local loss tensor, seconds)."""
    lm.timer.reset()
    if lm.on_gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for p in lm.layer.parameters():
        p.grad = None
    x = lm.x.detach().requires_grad_(True)
    out, _ = lm.layer(x)
    loss = out.float().pow(2).mean()
    loss.backward()
    if lm.on_gpu:
        torch.cuda.synchronize()
    return loss, time.perf_counter() - t0


def state_tensors(module: torch.nn.Module) -> dict:
    """{name: tensor} of every parameter and buffer."""
    d = dict(module.named_parameters())
    d.update(module.named_buffers())
    return d


def copy_state(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Every parameter and buffer of src into dst (same names and shapes required)."""
    copy_tensors(state_tensors(src), dst)


def copy_tensors(s: dict, dst: torch.nn.Module) -> None:
    """The tensors of `s` ({name: tensor}, e.g. state_tensors of a model) into dst's parameters
    and buffers of the same names and shapes."""
    d = state_tensors(dst)
    if s.keys() != d.keys():
        raise RuntimeError(f"model differs from the reference: extra {sorted(d.keys() - s.keys())[:4]}, "
                           f"missing {sorted(s.keys() - d.keys())[:4]}")
    with torch.no_grad():
        for name, t in d.items():
            if t.shape != s[name].shape:
                raise RuntimeError(f"{name}: shape {tuple(t.shape)} vs reference {tuple(s[name].shape)}")
            t.copy_(s[name])


def restart(run, initial: dict) -> None:
    """Back to the start: the initial weights and buffers, a fresh optimiser state, batch 0."""
    copy_tensors(initial, run.state.model)
    opt = getattr(run.state, "optimizer", None)
    if opt is not None:
        opt.state.clear()  # torch optimisers build their per-parameter state again on the next step
    run.next_step = 0


@dataclasses.dataclass
class Run:
    spec: BackendSpec
    state: object = None  # train_moe.Trainer or LayerModel
    step_fn: Optional[Callable] = None
    next_step: int = 0
    steps_total: int = 0  # steps run over all repetitions
    loss0: Optional[float] = None
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    rep_step_s: List[float] = dataclasses.field(default_factory=list)  # one median per repetition
    rep_dispatch_s: List[float] = dataclasses.field(default_factory=list)
    rep_combine_s: List[float] = dataclasses.field(default_factory=list)
    rep_loss: List[float] = dataclasses.field(default_factory=list)  # the last step's loss, per repetition
    peak_mib: float = 0.0
    tokens_per_s: float = 0.0
    dropped0: Optional[int] = None  # rows a static budget dropped at step 0 (sum over ranks and MoE layers)
    dropped: Optional[int] = None  # ... over every step of every repetition

    @property
    def key(self):
        return self.spec.key


def dropped_rows(model, device) -> Optional[int]:
    """Collective: rows the MoE layers' static budgets dropped so far (their managers'
    `num_dropped_rows`, summed over layers and ranks); None when no manager counts drops."""
    counts = []
    for m in model.modules():
        mgr = internals.comm_manager(getattr(m, "token_dispatcher", None))
        n = getattr(mgr, "num_dropped_rows", None)
        if isinstance(n, torch.Tensor):
            counts.append(int(n.sum().item()))
    t = torch.tensor([sum(counts), len(counts)], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t[0].item()) if t[1].item() else None


# ----------------------------------------------------------------------- agreement helpers
def agree_failure(error: Optional[str], device) -> Optional[str]:
    """Collective: None when no rank failed, else every failing rank's message."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return None
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, error)
    return "\n".join(f"[rank {r}] {m.rstrip()}" for r, m in enumerate(msgs) if m)


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


def peak_memory_mib(on_gpu: bool, device) -> float:
    """Collective (max over ranks). GPU: torch.cuda.max_memory_allocated since the last reset;
    CPU: the process's max RSS so far (resource.getrusage, KiB on Linux)."""
    if on_gpu:
        local = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        local = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ---------------------------------------------------------------------------- report helpers
def machine_description(on_gpu: bool, world: int, virtual_ranks: bool = False) -> str:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // max(1, local))
    if on_gpu:
        prop = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = f"{prop.name} ({prop.total_memory / 2**30:.0f} GiB, {prop.multi_processor_count} SMs)"
        where = (f"{world} processes sharing {min(world, torch.cuda.device_count())} x {gpu} (virtual ranks: gloo for "
                 f"Megatron's collectives, megatron_ep's CUDA IPC transport for the tokens)" if virtual_ranks
                 else f"{world} x {gpu}, {nodes} node(s), NCCL, one process per GPU")
        return f"{where}; torch {torch.__version__}, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"CPU only: {cpu}, {os.cpu_count()} cores, {world} processes on {nodes} node(s), gloo, "
            f"{torch.get_num_threads()} thread(s) per process; torch {torch.__version__}")


def git_revision() -> str:
    rev = report.git_revision(ROOT)
    if rev is None:
        return "unknown"
    return rev[0] + (" + uncommitted changes" if rev[1] else "")


def command_line(world: int) -> str:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT) if sys.argv and sys.argv[0] else "scripts/ab_throughput.py"
    rest = " ".join(shlex.quote(a) for a in sys.argv[1:])
    if local is None or cli.launched_by_us():  # plain python (it started its own ranks)
        return f"python {script} {rest}".strip()
    nodes = world // max(1, int(local))
    launcher = f"torchrun --nproc-per-node {local}" + (f" --nnodes {nodes}" if nodes > 1 else "")
    return f"{launcher} {script} {rest}".strip()


COLUMNS = ("backend", "tokens/s", "step ms", "spread", "dispatch ms", "combine ms", "peak MiB", "vs alltoall", "loss@0")


def reproducibility_note(runs: List[Run]) -> str:
    """Every repetition restarts from the same weights, optimiser state and batch: a backend whose
    last losses differ between repetitions trains non-deterministically, so its routing, load and
    step time drift between them (part of its spread)."""
    parts = []
    for r in runs:
        if len(r.rep_loss) < 2:
            continue
        same = max(r.rep_loss) == min(r.rep_loss)
        losses = f"{r.rep_loss[0]:.6g} x{len(r.rep_loss)}" if same else " / ".join(f"{v:.6g}" for v in r.rep_loss)
        parts.append(f"{r.key} {losses} ({'equal' if same else 'differ'})")
    return ("last loss per repetition (each restarted from the same state: equal when the backend trains "
            "deterministically): " + ", ".join(parts))


def comm_not_measured(run: Run) -> Optional[str]:
    """Why the run's dispatch / combine times (timers on) are no measurement, else None: its
    backend moves the tokens past the timers, or the timers saw no call (a total of 0 s)."""
    if run.spec.untimed:
        return run.spec.untimed
    if not any(run.rep_dispatch_s) and not any(run.rep_combine_s):
        return "the timers saw no dispatch or combine call"
    return None


def comm_ms(run: Run) -> Optional[tuple]:
    """(dispatch ms, combine ms): medians over repetitions, None where not measured."""
    if comm_not_measured(run):
        return None
    return statistics.median(run.rep_dispatch_s) * 1e3, statistics.median(run.rep_combine_s) * 1e3


def comm_cells(run: Run, time_comm: bool) -> List[str]:
    """The table's dispatch and combine ms: "-" with the timers off or where they measured
    nothing (comm_note says why), never a 0.00 that reads as a time."""
    ms = comm_ms(run) if time_comm else None
    return [f"{ms[0]:.2f}", f"{ms[1]:.2f}"] if ms else ["-", "-"]


def comm_progress(run: Run) -> str:
    """The dispatch / combine part of a repetition's progress line (timers on)."""
    why = comm_not_measured(run)
    if why:
        return f", dispatch / combine not measured ({why})"
    return f", dispatch {run.rep_dispatch_s[-1] * 1e3:.2f} ms, combine {run.rep_combine_s[-1] * 1e3:.2f} ms"


def comm_note(runs: List[Run]) -> Optional[str]:
    """The note naming the measured backends whose dispatch / combine cells are "-", and why."""
    why = {}
    for r in runs:
        reason = comm_not_measured(r) if r.rep_step_s else None
        if reason:
            why.setdefault(reason, []).append(r.key)
    if not why:
        return None
    return "dispatch / combine ms not measured (-): " + "; ".join(f"{', '.join(keys)}: {reason}"
                                                                  for reason, keys in why.items())


def dropped_note(runs: List[Run]) -> Optional[str]:
    """Rows dropped by the backends that run under a static budget (the others drop none)."""
    budgets = [r for r in runs if r.spec.budget and r.dropped is not None]
    if not budgets:
        return None
    return "rows dropped by static budgets (forward dispatches, summed over ranks and MoE layers): " + ", ".join(
        f"{r.key} {r.dropped0} at step 0, {r.dropped} over all {r.steps_total} steps" for r in budgets)


def table_rows(runs: List[Run], args, loss_ref: Optional[Run]) -> List[List[str]]:
    base = next((r for r in runs if r.key == "alltoall" and r.status == "ok" and r.rep_step_s), None)
    base_tps = base.tokens_per_s if base else None
    rows = []
    for r in runs:
        if r.status == "skipped":
            rows.append([r.key, f"skipped: {r.reason}"])
            continue
        if not r.rep_step_s:
            rows.append([r.key, f"FAILED: {last_line(r.reason)}"])
            continue
        step = statistics.median(r.rep_step_s)
        spread = (max(r.rep_step_s) - min(r.rep_step_s)) / step * 100
        comm = comm_cells(r, args.time_comm)
        ratio = f"{r.tokens_per_s / base_tps:.3f}" if base_tps else "-"
        loss = "-" if r.loss0 is None else f"{r.loss0:.7g}"
        if r.loss0 is not None and loss_ref is not None and r is not loss_ref:
            loss += f" (d {r.loss0 - loss_ref.loss0:+.1e})"
        row = [r.key, f"{r.tokens_per_s:.0f}", f"{step * 1e3:.2f}", f"{spread:.0f}%", *comm, f"{r.peak_mib:.0f}", ratio, loss]
        if r.status == "failed":
            row[0] += " (FAILED)"
        rows.append(row)
    return rows


def format_text_table(rows: List[List[str]]) -> str:
    full = [r for r in rows if len(r) == len(COLUMNS)]
    widths = [max(len(c), *(len(r[i]) for r in full)) if full else len(c) for i, c in enumerate(COLUMNS)]
    widths[0] = max(widths[0], *(len(r[0]) for r in rows)) if rows else widths[0]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(COLUMNS, widths)))]
    for r in rows:
        if len(r) == len(COLUMNS):
            out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        else:
            out.append(f"{r[0].ljust(widths[0])}  {r[1]}")
    return "\n".join(out)


def format_markdown_table(rows: List[List[str]]) -> str:
    out = [report.md_line(COLUMNS), report.md_rule(len(COLUMNS))]
    for r in rows:
        cells = r if len(r) == len(COLUMNS) else [r[0], r[1].replace("|", "\\|")] + [""] * (len(COLUMNS) - 2)
        out.append(report.md_line(cells))
    return "\n".join(out)


def write_png(path: str, runs: List[Run], args, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in runs if r.rep_step_s]
    base = next((r.tokens_per_s for r in ran if r.key == "alltoall"), None)
    # Horizontal bars: the backend names (up to 23 characters) read along the y axis; as x labels
    # of vertical bars they overlapped in both panels.
    rows = list(range(len(ran)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.5 * len(ran)), sharey=True)
    bars = ax1.barh(rows, [r.tokens_per_s for r in ran], color="tab:blue")
    for bar, r in zip(bars, ran):
        label = f" {r.tokens_per_s:.0f}" + (f" ({r.tokens_per_s / base:.2f}x)" if base else "")
        ax1.annotate(label, (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    ax1.set_yticks(rows, [r.key for r in ran])
    ax1.invert_yaxis()  # top to bottom in the table's order (the panels share the axis)
    ax1.set_xlabel("tokens/s (median)")
    ax1.set_title("throughput" + (" (ratio to alltoall)" if base else ""))
    ax1.margins(x=0.3)
    series = [("step", [statistics.median(r.rep_step_s) * 1e3 for r in ran])]
    if args.time_comm:
        comm = [comm_ms(r) for r in ran]
        series += [("dispatch", [None if c is None else c[0] for c in comm]),
                   ("combine", [None if c is None else c[1] for c in comm])]
    height = 0.8 / len(series)
    offsets = [(i - (len(series) - 1) / 2) * height for i in range(len(series))]
    for offset, (label, values) in zip(offsets, series):
        drawn = [(y + offset, v) for y, v in zip(rows, values) if v is not None]
        ax2.barh([y for y, _ in drawn], [v for _, v in drawn], height, label=label)
    if args.time_comm:  # no bar of 0 ms where the timers measured nothing: say so in its place
        for y, c in zip(rows, comm):
            if c is None:
                ax2.annotate(" dispatch / combine not measured", (0, y + (offsets[1] + offsets[2]) / 2), va="center",
                             fontsize=7, color="dimgray")
    ax2.set_xlabel("ms per step (median)")
    ax2.set_title("step / dispatch / combine time")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = train_moe.start(args, argv, __file__, PROG, validate)
    if not isinstance(started, train_moe.Started):
        return started
    rank, world, device, on_gpu = started.rank, started.world, started.device, started.on_gpu

    def say(*text):
        if rank == 0:
            print(*text, flush=True)

    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    machine = machine_description(on_gpu, world, args.virtual_ranks)
    dtype = "bf16" if on_gpu else "fp32"
    rtol = args.loss_rtol if args.loss_rtol is not None else (5e-3 if on_gpu else 1e-4)
    n_moe = args.layers - 1 if args.mode == "train" else 1
    shape = (f"{args.mode} mode: {args.layers} layers ({n_moe} MoE)" if args.mode == "train" else "layer mode: one MoE layer") + \
        (f", hidden {args.hidden}, {args.experts} experts top-{args.topk} (expert FFN {args.expert_ffn}, shared expert), "
         f"{args.seq_len} x {args.micro_batch} tokens per rank, {dtype}, megatron_ep buffer backend {args.backend}, "
         f"experts {args.experts_impl}")
    plan = (f"{args.reps} repetition(s), each backend {args.warmup} warm-up + {args.steps} timed step(s) per repetition, "
            f"interleaved, {'training on across repetitions' if args.continue_reps else 'each repetition from the initial weights and batch 0'}; "
            f"medians over repetitions of per-repetition medians")
    say(f"A/B: {machine}")
    say(f"A/B: {shape}")
    say(f"A/B: {plan}; comm timers {'on (synchronising)' if args.time_comm and on_gpu else 'on' if args.time_comm else 'off'}")
    if any(k.startswith("hybridep-chunked") for k in args.backend_keys):
        say(f"A/B: {model_split(args, world)}")

    runs = [Run(BACKENDS[k]) for k in args.backend_keys]
    reference_state = None
    for run in runs:
        reason = unavailable_reason(run.spec, args, on_gpu, world)
        reasons = [None] * world
        dist.all_gather_object(reasons, reason)
        where = [r for r, m in enumerate(reasons) if m]
        reason = None
        if where:  # usually every rank says the same; otherwise name the ranks
            reason = reasons[where[0]] + ("" if len(where) == world and len(set(reasons)) == 1 else f" (ranks {where})")
        if reason:
            run.status, run.reason = "skipped", reason
            say(f"{run.key} ({run.spec.about}): skipped: {reason}")
            continue
        t0 = time.perf_counter()
        error = None
        saved_env = {k: os.environ.get(k) for k, _ in run.spec.env}
        try:
            set_managers(run.spec, rank)
            os.environ.update({k: v.format(budget_factor=args.budget_factor, chunks=args.chunks) for k, v in run.spec.env})
            bargs = copy.copy(args)
            bargs.dispatcher = run.spec.dispatcher
            if args.mode == "train":
                run.state, run.step_fn = train_moe.build_trainer(bargs, device, on_gpu), train_moe.run_step
            else:
                run.state, run.step_fn = build_layer(bargs, device, on_gpu), layer_step
            if reference_state is None:
                reference_state = run.state
            else:
                copy_state(reference_state.model, run.state.model)
        except Exception:  # noqa: BLE001 - reported, agreed over ranks, exit status 1
            error = traceback.format_exc()
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        failure = agree_failure(error, device)
        if failure:
            run.status, run.reason = "failed", failure
            say(f"{run.key} ({run.spec.about}): FAILED while building:\n{failure}")
            continue
        if args.mode == "train":
            say(f"{run.key}: built in {time.perf_counter() - t0:.1f} s: {train_moe.describe(run.state)}")
        else:
            mgr = internals.comm_manager(run.state.layer.token_dispatcher)
            say(f"{run.key}: built in {time.perf_counter() - t0:.1f} s: "
                f"{type(mgr).__name__ if mgr else type(run.state.layer.token_dispatcher).__name__}, "
                f"experts {type(run.state.layer.experts).__name__}")

    # the initial weights every repetition restarts from (every model was copied from the first)
    initial = None
    if reference_state is not None and not args.continue_reps:
        initial = {n: t.detach().clone() for n, t in state_tensors(reference_state.model).items()}

    for rep in range(args.reps):
        for run in runs:
            if run.status != "ok":
                continue
            st = run.state
            if initial is not None and rep > 0:
                restart(run, initial)
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(device)
            timed = []
            for i in range(args.warmup + args.steps):
                error, loss, step_s = None, 0.0, 0.0
                try:
                    loss_t, step_s = run.step_fn(st, run.next_step)
                    loss = loss_t.item()
                except Exception:  # noqa: BLE001
                    error = traceback.format_exc()
                failure = agree_failure(error, device)
                if failure:
                    run.status, run.reason = "failed", failure
                    say(f"{run.key}: FAILED at step {run.next_step} (repetition {rep + 1}):\n{failure}")
                    break
                stats = train_moe.reduce_step_stats(loss, step_s, st.timer, device)
                if run.next_step == 0 and run.loss0 is None:
                    run.loss0 = stats.loss
                    run.dropped0 = dropped_rows(st.model, device)
                run.next_step += 1
                run.steps_total += 1
                if i >= args.warmup:
                    timed.append(stats)
            if hasattr(st, "optimizer"):
                st.optimizer.zero_grad(set_to_none=True)  # release grads before the next backend's peak
            else:
                for p in st.model.parameters():
                    p.grad = None
            if run.status != "ok":
                continue
            run.dropped = dropped_rows(st.model, device)
            run.peak_mib = max(run.peak_mib, peak_memory_mib(on_gpu, device))
            run.rep_step_s.append(statistics.median(s.step_s for s in timed))
            run.rep_dispatch_s.append(statistics.median(s.dispatch_s for s in timed))
            run.rep_combine_s.append(statistics.median(s.combine_s for s in timed))
            run.rep_loss.append(float(timed[-1].loss))
            comm = comm_progress(run) if args.time_comm else ""
            say(f"rep {rep + 1}/{args.reps} {run.key:>9}: step {run.rep_step_s[-1] * 1e3:.2f} ms "
                f"({st.tokens_per_step / run.rep_step_s[-1]:.0f} tok/s){comm}, loss {timed[-1].loss:.5g}")

    # tokens/s from the median step time (all backends share the token count)
    for run in runs:
        if run.rep_step_s:
            run.tokens_per_s = run.state.tokens_per_step / statistics.median(run.rep_step_s)

    # step-0 loss check: identical weights and data, the same function on every backend
    with_loss = [r for r in runs if r.loss0 is not None]
    loss_ref = next((r for r in with_loss if r.key == "alltoall"), with_loss[0] if with_loss else None)
    loss_lines = []
    for r in with_loss:
        if r is loss_ref:
            continue
        if r.dropped0:  # the budget changed what the experts computed: nothing to compare
            loss_lines.append(f"{r.key} {r.loss0:.7g} (not compared: its budget dropped {r.dropped0} rows at step 0)")
            continue
        diff = abs(r.loss0 - loss_ref.loss0)
        ok = diff <= rtol * abs(loss_ref.loss0) + 1e-12
        loss_lines.append(f"{r.key} {r.loss0:.7g} (|d| {diff:.1e}{'' if ok else ' > tolerance'})")
        if not ok and r.status == "ok":
            r.status, r.reason = "failed", f"step-0 loss {r.loss0:.7g} differs from {loss_ref.key}'s {loss_ref.loss0:.7g} by {diff:.1e} (rtol {rtol:g})"
    if loss_ref is None:
        loss_check = "loss check: nothing ran"
    elif not loss_lines:
        loss_check = f"loss check at step 0: only {loss_ref.key} ran ({loss_ref.loss0:.7g}); nothing to compare"
    else:
        bad = any("tolerance" in ln for ln in loss_lines)
        loss_check = (f"loss check at step 0 (identical weights and data; rtol {rtol:g} vs {loss_ref.key} {loss_ref.loss0:.7g}): "
                      + ", ".join(loss_lines) + (": MISMATCH" if bad else ": OK"))

    mem_note = ("peak MiB: torch.cuda.max_memory_allocated during the backend's steps, max over ranks and repetitions "
                "(every backend's model and optimiser state stay resident, so compare rows by difference)" if on_gpu else
                "peak MiB: process max RSS (resource.getrusage ru_maxrss), max over ranks, read after the backend's "
                "repetitions: cumulative over the whole run, not per backend")
    notes = [loss_check, mem_note, "spread: (max - min) / median of the per-repetition step times"]
    if not args.continue_reps and args.reps > 1:
        notes.append(reproducibility_note(runs))
    notes += filter(None, [dropped_note(runs)])
    if args.time_comm:
        notes.append("dispatch / combine ms: forward + backward, summed over MoE layers, max over ranks (recipes/comm_timer.py"
                     + ("; it synchronises the GPU around each call, which also lengthens the step)" if on_gpu else ")"))
        notes += filter(None, [comm_note(runs)])
    rows = table_rows(runs, args, loss_ref)
    failed = [r for r in runs if r.status == "failed"]
    measured = [r for r in runs if r.rep_step_s]
    if rank == 0:
        print("\n" + format_text_table(rows), flush=True)
        for n in notes:
            print(n, flush=True)
        for r in failed:
            print(f"FAILED {r.key}: {last_line(r.reason)}", flush=True)
        title = f"{args.mode} mode, {machine.split(';')[0]}"
        if args.png and measured:
            write_png(args.png, runs, args, title)
            print(f"wrote {args.png}", flush=True)
        if args.append_doc:
            stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
            section = [f"## A/B throughput run, {stamp} ({args.mode} mode)", "",
                       f"Command: `{command_line(world)}`", "",
                       f"* machine: {machine}",
                       f"* code: commit {git_revision()}, megatron-core {megatron_core_version()}",
                       f"* shape: {shape}",
                       f"* timing: {plan}", "",
                       format_markdown_table(rows), ""]
            section += [f"* {n}" for n in notes]
            if args.png and measured:
                section.append(f"* chart: `{args.png}`")
            with open(args.append_doc, "a+") as f:
                f.seek(0, os.SEEK_END)
                lead = "\n"
                if f.tell():
                    f.seek(f.tell() - 1)
                    lead = "\n" if f.read(1) == "\n" else "\n\n"
                f.write(lead + "\n".join(section) + "\n")
            print(f"appended to {args.append_doc}", flush=True)
        if not measured:
            print("nothing measured: every selected backend was skipped or failed", flush=True)
    code = 1 if failed else (3 if not measured else 0)
    dist.barrier()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # drop Megatron's group handles before the groups go
    dist.destroy_process_group()
    return code


def megatron_core_version() -> str:
    try:
        import megatron.core as mc

        return getattr(mc, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    cli.quiet()
    sys.exit(cli.run_main(main, prog=PROG))
