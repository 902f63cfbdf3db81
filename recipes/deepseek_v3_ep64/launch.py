"""DeepSeek-V3 (671B) pretraining with Megatron-LM's pretrain_gpt.py, 8 nodes x 8 GPUs, EP64,
MoE dispatch / combine on megatron_ep (Megatron's flex dispatcher, backend hybridep or deepep).

Run once per node (same arguments everywhere, NODE_RANK differs):

    export MEGATRON_LM_DIR=/path/to/Megatron-LM MASTER_ADDR=node0 MASTER_PORT=29500 NODE_RANK=3
    bash recipes/deepseek_v3_ep64/launch.sh [options] [-- extra pretrain_gpt.py arguments]

    bash recipes/deepseek_v3_ep64/launch.sh --dry-run   # every node's command; no GPU, no Megatron-LM
    bash recipes/deepseek_v3_ep64/launch.sh --preset tiny --dry-run   # the same features at bring-up size

`--preset tiny` keeps every DeepSeek-V3 feature that runs without Transformer Engine or apex
(group-limited routing, sigmoid scores with expert bias, seq_aux_loss, a
shared expert, MTP, megatron_ep's grouped-GEMM experts, the distributed optimizer with overlapped
gradient reduce and parameter gather, --overlap-moe-expert-parallel-comm) at the size of one node
of 4 GPUs (EP 4, 3 layers, hidden 256, 16 experts top-4 in 4 groups); `--dry-run` prints each flag
of the full recipe it replaces and with what (multi-latent attention among them: Megatron runs it
on Transformer Engine's attention only).

Rendezvous from the environment: MASTER_ADDR, MASTER_PORT (29500), NNODES (8), NODE_RANK,
GPUS_PER_NODE (8). Each node runs

    MEGATRON_EP_BACKEND=auto NVSHMEM_IB_ENABLE_IBGDA=1 NVSHMEM_HCA_LIST=... NVSHMEM_QP_DEPTH=1024 \\
        PYTHONPATH=$MEGATRON_LM_DIR:<this repo> torchrun --nnodes 8 \\
        --node-rank R --nproc-per-node 8 --master-addr A --master-port P \\
        -m megatron_ep.megatron.launch $MEGATRON_LM_DIR/pretrain_gpt.py <model and training flags>

MEGATRON_EP_BACKEND is --ep-backend, else the environment's MEGATRON_EP_BACKEND, else auto (a
value that names no backend is refused). auto runs megatron_ep's cuda kernels where the GPUs are
Hopper and its CUDA extension is built: an EP group spanning nodes takes the two-level internode path (NVSHMEM
RDMA between nodes, NVLink inside each), one inside a node the intranode path; elsewhere the
torch backend (NCCL all-to-all). The NVSHMEM settings are those an InfiniBand cluster needs
(--no-infiniband leaves NVSHMEM's own defaults).

`megatron_ep.megatron.launch` installs megatron_ep's flex managers into megatron-core and then
runs pretrain_gpt.py unchanged as `__main__`, so the managers are in place before Megatron builds
the model. Every flag this file passes is checked against Megatron's configuration classes by
tests/megatron/test_recipes.py. Standard library only: it must run where megatron_ep is not importable;
the rules it shares with megatron_ep (switches, backend names) come from megatron_ep/core/envs.py and
megatron_ep/megatron/backend.py, loaded by their paths (both are standard library only).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _repo_module(name: str, path: str):
    """A standard-library-only module of this checkout, loaded by its path: importing it as
    megatron_ep.* would run the packages' __init__ (megatron_ep.megatron's installs into
    megatron-core when MEGATRON_EP_INSTALL=1)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


envs = _repo_module("_launch_envs", "megatron_ep/core/envs.py")  # the one switch parser
backend_env = _repo_module("_launch_backend", "megatron_ep/megatron/backend.py")  # MEGATRON_EP_BACKEND's rule
MEGATRON_LM_PLACEHOLDER = "$MEGATRON_LM_DIR"  # dry run without a checkout: left to the shell

# DeepSeek-V3 architecture (its published config): fixed, not options.
NUM_EXPERTS = 256
DENSE_LAYERS = 3
MODEL = {
    "--hidden-size": 7168,
    "--ffn-hidden-size": 18432,           # the dense layers' FFN
    "--num-attention-heads": 128,
    "--q-lora-rank": 1536,
    "--kv-lora-rank": 512,
    "--qk-head-dim": 128,
    "--qk-pos-emb-head-dim": 64,
    "--v-head-dim": 128,
    "--norm-epsilon": 1e-6,
    "--init-method-std": 0.006,
    "--num-experts": NUM_EXPERTS,
    "--moe-ffn-hidden-size": 2048,
    "--moe-shared-expert-intermediate-size": 2048,   # one shared expert of the routed experts' size
    "--moe-router-topk": 8,
    "--moe-router-num-groups": 8,        # 8 groups of 32 experts = one group per node at EP64
    "--moe-router-group-topk": 4,        # each token reaches at most 4 groups (nodes)
    "--moe-router-score-function": "sigmoid",
    "--moe-router-topk-scaling-factor": 2.5,
    "--moe-router-bias-update-rate": 1e-3,           # aux-loss-free balancing, gamma = 0.001
    "--moe-router-load-balancing-type": "seq_aux_loss",
    "--moe-aux-loss-coeff": 1e-4,                    # the small sequence-wise loss, alpha = 0.0001
    "--moe-router-dtype": "fp32",
    "--mtp-num-layers": 1,
    "--mtp-loss-scaling-factor": 0.3,                # lambda of the first 10T tokens
    "--hidden-dropout": 0.0,                         # DeepSeek-V3 trains without dropout (Megatron's default: 0.1)
    "--attention-dropout": 0.0,
}
MODEL_SWITCHES = [
    "--multi-latent-attention", "--qk-layernorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--moe-router-enable-expert-bias", "--moe-grouped-gemm",
]
# Pretraining at 4K context uses plain RoPE (YaRN is DeepSeek-V3's later long-context stage);
# Megatron's fused MLA RoPE is YaRN only, hence --no-rope-fusion.
ROPE = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rope-type", "rope", "--no-rope-fusion"]
VOCAB = 129280                           # DeepSeek-V3 tokenizer
DEFAULT_TOKENIZER = "deepseek-ai/DeepSeek-V3"

# --preset tiny: the same features at the size of one node of 4 GPUs (EP 4): 16 experts in 4
# groups of 4 (one group per rank, as one per node at EP64), top-4 within 2 groups.
TINY_MODEL = {
    "--hidden-size": 256, "--ffn-hidden-size": 512, "--num-attention-heads": 4,
    "--num-experts": 16, "--moe-ffn-hidden-size": 128, "--moe-shared-expert-intermediate-size": 128,
    "--moe-router-topk": 4, "--moe-router-num-groups": 4, "--moe-router-group-topk": 2,
}
# What the tiny preset passes in place of the full recipe's flags that need Transformer Engine
# or apex (or that Megatron refuses beside a feature the preset adds): (the full recipe's,
# the preset's, why). `--dry-run --preset tiny` prints them.
MLA_FLAGS = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim")
TINY_REPLACES = [
    ("--multi-latent-attention and its sizes (" + " ".join(MLA_FLAGS) + ")", "standard attention (4 heads of 64)",
     "MLA's core attention takes other head sizes for q / k and v, which only Transformer Engine's DotProductAttention "
     "accepts (Megatron-core's own raises on k_channels, main and core_r0.19.0)"),
    ("--transformer-impl transformer_engine (Megatron's default)", "--transformer-impl local",
     "Transformer Engine's layers -> Megatron-core's own"),
    ("--moe-grouped-gemm", "megatron_ep.megatron.launch --ep-experts grouped",
     "Transformer Engine's grouped GEMM -> megatron_ep's GroupedGemmExperts (DeepGEMM where built, else torch grouped_mm)"),
    ("--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16", "(dropped)",
     "Transformer Engine's FusedAdam -> Megatron's Adam with fp32 main gradients and moments"),
    ("--optimizer-cpu-offload --optimizer-offload-fraction 1.0 --overlap-cpu-optimizer-d2h-h2d", "(dropped)",
     "needs the precision-aware optimizer: the Adam states stay on the GPU"),
    ("gradient-accumulation fusion (Megatron's default)", "--no-gradient-accumulation-fusion",
     "Megatron-core's own linear layers need apex's fused_weight_gradient_mlp_cuda for it"),
    ("masked-softmax fusion (Megatron's default)", "--no-masked-softmax-fusion",
     "Megatron-core's own attention needs apex's scaled_masked_softmax_cuda for it"),
    ("persistent layer norm (Megatron's default)", "--no-persist-layer-norm",
     "apex's kernel; Megatron-core's own norm (torch RMSNorm) refuses it"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", "(dropped)",
     "Megatron refuses full recomputation beside --overlap-moe-expert-parallel-comm, which the preset adds"),
]
TINY_SWITCHES = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                 "--no-persist-layer-norm", "--overlap-moe-expert-parallel-comm"]


@dataclasses.dataclass(frozen=True)
class Preset:
    model: dict
    switches: tuple
    dense_layers: int
    vocab: int
    launcher: tuple  # megatron_ep.megatron.launch's own options, before the script
    defaults: dict   # option -> value where the command line and the environment give none


PRESETS = {
    "full": Preset(MODEL, tuple(MODEL_SWITCHES), DENSE_LAYERS, VOCAB, (), dict(
        nnodes=8, gpus_per_node=8, layers=61, ep=64, seq_length=4096, micro_batch_size=1, global_batch_size=1024,
        train_iters=100000, warmup_iters=2000, save_interval=1000, recompute="full", optimizer_offload=True)),
    # 2 micro-batches per step: the EP overlap interleaves one micro-batch's communication with
    # another's computation
    "tiny": Preset({k: v for k, v in {**MODEL, **TINY_MODEL}.items() if k not in MLA_FLAGS},
                   tuple(s for s in MODEL_SWITCHES if s not in ("--moe-grouped-gemm", "--multi-latent-attention")) +
                   tuple(TINY_SWITCHES), 1, 4096, ("--ep-experts", "grouped"), dict(
        nnodes=1, gpus_per_node=4, layers=3, ep=4, seq_length=128, micro_batch_size=2, global_batch_size=16,
        train_iters=20, warmup_iters=2, save_interval=10, recompute="none", optimizer_offload=False)),
}


def moe_layer_pattern(layers: int, dense: int) -> str:
    """Megatron's --moe-layer-freq list syntax: the first `dense` layers dense, the rest MoE."""
    return f"([0]*{dense}+[1]*{layers - dense})"


def _env_int(name: str, default):
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"launch.sh: error: the environment's {name}={value!r} is not an integer") from None


DEBUG_ENV = "MEGATRON_EP_DEBUG_TRACEBACK"


class _Parser(argparse.ArgumentParser):
    """One line on a bad argument (argparse prints the whole usage first); megatron_ep.tools.cli
    does the same for the other entry points, but this file must run without megatron_ep."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)" for options that are simply unset
        return action.help if action.default is None else super()._get_help_string(action)


def _dflt(name: str) -> str:
    full, tiny = PRESETS["full"].defaults[name], PRESETS["tiny"].defaults[name]
    show = {True: "on", False: "off"}
    return f" (default: {show.get(full, full)} / {show.get(tiny, tiny)})"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="launch.sh", description=__doc__.split("\n\n")[0],
                epilog="Arguments after `--` go to pretrain_gpt.py as given.", formatter_class=_Help)
    p.add_argument("--preset", choices=sorted(PRESETS), default="full",
                   help="full: DeepSeek-V3 671B; tiny: every feature that runs without Transformer Engine or apex, at the "
                        "size of one node of 4 GPUs (--dry-run lists the flags it replaces). Options left unset take the "
                        "preset's defaults, shown as 'full / tiny'")
    g = p.add_argument_group("cluster (defaults from the environment)")
    g.add_argument("--nnodes", type=int, default=_env_int("NNODES", None), help="NNODES" + _dflt("nnodes"))
    g.add_argument("--node-rank", type=int, default=_env_int("NODE_RANK", None), help="NODE_RANK; required unless --dry-run")
    g.add_argument("--gpus-per-node", type=int, default=_env_int("GPUS_PER_NODE", None), help="GPUS_PER_NODE" + _dflt("gpus_per_node"))
    g.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"), help="MASTER_ADDR; required unless --dry-run")
    g.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT", 29500), help="MASTER_PORT")
    g.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_DIR"),
                   help="Megatron-LM checkout holding pretrain_gpt.py (MEGATRON_LM_DIR)")
    g.add_argument("--torchrun", default="torchrun", help="launcher command, e.g. 'python -m torch.distributed.run'")
    g.add_argument("--dry-run", action="store_true", help="print every node's command and exit")

    g = p.add_argument_group("megatron_ep")
    g.add_argument("--dispatcher", choices=("hybridep", "deepep"), default="hybridep",
                   help="--moe-flex-dispatcher-backend: hybridep (permute fused into dispatch) or deepep (rank-major + local permute)")
    g.add_argument("--ep-backend", choices=backend_env.BACKENDS, default=None,
                   help=f"the nodes' {backend_env.ENV} (default: the environment's {backend_env.ENV}, else auto; the "
                        "option wins). auto: megatron_ep's cuda kernels on Hopper GPUs with the extension built (an EP "
                        "group across nodes: the two-level internode path, NVSHMEM RDMA + NVLink; tested on virtual nodes, "
                        "never over InfiniBand), else the torch backend; cuda: the kernels or an error; torch: NCCL all-to-all")
    g.add_argument("--infiniband", action=argparse.BooleanOptionalAction, default=True,
                   help="set the NVSHMEM environment an InfiniBand cluster needs for the cuda backend: IBGDA, the HCA list, "
                        "the QP depth (--no-infiniband: NVSHMEM's defaults, e.g. for RoCE or EFA)")
    g.add_argument("--ib-hcas", default=os.environ.get("NVSHMEM_HCA_LIST"),
                   help="NVSHMEM_HCA_LIST: the compute HCAs, so storage and management NICs are left out (default: the "
                        "environment's NVSHMEM_HCA_LIST, else mlx5_0:1 ... one port-1 HCA per GPU, an HGX node's rails)")
    g.add_argument("--ll-max-tokens", type=int, default=128,
                   help="tokens per rank of a low-latency (decode) dispatch; sizes NVSHMEM_QP_DEPTH to at least 2 x (this + 1), "
                        "the puts one QP may have in flight")

    g = p.add_argument_group("model and parallelism")
    g.add_argument("--layers", type=int, help="decoder layers (the first 3 dense; tiny: 1)" + _dflt("layers"))
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size of the dense part (experts: ETP 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (EP x PP must divide the world size)")
    g.add_argument("--ep", type=int, help="expert parallel size" + _dflt("ep"))
    g.add_argument("--fp8", action="store_true", help="FP8 GEMMs: e4m3, blockwise scaling (DeepSeek-V3's 1x128 / 128x128; Hopper, TransformerEngine)")
    g.add_argument("--recompute", choices=("full", "selective", "none"),
                   help="activation recomputation: full (every layer, uniform, 1 layer per checkpoint), selective, none"
                        + _dflt("recompute"))
    g.add_argument("--optimizer-offload", action=argparse.BooleanOptionalAction,
                   help="Adam states on the CPU (see docs/megatron.md: 61 layers at EP64 on 64 GPUs do not fit otherwise)"
                        + _dflt("optimizer_offload"))

    g = p.add_argument_group("data and training")
    g.add_argument("--data-path", nargs="+", default=None, help="Megatron indexed-dataset prefixes (blend weights allowed); none = --mock-data")
    g.add_argument("--tokenizer-model", default=DEFAULT_TOKENIZER, help="HuggingFace tokenizer for real data")
    g.add_argument("--seq-length", type=int, help="sequence length (and max position embeddings)" + _dflt("seq_length"))
    g.add_argument("--micro-batch-size", type=int, help="sequences per GPU per micro-batch" + _dflt("micro_batch_size"))
    g.add_argument("--global-batch-size", type=int,
                   help="sequences per step (a multiple of micro batch x data parallel size)" + _dflt("global_batch_size"))
    g.add_argument("--train-iters", type=int, help="training steps (the cosine decay spans them)" + _dflt("train_iters"))
    g.add_argument("--lr", type=float, default=2.2e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=2.2e-5, help="learning rate at the end of the cosine decay")
    g.add_argument("--warmup-iters", type=int, help="linear warm-up steps" + _dflt("warmup_iters"))
    g.add_argument("--checkpoint-dir", default=None, help="--save / --load directory (none: no checkpoints)")
    g.add_argument("--save-interval", type=int,
                   help="steps between checkpoints (with --checkpoint-dir)" + _dflt("save_interval"))
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard log directory (none: no TensorBoard)")
    return p


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = build_parser()
    args = p.parse_args(argv)
    args.extra = extra
    try:  # --ep-backend, else MEGATRON_EP_BACKEND, else auto; a bad value of the variable is refused
        args.ep_backend, args.backend_note = backend_env.choose(args.ep_backend, "--ep-backend")
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    for name, value in PRESETS[args.preset].defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    validate(p, args)
    return args


def validate(p, args):
    for name in ("nnodes", "gpus_per_node", "layers", "tp", "pp", "ep", "seq_length", "micro_batch_size",
                 "global_batch_size", "train_iters", "save_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_iters < 0 or args.lr <= 0 or args.min_lr < 0:
        p.error("--warmup-iters and --min-lr must be >= 0, --lr > 0")
    world = args.nnodes * args.gpus_per_node
    preset = PRESETS[args.preset]
    experts = preset.model["--num-experts"]
    if args.layers <= preset.dense_layers:
        p.error(f"--layers must be more than the {preset.dense_layers} dense layers")
    if experts % args.ep:
        p.error(f"--ep {args.ep} must divide the {experts} experts")
    if args.preset == "tiny":
        for bad, why in ((args.fp8, "--fp8 needs Transformer Engine"),
                         (args.optimizer_offload, "--optimizer-offload needs Transformer Engine's precision-aware optimizer"),
                         (args.recompute == "full", "--recompute full: Megatron refuses it beside "
                                                    "--overlap-moe-expert-parallel-comm (use selective or none)")):
            if bad:
                p.error(f"--preset tiny: {why}")
    if world % (args.ep * args.pp) or world % (args.tp * args.pp):
        p.error(f"world size {world} (NNODES x GPUS_PER_NODE) must be a multiple of EP x PP = {args.ep * args.pp} and TP x PP = {args.tp * args.pp}")
    dp = world // (args.tp * args.pp)
    if args.global_batch_size % (args.micro_batch_size * dp):
        p.error(f"--global-batch-size must be a multiple of micro batch x data parallel = {args.micro_batch_size * dp}")
    if args.ep_backend != "torch":
        if args.gpus_per_node > 8:
            p.error(f"--ep-backend {args.ep_backend}: megatron_ep's NVLink stage takes at most 8 ranks per node")
        if args.ep % args.gpus_per_node and args.gpus_per_node % args.ep:
            p.error(f"--ep-backend {args.ep_backend}: an EP group of {args.ep} ranks must fill whole nodes of "
                    f"{args.gpus_per_node} GPUs, or fit in one (the cuda backend's paths)")
    if args.ll_max_tokens < 1:
        p.error("--ll-max-tokens must be >= 1")
    if not args.dry_run:
        for name, value in (("NODE_RANK / --node-rank", args.node_rank), ("MASTER_ADDR / --master-addr", args.master_addr),
                            ("MEGATRON_LM_DIR / --megatron-lm", args.megatron_lm)):
            if value is None:
                p.error(f"{name} is not set")
        if not 0 <= args.node_rank < args.nnodes:
            p.error(f"NODE_RANK {args.node_rank} is not in [0, {args.nnodes})")
        if not os.path.isfile(os.path.join(args.megatron_lm, "pretrain_gpt.py")):
            p.error(f"{args.megatron_lm} has no pretrain_gpt.py (MEGATRON_LM_DIR must be a Megatron-LM checkout)")


def _kv(d) -> list:
    out = []
    for flag, value in d.items():
        out += [flag, str(value)]
    return out


def megatron_args(args) -> list:
    """pretrain_gpt.py's arguments (without the extra ones after `--`)."""
    preset = PRESETS[args.preset]
    a = ["--num-layers", str(args.layers), "--moe-layer-freq", moe_layer_pattern(args.layers, preset.dense_layers)]
    a += _kv(preset.model) + list(preset.switches) + ROPE
    a += ["--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length)]
    # megatron_ep through Megatron's flex dispatcher
    a += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", args.dispatcher]
    # parallelism
    a += ["--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size", str(args.pp),
          "--expert-model-parallel-size", str(args.ep), "--expert-tensor-parallel-size", "1"]
    if args.tp > 1:
        a += ["--sequence-parallel"]
    a += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    # precision
    a += ["--bf16"]
    if args.fp8:
        a += ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--moe-router-padding-for-quantization"]
    # memory
    if args.recompute == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif args.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
    if args.optimizer_offload:
        # fp32 master weights and, as DeepSeek-V3 did, bf16 Adam moments, all on the host;
        # bf16 gradients on the device
        a += ["--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0",
              "--overlap-cpu-optimizer-d2h-h2d", "--main-grads-dtype", "bf16",
              "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    # optimizer and schedule (DeepSeek-V3: AdamW 0.9 / 0.95, weight decay 0.1, clip 1.0)
    a += ["--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--weight-decay", "0.1",
          "--clip-grad", "1.0", "--lr", str(args.lr), "--min-lr", str(args.min_lr), "--lr-decay-style", "cosine",
          "--lr-warmup-iters", str(args.warmup_iters), "--lr-decay-iters", str(args.train_iters),
          "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
          "--train-iters", str(args.train_iters), "--cross-entropy-loss-fusion"]
    # data and tokenizer
    if args.data_path:
        a += ["--data-path", *args.data_path, "--split", "99,1,0",
              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", args.tokenizer_model]
    else:
        a += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(preset.vocab)]
    # logging, evaluation, checkpoints
    a += ["--log-interval", "1", "--log-throughput", "--eval-interval", "1000", "--eval-iters", "10",
          "--distributed-timeout-minutes", "60"]
    if args.checkpoint_dir:
        a += ["--save", args.checkpoint_dir, "--load", args.checkpoint_dir, "--save-interval", str(args.save_interval)]
    if args.tensorboard_dir:
        a += ["--tensorboard-dir", args.tensorboard_dir]
    return a


def nvshmem_env(args) -> dict:
    """NVSHMEM's environment for the cuda backend on InfiniBand: GPU-initiated RDMA (IBGDA), the
    compute HCAs (each GPU's PE then takes the nearest of them), and QPs deep enough for a
    low-latency dispatch's puts (DeepEP's rule, 2 x (tokens + 1), and NVSHMEM's 1024 at least)."""
    if args.ep_backend == "torch" or not args.infiniband:
        return {}
    hcas = args.ib_hcas or ",".join(f"mlx5_{i}:1" for i in range(args.gpus_per_node))
    return {"NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_HCA_LIST": hcas,
            "NVSHMEM_QP_DEPTH": str(max(1024, 2 * (args.ll_max_tokens + 1)))}


def ep_paths(args, node_rank: int) -> str:
    """Which EP groups this node's ranks are in and the megatron_ep path each takes (EP groups
    are EP consecutive ranks: Megatron orders expert ranks expert-TP, then EP, with ETP 1)."""
    g, ep = args.gpus_per_node, args.ep
    first, last = node_rank * g, node_rank * g + g - 1
    groups = sorted({r // ep for r in range(first, last + 1)})
    spans = [(grp * ep // g, (grp * ep + ep - 1) // g) for grp in groups]
    if args.ep_backend == "torch":
        path = "torch backend (NCCL all-to-all)"
    elif spans[0][0] == spans[0][1]:
        path = f"cuda intranode path ({min(ep, g)} ranks over NVLink)"
    else:
        n = spans[0][1] - spans[0][0] + 1
        path = f"cuda two-level internode path ({n} nodes x {g} ranks: NVSHMEM RDMA between nodes, NVLink inside)"
    if args.ep_backend == "auto":
        path += " on Hopper GPUs with megatron_ep's extension, else the torch backend"
    where = ", ".join(f"EP group {grp} (ranks {grp * ep}-{grp * ep + ep - 1}, nodes {a}-{b})" if a != b else
                      f"EP group {grp} (ranks {grp * ep}-{grp * ep + ep - 1})" for grp, (a, b) in zip(groups, spans))
    return f"ranks {first}-{last}: {where}: {path}"


def node_command(args, node_rank: int):
    """(environment additions, argv) of one node. PYTHONPATH puts Megatron-LM's own megatron.core
    ahead of an installed megatron-core wheel, and makes megatron_ep importable from this
    checkout when it is not pip-installed; the caller's PYTHONPATH is appended at launch."""
    megatron_lm = os.path.abspath(args.megatron_lm) if args.megatron_lm else MEGATRON_LM_PLACEHOLDER
    env = {"MEGATRON_EP_BACKEND": args.ep_backend, **nvshmem_env(args)}
    if args.tp > 1:  # Megatron-LM's validate_args requires it with TP on Hopper and earlier
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([megatron_lm, REPO_ROOT])
    argv = shlex.split(args.torchrun) + [
        "--nnodes", str(args.nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(args.gpus_per_node),
        "--master-addr", args.master_addr or "$MASTER_ADDR", "--master-port", str(args.master_port),
        "-m", "megatron_ep.megatron.launch", *PRESETS[args.preset].launcher, megatron_lm + "/pretrain_gpt.py",
    ] + megatron_args(args) + args.extra
    return env, argv


def _quote(token: str) -> str:
    """shlex quoting, except that the placeholders ($MASTER_ADDR, $MEGATRON_LM_DIR) stay expandable."""
    if "$" in token and re.fullmatch(r"[\w$/.:+,=-]+", token):
        return f'"{token}"'
    return shlex.quote(token)


def render(env, argv) -> str:
    """One shell line; the caller's PYTHONPATH is appended as at launch."""
    words = [f"{k}={_quote(v)}" + ('"${PYTHONPATH:+:$PYTHONPATH}"' if k == "PYTHONPATH" else "") for k, v in env.items()]
    return " ".join(words + [_quote(x) for x in argv])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        print(f"# DeepSeek-V3{' (preset tiny)' if args.preset == 'tiny' else ''} on {args.nnodes} nodes x "
              f"{args.gpus_per_node} GPUs: EP{args.ep} TP{args.tp} PP{args.pp}, "
              f"{args.layers} layers, flex/{args.dispatcher}, megatron_ep backend {args.ep_backend}"
              + (", FP8 blockwise" if args.fp8 else ", bf16"))
        if args.backend_note:
            print(f"# {args.backend_note}")
        if args.preset == "tiny":
            for full, tiny, why in TINY_REPLACES:
                print(f"# replaces {full}  ->  {tiny}: {why}")
        nv = nvshmem_env(args)
        print("# NVSHMEM: " + (" ".join(f"{k}={v}" for k, v in nv.items()) if nv else "its own defaults"))
        for rank in range(args.nnodes):
            print(f"# node {rank}: {ep_paths(args, rank)}")
            print(render(*node_command(args, rank)))
        return
    if args.backend_note:
        print(f"# {args.backend_note}", flush=True)
    print(f"# node {args.node_rank}: {ep_paths(args, args.node_rank)}", flush=True)
    env, argv = node_command(args, args.node_rank)
    if shutil.which(argv[0]) is None:
        raise SystemExit(f"launch.sh: error: {argv[0]} not found; pass --torchrun '{sys.executable} -m torch.distributed.run'")
    print(render(env, argv), flush=True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env["PYTHONPATH"], os.environ.get("PYTHONPATH")]))
    os.execvpe(argv[0], argv, {**os.environ, **env})


def _stdout_closed() -> int:
    """The reader of stdout went away (`launch.sh --dry-run | head -1`): end quietly, as a
    command ended by SIGPIPE (status 141), with the rest of the output sent nowhere."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + 13


if __name__ == "__main__":
    try:
        envs.check_switches()  # MEGATRON_EP_DEBUG_TRACEBACK among them: one parser, one rule
    except ValueError as e:
        print(f"launch.sh: error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        try:
            main()
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        sys.exit(_stdout_closed())
    except Exception as e:  # one line (the traceback with MEGATRON_EP_DEBUG_TRACEBACK=1), as every entry point
        if envs.flag(DEBUG_ENV):
            raise
        sys.exit(f"launch.sh: error: {type(e).__name__}: {e} ({DEBUG_ENV}=1 shows the traceback)")
