// What the low-latency kernel files (dispatch.cu, combine.cu) share: the path's state, its
// waits (timeouts and peer failures recorded in the mapped error record), signals and row sends
// to a peer (a store when load/store reachable, else an NVSHMEM put), the send counters, the
// buffer-set release and the receive half's epilogue. The kernels live in the named namespace
// mep::low_latency so profilers show them as such. Include after nvshmem.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/cuda_check.h"
#include "common/protocol.h"
#include "low_latency/api.h"
#include "nvshmem/waits.cuh"

namespace mep {
namespace low_latency {


constexpr int kLLScaleRegs = 2;  // a lane's FP8 scales held in registers during a row's copy-out (H <= 8192)

__device__ __forceinline__ LowLatencyState* state_of(const LLCtx& c) {
  return reinterpret_cast<LowLatencyState*>(c.base + c.lay.state);
}
// Whether the rank mask is on. kS: -1 reads c.shrink at run time; a kernel instantiated per mode
// passes 0 or 1 to every helper below that takes it, and their mask tests fold away in the plain
// mode (the combine's registers: the mask's run-time tests alone pushed it into spills).
template <int kS = -1>
__device__ __forceinline__ bool shrink_on(const LLCtx& c) { return kS < 0 ? c.shrink != 0 : kS != 0; }

template <int kS = -1>
__device__ __forceinline__ sym::Waiter waiter(const LLCtx& c) {
  LowLatencyState* st = state_of(c);
  return {c.err, &st->failed, &st->err_claims, c.timeout_ns, &st->peer_failed, c.seq, shrink_on<kS>(c) ? st->mask : nullptr};
}

// The rank mask as this block saw it last (`take_mask`): bit r set = rank r masked (0 without
// the mask). In shared memory, not a register: the kernels are at their register limit.
static __shared__ unsigned long long s_ll_mask;  // (static: one per file, -rdc links the files)

// Block-wide (a barrier on each side): the mask snapshot the kernel's decisions about whom it
// sends to or waits for use, so all warps of a block agree; all blocks agree too, since the mask
// only grows inside a kernel by a timed-out wait, and each snapshot is taken where every block
// has passed the same waits (kernel entry, after the release waits).
template <int kS = -1>
__device__ __forceinline__ void take_mask(const LLCtx& c) {
  if (kS == 0) return;  // gone<0> is false
  __syncthreads();
  if (threadIdx.x < 32) {
    unsigned long long bits = 0;
    if (shrink_on<kS>(c)) {
      const int* m = state_of(c)->mask;
      for (int r = threadIdx.x; r < c.num_ranks; r += 32) bits |= (unsigned long long)(ld_volatile(m + r) != 0) << r;
      for (int o = 16; o; o >>= 1) bits |= __shfl_xor_sync(0xffffffffu, bits, o);
    }
    if (threadIdx.x == 0) s_ll_mask = bits;
  }
  __syncthreads();
}
template <int kS = -1>
__device__ __forceinline__ bool gone(int r) { return kS != 0 && ((s_ll_mask >> r) & 1ull); }
// Bit r set: rank r masked now. One thread: its R loads are issued together (predicated, unrolled),
// one round trip instead of one per rank. Not inlined: the kernels are at their register limit.
static __device__ __noinline__ unsigned long long mask_bits_now(const int* mask, int num_ranks) {
  int v[kLLMaxRanks];
#pragma unroll
  for (int r = 0; r < kLLMaxRanks; ++r) v[r] = r < num_ranks ? ld_volatile(mask + r) : 0;
  unsigned long long bits = 0;
#pragma unroll
  for (int r = 0; r < kLLMaxRanks; ++r) bits |= (unsigned long long)(v[r] != 0) << r;
  return bits;
}
// Rank r is masked now (a wait on it may have just masked it).
template <int kS = -1>
__device__ __forceinline__ bool masked_now(const LLCtx& c, int r) {
  return shrink_on<kS>(c) && ld_volatile(state_of(c)->mask + r) != 0;
}

// A trace stamp (LLTracePoint) when the buffer has a trace attached: thread 0's time, or with
// `warps` the latest of the block's warps (each warp's lane 0).
__device__ __forceinline__ void stamp(const LLCtx& c, int kernel, int point, bool warps = false) {
  if (c.trace == nullptr) return;
  unsigned long long* p = c.trace + ((long long)kernel * kLLMaxBlocks + blockIdx.x) * kLLTracePoints + point;
  if (warps ? (threadIdx.x & 31) == 0 : threadIdx.x == 0) atomicMax(p, globaltimer());
}

// Signal words: -1 - (count | sig << 32). Never 0, so "0 tokens" differs from "not arrived".
__device__ __forceinline__ long long encode(int count, long long sig) { return -1 - ((sig << 32) | (unsigned)count); }
__device__ __forceinline__ int decoded_count(long long v) { return (int)(unsigned)((unsigned long long)(-1 - v)); }
__device__ __forceinline__ long long decoded_sig(long long v) { return (long long)((unsigned long long)(-1 - v) >> 32); }

using sym::WaitSite;
__device__ __forceinline__ void report(const LLCtx& c, int code, const WaitSite& at, long long got) {
  sym::report(waiter(c), code, at, got);
}
template <int kS = -1, typename Load, typename Done>
__device__ __forceinline__ bool spin(const LLCtx& c, Load load, Done done, long long& v, const WaitSite& at) {
  return sym::spin(waiter<kS>(c), load, done, v, at);
}

// Wait until done(*p), p a signal word another rank writes (relaxed polls, one acquire after).
template <int kS = -1, typename Done>
__device__ __forceinline__ bool wait_word(const LLCtx& c, const long long* p, Done done, long long& v,
                                          const WaitSite& at) {
  const bool ok = spin<kS>(c, [&] { return ld_relaxed_sys(p); }, done, v, at);
  // one acquire load of the word once seen (it only moves forward until this rank clears it):
  // cheaper than a system fence, which also drains this thread's outstanding stores
  if (ok) v = ld_acquire_sys(p);
  return ok;
}

// wait_word on a word rank `at.peer` writes; under the rank mask a masked peer ends the wait too:
// true when the word arrived (`is_gone` false) or the peer is masked (`is_gone` true; nothing of
// it is used), false on a failure (reported).
template <int kS = -1, typename Done>
__device__ __forceinline__ bool wait_peer(const LLCtx& c, const long long* p, Done done, long long& v, bool& is_gone,
                                          const WaitSite& at) {
  is_gone = false;
  if (wait_word<kS>(c, p, done, v, at)) return true;
  is_gone = masked_now<kS>(c, at.peer);
  return is_gone;
}

// Write a 64-bit signal word at `off` in rank dst's buffer (after the caller's fence; see
// sym::put_signal for `release`).
__device__ __forceinline__ void put_signal(const LLCtx& c, int dst, long long off, long long v, bool release = true) {
  sym::put_signal(c.peer_base[dst], c.base, c.pe[dst], off, v, release);
}

// A row `bytes` long from this rank to rank dst at byte offset `off` of its buffer: stores when
// reachable, else a put from `stage` (symmetric) completed before returning. No fence here: the
// warp that signals for a group of rows acquires every sender's counter bump first (see
// `count_sent`), and its release covers their stores.
__device__ __forceinline__ void send_row(const LLCtx& c, int dst, long long off, const char* stage, int bytes) {
  const int lane = threadIdx.x & 31;
  char* peer = c.peer_base[dst];
  if (peer != nullptr) {
    warp_copy16_deep<8>(reinterpret_cast<int4*>(peer + off), reinterpret_cast<const int4*>(stage), bytes / 16);
  } else {
    __syncwarp();
    if (lane == 0) __threadfence_system();  // the NIC reads the staging from memory
    __syncwarp();
    nvshmemx_putmem_nbi_warp(c.base + off, stage, bytes, c.pe[dst]);
    if (lane == 0) nvshmem_quiet();  // delivered before the count signal is written
  }
  __syncwarp();
}

// Warp: each lane with `mine` counts `done` finished parts of its group, which has `parts` in all
// (the warps' shares of an expert's copies, or the warps of an (expert, receiver) pair); the lane
// that completes a group resets its counter and writes the group's signal word (`off` in rank
// dst's buffer).
__device__ __forceinline__ void count_sent(const LLCtx& c, bool mine, unsigned* counter, unsigned done, unsigned parts,
                                           int dst, long long off, long long v) {
  if (mine && atom_add_acq_rel_gpu(counter, done) + done == parts) {
    *counter = 0;  // nobody else touches it before this set's next call
    // a reachable peer gets a release store at system scope, which orders every row this lane
    // acquired through the counter; the NVSHMEM signal op needs the explicit fence
    if (c.peer_base[dst] == nullptr) __threadfence_system();
    put_signal(c, dst, off, v);
  }
  __syncwarp();
}

// Block-wide: threads r < R wait until receiver r released this set after its last receive half
// on it (its completed calls on the set reached ours), so its slots are free again. Ranks
// masked in the block's snapshot are not waited for.
template <int kS = -1>
__device__ __forceinline__ bool wait_released(const LLCtx& c, int set, int op, long long sig) {
  bool ok = true;
  const long long target = *reinterpret_cast<volatile long long*>(&state_of(c)->set_calls[set]);
  const long long* release = reinterpret_cast<const long long*>(c.base + c.lay.set_offset(set) + c.lay.release);
  for (int r = threadIdx.x; r < c.num_ranks; r += blockDim.x) {
    if (gone<kS>(r)) continue;
    long long v;
    bool is_gone;
    ok &= wait_peer<kS>(c, release + r, [&](long long x) { return x >= target; }, v, is_gone,
                        WaitSite{op, kLLWaitRelease, -1, r, set, sig});
  }
  return __syncthreads_and(ok);
}

// Block-wide end of a receive half: the last block to finish clears the set's signal words
// (`clear_off`, n words), then hands the set back to every sender. With `wait_n` > 0 (the
// combine: this call's E per-expert flags, L experts per rank), the flags nobody waited on
// (experts no local token used) are first waited for, so a late one cannot leak into the set's
// next call.
template <int kS = -1>
__device__ __forceinline__ void finish_receive(const LLCtx& c, int set, long long clear_off, int n, int wait_n = 0,
                                               int L = 1, long long sig = 0, int what = kLLWaitFlag) {
  __shared__ bool last;
  LowLatencyState* st = state_of(c);
  __syncthreads();
  // acq_rel: this block's reads of the words come before the bump; the last block acquires every
  // block's bump before clearing them
  if (threadIdx.x == 0) last = atom_add_acq_rel_gpu(&st->grid_done[set], 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  long long* words = reinterpret_cast<long long*>(c.base + c.lay.set_offset(set) + clear_off);
  if (wait_n > 0) {
    bool ok = true;
    for (int i = threadIdx.x; i < wait_n; i += blockDim.x) {
      if (masked_now<kS>(c, i / L)) continue;
      long long v;
      bool is_gone;
      const WaitSite at{kOpLowLatencyCombine, what, i, i / L, set, sig};
      const bool arrived = wait_peer<kS>(c, words + i, [](long long x) { return x != 0; }, v, is_gone, at);
      ok &= arrived;
      if (arrived && !is_gone && decoded_sig(v) != sig) report(c, kErrMismatch, at, decoded_sig(v));
    }
    if (!__syncthreads_and(ok)) {  // timed out: the path is broken, the set stays held
      if (threadIdx.x == 0) st->grid_done[set] = 0;
      return;
    }
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) words[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    st->grid_done[set] = 0;
    if (*reinterpret_cast<volatile int*>(&st->failed)) return;  // broken: leave the set held
    const long long done = ++st->set_calls[set];
    const long long off = c.lay.set_offset(set) + c.lay.release + (long long)c.rank * 8;
    const unsigned long long masked = shrink_on<kS>(c) ? mask_bits_now(st->mask, c.num_ranks) : 0;
    // one system fence (the block's reads of the set and its clears are ordered before it by the
    // barrier), then relaxed stores: a release store per rank would be a fence per rank
    __threadfence_system();
    for (int r = 0; r < c.num_ranks; ++r)
      if (!((masked >> r) & 1ull)) put_signal(c, r, off, done, false);  // (a masked rank's words are reset by the barrier)
  }
}

// An expert id as the kernels use it: -1 for an unused slot (any id outside [0, E)).
__device__ __forceinline__ int valid_id(long long e, int E) { return e >= 0 && e < E ? (int)e : -1; }

inline void check(cudaError_t e, const char* what) { check_cuda(e, what, "low-latency"); }

}  // namespace low_latency
}  // namespace mep
