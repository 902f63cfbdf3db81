// NVSHMEM set-up for every NVSHMEM path (low-latency now, internode later), once per process:
// unique-id bootstrap, the symmetric heap, peer addresses. Host code, compiled by nvcc into the
// same relocatable-device-code module as the kernels: nvshmemx_init_attr (inline in NVSHMEM's
// headers) initialises the device state of the module it is compiled into.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "nvshmem/bootstrap.h"

namespace mep {
namespace {

void check(cudaError_t e, const char* what) { check_cuda(e, what, "NVSHMEM set-up"); }

}  // namespace

std::string sym_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) throw std::runtime_error("megatron_ep: nvshmemx_get_uniqueid failed");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void sym_init(const std::string& uid, int rank, int nranks, int device) {
  if (uid.size() != sizeof(nvshmemx_uniqueid_t)) throw std::runtime_error("megatron_ep: bad NVSHMEM unique id size");
  check(cudaSetDevice(device), "cudaSetDevice");
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr) != 0)
    throw std::runtime_error("megatron_ep: nvshmemx_set_attr_uniqueid_args failed");
  nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);  // exits the process on failure (NVSHMEM's choice)
}

int sym_my_pe() { return nvshmem_my_pe(); }
int sym_n_pes() { return nvshmem_n_pes(); }

void* sym_malloc(size_t bytes) {
  void* p = nvshmem_malloc(bytes);
  if (p == nullptr)
    throw std::runtime_error("megatron_ep: nvshmem_malloc(" + std::to_string(bytes) +
                             ") failed: the symmetric heap (NVSHMEM_SYMMETRIC_SIZE) is too small");
  check(cudaMemset(p, 0, bytes), "zeroing the low-latency buffer");
  check(cudaDeviceSynchronize(), "zeroing the low-latency buffer");
  nvshmem_barrier_all();  // nobody signals into a peer's buffer before the peer zeroed it
  return p;
}

void sym_free(void* ptr) {
  check(cudaDeviceSynchronize(), "freeing the low-latency buffer");
  nvshmem_free(ptr);
}

void* sym_peer_ptr(void* sym, int pe) { return nvshmem_ptr(sym, pe); }

}  // namespace mep
