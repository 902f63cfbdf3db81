"""Worker pools for the GPU tests: R processes on the visible GPU(s) (virtual ranks when there
is one GPU; run them under MPS, see scripts/gpu_check.sh), kept for a test module's lifetime."""

from distpool import DistPool

# Outputs poisoned before every kernel, short handshake timeouts, eager module loading (a lazily
# loaded kernel can wait behind a peer's spinning one), NVLink multicast off.
ENV = {"MEP_TEST_CUDA": "1", "MEP_POISON": "1", "MEP_TIMEOUT_S": "30", "CUDA_MODULE_LOADING": "EAGER",
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
