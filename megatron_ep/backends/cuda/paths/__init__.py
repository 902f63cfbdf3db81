"""Kernel paths of the cuda backend, each on the shared runtime (megatron_ep/backends/cuda/runtime.py) and each
with its folder of csrc/ (csrc/README.md): `intranode` (one NVLink domain, normal path; module
`_C`), `low_latency` (decode; NVSHMEM, module `_C_nvshmem`), and `internode` (two levels: an RDMA
domain over NVSHMEM in `_C_nvshmem`, then the intranode path inside each node). `interface` is what the backend
calls on a path; `nvshmem_path` the base of the two NVSHMEM paths (their buffer, errors and
failure publication)."""
