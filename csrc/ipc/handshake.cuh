// The IPC runtime's device side (intranode kernels): the error record, signals and waits between
// the ranks' regions, the call exchange (records, verdict, aborts) and timeouts that report
// instead of hanging. The PTX primitives and copies are common/device.cuh's.
#pragma once

#include <cuda_runtime.h>

#include "common/device.cuh"
#include "common/wait.cuh"
#include "ipc/context.h"

namespace mep {

__device__ __forceinline__ Control* ctrl_of(const Ctx& c, int r) {
  return reinterpret_cast<Control*>(c.peers.base[r] + c.lay.control);
}
__device__ __forceinline__ char* region(const Ctx& c, int r) { return c.peers.base[r]; }
__device__ __forceinline__ CallRecord* record_of(const Ctx& c, int r) { return &ctrl_of(c, r)->call[c.seq & 1]; }


// ----------------------------------------------------------------------------- error record
// One record in the mapped host block holds the first error the host has not read yet. A
// kernel claims it (claims counted in the private control block, clears counted by the host),
// fills it, and publishes `error` last, so the host never reads a half-written record.
__device__ __forceinline__ bool claim_error(const Ctx& c) {
  Control* me = ctrl_of(c, c.rank);
  const int cleared = c.host->err_cleared;
  return atomicCAS(&me->err_claims, cleared, cleared + 1) == cleared;
}

__device__ __forceinline__ void publish_error(const Ctx& c, int code) {
  __threadfence_system();
  c.host->error = code;
  __threadfence_system();
}

// A wait that will never complete: record it and tell every rank to stop spinning.
static __device__ __noinline__ void report_failure(const Ctx& c, int code, int peer, int slot,
                                                   unsigned long long expected, unsigned long long observed) {
  if (claim_error(c)) {
    c.host->err_rank = c.rank;
    c.host->err_peer = peer;
    c.host->err_slot = slot;
    c.host->err_field = -1;
    c.host->err_seq = c.seq;
    c.host->err_expected = (long long)expected;
    c.host->err_observed = (long long)observed;
    publish_error(c, code);
  }
  if (code == kErrTimeout)
    for (int r = 0; r < c.num_ranks; ++r) atomicCAS(&ctrl_of(c, r)->abort, 0, c.rank + 1);
}

// Spin until signal[slot][peer] in this rank's control block reaches target (wait::spin).
// Returns false (after recording why) on timeout or when another rank aborted.
__device__ __forceinline__ bool wait_signal(const Ctx& c, int slot, int peer, unsigned long long target) {
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long* p = &me->signal[slot][peer];
  const auto aborted = [&](unsigned long long got) {
    const int ab = ld_volatile(&me->abort);
    if (ab) report_failure(c, kErrPeerAborted, ab - 1, slot, target, got);
    return ab != 0;
  };
  unsigned long long v;
  const wait::Outcome out = wait::spin<255>([&] { return ld_acquire_sys(p); },
                                            [&](unsigned long long x) { return x >= target; }, aborted, c.timeout_ns, v);
  if (out == wait::kTimedOut) report_failure(c, kErrTimeout, peer, slot, target, v);
  return out == wait::kArrived;
}

// Block-wide: threads 0..R-1 each wait on one source rank. All threads get the verdict.
__device__ __forceinline__ bool block_wait_all(const Ctx& c, int slot, unsigned long long target) {
  __shared__ int ok_all;
  if (threadIdx.x == 0) ok_all = 1;
  __syncthreads();
  if (threadIdx.x < c.num_ranks && !wait_signal(c, slot, threadIdx.x, target)) ok_all = 0;
  __syncthreads();
  return ok_all != 0;
}

// One thread: tell every rank (self included) that this rank passed `slot` once more.
__device__ __forceinline__ void signal_all(const Ctx& c, int slot) {
  __threadfence_system();
  for (int r = 0; r < c.num_ranks; ++r) add_release_sys(&ctrl_of(c, r)->signal[slot][c.rank], 1ull);
}

// Called by thread 0 of every block after the block's writes; true in the last block to finish.
__device__ __forceinline__ bool last_block_done(const Ctx& c, int counter) {
  __threadfence_system();
  Control* me = ctrl_of(c, c.rank);
  unsigned prev = atomicAdd(&me->grid_done[counter], 1u);
  if (prev + 1 == gridDim.x) {
    me->grid_done[counter] = 0;  // next launch of this kind starts from zero (stream order)
    __threadfence();
    return true;
  }
  return false;
}

// Every rank's own done signal on `done_slot`, then a wait for everybody's. Thread 0 of the last
// block of a kernel; true when the handshake completed (so the caller can record it).
__device__ __forceinline__ bool done_exchange(const Ctx& c, int done_slot) {
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long done = me->expected[done_slot] + 1;
  signal_all(c, done_slot);
  for (int s = 0; s < c.num_ranks; ++s)
    if (!wait_signal(c, done_slot, s, done)) return false;
  me->expected[done_slot] = done;
  return true;
}

// ------------------------------------------------------------------------------ call exchange
// The call this launch belongs to was aborted on this rank (hence on every rank) at an earlier
// exchange: later kernels of the call do nothing, so the ranks' handshake counters stay equal.
__device__ __forceinline__ bool call_aborted(const Ctx& c) {
  return ld_volatile(&ctrl_of(c, c.rank)->aborted_seq) == c.seq;
}

// One thread: write this rank's record for the call (signature, status, message).
__device__ __forceinline__ void write_record(const Ctx& c, const CallArgs& a) {
  CallRecord* rec = record_of(c, c.rank);
#pragma unroll
  for (int f = 0; f < kSigFields; ++f) rec->sig[f] = a.sig[f];
  const int n = a.msg_len < kMsgBytes ? a.msg_len : kMsgBytes;
  for (int i = 0; i < n; ++i) rec->msg[i] = a.msg[i];
  rec->msg_len = n;
  rec->status = a.status;
}

// Record an aborted call in the host block (block 0 of the kernel that found it, one thread).
static __device__ __noinline__ void record_abort(const Ctx& c, int slot, int failed_rank, int field,
                                                 const long long (*sig)[kSigFields]) {
  Control* me = ctrl_of(c, c.rank);
  const int n = ++me->aborted_calls;
  if (claim_error(c)) {
    c.host->err_rank = c.rank;
    c.host->err_peer = failed_rank;
    c.host->err_slot = slot;
    c.host->err_field = field;
    c.host->err_seq = c.seq;
    for (int r = 0; r < c.num_ranks; ++r) {
      c.host->err_values[r] = field >= 0 ? sig[r][field] : 0;
      c.host->err_ops[r] = sig[r][kSigOp];
    }
    int len = 0;
    if (failed_rank >= 0) {
      const CallRecord* rec = record_of(c, failed_rank);
      len = ld_volatile(&rec->msg_len);
      len = len < 0 ? 0 : (len > kMsgBytes ? kMsgBytes : len);
      for (int i = 0; i < len; ++i) c.host->err_msg[i] = *reinterpret_cast<const volatile char*>(&rec->msg[i]);
    }
    c.host->err_msg_len = len;
    publish_error(c, failed_rank >= 0 ? kErrPeerFailed : kErrMismatch);
  }
  c.host->num_aborted = n;
}

// Block-wide wait for every rank's signal on `slot` (target), then the verdict on this call's
// records: with `full`, every signature field must be equal on every rank (the first exchange of
// a call); always, no rank may have published a failure. Returns 1 to proceed, 0 when the call is
// aborted (on every rank alike: they all read the same records), -1 on a fatal timeout. Every
// thread gets the same answer; block 0 records an abort for the host.
__device__ __forceinline__ int block_wait_call(const Ctx& c, int slot, unsigned long long target, bool full) {
  __shared__ int s_state;
  __shared__ long long s_sig[kMaxRanks][kSigFields];
  __shared__ int s_status[kMaxRanks];
  const int R = c.num_ranks;
  if (threadIdx.x == 0) s_state = 1;
  __syncthreads();
  if (threadIdx.x < R && !wait_signal(c, slot, threadIdx.x, target)) s_state = -1;
  __syncthreads();
  if (s_state < 0) return -1;
  for (int i = threadIdx.x; i < R * kSigFields; i += blockDim.x) {
    const int r = i / kSigFields, f = i - r * kSigFields;
    s_sig[r][f] = ld_volatile(&record_of(c, r)->sig[f]);
  }
  if (threadIdx.x < R) s_status[threadIdx.x] = ld_volatile(&record_of(c, threadIdx.x)->status);
  __syncthreads();
  if (threadIdx.x == 0) {
    int failed = -1, field = -1;
    for (int r = 0; r < R && failed < 0; ++r)
      if (s_status[r] != kCallOk) failed = r;
    if (full && failed < 0)
      for (int f = 0; f < kSigFields && field < 0; ++f)
        for (int r = 1; r < R; ++r)
          if (s_sig[r][f] != s_sig[0][f]) {
            field = f;
            break;
          }
    if (failed >= 0 || field >= 0) {
      s_state = 0;
      reinterpret_cast<volatile long long*>(&ctrl_of(c, c.rank)->aborted_seq)[0] = c.seq;
      if (blockIdx.x == 0) record_abort(c, slot, failed, field, s_sig);
    }
  }
  __syncthreads();
  return s_state;
}


}  // namespace mep
