// Device helpers shared by the NVSHMEM paths (low_latency.cu, internode.cu): system-scope
// flags, bounded waits that record what they waited on, signals to a peer (a store when it is
// load/store reachable, else an NVSHMEM signal op) and a warp copy. Include after nvshmem.h.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "../low_latency_layout.h"  // LowLatencyError: the mapped error record both paths fill
#include "../protocol.h"

namespace mep {
namespace sym {

__device__ __forceinline__ long long ld_acquire_sys(const long long* p) {
  long long v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Polling: relaxed loads, then one acquire fence once the word is seen (an acquire pattern in
// PTX's model), so many pollers do not each pay a system-scope acquire per poll.
__device__ __forceinline__ long long ld_relaxed_sys(const long long* p) {
  long long v;
  asm volatile("ld.relaxed.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void st_release_sys(long long* p, long long v) {
  asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Counters that several warps bump after their stores: the one that sees the final count has
// acquired every earlier bump (and, cumulatively, the stores before them) and signals for all.
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int warp_sum(int v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Where a path's waits report: the mapped record, two words of its local state: `failed` (a
// wait timed out or a peer failed: every later wait returns at once) and `claims` (records
// claimed so far), and `peer_failed`, the one word of that state other ranks write: (rank + 1)
// << 32 | call sequence number of a peer that failed before joining that call (publish_failure).
// `seq`: the call the waiting kernel serves (< 0: none; such waits ignore publications).
struct Waiter {
  LowLatencyError* err;
  int* failed;
  int* claims;
  unsigned long long timeout_ns;
  const long long* peer_failed;
  long long seq;
};
__host__ __device__ constexpr long long failure_word(int rank, long long seq) {
  return ((long long)(rank + 1) << 32) | (seq & 0xffffffffLL);
}

// The first error since the host's last clear wins (the host bumps `cleared` after reading).
static __device__ __noinline__ void report(const Waiter& w, int code, int op, int what, int expert, int peer, int set,
                                    long long sig, long long got) {
  if (code == kErrTimeout || code == kErrPeerFailed) atomicExch(w.failed, 1);
  const int cleared = w.err->cleared;
  if (atomicCAS(w.claims, cleared, cleared + 1) != cleared) return;
  w.err->op = op, w.err->what = what, w.err->expert = expert, w.err->peer = peer, w.err->set = set;
  w.err->sig_expected = sig, w.err->sig_got = got;
  __threadfence_system();
  w.err->code = code;
}

// Spin until done(load()) or report a timeout; `what`/expert/peer/set name the wait for the host.
template <typename Load, typename Done>
__device__ __forceinline__ bool spin(const Waiter& w, Load load, Done done, long long& v, int op, int what,
                                     int expert, int peer, int set, long long sig) {
  unsigned long long start = 0;
  for (unsigned i = 0;; ++i) {
    v = load();
    if (done(v)) return true;
    if ((i & 127) == 127) {
      if (*reinterpret_cast<volatile int*>(w.failed)) return false;
      // a peer published that it failed before joining this call: it will never signal, so stop
      // now, naming it (a publication for another call, e.g. one every rank failed, is ignored)
      const long long pf = *reinterpret_cast<const volatile long long*>(w.peer_failed);
      if (w.seq >= 0 && pf != 0 && (pf & 0xffffffffLL) == (w.seq & 0xffffffffLL)) {
        report(w, kErrPeerFailed, op, what, expert, (int)(pf >> 32) - 1, set, sig, v);
        return false;
      }
      const unsigned long long now = globaltimer();
      if (start == 0) {
        start = now;
      } else if (now - start > w.timeout_ns) {
        report(w, kErrTimeout, op, what, expert, peer, set, sig, v);
        return false;
      }
    }
  }
}

// A 64-bit word at byte offset `off` of a peer's symmetric buffer (after the caller's fence):
// a release store through `peer` when reachable, else an NVSHMEM signal op on PE `pe`. With
// `release` false a relaxed store: for a word that orders nothing (a zero count) or that follows
// the caller's own system fence (several words after one fence) -- each release store is a
// MEMBAR.ALL.SYS of its own in the SASS.
__device__ __forceinline__ void put_signal(char* peer, char* base, int pe, long long off, long long v,
                                           bool release = true) {
  if (peer != nullptr) {
    if (release)
      st_release_sys(reinterpret_cast<long long*>(peer + off), v);
    else
      asm volatile("st.relaxed.sys.global.s64 [%0], %1;" ::"l"(reinterpret_cast<long long*>(peer + off)), "l"(v)
                   : "memory");
  } else {
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(base + off), (uint64_t)v, NVSHMEM_SIGNAL_SET, pe);
  }
}

// One thread: tell the other n - 1 peers (index `self` is this rank) that this rank failed before
// joining call `seq`, through the peer_failed word at byte offset `off` of their buffers: their
// waits for that call stop and name `rank` (the group rank).
__device__ __forceinline__ void publish_failure(char* const* peer_base, char* base, const int* pe, int n, int self,
                                                long long off, int rank, long long seq) {
  for (int r = 0; r < n; ++r)
    if (r != self) put_signal(peer_base[r], base, pe[r], off, failure_word(rank, seq));
}

// Warp copy of n16 16-byte words, four loads in flight per lane.
__device__ __forceinline__ void warp_copy16(int4* dst, const int4* src, int n16) {
  const int lane = threadIdx.x & 31;
  int i = lane;
  for (; i + 96 < n16; i += 128) {
    int4 a = __ldcg(src + i), b = __ldcg(src + i + 32), d = __ldcg(src + i + 64), e = __ldcg(src + i + 96);
    dst[i] = a, dst[i + 32] = b, dst[i + 64] = d, dst[i + 96] = e;
  }
  for (; i < n16; i += 32) dst[i] = __ldcg(src + i);
}

// Warp copy with all of a lane's loads (up to kDepth words) issued before its stores: a 7 KB row
// in one memory round trip at depth 16 (a warp per row: latency, not bandwidth, bounds).
template <int kDepth>
__device__ __forceinline__ void warp_copy16_deep(int4* dst, const int4* src, int n16) {
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < n16; base += 32 * kDepth) {
    int4 v[kDepth];
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      const int j = base + i * 32 + lane;
      if (j < n16) v[i] = __ldcg(src + j);
    }
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      const int j = base + i * 32 + lane;
      if (j < n16) dst[j] = v[i];
    }
  }
}

}  // namespace sym
}  // namespace mep
