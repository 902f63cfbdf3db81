"""Megatron-LM's own pretrain_gpt.py on virtual ranks (tests/support/megatron_lm_virtual.py), through
megatron_ep.megatron.launch: the runs tests/megatron/test_megatron_lm.py compares, their command lines,
running them side by side, and reading each iteration's lm loss and grad norm from the log.

Every run is a small GPT-MoE (2 layers, hidden 256, 8 experts top-2, sequence 128, bf16, mock
data, dropout 0, constant learning rate, seed 1234) for 20 iterations, except the two runs of the
DeepSeek-V3 EP64 recipe's `--preset tiny` (its own flags, 4 ranks) and the `ds3` runs: the same
model with DeepSeek-V3's routing and layer features (16 experts top-4, sigmoid scores with expert
bias, 4 groups of which 2 per token, top-k scaling 2.5, fp32 router, seq_aux_loss, a shared
expert, rope) at EP 4 and 2 virtual nodes x 2, our kernels on the Buffer's default SM budget
(MEGATRON_EP_DEVICE_SHARERS = the most processes the GPU holds at once, as docs/design.md §5 says); runs
that are compared differ only in what is compared (dispatcher, experts, a checkpoint in the
middle). MEP_E2E_RUNS (comma-separated fnmatch patterns of run names) selects runs, with the runs
they are compared with.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ITERS = 20
# Runs side by side on one GPU: at most MAX_RANKS processes at once, each rank's kernels on
# SMS_PER_RANK SMs, so every run's blocks fit together (12 x 8 = 96 of the H200's 132 SMs; more
# spinning blocks than SMs starve a run's peer and stall it), started STAGGER_S apart (MPS turns
# away clients that connect all at once).
MAX_RANKS, SMS_PER_RANK, STAGGER_S = 12, 8, 2.0

BASE_ARGS = [
    "--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
    "--lr", "3e-4", "--lr-decay-style", "constant", "--min-lr", "3e-4", "--weight-decay", "0.01", "--clip-grad", "1.0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
    "--transformer-impl", "local", "--bf16", "--distributed-backend", "gloo",
    "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--attention-softmax-in-fp32",
    "--num-workers", "1", "--timing-log-level", "0",
]


# DeepSeek-V3's routing and MoE-layer features on BASE_ARGS's model (values replaced, flags added)
DS3_ARGS = {
    "--num-experts": "16", "--moe-router-topk": "4", "--moe-router-load-balancing-type": "seq_aux_loss",
    "--moe-aux-loss-coeff": "1e-3", "--moe-router-score-function": "sigmoid", "--moe-router-enable-expert-bias": None,
    "--moe-router-num-groups": "4", "--moe-router-group-topk": "2", "--moe-router-topk-scaling-factor": "2.5",
    "--moe-router-dtype": "fp32", "--moe-shared-expert-intermediate-size": "256", "--position-embedding-type": "rope",
    "--no-rope-fusion": None,
}


def with_args(argv: List[str], flags: Dict[str, Optional[str]]) -> List[str]:
    """`argv` with each flag of `flags` set: a value replaced where the flag is there, else the flag
    (and its value; None: a switch) appended."""
    out = list(argv)
    for flag, value in flags.items():
        if flag in out:
            if value is not None:
                out[out.index(flag) + 1] = value
        else:
            out += [flag] + ([] if value is None else [value])
    return out


@dataclasses.dataclass
class Run:
    name: str
    version: str  # "main" | "r0.19": which Megatron-LM tree
    ranks: int
    dispatcher: str  # "alltoall" | "deepep" | "hybridep"
    ranks_per_node: Optional[int] = None  # virtual nodes (the two-level internode path)
    options: Tuple[str, ...] = ()  # megatron_ep.megatron.launch's own, before the script
    extra: Tuple[str, ...] = ()  # more pretrain_gpt.py arguments
    iters: int = ITERS
    after: Optional[str] = None  # a run that must end first (a resume after its save)
    preset: Optional[str] = None  # the DeepSeek-V3 recipe's preset: its flags replace BASE_ARGS
    ds3: bool = False  # DeepSeek-V3's routing (DS3_ARGS), our kernels on the Buffer's default SM budget
    ref: Optional[str] = None  # the run it is compared with, where reference() cannot tell from the name

    def args(self, ckpt_root: str) -> List[str]:
        if self.preset:
            return recipe_args(self.preset, self.dispatcher)[1]
        out = with_args(BASE_ARGS, DS3_ARGS) if self.ds3 else list(BASE_ARGS)
        out += ["--global-batch-size", str(2 * self.ranks), "--expert-model-parallel-size", str(self.ranks),
                "--train-iters", str(self.iters)]
        if self.dispatcher == "alltoall":
            out += ["--moe-token-dispatcher-type", "alltoall"]
        else:
            out += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", self.dispatcher]
            if not self.ds3:  # the runs side by side share one GPU, and our kernels' blocks must all be resident
                out += ["--moe-flex-dispatcher-num-sms", str(SMS_PER_RANK)]
        return out + [a.replace("{ckpt}", ckpt_root) for a in self.extra]


def recipe_args(preset: str, dispatcher: str) -> Tuple[List[str], List[str]]:
    """(launcher options, pretrain_gpt.py arguments) of recipes/deepseek_v3_ep64's `preset`, as its
    launch.sh builds them, with `dispatcher` (alltoall: Megatron's own in place of flex) and what
    virtual ranks need: gloo groups, no evaluation, the seed, SMS_PER_RANK SMs per rank."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from recipes.deepseek_v3_ep64 import launch as recipe

    args = recipe.parse_args(["--preset", preset, "--dry-run"] + ([] if dispatcher == "alltoall" else ["--dispatcher", dispatcher]))
    argv = recipe.megatron_args(args)
    if dispatcher == "alltoall":
        i = argv.index("--moe-flex-dispatcher-backend")
        del argv[i:i + 2]
        argv[argv.index("--moe-token-dispatcher-type") + 1] = "alltoall"
    else:
        argv += ["--moe-flex-dispatcher-num-sms", str(SMS_PER_RANK)]
    argv += ["--distributed-backend", "gloo", "--seed", "1234", "--eval-iters", "0", "--num-workers", "1",
             "--timing-log-level", "0"]
    return list(recipe.PRESETS[preset].launcher), argv


def runs() -> List[Run]:
    """Each dispatcher against alltoall at EP 2, EP 4 and 2 virtual nodes x 2 ranks (Megatron-LM
    main; EP 2 on core_r0.19.0 too); megatron_ep's experts, chunked experts and the static budget
    from the launcher; a checkpoint saved at iteration 10 and resumed. In the order they start."""
    def trio(version, R, P=None):
        shape = f"ep{R}" + (f"-{R // P}x{P}" if P else "")
        return [Run(f"{version}-{shape}-{d}", version, R, d, P) for d in ("alltoall", "deepep", "hybridep")]

    grouped = ("--ep-experts", "grouped")
    tiny = [Run(f"r0.19-recipe-tiny-{d}", "r0.19", 4, d, options=tuple(recipe_args("tiny", d)[0]), preset="tiny")
            for d in ("alltoall", "hybridep")]
    return tiny + trio("main", 2) + [
        Run("main-ep2-hybridep-grouped", "main", 2, "hybridep", options=grouped),
        # the same 20-iteration schedule as the uninterrupted run (the scheduler checks it), cut at 10
        Run("main-ep2-hybridep-grouped-save", "main", 2, "hybridep", options=grouped,
            extra=("--save", "{ckpt}/grouped", "--save-interval", "10", "--exit-interval", "10",
                   "--ckpt-format", "torch_dist")),
        Run("main-ep2-hybridep-chunked", "main", 2, "hybridep", options=grouped + ("--ep-chunks", "2")),
        Run("main-ep2-hybridep-chunked-budget", "main", 2, "hybridep",
            options=grouped + ("--ep-chunks", "2", "--ep-budget", "2.0")),
        Run("main-ep2-hybridep-grouped-resume", "main", 2, "hybridep", options=grouped,
            extra=("--load", "{ckpt}/grouped", "--ckpt-format", "torch_dist"), after="main-ep2-hybridep-grouped-save"),
    ] + trio("main", 4) + trio("main", 4, 2) + trio("r0.19", 2) + ds3_runs()


DS3_REF = "main-ds3-ep4-alltoall"  # alltoall has no nodes: one reference for both shapes
DS3_VARIANTS = (("deepep", ()), ("hybridep", ()), ("hybridep-grouped", ("--ep-experts", "grouped")),
                ("hybridep-chunked", ("--ep-experts", "grouped", "--ep-chunks", "2")),
                ("hybridep-chunked-budget", ("--ep-experts", "grouped", "--ep-chunks", "2", "--ep-budget", "2.0")))
CAPACITY = ("--moe-expert-capacity-factor", "1.0")  # Megatron's token dropping (the router drops; no padding)
# drop-and-pad: every expert's input padded to its capacity (the router's probability-0 padding
# pairs); of our managers only hybridep takes it (Megatron's flex dispatcher refuses it on deepep)
PAD = CAPACITY + ("--moe-pad-expert-input-to-capacity",)


def ds3_runs() -> List[Run]:
    """DeepSeek-V3's routing at EP 4 and on 2 virtual nodes x 2: each dispatcher, our experts, chunks
    and the static budget, Megatron's capacity factor on deepep and hybridep, and drop-and-pad on
    hybridep, against alltoall."""
    out = [Run(DS3_REF, "main", 4, "alltoall", ds3=True),
           Run("main-ds3-ep4-alltoall-capacity", "main", 4, "alltoall", ds3=True, extra=CAPACITY),
           Run("main-ds3-ep4-alltoall-pad", "main", 4, "alltoall", ds3=True, extra=PAD),
           Run("main-ds3-ep4-hybridep-pad", "main", 4, "hybridep", ds3=True, extra=PAD, ref="main-ds3-ep4-alltoall-pad")]
    for P in (None, 2):
        shape = "ep4" + ("-2x2" if P else "")
        for variant, options in DS3_VARIANTS:
            ref = {"hybridep-chunked": "grouped", "hybridep-chunked-budget": "grouped"}.get(variant)
            out.append(Run(f"main-ds3-{shape}-{variant}", "main", 4, variant.split("-")[0], P, options=options, ds3=True,
                           ref=f"main-ds3-{shape}-hybridep-grouped" if ref else DS3_REF))
    for d in ("deepep", "hybridep"):
        out.append(Run(f"main-ds3-ep4-{d}-capacity", "main", 4, d, ds3=True, extra=CAPACITY,
                       ref="main-ds3-ep4-alltoall-capacity"))
    return out


def select(all_runs: List[Run], patterns: Optional[str]) -> List[Run]:
    """The runs whose names match one of the comma-separated fnmatch `patterns` (None or empty: all),
    with the runs they are compared with or must follow."""
    if not patterns:
        return list(all_runs)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    names = {r.name for r in all_runs if any(fnmatch.fnmatch(r.name, p) for p in pats)}
    while True:
        more = {n for r in all_runs if r.name in names for n in (reference(r.name), r.after) if n} - names
        if not more:
            return [r for r in all_runs if r.name in names]
        names |= more


_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.Ee+-]+).*?grad norm: ([0-9.Ee+-]+)")


def parse(log: str) -> Dict[int, Tuple[float, float]]:
    """iteration -> (lm loss, grad norm) from Megatron's training log."""
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in _LINE.finditer(log)}


def command(run: Run, lm_dir: str, ckpt_root: str, sharers: int = MAX_RANKS) -> Tuple[List[str], dict]:
    """`sharers`: the most processes on the GPU at once (the SM budget of runs on the default one)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(run.ranks),
            os.path.join(HERE, "megatron_lm_virtual.py"), *run.options, os.path.join(lm_dir, "pretrain_gpt.py"),
            *run.args(ckpt_root)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               CUDA_DEVICE_MAX_CONNECTIONS="1", MEGATRON_EP_BACKEND="cuda", PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", NVSHMEM_DISABLE_NVLS="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if run.ranks_per_node:
        env["MEGATRON_EP_RANKS_PER_NODE"] = str(run.ranks_per_node)
    if run.ds3 and run.dispatcher != "alltoall":  # other runs' processes share the GPU too
        env["MEGATRON_EP_DEVICE_SHARERS"] = str(sharers)
    return argv, env


def run_all(selected: List[Run], lm_dirs: Dict[str, str], max_ranks: int, timeout_s: float,
            log_dir: Optional[str] = None) -> Dict[str, dict]:
    """Run `selected` side by side (at most `max_ranks` processes at once, in order, each after
    its `after`); returns per run its exit status, seconds, log and parsed iterations. Runs still
    going after `timeout_s` are killed."""
    ckpt_root = tempfile.mkdtemp(prefix="mep-megatron-lm-ckpt-")
    pending, live, results = list(selected), {}, {}
    # Megatron builds its dataset helpers (a C++ module) inside the tree at start-up, one build per
    # run: runs side by side on one tree race there ("helpers_cpp...so: file too short"). Built
    # once here, before any run.
    for tree in {lm_dirs[r.version] for r in selected if r.version in lm_dirs}:
        subprocess.run(["make", "-C", os.path.join(tree, "megatron", "core", "datasets")], capture_output=True)
    start = time.monotonic()
    try:
        while pending or live:
            for run in list(pending):
                busy = sum(r.ranks for r in selected if r.name in live)
                if busy and busy + run.ranks > max_ranks:
                    break
                if run.after and run.after not in results:
                    continue
                pending.remove(run)
                if run.version not in lm_dirs:
                    results[run.name] = dict(rc=None, skipped=f"no Megatron-LM {run.version} tree", log="", iters={})
                    continue
                argv, env = command(run, lm_dirs[run.version], ckpt_root, max_ranks)
                log = tempfile.TemporaryFile(mode="w+")
                live[run.name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True), log, time.monotonic())
                time.sleep(STAGGER_S)
            for name, (proc, log, t0) in list(live.items()):
                late = time.monotonic() - start > timeout_s
                if proc.poll() is None and not late:
                    continue
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                log.seek(0)
                text = log.read()
                log.close()
                del live[name]
                results[name] = dict(rc=proc.returncode, seconds=round(time.monotonic() - t0, 1), log=text,
                                     iters=parse(text), killed=late)
                if log_dir:
                    with open(os.path.join(log_dir, f"{name}.log"), "w") as f:
                        f.write(text)
            time.sleep(0.5)
    finally:
        shutil.rmtree(ckpt_root, ignore_errors=True)
    return results


def summary(results: Dict[str, dict]) -> str:
    """JSON of every run's iterations (the numbers docs/megatron.md's table quotes)."""
    return json.dumps({n: dict(rc=r["rc"], seconds=r.get("seconds"), iters=r["iters"]) for n, r in results.items()},
                      indent=1, sort_keys=True)


def reference(name: str) -> Optional[str]:
    """The run `name` is compared with in tests/megatron/test_megatron_lm.py (None: none)."""
    run = next((r for r in runs() if r.name == name), None)
    if run is not None and run.dispatcher == "alltoall":
        return None
    if run is not None and run.ref:
        return run.ref
    if name.endswith("-alltoall") or name.endswith("-save"):
        return None
    if name.endswith("-resume"):
        return name[:-len("-resume")]
    if "-grouped" in name or "-chunked" in name:
        return "main-ep2-hybridep"
    return name.rsplit("-", 1)[0] + "-alltoall"


def reference_loss(want: Dict[int, Tuple[float, float]], i: int, resumed_at: Optional[int] = None) -> float:
    """The reference run's lm loss that iteration `i` of a run must give. After a resume at
    iteration `resumed_at`, the second log line prints the mean loss of the resumed iteration and
    this one (Megatron's log accumulator keeps the first); its grad norm and every later loss are
    the reference run's own."""
    if resumed_at is not None and i == resumed_at + 1 and i - 1 in want:
        return (want[i - 1][0] + want[i][0]) / 2
    return want[i][0]


def table(results: Dict[str, dict]) -> str:
    """docs/megatron.md's table of the runs: each compared run's loss at its last iteration and
    its largest relative loss / grad-norm difference against its reference."""
    by_name = {r.name: r for r in runs()}
    rows = ["| run | Megatron-LM | EP (ranks) | dispatcher / launcher options | iterations | lm loss at the last (ref) "
            "| largest loss / grad-norm difference against |", "|---|---|---|---|---|---|---|"]
    for name in sorted(results):
        ref, got, run = reference(name), results[name], by_name.get(name)
        if ref is None or run is None:
            continue
        shape = f"ep{run.ranks}" + (f" as {run.ranks // run.ranks_per_node} nodes x {run.ranks_per_node}"
                                    if run.ranks_per_node else "")
        what = " ".join((run.dispatcher,) + tuple(run.options)) + (f" (recipe --preset {run.preset})" if run.preset else "")
        its = got["iters"]
        if got.get("rc") != 0 or not its:
            rows.append(f"| {name} | {run.version} | {shape} | {what} | - | failed (exit {got.get('rc')}) | - |")
            continue
        last = max(its)
        want = results.get(ref, {}).get("iters") or {}
        common = [i for i in its if i in want]
        if not common:
            rows.append(f"| {name} | {run.version} | {shape} | {what} | {len(its)} | {its[last][0]:.6f} (-) | - ({ref} did not run) |")
            continue
        resumed_at = min(its) if name.endswith("-resume") else None
        ref_losses = {i: reference_loss(want, i, resumed_at) for i in common}
        dl = max(abs(its[i][0] - ref_losses[i]) / abs(ref_losses[i]) for i in common)
        dg = max(abs(its[i][1] - want[i][1]) / max(abs(want[i][1]), 1e-12) for i in common)
        ref_loss = f"{want[last][0]:.6f}" if last in want else "-"
        rows.append(f"| {name} | {run.version} | {shape} | {what} | {len(its)} | {its[last][0]:.6f} ({ref_loss}) "
                    f"| {dl:.1e} / {dg:.1e} ({ref}) |")
    return "\n".join(rows) + "\n"
