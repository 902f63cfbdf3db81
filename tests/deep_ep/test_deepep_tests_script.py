"""scripts/deepep_tests.py on CPU: the launch-glue edits of DeepEP's tests/utils.py apply exactly
once, an edit that does not match stops the script naming it, --extract writes only the test
files, the test runs with megatron_ep's deep_ep first on the path (one process per virtual node),
and --help answers without torch; for DeepEP V2's suite (--test elastic), the glue of its
deep_ep/utils/envs.py and the utils package placed beside test_ep.py. DeepEP's own files are
checked too where a git mirror of DeepEP is on this machine."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "deepep_tests.py")
SHIM = os.path.join(ROOT, "megatron_ep", "deep_ep", "shim")
MIRROR = "/work/.mirror/deepseek-ai+DeepEP/repo"  # a DeepEP git mirror, where one is fetched
FILES = ("tests/test_intranode.py", "tests/test_internode.py", "tests/test_low_latency.py", "tests/utils.py")

# The launch glue of tests/utils.py's init_dist at deepseek-ai/DeepEP 567632d, the text the
# script edits (the rest of DeepEP's files is never copied here).
INIT_DIST = """\
    sig = inspect.signature(dist.init_process_group)
    params = {
        'backend': 'nccl',
        'init_method': f'tcp://{ip}:{port}',
        'world_size': num_nodes * num_local_ranks,
        'rank': node_rank * num_local_ranks + local_rank,
    }
    if 'device_id' in sig.parameters:
        # noinspection PyTypeChecker
        params['device_id'] = torch.device(f'cuda:{local_rank}')
    dist.init_process_group(**params)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    torch.cuda.set_device(local_rank)
"""

# A stand-in test file: says where `deep_ep` would be imported from, its arguments and the
# variables init_dist reads, and exits with status 3.
FAKE_TEST = """\
import importlib.util, os, sys
spec = importlib.util.find_spec('deep_ep')
print('deep_ep from', os.path.dirname(os.path.dirname(spec.origin)))
print('args', ' '.join(sys.argv[1:]))
print('node', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'port', os.environ['MASTER_PORT'])
sys.exit(3)
"""


def _checkout(path, utils=INIT_DIST, test=FAKE_TEST):
    os.makedirs(path / "tests")
    for rel in FILES:
        (path / rel).write_text(("def init_dist(local_rank, num_local_ranks):\n" + utils) if rel.endswith("utils.py")
                                else test)
    return path


def _run(*args, env=None, timeout=120):
    env = {**os.environ, **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MEGATRON_EP_DEBUG_TRACEBACK"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def test_edits_apply_once_and_keep_the_rest(tmp_path):
    src, work = _checkout(tmp_path / "deepep"), tmp_path / "work"
    rc, out = _run("--checkout", str(src), "--test", "low_latency", "--workdir", str(work), "--dry-run", "--",
                   "--num-tokens", "64")
    assert rc == 0, out
    assert "tests/test_low_latency.py --num-processes 2 --num-tokens 64" in out, out
    assert f"PYTHONPATH={SHIM}{os.pathsep}" in out, out
    patched = (work / "tests" / "utils.py").read_text()
    for new in ("'backend': 'gloo',", "    torch.cuda.set_device(local_rank % torch.cuda.device_count())\n",
                "    dist.all_gather_into_tensor = lambda output, input, group=None, async_op=False: "
                "dist.all_gather(\n",
                "# no device_id"):
        assert patched.count(new) == 1, (new, patched)
    assert "'nccl'" not in patched and "params['device_id']" not in patched
    # every other line of init_dist is kept as it was
    kept = [ln for ln in INIT_DIST.splitlines() if "nccl" not in ln and "device_id" not in ln
            and "noinspection" not in ln and "set_device" not in ln]
    assert all(ln in patched.splitlines() for ln in kept)
    for rel in FILES[:3]:  # the test files themselves are copied unchanged
        assert (work / rel).read_text() == FAKE_TEST


@pytest.mark.parametrize("how", ["missing", "twice"])
def test_an_edit_that_does_not_match_once_stops_the_run_naming_it(tmp_path, how):
    utils = (INIT_DIST.replace("'backend': 'nccl',", "'backend': 'mpi',") if how == "missing"
             else INIT_DIST + "    torch.cuda.set_device(local_rank)\n")
    edit = "backend gloo" if how == "missing" else "device of the rank"
    src, work = _checkout(tmp_path / "deepep", utils=utils), tmp_path / "work"
    rc, out = _run("--checkout", str(src), "--test", "intranode", "--workdir", str(work))
    assert rc == 2, out
    assert f"tests/utils.py: edit '{edit}' matches {0 if how == 'missing' else 2} times" in out, out
    assert not work.exists()  # nothing written, nothing run


def test_the_test_runs_with_the_shim_first_and_its_status_comes_back(tmp_path):
    src = _checkout(tmp_path / "deepep")
    rc, out = _run("--checkout", str(src), "--test", "intranode", "--", "--num-tokens", "128")
    assert rc == 3, out
    assert f"deep_ep from {SHIM}" in out and "node 0 of 1" in out, out
    assert "args --num-processes 2 --num-tokens 128" in out, out
    assert "deepep_tests.py: error: test_intranode.py exited with status 3" in out, out
    rc, out = _run("--checkout", str(src), "--test", "internode", "--num-nodes", "2")
    assert rc == 3, out
    assert "node 0 of 2" in out and "node 1 of 2" in out and "args --num-processes 8" in out, out
    ports = {ln.split()[-1] for ln in out.splitlines() if ln.startswith("node ")}
    assert len(ports) == 1, out  # the nodes meet at one rendezvous


def test_extract_writes_only_the_test_files_unpatched(tmp_path):
    src, dest = _checkout(tmp_path / "deepep"), tmp_path / "carry"
    (src / "tests" / "test_other.py").write_text("x = 1\n")
    (src / "setup.py").write_text("x = 1\n")
    rc, out = _run("--checkout", str(src), "--extract", str(dest))
    assert rc == 0, out
    got = sorted(os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs)
    assert got == sorted(FILES)
    assert (dest / "tests" / "utils.py").read_text() == (src / "tests" / "utils.py").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_extract_from_a_git_directory_at_a_revision(tmp_path):
    src, dest = _checkout(tmp_path / "deepep"), tmp_path / "carry"
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "one"], check=True)
    (src / "tests" / "utils.py").write_text("changed after the commit\n")
    rc, out = _run("--git", str(src), "--rev", "HEAD", "--extract", str(dest))
    assert rc == 0, out
    assert (dest / "tests" / "utils.py").read_text().endswith(INIT_DIST)
    rc, out = _run("--git", str(src), "--rev", "no-such-rev", "--extract", str(dest))
    assert rc == 2 and "no commit 'no-such-rev'" in out, out


def test_help_answers_without_torch():
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = [sys.argv[1], '--help']; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for option in ("--checkout", "--git", "--rev", "--extract", "--test", "--num-processes", "--num-nodes",
                   "--dry-run"):
        assert option in p.stdout, option


@pytest.mark.skipif(not os.path.isdir(MIRROR), reason=f"no DeepEP git mirror at {MIRROR} (CI has none)")
def test_deepep_567632d_files_take_every_edit(tmp_path):
    work = tmp_path / "work"
    for test in ("intranode", "low_latency"):
        rc, out = _run("--git", MIRROR, "--rev", "567632d", "--test", test, "--workdir", str(work), "--dry-run")
        assert rc == 0, out
    rc, out = _run("--git", MIRROR, "--rev", "567632d", "--test", "internode", "--workdir", str(work), "--dry-run")
    assert rc == 0 and "tests/test_internode.py --num-processes 8" in out, out
    real = subprocess.run(["git", "-C", MIRROR, "show", "567632d:tests/utils.py"], capture_output=True, text=True,
                          check=True).stdout
    assert INIT_DIST in real  # the fixture above is DeepEP's text
    assert "'backend': 'gloo'" in (work / "tests" / "utils.py").read_text()


# DeepEP V2's suite (dd758ca): the test's imports of the utils package and the launch glue of
# deep_ep/utils/envs.py's init_dist, the texts the script edits.
V2_IMPORTS = """\
from deep_ep.utils.math import (
    align, count_bytes, calc_diff,
)
from deep_ep.utils.gate import get_unbalanced_scores
from deep_ep.utils.envs import init_dist, init_seed, dist_print
from deep_ep.utils.refs import dispatch as ref_dispatch
from deep_ep.utils.refs import combine as ref_combine
from deep_ep.utils.refs import generate_pre_combine_data, ordered_accumulate
from deep_ep.utils.testing import bench_kineto
"""
V2_ENVS_HEAD = """\
import torch

# noinspection PyUnresolvedReferences
import deep_ep._C as _C

from .comm import get_nccl_comm_handle

"""
V2_FILES = ("tests/elastic/test_ep.py", *(f"deep_ep/utils/{m}.py" for m in ("envs", "math", "gate", "refs", "testing")))


def _v2_checkout(path, imports=V2_IMPORTS):
    for rel in V2_FILES:
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        text = {"tests/elastic/test_ep.py": imports + FAKE_TEST,
                "deep_ep/utils/envs.py": V2_ENVS_HEAD + "def init_dist(local_rank, num_local_ranks, seed=0):\n" + INIT_DIST,
                "deep_ep/utils/refs.py": "from .envs import get_global_seed\n"}.get(rel, "x = 1\n")
        (path / rel).write_text(text)
    return path


def test_v2_suite_edits_and_places_the_utils_package(tmp_path):
    """--test elastic: init_dist's glue in deep_ep/utils/envs.py, its imports of DeepEP's extension
    gone, the utils modules beside test_ep.py as deep_ep_utils, and every import of the test
    pointed there (refs' three too); the test file otherwise unchanged."""
    src, work = _v2_checkout(tmp_path / "deepep"), tmp_path / "work"
    rc, out = _run("--checkout", str(src), "--test", "elastic", "--workdir", str(work), "--dry-run", "--",
                   "--num-tokens", "64")
    assert rc == 0, out
    assert "tests/elastic/test_ep.py --num-processes 2 --num-tokens 64" in out, out
    pkg = work / "tests" / "elastic" / "deep_ep_utils"
    assert sorted(p.name for p in pkg.iterdir()) == ["__init__.py", "envs.py", "gate.py", "math.py", "refs.py", "testing.py"]
    assert not (work / "deep_ep").exists()
    envs = (pkg / "envs.py").read_text()
    assert "'backend': 'gloo'" in envs and "set_device(local_rank % torch.cuda.device_count())" in envs
    assert "deep_ep._C" not in envs and ".comm" not in envs and "params['device_id']" not in envs
    test = (work / "tests" / "elastic" / "test_ep.py").read_text()
    assert "deep_ep.utils" not in test and test.count("from deep_ep_utils.refs import ") == 3
    assert test == V2_IMPORTS.replace("deep_ep.utils.", "deep_ep_utils.") + FAKE_TEST
    assert (pkg / "refs.py").read_text() == "from .envs import get_global_seed\n"  # relative imports stay


def test_v2_suite_moves_fp8_rows_as_bytes_through_gloo(tmp_path):
    """gloo has no FP8 types ('Invalid scalar type' from V2's reference dispatch on a GPU, one
    H100, 2026-12-07): the patched init_dist wraps dist.all_to_all_single so that 1-byte float
    tensors go through as uint8 views of the same memory, and every other tensor unchanged."""
    import textwrap
    import types

    import torch

    src, work = _v2_checkout(tmp_path / "deepep"), tmp_path / "work"
    rc, out = _run("--checkout", str(src), "--test", "elastic", "--workdir", str(work), "--dry-run")
    assert rc == 0, out
    envs = (work / "tests" / "elastic" / "deep_ep_utils" / "envs.py").read_text()
    start = envs.index("    dist.init_process_group(**params)\n") + len("    dist.init_process_group(**params)\n")
    block = textwrap.dedent(envs[start:envs.index("    torch.set_default_dtype", start)])
    seen = []
    dist = types.SimpleNamespace(all_to_all_single=lambda output, input, *args, **kwargs: seen.append(
        (output, input, args, kwargs)))
    exec(block, {"dist": dist, "torch": torch})  # noqa: S102 - the patched file's own lines
    rows = torch.randn(4, 8).to(torch.float8_e4m3fn)
    got = torch.empty_like(rows)
    dist.all_to_all_single(got, rows, [2, 2], [1, 3], group=None)
    (o, i, args, kwargs), = seen
    assert o.dtype == i.dtype == torch.uint8 and o.data_ptr() == got.data_ptr() and i.data_ptr() == rows.data_ptr()
    assert torch.equal(i, rows.view(torch.uint8)) and args == ([2, 2], [1, 3]) and kwargs == {"group": None}
    counts = torch.arange(4, dtype=torch.int32)
    dist.all_to_all_single(counts, counts)
    assert seen[-1][0] is counts and seen[-1][1] is counts  # not FP8: as given


def test_v2_suite_an_import_that_moved_stops_the_run(tmp_path):
    src = _v2_checkout(tmp_path / "deepep", imports=V2_IMPORTS.replace(
        "from deep_ep.utils.refs import combine as ref_combine\n", ""))
    rc, out = _run("--checkout", str(src), "--test", "elastic", "--workdir", str(tmp_path / "work"))
    assert rc == 2, out
    assert "edit 'import refs' matches 2 times, expected 3" in out, out


def test_v2_extract_and_its_options(tmp_path):
    src, dest = _v2_checkout(tmp_path / "deepep"), tmp_path / "carry"
    rc, out = _run("--checkout", str(src), "--suite", "v2", "--extract", str(dest))
    assert rc == 0, out
    got = sorted(os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs)
    assert got == sorted(V2_FILES)
    rc, out = _run("--checkout", str(src), "--suite", "v2", "--test", "elastic")
    assert rc == 2 and "--suite goes with --extract" in out, out
    rc, out = _run("--checkout", str(src), "--test", "elastic", "--num-nodes", "2")
    assert rc == 2 and "--num-nodes goes with --test internode (test_ep.py runs on one node here)" in out, out


@pytest.mark.skipif(not os.path.isdir(MIRROR), reason=f"no DeepEP git mirror at {MIRROR} (CI has none)")
def test_deepep_dd758ca_files_take_every_edit(tmp_path):
    work = tmp_path / "work"
    rc, out = _run("--git", MIRROR, "--test", "elastic", "--workdir", str(work), "--dry-run")
    assert rc == 0 and "tests/elastic/test_ep.py --num-processes 2" in out, out
    pkg = work / "tests" / "elastic" / "deep_ep_utils"
    code = "import deep_ep_utils.envs, deep_ep_utils.refs, deep_ep_utils.math, deep_ep_utils.gate, deep_ep_utils.testing"
    p = subprocess.run([sys.executable, "-c", code], cwd=pkg.parent, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr  # the placed modules import without DeepEP's extension


def test_cuda_as_cpu_maps_every_cuda_device_to_the_cpu():
    """--cpu's sitecustomize: with MEGATRON_EP_CUDA_AS_CPU=1, factory calls, .cuda(), .to("cuda"), the
    default device and torch.cuda's queries give or answer for the CPU, and an FP8 tensor's
    collective moves its bytes; without the variable it changes nothing."""
    code = (
        "import torch, torch.distributed as dist\n"
        "torch.set_default_device('cuda'); torch.cuda.set_device(3); torch.cuda.synchronize()\n"
        "a = torch.randn(2, 4, device='cuda:0'); b = torch.zeros(3); c = a.cuda().to('cuda')\n"
        "d = torch.empty(2, device=torch.device('cuda', 1))\n"
        "assert {t.device.type for t in (a, b, c, d)} == {'cpu'}, (a.device, b.device, c.device, d.device)\n"
        "assert torch.cuda.current_device() == 0 and torch.cuda.device_count() == 1\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "x = torch.randn(4, 8).to(torch.float8_e4m3fn); y = torch.empty_like(x)\n"
        "dist.all_to_all_single(y, x)\n"
        "assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))\n"
        "print('mapped')\n")
    shim = os.path.join(ROOT, "scripts", "cuda_as_cpu")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")])),
           "MEGATRON_EP_CUDA_AS_CPU": "1", "MASTER_ADDR": "127.0.0.1"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "mapped" in p.stdout, p.stdout + p.stderr
    env["MEGATRON_EP_CUDA_AS_CPU"] = "0"
    off = "import torch, sitecustomize; assert torch.set_default_device.__module__ == 'torch'; print('untouched')"
    p = subprocess.run([sys.executable, "-c", off], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "untouched" in p.stdout, p.stdout + p.stderr


@pytest.mark.limit(900)
@pytest.mark.skipif(not os.path.isdir(MIRROR), reason=f"no DeepEP git mirror at {MIRROR} (CI has none)")
def test_deepep_dd758ca_test_ep_passes_on_cpu():
    """DeepEP V2's own tests/elastic/test_ep.py, every mode of its loop, on megatron_ep.deep_ep's
    ElasticBuffer on the torch backend, 2 CPU processes (--cpu), at a small shape."""
    rc, out = _run("--git", MIRROR, "--test", "elastic", "--cpu", "--", "--num-tokens", "64", "--hidden", "256",
                   "--num-experts", "16", "--num-topk", "4", "--skip-perf-test", timeout=840)
    assert rc == 0 and "Testing with do_handle_copy=0, expert_alignment=1" in out, out[-4000:]


def test_the_ll_compatibility_part_runs_where_the_gpu_has_the_memory():
    from test_deepep_suite import LL_COMPAT_MIN_GIB, fitted_args

    args = ["--num-tokens", "512", "--test-ll-compatibility"]
    assert fitted_args(args, 139.8) == (args, "")
    kept, note = fitted_args(args, 79.6)
    assert kept == ["--num-tokens", "512"] and "left out" in note and str(LL_COMPAT_MIN_GIB) in note
    assert fitted_args(["--num-tokens", "1024"], 79.6) == (["--num-tokens", "1024"], "")
