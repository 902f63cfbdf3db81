"""Kernel paths of the cuda backend, each on the shared runtime (megatron_ep/runtime.py) and each
one `.cu` file of csrc/kernels: `intranode` (one NVLink domain, normal path). The low-latency
and two-level internode paths will sit beside it."""
