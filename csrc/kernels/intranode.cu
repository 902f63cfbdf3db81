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

#include <cuda_bf16.h>

#include <climits>

#include "../device.cuh"
#include "api.h"

namespace mep {

constexpr int kCopyThreads = 512;
constexpr int kCopyWarps = kCopyThreads / 32;
constexpr int kExchangeThreads = 1024;
constexpr int kSteps = 8;            // tokens whose ids a notify warp loads together
constexpr int kNotifyChunkMin = 16;  // tokens per notify warp, at least: short chains of dependent steps
constexpr int kNotifyWarps = 8;      // warps per notify block: a block sums its warps' counts in shared memory
constexpr unsigned kFull = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T* at(const Ctx& c, int r, long long off) {
  return reinterpret_cast<T*>(region(c, r) + off);
}

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

// ------------------------------------------------------------------------------------- stage
// Copy this rank's dispatch inputs into its region (grid-stride; every block takes a share).
__device__ __forceinline__ void stage_body(const Ctx& c, const StageArgs& a) {
  const int R = c.num_ranks;
  const long long gtid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long nthreads = (long long)gridDim.x * blockDim.x;
  if (a.x != nullptr)  // row_bytes % 16 == 0 (host check)
    grid_copy16<8>(at<int4>(c, c.rank, c.lay.stage_x), reinterpret_cast<const int4*>(a.x), (long long)a.T * a.row_bytes / 16);
  if (a.scales != nullptr) {
    float* dst = at<float>(c, c.rank, c.lay.stage_scales);
    for (long long i = gtid; i < (long long)a.T * a.scale_cols; i += nthreads) dst[i] = a.scales[i];
  }
  int* sidx = at<int>(c, c.rank, c.lay.stage_idx);
  int* sspos = at<int>(c, c.rank, c.lay.stage_spos);
  float* sw = at<float>(c, c.rank, c.lay.stage_w);
  for (long long i = gtid; i < (long long)a.T * a.K; i += nthreads) {
    const long long e = a.topk_idx[i];
    sidx[i] = (e >= 0 && e < INT_MAX) ? (int)e : -1;
    sspos[i] = a.slot_pos[i];
    if (a.topk_w != nullptr) sw[i] = a.topk_w[i];
  }
  int* srpos = at<int>(c, c.rank, c.lay.stage_rpos);
  for (long long i = gtid; i < (long long)a.T * R; i += nthreads) srpos[i] = a.rank_pos[i];
  if (gtid == 0) {
    Control* me = ctrl_of(c, c.rank);
    me->num_tokens = a.T;
    me->has_weights = a.topk_w != nullptr;
  }
}

__global__ void __launch_bounds__(kCopyThreads, 1) stage_kernel(Ctx c, CallArgs call, int slot, StageArgs a) {
  if (call_aborted(c)) return;
  stage_body(c, a);
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridStage)) {
    if (slot == kSlotCall) write_record(c, call);
    signal_all(c, slot);
  }
}

void launch_stage(const Ctx& ctx, const CallArgs& call, int slot, const StageArgs& args, int num_blocks,
                  cudaStream_t stream) {
  stage_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, slot, args);
}

// ---------------------------------------------------------------------------------- dispatch
// Copy one row from `src` to every row listed by the lanes in `dests` (positions in `pos`).
__device__ __forceinline__ void copy_row_multi(char* out, int row_bytes, const char* src, unsigned dests, int pos) {
  constexpr int U = 8;  // 4 KB in flight per warp
  const int lane = lane_id();
  const int n16 = row_bytes >> 4;
  const int4* s16 = reinterpret_cast<const int4*>(src);
  for (int it = 0; it * 32 * U < n16; ++it) {  // uniform trip count: shuffles inside
    const int base = it * 32 * U + lane;
    int4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (base + j * 32 < n16) v[j] = __ldcg(s16 + base + j * 32);
    for (unsigned m = dests; m; m &= m - 1) {
      const int p = __shfl_sync(kFull, pos, __ffs(m) - 1);
      int4* d16 = reinterpret_cast<int4*>(out + (long long)p * row_bytes);
#pragma unroll
      for (int j = 0; j < U; ++j)
        if (base + j * 32 < n16) d16[base + j * 32] = v[j];
    }
  }
}

__device__ __forceinline__ bool is_pad_row(const int* info, int L, int row) {
  // rows past M, or inside expert le's segment past its count
  if (row >= info[RecvInfo::kPermRows]) return true;
  const int* seg = info + RecvInfo::seg_start(L);
  int lo = 0, hi = L - 1;
  while (lo < hi) {  // last le with seg[le] <= row
    const int mid = (lo + hi + 1) >> 1;
    if (seg[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return row - seg[lo] >= info[RecvInfo::counts(L) + lo];
}

// Zero rows of the outputs that carry no data: expert segments past their counts and worst-case
// rows past N / M (one warp per row).
__device__ __forceinline__ void fill_padding(const DispatchArgs& a, int gw, int tw) {
  const int* info = a.recv_info;
  const int L = info[RecvInfo::kLocal], lane = lane_id(), K = a.K;
  const int valid_rows = a.permute ? info[RecvInfo::kPermRows] : info[RecvInfo::kRows];
  for (int row = gw; row < a.out_rows; row += tw) {
    const bool pad = a.permute ? is_pad_row(info, L, row) : row >= valid_rows;
    if (!pad) continue;
    warp_zero_bytes(a.out_x + (long long)row * a.row_bytes, a.row_bytes);
    if (a.out_scales != nullptr) warp_zero_bytes(reinterpret_cast<char*>(a.out_scales + (long long)row * a.scale_cols), a.scale_cols * 4);
    if (!a.permute) {
      if (lane < K) {
        a.out_idx[(long long)row * K + lane] = -1;
        if (a.out_w != nullptr) a.out_w[(long long)row * K + lane] = 0.f;
      }
    } else if (lane == 0) {
      if (a.out_w != nullptr) a.out_w[row] = 0.f;
      a.out_row_expert[row] = -1;
    }
  }
}

// Pull every row bound for this rank from the peers' staging into the outputs, and fill the
// padding. Called once the peers' staging is known to be complete. Positions >= out_rows are
// not written (num_worst_tokens; notify counted them).
__device__ __forceinline__ void pull_body(const Ctx& c, const DispatchArgs& a) {
  __shared__ int s_tok[kMaxRanks + 1];  // prefix of the peers' token counts
  const int R = c.num_ranks, rank = c.rank, L = a.E / R, K = a.K;
  if (threadIdx.x == 0) {
    s_tok[0] = 0;
    for (int s = 0; s < R; ++s) s_tok[s + 1] = s_tok[s] + ld_volatile(&ctrl_of(c, s)->num_tokens);
  }
  __syncthreads();

  const int lane = lane_id();
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const int total = s_tok[R];
  // Each warp scans 32 source tokens at a time and copies the ones bound for this rank. Loads
  // are issued one step ahead: the next group's row positions while this group is copied, and
  // the next hit's slot metadata while this hit's row is copied.
  auto scan = [&](int g, int& s, int& t, int& rp) {
    const int u = g + lane;
    s = 0, t = 0, rp = -1;
    if (u < total) {
      while (u >= s_tok[s + 1]) ++s;
      t = u - s_tok[s];
      rp = __ldcg(at<const int>(c, s, c.lay.stage_rpos) + (long long)t * R + rank);
      if (!a.permute && rp >= a.out_rows) rp = -1;  // past num_worst_tokens: not delivered
    }
  };
  struct Meta {
    int e, sp;
    float w;
  };
  auto load_meta = [&](int hs, int ht) {
    Meta m{-1, -1, 0.f};
    if (lane < K) {
      const long long o = (long long)ht * K + lane;
      m.e = __ldcg(at<const int>(c, hs, c.lay.stage_idx) + o);
      m.sp = __ldcg(at<const int>(c, hs, c.lay.stage_spos) + o);
      if (a.has_weights) m.w = __ldcg(at<const float>(c, hs, c.lay.stage_w) + o);
    }
    return m;
  };
  int s_n, t_n, rp_n;
  if (gw * 32 < total) scan(gw * 32, s_n, t_n, rp_n);
  for (int g = gw * 32; g < total; g += tw * 32) {
    const int s = s_n, t = t_n, rp = rp_n;
    if (g + tw * 32 < total) scan(g + tw * 32, s_n, t_n, rp_n);
    unsigned hits = __ballot_sync(kFull, rp >= 0);
    Meta next{-1, -1, 0.f};
    if (hits) next = load_meta(__shfl_sync(kFull, s, __ffs(hits) - 1), __shfl_sync(kFull, t, __ffs(hits) - 1));
    for (; hits; hits &= hits - 1) {
      const int h = __ffs(hits) - 1;
      const int hs = __shfl_sync(kFull, s, h), ht = __shfl_sync(kFull, t, h), hrp = __shfl_sync(kFull, rp, h);
      const Meta m = next;
      const unsigned rest = hits & (hits - 1);
      if (rest) next = load_meta(__shfl_sync(kFull, s, __ffs(rest) - 1), __shfl_sync(kFull, t, __ffs(rest) - 1));
      const char* src_row = region(c, hs) + c.lay.stage_x + (long long)ht * a.row_bytes;
      const bool local = m.e >= 0 && m.e < a.E && m.e / L == rank;
      const float* src_scales = at<const float>(c, hs, c.lay.stage_scales) + (long long)ht * a.scale_cols;
      if (!a.permute) {
        copy_row_multi(a.out_x, a.row_bytes, src_row, 1u, hrp);
        if (a.out_scales != nullptr)
          warp_copy_bytes(reinterpret_cast<char*>(a.out_scales + (long long)hrp * a.scale_cols),
                          reinterpret_cast<const char*>(src_scales), a.scale_cols * 4);
        if (lane < K) {
          a.out_idx[(long long)hrp * K + lane] = local ? m.e - rank * L : -1;
          if (a.out_w != nullptr) a.out_w[(long long)hrp * K + lane] = local ? m.w : 0.f;
          if (local && a.out_tpe != nullptr) atomicAdd(reinterpret_cast<unsigned long long*>(a.out_tpe + (m.e - rank * L)), 1ull);
        }
      } else {
        const bool take = local && m.sp >= 0 && m.sp < a.out_rows;
        const unsigned dests = __ballot_sync(kFull, take);
        copy_row_multi(a.out_x, a.row_bytes, src_row, dests, m.sp);
        if (a.out_scales != nullptr)
          for (unsigned d = dests; d; d &= d - 1) {
            const int p = __shfl_sync(kFull, m.sp, __ffs(d) - 1);
            warp_copy_bytes(reinterpret_cast<char*>(a.out_scales + (long long)p * a.scale_cols),
                            reinterpret_cast<const char*>(src_scales), a.scale_cols * 4);
          }
        if (take) {
          if (a.out_w != nullptr) a.out_w[m.sp] = m.w;
          a.out_row_expert[m.sp] = m.e - rank * L;
        }
        if (a.comb_map != nullptr && lane < K) a.comb_map[(long long)hrp * K + lane] = take ? m.sp : -1;
      }
    }
  }
  fill_padding(a, gw, tw);
}

__global__ void __launch_bounds__(kCopyThreads, 1) dispatch_kernel(Ctx c, int slot, DispatchArgs a) {
  if (call_aborted(c)) return;
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long target = me->expected[slot] + 1;
  const int st = block_wait_call(c, slot, target, slot == kSlotCall);
  if (st < 0) return;
  if (st > 0) pull_body(c, a);
  // done reading the peers' staging: tell them, and wait until nobody reads ours any more
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridDispatch)) {
    me->expected[slot] = target;
    if (st > 0) done_exchange(c, kSlotDispatchDone);
  }
}

void launch_dispatch(const Ctx& ctx, int slot, const DispatchArgs& args, int num_blocks, cudaStream_t stream) {
  dispatch_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, slot, args);
}

// -------------------------------------------------------------------------------------- push
// Copy one local row to every destination lane in `dests` holds a pointer for.
__device__ __forceinline__ void copy_row_to(const char* src, int row_bytes, unsigned dests, unsigned long long dst) {
  constexpr int U = 8;
  const int lane = lane_id();
  const int n16 = row_bytes >> 4;
  const int4* s16 = reinterpret_cast<const int4*>(src);
  for (int it = 0; it * 32 * U < n16; ++it) {  // uniform trip count: shuffles inside
    const int base = it * 32 * U + lane;
    int4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (base + j * 32 < n16) v[j] = __ldg(s16 + base + j * 32);
    for (unsigned m = dests; m; m &= m - 1) {
      int4* d16 = reinterpret_cast<int4*>(__shfl_sync(kFull, dst, __ffs(m) - 1));
#pragma unroll
      for (int j = 0; j < U; ++j)
        if (base + j * 32 < n16) d16[base + j * 32] = v[j];
    }
  }
}

// Thread 0 of every block; all blocks of the grid are resident (the same assumption the
// cross-rank waits make, enforced by the host's SM budget). Reports instead of hanging.
__device__ __forceinline__ bool grid_barrier(const Ctx& c) {
  Control* me = ctrl_of(c, c.rank);
  __threadfence();
  atomicAdd(&me->grid_done[kGridBarrier], 1u);
  const unsigned long long start = globaltimer();
  while (ld_volatile(reinterpret_cast<const int*>(&me->grid_done[kGridBarrier])) < (int)gridDim.x) {
    if (globaltimer() - start > c.timeout_ns) {
      report_failure(c, kErrTimeout, c.rank, kNumSlots, gridDim.x, 0);
      return false;
    }
  }
  return true;
}

__global__ void __launch_bounds__(kCopyThreads, 1) dispatch_push_kernel(Ctx c, CallArgs call, int slot, PushArgs a) {
  __shared__ long long s_off[4][kMaxRanks];
  __shared__ int s_all_pooled, s_ok;
  if (call_aborted(c)) return;
  const int R = c.num_ranks, rank = c.rank, L = a.out.E / R, K = a.in.K;
  Control* me = ctrl_of(c, rank);
  const unsigned long long t_loc = me->expected[slot] + 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    me->out_x_off = a.out_x_off;
    me->out_s_off = a.out_s_off;
    me->out_idx_off = a.out_idx_off;
    me->out_w_off = a.out_w_off;
    me->out_pooled = a.out_x_off >= 0;
    if (slot == kSlotCall) write_record(c, call);
    signal_all(c, slot);
  }
  const int st = block_wait_call(c, slot, t_loc, slot == kSlotCall);
  if (st < 0) return;
  if (st == 0) {  // aborted on every rank: only the handshake counter moves
    __syncthreads();
    if (threadIdx.x == 0 && last_block_done(c, kGridPush)) me->expected[slot] = t_loc;
    return;
  }
  if (threadIdx.x == 0) {
    int all = 1;
    for (int d = 0; d < R; ++d) {
      const Control* p = ctrl_of(c, d);
      all &= ld_volatile(&p->out_pooled);
      s_off[0][d] = ld_volatile(&p->out_x_off);
      s_off[1][d] = ld_volatile(&p->out_s_off);
      s_off[2][d] = ld_volatile(&p->out_idx_off);
      s_off[3][d] = ld_volatile(&p->out_w_off);
    }
    s_all_pooled = all;
    if (blockIdx.x == 0) me->push_pooled = all;  // launch_fanout's verdict (stream-ordered after us)
  }
  __syncthreads();
  const int lane = lane_id();
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const StageArgs& in = a.in;

  if (s_all_pooled) {
    // every output is reachable: read each local row once, write it to each destination
    for (int t = gw; t < in.T; t += tw) {
      int pos = -1;
      unsigned long long dst = 0, dst_s = 0;
      if (lane < R) {
        pos = __ldg(in.rank_pos + (long long)t * R + lane);
        if (pos >= 0) {
          dst = reinterpret_cast<unsigned long long>(region(c, lane) + s_off[0][lane] + (long long)pos * in.row_bytes);
          dst_s = reinterpret_cast<unsigned long long>(region(c, lane) + s_off[1][lane] + (long long)pos * in.scale_cols * 4);
        }
      }
      long long e = -1;
      float w = 0.f;
      int sp = -1;
      if (lane < K) {
        e = __ldg(in.topk_idx + (long long)t * K + lane);
        if (in.topk_w != nullptr) w = __ldg(in.topk_w + (long long)t * K + lane);
        if (a.out.permute) sp = __ldg(in.slot_pos + (long long)t * K + lane);
      }
      const bool valid_e = e >= 0 && e < a.out.E;
      const unsigned dests = __ballot_sync(kFull, pos >= 0);
      copy_row_to(static_cast<const char*>(in.x) + (long long)t * in.row_bytes, in.row_bytes, dests, dst);
      for (unsigned m = dests; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const int p = __shfl_sync(kFull, pos, d);
        if (in.scales != nullptr)
          warp_copy_bytes(reinterpret_cast<char*>(__shfl_sync(kFull, dst_s, d)),
                          reinterpret_cast<const char*>(in.scales + (long long)t * in.scale_cols), in.scale_cols * 4);
        if (lane < K) {
          const bool local = valid_e && e / L == d;
          if (a.out.permute)  // (expert-major row, local expert) for the receiver's fan-out
            reinterpret_cast<int2*>(region(c, d) + s_off[2][d])[(long long)p * K + lane] =
                local ? make_int2(sp, (int)(e - (long long)d * L)) : make_int2(-1, -1);
          else
            reinterpret_cast<long long*>(region(c, d) + s_off[2][d])[(long long)p * K + lane] = local ? e - (long long)d * L : -1;
          if (s_off[3][d] >= 0) reinterpret_cast<float*>(region(c, d) + s_off[3][d])[(long long)p * K + lane] = local ? w : 0.f;
        }
      }
    }
    __syncthreads();  // then: this rank's writes into every output are complete
    if (threadIdx.x == 0 && last_block_done(c, kGridPush)) {
      me->expected[slot] = t_loc;
      done_exchange(c, kSlotPushDone);
    }
    return;
  }

  // some rank's outputs are ordinary tensors: everybody stages and pulls (same kernel)
  stage_body(c, in);
  __syncthreads();
  if (threadIdx.x == 0) s_ok = grid_barrier(c);
  __syncthreads();
  if (!s_ok) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) signal_all(c, kSlotStaged);
  const unsigned long long t_st = me->expected[kSlotStaged] + 1;
  if (!block_wait_all(c, kSlotStaged, t_st)) return;
  pull_body(c, a.out);
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridDispatch)) {
    me->grid_done[kGridBarrier] = 0;  // every block passed it long ago
    me->expected[slot] = t_loc;
    me->expected[kSlotStaged] = t_st;
    done_exchange(c, kSlotDispatchDone);
  }
}

void launch_dispatch_push(const Ctx& ctx, const CallArgs& call, int slot, const PushArgs& args, int num_blocks,
                          cudaStream_t stream) {
  dispatch_push_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, slot, args);
}

// ------------------------------------------------------------------------------------ fan-out
// Local: each pooled rank-major row is read once (HBM) and written into every expert segment it
// belongs to; a separate launch so it may use every SM (the copy-engine-free analogue of a
// permute after the dispatch), while the link-bound push keeps the caller's SM budget.
__global__ void __launch_bounds__(kCopyThreads) fanout_kernel(Ctx c, FanoutArgs f) {
  if (call_aborted(c) || !ld_volatile(&ctrl_of(c, c.rank)->push_pooled)) return;  // pull wrote everything
  const DispatchArgs& a = f.out;
  const int K = a.K, lane = lane_id();
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const int N = a.recv_info[RecvInfo::kRows];
  for (int n = gw; n < N; n += tw) {
    int pos = -1, le = -1;
    float w = 0.f;
    if (lane < K) {
      const int2 m = __ldcg(reinterpret_cast<const int2*>(f.map) + (long long)n * K + lane);
      pos = m.x < a.out_rows ? m.x : -1;  // past num_worst_tokens: dropped (notify counted it)
      le = m.y;
      if (f.w != nullptr) w = __ldcg(f.w + (long long)n * K + lane);
      if (a.comb_map != nullptr) a.comb_map[(long long)n * K + lane] = pos;
    }
    const unsigned dests = __ballot_sync(kFull, pos >= 0);
    copy_row_multi(a.out_x, a.row_bytes, f.rows + (long long)n * a.row_bytes, dests, pos);
    if (a.out_scales != nullptr)
      for (unsigned d = dests; d; d &= d - 1) {
        const int p = __shfl_sync(kFull, pos, __ffs(d) - 1);
        warp_copy_bytes(reinterpret_cast<char*>(a.out_scales + (long long)p * a.scale_cols),
                        reinterpret_cast<const char*>(f.scales + (long long)n * a.scale_cols), a.scale_cols * 4);
      }
    if (pos >= 0) {
      if (a.out_w != nullptr) a.out_w[pos] = w;
      a.out_row_expert[pos] = le;
    }
  }
  fill_padding(a, gw, tw);
}

void launch_fanout(const Ctx& ctx, const FanoutArgs& args, int num_blocks, cudaStream_t stream) {
  fanout_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
}

// ----------------------------------------------------------------------------- stage combine
__global__ void __launch_bounds__(kCopyThreads, 1) stage_combine_kernel(Ctx c, CallArgs call, StageCombineArgs a) {
  const long long gtid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long nthreads = (long long)gridDim.x * blockDim.x;
  if (a.x != nullptr)
    grid_copy16<8>(at<int4>(c, c.rank, c.lay.comb_x), reinterpret_cast<const int4*>(a.x), (long long)a.rows * a.row_bytes / 16);
  if (a.w != nullptr) {
    float* dst = at<float>(c, c.rank, c.lay.comb_w);
    for (long long i = gtid; i < (long long)a.rows * a.w_cols; i += nthreads) dst[i] = a.w[i];
  }
  if (gtid == 0) ctrl_of(c, c.rank)->comb_has_weights = a.w != nullptr;
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridStageComb)) {
    write_record(c, call);
    signal_all(c, kSlotCall);
  }
}

void launch_stage_combine(const Ctx& ctx, const CallArgs& call, const StageCombineArgs& args, int num_blocks,
                          cudaStream_t stream) {
  stage_combine_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, args);
}

// ---------------------------------------------------------------------------------- combine
template <bool kFp32>
struct Acc;

template <>
struct Acc<false> {  // 8 bf16 per 16 bytes
  float v[8];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
  }
  __device__ __forceinline__ void add(const int4& x) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] += f.x;
      v[2 * i + 1] += f.y;
    }
  }
  __device__ __forceinline__ int4 pack() const {
    int4 out;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    return out;
  }
};

template <>
struct Acc<true> {  // 4 fp32 per 16 bytes
  float v[4];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = 0.f;
  }
  __device__ __forceinline__ void add(const int4& x) {
    const float* f = reinterpret_cast<const float*>(&x);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] += f[i];
  }
  __device__ __forceinline__ int4 pack() const {
    int4 out;
    float* f = reinterpret_cast<float*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = v[i];
    return out;
  }
};

// Lane k < K: the weight of token t's slot k back from its owner's combine staging (`pos`: the
// slot's row there, -1 when not delivered).
__device__ __forceinline__ void scatter_weight(const Ctx& c, const CombineArgs& a, int t, int owner, int pos) {
  const int lane = lane_id(), K = a.K;
  if (a.w_out == nullptr || lane >= K) return;
  float w = 0.f;
  if (pos >= 0 && a.has_weights) {
    const float* wsrc = at<const float>(c, owner, c.lay.comb_w);
    w = __ldcg(a.permute ? wsrc + pos : wsrc + (long long)pos * K + lane);
  }
  a.w_out[(long long)t * K + lane] = w;
}

template <bool kFp32>
__global__ void __launch_bounds__(kCopyThreads, 1) combine_kernel(Ctx c, CombineArgs a) {
  constexpr int kChunks = 4;    // 16-byte chunks per lane per step
  constexpr int kSrcBatch = 4;  // source rows loaded together: 16 loads in flight per lane
  const int R = c.num_ranks, K = a.K, L = a.E / R;
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long target = me->expected[kSlotCall] + 1;
  const int st = block_wait_call(c, kSlotCall, target, true);
  if (st < 0) return;

  const int lane = lane_id();
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const int row_bytes = a.H * (kFp32 ? 4 : 2);
  const int n16 = row_bytes >> 4;
  for (int t = (st > 0 ? gw : a.T); t < a.T; t += tw) {
    // lane j describes source row j: rank-major one per rank, expert-major one per slot; only
    // rows the dispatch delivered (valid id, position inside every rank's input) are read
    const char* src = nullptr;
    int owner = -1, pos = -1;
    if (lane < K) {
      const long long e = a.topk_idx[(long long)t * K + lane];
      if (e >= 0 && e < a.E) owner = (int)(e / L);
    }
    if (!a.permute) {
      if (lane < R) {
        const int p = a.rank_pos[(long long)t * R + lane];
        if (p >= 0 && p < a.row_limits[lane]) src = region(c, lane) + c.lay.comb_x + (long long)p * row_bytes;
      }
      if (owner >= 0) {
        const int p = a.rank_pos[(long long)t * R + owner];
        pos = (p >= 0 && p < a.row_limits[owner]) ? p : -1;
      }
    } else if (owner >= 0) {
      const int p = a.slot_pos[(long long)t * K + lane];
      if (p >= 0 && p < a.row_limits[owner]) {
        pos = p;
        src = region(c, owner) + c.lay.comb_x + (long long)p * row_bytes;
      }
    }
    const unsigned srcs = __ballot_sync(kFull, src != nullptr);
    const unsigned long long src_u = reinterpret_cast<unsigned long long>(src);
    int4* y = reinterpret_cast<int4*>(static_cast<char*>(a.y) + (long long)t * row_bytes);
    // kChunks chunks per lane from kSrcBatch source rows at a time (accumulated in row order)
    for (int it = 0; it * 32 * kChunks < n16; ++it) {  // uniform trip count: shuffles inside
      const int base = it * 32 * kChunks + lane;
      Acc<kFp32> acc[kChunks];
#pragma unroll
      for (int j = 0; j < kChunks; ++j) acc[j].zero();
      for (unsigned m = srcs; m;) {
        const int4* p[kSrcBatch];
#pragma unroll
        for (int b = 0; b < kSrcBatch; ++b) {  // warp-uniform: every lane sees the same m
          p[b] = nullptr;
          if (m) {
            p[b] = reinterpret_cast<const int4*>(__shfl_sync(kFull, src_u, __ffs(m) - 1));
            m &= m - 1;
          }
        }
        int4 v[kSrcBatch][kChunks];
#pragma unroll
        for (int b = 0; b < kSrcBatch; ++b)
          if (p[b] != nullptr) {
#pragma unroll
            for (int j = 0; j < kChunks; ++j)
              if (base + j * 32 < n16) v[b][j] = __ldcg(p[b] + base + j * 32);
          }
#pragma unroll
        for (int b = 0; b < kSrcBatch; ++b)
          if (p[b] != nullptr) {
#pragma unroll
            for (int j = 0; j < kChunks; ++j)
              if (base + j * 32 < n16) acc[j].add(v[b][j]);
          }
      }
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
        if (base + j * 32 < n16) y[base + j * 32] = acc[j].pack();
    }
    scatter_weight(c, a, t, owner, pos);
  }

  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridCombine)) {
    me->expected[kSlotCall] = target;
    if (st > 0) done_exchange(c, kSlotCombDone);
  }
}

// Four channels of a row as fp32: 8 bytes of bf16 or 16 of fp32.
template <bool kFp32>
__device__ __forceinline__ float4 load4(const char* row, int i) {
  if constexpr (kFp32) {
    return __ldcg(reinterpret_cast<const float4*>(row) + i);
  } else {
    const uint2 u = __ldcg(reinterpret_cast<const uint2*>(row) + i);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}

template <bool kFp32>
__device__ __forceinline__ void store4(char* row, int i, const float4& v) {
  if constexpr (kFp32) {
    reinterpret_cast<float4*>(row)[i] = v;
  } else {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<unsigned*>(&lo);
    u.y = *reinterpret_cast<unsigned*>(&hi);
    reinterpret_cast<uint2*>(row)[i] = u;
  }
}

// Sum the rows that lanes in `srcs` point at (lane order), four channels per lane per step, into
// `dst` (fp32 or bf16). Loads of kSrcBatch rows x kUnroll steps are issued before any add, so a
// lane keeps 16 loads in flight (remote rows pay a link round trip each).
template <bool kInFp32, bool kOutFp32>
__device__ __forceinline__ void warp_sum_rows(char* dst, unsigned srcs, unsigned long long src, int H) {
  constexpr int kUnroll = 4, kSrcBatch = 4;
  const int lane = lane_id();
  const int n4 = H >> 2;
  for (int it = 0; it * 32 * kUnroll < n4; ++it) {  // uniform trip count: shuffles inside
    const int base = it * 32 * kUnroll + lane;
    float4 acc[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (unsigned m = srcs; m;) {
      const char* row[kSrcBatch];
#pragma unroll
      for (int b = 0; b < kSrcBatch; ++b) {  // warp-uniform: every lane sees the same m
        row[b] = nullptr;
        if (m) {
          row[b] = reinterpret_cast<const char*>(__shfl_sync(kFull, src, __ffs(m) - 1));
          m &= m - 1;
        }
      }
      float4 v[kSrcBatch][kUnroll];
#pragma unroll
      for (int b = 0; b < kSrcBatch; ++b)
        if (row[b] != nullptr) {
#pragma unroll
          for (int j = 0; j < kUnroll; ++j)
            if (base + j * 32 < n4) v[b][j] = load4<kInFp32>(row[b], base + j * 32);
        }
#pragma unroll
      for (int b = 0; b < kSrcBatch; ++b)
        if (row[b] != nullptr) {
#pragma unroll
          for (int j = 0; j < kUnroll; ++j)
            if (base + j * 32 < n4) {
              acc[j].x += v[b][j].x;
              acc[j].y += v[b][j].y;
              acc[j].z += v[b][j].z;
              acc[j].w += v[b][j].w;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (base + j * 32 < n4) store4<kOutFp32>(dst, base + j * 32, acc[j]);
  }
}

// Local pre-reduction of an expert-major combine: partial[n] = sum of rank-major row n's expert
// rows (fp32, into this rank's combine area), weights staged; then the call exchange.
template <bool kInFp32>
__global__ void __launch_bounds__(kCopyThreads) combine_reduce_kernel(Ctx c, CallArgs call, CombineReduceArgs a) {
  const int K = a.K, lane = lane_id();
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const long long in_row = (long long)a.H * (kInFp32 ? 4 : 2), out_row = (long long)a.H * 4;
  const int N = a.recv_info[RecvInfo::kRows];
  char* partials = region(c, c.rank) + c.lay.comb_x;
  for (int n = gw; n < N; n += tw) {
    const char* src = nullptr;
    if (lane < K) {
      const int p = a.map[(long long)n * K + lane];
      if (p >= 0 && p < a.rows) src = static_cast<const char*>(a.x) + p * in_row;
    }
    warp_sum_rows<kInFp32, true>(partials + n * out_row, __ballot_sync(kFull, src != nullptr),
                                 reinterpret_cast<unsigned long long>(src), a.H);
  }
  if (a.w != nullptr) {
    float* dst = at<float>(c, c.rank, c.lay.comb_w);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < a.rows; i += (long long)gridDim.x * blockDim.x)
      dst[i] = a.w[i];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) ctrl_of(c, c.rank)->comb_has_weights = a.w != nullptr;
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridStageComb)) {
    write_record(c, call);
    signal_all(c, kSlotCall);
  }
}

void launch_combine_reduce(const Ctx& ctx, const CallArgs& call, const CombineReduceArgs& args, int num_blocks,
                           cudaStream_t stream) {
  if (args.is_fp32)
    combine_reduce_kernel<true><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, args);
  else
    combine_reduce_kernel<false><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, args);
}

// Second half: y[t] = sum over ranks of the token's fp32 partial there (one row per rank).
template <bool kOutFp32>
__global__ void __launch_bounds__(kCopyThreads, 1) combine_partials_kernel(Ctx c, CombineArgs a) {
  const int R = c.num_ranks, K = a.K, L = a.E / R;
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long target = me->expected[kSlotCall] + 1;
  const int st = block_wait_call(c, kSlotCall, target, true);
  if (st < 0) return;
  const int lane = lane_id();
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const long long out_row = (long long)a.H * (kOutFp32 ? 4 : 2), part_row = (long long)a.H * 4;
  for (int t = (st > 0 ? gw : a.T); t < a.T; t += tw) {
    const char* src = nullptr;
    if (lane < R) {  // every rank-major row has a partial (zeros where all its slots were dropped)
      const int p = a.rank_pos[(long long)t * R + lane];
      if (p >= 0) src = region(c, lane) + c.lay.comb_x + p * part_row;
    }
    int owner = -1, pos = -1;
    if (lane < K) {
      const long long e = a.topk_idx[(long long)t * K + lane];
      if (e >= 0 && e < a.E) {
        owner = (int)(e / L);
        const int p = a.slot_pos[(long long)t * K + lane];
        pos = (p >= 0 && p < a.row_limits[owner]) ? p : -1;
      }
    }
    warp_sum_rows<true, kOutFp32>(static_cast<char*>(a.y) + t * out_row, __ballot_sync(kFull, src != nullptr),
                                  reinterpret_cast<unsigned long long>(src), a.H);
    scatter_weight(c, a, t, owner, pos);
  }
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridCombine)) {
    me->expected[kSlotCall] = target;
    if (st > 0) done_exchange(c, kSlotCombDone);
  }
}

void launch_combine(const Ctx& ctx, const CombineArgs& args, int num_blocks, cudaStream_t stream) {
  if (args.partials) {
    if (args.is_fp32)
      combine_partials_kernel<true><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
    else
      combine_partials_kernel<false><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
  } else if (args.is_fp32)
    combine_kernel<true><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
  else
    combine_kernel<false><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
}

// --------------------------------------------------------------------------------- prepare
void prepare_layout_kernels();   // layout.cu
void prepare_runtime_kernels();  // runtime.cu

void prepare_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, notify_count_kernel);
  cudaFuncGetAttributes(&attr, notify_exchange_kernel);
  cudaFuncGetAttributes(&attr, notify_positions_kernel);
  cudaFuncSetAttribute(notify_exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       exchange_smem_bytes(kMaxExperts, kMaxRanks));
  cudaFuncGetAttributes(&attr, stage_kernel);
  cudaFuncGetAttributes(&attr, dispatch_kernel);
  cudaFuncGetAttributes(&attr, dispatch_push_kernel);
  cudaFuncGetAttributes(&attr, stage_combine_kernel);
  cudaFuncGetAttributes(&attr, combine_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_kernel<false>);
  cudaFuncGetAttributes(&attr, fanout_kernel);
  cudaFuncGetAttributes(&attr, combine_reduce_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_reduce_kernel<false>);
  cudaFuncGetAttributes(&attr, combine_partials_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_partials_kernel<false>);
  prepare_layout_kernels();
  prepare_runtime_kernels();
}

}  // namespace mep
