"""Scaled-down proxies of the DeepSeek-V3 EP64 recipe that run on the machines at hand: named
presets that expand to `torchrun ... recipes/train_moe.py ...` (torchrun = `python -m
torch.distributed.run`, the interpreter running this module).

    python -m recipes.proxies --list
    python -m recipes.proxies --preset cpu-toy --dry-run        # check and print the command
    python -m recipes.proxies --preset cpu-toy                  # run it (4 gloo processes)
    python -m recipes.proxies --preset cpu-toy --nproc 2 --steps 2
    python -m recipes.proxies --preset gpu-8 -- --dispatcher deepep   # after `--`: train_moe.py flags

The model family is train_moe.py's (DeepSeek-V3-style MoE: sigmoid router with expert bias,
group-limited top-k with one group per EP rank, scaled top-k probs, one shared expert, SwiGLU
experts on megatron_ep's GroupedGemmExperts); unlike the full recipe it has standard attention
(no MLA), no MTP, and one dense layer first instead of three. EP = world size.

No virtual EP on one GPU: Megatron runs its collectives over NCCL on GPUs, and NCCL refuses two
ranks on the same device, so the 1-GPU proxy is EP1 (one process). megatron-core 0.16-0.18 also
refuse the flex dispatcher at TP x EP = 1 (0.19 accepts hybridep there), so on those versions
run gpu-1 with `-- --dispatcher alltoall` (Megatron's dispatcher, megatron_ep's experts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
from typing import Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_MOE = os.path.join(REPO_ROOT, "recipes", "train_moe.py")


@dataclasses.dataclass(frozen=True)
class Preset:
    nproc: int
    device: str                 # "cpu" (gloo) or "gpu" (NCCL, one GPU per process)
    args: tuple                 # train_moe.py arguments
    about: str
    env: Optional[Dict[str, str]] = None


_COMMON = ("--dispatcher", "hybridep", "--experts-impl", "grouped")
PRESETS: Dict[str, Preset] = {
    "cpu-toy": Preset(
        nproc=4, device="cpu",
        args=_COMMON + ("--backend", "torch", "--layers", "3", "--hidden", "64", "--heads", "4", "--ffn", "128",
                        "--expert-ffn", "32", "--experts", "16", "--topk", "4", "--vocab", "256",
                        "--seq-len", "32", "--micro-batch", "2", "--steps", "6"),
        # gloo on CPU even where a GPU is visible (train_moe.py picks NCCL whenever CUDA is available)
        env={"CUDA_VISIBLE_DEVICES": ""},
        about="CPU, 2-4 gloo processes (--nproc), torch reference backend; toy sizes, runs in seconds"),
    "gpu-1": Preset(
        nproc=1, device="gpu",
        args=_COMMON + ("--backend", "torch", "--layers", "8", "--hidden", "2048", "--heads", "16", "--ffn", "8192",
                        "--expert-ffn", "512", "--experts", "64", "--topk", "8", "--vocab", "32768",
                        "--seq-len", "4096", "--micro-batch", "1", "--steps", "20"),
        about="1 GPU, EP1 (no communication: torch backend permutes locally); needs megatron-core >= 0.19 "
              "for flex at EP1, else add `-- --dispatcher alltoall`"),
    "gpu-8": Preset(
        nproc=8, device="gpu",
        args=_COMMON + ("--backend", "cuda", "--layers", "8", "--hidden", "2048", "--heads", "16", "--ffn", "8192",
                        "--expert-ffn", "1024", "--experts", "64", "--topk", "8", "--group-topk", "4",
                        "--vocab", "32768", "--seq-len", "4096", "--micro-batch", "1", "--steps", "20"),
        about="8 GPUs of one node, EP8, megatron_ep cuda kernels; 8 experts per rank, top-8, "
              "each token to at most 4 of the 8 ranks (DeepSeek-V3's 4-of-8 group limit)"),
}


def command(name: str, nproc: Optional[int] = None, steps: Optional[int] = None,
            extra: List[str] = ()) -> tuple:
    """(environment additions, argv) of a preset. `steps` replaces the preset's step count (the
    printed command holds one --steps); `extra` comes last, and train_moe.py's argparse keeps the
    last of a repeated flag, so it wins over the preset's values."""
    preset = PRESETS[name]
    n = preset.nproc if nproc is None else nproc
    args = list(preset.args)
    if steps is not None:
        i = args.index("--steps")
        args[i + 1] = str(steps)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            TRAIN_MOE, *args]
    argv += list(extra)
    return dict(preset.env or {}), argv


def _check(name: str, nproc: int, extra: List[str]) -> None:
    """Refuse, before starting processes, what would fail inside them (cli.UsageError)."""
    from megatron_ep.tools import cli

    cli.require("torch", "megatron.core", prog=PROG)  # --list runs without them
    preset = PRESETS[name]
    args = _train_moe_args(preset.args + tuple(extra))
    if preset.device == "gpu":
        import torch

        have = torch.cuda.device_count()
        cli.check(have >= nproc, f"preset {name} needs {_count(nproc, 'GPU')}, {have} visible (one process per GPU: "
                                 "NCCL refuses several ranks on one GPU)")
    from megatron_ep.tools import resources
    from recipes.train_moe import validate

    validate(args, nproc)
    need = resources.moe_gpt_need(args, nproc, on_gpu=preset.device == "gpu")
    resources.refuse_unless_fits(need, force=args.force)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _train_moe_args(argv):
    sys.path.insert(0, REPO_ROOT)
    from recipes.train_moe import parse_args

    return parse_args(list(argv))


def render(env: Dict[str, str], argv: List[str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv])


PROG = "python -m recipes.proxies"


def build_parser():
    from megatron_ep.tools import cli

    p = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                           epilog="Arguments after `--` go to recipes/train_moe.py (its --help lists them).")
    p.add_argument("--list", action="store_true", help="list the presets and their commands")
    p.add_argument("--preset", choices=sorted(PRESETS), help="the preset to run (or print with --dry-run)")
    p.add_argument("--nproc", type=cli.integer(), default=None, help="processes (= EP size); default: the preset's")
    p.add_argument("--steps", type=cli.integer(), default=None, help="training steps; default: the preset's")
    p.add_argument("--dry-run", action="store_true",
                   help="check the command as a run would, print it, run nothing (needs torch and megatron-core, as the "
                        "run does)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = build_parser()
    args = p.parse_args(argv)
    if args.list:
        for name, preset in PRESETS.items():
            print(f"{name:8s} {preset.nproc} x {preset.device}  {preset.about}")
            print(f"{'':8s} {render(*command(name))}")
        return 0
    if args.preset is None:
        p.error("--preset or --list is required")
    nproc = PRESETS[args.preset].nproc if args.nproc is None else args.nproc
    env, cmd = command(args.preset, nproc, args.steps, extra)
    # the dry run prints only a command the run would start: the same checks first
    _check(args.preset, nproc, extra + (["--steps", str(args.steps)] if args.steps is not None else []))
    print(render(env, cmd), flush=True)
    if args.dry_run:
        return 0
    if args.debug:
        env = {**env, "MEGATRON_EP_DEBUG_TRACEBACK": "1"}
    # torchrun's default (1 thread per process), set here so that it does not print its notice about it
    env = {"OMP_NUM_THREADS": "1", **os.environ, **env}
    return subprocess.call(cmd, cwd=REPO_ROOT, env=env)


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from megatron_ep.tools import cli

    cli.quiet()
    sys.exit(cli.run_main(main, prog=PROG))
