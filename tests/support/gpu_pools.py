"""Worker pools for the GPU tests: R processes on the visible GPU(s) (virtual ranks when there
is one GPU; run them under MPS, see scripts/gate/gpu_check.sh), kept for a test module's lifetime.
A GPU test module takes its marks and its pools' closing from here:

    pytestmark = GPU_MARKS
    POOLS = GpuPools(...)
    _close_pools = closing(POOLS)

Pools start ahead: when a module's first test starts, the pools its selected tests will use start
too (each rank's start -- torch, the control group, the CUDA context with every kernel loaded -- is
most of a small test's time), so they come up together and beside the tests that run first: the
default-environment pool of every `R` a selected test is parametrized with, and what `ahead` names
per test (`Shared`: a pool of the module's with other environment values; `Alone`: a fresh pool for
`run_alone`). MEP_TEST_POOLS_AHEAD=0 starts each pool at its first use instead.
"""

import os

import pytest
import torch

import megatron_ep
from distpool import DistPool

def gate_subset(selected: list) -> list:
    """The cases MEP_CASES names (a comma list of indices into `selected`: the gate's sanitizer
    runs take one case), or all of them."""
    picks = os.environ.get("MEP_CASES")
    return [selected[int(i)] for i in picks.split(",")] if picks else selected


# What a GPU test module needs to run: the `gpu` mark (-m gpu selects them) and a skip elsewhere.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and megatron_ep.cuda_backend_available()),
                       reason="needs a CUDA GPU and the built extension"),
]

# Outputs poisoned before every kernel, short handshake timeouts (MEGATRON_EP_TIMEOUT_S from the
# environment when set: the gate's sanitizer runs are several times slower), eager module loading
# under MPS (one context for every rank: a kernel loaded lazily can wait behind a peer's spinning
# one), NVLink multicast off. Without MPS each rank has its own context, so the gate's sanitizer
# runs set MEP_TEST_MODULE_LOADING=LAZY: the tools then instrument only the kernels that run.
ENV = {"MEP_TEST_CUDA": "1", "MEP_POISON": "1", "MEGATRON_EP_TIMEOUT_S": os.environ.get("MEGATRON_EP_TIMEOUT_S", "30"),
       "CUDA_MODULE_LOADING": os.environ.get("MEP_TEST_MODULE_LOADING", "EAGER"),
       "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def _key(R: int, backend: str, env: dict) -> tuple:
    return (R, backend, tuple(sorted(env.items())))


# fresh pools started ahead for run_alone, by their key; each serves one run_alone call
_SPARES: dict = {}


class Shared:
    """A pool of the module's (GpuPools.get) with these extra environment values, started ahead."""

    def __init__(self, R: int, backend: str = "gloo", **env):
        self.R, self.backend, self.env = R, backend, env

    def start(self, pools: "GpuPools") -> None:
        pools.get(self.R, self.backend, **self.env)


class Alone:
    """A fresh pool for one run_alone(R, ..., backend, **env) call, started ahead."""

    def __init__(self, R: int, backend: str = "gloo", **env):
        self.R, self.backend, self.env = R, backend, {**ENV, **env}

    def start(self, pools: "GpuPools") -> None:
        pool = DistPool(self.R, backend=self.backend, env=self.env)
        _SPARES.setdefault(_key(self.R, self.backend, self.env), []).append(pool)
        pools.spares.append(pool)


class GpuPools:
    def __init__(self, ahead: dict | None = None, **env):
        """ahead: test function name -> [Shared or Alone] pools to start when the module's first
        test starts (module docstring); env: extra environment values of every pool."""
        self.env = {**ENV, **env}
        self.ahead = dict(ahead or {})
        self._pools = {}
        self.spares = []  # the Alone pools started for this module (closed with it if unused)

    def get(self, R: int, backend: str = "gloo", **env) -> DistPool:
        """A live pool of R ranks with this control backend and these extra environment values
        (its ranks start in the background; the first run waits for them)."""
        key = _key(R, backend, env)
        if key not in self._pools or self._pools[key].broken:
            self._pools[key] = DistPool(R, backend=backend, env={**self.env, **env})
        return self._pools[key]

    def start_ahead(self, selected: list) -> None:
        """Start the pools of the selected tests, [(function name, parameters)], in their order."""
        for name, params in selected:
            if "R" in params:
                self.get(params["R"])
            for spec in self.ahead.get(name, ()):
                spec.start(self)

    def close(self) -> None:
        for p in list(self._pools.values()) + self.spares:
            p.close()
        self._pools.clear()
        for key, spares in list(_SPARES.items()):
            _SPARES[key] = [p for p in spares if p not in self.spares]
        self.spares.clear()


def run_alone(R: int, fn, *args, timeout: float, backend: str = "gloo", **env) -> list:
    """fn's per-rank results on a pool of its own, closed after (a test whose environment, e.g. a
    short timeout, no other test may share, or which may leave its pool broken): one started
    ahead for this call (Alone) when there is one, else a new one."""
    full = {**ENV, **env}
    spares = _SPARES.get(_key(R, backend, full), [])
    pool = spares.pop(0) if spares else DistPool(R, backend=backend, env=full)
    try:
        return pool.run(fn, *args, timeout=timeout)
    finally:
        pool.close()


def closing(pools: GpuPools):
    """A module-scoped autouse fixture that starts the module's pools ahead (module docstring) and
    closes them after its last test; pytest finds it under the name the module assigns it to."""

    @pytest.fixture(scope="module", autouse=True)
    def _close_pools(request):
        if os.environ.get("MEP_TEST_POOLS_AHEAD", "1") == "1":
            mine = [item for item in request.session.items if item.module is request.module]
            pools.start_ahead([(item.originalname, dict(getattr(getattr(item, "callspec", None), "params", {})))
                               for item in mine])
        yield
        pools.close()

    return _close_pools
