// A first-fit allocator over a section of the communication region. Dispatch outputs allocated
// here are ordinary tensors for the caller, but peers can write into them directly (push). A
// block returns to the pool when its last tensor dies: events recorded on the stream it was
// allocated for and on the stream current where it died mark when the memory is really free
// (torch's record_stream does not reach this pool: a consumer on another stream, e.g. the expert
// GEMMs under Megatron's EP overlap, is covered by the stream it frees the tensor on), and the
// pool only hands out ranges whose events have completed. When nothing else fits, the oldest
// pending ranges are taken over: the `order` stream (the one whose kernels write the block
// first) waits for their events on the GPU, never the host (a loop of dispatches keeps the host
// ahead).
#pragma once

#include <cuda_runtime.h>

#include <deque>
#include <map>
#include <mutex>
#include <vector>

namespace mep {

class Pool {
 public:
  static constexpr long long kAlign = 256;
  // What a request of `bytes` occupies: whole kAlign units, at least one.
  static long long block_bytes(long long bytes) {
    return bytes <= 0 ? kAlign : (bytes + kAlign - 1) / kAlign * kAlign;
  }
  Pool(int device, long long begin, long long bytes);
  ~Pool();
  // Offset in the region, or -1. `order` may be the legacy default stream (nullptr itself).
  long long alloc(long long bytes, cudaStream_t order);
  // `also` (when given and not `stream`): a second stream whose work so far must end before the
  // range is reused
  void release(long long offset, long long bytes, cudaStream_t stream, const cudaStream_t* also = nullptr);
  // A range whose every use ran on the communication stream, as every later use will: free now
  // (stream order alone keeps the next user behind the last one; no event, no host wait later).
  void release_now(long long offset, long long bytes);
  long long free_bytes();
  // Allocations so far that took over pending ranges (a GPU-side wait), and that found no room
  // at all (the caller then stages and pulls).
  struct Stats {
    long long stream_waits = 0, misses = 0;
  };
  Stats stats();

 private:
  struct Pending {
    long long off, size;
    cudaEvent_t ev;
    cudaEvent_t ev2;  // on the second stream, or nullptr
  };
  bool done(const Pending& p);  // both events completed
  cudaEvent_t event();          // a spare event, or a new one (nullptr when none can be created)
  void reap();  // every pending range whose events completed back to the free list
  void free_oldest();  // the oldest pending range back to the free list, its event to the spares
  long long take(long long bytes);
  void insert_free(long long off, long long size);

  int device_;
  std::mutex mu_;
  std::map<long long, long long> free_;  // offset -> size, coalesced
  std::deque<Pending> pending_;          // freed by the host, maybe still in use on the device
  std::vector<cudaEvent_t> spare_events_;
  Stats stats_;
};

}  // namespace mep
