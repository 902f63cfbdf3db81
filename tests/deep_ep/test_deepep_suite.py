"""DeepEP's own test files (deepseek-ai/DeepEP 567632d: tests/test_intranode.py,
tests/test_internode.py and tests/test_low_latency.py) on megatron_ep.deep_ep, on virtual ranks
of one GPU (2; the internode file on 2 virtual nodes of 8 with --test-ll-compatibility, the
low-latency file's --shrink-test on 8), through scripts/deepep_tests.py: only their launch glue is edited, every assertion of
theirs is kept (the internode file's benchmark asserts one dispatch / combine kernel and one
notify kernel per cached call: csrc/internode/fused.cu). And DeepEP dd758ca's V2 file,
tests/elastic/test_ep.py, on our ElasticBuffer at 2 virtual ranks (its correctness checks).

The files are DeepEP's, so they are never committed: extract them into .carry/deepep and
.carry/deepep-v2 (CONTRIBUTING.md, "DeepEP's own tests") or name other folders with
MEP_DEEPEP_TESTS and MEP_DEEPEP_V2_TESTS. Without them their cases skip saying so. MEP_DEEPEP_OUT=DIR keeps each run's output (DeepEP's prints:
its checks and timings, which on virtual ranks are not speed figures)."""

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from gpu_pools import GPU_MARKS

pytestmark = GPU_MARKS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the launcher's own map of a test to its suite and file
_spec = importlib.util.spec_from_file_location("deepep_tests", os.path.join(ROOT, "scripts", "deepep_tests.py"))
launcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launcher)
CHECKOUT = os.environ.get("MEP_DEEPEP_TESTS", os.path.join(ROOT, ".carry", "deepep"))
# DeepEP dd758ca's V2 suite (tests/elastic/test_ep.py and the deep_ep/utils modules it imports):
# `scripts/deepep_tests.py --suite v2 --extract .carry/deepep-v2`; without it its case skips
V2_CHECKOUT = os.environ.get("MEP_DEEPEP_V2_TESTS", os.path.join(ROOT, ".carry", "deepep-v2"))

# Sizes that keep each file within its time limit on 2 virtual ranks; the shapes stay DeepEP's
# defaults where they matter to the kernels (hidden 7168, top-8, low-latency 288 experts).
# The shrink test runs at 8 ranks (its ranks 1, 3 and 5 stop at their first dispatch, combine
# and clean; the others mask them when a wait passes MEGATRON_EP_MASK_TIMEOUT_S).
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
    ("low_latency", ["--shrink-test"], ["--num-processes", "8"], {"MEGATRON_EP_MASK_TIMEOUT_S": "4"}),
    # V2's file: every correctness check of its dispatch / combine cases (plain and expanded, bf16
    # and FP8, cached, with and without the CPU sync); its timing part (--skip-perf-test, the file's
    # own switch) reads DeepEP's kernel names from a profile, which ours do not have
    ("elastic", ["--num-tokens", "512", "--skip-perf-test"], ["--num-processes", "2"], {}),
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
@pytest.mark.parametrize("test,args,launch,env", CASES,
                         ids=["intranode", "internode", "low_latency", "low_latency_shrink", "elastic"])
def test_deepep_own_test_file(test, args, launch, env):
    checkout = {"v1": CHECKOUT, "v2": V2_CHECKOUT}[launcher.suite_of(test)]
    name = launcher.test_file(test)
    if not os.path.exists(os.path.join(checkout, name)):
        pytest.skip(f"DeepEP's test files are not at {checkout} (python scripts/deepep_tests.py --extract, "
                    f"CONTRIBUTING.md)")
    args, note = fitted_args(args, gpu_memory_gib())
    if note:
        print(note, end="")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "deepep_tests.py"), "--checkout", checkout, "--test", test,
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
    assert p.returncode == 0, f"DeepEP's {name} failed on megatron_ep.deep_ep (exit {p.returncode}):\n" \
                              f"{out[-6000:]}"
