"""DeepEP's own test files run on megatron_ep.deep_ep, on virtual ranks: several processes sharing
one GPU (run them under MPS, docs/design.md §5). Two suites:
  * v1, DeepEP 567632d (the V1 API, `Buffer`): tests/test_intranode.py, test_internode.py,
    test_low_latency.py and their tests/utils.py (--test intranode | internode | low_latency);
  * v2, DeepEP dd758ca (the V2 API, `ElasticBuffer`): tests/elastic/test_ep.py and the modules of
    deep_ep/utils/ it imports (envs, math, gate, refs, testing) (--test elastic).

The files come from a DeepEP checkout (--checkout DIR: a folder holding the suite's files, at
their paths) or from a git directory at a revision (--git GITDIR [--rev REV], the suite's
revision unless given; `git show`). They are never part of this repository: --extract DEST
[--suite v2] only writes the suite's files, unpatched, into DEST at their paths (e.g.
.carry/deepep and .carry/deepep-v2, git-ignored, to carry to a GPU machine without network).

With --test, the files are copied into a work folder and only the launch glue of utils.py's
init_dist is edited; every assertion of the tests stays:
  * the process group is gloo (NCCL refuses two ranks on one GPU; gloo serves one rank per GPU
    as well), with no device_id= argument;
  * torch.cuda.set_device(local_rank % torch.cuda.device_count()): rank r on GPU r % GPUs;
  * on gloo, dist.all_gather_into_tensor gathers into the output's R slices through
    dist.all_gather: gloo refuses the stacked output form ([R, N, ...] for an input [N, ...])
    that test_low_latency.py uses.
The v2 suite's init_dist is deep_ep/utils/envs.py's (the package's, not the tests'): it gets the
first, second and fourth edit and one of its own (gloo has no FP8 types, so the FP8 tensors its
reference dispatch sends through dist.all_to_all_single move as their bytes), and loses its
imports of DeepEP's extension (`deep_ep._C`, `.comm`), which only its NCCL-communicator helpers
use; the utils modules are placed beside
test_ep.py as the package `deep_ep_utils` (megatron_ep's `deep_ep.utils` is DeepEP's event types),
and test_ep.py's seven `from deep_ep.utils.X import` lines name that package.
Each edit replaces an exact text that must occur exactly once (the text of the suite's DeepEP
revision); where one does not, nothing runs and the error names the file and the edit.

The test then runs as `python tests/test_X.py --num-processes N ...` with megatron_ep's
`deep_ep` first on PYTHONPATH and NVLink multicast off (NCCL_NVLS_ENABLE=0,
NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1; CUDA_MODULE_LOADING=EAGER unless
set, as the project's GPU tests run). --num-processes is the test's own
option: the ranks its torch.multiprocessing.spawn starts. The internode test needs 8 of them per
node and at least 2 nodes: --num-nodes M runs M copies of the file on this machine (RANK = node,
WORLD_SIZE = M, the variables its init_dist reads). Arguments after `--` go to the test file. The
exit status is the test's.

    python scripts/deepep_tests.py --git /work/.mirror/deepseek-ai+DeepEP/repo --rev 567632d --extract .carry/deepep
    python scripts/deepep_tests.py --checkout .carry/deepep --test intranode --num-processes 2 -- --num-tokens 1024
    python scripts/deepep_tests.py --checkout .carry/deepep --test internode --num-nodes 2 --num-processes 8
    python scripts/deepep_tests.py --git /work/.mirror/deepseek-ai+DeepEP/repo --suite v2 --extract .carry/deepep-v2
    python scripts/deepep_tests.py --checkout .carry/deepep-v2 --test elastic --num-processes 2 -- --num-tokens 512

--cpu runs a test on CPU processes instead, on the torch backend, with the test's CUDA devices
mapped to the CPU (scripts/cuda_as_cpu/sitecustomize.py): a check of the DeepEP API layer before a
GPU run (no kernel of ours runs), e.g.

    python scripts/deepep_tests.py --checkout .carry/deepep-v2 --test elastic --cpu -- --num-tokens 64 \
        --hidden 256 --num-experts 16 --num-topk 4 --skip-perf-test
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ep.tools.cli import ArgumentParser, UsageError, check, integer, require, run_main  # noqa: E402
from megatron_ep.tools.cli.launching import first_failure, free_port, how_it_ended, stop  # noqa: E402

PROG = "deepep_tests.py"
DEFAULT_REV = "567632d"  # the DeepEP commit whose V1 API megatron_ep.deep_ep reproduces
V2_REV = "dd758ca"  # the DeepEP commit whose V2 API (ElasticBuffer) megatron_ep.deep_ep reproduces
FILES = ("tests/test_intranode.py", "tests/test_internode.py", "tests/test_low_latency.py", "tests/utils.py")
V2_UTILS = ("envs", "math", "gate", "refs", "testing")  # the deep_ep/utils modules test_ep.py imports
V2_FILES = ("tests/elastic/test_ep.py", *(f"deep_ep/utils/{m}.py" for m in V2_UTILS))
TESTS = ("intranode", "internode", "low_latency", "elastic")
SUITES = {"v1": (DEFAULT_REV, FILES), "v2": (V2_REV, V2_FILES)}  # suite -> (revision, files)
V2_PACKAGE = "tests/elastic/deep_ep_utils"  # where the v2 utils modules go in the work folder
SHIM = os.path.join(ROOT, "megatron_ep", "deep_ep", "shim")  # what `python -m megatron_ep.deep_ep --path` prints
CUDA_AS_CPU = os.path.join(ROOT, "scripts", "cuda_as_cpu")  # --cpu: its sitecustomize maps CUDA to the CPU
ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# (name, file, exact text at DeepEP 567632d, replacement): launch glue of init_dist only.
EDITS: Tuple[tuple, ...] = (
    ("backend gloo", "tests/utils.py",
     "        'backend': 'nccl',\n",
     "        'backend': 'gloo',  # virtual ranks: NCCL refuses two ranks on one GPU\n"),
    ("no device_id", "tests/utils.py",
     "    if 'device_id' in sig.parameters:\n"
     "        # noinspection PyTypeChecker\n"
     "        params['device_id'] = torch.device(f'cuda:{local_rank}')\n",
     "    # no device_id: virtual ranks share a GPU\n"),
    ("gloo all_gather_into_tensor", "tests/utils.py",
     "    dist.init_process_group(**params)\n",
     "    dist.init_process_group(**params)\n"
     "    # gloo refuses the stacked output form ([R, N, ...] for an input [N, ...]): gather into its R slices\n"
     "    dist.all_gather_into_tensor = lambda output, input, group=None, async_op=False: dist.all_gather(\n"
     "        list(output.view(dist.get_world_size(group), *input.shape).unbind(0)), input, group=group,\n"
     "        async_op=async_op)\n"),
    ("device of the rank", "tests/utils.py",
     "    torch.cuda.set_device(local_rank)\n",
     "    torch.cuda.set_device(local_rank % torch.cuda.device_count())\n"),
)

# The v2 suite's edits (DeepEP dd758ca): init_dist's launch glue in deep_ep/utils/envs.py, its
# imports of DeepEP's extension, and test_ep.py's imports of the utils package.
_ENVS = "deep_ep/utils/envs.py"
V2_EDITS: Tuple[tuple, ...] = (  # (name, file, text, replacement[, times the text occurs: 1])
    ("backend gloo", _ENVS, "        'backend': 'nccl',\n",
     "        'backend': 'gloo',  # virtual ranks: NCCL refuses two ranks on one GPU\n"),
    ("no device_id", _ENVS,
     "    if 'device_id' in sig.parameters:\n"
     "        # noinspection PyTypeChecker\n"
     "        params['device_id'] = torch.device(f'cuda:{local_rank}')\n",
     "    # no device_id: virtual ranks share a GPU\n"),
    ("device of the rank", _ENVS, "    torch.cuda.set_device(local_rank)\n",
     "    torch.cuda.set_device(local_rank % torch.cuda.device_count())\n"),
    ("gloo FP8 bytes", _ENVS, "    dist.init_process_group(**params)\n",
     "    dist.init_process_group(**params)\n"
     "    # gloo has no FP8 types ('Invalid scalar type'): the reference's FP8 rows move as their bytes\n"
     "    _all_to_all_single = dist.all_to_all_single\n"
     "    dist.all_to_all_single = lambda output, input, *args, **kwargs: _all_to_all_single(\n"
     "        *(t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t\n"
     "          for t in (output, input)), *args, **kwargs)\n"),
    ("no deep_ep._C", _ENVS, "# noinspection PyUnresolvedReferences\nimport deep_ep._C as _C\n",
     "# (DeepEP's extension: only the NCCL-communicator helpers below use it, and the test does not)\n"),
    ("no .comm", _ENVS, "from .comm import get_nccl_comm_handle\n", ""),
    *((f"import {m}", "tests/elastic/test_ep.py", f"from deep_ep.utils.{m} import ", f"from deep_ep_utils.{m} import ",
       n) for m, n in (("math", 1), ("gate", 1), ("envs", 1), ("refs", 3), ("testing", 1))),
)


class EditError(UsageError):
    """An edit whose text does not occur exactly once: a DeepEP whose init_dist differs."""


# ------------------------------------------------------------------------------- sources
def read_checkout(checkout: str, files: Sequence[str] = FILES) -> Dict[str, str]:
    texts = {}
    for rel in files:
        path = os.path.join(checkout, rel)
        check(os.path.isfile(path),
              f"{checkout}: no {rel} (--checkout takes a DeepEP checkout: a folder holding the suite's files)")
        with open(path, encoding="utf-8") as f:
            texts[rel] = f.read()
    return texts


def read_git(gitdir: str, rev: str, files: Sequence[str] = FILES) -> Tuple[Dict[str, str], str]:
    """The files at `rev` of the git directory, and the full commit."""
    check(shutil.which("git") is not None, "git is not on PATH (--git needs it; --checkout does not)")
    check(os.path.isdir(gitdir), f"--git {gitdir}: no such directory")
    got = subprocess.run(["git", "-C", gitdir, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         capture_output=True, text=True)
    check(got.returncode == 0, f"--git {gitdir}: no commit {rev!r} there")
    commit = got.stdout.strip()
    texts = {}
    for rel in files:
        got = subprocess.run(["git", "-C", gitdir, "show", f"{commit}:{rel}"], capture_output=True, text=True)
        check(got.returncode == 0, f"--git {gitdir}: no {rel} at {rev}")
        texts[rel] = got.stdout
    return texts, commit


def write(texts: Dict[str, str], dest: str) -> None:
    for rel, text in texts.items():
        path = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


# ---------------------------------------------------------------------------------- patch
def patch(texts: Dict[str, str], edits: Sequence[tuple] = EDITS, rev: str = DEFAULT_REV) -> Dict[str, str]:
    """The files with every edit applied; EditError naming the file and the edit where one's text
    does not occur as often as it does at `rev` (once, unless the edit says; checked before
    anything is written)."""
    out = dict(texts)
    for name, rel, old, new, *times in edits:
        want = times[0] if times else 1
        n = out[rel].count(old)
        if n != want:
            raise EditError(f"{rel}: edit '{name}' matches {n} times, expected {'exactly once' if want == 1 else want} "
                            f"(its text is DeepEP {rev}'s; this DeepEP differs, so nothing runs): {old.strip()!r}")
        out[rel] = out[rel].replace(old, new)
    return out


def placed(texts: Dict[str, str], suite: str) -> Dict[str, str]:
    """The patched files at their paths in the work folder: the v2 utils modules as the package
    `deep_ep_utils` beside test_ep.py (its folder is the first on the test's sys.path, and its
    spawned ranks'), the rest where DeepEP has them."""
    if suite != "v2":
        return texts
    out = {f"{V2_PACKAGE}/__init__.py": "# DeepEP's deep_ep/utils modules that tests/elastic/test_ep.py imports\n"}
    for rel, text in texts.items():
        out[f"{V2_PACKAGE}/{os.path.basename(rel)}" if rel.startswith("deep_ep/utils/") else rel] = text
    return out


# ------------------------------------------------------------------------------------ run
def suite_of(test: str) -> str:
    return "v2" if test == "elastic" else "v1"


def test_file(test: str) -> str:
    """The test's file in its suite's checkout."""
    return "tests/elastic/test_ep.py" if test == "elastic" else f"tests/test_{test}.py"


def command(test: str, num_processes: int, extra: Sequence[str]) -> List[str]:
    return [sys.executable, test_file(test), "--num-processes", str(num_processes), *extra]


def environment(cpu: bool = False) -> Dict[str, str]:
    """This process's environment with megatron_ep's deep_ep first on PYTHONPATH (then this
    checkout, for megatron_ep itself), NVLink multicast off, and the rendezvous init_dist reads
    (MASTER_ADDR, a free MASTER_PORT); `cpu`: CPU processes on the torch backend, the tests'
    CUDA devices mapped to the CPU (scripts/cuda_as_cpu/sitecustomize.py)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [CUDA_AS_CPU if cpu else None, SHIM, ROOT,
                                                      os.environ.get("PYTHONPATH")]))
    if cpu:
        env.update(MEGATRON_EP_CUDA_AS_CPU="1", MEGATRON_EP_DEEP_EP_BACKEND="torch")
    env.update(ENV)
    env.setdefault("CUDA_MODULE_LOADING", "EAGER")  # virtual ranks under MPS: docs/design.md §5
    # 16 virtual ranks (the internode file) hold about 4.8 GiB each, most of it from creation on:
    # 77.9 of an H100's 79.6 GiB with these two (2026-12-06); without them the file ran out of
    # memory there. The heap's mappings in 2 MiB steps instead of NVSHMEM's 512 MiB, and torch's
    # cached blocks grown in place instead of kept per size.
    env.setdefault("NVSHMEM_CUMEM_GRANULARITY", str(2 << 20))
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env


def _forward(pipe, lock: threading.Lock) -> None:
    """A node's output onto ours a whole line at a time, so lines of different nodes never mix
    (an unbuffered print writes its pieces one by one)."""
    for line in iter(pipe.readline, b""):
        with lock:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
    pipe.close()


def run_nodes(cmd: Sequence[str], num_nodes: int, env: Dict[str, str], cwd: str, grace_s: float = 10.0) -> int:
    """`cmd` once per node (RANK = node, WORLD_SIZE = nodes), each in a process group of its own.
    When one fails, the others get `grace_s`, then their groups (the test's spawned ranks too) are
    stopped. Returns the first failing node's exit status, else 0."""
    procs = [subprocess.Popen(list(cmd), cwd=cwd, env={**env, "RANK": str(n), "WORLD_SIZE": str(num_nodes)},
                              start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for n in range(num_nodes)]
    lock = threading.Lock()
    readers = [threading.Thread(target=_forward, args=(p.stdout, lock), daemon=True) for p in procs]
    for r in readers:
        r.start()
    try:
        first = first_failure(procs, grace_s, poll_s=0.1)
    except KeyboardInterrupt:
        stop(procs, signal.SIGINT, groups=True)
        return 130
    stop(procs, groups=True)  # the nodes past the grace, and ranks that outlive their node
    for r in readers:  # their pipes close with the stopped groups
        r.join(timeout=5.0)
    if first is None:
        return 0
    node, code = first
    where = f"node {node} of {num_nodes}: " if num_nodes > 1 else ""
    print(f"{PROG}: error: {where}{os.path.basename(cmd[1])} {how_it_ended(code)}", file=sys.stderr, flush=True)
    return code if code > 0 else 1


def parse(argv: Optional[Sequence[str]] = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = ArgumentParser(prog=PROG, description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkout", metavar="DIR",
                     help="a DeepEP checkout: a folder holding the suite's files at their paths")
    src.add_argument("--git", metavar="GITDIR", help="a DeepEP git directory (bare or not); the files at --rev")
    p.add_argument("--rev", default=None,
                   help=f"the revision to take with --git (default: the suite's, the commit megatron_ep.deep_ep "
                        f"reproduces: v1 {DEFAULT_REV}, v2 {V2_REV})")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--extract", metavar="DEST", help="only write the suite's files, unpatched, into DEST")
    what.add_argument("--test", choices=TESTS,
                      help="run DeepEP's tests/test_<TEST>.py (v1), or tests/elastic/test_ep.py (elastic: v2), on "
                           "megatron_ep.deep_ep")
    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="with --extract: which files (default v1); --test picks its own")
    p.add_argument("--num-processes", type=integer(1), default=None,
                   help="the test file's --num-processes: the ranks it spawns (per node); "
                        "default 8 for internode (its only value), else 2")
    p.add_argument("--num-nodes", type=integer(1), default=None,
                   help="nodes on this machine (copies of the test file, RANK = node, WORLD_SIZE = nodes); "
                        "internode: 2 unless given, at least 2; the other tests: 1")
    p.add_argument("--workdir", metavar="DIR", default=None,
                   help="the folder for the patched copy (default: a new temporary folder, removed after the run)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU processes on the torch backend, the test's CUDA devices mapped to the CPU "
                        "(scripts/cuda_as_cpu): checks the DeepEP API layer before a GPU run, not the kernels")
    p.add_argument("--dry-run", action="store_true",
                   help="patch and print the command, run nothing (the work folder is kept)")
    args = p.parse_args(argv)
    args.extra = extra
    if args.rev is not None and not args.git:
        p.error("--rev goes with --git")
    if args.test is not None and args.suite is not None:
        p.error("--suite goes with --extract (--test picks its suite)")
    args.suite = suite_of(args.test) if args.test is not None else args.suite or "v1"
    args.rev = args.rev or SUITES[args.suite][0]
    if args.extract is not None:
        for name in ("workdir", "num_nodes", "num_processes"):
            if getattr(args, name) is not None:
                p.error(f"--{name.replace('_', '-')} goes with --test, not --extract")
        if extra or args.dry_run or args.cpu:
            p.error("--extract takes no test arguments, no --dry-run and no --cpu")
        return args
    if args.num_nodes is None:
        args.num_nodes = 2 if args.test == "internode" else 1
    if args.num_processes is None:
        args.num_processes = 8 if args.test == "internode" else 2
    if args.test == "internode":
        if args.num_nodes < 2 or args.num_processes != 8:
            p.error("test_internode.py asserts 8 ranks per node and more than 8 ranks: "
                    "--num-processes 8 and --num-nodes 2 or more")
    elif args.num_nodes != 1:
        p.error(f"--num-nodes goes with --test internode ({os.path.basename(command(args.test, 1, [])[1])} runs on one "
                f"node here)")
    if any(a == "--num-processes" or a.startswith("--num-processes=") for a in extra):
        p.error("give --num-processes before `--` (it is passed to the test file)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    files = SUITES[args.suite][1]
    if args.git:
        texts, commit = read_git(args.git, args.rev, files)
        origin = f"{args.git} at {commit[:12]}"
    else:
        texts, origin = read_checkout(args.checkout, files), args.checkout
    if args.extract is not None:
        write(texts, args.extract)
        print(f"{PROG}: wrote {', '.join(files)} ({sum(len(t.encode()) for t in texts.values())} bytes) from {origin} "
              f"into {args.extract}", flush=True)
        return 0
    # before anything is written or run
    patched = placed(patch(texts, EDITS if args.suite == "v1" else V2_EDITS, args.rev), args.suite)
    if not args.dry_run:
        require("torch", "numpy", prog=PROG)
    work = tempfile.mkdtemp(prefix="deepep-tests-") if args.workdir is None else args.workdir
    temporary = args.workdir is None and not args.dry_run  # a dry run leaves its folder to be read
    try:
        write(patched, work)
        cmd = command(args.test, args.num_processes, args.extra)
        env = environment(args.cpu)
        nodes = f"RANK=0..{args.num_nodes - 1}" if args.num_nodes > 1 else "RANK=0"
        shown = {"PYTHONPATH": env["PYTHONPATH"], **ENV,
                 **{k: env[k] for k in ("CUDA_MODULE_LOADING", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_EP_CUDA_AS_CPU",
                                        "MEGATRON_EP_DEEP_EP_BACKEND") if k in env},
                 "WORLD_SIZE": str(args.num_nodes)}
        print(f"+ cd {shlex.quote(work)} && " + " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items())
              + f" {nodes} " + shlex.join(cmd), flush=True)
        if args.dry_run:
            return 0
        return run_nodes(cmd, args.num_nodes, env, work)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
