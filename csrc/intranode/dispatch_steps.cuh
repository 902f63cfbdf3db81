// The intranode dispatch's steps as device functions: stage, pull, push. dispatch.cu's kernels
// run them; the internode path's fused kernels (csrc/internode/fused.cu) run the push inside
// their own launch, on the rows that arrived over RDMA.
#pragma once

#include "intranode/common.cuh"

namespace mep {

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

// ---------------------------------------------------------------------------------- dispatch
// Copy one row from `src` to the destination of every lane in `dests`: `dest_of(l)` is lane l's
// destination (a warp shuffle, so every lane calls it alike). U 16-byte loads in flight per lane
// before the stores; kPeerSource: the row lies in a peer's region (loads through L2), else in
// this rank's read-only input.
template <bool kPeerSource, typename DestOf>
__device__ __forceinline__ void copy_row_fanout(const char* src, int row_bytes, unsigned dests, DestOf dest_of) {
  constexpr int U = 8;  // 4 KB in flight per warp
  const int lane = lane_id();
  const int n16 = row_bytes >> 4;
  const int4* s16 = reinterpret_cast<const int4*>(src);
  for (int it = 0; it * 32 * U < n16; ++it) {  // uniform trip count: shuffles inside
    const int base = it * 32 * U + lane;
    int4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (base + j * 32 < n16) v[j] = kPeerSource ? __ldcg(s16 + base + j * 32) : __ldg(s16 + base + j * 32);
    for (unsigned m = dests; m; m &= m - 1) {
      int4* d16 = dest_of(__ffs(m) - 1);
#pragma unroll
      for (int j = 0; j < U; ++j)
        if (base + j * 32 < n16) d16[base + j * 32] = v[j];
    }
  }
}

// Copy one row from `src` to every row listed by the lanes in `dests` (positions in `pos`).
__device__ __forceinline__ void copy_row_multi(char* out, int row_bytes, const char* src, unsigned dests, int pos) {
  copy_row_fanout<true>(src, row_bytes, dests, [&](int l) {
    return reinterpret_cast<int4*>(out + (long long)__shfl_sync(kFull, pos, l) * row_bytes);
  });
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
      if (a.out_src != nullptr && lane == 0) a.out_src[hrp] = ht;  // (hrp: the rank-major row, in both layouts)
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

// -------------------------------------------------------------------------------------- push
// Copy one of this rank's rows to every destination lane in `dests` holds a pointer for
// (kLive: the row was written by a peer during this launch).
template <bool kLive>
__device__ __forceinline__ void copy_row_to(const char* src, int row_bytes, unsigned dests, unsigned long long dst) {
  copy_row_fanout<kLive>(src, row_bytes, dests,
                         [&](int l) { return reinterpret_cast<int4*>(__shfl_sync(kFull, dst, l)); });
}

// Thread 0 of every block; all blocks of the grid are resident (the same assumption the
// cross-rank waits make, enforced by the host's SM budget). Reports instead of hanging.
__device__ __forceinline__ bool grid_barrier(const Ctx& c) {
  Control* me = ctrl_of(c, c.rank);
  __threadfence();
  atomicAdd(&me->grid_done[kGridBarrier], 1u);
  int arrived;
  if (wait::spin<0>([&] { return ld_volatile(reinterpret_cast<const int*>(&me->grid_done[kGridBarrier])); },
                    [&](int n) { return n >= (int)gridDim.x; }, wait::NeverStop{}, c.timeout_ns,
                    arrived) == wait::kArrived)
    return true;
  report_failure(c, kErrTimeout, c.rank, kNumSlots, gridDim.x, 0);
  return false;
}

// Push, first half (one thread): publish where this rank's rank-major outputs lie (offsets in
// its region, or not pooled) and, for a cached dispatch, its call record; signal `slot`.
__device__ __forceinline__ void push_announce(const Ctx& c, const CallArgs& call, int slot, const PushArgs& a) {
  Control* me = ctrl_of(c, c.rank);
  me->out_x_off = a.out_x_off;
  me->out_s_off = a.out_s_off;
  me->out_idx_off = a.out_idx_off;
  me->out_w_off = a.out_w_off;
  me->out_src_off = a.out_src_off;
  me->out_pooled = a.out_x_off >= 0;
  if (slot == kSlotCall) write_record(c, call);
  signal_all(c, slot);
}

// Push, second half (grid): wait for every rank's announcement, then write this rank's rows into
// every destination's pooled outputs, or (some rank's outputs are not pooled) stage and pull.
// kLiveInput: the inputs were written by peers during this launch (the internode path's fused
// dispatch pushes what arrived over RDMA), so they are read through L2, not the read-only path.
template <bool kLiveInput>
__device__ __forceinline__ void push_rows(const Ctx& c, int slot, const PushArgs& a) {
  __shared__ long long s_off[5][kMaxRanks];
  __shared__ int s_all_pooled, s_ok;
  const int R = c.num_ranks, rank = c.rank, L = a.out.E / R, K = a.in.K;
  Control* me = ctrl_of(c, rank);
  const unsigned long long t_loc = me->expected[slot] + 1;
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
      s_off[4][d] = ld_volatile(&p->out_src_off);
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
        if (in.topk_w != nullptr) w = kLiveInput ? __ldcg(in.topk_w + (long long)t * K + lane) : __ldg(in.topk_w + (long long)t * K + lane);
        if (a.out.permute) sp = __ldg(in.slot_pos + (long long)t * K + lane);
      }
      const bool valid_e = e >= 0 && e < a.out.E;
      const unsigned dests = __ballot_sync(kFull, pos >= 0);
      copy_row_to<kLiveInput>(static_cast<const char*>(in.x) + (long long)t * in.row_bytes, in.row_bytes, dests, dst);
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
        if (lane == 0 && s_off[4][d] >= 0) reinterpret_cast<int*>(region(c, d) + s_off[4][d])[p] = t;
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

}  // namespace mep
