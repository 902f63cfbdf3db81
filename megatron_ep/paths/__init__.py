"""Kernel paths of the cuda backend, each on the shared runtime (megatron_ep/runtime.py) and each
one `.cu` file of csrc/kernels: `intranode` (one NVLink domain, normal path) and `low_latency`
(decode; NVSHMEM, its own extension `_C_ll`). The two-level internode path will sit beside them."""
