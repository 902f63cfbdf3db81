"""Run Megatron-LM's own unit tests on megatron_ep's flex managers, on CPU (gloo, the torch
backend), as `torchrun --nproc-per-node 8 -m pytest ...` would on 8 GPUs:

    python tests/support/run_megatron_tests.py /path/to/Megatron-LM               # TestFlexDispatcher
    python tests/support/run_megatron_tests.py /path/to/Megatron-LM -k "TestFlexDispatcher and hybridep"
    python tests/support/run_megatron_tests.py /path/to/Megatron-LM --deep-ep -k "TestFlexDispatcher and deepep"

`--deep-ep`: Megatron's own `_DeepepManager` instead of ours, its `fused_a2a` importing
megatron_ep.deep_ep (the shim folder first on PYTHONPATH) in place of DeepEP; HybridEP stays
missing, so Megatron skips its hybridep cases.

The checkout's `megatron` is the one imported (its directory goes first on PYTHONPATH) and
megatron_ep comes from this repository. Each rank runs pytest on the test file
(`--file`, default tests/unit_tests/transformer/moe/test_token_dispatcher.py) with this module
loaded as a plugin, which changes only what a CPU run needs, before collection:
* megatron_ep.megatron.install(): Megatron's flex dispatcher builds our managers;
* `fused_a2a.HAVE_DEEP_EP` / `HAVE_HYBRIDEP` are set (the tests skip without DeepEP and
  HybridEP, which our managers replace);
* the `skipif(not torch.cuda.is_available())` marks are dropped, `.cuda()` of tensors and
  modules is the identity, `torch.cuda.synchronize` / `set_device` do nothing, and
  recipes/cpu_shims.py applies (router device, streams, RNG tracker);
* `Utils.initialize_distributed` joins a gloo group (RANK / WORLD_SIZE from this launcher)
  instead of NCCL, and the unit-test data download is skipped (no test here reads it);
* `typing.override` (Python 3.12) comes from typing_extensions on older Pythons.
Megatron-LM's conftest imports its data downloader (click, requests): where those are missing,
a stand-in downloader whose download raises takes its place (no test here reads that data).
`--gpu` runs the ranks as virtual ranks of the visible GPU (every rank on cuda:0, under MPS, gloo
groups as tests/support/megatron_lm_virtual.py makes them, CUDA modules loaded eagerly) with our CUDA kernels. Nothing of Megatron-LM is copied or changed. Exit
status: 0 when every rank passed; each rank's pytest summary line is printed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_FILE = "tests/unit_tests/transformer/moe/test_token_dispatcher.py"


# ----------------------------------------------------------------------------- the plugin
def _typing_override() -> None:
    """megatron.training (main) imports Python 3.12's typing.override; Megatron's conftest
    imports it before any hook runs, so this runs when pytest loads the plugin."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _without_downloader() -> None:
    """Megatron's unit-test conftest imports its data downloader, which imports click and
    requests; no dispatcher test reads that data. Where those packages are missing (a GPU image),
    a stand-in module takes the downloader's place, its download raising, so the conftest loads;
    this runs when pytest loads the plugin, before the conftest."""
    try:
        import click  # noqa: F401
        import requests  # noqa: F401
        return
    except ImportError:
        pass
    import types

    def download_and_extract_asset(*args, **kwargs):
        raise ImportError("unit-test data not downloaded (click and requests are missing)")

    parts = "tests.test_utils.python_scripts.download_unit_tests_dataset".split(".")
    for i in range(2, len(parts) + 1):
        name = ".".join(parts[:i])
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[".".join(parts)].download_and_extract_asset = download_and_extract_asset


def _on_cpu() -> None:
    import torch

    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    from recipes import cpu_shims

    cpu_shims.apply()


def _on_one_gpu() -> None:
    """Virtual ranks (several processes on one GPU, under MPS): every rank on cuda:0, and gloo
    groups with Megatron's collectives over them (NCCL refuses two ranks on one GPU;
    megatron_lm_virtual.py)."""
    import torch

    import megatron_lm_virtual

    set_device = torch.cuda.set_device
    torch.cuda.set_device = lambda *a, **k: set_device(0)
    set_device(0)
    megatron_lm_virtual._patch_collectives()


def pytest_configure(config):
    sys.path.insert(0, ROOT)
    if os.environ.get("MEP_RUN_GPU") == "1":
        _on_one_gpu()
    else:
        _on_cpu()
    from megatron.core.transformer.moe import fused_a2a

    if os.environ.get("MEP_RUN_DEEP_EP") == "1":  # Megatron's own manager on our deep_ep module
        import deep_ep

        assert deep_ep.Buffer.__module__.startswith("megatron_ep.deep_ep"), deep_ep.__file__
        assert fused_a2a.HAVE_DEEP_EP, "fused_a2a did not import deep_ep"
        what = f"Megatron's own _DeepepManager on {deep_ep.Buffer.__module__}"
    else:
        import megatron_ep.megatron as mep_megatron

        feats = mep_megatron.install()
        fused_a2a.HAVE_DEEP_EP = fused_a2a.HAVE_HYBRIDEP = True
        what = f"megatron_ep managers installed into megatron-core {feats.version}"
    from tests.unit_tests.test_utilities import Utils

    def initialize_distributed():
        import torch.distributed as dist

        if not dist.is_initialized() and Utils.rank >= 0:
            dist.init_process_group("gloo", rank=Utils.rank, world_size=Utils.world_size)
            dist.barrier()
        Utils.inited = True

    Utils.initialize_distributed = staticmethod(initialize_distributed)
    print(f"{what} (rank {Utils.rank})")


def pytest_collection_modifyitems(config, items):
    conftest = sys.modules.get("tests.unit_tests.conftest")
    if conftest is not None and hasattr(conftest, "download_and_extract_asset"):
        def no_download(*a, **k):
            raise ImportError("unit-test data not downloaded (CPU run of the dispatcher tests)")

        conftest.download_and_extract_asset = no_download
    if os.environ.get("MEP_RUN_GPU") == "1":
        return
    for item in items:
        item.own_markers = [m for m in item.own_markers
                            if not (m.name == "skipif" and "CUDA not available" in str(m.kwargs.get("reason", "")))]


# ----------------------------------------------------------------------------- the launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkout", help="Megatron-LM checkout (holds megatron/ and tests/unit_tests/)")
    p.add_argument("-k", default="TestFlexDispatcher", help="pytest -k expression (default: TestFlexDispatcher)")
    p.add_argument("--file", default=DEFAULT_FILE, help=f"test file inside the checkout (default: {DEFAULT_FILE})")
    p.add_argument("--nproc", type=int, default=8, help="ranks (Megatron's tests assume 8)")
    p.add_argument("--timeout", type=int, default=3000, help="seconds before the ranks are stopped")
    p.add_argument("--deep-ep", action="store_true",
                   help="Megatron's own _DeepepManager on megatron_ep.deep_ep (not our managers)")
    p.add_argument("--gpu", action="store_true",
                   help="on the visible GPU (every rank on cuda:0, under MPS: start it first) with our CUDA kernels, "
                        "instead of CPU processes and the torch backend")
    args = p.parse_args(argv)
    checkout = os.path.abspath(args.checkout)
    if not os.path.isfile(os.path.join(checkout, args.file)):
        print(f"run_megatron_tests: error: {os.path.join(checkout, args.file)} does not exist", file=sys.stderr)
        return 2
    backend = "cuda" if args.gpu else "torch"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(args.nproc),
               MEGATRON_EP_BACKEND=backend, MEGATRON_EP_DEEP_EP_BACKEND=backend, MEP_RUN_GPU="1" if args.gpu else "0",
               MEP_RUN_DEEP_EP="1" if args.deep_ep else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "megatron_ep", "deep_ep", "shim") if args.deep_ep
                                                        else None, checkout, ROOT, HERE, os.environ.get("PYTHONPATH")])))
    if args.gpu:  # Megatron's EP groups split the ranks; our buffers split the GPU's SMs over all of them
        env["MEGATRON_EP_DEVICE_SHARERS"] = str(args.nproc)
        # eager module loading: the ranks share one GPU under MPS (megatron_ep/backends/cuda/sharing.py)
        env["CUDA_MODULE_LOADING"] = "EAGER"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "pytest", "-p", "run_megatron_tests", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "-rs", args.file, "-k", args.k]
    procs = []
    for rank in range(args.nproc):
        out = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"megatron_tests_rank{rank}.log"), "w+")
        procs.append((subprocess.Popen(cmd, cwd=checkout, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                       stdout=out, stderr=subprocess.STDOUT), out))
    codes = []
    for rank, (proc, out) in enumerate(procs):
        try:
            codes.append(proc.wait(timeout=args.timeout))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            codes.append("timeout")
        out.seek(0)
        text = out.read()
        out.close()
        summary = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or " error" in ln
                   or " skipped" in ln]
        if rank == 0 or codes[-1] != 0:
            print(text[-20000:] if codes[-1] != 0 else "\n".join(ln for ln in text.splitlines() if ln.startswith("SKIPPED")))
        print(f"rank {rank}: exit {codes[-1]}: {summary[-1] if summary else '(no summary)'} ({out.name})")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
else:
    _typing_override()
    _without_downloader()
