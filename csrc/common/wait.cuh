// The one bounded wait every transport's kernels run (the IPC handshake, ipc/handshake.cuh; the
// NVSHMEM paths, nvshmem/waits.cuh): poll a word until it is done, let the path end the wait
// early, and time out instead of hanging. What a stop or a timeout records, and where, is the
// path's own (each has its own error record); the loop, its check cadence and its clock are here.
#pragma once

#include "common/device.cuh"

namespace mep {
namespace wait {

enum Outcome : int {
  kArrived = 0,   // done(v) held
  kStopped = 1,   // stop(v) ended the wait (the path recorded why)
  kTimedOut = 2,  // timeout_ns passed since the first check without either
};

// Poll `load()` into `v` until `done(v)`. Every kCheckMask + 1 polls (kCheckMask: 2^k - 1) ask
// `stop(v)` and read the clock: a wait that finishes within its first polls never reads
// %globaltimer, and the clock starts at the first check.
template <unsigned kCheckMask, typename V, typename Load, typename Done, typename Stop>
__device__ __forceinline__ Outcome spin(Load load, Done done, Stop stop, unsigned long long timeout_ns, V& v) {
  static_assert((kCheckMask & (kCheckMask + 1)) == 0, "kCheckMask must be 2^k - 1");
  unsigned long long start = 0;
  for (unsigned i = 1;; ++i) {
    v = load();
    if (done(v)) return kArrived;
    if ((i & kCheckMask) == 0) {
      if (stop(v)) return kStopped;
      const unsigned long long now = globaltimer();
      if (start == 0)
        start = now;
      else if (now - start > timeout_ns)
        return kTimedOut;
    }
  }
}

// A wait with nothing to stop it but the clock.
struct NeverStop {
  template <typename V>
  __device__ __forceinline__ bool operator()(const V&) const { return false; }
};

}  // namespace wait
}  // namespace mep
