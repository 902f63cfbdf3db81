"""Worker pools for the GPU tests: R processes on the visible GPU(s) (virtual ranks when there
is one GPU; run them under MPS, see scripts/gpu_check.sh), kept for a test module's lifetime.
A GPU test module takes its marks and its pools' closing from here:

    pytestmark = GPU_MARKS
    POOLS = GpuPools(...)
    _close_pools = closing(POOLS)
"""

import os

import pytest
import torch

import megatron_ep
from distpool import DistPool

# What a GPU test module needs to run: the `gpu` mark (-m gpu selects them) and a skip elsewhere.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and megatron_ep.cuda_backend_available()),
                       reason="needs a CUDA GPU and the built extension"),
]

# Outputs poisoned before every kernel, short handshake timeouts (MEP_TIMEOUT_S from the
# environment when set: the gate's sanitizer runs are several times slower), eager module loading
# under MPS (one context for every rank: a kernel loaded lazily can wait behind a peer's spinning
# one), NVLink multicast off. Without MPS each rank has its own context, so the gate's sanitizer
# runs set MEP_TEST_MODULE_LOADING=LAZY: the tools then instrument only the kernels that run.
ENV = {"MEP_TEST_CUDA": "1", "MEP_POISON": "1", "MEP_TIMEOUT_S": os.environ.get("MEP_TIMEOUT_S", "30"),
       "CUDA_MODULE_LOADING": os.environ.get("MEP_TEST_MODULE_LOADING", "EAGER"),
       "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


class GpuPools:
    def __init__(self, **env):
        self.env = {**ENV, **env}
        self._pools = {}

    def get(self, R: int, backend: str = "gloo", **env) -> DistPool:
        """A live pool of R ranks with this control backend and these extra environment values."""
        key = (R, backend, tuple(sorted(env.items())))
        if key not in self._pools or self._pools[key].broken:
            self._pools[key] = DistPool(R, backend=backend, env={**self.env, **env})
        return self._pools[key]

    def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()


def run_alone(R: int, fn, *args, timeout: float, backend: str = "gloo", **env) -> list:
    """fn's per-rank results on a pool of its own, closed after (a test whose environment, e.g. a
    short timeout, no other test may share, or which may leave its pool broken)."""
    pool = DistPool(R, backend=backend, env={**ENV, **env})
    try:
        return pool.run(fn, *args, timeout=timeout)
    finally:
        pool.close()


def closing(pools: GpuPools):
    """A module-scoped autouse fixture that closes `pools` after the module's last test; pytest
    finds it under the name the module assigns it to."""

    @pytest.fixture(scope="module", autouse=True)
    def _close_pools():
        yield
        pools.close()

    return _close_pools
