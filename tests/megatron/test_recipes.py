"""Recipes: every Megatron-LM flag of the DeepSeek-V3 EP64 launcher is a megatron-core config
field (or a mapped / training-loop flag verified against Megatron-LM's source), its dry run
prints one correct torchrun command per node, and the cpu-toy proxy trains for 2 steps.

Megatron-LM's `megatron/training/arguments.py` is not in the megatron-core wheel, so the flags
that are not config fields were checked by hand against these Megatron-LM commits (line numbers
below are arguments.py's unless another file is named):
  A = core_v0.16.1  55ac7082517c3878ae653c07c09c534b8aed49f6
  B = core_v0.19.0  5be9626709af2722333bf54797c954c09edeada3
(and main at d98e8a64ddf34856e74b24714e3bedb2f5a39553, 2026-08-22: all flags of the launcher's
default, FP8 + TP2 + real-data + checkpoint, and no-offload variants went through
`parse_args()` of all three checkouts with no unknown argument, and `validate_args()` at
world size 64 accepted them.) Config fields become flags through Megatron-LM's
ArgumentGroupFactory: `foo_bar` -> `--foo-bar` (`--no-foo-bar` for a bool defaulting to True)
unless the field's `argparse_meta` names another flag.
"""

import dataclasses
import math
import os
import re
import shlex
import subprocess
import sys

import megatron.core  # noqa: F401  (CI installs megatron-core: a missing one must fail, not skip)
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from test_megatron_install import ROOT, _run  # subprocess helper: cwd and PYTHONPATH = the checkout

sys.path.insert(0, ROOT)
from recipes.deepseek_v3_ep64 import launch  # noqa: E402

CONFIG_CLASSES = (TransformerConfig, MLATransformerConfig, ModelParallelConfig, OptimizerConfig,
                  DistributedDataParallelConfig)

# Megatron-LM flag -> config field, where the names differ.
MAPPED = {
    # A 2691 / B 3351 `--num-experts`; copied into num_moe_experts by core_transformer_config_from_args
    # (A arguments.py 1327, B argument_utils.py 308)
    "--num-experts": "num_moe_experts",
    # A 1687 / B 2367 `--swiglu`; sets gated_linear_unit (A 1334, B argument_utils.py 316) and SiLU
    "--swiglu": "gated_linear_unit",
    # A 2045 / B 2765 `--no-rope-fusion`, dest='apply_rope_fusion'
    "--no-rope-fusion": "apply_rope_fusion",
    # argparse_meta arg_names of the field in transformer_config.py: A 151 / B 195
    "--norm-epsilon": "layernorm_epsilon",
    # transformer_config.py A 162 / B 206 (store_false)
    "--disable-bias-linear": "add_bias_linear",
    # transformer_config.py A 430 / B 567
    "--fp8-format": "fp8",
    # A 2030 / B 2750 (store_false, dest='masked_softmax_fusion'): --preset tiny
    "--no-masked-softmax-fusion": "masked_softmax_fusion",
    # A 2083 / B 2807 (store_false, dest='gradient_accumulation_fusion'): --preset tiny
    "--no-gradient-accumulation-fusion": "gradient_accumulation_fusion",
    # A 2078 / B 2802 (store_true; Megatron-LM passes persist_layer_norm = not it): --preset tiny
    "--no-persist-layer-norm": "persist_layer_norm",
}

# Flags of Megatron-LM's training loop / model builder, not megatron-core config fields.
# "TC n" = a field of megatron/training/training_config.py (A) / config/training_config.py (B)
# that Megatron-LM's ArgumentGroupFactory turns into the flag.
TRAINING_LOOP = {
    "--seq-length": "A 2482 / B 3138",
    "--max-position-embeddings": "A 1642 / B 2311",
    "--position-embedding-type": "A 1645 / B 2314",
    "--untie-embeddings-and-output-weights": "A 1697 / B 2377",
    "--micro-batch-size": "TC A 10 / B 11",
    "--global-batch-size": "TC A 14 / B 15",
    "--train-iters": "TC A 46 / B 64",
    "--lr-decay-style": "TC A 124 / B 169",
    "--lr-decay-iters": "TC A 130 / B 175",
    "--lr-warmup-iters": "TC A 145 / B 190",
    "--eval-iters": "TC A 94 / B 115",
    "--eval-interval": "TC A 98 / B 119",
    "--log-interval": "TC A 202 / B 247",
    "--log-throughput": "TC A 208 / B 253",
    "--tensorboard-dir": "TC A 238 / B 283",
    "--save": "TC A 329 / B 395",
    "--save-interval": "TC A 332 / B 398",
    "--load": "TC A 355 / B 430",
    "--distributed-timeout-minutes": "A 2238 / B config/common_config.py 77",
    "--mock-data": "A 2479 / B 3135",
    "--data-path": "A 2431 / B 3088",
    "--split": "A 2443 / B 3099",
    "--tokenizer-type": "A 2386 / B TC 673",
    "--tokenizer-model": "A 2401 / B TC 689",
    "--vocab-size": "A 2373 / B TC 654",
}

# Launcher variants that together emit every flag it can pass.
VARIANTS = {
    "default": ["--dry-run"],
    "fp8-tp2-data-ckpt": ["--dry-run", "--fp8", "--dispatcher", "deepep", "--tp", "2", "--recompute", "selective",
                          "--data-path", "0.7", "/data/a_text_document", "0.3", "/data/b_text_document",
                          "--checkpoint-dir", "/ckpt", "--tensorboard-dir", "/tb"],
    "no-offload": ["--dry-run", "--no-optimizer-offload", "--recompute", "none", "--layers", "8"],
    "tiny": ["--dry-run", "--preset", "tiny"],
}


def _fields():
    return {f.name: f for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)}


def _flags(argv):
    return [a for a in argv if a.startswith("--")]


def unknown_flags(flags):
    """Flags that are neither a config field, a mapped flag nor a listed training-loop flag."""
    fields = _fields()
    return sorted({f for f in flags
                   if f[2:].replace("-", "_") not in fields and f not in MAPPED and f not in TRAINING_LOOP})


def _all_recipe_flags():
    return {name: launch.megatron_args(launch.parse_args(argv)) for name, argv in VARIANTS.items()}


def test_every_recipe_flag_is_known_to_megatron():
    per_variant = _all_recipe_flags()
    used = set()
    for name, argv in per_variant.items():
        flags = _flags(argv)
        used.update(flags)
        assert not unknown_flags(flags), f"{name}: not a megatron-core config field nor a verified Megatron-LM flag: {unknown_flags(flags)}"
    fields = _fields()
    for flag, field in MAPPED.items():
        assert field in fields, f"{flag} maps to {field}, which megatron-core {megatron.core.__version__} lacks"
        meta = fields[field].metadata.get("argparse_meta", {}).get("arg_names")
        if meta is not None:  # the config itself names the flag: it must be ours
            assert flag in meta, (flag, field, meta)
    # switches given without a value must be store_true flags: bool fields that default to False
    # (a True default would make Megatron-LM's flag `--no-...`)
    for argv in per_variant.values():
        for i, flag in enumerate(argv):
            takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            field = fields.get(flag[2:].replace("-", "_")) if flag.startswith("--") else None
            if field is not None and not takes_value and flag not in MAPPED:
                owner = [c for c in (TransformerConfig, ModelParallelConfig, OptimizerConfig, DistributedDataParallelConfig,
                                     MLATransformerConfig)
                         if field.name in {f.name for f in dataclasses.fields(c)}][0]
                default = {f.name: f for f in dataclasses.fields(owner)}[field.name].default
                assert default is False, f"{flag}: {owner.__name__}.{field.name} defaults to {default!r}"
    stale = (set(MAPPED) | set(TRAINING_LOOP)) - used
    assert not stale, f"listed but never passed (remove them): {sorted(stale)}"


def test_flag_check_rejects_an_unknown_flag():
    assert unknown_flags(["--moe-router-topk", "--num-experts", "--train-iters", "--moe-router-not-a-flag"]) == ["--moe-router-not-a-flag"]


def test_recipe_model_is_deepseek_v3():
    argv = launch.megatron_args(launch.parse_args(["--dry-run"]))
    opt = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            opt[a] = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
    freq = eval(opt["--moe-layer-freq"], {})  # Megatron-LM evaluates this list expression the same way
    assert freq == [0] * 3 + [1] * 58 and int(opt["--num-layers"]) == 61
    expect = {"--hidden-size": "7168", "--ffn-hidden-size": "18432", "--num-attention-heads": "128",
              "--q-lora-rank": "1536", "--kv-lora-rank": "512", "--qk-head-dim": "128", "--qk-pos-emb-head-dim": "64",
              "--v-head-dim": "128", "--num-experts": "256", "--moe-router-topk": "8", "--moe-ffn-hidden-size": "2048",
              "--moe-shared-expert-intermediate-size": "2048", "--moe-router-num-groups": "8", "--moe-router-group-topk": "4",
              "--moe-router-score-function": "sigmoid", "--moe-router-topk-scaling-factor": "2.5", "--mtp-num-layers": "1",
              "--expert-model-parallel-size": "64", "--moe-token-dispatcher-type": "flex",
              "--moe-flex-dispatcher-backend": "hybridep", "--seq-length": "4096"}
    assert {k: opt.get(k) for k in expect} == expect
    for switch in ("--multi-latent-attention", "--moe-router-enable-expert-bias", "--moe-grouped-gemm", "--bf16", "--mock-data"):
        assert opt.get(switch) is True, switch


def _dry_run(cmd, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "GPUS_PER_NODE", "MEGATRON_LM_DIR", "MASTER_ADDR")}
    env.update(env_extra, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return out


def _node_commands(stdout):
    lines = [ln for ln in stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    return [shlex.split(ln) for ln in lines]


def _value(words, flag):
    return words[words.index(flag) + 1]


def _without_rank(words):
    i = words.index("--node-rank")
    return words[:i] + words[i + 2:]


def test_dry_run_prints_one_command_per_node():
    env = {"NNODES": "8", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "23456"}
    sh = os.path.join(ROOT, "recipes", "deepseek_v3_ep64", "launch.sh")
    py = os.path.join(ROOT, "recipes", "deepseek_v3_ep64", "launch.py")
    for cmd, backend in ((["bash", sh, "--dry-run"], "hybridep"),
                         ([sys.executable, py, "--dry-run", "--dispatcher", "deepep"], "deepep")):
        out = _dry_run(cmd, env)
        assert out.returncode == 0, out.stderr[-2000:]
        nodes = _node_commands(out.stdout)
        assert len(nodes) == 8, out.stdout[:2000]
        header = [ln for ln in out.stdout.splitlines() if ln.startswith("# node ")]
        assert len(header) == 8 and all("two-level internode path (8 nodes x 8 ranks" in ln and "ranks 0-63" in ln
                                        for ln in header), header
        for rank, words in enumerate(nodes):
            assert "MEGATRON_EP_BACKEND=auto" in words  # our kernels by default: the internode path across the 8 nodes
            assert {"NVSHMEM_IB_ENABLE_IBGDA=1", "NVSHMEM_QP_DEPTH=1024"} <= set(words), words[:6]
            assert any(w.startswith("NVSHMEM_HCA_LIST=mlx5_0:1,") for w in words), words[:6]
            pythonpath = next(w for w in words if w.startswith("PYTHONPATH="))
            assert pythonpath.startswith("PYTHONPATH=$MEGATRON_LM_DIR:")  # Megatron-LM's megatron.core first
            start = words.index("torchrun")
            assert _value(words, "--nnodes") == "8" and _value(words, "--node-rank") == str(rank)
            assert _value(words, "--nproc-per-node") == "8"
            assert _value(words, "--master-addr") == "10.1.2.3" and _value(words, "--master-port") == "23456"
            m = words.index("-m", start)
            assert words[m + 1] == "megatron_ep.megatron.launch" and words[m + 2].endswith("/pretrain_gpt.py")
            assert _value(words, "--expert-model-parallel-size") == "64"
            assert _value(words, "--moe-token-dispatcher-type") == "flex"
            assert _value(words, "--moe-flex-dispatcher-backend") == backend
            assert _without_rank(words) == _without_rank(nodes[0])  # the nodes differ by their rank only


def test_launcher_execs_the_node_command(tmp_path):
    """A real launch (torchrun replaced by echo): this node's command, with the checkout's path."""
    (tmp_path / "pretrain_gpt.py").write_text("")
    py = os.path.join(ROOT, "recipes", "deepseek_v3_ep64", "launch.py")
    out = _dry_run([sys.executable, py, "--torchrun", "echo"],
                   {"NODE_RANK": "5", "MASTER_ADDR": "10.1.2.3", "MEGATRON_LM_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    header, printed, echoed = out.stdout.strip().splitlines()
    assert header.startswith("# node 5: ranks 40-47: EP group 0 (ranks 0-63, nodes 0-7): cuda two-level internode path"), header
    words = echoed.split()
    assert _value(words, "--node-rank") == "5" and _value(words, "--nnodes") == "8"
    assert words[words.index("megatron_ep.megatron.launch") + 1] == str(tmp_path / "pretrain_gpt.py")
    assert f"PYTHONPATH={tmp_path}:{ROOT}" in printed


def test_launcher_refuses_what_cannot_run():
    py = os.path.join(ROOT, "recipes", "deepseek_v3_ep64", "launch.py")
    out = _dry_run([sys.executable, py], {"MASTER_ADDR": "10.1.2.3"})  # a real launch without NODE_RANK
    assert out.returncode == 2 and "NODE_RANK" in out.stderr
    out = _dry_run([sys.executable, py, "--dry-run"], {"NNODES": "2"})  # EP64 needs 64 GPUs
    assert out.returncode == 2 and "EP x PP" in out.stderr
    out = _dry_run([sys.executable, py, "--dry-run", "--ep-backend", "cuda"], {})  # EP64 across nodes: internode path
    assert out.returncode == 0 and "MEGATRON_EP_BACKEND=cuda" in out.stdout, out.stderr
    out = _dry_run([sys.executable, py, "--dry-run", "--ep", "16", "--gpus-per-node", "4"], {"NNODES": "16"})
    assert out.returncode == 0 and "(4 nodes x 4 ranks" in out.stdout, out.stderr
    out = _dry_run([sys.executable, py, "--dry-run", "--ep", "32", "--gpus-per-node", "6", "--global-batch-size", "960"],
                   {"NNODES": "16"})
    assert out.returncode == 2 and "must fill whole nodes" in out.stderr, out.stderr


def test_launcher_follows_the_backend_variable():
    """MEGATRON_EP_BACKEND picks every node's backend unless --ep-backend does (which wins, and
    says so); a value that names no backend is refused in one line by megatron_ep's own rule
    (megatron_ep/megatron/backend.py)."""
    py = os.path.join(ROOT, "recipes", "deepseek_v3_ep64", "launch.py")

    def backends(out):
        return {w for words in _node_commands(out.stdout) for w in words if w.startswith("MEGATRON_EP_BACKEND=")}

    out = _dry_run([sys.executable, py, "--dry-run"], {"MEGATRON_EP_BACKEND": "torch"})
    assert out.returncode == 0 and backends(out) == {"MEGATRON_EP_BACKEND=torch"}, out.stdout[:2000] + out.stderr
    assert "megatron_ep backend torch" in out.stdout and "# NVSHMEM: its own defaults" in out.stdout  # NCCL: no NVSHMEM
    assert "torch backend (NCCL all-to-all)" in out.stdout
    out = _dry_run([sys.executable, py, "--dry-run", "--ep-backend", "cuda"], {"MEGATRON_EP_BACKEND": "torch"})
    assert out.returncode == 0 and backends(out) == {"MEGATRON_EP_BACKEND=cuda"}, out.stderr
    assert "# --ep-backend cuda overrides MEGATRON_EP_BACKEND=torch (the command's option wins)" in out.stdout
    out = _dry_run([sys.executable, py, "--dry-run"], {"MEGATRON_EP_BACKEND": ""})
    assert out.returncode == 0 and backends(out) == {"MEGATRON_EP_BACKEND=auto"}, out.stderr
    for options in ([], ["--ep-backend", "torch"]):  # a bad value is refused even under the option
        out = _dry_run([sys.executable, py, "--dry-run", *options], {"MEGATRON_EP_BACKEND": "xyz"})
        assert out.returncode == 2 and out.stdout == "", out.stdout[:500]
        assert out.stderr.strip() == ("launch.sh: error: MEGATRON_EP_BACKEND='xyz' names no backend: use one of "
                                      "torch, cuda, auto (or leave it unset: auto)"), out.stderr


def test_tiny_preset():
    """--preset tiny: DeepSeek-V3's features without Transformer Engine at 4 GPUs, megatron_ep's
    experts from the launcher, every replaced flag printed by --dry-run with its replacement, and
    the options Transformer Engine or Megatron would refuse refused first."""
    py = os.path.join(ROOT, "recipes", "deepseek_v3_ep64", "launch.py")
    out = _dry_run([sys.executable, py, "--dry-run", "--preset", "tiny"], {})
    assert out.returncode == 0, out.stderr
    (words,) = _node_commands(out.stdout)
    m = words.index("-m")
    assert words[m + 1:m + 4] == ["megatron_ep.megatron.launch", "--ep-experts", "grouped"], words[m:m + 5]
    for switch in ("--moe-router-enable-expert-bias", "--use-distributed-optimizer", "--mtp-num-layers",
                   "--overlap-grad-reduce", "--overlap-moe-expert-parallel-comm", "--no-gradient-accumulation-fusion"):
        assert switch in words, switch
    for gone in ("--moe-grouped-gemm", "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--recompute-granularity",
                 "--multi-latent-attention", "--q-lora-rank"):
        assert gone not in words, gone
    assert _value(words, "--transformer-impl") == "local" and _value(words, "--expert-model-parallel-size") == "4"
    assert _value(words, "--moe-router-load-balancing-type") == "seq_aux_loss" and _value(words, "--mtp-num-layers") == "1"
    assert _value(words, "--nproc-per-node") == "4" and _value(words, "--moe-router-num-groups") == "4"
    replaced = [ln for ln in out.stdout.splitlines() if ln.startswith("# replaces ")]
    assert len(replaced) == len(launch.TINY_REPLACES) and any("--moe-grouped-gemm  ->  megatron_ep" in ln for ln in replaced)
    for flag in ("--fp8", "--optimizer-offload"):
        bad = _dry_run([sys.executable, py, "--dry-run", "--preset", "tiny", flag], {})
        assert bad.returncode == 2 and "--preset tiny" in bad.stderr and "Transformer Engine" in bad.stderr, bad.stderr
    bad = _dry_run([sys.executable, py, "--dry-run", "--preset", "tiny", "--recompute", "full"], {})
    assert bad.returncode == 2 and "overlap-moe-expert-parallel-comm" in bad.stderr, bad.stderr
    full = _dry_run([sys.executable, py, "--dry-run"], {})  # the full recipe is unchanged by the preset's defaults
    assert "# replaces" not in full.stdout and _value(_node_commands(full.stdout)[0], "--num-layers") == "61"
    assert "--preset {full,tiny}" in subprocess.run([sys.executable, py, "--help"], capture_output=True, text=True).stdout


def test_dry_run_backend_choices():
    """--ep-backend torch: NCCL all-to-all and no NVSHMEM settings; --ib-hcas / --ll-max-tokens
    reach the environment; EP8 on 8-GPU nodes stays inside each node (the intranode path)."""
    py = os.path.join(ROOT, "recipes", "deepseek_v3_ep64", "launch.py")
    out = _dry_run([sys.executable, py, "--dry-run", "--ep-backend", "torch"], {})
    assert out.returncode == 0 and "MEGATRON_EP_BACKEND=torch" in out.stdout and "NVSHMEM_" not in _node_commands(out.stdout)[0][0]
    assert all("NVSHMEM" not in w for w in _node_commands(out.stdout)[0]) and "torch backend (NCCL all-to-all)" in out.stdout
    out = _dry_run([sys.executable, py, "--dry-run", "--ib-hcas", "mlx5_2:1,mlx5_3:1", "--ll-max-tokens", "1024"], {})
    words = _node_commands(out.stdout)[3]
    assert "NVSHMEM_HCA_LIST=mlx5_2:1,mlx5_3:1" in words and "NVSHMEM_QP_DEPTH=2050" in words, words[:6]
    out = _dry_run([sys.executable, py, "--dry-run", "--no-infiniband"], {})
    assert all("NVSHMEM" not in w for w in _node_commands(out.stdout)[0]), out.stdout[:500]
    out = _dry_run([sys.executable, py, "--dry-run", "--ep", "8"], {})
    header = [ln for ln in out.stdout.splitlines() if ln.startswith("# node 5:")]
    assert header and "EP group 5 (ranks 40-47)" in header[0] and "cuda intranode path" in header[0], header


def test_proxy_presets_list_and_dry_run():
    listing = _run(None, args=("-m", "recipes.proxies", "--list"))
    for name in ("cpu-toy", "gpu-1", "gpu-8"):
        assert re.search(rf"^{name}\s", listing, re.M), listing
    from recipes import proxies

    _, cmd = proxies.command("gpu-8")  # its dry run checks for 8 GPUs, as its run does
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8" and cmd[cmd.index("--backend") + 1] == "cuda"
    assert cmd[cmd.index("--experts") + 1] == "64" and cmd[cmd.index("--group-topk") + 1] == "4"
    cmd = shlex.split(_run(None, args=("-m", "recipes.proxies", "--preset", "cpu-toy", "--dry-run")).strip())
    assert cmd[0] == "CUDA_VISIBLE_DEVICES=" and cmd[1:4] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[4:7] == ["--standalone", "--nproc-per-node", "4"] and cmd[7].endswith("recipes/train_moe.py")


def test_cpu_toy_proxy_trains():
    """The cpu-toy preset end to end: 2 gloo processes, 2 steps of train_moe.py, finite loss."""
    out = _run(None, args=("-m", "recipes.proxies", "--preset", "cpu-toy", "--nproc", "2", "--steps", "2"))
    assert "manager=MegatronEPHybridEPManager" in out and "world=2" in out, out[-3000:]
    steps = [ln.split() for ln in out.splitlines() if re.match(r"^\s*\d+\s+\S+\s+[\d.]+\s", ln)]
    assert [int(s[0]) for s in steps] == [0, 1], out[-3000:]
    losses = [float(s[1]) for s in steps]
    assert all(math.isfinite(x) and 0 < x < 10 for x in losses), losses


def _train_losses(dispatcher, steps):
    out = _run(None, env={"CUDA_VISIBLE_DEVICES": ""}, args=(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "recipes/train_moe.py",
        "--dispatcher", dispatcher, "--steps", str(steps)))
    rows = [ln.split() for ln in out.splitlines() if re.match(r"^\s*\d+\s+\S+\s+[\d.]+\s", ln)]
    assert [int(r[0]) for r in rows] == list(range(steps)), out[-3000:]
    return [float(r[1]) for r in rows]


def test_train_moe_loss_decreases_and_matches_alltoall():
    """recipes/train_moe.py at toy size (2 gloo processes, fixed seed, 4 steps): the loss is finite
    and falls at every step, and the flex hybridep run (megatron_ep's manager, fused permute,
    grouped experts) computes the same losses as Megatron's alltoall dispatcher (fp32)."""
    flex, ref = _train_losses("hybridep", 4), _train_losses("alltoall", 4)
    assert all(math.isfinite(x) for x in flex), flex
    assert all(b < a for a, b in zip(flex, flex[1:])), f"loss does not fall every step: {flex}"
    assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(flex, ref)), f"hybridep {flex} vs alltoall {ref}"


def test_shared_expert_overlap_flag():
    """--shared-expert-overlap reaches Megatron's config (the A/B tool shares the flag), and what
    cannot run is refused before anything starts: no GPU, or a flex dispatcher on a megatron-core
    whose config accepts the overlap with alltoall only (0.16)."""
    import pytest
    import torch

    from megatron_ep.tools import cli
    from recipes import train_moe

    args = train_moe.parse_args(["--dispatcher", "alltoall", "--shared-expert-overlap"])
    if not torch.cuda.is_available():
        with pytest.raises(cli.UsageError, match="--shared-expert-overlap needs a CUDA GPU"):
            train_moe.validate(args, 2)
    config = train_moe.build_config(args, 1, on_gpu=False)
    assert config.moe_shared_expert_overlap and config.moe_shared_expert_intermediate_size == args.expert_ffn
    assert not train_moe.build_config(train_moe.parse_args(["--dispatcher", "alltoall"]), 1, on_gpu=False).moe_shared_expert_overlap
    version = tuple(int(x) for x in megatron.core.__version__.split(".")[:2])
    flex = train_moe.parse_args(["--dispatcher", "hybridep", "--shared-expert-overlap"])
    if version < (0, 19):
        with pytest.raises(cli.UsageError, match="needs megatron-core >= 0.19"):
            train_moe.validate(flex, 2)
    if version >= (0, 19):
        assert train_moe.build_config(flex, 1, on_gpu=False).moe_shared_expert_overlap
