"""The low-latency extension `_C_nvshmem` (NVSHMEM) is built by setup wherever `_C` is and the pip
NVSHMEM is installed, links NVSHMEM's host library and carries its device code, imports without a
GPU, and its layout (the one owner of the buffer's size) places every section inside the buffer."""

import glob
import os
import shutil
import subprocess

import pytest

import megatron_ep
from megatron_ep.core import envs
from megatron_ep.backends.cuda import extension as _ext
from megatron_ep.backends.cuda.paths import low_latency as LL

PKG = os.path.dirname(megatron_ep.__file__)


def _nvshmem_installed() -> bool:
    try:
        import nvidia.nvshmem  # noqa: F401
    except ImportError:
        return False
    return True


def _built():
    return glob.glob(os.path.join(PKG, "_C_nvshmem*.so"))


@pytest.fixture(scope="module")
def so():
    cuda_built = glob.glob(os.path.join(PKG, "_C.*.so"))
    required = envs.flag("MEGATRON_EP_REQUIRE_EXTENSION")
    if not _built() and not (required or cuda_built):
        pytest.skip("no CUDA extension built here (set MEGATRON_EP_REQUIRE_EXTENSION=1 to require it)")
    if not _nvshmem_installed():
        pytest.skip("nvidia-nvshmem-cu13 is not installed: setup.py skips _C_nvshmem (by design)")
    built = _built()
    assert built, f"megatron_ep._C_nvshmem was not built under {PKG} although _C was and NVSHMEM is installed"
    return built[0]


def test_links_nvshmem_and_has_device_code(so):
    if shutil.which("ldd"):
        out = subprocess.run(["ldd", so], capture_output=True, text=True).stdout
        line = next((ln for ln in out.splitlines() if "libnvshmem_host" in ln), "")
        assert line and "not found" not in line, f"_C_nvshmem does not resolve NVSHMEM's host library:\n{out}"
    if shutil.which("nm"):  # NVSHMEM's static device library (its init half) was linked in
        syms = subprocess.run(["nm", "-C", so], capture_output=True, text=True).stdout
        assert "nvshmemi_init_thread" in syms, "_C_nvshmem lacks libnvshmem_device.a's nvshmemi_init_thread"
    cuobjdump = shutil.which("cuobjdump") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")
    if os.path.exists(cuobjdump):
        elf = subprocess.run([cuobjdump, "--list-elf", so], capture_output=True, text=True).stdout
        assert "sm_90" in elf, f"_C_nvshmem carries no sm_90 device code:\n{elf}"


def test_imports_without_a_gpu_and_plans(so):
    ext = _ext.load_nvshmem()  # NVSHMEM's host library loads lazily: no GPU or driver needed to import
    R, E, mt, H, K = 8, 256, 128, 7168, 8
    plan = ext.plan(R, E, mt, H, K, True)
    msg = 16 + H + H // 128 * 4  # DeepEP's accounting: header + FP8 data + scales
    row = 2 * H + -(-(H // 128 * 4) // 16) * 16  # a bf16 combine row, then LogFMT's meta word per 128 channels
    assert plan["d_msg"] == msg and plan["c_row"] == row
    sections = ["d_rows", "d_table", "c_recv", "d_count", "c_flag", "release"]
    offs = [plan[s] for s in sections]
    assert offs == sorted(offs) and all(o % 256 == 0 for o in offs)
    assert plan["d_rows"] + R * mt * msg <= plan["d_table"]             # [R][mt] dispatch rows, one per (source, token)
    assert plan["d_table"] + (E // R) * R * mt * 16 <= plan["c_recv"]   # [L][R][mt] table entries, one per copy
    assert plan["c_recv"] + mt * K * row <= plan["d_count"]             # [mt][K] combine slots
    assert plan["release"] + 64 * 8 <= plan["set_bytes"]
    assert plan["state"] == 2 * plan["set_bytes"] and plan["total"] > plan["state"]  # two sets, then local state
    # the hint: two sets of rows per (source, token), entries per copy, combine slots and staging
    hint = LL.buffer_bytes(R, E, mt, H, K, use_fp8=True)
    need = 2 * (R * mt * msg + E * mt * 16 + mt * K * row + 132 * 16 * row)
    assert hint == plan["total"] and need <= hint <= need * 1.1
    assert hint < E * mt * msg  # below one set of DeepEP's per-expert layout
    bf16 = ext.plan(R, E, mt, H, K, False)
    assert bf16["d_msg"] == 16 + 2 * H and bf16["total"] > plan["total"]


def test_missing_extension_is_named(monkeypatch):
    monkeypatch.setattr(_ext.NVSHMEM, "module", None)
    monkeypatch.setattr(_ext.NVSHMEM, "error", "ImportError: libnvshmem_host.so.3: cannot open shared object file")
    with pytest.raises(RuntimeError, match="nvidia-nvshmem-cu13") as info:
        _ext.load_nvshmem()
    assert "libnvshmem_host.so.3" in str(info.value)


def test_signature_hash_tells_calls_apart():
    from megatron_ep.core import protocol as P

    a = P.Call(P.OP["low_latency_dispatch"], 3).set(hidden=7168, topk=8, num_experts=256, max_tokens_per_rank=128)
    b = P.Call(P.OP["low_latency_dispatch"], 3).set(hidden=7168, topk=8, num_experts=256, max_tokens_per_rank=64)
    c = P.Call(P.OP["low_latency_dispatch"], 3).set(hidden=7168, topk=8, num_experts=256, max_tokens_per_rank=128)
    assert LL.signature_hash(a) == LL.signature_hash(c) != LL.signature_hash(b)
    assert 0 <= LL.signature_hash(a) < 2**31


def test_bench_script_smoke():
    """scripts/bench low-latency end to end on CPU (the torch path, 2 gloo ranks, no timing)."""
    import sys

    root = os.path.dirname(PKG)
    res = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench"), "low-latency", "--smoke"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "| torch | 4 |" in res.stdout and "| torch | 1 |" in res.stdout, res.stdout
