// The intranode combine's steps as device functions: stage, pull-and-sum, the expert-major
// pre-reduction and the partial sums. combine.cu's kernels run them; the internode path's fused
// combine (csrc/internode/fused.cu) runs them inside its own launch before the RDMA hop.
#pragma once

#include "intranode/common.cuh"

namespace mep {

// The end of a combine's staging (stage_combine_step, combine_reduce_step): whether weights were staged,
// then, from the last block to finish, this rank's call record and its signal to every rank.
__device__ __forceinline__ void finish_combine_stage(const Ctx& c, const CallArgs& call, bool has_weights, bool first) {
  if (first) ctrl_of(c, c.rank)->comb_has_weights = has_weights;
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridStageComb)) {
    write_record(c, call);
    signal_all(c, kSlotCall);
  }
}

__device__ __forceinline__ void stage_combine_step(const Ctx& c, const CallArgs& call, const StageCombineArgs& a) {
  const long long gtid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long nthreads = (long long)gridDim.x * blockDim.x;
  if (a.x != nullptr)
    grid_copy16<8>(at<int4>(c, c.rank, c.lay.comb_x), reinterpret_cast<const int4*>(a.x), (long long)a.rows * a.row_bytes / 16);
  if (a.w != nullptr) {
    float* dst = at<float>(c, c.rank, c.lay.comb_w);
    for (long long i = gtid; i < (long long)a.rows * a.w_cols; i += nthreads) dst[i] = a.w[i];
  }
  finish_combine_stage(c, call, a.w != nullptr, gtid == 0);
}

// ---------------------------------------------------------------------------------- combine
// The order of a token's sum (DeepEP V2's reference combine): an fp32 accumulator that starts at
// the biases (b0 + b1, 0 without), then one term per rank the token went to, added at that
// rank's last top-k slot (ranks ordered by it); a rank's term is its rank-major row, or in
// expert-major mode the sum of its expert rows in slot order rounded to x's dtype. One rounding
// at the end. Fixing the order makes every path, and the torch backend, bit-identical.
template <bool kFp32>
struct Acc;

template <>
struct Acc<false> {  // 8 bf16 per 16 bytes
  float v[8];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
  }
  __device__ __forceinline__ void add(const int4& x) { add_bf16x8(v, x); }
  // += p rounded to bf16 (a rank's partial, as it would cross the link)
  __device__ __forceinline__ void add_rounded(const Acc& p) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] += __bfloat162float(__float2bfloat16_rn(p.v[i]));
  }
  __device__ __forceinline__ int4 pack() const { return pack_bf16x8(v); }
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
  __device__ __forceinline__ void add_rounded(const Acc& p) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] += p.v[i];
  }
  __device__ __forceinline__ int4 pack() const {
    int4 out;
    float* f = reinterpret_cast<float*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = v[i];
    return out;
  }
};

// Which lanes end a group: lane k (a slot) whose `key` (its owner rank, -1: none) no later slot
// shares. Ranks in the order of these lanes are ranks in the order of their last slot.
__device__ __forceinline__ unsigned group_ends(int key, unsigned* same) {
  const unsigned m = __match_any_sync(kFull, key);
  *same = m;
  return __ballot_sync(kFull, key >= 0 && (m >> lane_id()) == 1u);
}

// The loads of one batch of rows, all issued before any add (16 in flight per lane: remote rows
// pay a link round trip each): word base + 32 j of each row that is there, for the words below
// n_words.
template <int kSteps, int kSrcBatch, typename Row, typename Word, typename Load>
__device__ __forceinline__ void load_batch(const Row (&row)[kSrcBatch], Word (&v)[kSrcBatch][kSteps], int base,
                                           int n_words, Load load) {
#pragma unroll
  for (int b = 0; b < kSrcBatch; ++b)
    if (row[b] != nullptr) {
#pragma unroll
      for (int j = 0; j < kSteps; ++j)
        if (base + j * 32 < n_words) v[b][j] = load(row[b], base, j);
    }
}

// Warp: sums rows that the lanes in `srcs` point at (lane l's row: `src` shuffled from lane l, as a Row pointer),
// in lane order, word by word; `n_words` words per row, kSteps words per lane per step, and the
// loads of kSrcBatch rows x kSteps words issued before any add (16 loads in flight per lane:
// remote rows pay a link round trip each). `load(row, base, j)` reads word base + 32 j of a row
// as a Word (callers keep their own address arithmetic),
// Acc accumulates Words (zero(), add()), `init(i, acc)` sets word i's start (the biases),
// `store(i, acc)` writes word i of the sum.
template <int kSteps, int kSrcBatch, typename Row, typename Word, typename Acc, typename Load, typename Init,
          typename Store>
__device__ __forceinline__ void warp_sum_batched(unsigned srcs, unsigned long long src, int n_words, Load load,
                                                 Init init, Store store) {
  const int lane = lane_id();
  for (int it = 0; it * 32 * kSteps < n_words; ++it) {  // uniform trip count: shuffles inside
    const int base = it * 32 * kSteps + lane;
    Acc acc[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      acc[j].zero();
      if (base + j * 32 < n_words) init(base + j * 32, acc[j]);
    }
    for (unsigned m = srcs; m;) {
      Row row[kSrcBatch];
#pragma unroll
      for (int b = 0; b < kSrcBatch; ++b) {  // warp-uniform: every lane sees the same m
        row[b] = nullptr;
        if (m) {
          row[b] = reinterpret_cast<Row>(__shfl_sync(kFull, src, __ffs(m) - 1));
          m &= m - 1;
        }
      }
      Word v[kSrcBatch][kSteps];
      load_batch<kSteps, kSrcBatch>(row, v, base, n_words, load);
#pragma unroll
      for (int b = 0; b < kSrcBatch; ++b)
        if (row[b] != nullptr) {
#pragma unroll
          for (int j = 0; j < kSteps; ++j)
            if (base + j * 32 < n_words) acc[j].add(v[b][j]);
        }
    }
#pragma unroll
    for (int j = 0; j < kSteps; ++j)
      if (base + j * 32 < n_words) store(base + j * 32, acc[j]);
  }
}

// As warp_sum_batched, with the rows in groups: `ends` (ascending) are the lanes that close a
// group, `members` (read at those lanes) the group's lanes with a row; each group is summed in
// lane order into a partial that is rounded (Acc::add_rounded) and added to the total when the
// group closes. The expert-major staged combine: a group is a rank's slots.
template <int kSteps, int kSrcBatch, typename Acc, typename Load, typename Init, typename Store>
__device__ __forceinline__ void warp_sum_grouped(unsigned ends, unsigned members, unsigned long long src, int n_words,
                                                 Load load, Init init, Store store) {
  const int lane = lane_id();
  for (int it = 0; it * 32 * kSteps < n_words; ++it) {  // uniform trip count: shuffles inside
    const int base = it * 32 * kSteps + lane;
    Acc acc[kSteps], part[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      acc[j].zero();
      part[j].zero();
      if (base + j * 32 < n_words) init(base + j * 32, acc[j]);
    }
    unsigned g = ends, cur = 0;  // groups left; the current group's lanes left (warp-uniform)
    while (g | cur) {
      const int4* row[kSrcBatch];
      bool close[kSrcBatch];
#pragma unroll
      for (int b = 0; b < kSrcBatch; ++b) {
        row[b] = nullptr;
        close[b] = false;
        if (cur == 0 && g != 0) {
          cur = __shfl_sync(kFull, members, __ffs(g) - 1);
          g &= g - 1;
        }
        if (cur != 0) {
          row[b] = reinterpret_cast<const int4*>(__shfl_sync(kFull, src, __ffs(cur) - 1));
          cur &= cur - 1;
          close[b] = cur == 0;
        }
      }
      int4 v[kSrcBatch][kSteps];
      load_batch<kSteps, kSrcBatch>(row, v, base, n_words, load);
#pragma unroll
      for (int b = 0; b < kSrcBatch; ++b)
        if (row[b] != nullptr) {
#pragma unroll
          for (int j = 0; j < kSteps; ++j) {
            if (base + j * 32 < n_words) part[j].add(v[b][j]);
            if (close[b]) {
              acc[j].add_rounded(part[j]);
              part[j].zero();
            }
          }
        }
    }
#pragma unroll
    for (int j = 0; j < kSteps; ++j)
      if (base + j * 32 < n_words) store(base + j * 32, acc[j]);
  }
}

// The frame both pull-and-sum kernels share. Begin: wait for the call exchange (every rank
// staged its rows); `st` < 0: this rank's host block says why (return), 0: the call was aborted
// on every rank (pull nothing), > 0: go. End: the last block to finish marks the call seen and
// tells every rank that its staging was read.
struct PullFrame {
  Control* me;
  unsigned long long target;
  int st;
};

__device__ __forceinline__ PullFrame begin_pull(const Ctx& c) {
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long target = me->expected[kSlotCall] + 1;
  return {me, target, block_wait_call(c, kSlotCall, target, true)};
}

__device__ __forceinline__ void end_pull(const Ctx& c, const PullFrame& f) {
  __syncthreads();
  if (threadIdx.x == 0 && last_block_done(c, kGridCombine)) {
    f.me->expected[kSlotCall] = f.target;
    if (f.st > 0) done_exchange(c, kSlotCombDone);
  }
}

// Lane k < K: the rank owning token t's slot k (-1: an unused or out-of-range id, or lane >= K).
__device__ __forceinline__ int slot_owner(const CombineArgs& a, int t, int L) {
  if (lane_id() >= a.K) return -1;
  const long long e = a.topk_idx[(long long)t * a.K + lane_id()];
  return (e >= 0 && e < a.E) ? (int)(e / L) : -1;
}

// Lane k: slot k's row in its owner's combine staging, -1 when the dispatch did not deliver it.
__device__ __forceinline__ int slot_row(const CombineArgs& a, int t, int owner) {
  if (owner < 0) return -1;
  const int p = a.slot_pos[(long long)t * a.K + lane_id()];
  return (p >= 0 && p < a.row_limits[owner]) ? p : -1;
}

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

// Word i of token t's starting value: its biases (x's dtype, [T, H] each), 0 without. Read from
// the arguments at each word (kernel parameters cost no registers; the sums need them all).
template <bool kFp32>
__device__ __forceinline__ void add_bias(const CombineArgs& a, long long word, Acc<kFp32>& acc) {
  if (a.bias0 != nullptr) acc.add(__ldg(static_cast<const int4*>(a.bias0) + word));
  if (a.bias1 != nullptr) acc.add(__ldg(static_cast<const int4*>(a.bias1) + word));
}

// kSum (CombineSum): the layout and the order of the sum as a template argument, so that each
// kernel holds one sum (two in one function spill: ptxas allocates for both at once)
template <bool kFp32, int kSum>
__device__ __forceinline__ void combine_step(const Ctx& c, const CombineArgs& a) {
  constexpr bool kPermute = kSum != kSumRankRows;
  constexpr int kChunks = 4;    // 16-byte chunks per lane per step
  constexpr int kSrcBatch = 4;  // source rows loaded together: 16 loads in flight per lane
  constexpr int kGroupChunks = 2;  // the grouped sum keeps a partial too: half the chunks, same registers
  const int R = c.num_ranks, L = a.E / R;
  const PullFrame f = begin_pull(c);
  if (f.st < 0) return;

  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const int row_bytes = a.H * (kFp32 ? 4 : 2);
  const int n16 = row_bytes >> 4;
  const auto load = [](const int4* row, int base, int j) { return __ldcg(row + base + j * 32); };
  for (int t = (f.st > 0 ? gw : a.T); t < a.T; t += tw) {
    // lane k describes slot k; only rows the dispatch delivered (valid id, position inside every
    // rank's input) are read. Rank-major: the owner's row, at the owner's last slot; expert-major:
    // the slot's row, its owner's slots a group that closes at the last of them (kSumSlots: no
    // groups, every slot's row a term of its own).
    const char* src = nullptr;
    const int owner = slot_owner(a, t, L);
    unsigned same;
    const unsigned ends = group_ends(owner, &same);
    const bool last = (ends >> lane_id()) & 1u;
    int pos = -1;
    if constexpr (!kPermute) {
      if (owner >= 0) {
        const int p = a.rank_pos[(long long)t * R + owner];
        pos = (p >= 0 && p < a.row_limits[owner]) ? p : -1;
      }
      if (last && pos >= 0) src = region(c, owner) + c.lay.comb_x + (long long)pos * row_bytes;
    } else {
      pos = slot_row(a, t, owner);
      if (pos >= 0) src = region(c, owner) + c.lay.comb_x + (long long)pos * row_bytes;
    }
    const unsigned has = __ballot_sync(kFull, src != nullptr);
    const unsigned long long src_u = reinterpret_cast<unsigned long long>(src);
    int4* y = reinterpret_cast<int4*>(static_cast<char*>(a.y) + (long long)t * row_bytes);
    const auto init = [&](int i, Acc<kFp32>& acc) { add_bias<kFp32>(a, (long long)t * n16 + i, acc); };
    const auto store = [&](int i, const Acc<kFp32>& acc) { y[i] = acc.pack(); };
    if constexpr (kSum != kSumGrouped)  // one term per rank (rank-major) or per slot, in lane order
      warp_sum_batched<kChunks, kSrcBatch, const int4*, int4, Acc<kFp32>>(has, src_u, n16, load, init, store);
    else
      warp_sum_grouped<kGroupChunks, kSrcBatch, Acc<kFp32>>(ends, same & has, src_u, n16, load, init, store);
    scatter_weight(c, a, t, owner, pos);
  }
  end_pull(c, f);
}


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
struct Sum4 {  // four fp32 channels
  float4 v;
  __device__ __forceinline__ void zero() { v = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ void add(const float4& x) {
    v.x += x.x;
    v.y += x.y;
    v.z += x.z;
    v.w += x.w;
  }
};

// `init(i, acc)`: word i's start (no bias: nothing to add to the zeros)
struct NoInit {
  __device__ __forceinline__ void operator()(int, Sum4&) const {}
};

// The biases of one token, four channels at a time (x's dtype, [T, H] each).
template <bool kFp32>
struct BiasInit4 {
  const char *b0, *b1;  // token t's bias rows, or nullptr
  __device__ __forceinline__ BiasInit4(const CombineArgs& a, int t, long long row_bytes)
      : b0(a.bias0 != nullptr ? static_cast<const char*>(a.bias0) + t * row_bytes : nullptr),
        b1(a.bias1 != nullptr ? static_cast<const char*>(a.bias1) + t * row_bytes : nullptr) {}
  __device__ __forceinline__ void operator()(int i, Sum4& acc) const {
    if (b0 != nullptr) acc.add(load4<kFp32>(b0, i));
    if (b1 != nullptr) acc.add(load4<kFp32>(b1, i));
  }
};

template <bool kInFp32, bool kOutFp32, typename Init = NoInit>
__device__ __forceinline__ void warp_sum_rows(char* dst, unsigned srcs, unsigned long long src, int H,
                                              Init init = Init()) {
  warp_sum_batched<4, 4, const char*, float4, Sum4>(
      srcs, src, H >> 2, [](const char* row, int base, int j) { return load4<kInFp32>(row, base + j * 32); }, init,
      [&](int i, const Sum4& acc) { store4<kOutFp32>(dst, i, acc.v); });
}

// Local pre-reduction of an expert-major combine: partial[n] = sum of rank-major row n's expert
// rows in slot order (fp32), rounded to x's dtype (the rank's term of the combine order above)
// into this rank's combine area, weights staged; then the call exchange.
template <bool kFp32>
__device__ __forceinline__ void combine_reduce_step(const Ctx& c, const CallArgs& call, const CombineReduceArgs& a) {
  const int K = a.K, lane = lane_id();
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const long long row = (long long)a.H * (kFp32 ? 4 : 2);  // input rows and partials alike
  const int N = a.recv_info[RecvInfo::kRows];
  char* partials = region(c, c.rank) + c.lay.comb_x;
  for (int n = gw; n < N; n += tw) {
    const char* src = nullptr;
    if (lane < K) {
      const int p = a.map[(long long)n * K + lane];
      if (p >= 0 && p < a.rows) src = static_cast<const char*>(a.x) + p * row;
    }
    warp_sum_rows<kFp32, kFp32>(partials + n * row, __ballot_sync(kFull, src != nullptr),
                                reinterpret_cast<unsigned long long>(src), a.H);
  }
  if (a.w != nullptr) {
    float* dst = at<float>(c, c.rank, c.lay.comb_w);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < a.rows; i += (long long)gridDim.x * blockDim.x)
      dst[i] = a.w[i];
  }
  finish_combine_stage(c, call, a.w != nullptr, blockIdx.x == 0 && threadIdx.x == 0);
}

// Second half: y[t] = the biases + the token's partial at each rank it went to (x's dtype, one
// row per rank), ranks in the order of their last slot.
template <bool kFp32>
__device__ __forceinline__ void combine_partials_step(const Ctx& c, const CombineArgs& a) {
  const int R = c.num_ranks, L = a.E / R;
  const PullFrame f = begin_pull(c);
  if (f.st < 0) return;
  const int gw = blockIdx.x * kCopyWarps + (threadIdx.x >> 5), tw = gridDim.x * kCopyWarps;
  const long long row = (long long)a.H * (kFp32 ? 4 : 2);  // partials and y alike
  for (int t = (f.st > 0 ? gw : a.T); t < a.T; t += tw) {
    const char* src = nullptr;
    const int owner = slot_owner(a, t, L), pos = slot_row(a, t, owner);
    unsigned same;
    if ((group_ends(owner, &same) >> lane_id()) & 1u) {
      // every rank-major row has a partial (zeros where all its slots were dropped)
      const int p = a.rank_pos[(long long)t * R + owner];
      if (p >= 0) src = region(c, owner) + c.lay.comb_x + p * row;
    }
    warp_sum_rows<kFp32, kFp32>(static_cast<char*>(a.y) + t * row, __ballot_sync(kFull, src != nullptr),
                                reinterpret_cast<unsigned long long>(src), a.H, BiasInit4<kFp32>(a, t, row));
    scatter_weight(c, a, t, owner, pos);
  }
  end_pull(c, f);
}

}  // namespace mep
