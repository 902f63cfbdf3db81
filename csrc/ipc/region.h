// The communication region of one rank: device memory shared with the peers of the group by
// CUDA IPC handles (works for several processes on one GPU too), plus the mapped pinned host
// block through which kernels report receive counts and errors. No torch here.
//
// Lifetime: the peers' mappings are closed collectively (close_peers, after the group agreed
// nobody reads any more); this rank's own memory is freed only when the last owner lets go --
// the runtime, and every tensor over region memory (pooled outputs, zero-copy views).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "ipc/context.h"
#include "common/cuda_check.h"

namespace mep {

class Region {
 public:
  Region(int device, long long bytes);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  std::string ipc_handle() const;  // this region's cudaIpcMemHandle_t, as bytes
  void open_peers(const std::vector<std::string>& handles, int rank);
  void close_peers();  // unmap the peers' regions (idempotent); own memory stays

  char* base() const { return base_; }
  long long bytes() const { return bytes_; }
  const Peers& peers() const { return peers_; }
  bool peers_open() const { return peers_open_; }
  HostInfo* host() const { return host_; }
  HostInfo* host_device() const { return host_dev_; }
  int device() const { return device_; }

 private:
  int device_ = -1;
  long long bytes_ = 0;
  char* base_ = nullptr;
  HostInfo* host_ = nullptr;
  HostInfo* host_dev_ = nullptr;
  Peers peers_{};
  bool peers_open_ = false;
  std::vector<char*> opened_;
};

}  // namespace mep
