"""Ranks that share one GPU (virtual ranks, under MPS) load CUDA modules eagerly: every launcher of
such ranks sets CUDA_MODULE_LOADING=EAGER before CUDA starts, and a cuda Buffer whose ranks share a
GPU under lazy loading says why its handshakes may time out (megatron_ep/backends/cuda/sharing.py). CPU
only: the launchers are stopped at their first CUDA call."""

import os
import sys
import types

import pytest
import torch

from megatron_ep.core import protocol as P
from megatron_ep.backends.cuda.ledger import CallLedger

ENV = "CUDA_MODULE_LOADING"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class _FirstCudaCall(Exception):
    pass


@pytest.fixture
def first_cuda_call(monkeypatch):
    """torch.cuda.set_device stops the caller, recording CUDA_MODULE_LOADING as CUDA would read it."""
    seen = {}

    def set_device(*args, **kwargs):
        seen["loading"] = os.environ.get(ENV)
        raise _FirstCudaCall()

    monkeypatch.setenv(ENV, "LAZY")  # what torch or a container leaves behind
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return seen


def test_megatron_lm_virtual_loads_modules_eagerly(first_cuda_call):
    """tests/support/megatron_lm_virtual.py (pretrain_gpt.py on virtual ranks) sets EAGER before CUDA starts,
    whatever the environment says."""
    import megatron_lm_virtual

    with pytest.raises(_FirstCudaCall):
        megatron_lm_virtual.main()
    assert first_cuda_call["loading"] == "EAGER"


def test_train_moe_virtual_ranks_load_modules_eagerly(first_cuda_call):
    sys.path.insert(0, ROOT)
    from recipes import train_moe

    with pytest.raises(_FirstCudaCall):
        train_moe.init_distributed(virtual_ranks=True)
    assert first_cuda_call["loading"] == "EAGER"


def test_run_megatron_tests_gpu_ranks_load_modules_eagerly(monkeypatch, tmp_path):
    """run_megatron_tests.py --gpu starts its ranks with EAGER (and the CPU run leaves it alone)."""
    import run_megatron_tests

    (tmp_path / "t.py").write_text("")
    envs = []

    class Proc:
        def __init__(self, cmd, env, **kwargs):
            envs.append(env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setenv(ENV, "LAZY")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(run_megatron_tests.subprocess, "Popen", Proc)
    assert run_megatron_tests.main([str(tmp_path), "--file", "t.py", "--nproc", "2", "--gpu"]) == 0
    assert [e[ENV] for e in envs] == ["EAGER", "EAGER"]
    envs.clear()
    assert run_megatron_tests.main([str(tmp_path), "--file", "t.py", "--nproc", "2"]) == 0
    assert [e[ENV] for e in envs] == ["LAZY", "LAZY"]


def test_loading_mode_from_the_environment():
    from megatron_ep.backends.cuda import sharing

    assert sharing.env_mode({}) == "LAZY"  # torch's and the driver's default
    assert sharing.env_mode({"CUDA_MODULE_LOADING": "eager"}) == "EAGER"
    assert sharing.env_mode({"CUDA_MODULE_LOADING": "LAZY"}) == "LAZY"
    env = {"CUDA_MODULE_LOADING": "LAZY"}
    sharing.prepare_shared_gpu(env)
    assert env == {"CUDA_MODULE_LOADING": "EAGER"}
    assert sharing.lazy_loading_hazard(1, "LAZY") is None  # one rank per GPU: its own context
    assert sharing.lazy_loading_hazard(4, "EAGER") is None
    assert "CUDA_MODULE_LOADING=EAGER" in sharing.lazy_loading_hazard(4, "LAZY")


def _runtime(ranks_per_device: int) -> CallLedger:
    """The call ledger of a cuda runtime, over the parts of a region its error messages read (no
    GPU here)."""
    return CallLedger("intranode", types.SimpleNamespace(rank=1, timeout_s=60.0), ranks_per_device)


def _timeout(code: str, slot: str) -> dict:
    return dict(code=P.ERROR[code], rank=1, peer=2, slot=P.SLOT[slot], seq=4, observed=3, expected=4)


@pytest.mark.parametrize("code,slot", [("timeout", "call"), ("peer_aborted", "combine_done")])
def test_timeouts_of_ranks_sharing_a_gpu_name_lazy_loading(monkeypatch, code, slot):
    """The messages of a timeout (and of the peers that stop because of it) where the ranks share a
    GPU under lazy loading say so and name the setting; with one rank per GPU, or EAGER, they do not."""
    monkeypatch.setenv(ENV, "LAZY")
    shared = _runtime(4)._describe_fatal(_timeout(code, slot))
    assert "call #4" in shared and "CUDA_MODULE_LOADING=EAGER" in shared and "4 ranks share this GPU" in shared
    assert "CUDA_MODULE_LOADING" not in _runtime(1)._describe_fatal(_timeout(code, slot))
    monkeypatch.setenv(ENV, "EAGER")
    assert "CUDA_MODULE_LOADING" not in _runtime(4)._describe_fatal(_timeout(code, slot))
