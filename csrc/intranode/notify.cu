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
constexpr int kSteps = 8;  // tokens whose ids a notify warp loads together

__device__ __forceinline__ int pad_to(int n, int align) { return (n + align - 1) / align * align; }

// ------------------------------------------------------------------------------------- notify
// Tokens are cut into chunks, one warp each, in token order (notify_plan, csrc/ipc/region_layout.h:
// G token groups of T / G tokens, each cut into blocks of kNotifyWarps chunks, so neither a chunk
// nor a block straddles a group). Pass 1 counts per chunk, and a block turns its warps' counts
// into per-chunk prefixes inside the block; the exchange block turns the blocks' totals into
// exclusive prefixes inside each group (a few L2 round trips, not one per chunk), publishes this
// rank's per-group totals with its call record, checks every rank's record, and computes where
// each group's rows of this rank start in every destination: after the rows of every earlier
// group (all ranks), then after those of the lower ranks in the same group. Pass 2 walks each
// chunk again in token order and hands out rows. Row order is therefore (destination expert or
// rank, token group, source rank, source token) with no sort; with one group (the intranode
// Buffer) that is (destination, source rank, source token). The internode path's intranode stage
// takes one group per source node, which makes its rows' order the contract's (source node, source
// rank inside the node, token), so it needs no reorder pass afterwards. Short chunks keep each
// warp's chain of dependent steps short (the 64-token chunks of one warp per block took 12 + 20
// us at 4096 tokens, count and positions). The scratch rows: see region_layout.h.
__device__ __forceinline__ int* scratch_of(const Ctx& c) { return at<int>(c, c.rank, c.lay.scratch); }
__device__ __forceinline__ int* counts_of(const Ctx& c, int r) { return at<int>(c, r, c.lay.counts); }

// Warp `w` of the grid: its token group and its chunk of tokens [t_begin, t_end) inside it.
struct ChunkSpan {
  int group, t_begin, t_end;
};
__device__ __forceinline__ ChunkSpan chunk_span(const NotifyArgs& a, const NotifyPlan& p, int w) {
  const int per_group = p.chunks / p.groups, g = w / per_group, j = w - g * per_group;
  const int Tg = a.T / p.groups, first = g * Tg;
  return {g, first + min(Tg, j * p.chunk), first + min(Tg, j * p.chunk + p.chunk)};
}

// Lane k holds slot k of token t (-1 past the chunk or past K).
__device__ __forceinline__ long long load_slot(const long long* __restrict__ topk_idx, int t, int t_end, int K) {
  const int lane = lane_id();
  return (lane < K && t < t_end) ? topk_idx[(long long)t * K + lane] : -1;
}

// NotifyArgs::check, one token per warp call (lane k holds slot k): an id that is neither -1 nor an
// expert, or an expert an earlier slot of the token names already, is a bad slot; the token's
// first one is offered for the call's first (Control::bad_key keeps the largest T * K - slot, so
// the lowest slot). Checked here, where the ids are read anyway: the exchange kernel then
// publishes this rank's record as failed, so every rank aborts the call at the exchange, before
// any row moves, and learns it with the sizes its host waits for (no extra sync).
__device__ __forceinline__ void flag_bad_slot(const Ctx& c, const NotifyArgs& a, int t, long long id, bool valid) {
  const int lane = lane_id();
  const unsigned bad_lanes = bad_slot_lanes(id, valid, lane < a.K && t < a.T);
  if (bad_lanes != 0u && lane == __ffs(bad_lanes) - 1) {
    const long long slot = (long long)t * a.K + lane;
    atomicMax(&ctrl_of(c, c.rank)->bad_key, (unsigned long long)((long long)a.T * a.K - slot));
  }
}

// Pass 1 of notify block `block` (its kNotifyWarps warps count; the block's other warps, in the
// one-block kernel, only join its barriers). cnt_all: dynamic shared memory, per warp [E] experts,
// then [R] ranks.
__device__ __forceinline__ void count_step(const Ctx& c, const NotifyArgs& a, const NotifyPlan& p, int* cnt_all,
                                           int block) {
  const int E = a.E, R = c.num_ranks, L = E / R, K = a.K, lane = lane_id(), warp = threadIdx.x / 32;
  const int cols = E + R;
  int* cnt = cnt_all + warp * cols;
  for (int i = threadIdx.x; i < kNotifyWarps * cols; i += blockDim.x) cnt_all[i] = 0;
  __syncthreads();
  const ChunkSpan span = warp < kNotifyWarps ? chunk_span(a, p, block * kNotifyWarps + warp) : ChunkSpan{0, 0, 0};
  for (int t0 = span.t_begin; t0 < span.t_end; t0 += kSteps) {
    long long ids[kSteps];  // loaded together: one dependent load per token would stall the warp
#pragma unroll
    for (int b = 0; b < kSteps; ++b) ids[b] = load_slot(a.topk_idx, t0 + b, span.t_end, K);
    if (a.topk_copy != nullptr) {  // every token is counted once, by one warp: its copy is written here
#pragma unroll
      for (int b = 0; b < kSteps; ++b)
        if (lane < K && t0 + b < span.t_end) a.topk_copy[(long long)(t0 + b) * K + lane] = ids[b];
    }
#pragma unroll
    for (int b = 0; b < kSteps; ++b) {
      const bool valid = ids[b] >= 0 && ids[b] < E;  // other ids count as unused slots
      if (valid) atomicAdd(&cnt[(int)ids[b]], 1);
      const unsigned ranks = __reduce_or_sync(kFull, valid ? 1u << ((int)ids[b] / L) : 0u);
      if (lane < R && ((ranks >> lane) & 1u)) cnt[E + lane] += 1;  // lane r alone owns rank r
      if (a.check) flag_bad_slot(c, a, t0 + b, ids[b], valid);
    }
  }
  __syncthreads();
  // each chunk's prefix inside the block, and the block's totals
  int* scratch = scratch_of(c);
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    int run = 0;
#pragma unroll
    for (int v = 0; v < kNotifyWarps; ++v) {
      scratch[(long long)(block * kNotifyWarps + v) * kScratchStride + i] = run;
      run += cnt_all[v * cols + i];
    }
    scratch[(long long)(p.chunks + block) * kScratchStride + i] = run;
  }
}

__global__ void __launch_bounds__(32 * kNotifyWarps) notify_count_kernel(Ctx c, NotifyArgs a, NotifyPlan p) {
  extern __shared__ int cnt_all[];
  count_step(c, a, p, cnt_all, blockIdx.x);
}

// The exchange block's dynamic shared memory, in ints: every rank's rows per (group, expert)
// [R][G * E] and their sums over the ranks [G * E]; per expert the total, the padded scan and the
// segment start [3][E]; every rank's tokens per (group, destination rank) [R][G * R] and their
// sums over the ranks [G * R].
constexpr int exchange_smem_ints(int GE, int E, int R, int G) { return R * GE + GE + 3 * E + R * G * R + G * R; }
int exchange_smem_bytes(int E, int R, int G) { return exchange_smem_ints(G * E, E, R, G) * (int)sizeof(int); }
// The most any call needs (G * E <= kMaxExperts, E <= kMaxExperts, G <= kMaxTokenGroups).
constexpr int kExchangeSmemMax = exchange_smem_ints(kMaxExperts, kMaxExperts, kMaxRanks, kMaxTokenGroups) * 4;

// The exchange, by one block of kExchangeThreads (smem: exchange_smem_bytes); returns early, the
// whole block alike, where the call failed here or was aborted on every rank (the positions step
// that follows then hands out none).
__device__ __forceinline__ void exchange_step(const Ctx& c, const CallArgs& call, const NotifyArgs& a,
                                              const NotifyPlan& p, int* smem) {
  const int E = a.E, R = c.num_ranks, rank = c.rank, L = E / R, tid = threadIdx.x;
  const int G = p.groups, GE = G * E, GR = G * R;
  int* all_e = smem;            // [R][G * E] every rank's rows per (group, expert)
  int* col_e = all_e + R * GE;  // [G * E] their sums over the ranks
  int* tot = col_e + GE;        // [E] rows per expert
  int* incl = tot + E;          // [E] padded totals, inclusive scan
  int* seg = incl + E;          // [E] segment start inside the destination's output
  int* all_r = seg + E;         // [R][G * R] every rank's tokens per (group, destination rank)
  int* col_r = all_r + R * GR;  // [G * R] their sums over the ranks
  __shared__ int s_T[kMaxRanks], s_W[kMaxRanks], s_rows[kMaxRanks];
  __shared__ int s_dropped;
  int* scratch = scratch_of(c);
  Control* me = ctrl_of(c, rank);
  const unsigned long long target = me->expected[kSlotCall] + 1;

  // the blocks' totals -> exclusive prefixes over the blocks of their group (in place), and this
  // rank's per-group totals into its counts area; loads batched so a column is not one dependent
  // L2 round trip per block
  constexpr int kBatch = 8;
  const int cols = E + R, per_group = p.blocks / G;
  int* btot = scratch + (long long)p.chunks * kScratchStride;
  int* mine = counts_of(c, rank);
  for (int k = tid; k < G * cols; k += blockDim.x) {
    const int g = k / cols, i = k - g * cols;
    int* col = btot + (long long)g * per_group * kScratchStride + i;
    int run = 0;
    for (int b0 = 0; b0 < per_group; b0 += kBatch) {
      int v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = b0 + j < per_group ? col[(long long)(b0 + j) * kScratchStride] : 0;
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (b0 + j < per_group) {
          col[(long long)(b0 + j) * kScratchStride] = run;
          run += v[j];
        }
    }
    mine[i < E ? kCountsExperts + g * E + i : kCountsRanks + g * kMaxRanks + (i - E)] = run;
  }

  // publish T and the call record with the counts; then the exchange
  if (tid == 0) {
    mine[kCountsT] = a.T;
    mine[kCountsWorst] = a.worst;
    write_record(c, call);
    s_dropped = 0;
    // the count kernel's first bad slot (NotifyArgs::check), reset for the next call's: this
    // rank's host reads the slot (it words its own error from the ids), the peers the record's
    // message (PeerFailedError)
    const unsigned long long bad_key = me->bad_key;
    me->bad_key = 0ull;
    c.host->bad_slot = bad_key != 0ull ? (long long)a.T * a.K - (long long)bad_key : -1;
    if (bad_key != 0ull) {
      CallRecord* rec = record_of(c, rank);
      constexpr char kMsg[] = "ValueError: topk_idx names an expert id outside [-1, num_experts) or one expert "
                              "twice in a token";
      int n = 0;
      for (; kMsg[n] != '\0' && n < kMsgBytes; ++n) rec->msg[n] = kMsg[n];
      rec->msg_len = n;
      rec->status = kCallFailed;
    }
  }
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

  // every rank's per-group counts at once (independent remote loads)
  for (int i = tid; i < R * GE; i += blockDim.x) {
    const int s = i / GE, k = i - s * GE;
    all_e[i] = ld_volatile(counts_of(c, s) + kCountsExperts + k);
  }
  for (int i = tid; i < R * GR; i += blockDim.x) {
    const int s = i / GR, k = i - s * GR, g = k / R, d = k - g * R;
    all_r[i] = ld_volatile(counts_of(c, s) + kCountsRanks + g * kMaxRanks + d);
  }
  if (tid < R) {
    s_T[tid] = ld_volatile(counts_of(c, tid) + kCountsT);
    s_W[tid] = ld_volatile(counts_of(c, tid) + kCountsWorst);
    a.row_limits[tid] = s_W[tid] > 0 ? s_W[tid] : INT_MAX;  // each rank delivers its own worst-case rows
  }
  __syncthreads();
  for (int k = tid; k < GE; k += blockDim.x) {
    int t = 0;
    for (int s = 0; s < R; ++s) t += all_e[s * GE + k];
    col_e[k] = t;
  }
  for (int k = tid; k < GR; k += blockDim.x) {
    int t = 0;
    for (int s = 0; s < R; ++s) t += all_r[s * GR + k];
    col_r[k] = t;
  }
  if (a.rank_counts != nullptr)  // every (group, source rank)'s tokens per destination rank
    for (int i = tid; i < GR * R; i += blockDim.x) {
      const int gs = i / R, d = i - gs * R, g = gs / R, s = gs - g * R;
      a.rank_counts[i] = all_r[s * GR + g * R + d];
    }
  if (a.rank_prefix != nullptr)  // and their inclusive prefix over the rows (at most G * R terms each)
    for (int i = tid; i < GR * R; i += blockDim.x) {
      const int gs = i / R, d = i - gs * R;
      int t = 0;
      for (int r = 0; r <= gs; ++r) {
        const int g = r / R, s = r - g * R;
        t += all_r[s * GR + g * R + d];
      }
      a.rank_prefix[i] = t;
    }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    int t = 0;
    for (int g = 0; g < G; ++g) t += col_e[g * E + e];
    tot[e] = t;
    incl[e] = pad_to(t, a.align);
  }
  if (tid < R) {
    int n = 0;
    for (int g = 0; g < G; ++g) n += col_r[g * R + tid];
    s_rows[tid] = n;
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
  // base rows for pass 2, one per group: expert e -> its segment + the rows of the earlier groups
  // (every rank) + the group's rows of the lower ranks; rank d -> the same without a segment
  int* base = scratch + (long long)(p.chunks + p.blocks) * kScratchStride;
  for (int k = tid; k < GE; k += blockDim.x) {
    const int g = k / E, e = k - g * E;
    int b = seg[e];
    for (int h = 0; h < g; ++h) b += col_e[h * E + e];
    for (int s = 0; s < rank; ++s) b += all_e[s * GE + k];
    base[(long long)g * kScratchStride + e] = b;
  }
  for (int k = tid; k < GR; k += blockDim.x) {
    const int g = k / R, d = k - g * R;
    int b = 0;
    for (int h = 0; h < g; ++h) b += col_r[h * R + d];
    for (int s = 0; s < rank; ++s) b += all_r[s * GR + k];
    base[(long long)g * kScratchStride + E + d] = b;
  }
  __syncthreads();
  if (tid == 0) {
    int n_max = 0, m_max = 0, t_max = 0, n_mine = 0, m_mine = 0;
    for (int d = 0; d < R; ++d) {
      const int n = s_rows[d];
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

// Pass 2 of notify block `block`, by its kNotifyWarps warps (a warp past them returns at once: no
// block barrier follows). run_all: dynamic shared memory, per warp [E] running row of each
// expert, then [R] of each rank.
__device__ __forceinline__ void positions_step(const Ctx& c, const NotifyArgs& a, const NotifyPlan& p, int* run_all,
                                               int block) {
  const int E = a.E, R = c.num_ranks, L = E / R, K = a.K, lane = lane_id(), warp = threadIdx.x / 32;
  if (warp >= kNotifyWarps) return;
  const int w = block * kNotifyWarps + warp;
  int* run = run_all + warp * (E + R);
  const ChunkSpan span = chunk_span(a, p, w);
  const int t_begin = span.t_begin, t_end = span.t_end;
  if (call_aborted(c)) {  // no positions: whatever later uses them skips every row
    for (long long i = (long long)t_begin * K + lane; i < (long long)t_end * K; i += 32) a.slot_pos[i] = -1;
    for (long long i = (long long)t_begin * R + lane; i < (long long)t_end * R; i += 32) a.rank_pos[i] = -1;
    return;
  }
  const int* scratch = scratch_of(c);
  const int* prefix = scratch + (long long)w * kScratchStride;                                  // inside the block
  const int* bprefix = scratch + (long long)(p.chunks + block) * kScratchStride;                // over the group's blocks
  const int* base = scratch + (long long)(p.chunks + p.blocks + span.group) * kScratchStride;  // the group's bases
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

__global__ void __launch_bounds__(32 * kNotifyWarps) notify_positions_kernel(Ctx c, NotifyArgs a, NotifyPlan p) {
  extern __shared__ int run_all[];
  positions_step(c, a, p, run_all, blockIdx.x);
}

__global__ void __launch_bounds__(kExchangeThreads, 1) notify_exchange_kernel(Ctx c, CallArgs call, NotifyArgs a,
                                                                              NotifyPlan p) {
  extern __shared__ int smem[];
  exchange_step(c, call, a, p, smem);
}

// A plan of one block (up to kNotifyWarps * kNotifyChunkMin tokens, one group): the three steps in
// one launch, the shared memory of each step reused by the next. Two launches less on the host,
// and no kernel boundary between the counts, the exchange and the positions on the GPU.
__global__ void __launch_bounds__(kExchangeThreads, 1) notify_one_block_kernel(Ctx c, CallArgs call, NotifyArgs a,
                                                                               NotifyPlan p) {
  extern __shared__ int smem[];
  count_step(c, a, p, smem, 0);
  __syncthreads();  // the scratch's prefixes, and the counters' shared memory free for the exchange
  exchange_step(c, call, a, p, smem);
  __syncthreads();  // the scratch's bases (a failed or aborted exchange: the positions step hands out none)
  positions_step(c, a, p, smem, 0);
}

constexpr int kHistBytesMax = kNotifyWarps * (kMaxExperts + kMaxRanks) * (int)sizeof(int);

void launch_notify(const Ctx& ctx, const CallArgs& call, const NotifyArgs& args, cudaStream_t stream) {
  const NotifyPlan p = notify_plan(args.T, args.groups);
  const int R = ctx.num_ranks;
  const int hist = kNotifyWarps * (args.E + R) * (int)sizeof(int);  // per warp: E + R counters
  const int exchange = exchange_smem_bytes(args.E, R, p.groups);
  if (p.blocks == 1) {
    notify_one_block_kernel<<<1, kExchangeThreads, std::max(hist, exchange), stream>>>(ctx, call, args, p);
    return;
  }
  notify_count_kernel<<<p.blocks, 32 * kNotifyWarps, hist, stream>>>(ctx, args, p);
  notify_exchange_kernel<<<1, kExchangeThreads, exchange, stream>>>(ctx, call, args, p);
  notify_positions_kernel<<<p.blocks, 32 * kNotifyWarps, hist, stream>>>(ctx, args, p);
}

void prepare_notify_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, notify_count_kernel);
  cudaFuncGetAttributes(&attr, notify_exchange_kernel);
  cudaFuncGetAttributes(&attr, notify_positions_kernel);
  cudaFuncGetAttributes(&attr, notify_one_block_kernel);
  cudaFuncSetAttribute(notify_exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kExchangeSmemMax);
  cudaFuncSetAttribute(notify_one_block_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       std::max(kExchangeSmemMax, kHistBytesMax));
}

}  // namespace mep
