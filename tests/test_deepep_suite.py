"""DeepEP's own test files (deepseek-ai/DeepEP 567632d: tests/test_intranode.py,
tests/test_internode.py and tests/test_low_latency.py) on megatron_ep.deep_ep, on virtual ranks
of one GPU (2; the internode file on 2 virtual nodes of 8 with --test-ll-compatibility, the
low-latency file's --shrink-test on 8), through scripts/deepep_tests.py: only their launch glue is edited, every assertion of
theirs is kept (the internode file's benchmark asserts one dispatch / combine kernel and one
notify kernel per cached call: csrc/internode/fused.cu).

The files are DeepEP's, so they are never committed: extract them into .carry/deepep
(CONTRIBUTING.md, "DeepEP's own tests") or name another folder with MEP_DEEPEP_TESTS. Without
them these tests skip saying so. MEP_DEEPEP_OUT=DIR keeps each run's output (DeepEP's prints:
its checks and timings, which on virtual ranks are not speed figures)."""

import os
import signal
import subprocess
import sys

import pytest

from gpu_pools import GPU_MARKS

pytestmark = GPU_MARKS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT = os.environ.get("MEP_DEEPEP_TESTS", os.path.join(ROOT, ".carry", "deepep"))

# Sizes that keep each file within its time limit on 2 virtual ranks; the shapes stay DeepEP's
# defaults where they matter to the kernels (hidden 7168, top-8, low-latency 288 experts).
# The shrink test runs at 8 ranks (its ranks 1, 3 and 5 stop at their first dispatch, combine
# and clean; the others mask them when a wait passes MEP_MASK_TIMEOUT_S).
# The internode file runs 2 virtual nodes of 8 ranks (16 processes of 8 SMs on one H200), 512
# tokens per rank: its correctness checks, its tuning sweep of 218 profiled calls, then, on the
# same Buffer (low_latency_mode=True), test_low_latency.py's checks at 16 ranks of 256 experts
# (--test-ll-compatibility: one Buffer serving prefill's normal calls and decode's low-latency ones).
# That part needs more memory than an 80 GB card has for 16 ranks (their NVSHMEM heaps and
# DeepEP's benchmark buffers: on an H100 80GB cuBLAS cannot start in its benchmark), so on a GPU
# under LL_COMPAT_MIN_GIB the file runs without it and its output says so.
CASES = [
    ("intranode", ["--num-tokens", "1024", "--num-experts", "64"], ["--num-processes", "2"], {}),
    ("internode", ["--num-tokens", "512", "--test-ll-compatibility"], ["--num-nodes", "2", "--num-processes", "8"], {}),
    ("low_latency", [], ["--num-processes", "2"], {}),
    ("low_latency", ["--shrink-test"], ["--num-processes", "8"], {"MEP_MASK_TIMEOUT_S": "4"}),
]
LIMIT_S = {"internode": 420}  # the run's own timeout; the test's limit is 20 s more
LL_COMPAT_MIN_GIB = 100


def gpu_memory_gib() -> float:
    """GPU 0's memory, from nvidia-smi (this process makes no CUDA context of its own); 0 if unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return float(out.split()[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0.0


def fitted_args(args: list, gib: float) -> tuple:
    """(args, note): --test-ll-compatibility dropped on a GPU of less than LL_COMPAT_MIN_GIB."""
    if "--test-ll-compatibility" not in args or gib >= LL_COMPAT_MIN_GIB:
        return args, ""
    return [a for a in args if a != "--test-ll-compatibility"], \
        (f"(--test-ll-compatibility left out: this GPU has {gib:.0f} GiB; 16 virtual ranks with their "
         f"low-latency buffers need {LL_COMPAT_MIN_GIB} GiB or more)\n")


@pytest.mark.limit(440)
@pytest.mark.parametrize("test,args,launch,env", CASES, ids=["intranode", "internode", "low_latency", "low_latency_shrink"])
def test_deepep_own_test_file(test, args, launch, env):
    path = os.path.join(CHECKOUT, "tests", f"test_{test}.py")
    if not os.path.exists(path):
        pytest.skip(f"DeepEP's test files are not at {CHECKOUT} (python scripts/deepep_tests.py --extract, "
                    f"CONTRIBUTING.md)")
    args, note = fitted_args(args, gpu_memory_gib())
    if note:
        print(note, end="")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "deepep_tests.py"), "--checkout", CHECKOUT, "--test", test,
           *launch, "--", *args]
    # a session of its own: a file that runs past its limit is killed with the ranks it spawned
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, env={**os.environ, **env})
    try:
        out, _ = p.communicate(timeout=LIMIT_S.get(test, 210))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        out += f"\n(killed after {LIMIT_S.get(test, 210)} s)"
    keep = os.environ.get("MEP_DEEPEP_OUT")
    if keep:
        os.makedirs(keep, exist_ok=True)
        with open(os.path.join(keep, f"test_{test}{'_shrink' if '--shrink-test' in args else ''}.log"), "w") as f:
            f.write(note + out)
    assert p.returncode == 0, f"DeepEP's tests/test_{test}.py failed on megatron_ep.deep_ep (exit {p.returncode}):\n" \
                              f"{out[-6000:]}"
