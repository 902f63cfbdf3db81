#include "ipc/region.h"

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>

namespace mep {

Region::Region(int device, long long bytes) : device_(device), bytes_(bytes) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  check_cuda(cudaMalloc(&base_, bytes), "cudaMalloc of the communication region");
  // zeroed control block: every handshake counter starts at 0 on every rank
  check_cuda(cudaMemset(base_, 0, bytes), "cudaMemset of the communication region");
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(HostInfo), cudaHostAllocMapped), "cudaHostAlloc");
  std::memset(static_cast<void*>(host_), 0, sizeof(HostInfo));
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev_), host_, 0), "cudaHostGetDevicePointer");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

Region::~Region() {
  try {
    close_peers();
  } catch (...) {
  }
  if (base_ == nullptr) return;
  cudaSetDevice(device_);
  cudaDeviceSynchronize();  // no kernel of ours still uses it
  cudaFree(base_);
  base_ = nullptr;
  if (host_ != nullptr) cudaFreeHost(host_);
  host_ = nullptr;
  host_dev_ = nullptr;
}

std::string Region::ipc_handle() const {
  cudaIpcMemHandle_t h;
  check_cuda(cudaIpcGetMemHandle(&h, base_), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void Region::open_peers(const std::vector<std::string>& handles, int rank) {
  if ((int)handles.size() > kMaxRanks) throw std::runtime_error("megatron_ep: more ranks than kMaxRanks in one region group");
  check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  for (int r = 0; r < (int)handles.size(); ++r) {
    if (r == rank) {
      peers_.base[r] = base_;
      continue;
    }
    if (handles[r].size() != sizeof(cudaIpcMemHandle_t)) throw std::runtime_error("megatron_ep: malformed IPC handle");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[r].data(), sizeof(h));
    void* ptr = nullptr;
    check_cuda(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle of a peer region");
    peers_.base[r] = static_cast<char*>(ptr);
    opened_.push_back(static_cast<char*>(ptr));
  }
  peers_open_ = true;
}

void Region::close_peers() {
  if (!peers_open_) return;
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  for (char* p : opened_) cudaIpcCloseMemHandle(p);
  opened_.clear();
  std::memset(&peers_, 0, sizeof(peers_));
  peers_open_ = false;
}

}  // namespace mep
