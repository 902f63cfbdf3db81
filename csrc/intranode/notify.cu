// Intranode normal path: notify (counts, the call exchange, exact row positions), then every
// rank stages its inputs once in its own region and pulls the rows it needs straight from its
// peers' regions into its final outputs -- or, for rank-major outputs that lie in the regions'
// pools, every sender pushes its rows straight into the receivers' outputs.
//
// Sizes are fixed worst cases with exact offsets computed by notify, so there are no queues,
// credits or head/tail pointers: a call is exchange -> [stage ->] copy -> done, and every wait is
// bounded by a timeout. The first exchange of every call carries the ranks' call records
// (signature, status): nothing moves between ranks before all of them agreed.
//
// Expert-major dispatch reads each (token, rank) row once over the link and writes it from
// registers into every local expert segment that token names (send once, duplicate locally).
//
// This file: notify (counts, the call exchange, exact row positions).

#include "intranode/common.cuh"

namespace mep {

constexpr int kExchangeThreads = 1024;
constexpr int kSteps = 8;            // tokens whose ids a notify warp loads together
constexpr int kNotifyChunkMin = 16;  // tokens per notify warp, at least: short chains of dependent steps
constexpr int kNotifyWarps = 8;      // warps per notify block: a block sums its warps' counts in shared memory

__device__ __forceinline__ int pad_to(int n, int align) { return (n + align - 1) / align * align; }

// ------------------------------------------------------------------------------------- notify
// Tokens are cut into chunks, one warp each, in token order. Pass 1 counts per chunk, and a
// block of kNotifyWarps warps turns its warps' counts into per-chunk prefixes inside the block;
// the exchange block turns the blocks' totals into exclusive prefixes (a few L2 round trips,
// not one per chunk), publishes this rank's totals with its call record, checks every rank's
// record, and computes where each rank's rows start in every destination; pass 2 walks each
// chunk again in token order and hands out rows. Row order is therefore (destination expert or
// rank, source rank, source token) with no sort. Short chunks keep each warp's chain of
// dependent steps short (the 64-token chunks of one warp per block took 12 + 20 us at 4096
// tokens, count and positions). The scratch rows (int32,
// kScratchStride each): [0, chunks) each chunk's prefix inside its block, then [chunks, chunks +
// blocks) each block's totals (the exchange turns them into prefixes over blocks), then one row of
// bases (where this rank's rows start in each destination).
struct NotifyPlan {
  int blocks, chunks, chunk;
};
constexpr int kMaxNotifyChunks = (kMaxNotifyBlocks - 1) / (kNotifyWarps + 1) * kNotifyWarps;  // rows fit the scratch
inline NotifyPlan notify_plan(int T) {
  int chunks = (T + kNotifyChunkMin - 1) / kNotifyChunkMin;
  chunks = chunks < 1 ? 1 : (chunks > kMaxNotifyChunks ? kMaxNotifyChunks : chunks);
  const int blocks = (chunks + kNotifyWarps - 1) / kNotifyWarps;
  chunks = blocks * kNotifyWarps;
  const int chunk = (T + chunks - 1) / chunks;
  return {blocks, chunks, chunk < 1 ? 1 : chunk};
}

__device__ __forceinline__ int* scratch_of(const Ctx& c) { return at<int>(c, c.rank, c.lay.scratch); }
__device__ __forceinline__ int* counts_of(const Ctx& c, int r) { return at<int>(c, r, c.lay.counts); }

// Lane k holds slot k of token t (-1 past the chunk or past K).
__device__ __forceinline__ long long load_slot(const long long* __restrict__ topk_idx, int t, int t_end, int K) {
  const int lane = lane_id();
  return (lane < K && t < t_end) ? topk_idx[(long long)t * K + lane] : -1;
}

__global__ void __launch_bounds__(32 * kNotifyWarps) notify_count_kernel(Ctx c, NotifyArgs a, int chunk) {
  extern __shared__ int cnt_all[];  // per warp: [E] experts, then [R] ranks
  const int E = a.E, R = c.num_ranks, L = E / R, K = a.K, lane = lane_id(), warp = threadIdx.x / 32;
  const int cols = E + R, chunks = gridDim.x * kNotifyWarps;
  int* cnt = cnt_all + warp * cols;
  for (int i = threadIdx.x; i < kNotifyWarps * cols; i += blockDim.x) cnt_all[i] = 0;
  __syncthreads();
  const int w = blockIdx.x * kNotifyWarps + warp;
  const int t_begin = min(a.T, w * chunk), t_end = min(a.T, t_begin + chunk);
  for (int t0 = t_begin; t0 < t_end; t0 += kSteps) {
    long long ids[kSteps];  // loaded together: one dependent load per token would stall the warp
#pragma unroll
    for (int b = 0; b < kSteps; ++b) ids[b] = load_slot(a.topk_idx, t0 + b, t_end, K);
#pragma unroll
    for (int b = 0; b < kSteps; ++b) {
      const bool valid = ids[b] >= 0 && ids[b] < E;  // other ids count as unused slots
      if (valid) atomicAdd(&cnt[(int)ids[b]], 1);
      const unsigned ranks = __reduce_or_sync(kFull, valid ? 1u << ((int)ids[b] / L) : 0u);
      if (lane < R && ((ranks >> lane) & 1u)) cnt[E + lane] += 1;  // lane r alone owns rank r
    }
  }
  __syncthreads();
  // each chunk's prefix inside the block, and the block's totals
  int* scratch = scratch_of(c);
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    int run = 0;
#pragma unroll
    for (int v = 0; v < kNotifyWarps; ++v) {
      scratch[(long long)(blockIdx.x * kNotifyWarps + v) * kScratchStride + i] = run;
      run += cnt_all[v * cols + i];
    }
    scratch[(long long)(chunks + blockIdx.x) * kScratchStride + i] = run;
  }
}

int exchange_smem_bytes(int E, int R) { return (E + R + R * E + 3 * E) * (int)sizeof(int); }

__global__ void __launch_bounds__(kExchangeThreads, 1) notify_exchange_kernel(Ctx c, CallArgs call, NotifyArgs a,
                                                                              int blocks) {
  extern __shared__ int smem[];
  const int E = a.E, R = c.num_ranks, rank = c.rank, L = E / R, tid = threadIdx.x;
  int* tot = smem;             // [E + R]: this rank's totals, then (experts) every rank's
  int* all_e = tot + E + R;    // [R][E] every rank's per-expert counts
  int* below = all_e + R * E;  // [E] counts of the ranks below this one
  int* incl = below + E;       // [E] padded totals, inclusive scan
  int* seg = incl + E;         // [E] segment start inside the destination's output
  __shared__ int s_rcnt[kMaxRanks][kMaxRanks];  // [source][destination] tokens
  __shared__ int s_T[kMaxRanks], s_W[kMaxRanks];
  __shared__ int s_dropped;
  int* scratch = scratch_of(c);
  Control* me = ctrl_of(c, rank);
  const unsigned long long target = me->expected[kSlotCall] + 1;

  // the blocks' totals -> exclusive prefixes over blocks (in place), and this rank's totals; loads
  // batched so a column is not one dependent L2 round trip per block
  constexpr int kBatch = 8;
  const int chunks = blocks * kNotifyWarps;
  int* btot = scratch + (long long)chunks * kScratchStride;
  for (int i = tid; i < E + R; i += blockDim.x) {
    int run = 0;
    for (int b0 = 0; b0 < blocks; b0 += kBatch) {
      int v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = b0 + j < blocks ? btot[(long long)(b0 + j) * kScratchStride + i] : 0;
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (b0 + j < blocks) {
          btot[(long long)(b0 + j) * kScratchStride + i] = run;
          run += v[j];
        }
    }
    tot[i] = run;
  }
  __syncthreads();

  // publish counts, T and the call record; then the exchange
  int* mine = counts_of(c, rank);
  for (int e = tid; e < E; e += blockDim.x) mine[kMaxRanks + e] = tot[e];
  if (tid < R) mine[tid] = tot[E + tid];
  if (tid == 0) {
    mine[kMaxRanks + kMaxExperts] = a.T;
    mine[kMaxRanks + kMaxExperts + 1] = a.worst;
    write_record(c, call);
  }
  if (tid == 0) s_dropped = 0;
  __threadfence_system();
  __syncthreads();
  if (tid == 0) signal_all(c, kSlotCall);
  const int st = block_wait_call(c, kSlotCall, target, true);
  if (st < 0) return;  // the host block says why
  if (tid == 0) me->expected[kSlotCall] = target;
  if (st == 0) {  // aborted on every rank: wake the host, which reads the error first
    if (tid == 0) {
      a.recv_info[RecvInfo::kRows] = 0;
      a.recv_info[RecvInfo::kPermRows] = 0;
      a.recv_info[RecvInfo::kLocal] = L;
      a.recv_info[RecvInfo::kDropped] = 0;
      c.host->num_rows = -1;  // tells the host this call was aborted
      c.host->num_perm_rows = -1;
      for (int r = 0; r < R; ++r) a.row_limits[r] = 0;  // nothing was delivered
      for (int le = 0; le < L; ++le) a.out_tpe[le] = 0;
      *a.out_dropped = 0;
      __threadfence_system();
      c.host->tag = a.tag;
    }
    return;
  }

  // every rank's counts at once (independent remote loads)
  for (int i = tid; i < R * E; i += blockDim.x) {
    const int s = i / E, e = i - s * E;
    all_e[i] = ld_volatile(counts_of(c, s) + kMaxRanks + e);
  }
  for (int i = tid; i < R * R; i += blockDim.x) s_rcnt[i / R][i % R] = ld_volatile(counts_of(c, i / R) + i % R);
  if (tid < R) {
    s_T[tid] = ld_volatile(counts_of(c, tid) + kMaxRanks + kMaxExperts);
    s_W[tid] = ld_volatile(counts_of(c, tid) + kMaxRanks + kMaxExperts + 1);
    a.row_limits[tid] = s_W[tid] > 0 ? s_W[tid] : INT_MAX;  // each rank delivers its own worst-case rows
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    int t = 0, b = 0;
    for (int s = 0; s < R; ++s) {
      const int v = all_e[s * E + e];
      t += v;
      b += s < rank ? v : 0;
    }
    tot[e] = t;
    below[e] = b;
    incl[e] = pad_to(t, a.align);
  }
  __syncthreads();
  for (int off = 1; off < E; off <<= 1) {  // inclusive scan of the padded totals (E <= blockDim)
    const int v = (tid < E && tid >= off) ? incl[tid - off] : 0;
    __syncthreads();
    if (tid < E) incl[tid] += v;
    __syncthreads();
  }
  for (int e = tid; e < E; e += blockDim.x) {
    const int first = (e / L) * L;
    seg[e] = incl[e] - pad_to(tot[e], a.align) - (first > 0 ? incl[first - 1] : 0);
  }
  __syncthreads();

  // receive layout of this rank, and what the group needs
  const int W = a.worst;
  for (int le = tid; le < L; le += blockDim.x) {
    const int e = rank * L + le;
    const int cnt = tot[e], s0 = seg[e], padded = pad_to(cnt, a.align);
    const int seg_len = W > 0 ? min(s0 + padded, W) - min(s0, W) : padded;
    a.recv_info[RecvInfo::counts(L) + le] = cnt;
    a.recv_info[RecvInfo::padded(L) + le] = seg_len;
    a.recv_info[RecvInfo::seg_start(L) + le] = s0;
    a.out_tpe[le] = a.permute ? seg_len : (W > 0 ? 0 : cnt);
    if (W > 0 && a.permute) {
      const int lost = s0 + cnt - max(s0, W);
      if (lost > 0) atomicAdd(&s_dropped, lost);
    }
    c.host->expert_counts[le] = cnt;
  }
  // base rows for pass 2: expert e -> its segment + lower ranks; rank d -> lower ranks' rows
  int* base = scratch + (long long)(chunks + blocks) * kScratchStride;
  for (int e = tid; e < E; e += blockDim.x) base[e] = seg[e] + below[e];
  if (tid < R) {
    int b = 0;
    for (int s = 0; s < rank; ++s) b += s_rcnt[s][tid];
    base[E + tid] = b;
  }
  __syncthreads();
  if (tid == 0) {
    int n_max = 0, m_max = 0, t_max = 0, n_mine = 0, m_mine = 0;
    for (int d = 0; d < R; ++d) {
      int n = 0;
      for (int s = 0; s < R; ++s) n += s_rcnt[s][d];
      const int m = incl[d * L + L - 1] - (d > 0 ? incl[d * L - 1] : 0);
      n_max = max(n_max, n);
      m_max = max(m_max, m);
      t_max = max(t_max, s_T[d]);
      if (d == rank) n_mine = n, m_mine = m;
    }
    int dropped = 0;
    if (W > 0) dropped = a.permute ? s_dropped : max(0, n_mine - W);
    a.recv_info[RecvInfo::kRows] = n_mine;
    a.recv_info[RecvInfo::kPermRows] = m_mine;
    a.recv_info[RecvInfo::kLocal] = L;
    a.recv_info[RecvInfo::kDropped] = dropped;
    *a.out_dropped = dropped;
    c.host->num_rows = n_mine;
    c.host->num_perm_rows = m_mine;
    c.host->need_tokens = t_max;
    c.host->need_rows = n_max;
    c.host->need_perm_rows = m_max;
  }
  __threadfence_system();
  __syncthreads();
  if (tid == 0) c.host->tag = a.tag;  // the CPU may now size the outputs
}

__global__ void __launch_bounds__(32 * kNotifyWarps) notify_positions_kernel(Ctx c, NotifyArgs a, int chunk,
                                                                              int blocks) {
  extern __shared__ int run_all[];  // per warp: [E] running row of each expert, then [R] of each rank
  const int E = a.E, R = c.num_ranks, L = E / R, K = a.K, lane = lane_id(), warp = threadIdx.x / 32;
  const int w = blockIdx.x * kNotifyWarps + warp, chunks = blocks * kNotifyWarps;
  int* run = run_all + warp * (E + R);
  const int t_begin = min(a.T, w * chunk), t_end = min(a.T, t_begin + chunk);
  if (call_aborted(c)) {  // no positions: whatever later uses them skips every row
    for (long long i = (long long)t_begin * K + lane; i < (long long)t_end * K; i += 32) a.slot_pos[i] = -1;
    for (long long i = (long long)t_begin * R + lane; i < (long long)t_end * R; i += 32) a.rank_pos[i] = -1;
    return;
  }
  const int* scratch = scratch_of(c);
  const int* prefix = scratch + (long long)w * kScratchStride;                         // inside the block
  const int* bprefix = scratch + (long long)(chunks + blockIdx.x) * kScratchStride;   // over the blocks
  const int* base = scratch + (long long)(chunks + blocks) * kScratchStride;
  for (int i = lane; i < E + R; i += 32) run[i] = prefix[i] + bprefix[i] + base[i];
  __syncwarp();
  for (int t0 = t_begin; t0 < t_end; t0 += kSteps) {
    long long ids[kSteps];
#pragma unroll
    for (int b = 0; b < kSteps; ++b) ids[b] = load_slot(a.topk_idx, t0 + b, t_end, K);
#pragma unroll
    for (int b = 0; b < kSteps; ++b) {
      const int t = t0 + b;
      if (t >= t_end) break;  // warp-uniform
      const bool valid = ids[b] >= 0 && ids[b] < E;
      const int pos = valid ? atomicAdd(&run[(int)ids[b]], 1) : -1;
      if (lane < K) a.slot_pos[(long long)t * K + lane] = pos;
      const unsigned ranks = __reduce_or_sync(kFull, valid ? 1u << ((int)ids[b] / L) : 0u);
      if (lane < R) a.rank_pos[(long long)t * R + lane] = ((ranks >> lane) & 1u) ? run[E + lane]++ : -1;
    }
  }
}

void launch_notify(const Ctx& ctx, const CallArgs& call, const NotifyArgs& args, cudaStream_t stream) {
  const NotifyPlan p = notify_plan(args.T);
  const int R = ctx.num_ranks;
  const int hist = kNotifyWarps * (args.E + R) * (int)sizeof(int);  // per warp: E + R counters
  notify_count_kernel<<<p.blocks, 32 * kNotifyWarps, hist, stream>>>(ctx, args, p.chunk);
  notify_exchange_kernel<<<1, kExchangeThreads, exchange_smem_bytes(args.E, R), stream>>>(ctx, call, args, p.blocks);
  notify_positions_kernel<<<p.blocks, 32 * kNotifyWarps, hist, stream>>>(ctx, args, p.chunk, p.blocks);
}

void prepare_notify_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, notify_count_kernel);
  cudaFuncGetAttributes(&attr, notify_exchange_kernel);
  cudaFuncGetAttributes(&attr, notify_positions_kernel);
  cudaFuncSetAttribute(notify_exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       exchange_smem_bytes(kMaxExperts, kMaxRanks));
}

}  // namespace mep
