"""megatron_ep's cuda backend: the Buffer backend (backend.py) over one runtime (runtime.py: the
CUDA-IPC region, streams, the failure model of every path) and its kernel paths (paths/:
intranode, two-level internode, low-latency), with what they share: the compiled extensions'
loading (extension.py), NVSHMEM's initialisation (nvshmem.py), the hosts of a group (hosts.py)
and the failure state a path publishes (failure_state.py). The package root holds what is
backend-neutral (API, checks, reference backend, permute, experts, Megatron integration);
importing this package loads nothing of CUDA.
"""
