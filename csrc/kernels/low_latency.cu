// The low-latency (decode) path: one kernel per direction, no host sync, fixed shapes.
//
// Dispatch, send half: each block casts its tokens (FP8 per 128 channels, or a bf16 copy) once
// into its staging slot (before it waits for the receivers' release: the staging is this rank's
// own), then sends each token's row once to every rank that owns one of its experts, at the
// token's position among this rank's rows for that rank (a warp scan of the call's ids, held in
// shared memory): a row crosses the link once per receiver, however many of its experts live
// there. Each copy (token, k) becomes a table entry at the receiver, slot (local expert, this
// rank, position), position = the copy's rank among this rank's copies for that expert, so copies
// arrive in token order without atomics. The warps that finish an expert's last copy then write
// the (expert, source) count signal, -1 - count (with the call's signature hash in the high
// word): 0 means "not arrived", so 0 tokens is visible (experts with no copy get theirs at once).
// Receive half: per (local expert, source), wait on every source's signal, place the source's
// copies after the earlier sources' (grouped by source ascending), expand each table entry into
// its row of the expert's segment, and fill count/range/src.
//
// Combine: each expert row goes back to its token's rank, into slot (token, top-k slot), by warps
// split over the (local expert, token rank) pairs; the pair's last warp sends one flag per
// (global expert, token rank) after the rows; the receive half waits for every expert's flag and
// reduces sum_k w * y in fp32.
//
// Ordering: a row's stores are followed by an acq_rel bump of a per-group counter; the warp that
// completes the group has acquired every bump, and its system-scope release store of the signal
// makes every row visible first (no fence per row). Waits poll relaxed, then acquire once.
//
// Transport: stores through nvshmem_ptr when the peer is load/store reachable (NVLink, or the
// same GPU), else NVSHMEM puts (IBGDA/IB across nodes) completed with nvshmem_quiet before the
// count is sent. Buffer sets: a sender waits, per receiver, until that receiver released the set
// after its previous receive half on it (a token written back by the receiver), so a slow
// receiver (a recv hook not yet called) is never overwritten. Every wait has a timeout that
// records what it waited on in mapped host memory and stops every later wait.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../cuda_check.h"
#include "../protocol.h"
#include "low_latency.h"
#include "symmetric.cuh"

namespace mep {
namespace {

using sym::globaltimer;
using sym::atom_add_acq_rel_gpu;
using sym::warp_copy16;
using sym::warp_copy16_deep;
using sym::warp_sum;

constexpr int kLLScaleRegs = 2;  // a lane's FP8 scales held in registers during a row's copy-out (H <= 8192)

__device__ __forceinline__ LowLatencyState* state_of(const LLCtx& c) {
  return reinterpret_cast<LowLatencyState*>(c.base + c.lay.state);
}
__device__ __forceinline__ sym::Waiter waiter(const LLCtx& c) {
  LowLatencyState* st = state_of(c);
  return {c.err, &st->failed, &st->err_claims, c.timeout_ns, &st->peer_failed, c.seq};
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

__device__ __forceinline__ void report(const LLCtx& c, int code, int op, int what, int expert, int peer, int set,
                                       long long sig, long long got) {
  sym::report(waiter(c), code, op, what, expert, peer, set, sig, got);
}
template <typename Load, typename Done>
__device__ __forceinline__ bool spin(const LLCtx& c, Load load, Done done, long long& v, int op, int what,
                                     int expert, int peer, int set, long long sig) {
  return sym::spin(waiter(c), load, done, v, op, what, expert, peer, set, sig);
}

// Wait until done(*p), p a signal word another rank writes (relaxed polls, one acquire after).
template <typename Done>
__device__ __forceinline__ bool wait_word(const LLCtx& c, const long long* p, Done done, long long& v, int op, int what,
                                          int expert, int peer, int set, long long sig) {
  const bool ok = spin(c, [&] { return sym::ld_relaxed_sys(p); }, done, v, op, what, expert, peer, set, sig);
  // one acquire load of the word once seen (it only moves forward until this rank clears it):
  // cheaper than a system fence, which also drains this thread's outstanding stores
  if (ok) v = sym::ld_acquire_sys(p);
  return ok;
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
// on it (its completed calls on the set reached ours), so its slots are free again.
__device__ __forceinline__ bool wait_released(const LLCtx& c, int set, int op, long long sig) {
  bool ok = true;
  const long long target = *reinterpret_cast<volatile long long*>(&state_of(c)->set_calls[set]);
  const long long* release = reinterpret_cast<const long long*>(c.base + c.lay.set_offset(set) + c.lay.release);
  for (int r = threadIdx.x; r < c.num_ranks; r += blockDim.x) {
    long long v;
    ok &= wait_word(c, release + r, [&](long long x) { return x >= target; }, v, op, kLLWaitRelease, -1, r, set, sig);
  }
  return __syncthreads_and(ok);
}

// Block-wide end of a receive half: the last block to finish clears the set's signal words
// (`clear_off`, n words), then hands the set back to every sender. With `wait_n` > 0 (the
// combine: this call's E per-expert flags, L experts per rank), the flags nobody waited on
// (experts no local token used) are first waited for, so a late one cannot leak into the set's
// next call.
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
      long long v;
      ok &= wait_word(c, words + i, [](long long x) { return x != 0; }, v, kOpLowLatencyCombine, what, i, i / L, set,
                      sig);
      if (ok && decoded_sig(v) != sig) report(c, kErrMismatch, kOpLowLatencyCombine, what, i, i / L, set, sig, decoded_sig(v));
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
    // one system fence (the block's reads of the set and its clears are ordered before it by the
    // barrier), then relaxed stores: a release store per rank would be a fence per rank
    __threadfence_system();
    for (int r = 0; r < c.num_ranks; ++r) put_signal(c, r, off, done, false);
  }
}

// Warp: x/scale as FP8 e4m3 for one 128-channel block (lane: its 4 channels in `raw`), bit-exact with
// megatron_ep.fp8: fp32 amax floored at 1e-4, scale = amax / 448 (IEEE division), optionally
// rounded up to a power of two, q = e4m3(x / scale) round-to-nearest-even.
__device__ __forceinline__ void cast_block(const uint2 raw, uint8_t* q, float* scale_out, bool round_scale) {
  const int lane = threadIdx.x & 31;
  const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  const float2 f0 = __bfloat1622float2(p0), f1 = __bfloat1622float2(p1);
  float amax = fmaxf(fmaxf(fabsf(f0.x), fabsf(f0.y)), fmaxf(fabsf(f1.x), fabsf(f1.y)));
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  amax = fmaxf(amax, 1e-4f);
  float scale = __fdiv_rn(amax, 448.0f);
  if (round_scale) {  // smallest power of two >= scale (scale is a positive normal float)
    unsigned u = __float_as_uint(scale);
    if (u & 0x7fffffu) u = (u & 0xff800000u) + 0x800000u;
    scale = __uint_as_float(u);
  }
  const float2 a = make_float2(__fdiv_rn(f0.x, scale), __fdiv_rn(f0.y, scale));
  const float2 b = make_float2(__fdiv_rn(f1.x, scale), __fdiv_rn(f1.y, scale));
  const unsigned lo = __nv_cvt_float2_to_fp8x2(a, __NV_SATFINITE, __NV_E4M3);
  const unsigned hi = __nv_cvt_float2_to_fp8x2(b, __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<unsigned*>(q + lane * 4) = lo | (hi << 16);
  if (lane == 0) *scale_out = scale;
}

// ------------------------------------------------------------------------------------ dispatch
// An expert id as the kernels use it: -1 for an unused slot (any id outside [0, E)).
__device__ __forceinline__ int valid_id(long long e, int E) { return e >= 0 && e < E ? (int)e : -1; }

// `ids_in_smem`: the T*K ids and an E-entry copy count fit in the dynamic shared memory
// (kLLIdsSmemBytes) and T in the static token masks (kLLMaskTokens), else each scan reads the ids
// from global memory.
__global__ void __launch_bounds__(kLLThreads, 1) ll_dispatch_kernel(const LLCtx c, const LLDispatchArgs a,
                                                                    bool ids_in_smem) {
  extern __shared__ int s_ids[];
  __shared__ unsigned long long s_tmask[kLLMaskTokens];  // static: its address costs no register
  __shared__ int s_dest[kMaxTopk], s_ndest;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int R = c.num_ranks, L = a.E / R, set = a.set;
  const int num_warps = gridDim.x * kLLWarps, gw = blockIdx.x * kLLWarps + warp;
  const LowLatencyLayout& lay = c.lay;
  LowLatencyState* st = state_of(c);
  const int data_bytes = a.fp8 ? a.H : a.H * 2;
  // data + scales, rounded up to 16 bytes (a few bytes past the scales ride along: both the
  // staging slot and the receive slot are d_msg = 16 + that many bytes, see the layout)
  const int payload = (data_bytes + (a.fp8 ? a.H / 128 * 4 : 0) + 15) / 16 * 16;
  const int TK = a.T * a.K;
  stamp(c, 0, kLLTraceEntry);

  if (a.phases & kLLSend) {
    // every copy's expert (-1: unused slot) once per block, and the copies per expert: the
    // prefix counts below scan the ids up to their copy, the counts answer "how many" at once
    // and per token the mask of its receiving ranks (R <= 64): a row's position scan then tests
    // one bit per earlier token instead of dividing K ids by L (2 x H200, 2026-11-30, --trace at
    // 8b50ae5: ~3.8 us of scans per block at 128 tokens, most of it integer divisions)
    // A thread's first kIdsAhead ids are loaded here and stored after the cast below, so their
    // loads and the cast's overlap (two memory round trips were one after the other: ~4 us from
    // entry to the cast's end, 2 x H200, 2026-11-30, --trace at 410d2a2, median block); 2 per
    // thread cover T*K <= 1024, the decode shape.
    constexpr int kIdsAhead = 2;
    int* s_cnt = s_ids + TK;
    long long ahead[kIdsAhead];
    if (ids_in_smem) {
#pragma unroll
      for (int i = 0; i < kIdsAhead; ++i) {
        const int j = threadIdx.x + i * blockDim.x;
        ahead[i] = j < TK ? a.topk_idx[j] : -1;
      }
      for (int e = threadIdx.x; e < a.E; e += blockDim.x) s_cnt[e] = 0;
      for (int t = threadIdx.x; t < a.T; t += blockDim.x) s_tmask[t] = 0;
    }
    const auto fill_ids = [&] {  // after a barrier past the zeroing
      const auto put = [&](int j, long long raw) {
        const int e = valid_id(raw, a.E);
        s_ids[j] = e;
        if (e >= 0) {
          atomicAdd(&s_cnt[e], 1);
          atomicOr(&s_tmask[j / a.K], 1ull << (e / L));
        }
      };
#pragma unroll
      for (int i = 0; i < kIdsAhead; ++i)
        if (threadIdx.x + i * blockDim.x < TK) put(threadIdx.x + i * blockDim.x, ahead[i]);
      for (int j = threadIdx.x + kIdsAhead * blockDim.x; j < TK; j += blockDim.x) put(j, a.topk_idx[j]);
    };
    const auto id = [&](int j) { return ids_in_smem ? s_ids[j] : valid_id(a.topk_idx[j], a.E); };
    // copies to e in the whole call (the smem count, else a warp scan); on every lane
    const auto copies_to = [&](int e) {
      if (ids_in_smem) return s_cnt[e];
      int n = 0;
      for (int j = lane; j < TK; j += 32) n += id(j) == e;
      return warp_sum(n);
    };
    const auto count_offset = [&](int e) {
      return lay.set_offset(set) + lay.d_count + ((long long)(e % L) * R + c.rank) * 8;
    };
    // every token of the block cast into its staging slot before the receivers are waited for:
    // the staging is this rank's own, last read by this rank's previous send on the set (stream
    // order; puts are quieted before that send's counts), so it is free already
    for (int t = blockIdx.x; t < a.T; t += gridDim.x) {
      char* stage = c.base + lay.set_offset(set) + lay.d_send + (long long)t * lay.d_msg;
      const __nv_bfloat16* xt = reinterpret_cast<const __nv_bfloat16*>(a.x) + (long long)t * a.H;
      if (a.fp8) {  // a warp's blocks are loaded together: one memory round trip, not one per block
        constexpr int kCastBatch = 4;
        const int nb = a.H / 128;
        for (int g0 = warp; g0 < nb; g0 += kLLWarps * kCastBatch) {
          uint2 raw[kCastBatch];
#pragma unroll
          for (int i = 0; i < kCastBatch; ++i) {
            const int g = g0 + i * kLLWarps;
            if (g < nb) raw[i] = *reinterpret_cast<const uint2*>(xt + g * 128 + lane * 4);
          }
#pragma unroll
          for (int i = 0; i < kCastBatch; ++i) {
            const int g = g0 + i * kLLWarps;
            if (g < nb)
              cast_block(raw[i], reinterpret_cast<uint8_t*>(stage) + g * 128, reinterpret_cast<float*>(stage + a.H) + g,
                         a.round_scale);
          }
        }
      } else {
        for (int i = threadIdx.x; i < data_bytes / 16; i += blockDim.x)
          reinterpret_cast<int4*>(stage)[i] = reinterpret_cast<const int4*>(xt)[i];
      }
    }
    if (ids_in_smem) {
      __syncthreads();
      fill_ids();
    }
    if (blockIdx.x < a.T) stamp(c, 0, kLLTraceCast, true);
    if (wait_released(c, set, kOpLowLatencyDispatch, a.sig)) {  // (a block barrier: s_ids and staging are filled)
      stamp(c, 0, kLLTraceReleased);
      // experts this rank sends nothing to: their count (0) first, before this warp has stores in
      // flight (a release store then waits for none); by the blocks without a token when there
      // are some (T < blocks), else one warp each from the last blocks
      const int idle_warps = gridDim.x > a.T ? (gridDim.x - a.T) * kLLWarps : 0;
      const int zw = idle_warps > 0 ? gw - a.T * kLLWarps : num_warps - 1 - gw;
      const int zstride = idle_warps > 0 ? idle_warps : num_warps;
      for (int e = zw; zw >= 0 && e < a.E; e += zstride)
        if (copies_to(e) == 0 && lane == 0) put_signal(c, e / L, count_offset(e), encode(0, a.sig), false);  // orders nothing
      stamp(c, 0, kLLTraceZero, true);
      // the warps of one row: a fixed number for the whole call (a copy's count closes after
      // copies x `per` parts), enough for min(K, R) destinations to use every warp
      const int per = max(1, kLLWarps / max(1, min(a.K, R))), n16 = payload / 16, chunk = (n16 + per - 1) / per;
      for (int t = blockIdx.x; t < a.T; t += gridDim.x) {
        const char* stage = c.base + lay.set_offset(set) + lay.d_send + (long long)t * lay.d_msg;
        // this token's receiving ranks, each once, in slot order
        if (warp == 0) {
          const int e = lane < a.K ? id(t * a.K + lane) : -1;
          const int d = e >= 0 ? e / L : -1;
          bool first = d >= 0;
          for (int k = 0; k < a.K; ++k) {
            const int dk = __shfl_sync(0xffffffffu, d, k);
            if (k < lane && dk == d) first = false;
          }
          const unsigned m = __ballot_sync(0xffffffffu, first);
          if (first) s_dest[__popc(m & ((1u << lane) - 1))] = d;
          if (lane == 0) s_ndest = __popc(m);
        }
        __syncthreads();
        const int nd = s_ndest;
        for (int u = warp; u < nd * per; u += kLLWarps) {
          const int d = s_dest[u / per], h = u % per;
          int p = 0;  // this token's row position among this rank's rows for d (tokens before it with a copy there)
          if (ids_in_smem) {
            for (int t2 = lane; t2 < t; t2 += 32) p += (int)(s_tmask[t2] >> d & 1ull);
          } else {
            for (int t2 = lane; t2 < t; t2 += 32) {
              bool hit = false;
              for (int k = 0; k < a.K; ++k) {
                const int e2 = id(t2 * a.K + k);
                hit |= e2 >= 0 && e2 / L == d;
              }
              p += hit;
            }
          }
          p = warp_sum(p);
          stamp(c, 0, kLLTraceScanned, true);
          // the table entries of the token's copies on d, slot k by the row's warp k % per
          for (int k = h; k < a.K; k += per) {
            const int e = id(t * a.K + k);
            if (e < 0 || e / L != d) continue;
            int pos = 0;  // copies to e before this one (token order)
            for (int j = lane; j < t * a.K + k; j += 32) pos += id(j) == e;
            pos = warp_sum(pos);
            if (pos >= lay.max_tokens) continue;  // (duplicate ids past the capacity: never delivered)
            const long long eoff = lay.d_entry(set, e % L, c.rank, pos);
            // the weight rides in the entry's spare word (the merged combine's, at the receiver)
            const int4 entry = make_int4(p, k, t, a.weights != nullptr ? __float_as_int(a.weights[t * a.K + k]) : 0);
            if (c.peer_base[d] != nullptr) {
              if (lane == 0) *reinterpret_cast<int4*>(c.peer_base[d] + eoff) = entry;
            } else {
              char* meta = c.base + lay.set_offset(set) + lay.d_meta + ((long long)t * lay.max_topk + k) * kLLEntry;
              if (lane == 0) *reinterpret_cast<int4*>(meta) = entry;
              __syncwarp();
              if (lane == 0) __threadfence_system();
              __syncwarp();
              nvshmemx_putmem_nbi_warp(c.base + eoff, meta, kLLEntry, c.pe[d]);
            }
          }
          // this warp's share of the row (after the entries: send_row quiets the puts)
          const int b16 = min(h * chunk, n16), m16 = min(chunk, n16 - b16);
          if (m16 > 0) {
            send_row(c, d, lay.d_row(set, c.rank, p) + kLLHeader + b16 * 16, stage + b16 * 16, m16 * 16);
          } else if (c.peer_base[d] == nullptr) {  // no share of a short row: the entries' puts still complete first
            if (lane == 0) nvshmem_quiet();
            __syncwarp();
          }
          stamp(c, 0, kLLTraceStored, true);
          // every copy of the token on d: this warp's part is done; the copy's expert closes
          // (count signal) after all its copies' parts
          const int e_l = lane < a.K ? id(t * a.K + lane) : -1;
          const bool on_d = e_l >= 0 && e_l / L == d;
          int n_l = 0;
          if (ids_in_smem) {
            n_l = on_d ? s_cnt[e_l] : 0;
          } else {
            for (int k = 0; k < a.K; ++k) {
              const int ek = __shfl_sync(0xffffffffu, e_l, k);
              const int on = __shfl_sync(0xffffffffu, (int)on_d, k);
              if (on) {
                const int n = copies_to(ek);  // warp-wide
                if (lane == k) n_l = n;
              }
            }
          }
          __syncwarp();
          const int e_c = on_d ? e_l : 0;  // (lanes without a copy on d count nothing)
          count_sent(c, on_d, &st->d_finish[set][e_c], 1, n_l * per, d, count_offset(e_c), encode(n_l, a.sig));
        }
        __syncthreads();  // s_dest is rewritten for the block's next token
      }
      stamp(c, 0, kLLTraceSent, true);
    }
  }

  if (!(a.phases & kLLRecv)) return;
  // receive: (local expert, source) pairs, each split over `split` warps by row
  const int pairs = L * R, split = num_warps > pairs ? num_warps / pairs : 1;
  const long long* counts = reinterpret_cast<const long long*>(c.base + lay.set_offset(set) + lay.d_count);
  for (int u = gw; u < pairs * split; u += num_warps) {
    const int e = u / split / R, s = u / split % R, g = u % split;
    int before = 0, total = 0, mine = 0;
    bool ok = true;
    for (int r = lane; r < R; r += 32) {
      long long v;
      ok &= wait_word(c, counts + (long long)e * R + r, [](long long x) { return x != 0; }, v, kOpLowLatencyDispatch,
                      kLLWaitCount, e, r, set, a.sig);
      int n = ok ? decoded_count(v) : 0;
      if (ok && decoded_sig(v) != a.sig) {
        if (g == 0 && s == 0) report(c, kErrMismatch, kOpLowLatencyDispatch, kLLWaitCount, e, r, set, a.sig, decoded_sig(v));
        n = 0;  // a different call: nothing of it is delivered
      }
      n = min(n, a.out_cap / R);  // never past this call's outputs, whatever a mismatched sender claims
      total += n;
      before += r < s ? n : 0;
      mine += r == s ? n : 0;
    }
    total = warp_sum(total), before = warp_sum(before), mine = warp_sum(mine);
    __syncwarp();  // memory order: every lane reads rows whose signal another lane acquired
    if (!__all_sync(0xffffffffu, ok)) continue;
    stamp(c, 0, kLLTraceArrived, true);
    if (g == 0 && lane == 0) {
      a.out_range[((long long)e * R + s) * 2] = before;
      a.out_range[((long long)e * R + s) * 2 + 1] = mine;
      if (s == 0) a.out_count[e] = total;
    }
    if (g == 0 && s == 0)
      for (int i = total + lane; i < a.out_cap; i += 32) a.out_src[(long long)e * a.out_cap + i] = -1;
    for (int i = g; i < mine; i += split) {
      // which row holds copy i of (e, s), and whose it is; then the row (one round trip each)
      const int4 ent = __ldcg(reinterpret_cast<const int4*>(c.base + lay.d_entry(set, e, s, i)));
      const long long row = (long long)e * a.out_cap + before + i;
      if (ent.x < 0 || ent.x >= lay.max_tokens) {  // (never: the sender's positions are < T)
        if (lane == 0) a.out_src[row] = -1, a.out_slot[row] = -1;
        continue;
      }
      // the merged combine's index (before the copy: nothing of it stays live across the copy's loads)
      if (a.out_pairs != nullptr && lane == 0 && ent.z < a.out_cap / R && ent.y < a.K) {  // (always, from a matching sender)
        a.out_w[row] = __int_as_float(ent.w);
        a.out_pairs[((long long)s * (a.out_cap / R) + ent.z) * a.K + ent.y] = (int)row;
      }
      const char* slot = c.base + lay.d_row(set, s, ent.x);
      const float* sc = reinterpret_cast<const float*>(slot + kLLHeader + a.H);
      const int nsc = a.fp8 ? a.H / 128 : 0;
      float sc_reg[kLLScaleRegs];
#pragma unroll
      for (int r = 0; r < kLLScaleRegs; ++r)
        if (lane + r * 32 < nsc) sc_reg[r] = __ldcg(sc + lane + r * 32);
      warp_copy16_deep<16>(reinterpret_cast<int4*>(static_cast<char*>(a.out_x) + row * data_bytes),
                           reinterpret_cast<const int4*>(slot + kLLHeader), data_bytes / 16);
#pragma unroll
      for (int r = 0; r < kLLScaleRegs; ++r)
        if (lane + r * 32 < nsc) a.out_scales[row * nsc + lane + r * 32] = sc_reg[r];
      for (int j = lane + kLLScaleRegs * 32; j < nsc; j += 32) a.out_scales[row * nsc + j] = __ldcg(sc + j);
      if (lane == 0) {
        a.out_src[row] = ent.z;
        a.out_slot[row] = ent.y;
      }
    }
  }
  stamp(c, 0, kLLTraceCopied, true);
  finish_receive(c, set, lay.d_count, (lay.num_experts / R) * R);
  stamp(c, 0, kLLTraceEnd);
}

// ------------------------------------------------------------------------------------- combine
// acc[0..8) += w * the 8 bf16 values of a 16-byte word (fp32)
__device__ __forceinline__ void axpy_bf16x8(float* acc, float w, const int4& word) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&word);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += w * f.x;
    acc[2 * i + 1] += w * f.y;
  }
}

// 8 fp32 values rounded to bf16, as one 16-byte word
__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
  int4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return out;
}

// Warp: dst[v] = bf16(sum_j w[j] * rows[j][b16 + v]) for v < m16 (16-byte words of bf16 rows of
// n16 words), fp32 sums in j order (= k ascending), four copies' loads in flight per lane. Not
// inlined: inside the combine kernel its registers pushed the kernel into spills.
__device__ __noinline__ void merge_rows(int4* dst, const int4* __restrict__ x, const int* rows, const float* w, int n,
                                        int n16, int b16, int m16) {
  const int lane = threadIdx.x & 31;
  for (int v = lane; v < m16; v += 32) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < n; j0 += 4) {
      int4 raw[4];
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (j0 + b < n) raw[b] = __ldg(x + (long long)rows[j0 + b] * n16 + b16 + v);
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        if (j0 + b >= n) break;
        axpy_bf16x8(acc, w[j0 + b], raw[b]);
      }
    }
    dst[v] = pack_bf16x8(acc);
  }
}

// Merged send (the dispatch carried the weights): a warp per (source rank, token) unit, or a
// channel share of one (`msplit` warps per unit), finds the token's copies here through the
// dispatch's `pairs` (each entry checked against src / slot / range: entries of copies elsewhere
// are stale), and sends one row to the source's slot of its first copy here: the copy itself
// when it is the only one (the source weights it), else the weighted sum of the copies in fp32,
// k ascending, rounded to bf16. At EP 2, top-8 of 256, that is ~1 row per token instead of ~4.
// Each rank then sends every source one flag (c_flag word `rank`) once all its units for that
// source are done.
__device__ __forceinline__ void merged_send(const LLCtx& c, const LLCombineArgs& a, int gw, int num_warps) {
  __shared__ int s_mrow[kLLWarps][kMaxTopk];  // the unit's copies here, k ascending
  __shared__ float s_mw[kLLWarps][kMaxTopk];
  constexpr unsigned kFull = 0xffffffffu;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int R = c.num_ranks, L = a.E / R, set = a.set, K = a.K, mt = a.out_cap / R;
  const LowLatencyLayout& lay = c.lay;
  LowLatencyState* st = state_of(c);
  const int n16 = a.H / 8, units = R * mt;  // 16-byte words of a bf16 row
  // every warp busy, each with at least 64 words of the row
  const int msplit = max(1, min(num_warps / max(1, units), n16 / 64)), chunk = (n16 + msplit - 1) / msplit;
  const long long rows_total = (long long)L * a.out_cap;
  const int4* x = static_cast<const int4*>(a.x);
  int cur = -1;
  unsigned done = 0;
  const auto flush = [&] {
    if (done > 0)
      count_sent(c, (threadIdx.x & 31) == 0, &st->c_finish[set][cur], done, (unsigned)(mt * msplit), cur,
                 lay.set_offset(set) + lay.c_flag + (long long)c.rank * 8, encode(0, a.sig));
    done = 0;
  };
  for (int u = gw; u < units * msplit; u += num_warps) {
    const int unit = u / msplit, g = u % msplit, s = unit / mt, t = unit % mt;
    if (s != cur) flush(), cur = s;
    ++done;
    int row = -1;
    float w = 0.f;
    if (lane < K) {
      const int r = a.pairs[(long long)unit * K + lane];
      if (r >= 0 && r < rows_total) {
        const int e = r / a.out_cap, i = r - e * a.out_cap;
        const int b = a.range[((long long)e * R + s) * 2], n = a.range[((long long)e * R + s) * 2 + 1];
        if (i >= b && i < b + n && a.src[r] == t && a.slot[r] == lane) row = r, w = a.row_w[r];
      }
    }
    const unsigned m = __ballot_sync(kFull, row >= 0);
    if (m == 0) continue;
    const int n = __popc(m), k1 = __ffs(m) - 1;
    if (row >= 0) {
      const int j = __popc(m & ((1u << lane) - 1));
      s_mrow[warp][j] = row, s_mw[warp][j] = w;
    }
    __syncwarp();
    const int b16 = min(g * chunk, n16), m16 = min(chunk, n16 - b16);
    char* peer = c.peer_base[s];
    const long long off = lay.c_slot(set, t, k1) + (long long)b16 * 16;
    char* stage = c.base + lay.set_offset(set) + lay.c_stage + (long long)gw * lay.c_row + (long long)b16 * 16;
    int4* dst = reinterpret_cast<int4*>(peer != nullptr ? peer + off : stage);  // puts read symmetric memory
    if (n == 1) {
      warp_copy16(dst, x + (long long)s_mrow[warp][0] * n16 + b16, m16);
    } else {
      merge_rows(dst, x, s_mrow[warp], s_mw[warp], n, n16, b16, m16);
    }
    __syncwarp();
    if (peer == nullptr) send_row(c, s, off, stage, m16 * 16);
    __syncwarp();  // s_mrow / s_mw are rewritten for the warp's next unit
  }
  if (cur >= 0) flush();
}

__global__ void __launch_bounds__(kLLThreads, 1) ll_combine_kernel(const LLCtx c, const LLCombineArgs a) {
  const int warp = threadIdx.x / 32;
  const int R = c.num_ranks, L = a.E / R, set = a.set;
  const int num_warps = gridDim.x * kLLWarps, gw = blockIdx.x * kLLWarps + warp;
  const LowLatencyLayout& lay = c.lay;
  LowLatencyState* st = state_of(c);
  const int row_bytes = a.H * 2;
  const bool merged = a.pairs != nullptr;  // the dispatch carried the weights (merged_send)
  stamp(c, 1, kLLTraceEntry);

  if (a.phases & kLLSend) {
    if (wait_released(c, set, kOpLowLatencyCombine, a.sig)) {
      stamp(c, 1, kLLTraceReleased);
      if (merged) {
        merged_send(c, a, gw, num_warps);
      } else {
        // (local expert, token rank) pairs, each split over `split` warps by row; the pair's last
        // warp to finish sends its flag
        const int pairs = L * R, split = num_warps > pairs ? num_warps / pairs : 1;
        for (int u = gw; u < pairs * split; u += num_warps) {
          const int e = u / split / R, s = u / split % R, g = u % split;
          const int begin = a.range[((long long)e * R + s) * 2], n = a.range[((long long)e * R + s) * 2 + 1];
          for (int i = g; i < n; i += split) {
            const long long row = (long long)e * a.out_cap + begin + i;
            const int t = a.src[row], k = a.slot[row];
            const char* xrow = static_cast<const char*>(a.x) + row * row_bytes;
            const char* from = xrow;
            if (c.peer_base[s] == nullptr) {  // puts read symmetric memory: stage the row
              char* stage = c.base + lay.set_offset(set) + lay.c_stage + (long long)gw * lay.c_row;
              warp_copy16(reinterpret_cast<int4*>(stage), reinterpret_cast<const int4*>(xrow), row_bytes / 16);
              from = stage;
            }
            send_row(c, s, lay.c_slot(set, t, k), from, row_bytes);
          }
          stamp(c, 1, kLLTraceStored, true);
          count_sent(c, (threadIdx.x & 31) == 0, &st->c_finish[set][e * R + s], 1, split, s,
                     lay.set_offset(set) + lay.c_flag + (long long)(c.rank * L + e) * 8, encode(n, a.sig));
        }
      }
      stamp(c, 1, kLLTraceSent, true);
    }
  }

  if (!(a.phases & kLLRecv)) return;
  // receive: a block waits only for the flags of the experts its token uses (threads k < K), so
  // it reduces as soon as they are in and only T*K threads poll
  const long long* flags = reinterpret_cast<const long long*>(c.base + lay.set_offset(set) + lay.c_flag);
  // the token's weights and used slots in shared memory (unused slots' rows are never read); every
  // slot's load of a step is issued before the adds (k ascending, as the reference sums)
  // Merged: only the first slot of each rank the token uses holds a row (that rank's weighted sum,
  // or its only copy, weighted here), and one flag per rank says that rank's rows are in.
  __shared__ float s_w[kMaxTopk];
  __shared__ bool s_on[kMaxTopk];
  __shared__ int s_rank[kMaxTopk];
  constexpr int kBatch = 8;
  for (int t = blockIdx.x; t < a.T; t += gridDim.x) {
    bool ok = true;
    int e = -1;
    if (threadIdx.x < a.K) {
      e = valid_id(a.topk_idx[(long long)t * a.K + threadIdx.x], a.E);
      s_rank[threadIdx.x] = e >= 0 ? e / L : -1;
    }
    if (merged) __syncthreads();
    if (threadIdx.x < a.K) {
      const int k = threadIdx.x;
      float w = a.weights[(long long)t * a.K + k];
      int word = e;  // the flag waited on: the expert's, or merged the rank's (first slot only)
      if (merged && e >= 0) {
        const int r = e / L;
        int first = k, n = 0;
        for (int k2 = 0; k2 < a.K; ++k2)
          if (s_rank[k2] == r) first = min(first, k2), ++n;
        word = first == k ? r : -1;
        if (n > 1) w = 1.f;  // the rank sent its weighted sum
      }
      s_on[k] = word >= 0;
      s_w[k] = w;
      if (word >= 0) {
        const int what = merged ? kLLWaitRankFlag : kLLWaitFlag, peer = merged ? word : e / L;
        long long v;
        ok = wait_word(c, flags + word, [](long long x) { return x != 0; }, v, kOpLowLatencyCombine, what, word, peer, set,
                       a.sig);
        if (ok && decoded_sig(v) != a.sig)
          report(c, kErrMismatch, kOpLowLatencyCombine, what, word, peer, set, a.sig, decoded_sig(v));
      }
    }
    if (!__syncthreads_and(ok)) break;  // timed out (reported): every later wait returns at once
    if (t == blockIdx.x) stamp(c, 1, kLLTraceArrived);
    for (int v = threadIdx.x; v < a.H / 8; v += blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < a.K; k0 += kBatch) {
        int4 raw[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int k = k0 + b;
          raw[b] = k < a.K && s_on[k] ? __ldcg(reinterpret_cast<const int4*>(c.base + lay.c_slot(set, t, k)) + v)
                                      : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (k0 + b >= a.K || !s_on[k0 + b]) continue;
          axpy_bf16x8(acc, s_w[k0 + b], raw[b]);
        }
      }
      reinterpret_cast<int4*>(a.y)[(long long)t * (a.H / 8) + v] = pack_bf16x8(acc);
    }
    __syncthreads();  // s_w, s_on are rewritten for the next token
  }
  stamp(c, 1, kLLTraceCopied, true);
  if (merged) {
    finish_receive(c, set, lay.c_flag, lay.num_experts, R, 1, a.sig, kLLWaitRankFlag);
  } else {
    finish_receive(c, set, lay.c_flag, lay.num_experts, a.E, L, a.sig);
  }
  stamp(c, 1, kLLTraceEnd);
}

// This rank failed before joining a call: every peer's waits stop and name it.
__global__ void ll_publish_failure_kernel(const LLCtx c, long long seq) {
  if (threadIdx.x == 0)
    sym::publish_failure(c.peer_base, c.base, c.pe, c.num_ranks, c.rank,
                         c.lay.state + (long long)offsetof(LowLatencyState, peer_failed), c.rank, seq);
}

void check(cudaError_t e, const char* what) { check_cuda(e, what, "low-latency"); }

}  // namespace

// ------------------------------------------------------------------------------------ launchers
void launch_ll_dispatch(const LLCtx& c, const LLDispatchArgs& a, int num_blocks, cudaStream_t stream) {
  const long long ids_bytes = ((long long)a.T * a.K + a.E) * sizeof(int);  // ids, then the per-expert counts
  const bool ids_in_smem = ids_bytes <= kLLIdsSmemBytes && a.T <= kLLMaskTokens;
  LLCtx cs = c;
  cs.seq = a.seq;
  ll_dispatch_kernel<<<num_blocks, kLLThreads, ids_in_smem ? ids_bytes : 0, stream>>>(cs, a, ids_in_smem);
  check(cudaGetLastError(), "dispatch launch");
}

void launch_ll_combine(const LLCtx& c, const LLCombineArgs& a, int num_blocks, cudaStream_t stream) {
  LLCtx cs = c;
  cs.seq = a.seq;
  ll_combine_kernel<<<num_blocks, kLLThreads, 0, stream>>>(cs, a);
  check(cudaGetLastError(), "combine launch");
}

void launch_ll_publish_failure(const LLCtx& c, long long seq, cudaStream_t stream) {
  ll_publish_failure_kernel<<<1, 32, 0, stream>>>(c, seq);
  check(cudaGetLastError(), "failure publication launch");
}

void ll_touch_kernels() {
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, ll_publish_failure_kernel), "loading the failure publication kernel");
  check(cudaFuncGetAttributes(&attr, ll_dispatch_kernel), "loading the dispatch kernel");
  check(cudaFuncSetAttribute(ll_dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kLLIdsSmemBytes),
        "the dispatch kernel's shared memory");
  check(cudaFuncGetAttributes(&attr, ll_combine_kernel), "loading the combine kernel");
}

}  // namespace mep
