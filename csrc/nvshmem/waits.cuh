// Device helpers shared by the NVSHMEM paths (internode, low-latency): bounded waits that record
// what they waited on, signals to a peer (a store when it is load/store reachable, else an
// NVSHMEM signal op) and the failure publication. Include after nvshmem.h.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem/common.h"  // SymmetricError: the mapped error record both paths fill
#include "common/device.cuh"
#include "common/wait.cuh"
#include "common/protocol.h"

namespace mep {
namespace sym {


// Where a path's waits report: the mapped record, two words of its local state: `failed` (a
// wait timed out or a peer failed: every later wait returns at once) and `claims` (records
// claimed so far), and `peer_failed`, the one word of that state other ranks write: (rank + 1)
// << 32 | call sequence number of a peer that failed before joining that call (publish_failure).
// `seq`: the call the waiting kernel serves (< 0: none; such waits ignore publications).
// `mask` (low-latency rank mask; null: none): a wait on a masked peer stops, and a wait that
// times out, or whose peer published a failure, masks that peer instead of reporting; the
// caller tells a masked peer from a failure by reading the mask.
struct Waiter {
  SymmetricError* err;
  int* failed;
  int* claims;
  unsigned long long timeout_ns;
  const long long* peer_failed;
  long long seq;
  int* mask = nullptr;
};
__host__ __device__ constexpr long long failure_word(int rank, long long seq) {
  return ((long long)(rank + 1) << 32) | (seq & 0xffffffffLL);
}

// What a wait names when it reports (SymmetricError's fields): the call's op, which wait (a
// path's wait code), the expert (or node), the peer rank it waited for, the buffer set (or
// direction), and the call's signature.
struct WaitSite {
  int op, what, expert, peer, set;
  long long sig;
};

// The first error since the host's last clear wins (the host bumps `cleared` after reading).
// `got`: the value the wait saw (a signature, for a mismatch).
static __device__ __noinline__ void report(const Waiter& w, int code, const WaitSite& at, long long got) {
  if (code == kErrTimeout || code == kErrPeerFailed) atomicExch(w.failed, 1);
  const int cleared = w.err->cleared;
  if (atomicCAS(w.claims, cleared, cleared + 1) != cleared) return;
  w.err->op = at.op, w.err->what = at.what, w.err->expert = at.expert, w.err->peer = at.peer, w.err->set = at.set;
  w.err->sig_expected = at.sig, w.err->sig_got = got;
  __threadfence_system();
  w.err->code = code;
}

// wait::spin over a path's word (common/wait.cuh): it stops early on this call's failure flag, on
// a masked peer, or on a peer's published failure (named in the report); a timeout reports, or
// under the rank mask masks the peer. `at` names the wait for the host.
template <typename Load, typename Done>
__device__ __forceinline__ bool spin(const Waiter& w, Load load, Done done, long long& v, const WaitSite& at) {
  const auto stop = [&](long long got) {
    if (w.mask != nullptr && at.peer >= 0 && *reinterpret_cast<volatile int*>(w.mask + at.peer)) return true;
    if (*reinterpret_cast<volatile int*>(w.failed)) return true;
    // a peer published that it failed before joining this call: it will never signal, so stop
    // now, naming it (a publication for another call, e.g. one every rank failed, is ignored)
    const long long pf = *reinterpret_cast<const volatile long long*>(w.peer_failed);
    if (w.seq < 0 || pf == 0 || (pf & 0xffffffffLL) != (w.seq & 0xffffffffLL)) return false;
    if (w.mask != nullptr) {  // masked from now on; this wait goes on unless it was that peer's
      atomicExch(w.mask + (int)(pf >> 32) - 1, 1);
      return false;
    }
    WaitSite named = at;  // the wait, naming the peer that published
    named.peer = (int)(pf >> 32) - 1;
    report(w, kErrPeerFailed, named, got);
    return true;
  };
  const wait::Outcome out = wait::spin<127>(load, done, stop, w.timeout_ns, v);
  if (out != wait::kTimedOut) return out == wait::kArrived;
  if (w.mask != nullptr && at.peer >= 0)
    atomicExch(w.mask + at.peer, 1);
  else
    report(w, kErrTimeout, at, v);
  return false;
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


}  // namespace sym
}  // namespace mep
