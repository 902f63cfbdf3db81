"""The up-front estimate of processes and memory (megatron_ep/tools/resources.py) against a given
machine: it refuses, in one line naming the figure, the limit and --force, the runs that cannot
fit (issue 26: 64 ranks on 2 cores, 100000 demo experts, a 10^8-token sequence), lets through
every run the README, the docs, the proxy presets and the GPU benchmarks use on the machines
they are meant for, and follows a rank's measured peak memory."""

import os
import re
import shlex
import subprocess
import sys

import pytest

import megatron.core  # noqa: F401  (CI installs megatron-core: a missing one must fail, not skip)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import ab_throughput  # noqa: E402
from megatron_ep.tools import cli, demo, resources  # noqa: E402
from recipes import proxies, train_moe  # noqa: E402
from test_entry_points import _readme_commands, _split  # noqa: E402

GiB = 2**30
CI_LIKE = resources.Machine(cores=2, memory_bytes=20 * GiB)  # the issue's 2-core, 24 GiB machine
H200_NODE = resources.Machine(cores=128, memory_bytes=500 * GiB, gpu_bytes=(139 * GiB,) * 8)


def _need(target, argv, world, on_gpu):
    """The Need of one command line, as its script computes it, as if it started the ranks."""
    if target in ("megatron_ep.tools.demo", "scripts/run_demo.sh"):
        args = demo.parse_args(argv)
        world = world or args.ranks
        need = resources.demo_need(args, world, on_gpu)
    elif target == "recipes/train_moe.py":
        args = train_moe.parse_args(argv)
        world = world or args.nproc_per_node
        need = resources.moe_gpt_need(args, world, on_gpu)
    else:
        args = ab_throughput.parse_args(argv)
        world = world or args.nproc_per_node
        need = ab_throughput.resources_needed(args, world, on_gpu)
    return resources.Need(world, need.rank_parts, need.on_gpu, need.share_gpus, starting=True)


def _refusal(target, argv, machine, world=None, on_gpu=False):
    with pytest.raises(cli.UsageError) as e:
        resources.refuse_unless_fits(_need(target, argv, world, on_gpu), machine=machine)
    return str(e.value)


def test_issue_runs_are_refused_in_one_line():
    line = _refusal("megatron_ep.tools.demo", ["--ranks", "64", "--experts", "64"], CI_LIKE)
    assert line.startswith("64 processes") and "more than 8 (4 per core, 2 cores)" in line and "--force" in line, line
    line = _refusal("recipes/train_moe.py", ["--nproc-per-node", "64", "--experts", "64"], CI_LIKE)
    assert line.startswith("64 processes") and "--force" in line, line
    line = _refusal("megatron_ep.tools.demo", ["--experts", "100000"], CI_LIKE)
    # 2 x 100000 experts x 256 x 128 fp32 = 26.2 GB = 24.4 GiB of weights on each of 4 ranks
    assert re.search(r"expert weights 24\.\d GiB each", line) and "than the 20.0 GiB available" in line, line
    assert "--force" in line and "\n" not in line, line
    line = _refusal("recipes/train_moe.py", ["--seq-len", "100000000"], CI_LIKE)
    assert "attention activations" in line and "--force" in line, line


def test_force_skips_the_estimates_but_not_the_gpu_count():
    big = _need("megatron_ep.tools.demo", ["--ranks", "64", "--experts", "64000"], None, False)
    resources.refuse_unless_fits(big, force=True, machine=CI_LIKE)
    two_gpus = resources.Machine(cores=32, memory_bytes=200 * GiB, gpu_bytes=(139 * GiB,) * 2)
    line = _refusal("recipes/train_moe.py", ["--nproc-per-node", "8", "--backend", "cuda"], two_gpus, on_gpu=True)
    assert line == "8 ranks need 8 GPUs here (one per rank), 2 visible", line
    with pytest.raises(cli.UsageError):
        resources.refuse_unless_fits(_need("recipes/train_moe.py", ["--nproc-per-node", "8"], None, True),
                                     force=True, machine=two_gpus)
    # several ranks per GPU (--virtual-ranks) share its memory instead
    resources.refuse_unless_fits(_need("scripts/ab_throughput.py", ["--nproc-per-node", "8", "--virtual-ranks"], None,
                                       True), machine=two_gpus)


def test_gpu_memory_is_per_gpu():
    # 256 experts of hidden 7168 x FFN 2048 on one GPU: 32 GiB of bf16 weights per MoE layer
    argv = ["--nproc-per-node", "1", "--hidden", "7168", "--heads", "56", "--expert-ffn", "2048", "--experts", "256",
            "--topk", "8", "--layers", "4", "--seq-len", "4096", "--micro-batch", "1"]
    line = _refusal("recipes/train_moe.py", argv, H200_NODE, on_gpu=True)
    assert "per GPU" in line and "more than the GPU's 139.0 GiB" in line and "--force" in line, line
    argv[1] = "8"  # the same model over 8 GPUs: 32 experts each
    resources.refuse_unless_fits(_need("recipes/train_moe.py", argv, None, True), machine=H200_NODE)


def _documented_runs():
    """(where, target, argv, world, on_gpu) of every demo / train_moe / A/B command line in the
    README and docs/performance.md, the proxy presets and the tests' own runs."""
    runs = []
    texts = {"README": _readme_commands()}
    perf = open(os.path.join(ROOT, "docs", "performance.md")).read().replace("\\\n", " ")
    lines = re.findall(r"(?m)^\s*((?:python|torchrun) .*\S)\s*$", perf) + re.findall(r"`((?:python|torchrun) [^`]*)`", perf)
    texts["docs/performance.md"] = [shlex.split(m, comments=True) for m in lines
                                    if "ab_throughput.py" in m or "train_moe.py" in m]
    for module in (demo, train_moe, ab_throughput):
        doc = module.__doc__.replace("\\\n", " ")
        texts[f"{module.__name__} docstring"] = [shlex.split(m, comments=True)
                                                 for m in re.findall(r"(?m)^\s*((?:python|torchrun) .*\S)\s*$", doc)]
    for where, commands in texts.items():
        for words in commands:
            target, argv, launcher = _split(words)
            if target not in ("megatron_ep.tools.demo", "scripts/run_demo.sh", "recipes/train_moe.py",
                              "scripts/ab_throughput.py"):
                continue
            world = int(launcher[launcher.index("--nproc-per-node") + 1]) if "--nproc-per-node" in (launcher or []) else None
            runs.append((where, target, argv, world, "cuda" in argv))
    for name, preset in proxies.PRESETS.items():
        runs.append((f"preset {name}", "recipes/train_moe.py", list(preset.args), preset.nproc, preset.device == "gpu"))
    # the A/B train mode at DeepSeek-V3's hidden size on a node of 8 GPUs (8 experts each)
    runs.append(("GPU A/B", "scripts/ab_throughput.py", shlex.split(
        "--backend cuda --layers 4 --hidden 7168 --heads 56 --expert-ffn 2048 --experts 64 --topk 8 --seq-len 4096 "
        "--micro-batch 1 --backends alltoall,hybridep,hybridep-budget,DeepEP"), 8, True))
    runs += [("tests", "recipes/train_moe.py", ["--steps", "4"], 2, False),
             ("tests", "scripts/ab_throughput.py", ["--backend", "torch", "--reps", "2", "--warmup", "1"], 2, False),
             ("tests", "megatron_ep.tools.demo", ["--tokens", "30"], 4, False)]
    return runs


def test_documented_runs_pass(monkeypatch):
    """On the machines they are written for: CPU runs on a 2-core 20 GiB box, GPU runs on a node
    of 8 H200s; deep_ep counted as installed (its backends then keep their models too)."""
    monkeypatch.setattr(ab_throughput.importlib.util, "find_spec", lambda name, *a: object())
    runs = _documented_runs()
    assert sum(r[4] for r in runs) >= 8 and sum(not r[4] for r in runs) >= 8, runs
    for where, target, argv, world, on_gpu in runs:
        need = _need(target, argv, world, on_gpu)
        try:
            resources.refuse_unless_fits(need, machine=H200_NODE if on_gpu else CI_LIKE)
        except cli.UsageError as e:
            raise AssertionError(f"{where}: {target} {' '.join(argv)}: {e}") from None


MEASURE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)  # the largest rank's peak, bytes
"""


def _peak_rank_memory(argv):
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "megatron_ep.tools.demo", *argv], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_demo_estimate_follows_the_measured_memory():
    """One rank whose expert weights and fp64 reference copies dominate (about 1.2 GiB) against
    the same demo at its default size: the estimate grows by 0.5x to 1.25x of the measured growth
    of the rank's peak resident memory (routing is not quite the uniform one the estimate takes)."""
    small = ["--ranks", "1", "--steps", "1"]
    big = small + ["--experts", "32", "--hidden", "768", "--ffn", "768"]
    measured = _peak_rank_memory(big) - _peak_rank_memory(small)
    estimated = _need("megatron_ep.tools.demo", big, 1, False).rank_bytes - _need("megatron_ep.tools.demo", small, 1, False).rank_bytes
    assert 0.5 * measured <= estimated <= 1.25 * measured, (estimated / GiB, measured / GiB)
