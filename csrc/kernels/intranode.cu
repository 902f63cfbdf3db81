// Intranode normal path: every rank stages its inputs once in its own region, and every rank
// pulls the rows it needs straight from its peers' regions into its final outputs.
//
// Why pull: the outputs (dispatch) and the token sums (combine) are ordinary tensors on the
// pulling rank, so rows land in their final place in one pass -- no ring buffer and no copy
// out of a receive buffer (DeepEP V1's extra pass). Sizes are fixed worst cases with exact
// offsets computed by notify, so there are no queues, credits or head/tail pointers: a call is
// stage -> signal -> pull -> signal, and every wait is bounded by a timeout.
//
// Expert-major dispatch reads each (token, rank) row once over the link and writes it from
// registers into every local expert segment that token names (send once, duplicate locally).

#include <cuda_bf16.h>

#include "../device.cuh"
#include "api.h"

namespace mep {

constexpr int kCopyThreads = 512;
constexpr int kCopyWarps = kCopyThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T* at(const Ctx& c, int r, long long off) {
  return reinterpret_cast<T*>(region(c, r) + off);
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
    sidx[i] = (int)a.topk_idx[i];
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

__global__ void __launch_bounds__(kCopyThreads, 1) stage_kernel(Ctx c, StageArgs a) {
  stage_body(c, a);
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridStage)) signal_all(c, kSlotStaged);
}

void launch_stage(const Ctx& ctx, const StageArgs& args, int num_blocks, cudaStream_t stream) {
  stage_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
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
  if (row >= info[1]) return true;
  const int* seg = info + 3 + 2 * L;
  int lo = 0, hi = L - 1;
  while (lo < hi) {  // last le with seg[le] <= row
    const int mid = (lo + hi + 1) >> 1;
    if (seg[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return row - seg[lo] >= info[3 + lo];
}

// Pull every row bound for this rank from the peers' staging into the outputs, and fill the
// padding. Called once the peers' staging is known to be complete.
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
      const bool local = m.e >= 0 && m.e / L == rank;
      const float* src_scales = at<const float>(c, hs, c.lay.stage_scales) + (long long)ht * a.scale_cols;
      if (!a.permute) {
        copy_row_multi(a.out_x, a.row_bytes, src_row, 1u, hrp);
        if (a.out_scales != nullptr)
          warp_copy_bytes(reinterpret_cast<char*>(a.out_scales + (long long)hrp * a.scale_cols),
                          reinterpret_cast<const char*>(src_scales), a.scale_cols * 4);
        if (lane < K) {
          a.out_idx[(long long)hrp * K + lane] = local ? m.e - rank * L : -1;
          if (a.out_w != nullptr) a.out_w[(long long)hrp * K + lane] = local ? m.w : 0.f;
        }
      } else {
        const unsigned dests = __ballot_sync(kFull, local);
        copy_row_multi(a.out_x, a.row_bytes, src_row, dests, m.sp);
        if (a.out_scales != nullptr)
          for (unsigned d = dests; d; d &= d - 1) {
            const int p = __shfl_sync(kFull, m.sp, __ffs(d) - 1);
            warp_copy_bytes(reinterpret_cast<char*>(a.out_scales + (long long)p * a.scale_cols),
                            reinterpret_cast<const char*>(src_scales), a.scale_cols * 4);
          }
        if (local) {
          if (a.out_w != nullptr) a.out_w[m.sp] = m.w;
          a.out_row_expert[m.sp] = m.e - rank * L;
        }
      }
    }
  }

  // padding: expert segments past their counts and worst-case rows past N / M
  const int* info = a.recv_info;
  const int valid_rows = a.permute ? info[1] : info[0];
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

__global__ void __launch_bounds__(kCopyThreads, 1) dispatch_kernel(Ctx c, DispatchArgs a) {
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long target = me->expected[kSlotStaged] + 1;
  if (!block_wait_all(c, kSlotStaged, target)) return;
  pull_body(c, a);
  // done reading the peers' staging: tell them, and wait until nobody reads ours any more
  __syncthreads();
  if (threadIdx.x == 0 && end_of_call(c, kGridDispatch, kSlotDispatchDone)) me->expected[kSlotStaged] = target;
}

void launch_dispatch(const Ctx& ctx, const DispatchArgs& args, int num_blocks, cudaStream_t stream) {
  dispatch_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
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
// cross-rank waits make). A hang here means they were not: report it instead of hanging.
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

__global__ void __launch_bounds__(kCopyThreads, 1) dispatch_push_kernel(Ctx c, PushArgs a) {
  __shared__ long long s_off[4][kMaxRanks];
  __shared__ int s_all_pooled;
  const int R = c.num_ranks, rank = c.rank, L = a.out.E / R, K = a.in.K;
  Control* me = ctrl_of(c, rank);
  const unsigned long long t_loc = me->expected[kSlotOutLoc] + 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    me->out_x_off = a.out_x_off;
    me->out_s_off = a.out_s_off;
    me->out_idx_off = a.out_idx_off;
    me->out_w_off = a.out_w_off;
    me->out_pooled = a.out_x_off >= 0;
    signal_all(c, kSlotOutLoc);
  }
  if (!block_wait_all(c, kSlotOutLoc, t_loc)) return;
  if (threadIdx.x == 0) {
    int all = 1;
    for (int d = 0; d < R; ++d) {
      const Control* p = ctrl_of(c, d);
      all &= ld_volatile(&p->out_pooled);
      s_off[0][d] = *reinterpret_cast<const volatile long long*>(&p->out_x_off);
      s_off[1][d] = *reinterpret_cast<const volatile long long*>(&p->out_s_off);
      s_off[2][d] = *reinterpret_cast<const volatile long long*>(&p->out_idx_off);
      s_off[3][d] = *reinterpret_cast<const volatile long long*>(&p->out_w_off);
    }
    s_all_pooled = all;
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
      if (lane < K) {
        e = __ldg(in.topk_idx + (long long)t * K + lane);
        if (in.topk_w != nullptr) w = __ldg(in.topk_w + (long long)t * K + lane);
      }
      const unsigned dests = __ballot_sync(kFull, pos >= 0);
      copy_row_to(static_cast<const char*>(in.x) + (long long)t * in.row_bytes, in.row_bytes, dests, dst);
      for (unsigned m = dests; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const int p = __shfl_sync(kFull, pos, d);
        if (in.scales != nullptr)
          warp_copy_bytes(reinterpret_cast<char*>(__shfl_sync(kFull, dst_s, d)),
                          reinterpret_cast<const char*>(in.scales + (long long)t * in.scale_cols), in.scale_cols * 4);
        if (lane < K) {
          const bool local = e >= 0 && e / L == d;
          reinterpret_cast<long long*>(region(c, d) + s_off[2][d])[(long long)p * K + lane] = local ? e - (long long)d * L : -1;
          if (s_off[3][d] >= 0) reinterpret_cast<float*>(region(c, d) + s_off[3][d])[(long long)p * K + lane] = local ? w : 0.f;
        }
      }
    }
    __syncthreads();  // then: this rank's writes into every output are complete
    if (threadIdx.x == 0 && end_of_call(c, kGridPush, kSlotPushDone)) me->expected[kSlotOutLoc] = t_loc;
    return;
  }

  // some rank's outputs are ordinary tensors: everybody stages and pulls (same kernel)
  stage_body(c, in);
  __syncthreads();
  if (threadIdx.x == 0 && !grid_barrier(c)) return;
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0) signal_all(c, kSlotStaged);
  const unsigned long long t_st = me->expected[kSlotStaged] + 1;
  if (!block_wait_all(c, kSlotStaged, t_st)) return;
  pull_body(c, a.out);
  __syncthreads();
  if (threadIdx.x == 0 && end_of_call(c, kGridDispatch, kSlotDispatchDone)) {
    me->grid_done[kGridBarrier] = 0;  // every block passed it long ago
    me->expected[kSlotOutLoc] = t_loc;
    me->expected[kSlotStaged] = t_st;
  }
}

void launch_dispatch_push(const Ctx& ctx, const PushArgs& args, int num_blocks, cudaStream_t stream) {
  dispatch_push_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
}

// ----------------------------------------------------------------------------- stage combine
__global__ void __launch_bounds__(kCopyThreads, 1) stage_combine_kernel(Ctx c, StageCombineArgs a) {
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
  if (threadIdx.x == 0 && last_block_done(c, kGridStageComb)) signal_all(c, kSlotCombStaged);
}

void launch_stage_combine(const Ctx& ctx, const StageCombineArgs& args, int num_blocks, cudaStream_t stream) {
  stage_combine_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
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

template <bool kFp32>
__global__ void __launch_bounds__(kCopyThreads, 1) combine_kernel(Ctx c, CombineArgs a) {
  constexpr int kChunks = 4;    // 16-byte chunks per lane per step
  constexpr int kSrcBatch = 4;  // source rows loaded together: 16 loads in flight per lane
  const int R = c.num_ranks, K = a.K, L = a.E / R;
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long target = me->expected[kSlotCombStaged] + 1;
  if (!block_wait_all(c, kSlotCombStaged, target)) return;

  const int lane = lane_id();
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const int row_bytes = a.H * (kFp32 ? 4 : 2);
  const int n16 = row_bytes >> 4;
  for (int t = gw; t < a.T; t += tw) {
    // lane j describes source row j: rank-major one per rank, expert-major one per slot
    const char* src = nullptr;
    long long e = -1;
    if (lane < K) e = a.topk_idx[(long long)t * K + lane];
    if (!a.permute) {
      if (lane < R) {
        const int p = a.rank_pos[(long long)t * R + lane];
        if (p >= 0) src = region(c, lane) + c.lay.comb_x + (long long)p * row_bytes;
      }
    } else if (e >= 0) {
      const int p = a.slot_pos[(long long)t * K + lane];
      src = region(c, (int)(e / L)) + c.lay.comb_x + (long long)p * row_bytes;
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
    if (a.w_out != nullptr && lane < K) {
      float w = 0.f;
      if (e >= 0 && a.has_weights) {
        const int d = (int)(e / L);
        if (!a.permute) {
          const int p = a.rank_pos[(long long)t * R + d];
          w = __ldcg(at<const float>(c, d, c.lay.comb_w) + (long long)p * K + lane);
        } else {
          w = __ldcg(at<const float>(c, d, c.lay.comb_w) + a.slot_pos[(long long)t * K + lane]);
        }
      }
      a.w_out[(long long)t * K + lane] = w;
    }
  }

  __syncthreads();
  if (threadIdx.x == 0 && end_of_call(c, kGridCombine, kSlotCombDone)) me->expected[kSlotCombStaged] = target;
}

void launch_combine(const Ctx& ctx, const CombineArgs& args, int num_blocks, cudaStream_t stream) {
  if (args.is_fp32)
    combine_kernel<true><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
  else
    combine_kernel<false><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
}

// --------------------------------------------------------------------------------- prepare
void prepare_layout_kernels();  // layout.cu

void prepare_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, stage_kernel);
  cudaFuncGetAttributes(&attr, dispatch_kernel);
  cudaFuncGetAttributes(&attr, dispatch_push_kernel);
  cudaFuncGetAttributes(&attr, stage_combine_kernel);
  cudaFuncGetAttributes(&attr, combine_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_kernel<false>);
  prepare_layout_kernels();
}

}  // namespace mep
