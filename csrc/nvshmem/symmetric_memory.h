// One rank's NVSHMEM symmetric buffer as an NVSHMEM path's binding holds it (LowLatencyBuffer,
// InternodeBuffer): the collective allocation, the device tables the kernels read (each peer's
// load/store address and PE), the mapped host error record they write, and its reading and
// clearing. The paths differ only in which peers they list and what they call the record's
// fields.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "nvshmem/common.h"  // SymmetricError, the record both paths' kernels write
#include "nvshmem/bootstrap.h"
#include "common/tensor_args.h"

namespace mep {

class SymmetricMemory {
 public:
  // `path` names the path in error messages ("low-latency", "internode").
  explicit SymmetricMemory(const char* path) : path_(path) {}
  SymmetricMemory(const SymmetricMemory&) = delete;
  SymmetricMemory& operator=(const SymmetricMemory&) = delete;
  ~SymmetricMemory() { release_local(); }  // not the symmetric buffer: freeing it is collective (close)

  // Collective over every PE: `bytes` of symmetric memory (zeroed) and the tables for `pes`, the
  // PE of each peer in the path's order. p2p() says which peers are load/store reachable; with
  // `stores` false the kernels see no address at all (every transfer is a put).
  void open(size_t bytes, const std::vector<int>& pes, bool stores) {
    const int n = (int)pes.size();
    base_ = static_cast<char*>(sym_malloc(bytes));
    std::vector<char*> peers(n);
    p2p_.resize(n);
    for (int r = 0; r < n; ++r) {
      peers[r] = static_cast<char*>(sym_peer_ptr(base_, pes[r]));
      p2p_[r] = peers[r] != nullptr;
      if (!stores) peers[r] = nullptr;
    }
    cuda_ok(cudaMalloc(&peer_dev_, n * sizeof(char*)), path_, "cudaMalloc");
    cuda_ok(cudaMalloc(&pe_dev_, n * sizeof(int)), path_, "cudaMalloc");
    cuda_ok(cudaMemcpy(peer_dev_, peers.data(), n * sizeof(char*), cudaMemcpyHostToDevice), path_, "cudaMemcpy");
    cuda_ok(cudaMemcpy(pe_dev_, pes.data(), n * sizeof(int), cudaMemcpyHostToDevice), path_, "cudaMemcpy");
    cuda_ok(cudaHostAlloc(&err_host_, sizeof(SymmetricError), cudaHostAllocMapped), path_, "cudaHostAlloc");
    std::memset((void*)err_host_, 0, sizeof(SymmetricError));
    cuda_ok(cudaHostGetDevicePointer((void**)&err_dev_, (void*)err_host_, 0), path_, "cudaHostGetDevicePointer");
  }

  // Fills the fields every path's kernel context shares (LLCtx, InternodeCtx).
  template <typename Ctx>
  void point(Ctx& c) const {
    c.base = base_, c.peer_base = peer_dev_, c.pe = pe_dev_, c.err = err_dev_;
  }

  // A failure publication (`launch(stream)`, a one-thread kernel writing the peers' peer_failed
  // word) on a stream of its own -- this rank's queued work may itself wait on peers -- and
  // completed on return.
  template <typename Launch>
  void publish_aside(Launch launch) const {
    live();
    const c10::cuda::CUDAStream s = c10::cuda::getStreamFromPool(true, c10::cuda::current_device());
    launch(s.stream());
    cuda_ok(cudaStreamSynchronize(s.stream()), path_, "publishing a failure");
  }

  char* base() const { return base_; }
  const std::vector<bool>& p2p() const { return p2p_; }
  void live() const { TORCH_CHECK(base_ != nullptr, "megatron_ep: this ", path_, " buffer was closed"); }

  // The kernels' first unread error, or None. The record's `expert` and `set` fields carry what
  // the path calls `expert_key` and `set_key`.
  py::object error(const char* expert_key, const char* set_key) const {
    if (err_host_ == nullptr || err_host_->code == 0) return py::none();
    py::dict d;
    d["code"] = (int)err_host_->code, d["op"] = (int)err_host_->op, d["what"] = (int)err_host_->what;
    d[expert_key] = (int)err_host_->expert, d["peer"] = (int)err_host_->peer, d[set_key] = (int)err_host_->set;
    d["sig_expected"] = (long long)err_host_->sig_expected, d["sig_got"] = (long long)err_host_->sig_got;
    return d;
  }
  // The address of the record's code (0 when there is none): the host reads that word before
  // each call without crossing into C++, and calls error() only where it is set.
  long long error_address() const {
    return err_host_ == nullptr ? 0 : reinterpret_cast<long long>(&err_host_->code);
  }
  void clear_error() {
    if (err_host_ == nullptr) return;
    err_host_->code = 0;
    err_host_->cleared = err_host_->cleared + 1;  // lets the kernels claim the record again
  }

  // Collective (nvshmem_free).
  void close() {
    if (base_ == nullptr) return;
    sym_free(base_);
    base_ = nullptr;
    release_local();
  }

 private:
  void release_local() {
    if (peer_dev_ != nullptr) cudaFree(peer_dev_);
    if (pe_dev_ != nullptr) cudaFree(pe_dev_);
    if (err_host_ != nullptr) cudaFreeHost((void*)err_host_);
    peer_dev_ = nullptr, pe_dev_ = nullptr, err_host_ = nullptr, err_dev_ = nullptr;
  }

  const char* path_;
  char* base_ = nullptr;
  char** peer_dev_ = nullptr;
  int* pe_dev_ = nullptr;
  SymmetricError* err_host_ = nullptr;
  SymmetricError* err_dev_ = nullptr;  // the device's view of err_host_
  std::vector<bool> p2p_;
};

}  // namespace mep
