"""What a run needs, checked before any process starts: processes on this machine and memory
per rank (host memory, or its GPU's), against the machine's cores, memory and GPUs.

The demo, recipes/train_moe.py, recipes/decode_moe.py, scripts/ab_throughput.py and
scripts/bench overlap each describe their run with a `Need` (`demo_need`, `moe_gpt_need`,
`expert_layer_need`) and call `refuse_unless_fits(need, force=args.force)`:
a run that cannot fit ends as one line (cli.UsageError) naming the figure, the limit and
`--force`, which skips the estimates (the GPU count is a fact and is not skipped).

The estimates are read off the model shape, assuming balanced (uniform) routing: what the run
certainly allocates (weights, gradients, optimiser state, the largest activations) and, for
processes this command starts, this process's own private memory each (they import what it
imported). Allocator slack, temporaries, CUDA contexts and communication buffers are left out,
so the estimates come to between half of and about a rank's peak resident memory on CPU runs of
the demo and of train_moe.py (the demo's up to 1.05x: its routing is not quite uniform). A
refused run would not have fitted, or only just; one let through may still run out.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, Optional, Tuple

from .cli import UsageError, launched_by_us, world_size_from_env

GiB = 2**30

# Gloo ranks of one machine on a few cores each take turns: our tests and the README run 4 on 2
# cores; far past that, the run only queues for the scheduler and its memory.
PROCESSES_PER_CORE = 4

FORCE_HELP = "skip the up-front estimate of processes and memory against this machine's cores, memory and GPUs"


def add_force(parser) -> None:
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)


# ------------------------------------------------------------------------------- the machine
@dataclasses.dataclass(frozen=True)
class Machine:
    cores: int
    memory_bytes: Optional[int]  # host memory available now (None: unknown, not checked)
    gpu_bytes: Tuple[int, ...] = ()  # total memory of each visible GPU

    @classmethod
    def here(cls, gpus: bool) -> "Machine":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        gpu_bytes: Tuple[int, ...] = ()
        if gpus:
            import torch

            # total, not free: reading free memory would create a CUDA context on each GPU
            gpu_bytes = tuple(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        return cls(cores, available_memory(), gpu_bytes)


def available_memory() -> Optional[int]:
    """MemAvailable (memory the kernel can give without swapping), capped by this cgroup's limit."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            found = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                left = int(limit) - int(g.read())
                found = left if found is None else min(found, left)
    except (OSError, ValueError):
        pass
    return found


def own_private_memory() -> int:
    """Resident memory of this process that no other process shares (/proc/self/statm:
    resident - shared pages): what each rank started from it pays at least, once it has imported
    the same modules. 0 where statm is missing."""
    try:
        with open("/proc/self/statm") as f:
            _, resident, shared = (int(v) for v in f.read().split()[:3])
        return max(0, resident - shared) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


# -------------------------------------------------------------------------------- the need
@dataclasses.dataclass(frozen=True)
class Need:
    """A run on this machine: `processes` ranks here, each holding `rank_parts` (name -> bytes)
    in host memory or, `on_gpu`, on its GPU (one GPU per rank unless `share_gpus`)."""

    processes: int
    rank_parts: Dict[str, int]
    on_gpu: bool = False
    share_gpus: bool = False
    starting: bool = True  # this command starts the processes (else a launcher already did)

    @property
    def rank_bytes(self) -> int:
        return sum(self.rank_parts.values())


def local_processes(world: int) -> Tuple[int, bool]:
    """(ranks on this machine, whether this command starts them): all `world` when it starts
    them itself, else its launcher's LOCAL_WORLD_SIZE."""
    if world_size_from_env() is None:
        return world, True
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return (int(local) if local.isdigit() else world), False


def _size(n: float) -> str:
    """Bytes in MiB up to PiB (a refused run can be absurdly large)."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", GiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if n < 10**4 * size else f"{n:.1e} B"
    return f"{n / 2**20:.0f} MiB"


def _largest(parts: Dict[str, int]) -> str:
    name, size = max(parts.items(), key=lambda kv: kv[1])
    return f"{name} {_size(size)}"


def refuse_unless_fits(need: Need, force: bool = False, machine: Optional[Machine] = None) -> None:
    """cli.UsageError (one line) when `need` cannot run on `machine` (default: this one). The
    ranks cli.launch() started skip it: their parent checked, and they see each other's memory."""
    if machine is None and launched_by_us():
        return
    m = machine or Machine.here(need.on_gpu)
    n = need.processes
    if need.on_gpu and not need.share_gpus:
        if n > len(m.gpu_bytes):
            raise UsageError(f"{n} ranks need {n} GPUs here (one per rank), {len(m.gpu_bytes)} visible")
    if force:
        return
    limit = PROCESSES_PER_CORE * m.cores
    if n > limit:
        raise UsageError(f"{n} processes on this machine are more than {limit} ({PROCESSES_PER_CORE} per core, "
                         f"{m.cores} cores); lower the ranks, or --force starts them anyway")
    base = own_private_memory() if need.starting else 0
    host_rank = base + (0 if need.on_gpu else need.rank_bytes)
    if m.memory_bytes is not None and n * host_rank > m.memory_bytes:
        what = f"{n} processes x {_size(host_rank)}" + ("" if need.on_gpu else f": {_largest(need.rank_parts)} each")
        raise UsageError(f"needs about {_size(n * host_rank)} of memory ({what}), more than the "
                         f"{_size(m.memory_bytes)} available; shrink the run, or --force runs it anyway")
    if need.on_gpu and m.gpu_bytes:
        per_gpu = math.ceil(n / len(m.gpu_bytes)) if need.share_gpus else 1
        if per_gpu * need.rank_bytes > min(m.gpu_bytes):
            share = f"{per_gpu} ranks x " if per_gpu > 1 else ""
            raise UsageError(f"needs about {_size(per_gpu * need.rank_bytes)} per GPU ({share}{_size(need.rank_bytes)} "
                             f"per rank: {_largest(need.rank_parts)}), more than the GPU's {_size(min(m.gpu_bytes))}; "
                             "shrink the run, use more ranks, or --force runs it anyway")


# --------------------------------------------------------------------------- the estimates
def demo_need(args, world: int, on_gpu: bool) -> Need:
    """megatron_ep.tools.demo: every rank holds every expert's weights (fp32) for its dense
    reference, and at most --tokens tokens (rank 0's count; the others get fewer).
      weights     4 B x (2 E H F + H E)               (w1, w2 of every expert; the router)
      reference   16 B x H F x K x used               (the dense reference's fp64 copy of an
                  expert's w1 and w2, per top-k slot, kept for backward; used = E (1 - (1 - 1/E)^T),
                  the experts T tokens pick in one slot when routing is uniform)
      activations T K rows x (H + F) x (4 B x 2 + 8 B x 2) (balanced routing: a rank receives as
                  many rows as it sends; each row's input and hidden and their gradients, fp32 in
                  the distributed layer, fp64 in the reference)"""
    E, H, F, K, T = args.experts, args.hidden, args.ffn, args.topk, args.tokens
    used = E * -math.expm1(T * math.log1p(-1 / E)) if E > 1 else 1  # E (1 - (1 - 1/E)^T), exact for large E
    processes, starting = local_processes(world)
    parts = {"expert weights": 4 * (2 * E * H * F + H * E),
             "reference weight copies": int(16 * H * F * K * used),
             "activations": T * K * (H + F) * (4 * 2 + 8 * 2)}
    return Need(processes, parts, on_gpu=on_gpu, starting=starting)


def moe_gpt_need(args, world: int, on_gpu: bool, *, mode: str = "train", models: int = 1,
                 initial_copy: bool = False, budget_factor: Optional[float] = None) -> Need:
    """recipes/train_moe.py's model (mode "train") or one of its MoE layers (mode "layer", the A/B
    tool); `models` copies resident at once (the A/B tool keeps one per backend, plus
    `initial_copy` of the weights). Per rank, with b = 2 B (bf16, GPUs) or 4 B (fp32, CPU),
    E/W local experts, N = seq-len x micro-batch tokens, n MoE layers (layers - 1, or 1):
      params    n (E/W 3 H Fe + E H + 3 H Fe)              (SwiGLU experts, router, shared expert)
                + train: layers 4 H^2 + 3 H ffn + V H      (attention, the dense layer, embedding)
      weights   b x params x models x (3 train: AdamW's two moments | 1 layer) + b x params for
                the gradients (one model steps at a time) + b x params for the initial copy
      activations b x n (R (2 H + 3 Fe) + N (3 H + 3 Fe)), R = max(N K, the static budget)
                rows (each row's input, SwiGLU hidden and output; per token the norm, combine and
                shared expert); train adds b x layers (7 H N + heads S^2 micro-batch) (attention
                with its softmax probs kept for backward), the S^2 mask, b x N (3 ffn + 2 H) and
                8 B x N V (fp32 logits and their gradient)"""
    b = 2 if on_gpu else 4
    H, Fe, E, K, V = args.hidden, args.expert_ffn, args.experts, args.topk, args.vocab
    S, B = args.seq_len, args.micro_batch
    N = S * B
    n_moe = args.layers - 1 if mode == "train" else 1
    params = n_moe * ((E // world) * 3 * H * Fe + E * H + 3 * H * Fe)
    if mode == "train":
        params += args.layers * 4 * H * H + 3 * H * args.ffn + V * H
    rows = N * K
    if budget_factor is not None:
        rows = max(rows, int(N * K * budget_factor))
    per_model = b * params * (3 if mode == "train" else 1)
    parts = {"weights and optimiser state" if mode == "train" else "weights":
             models * per_model + b * params + (b * params if initial_copy else 0),
             "MoE activations": b * n_moe * (rows * (2 * H + 3 * Fe) + N * (3 * H + 3 * Fe))}
    if mode == "train":
        parts["attention activations"] = b * args.layers * (7 * H * N + args.heads * S * S * B) + S * S
        parts["logits and dense layer"] = 8 * N * V + b * N * (3 * args.ffn + 2 * H)
    processes, starting = local_processes(world)
    return Need(processes, parts, on_gpu=on_gpu, share_gpus=bool(getattr(args, "virtual_ranks", False)),
                starting=starting)


def expert_layer_need(args, world: int, on_gpu: bool) -> Need:
    """scripts/bench overlap: one MoE layer's routed experts (chunked_expert_mlp) per rank,
    forward and backward, with b = 2 B (bf16, GPUs) or 4 B (fp32, CPU), T = --tokens, E/W local
    experts (ranks may share GPUs: virtual ranks):
      weights      b x 2 x E/W 3 H F                 (SwiGLU w1 [2F, H], w2 [H, F]; their gradients)
      activations  b x 2 x (T K (2 H + 3 F) + 3 T H) (balanced routing: T K rows arrive, each row's
                   input, SwiGLU hidden and output; the layer's input, output and input gradient;
                   forward and backward)"""
    b = 2 if on_gpu else 4
    T, H, F, K = args.tokens, args.hidden, args.ffn, args.topk
    local = args.experts // world
    processes, starting = local_processes(world)
    parts = {"expert weights and gradients": b * 2 * local * 3 * H * F,
             "activations": b * 2 * (T * K * (2 * H + 3 * F) + 3 * T * H)}
    return Need(processes, parts, on_gpu=on_gpu, share_gpus=True, starting=starting)
