// The internode path's RDMA-domain steps as device functions (the protocol: kernels.cu's
// header). kernels.cu's kernels run them one launch each (a new routing's dispatch); fused.cu's
// run them inside one launch per direction with the intranode stage (a cached dispatch, every
// combine). Include after nvshmem.h.
#pragma once

#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/protocol.h"
#include "internode/api.h"
#include "nvshmem/waits.cuh"

namespace mep {
namespace internode {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ InternodeState* state_of(const InternodeCtx& c) {
  return reinterpret_cast<InternodeState*>(c.base + c.lay.state);
}
__device__ __forceinline__ sym::Waiter waiter(const InternodeCtx& c) {
  InternodeState* st = state_of(c);
  return {c.err, &st->failed, &st->err_claims, c.timeout_ns, &st->peer_failed, c.seq};
}
__device__ __forceinline__ int peer_rank(const InternodeCtx& c, int node) { return node * c.ranks_per_node + c.local; }
__device__ __forceinline__ bool failed(const InternodeCtx& c) { return *reinterpret_cast<volatile int*>(&state_of(c)->failed); }

// Bit n set when one of the warp's slots (lane k: slot k) names an expert of node n.
__device__ __forceinline__ unsigned long long node_mask(long long e, int E, int experts_per_node) {
  const int n = (e >= 0 && e < E) ? (int)(e / experts_per_node) : -1;
  const unsigned lo = __reduce_or_sync(kFull, n >= 0 && n < 32 ? 1u << n : 0u);
  const unsigned hi = __reduce_or_sync(kFull, n >= 32 ? 1u << (n - 32) : 0u);
  return ((unsigned long long)hi << 32) | lo;
}

// Block-wide: wait until every destination node finished reading this rank's previous call.
__device__ __forceinline__ bool wait_released(const InternodeCtx& c, int dir, long long call, int op, long long sig) {
  bool ok = true;
  const long long* rel = reinterpret_cast<const long long*>(c.base + c.lay.release_at(dir, 0));
  for (int n = threadIdx.x; n < c.lay.num_nodes; n += blockDim.x) {
    long long v;
    ok &= sym::spin(waiter(c), [&] { return ld_acquire_sys(rel + n); }, [&](long long x) { return x >= call - 1; }, v,
                    sym::WaitSite{op, kInternodeWaitRelease, n, peer_rank(c, n), dir, sig});
  }
  return __syncthreads_and(ok);
}

// Block-wide: wait for every source node's signal of this call, check its hash, and return its
// token count in `tokens` (0 for a node that timed out or made a different call).
__device__ __forceinline__ bool wait_sources(const InternodeCtx& c, int dir, long long call, int op, long long sig, int* tokens) {
  bool ok = true;
  for (int n = threadIdx.x; n < c.lay.num_nodes; n += blockDim.x) {
    const long long* word = reinterpret_cast<const long long*>(c.base + c.lay.signal_at(dir, n));
    long long v;
    const sym::WaitSite at{op, kInternodeWaitSignal, n, peer_rank(c, n), dir, sig};
    const bool got = sym::spin(waiter(c), [&] { return ld_acquire_sys(word); }, [&](long long x) { return x >= call; },
                               v, at);
    int T = 0;
    if (got) {
      const volatile long long* head = reinterpret_cast<const volatile long long*>(c.base + c.lay.head_at(dir, n));
      const long long their = head[1];
      T = (int)min(head[0], (long long)c.lay.max_tokens);
      if (their != sig) {
        if (blockIdx.x == 0) sym::report(waiter(c), kErrMismatch, at, their);
        T = 0;  // a different call: nothing of it is used
      }
    }
    tokens[n] = T;
    ok &= got;
  }
  return __syncthreads_and(ok);
}

// Block-wide end of a grid: true in the one block that finished last (every block's writes
// are then visible to it), which resets the counter.
__device__ __forceinline__ bool last_block(unsigned* counter) {
  __shared__ bool last;
  __threadfence_system();  // this thread's stores (to peers too) before the count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();
  if (threadIdx.x == 0) *counter = 0;
  return true;
}

// The last block: header {T, sig} then the signal `call` into every node's slot for this node.
__device__ __forceinline__ void signal_all(const InternodeCtx& c, int dir, long long call, const int* tokens_for, int T, long long sig) {
  for (int n = threadIdx.x; n < c.lay.num_nodes; n += blockDim.x) {
    const long long head_off = c.lay.head_at(dir, c.node);
    const long long count = tokens_for != nullptr ? tokens_for[n] : T;
    char* peer = c.peer_base[n];
    if (peer != nullptr) {
      volatile long long* head = reinterpret_cast<volatile long long*>(peer + head_off);
      head[0] = count, head[1] = sig;
      __threadfence_system();
    } else {
      nvshmem_longlong_p(reinterpret_cast<long long*>(c.base + head_off), count, c.pe[n]);
      nvshmem_longlong_p(reinterpret_cast<long long*>(c.base + head_off) + 1, sig, c.pe[n]);
      nvshmem_fence();  // the header before the signal
    }
    sym::put_signal(peer, c.base, c.pe[n], c.lay.signal_at(dir, c.node), call);
  }
}

// The send's end (grid): the last block to finish writes every node's header and signal (`call`)
// and counts the call as sent. `tokens_for`: the count each node gets (combine), else T for all.
__device__ __forceinline__ void finish_send(const InternodeCtx& c, int dir, long long call, const int* tokens_for, int T,
                                            long long sig, unsigned* counter) {
  if (!last_block(counter) || failed(c)) return;
  signal_all(c, dir, call, tokens_for, T, sig);
  __syncthreads();
  if (threadIdx.x == 0) state_of(c)->sent[dir] = call;
}

// Tell every sender of `dir` that this rank finished reading its call `done` (they may write
// again); nothing when the path is broken (the slots stay held). Every thread of the block.
__device__ __forceinline__ void release_senders(const InternodeCtx& c, int dir, long long done) {
  if (failed(c)) return;
  __threadfence_system();
  for (int n = threadIdx.x; n < c.lay.num_nodes; n += blockDim.x)
    sym::put_signal(c.peer_base[n], c.base, c.pe[n], c.lay.release_at(dir, c.node), done);
}

// The receive's end (grid): the last block to finish counts the call received and, with
// `release`, releases the slots to their senders at once.
__device__ __forceinline__ void finish_receive(const InternodeCtx& c, int dir, long long call, unsigned* counter,
                                               bool release) {
  if (!last_block(counter)) return;
  if (threadIdx.x == 0) state_of(c)->received[dir] = call;
  if (release) release_senders(c, dir, call);
}

// ------------------------------------------------------------------------------------ dispatch
// Send half (grid), after the release wait: with `a.ids`, the ids and weights of every token to
// every node (one contiguous block each; a cached dispatch sends its weights only, its receivers
// keep the ids); then each token's row once to every node owning one of its experts, the nodes
// staggered per token (no incast).
__device__ __forceinline__ void send_rows(const InternodeCtx& c, const InternodeSendArgs& a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, N = c.lay.num_nodes, mt = c.lay.max_tokens;
  const int num_warps = gridDim.x * kInternodeWarps, gw = blockIdx.x * kInternodeWarps + warp;
  const long long gtid = (long long)blockIdx.x * blockDim.x + threadIdx.x, gthreads = (long long)gridDim.x * blockDim.x;
  const InternodeLayout& lay = c.lay;
  const long long slot0 = (long long)c.node * mt;  // this node's slots in every receiver
  const int sc = a.scale_cols;  // also the stride of the scale rows
  const long long TK = (long long)a.T * a.K;
  for (int n = 0; n < N && TK > 0; ++n) {
    char* peer = c.peer_base[n];
    if (peer != nullptr) {
      if (a.ids) {
        long long* di = reinterpret_cast<long long*>(peer + lay.d_idx) + slot0 * a.K;
        for (long long j = gtid; j < TK; j += gthreads) di[j] = a.topk_idx[j];
      }
      if (a.weights != nullptr) {
        float* dw = reinterpret_cast<float*>(peer + lay.d_w) + slot0 * a.K;
        for (long long j = gtid; j < TK; j += gthreads) dw[j] = a.weights[j];
      }
    } else if (blockIdx.x == n % gridDim.x) {
      if (a.ids) nvshmemx_putmem_nbi_block(c.base + lay.d_idx + slot0 * a.K * 8, a.topk_idx, TK * 8, c.pe[n]);
      if (a.weights != nullptr)
        nvshmemx_putmem_nbi_block(c.base + lay.d_w + slot0 * a.K * 4, a.weights, TK * 4, c.pe[n]);
    }
  }
  const int experts_per_node = a.E / N;
  for (int t = gw; t < a.T; t += num_warps) {
    const long long e = lane < a.K ? a.topk_idx[(long long)t * a.K + lane] : -1;
    const unsigned long long mask = node_mask(e, a.E, experts_per_node);
    const char* xs = a.x + (long long)t * a.row_bytes;
    const long long row = slot0 + t;
    for (int i = 0; i < N; ++i) {
      const int n = (c.node + 1 + i + t) % N;
      if (!((mask >> n) & 1ull)) continue;
      char* peer = c.peer_base[n];
      if (peer != nullptr) {
        warp_copy16_deep<8>(reinterpret_cast<int4*>(peer + lay.d_x + row * a.row_bytes),
                             reinterpret_cast<const int4*>(xs), a.row_bytes / 16);
        float* ds = reinterpret_cast<float*>(peer + lay.d_s) + row * sc;
        for (int j = lane; j < sc; j += 32) ds[j] = a.scales[(long long)t * sc + j];
      } else {
        nvshmemx_putmem_nbi_warp(c.base + lay.d_x + row * a.row_bytes, xs, a.row_bytes, c.pe[n]);
        if (sc > 0)
          nvshmemx_putmem_nbi_warp(c.base + lay.d_s + row * sc * 4, a.scales + (long long)t * sc, sc * 4, c.pe[n]);
      }
    }
  }
  if (lay.staged) {
    __syncwarp();
    if (lane == 0) nvshmem_quiet();  // delivered before the signal
  }
}

// ------------------------------------------------------------------------------------- combine
// Send half (grid), after the release wait: each forwarded token's intranode sum (and weights) back
// to the slot (this node, token) of the rank it came from; a token with no expert on this node is
// not sent (its source does not wait for it).
__device__ __forceinline__ void combine_send_rows(const InternodeCtx& c, const InternodeCombineSendArgs& a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, N = c.lay.num_nodes, mt = c.lay.max_tokens;
  const int num_warps = gridDim.x * kInternodeWarps, gw = blockIdx.x * kInternodeWarps + warp;
  const InternodeLayout& lay = c.lay;
  for (long long row = gw; row < (long long)N * mt; row += num_warps) {
    const int n = (int)(row / mt), t = (int)(row % mt);
    if (t >= a.tokens[n]) continue;
    const bool mine = lane < a.K && a.local_idx[row * a.K + lane] >= 0;
    if (!__any_sync(kFull, mine)) continue;
    const long long slot = (long long)c.node * mt + t;
    const char* ys = a.y + row * a.row_bytes;
    char* peer = c.peer_base[n];
    if (peer != nullptr) {
      warp_copy16_deep<8>(reinterpret_cast<int4*>(peer + lay.c_y + slot * a.row_bytes),
                           reinterpret_cast<const int4*>(ys), a.row_bytes / 16);
      if (a.w != nullptr && lane < a.K)
        reinterpret_cast<float*>(peer + lay.c_w)[slot * a.K + lane] = __ldcg(a.w + row * a.K + lane);
    } else {
      nvshmemx_putmem_nbi_warp(c.base + lay.c_y + slot * a.row_bytes, ys, a.row_bytes, c.pe[n]);
      if (a.w != nullptr)
        nvshmemx_putmem_nbi_warp(c.base + lay.c_w + slot * a.K * 4, a.w + row * a.K, a.K * 4, c.pe[n]);
    }
  }
  if (lay.staged) {
    __syncwarp();
    if (lane == 0) nvshmem_quiet();
  }
}

template <bool kFp32>
__device__ __forceinline__ void add_word(float* acc, const int4& raw) {
  if constexpr (kFp32) {
    const float* f = reinterpret_cast<const float*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += f[i];
  } else {
    add_bf16x8(acc, raw);
  }
}

// y[t]: the biases, then each node's intranode sum added at the node's last slot of t (`node`:
// lane k's slot's node, -1 none; `ok` false: nothing arrived, only the biases). The order of
// DeepEP V2's reference: its scale-up partials, like its rank partials, join in the order of
// their last slot. Uniform trip count: the node shuffles run on every lane.
template <bool kFp32>
__device__ __forceinline__ void sum_slots(const InternodeCtx& c, const InternodeCombineRecvArgs& a, int t, int node,
                                          bool ok) {
  constexpr int kPer = kFp32 ? 4 : 8;  // elements per 16-byte word
  const int lane = threadIdx.x & 31, mt = c.lay.max_tokens, row_bytes = a.H * (kFp32 ? 4 : 2), nv = a.H / kPer;
  const char* slots = c.base + c.lay.c_y;
  const unsigned same = __match_any_sync(kFull, node);
  const unsigned ends = __ballot_sync(kFull, ok && node >= 0 && (same >> lane) == 1u);
  const int4* b0 = a.bias0 != nullptr ? static_cast<const int4*>(a.bias0) + (long long)t * nv : nullptr;
  const int4* b1 = a.bias1 != nullptr ? static_cast<const int4*>(a.bias1) + (long long)t * nv : nullptr;
  for (int v0 = 0; v0 < nv; v0 += 32) {
    const int v = v0 + lane;
    const bool in = v < nv;
    float acc[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] = 0.f;
    if (in && b0 != nullptr) add_word<kFp32>(acc, __ldg(b0 + v));
    if (in && b1 != nullptr) add_word<kFp32>(acc, __ldg(b1 + v));
    for (unsigned m = ends; m; m &= m - 1) {
      const int n = __shfl_sync(kFull, node, __ffs(m) - 1);
      if (in) add_word<kFp32>(acc, __ldcg(reinterpret_cast<const int4*>(slots + ((long long)n * mt + t) * row_bytes) + v));
    }
    if (!in) continue;
    int4 out;
    if constexpr (kFp32) {
      out = *reinterpret_cast<const int4*>(acc);
    } else {
      out = pack_bf16x8(acc);
    }
    reinterpret_cast<int4*>(static_cast<char*>(a.y) + (long long)t * row_bytes)[v] = out;
  }
}

// Receive half (grid): wait for every source node's sums, y[t] = the biases + the sums of the
// nodes token t went to (fp32, sum_slots' order), its weights likewise; the last block counts
// the call received and releases the slots to their senders at once.
__device__ __forceinline__ void combine_recv_sum(const InternodeCtx& c, const InternodeCombineRecvArgs& a, unsigned* counter) {
  __shared__ int tokens[kInternodeMaxNodes];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, N = c.lay.num_nodes, mt = c.lay.max_tokens;
  const int num_warps = gridDim.x * kInternodeWarps, gw = blockIdx.x * kInternodeWarps + warp;
  InternodeState* st = state_of(c);
  const long long call = *reinterpret_cast<volatile long long*>(&st->received[kInternodeCombine]) + 1;
  const bool ok = wait_sources(c, kInternodeCombine, call, kOpCombine, a.sig, tokens);
  const int experts_per_node = a.E / N;
  const float* wslots = reinterpret_cast<const float*>(c.base + c.lay.c_w);
  for (int t = gw; t < a.T; t += num_warps) {
    const long long e = lane < a.K ? a.topk_idx[(long long)t * a.K + lane] : -1;
    const unsigned long long mask = ok ? node_mask(e, a.E, experts_per_node) : 0ull;
    const int node = (e >= 0 && e < a.E) ? (int)(e / experts_per_node) : -1;
    if (a.fp32)
      sum_slots<true>(c, a, t, node, ok);
    else
      sum_slots<false>(c, a, t, node, ok);
    if (a.w != nullptr && lane < a.K) {
      float s = 0.f;
      for (unsigned long long m = mask; m; m &= m - 1) {
        const int n = __ffsll((long long)m) - 1;
        s += __ldcg(wslots + ((long long)n * mt + t) * a.K + lane);
      }
      a.w[(long long)t * a.K + lane] = s;
    }
  }
  finish_receive(c, kInternodeCombine, call, counter, true);
}

}  // namespace internode
}  // namespace mep
