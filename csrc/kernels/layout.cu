// Layout and notify: everything a dispatch needs to know before any row moves.
//
// notify runs in one block of 32 warps. Each warp owns a contiguous chunk of tokens and walks it
// in order, several tokens per step (32 / K), so that ranks within a (destination, expert) come
// out in source-token order without any sort: per-warp histograms give each warp's prefix, the
// count exchange gives each rank's prefix, and a second walk hands out rows. Positions are
// exact: every sender knows where each of its rows lands in every receiver.

#include "../device.cuh"
#include "api.h"

namespace mep {

constexpr int kNotifyWarps = 32;
constexpr int kNotifyThreads = kNotifyWarps * 32;
constexpr int kLayoutThreads = 256;
constexpr int kSteps = 8;  // tokens whose ids a notify warp loads together

// ------------------------------------------------------------------------------------- layout
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(const long long* __restrict__ topk_idx, int T, int K,
                                                                int E, int R, long long* tokens_per_rank,
                                                                long long* tokens_per_expert, bool* token_in_rank) {
  extern __shared__ int hist[];  // [E] experts, then [R] ranks
  for (int i = threadIdx.x; i < E + R; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const int L = E / R;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
    unsigned ranks = 0;  // R <= 32 in this kernel's contract
    for (int k = 0; k < K; ++k) {
      const long long e = topk_idx[(long long)t * K + k];
      if (e >= 0 && e < E) {
        atomicAdd(&hist[e], 1);
        ranks |= 1u << (e / L);
      }
    }
    for (int r = 0; r < R; ++r) {
      const bool in = (ranks >> r) & 1u;
      token_in_rank[(long long)t * R + r] = in;
      if (in) atomicAdd(&hist[E + r], 1);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < E; i += blockDim.x)
    if (hist[i]) atomicAdd(reinterpret_cast<unsigned long long*>(tokens_per_expert + i), (unsigned long long)hist[i]);
  for (int i = threadIdx.x; i < R; i += blockDim.x)
    if (hist[E + i]) atomicAdd(reinterpret_cast<unsigned long long*>(tokens_per_rank + i), (unsigned long long)hist[E + i]);
}

void launch_layout(const long long* topk_idx, int T, int K, int E, int R, long long* tokens_per_rank,
                   long long* tokens_per_expert, bool* token_in_rank, cudaStream_t stream) {
  const int blocks = T > 0 ? (T + kLayoutThreads - 1) / kLayoutThreads : 1;
  const int smem = (E + R) * (int)sizeof(int);
  layout_kernel<<<blocks < 132 ? blocks : 132, kLayoutThreads, smem, stream>>>(topk_idx, T, K, E, R, tokens_per_rank,
                                                                                tokens_per_expert, token_in_rank);
}

// ------------------------------------------------------------------------------------- notify
// Lane k of a warp holds slot k of one token (K <= 32). Experts within a token are distinct, so
// every lane can bump its own expert counter; a token counts once per rank through its first
// lane naming that rank (one ballot per rank: R <= 8). Match instructions are avoided: their
// cost grows with the number of distinct keys.
__device__ __forceinline__ long long load_slot(const long long* __restrict__ topk_idx, int t, int t_end, int K) {
  const int lane = lane_id();
  return (lane < K && t < t_end) ? topk_idx[(long long)t * K + lane] : -1;
}

// Exclusive prefix over the per-warp counts cnt[w * stride] (in place); returns the total.
__device__ __forceinline__ int warp_prefix(int* cnt, int stride) {
  int run = 0;
  for (int w = 0; w < kNotifyWarps; ++w) {
    const int v = cnt[w * stride];
    cnt[w * stride] = run;
    run += v;
  }
  return run;
}

__device__ __forceinline__ int pad_to(int n, int align) { return (n + align - 1) / align * align; }

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(Ctx c, NotifyArgs a) {
  extern __shared__ int smem[];
  const int E = a.E, R = c.num_ranks, rank = c.rank, L = E / R, K = a.K;
  int* cnt_e = smem;                               // [W][E]: per-warp counts, then running rows
  int* cnt_r = cnt_e + kNotifyWarps * E;           // [W][kMaxRanks]
  int* tot_e = cnt_r + kNotifyWarps * kMaxRanks;   // [E] totals over all ranks
  int* below_e = tot_e + E;                        // [E] totals over lower ranks
  int* seg_e = below_e + E;                        // [E] segment start of e in its rank's output
  int* peer_e = seg_e + E;                         // [R][E] every rank's per-expert counts
  __shared__ int rtot[kMaxRanks], rbase[kMaxRanks];
  const int tid = threadIdx.x, warp = tid >> 5, lane = lane_id();
  Control* me = ctrl_of(c, rank);
  const unsigned long long target = me->expected[kSlotNotify] + 1;

  for (int i = tid; i < kNotifyWarps * E; i += blockDim.x) cnt_e[i] = 0;
  for (int i = tid; i < kNotifyWarps * kMaxRanks; i += blockDim.x) cnt_r[i] = 0;
  __syncthreads();

  const int chunk = (a.T + kNotifyWarps - 1) / kNotifyWarps;
  const int t_begin = min(a.T, warp * chunk), t_end = min(a.T, t_begin + chunk);
  // pass 1: per-warp counts. The ids of kSteps tokens are loaded together: one dependent load
  // per token would leave each warp waiting a full memory latency per token.
  for (int t0 = t_begin; t0 < t_end; t0 += kSteps) {
    long long ids[kSteps];
#pragma unroll
    for (int b = 0; b < kSteps; ++b) ids[b] = load_slot(a.topk_idx, t0 + b, t_end, K);
#pragma unroll
    for (int b = 0; b < kSteps; ++b) {
      const bool valid = ids[b] >= 0 && ids[b] < E;  // ids were range-checked on the host unless check_inputs=False
      const int d = valid ? (int)ids[b] / L : -1;
      if (valid) cnt_e[warp * E + (int)ids[b]] += 1;
      for (int r = 0; r < R; ++r) {
        const unsigned m = __ballot_sync(0xffffffffu, d == r);
        if (m && lane == __ffs(m) - 1) cnt_r[warp * kMaxRanks + r] += 1;
      }
    }
  }
  __syncthreads();

  // warp prefixes (exclusive, in place) and this rank's totals
  for (int e = tid; e < E; e += blockDim.x) tot_e[e] = warp_prefix(cnt_e + e, E);
  if (tid < R) rtot[tid] = warp_prefix(cnt_r + tid, kMaxRanks);
  __syncthreads();

  // publish this rank's counts, then exchange
  int* my_counts = reinterpret_cast<int*>(region(c, rank) + c.lay.counts);
  for (int e = tid; e < E; e += blockDim.x) my_counts[kMaxRanks + e] = tot_e[e];
  if (tid < R) my_counts[tid] = rtot[tid];
  __threadfence_system();
  __syncthreads();
  if (tid == 0) signal_all(c, kSlotNotify);
  if (!block_wait_all(c, kSlotNotify, target)) return;  // the host block records why

  // every peer's counts at once (R * E independent remote loads), then per-expert sums
  for (int i = tid; i < R * E; i += blockDim.x) {
    const int s = i / E, e = i - s * E;
    peer_e[i] = ld_volatile(reinterpret_cast<const int*>(region(c, s) + c.lay.counts) + kMaxRanks + e);
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    int tot = 0, below = 0;
    for (int s = 0; s < R; ++s) {
      const int v = peer_e[s * E + e];
      tot += v;
      below += s < rank ? v : 0;
    }
    tot_e[e] = tot;
    below_e[e] = below;
  }
  if (tid < R) {
    int below = 0;
    for (int s = 0; s < rank; ++s) below += ld_volatile(reinterpret_cast<const int*>(region(c, s) + c.lay.counts) + tid);
    rbase[tid] = below;
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    const int first = (e / L) * L;
    int start = 0;
    for (int e2 = first; e2 < e; ++e2) start += pad_to(tot_e[e2], a.align);
    seg_e[e] = start;
  }
  __syncthreads();

  // this rank as a receiver: rank-major rows N, expert-major rows M, per-expert layout
  if (tid == 0) {
    int n = 0;
    for (int s = 0; s < R; ++s) n += ld_volatile(reinterpret_cast<const int*>(region(c, s) + c.lay.counts) + rank);
    const int last = rank * L + L - 1;
    const int m = seg_e[last] + pad_to(tot_e[last], a.align);
    a.recv_info[0] = n;
    a.recv_info[1] = m;
    a.recv_info[2] = L;
    c.host->num_rows = n;
    c.host->num_perm_rows = m;
  }
  for (int le = tid; le < L; le += blockDim.x) {
    const int e = rank * L + le;
    a.recv_info[3 + le] = tot_e[e];
    a.recv_info[3 + L + le] = pad_to(tot_e[e], a.align);
    a.recv_info[3 + 2 * L + le] = seg_e[e];
    if (le < kMaxExperts) c.host->expert_counts[le] = tot_e[e];
  }
  __threadfence_system();
  __syncthreads();
  if (tid == 0) c.host->tag = a.tag;  // the CPU may now size the outputs

  // running row counters for pass 2: destination prefix + lower ranks + lower warps
  for (int i = tid; i < kNotifyWarps * E; i += blockDim.x) {
    const int e = i % E;
    cnt_e[i] += seg_e[e] + below_e[e];
  }
  for (int i = tid; i < kNotifyWarps * kMaxRanks; i += blockDim.x) {
    const int d = i % kMaxRanks;
    if (d < R) cnt_r[i] += rbase[d];
  }
  for (long long i = tid; i < (long long)a.T * R; i += blockDim.x) a.rank_pos[i] = -1;
  __syncthreads();

  // pass 2: hand out rows in source-token order (each lane touches only its own counters)
  for (int t0 = t_begin; t0 < t_end; t0 += kSteps) {
    long long ids[kSteps];
#pragma unroll
    for (int b = 0; b < kSteps; ++b) ids[b] = load_slot(a.topk_idx, t0 + b, t_end, K);
#pragma unroll
    for (int b = 0; b < kSteps; ++b) {
      const int t = t0 + b;
      if (t >= t_end) break;  // warp-uniform
      const bool valid = ids[b] >= 0 && ids[b] < E;  // ids were range-checked on the host unless check_inputs=False
      const int d = valid ? (int)ids[b] / L : -1;
      if (lane < K) a.slot_pos[(long long)t * K + lane] = valid ? cnt_e[warp * E + (int)ids[b]]++ : -1;
      for (int r = 0; r < R; ++r) {
        const unsigned m = __ballot_sync(0xffffffffu, d == r);
        if (m && lane == __ffs(m) - 1) a.rank_pos[(long long)t * R + r] = cnt_r[warp * kMaxRanks + r]++;
      }
    }
  }
  __syncthreads();
  if (tid == 0) me->expected[kSlotNotify] = target;
}

int notify_smem_bytes(int E) { return (kNotifyWarps * E + kNotifyWarps * kMaxRanks + 3 * E + kMaxRanks * E) * (int)sizeof(int); }

void launch_notify(const Ctx& ctx, const NotifyArgs& args, cudaStream_t stream) {
  notify_kernel<<<1, kNotifyThreads, notify_smem_bytes(args.E), stream>>>(ctx, args);
}

}  // namespace mep

namespace mep {

void prepare_layout_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, layout_kernel);
  cudaFuncGetAttributes(&attr, notify_kernel);
  cudaFuncSetAttribute(notify_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, notify_smem_bytes(kMaxExperts));
}

}  // namespace mep
