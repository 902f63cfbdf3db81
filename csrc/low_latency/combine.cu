// The low-latency combine kernel (send and receive halves), the failure publication kernel and
// their launchers (the path's design: dispatch.cu).
#include "low_latency/device.cuh"
#include "low_latency/logfmt.cuh"

namespace mep {
namespace low_latency {

// ------------------------------------------------------------------------------------- combine
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

// Merged send's part of a row with LogFMT: the copy, or the copies' weighted sum, in this warp's
// staging row first (`stage_row`, the slot's layout); then its blocks encoded into the slot of a
// reachable peer, or in place in the staging row and put (the blocks, then their meta words).
// Not inlined: it would push the combine kernel into spills.
__device__ __noinline__ void merged_send_logfmt(const LLCtx& c, int s, long long slot_off, char* stage_row, const int4* x,
                                                const int* rows, const float* w, int n, int n16, int b16, int m16, int H) {
  char* peer = c.peer_base[s];
  char* stage = stage_row + (long long)b16 * 16;
  const char* src_row = n == 1 ? reinterpret_cast<const char*>(x + (long long)rows[0] * n16) : stage_row;
  if (n > 1) merge_rows(reinterpret_cast<int4*>(stage), x, rows, w, n, n16, b16, m16);
  __syncwarp();
  logfmt_encode_blocks(peer != nullptr ? peer + slot_off : stage_row, src_row, H, b16 / 16, (b16 + m16) / 16);
  __syncwarp();
  if (peer != nullptr) return;
  send_row(c, s, slot_off + (long long)b16 * 16, stage, m16 * 16);
  const long long moff = 2LL * H + b16 / 16 * 4;  // then the blocks' meta words (a put: any byte count)
  send_row(c, s, slot_off + moff, stage_row + moff, m16 / 16 * 4);
}

// Merged send (the dispatch carried the weights): a warp per (source rank, token) unit, or a
// channel share of one (`msplit` warps per unit), finds the token's copies here through the
// dispatch's `pairs` (each entry checked against src / slot / range: entries of copies elsewhere
// are stale), and sends one row to the source's slot of its first copy here: the copy itself
// when it is the only one (the source weights it), else the weighted sum of the copies in fp32,
// k ascending, rounded to bf16. At EP 2, top-8 of 256, that is ~1 row per token instead of ~4.
// Each rank then sends every source one flag (c_flag word `rank`) once all its units for that
// source are done.
template <bool kLogfmt, int kS>
__device__ __forceinline__ void merged_send(const LLCtx& c, const LLCombineArgs& a, int gw, int num_warps) {
  __shared__ int s_mrow[kLLWarps][kMaxTopk];  // the unit's copies here, k ascending
  __shared__ float s_mw[kLLWarps][kMaxTopk];
  constexpr unsigned kFull = 0xffffffffu;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int R = c.num_ranks, L = a.E / R, set = a.set, K = a.K, mt = a.out_cap / R;
  const LowLatencyLayout& lay = c.lay;
  LowLatencyState* st = state_of(c);
  const int n16 = a.H / 8, units = R * mt;  // 16-byte words of a bf16 row
  // every warp busy, each with at least 64 words of the row; LogFMT: whole 128-channel blocks (16 words)
  const int msplit = max(1, min(num_warps / max(1, units), n16 / 64));
  int chunk = (n16 + msplit - 1) / msplit;
  if (kLogfmt) chunk = (chunk + 15) / 16 * 16;
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
    if (gone<kS>(s)) continue;  // masked: nothing for it (no rows, no flag)
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
    char* stage_row = c.base + lay.set_offset(set) + lay.c_stage + (long long)gw * lay.c_row;
    char* stage = stage_row + (long long)b16 * 16;
    if constexpr (kLogfmt) {
      if (m16 > 0)
        merged_send_logfmt(c, s, lay.c_slot(set, t, k1), stage_row, x, s_mrow[warp], s_mw[warp], n, n16, b16, m16, a.H);
    } else {
      int4* dst = reinterpret_cast<int4*>(peer != nullptr ? peer + off : stage);  // puts read symmetric memory
      if (n == 1) {
        warp_copy16(dst, x + (long long)s_mrow[warp][0] * n16 + b16, m16);
      } else {
        merge_rows(dst, x, s_mrow[warp], s_mw[warp], n, n16, b16, m16);
      }
      __syncwarp();
      if (peer == nullptr) send_row(c, s, off, stage, m16 * 16);
    }
    __syncwarp();  // s_mrow / s_mw are rewritten for the warp's next unit
  }
  if (cur >= 0) flush();
}

// kLogfmt: the rows travel as LogFMT-10 (low_latency/logfmt.cuh); kShrink: the rank mask is on
// (c.shrink). Each an instantiation of its own, so the plain kernel keeps its registers (the
// mask's waits alone pushed it into spills).
template <bool kLogfmt, bool kShrink>
__global__ void __launch_bounds__(kLLThreads, 1) combine_kernel(const LLCtx c, const LLCombineArgs a) {
  constexpr int kS = kShrink ? 1 : 0;  // every helper's mask test known at compile time
  const int warp = threadIdx.x / 32;
  const int R = c.num_ranks, L = a.E / R, set = a.set;
  const int num_warps = gridDim.x * kLLWarps, gw = blockIdx.x * kLLWarps + warp;
  const LowLatencyLayout& lay = c.lay;
  LowLatencyState* st = state_of(c);
  const int row_bytes = a.H * 2;
  const bool merged = a.pairs != nullptr;  // the dispatch carried the weights (merged_send)
  // the rank mask: ranks masked here get no rows and are not waited for (their experts' slots
  // drop out of the sum, not renormalised)
  take_mask<kS>(c);
  stamp(c, 1, kLLTraceEntry);

  if (a.phases & kLLSend) {
    const bool released = wait_released<kS>(c, set, kOpLowLatencyCombine, a.sig);
    take_mask<kS>(c);  // with the receivers a release wait masked
    if (released) {
      stamp(c, 1, kLLTraceReleased);
      if (merged) {
        merged_send<kLogfmt, kS>(c, a, gw, num_warps);
      } else {
        // (local expert, token rank) pairs, each split over `split` warps by row; the pair's last
        // warp to finish sends its flag
        const int pairs = L * R, split = num_warps > pairs ? num_warps / pairs : 1;
        for (int u = gw; u < pairs * split; u += num_warps) {
          const int e = u / split / R, s = u / split % R, g = u % split;
          if (gone<kS>(s)) continue;  // masked: nothing for it (no rows, no flag)
          const int begin = a.range[((long long)e * R + s) * 2], n = a.range[((long long)e * R + s) * 2 + 1];
          for (int i = g; i < n; i += split) {
            const long long row = (long long)e * a.out_cap + begin + i;
            const int t = a.src[row], k = a.slot[row];
            const char* xrow = static_cast<const char*>(a.x) + row * row_bytes;
            const char* from = xrow;
            if constexpr (kLogfmt) {  // encoded straight into a reachable peer's slot, else into the staging row
              char* stage = c.base + lay.set_offset(set) + lay.c_stage + (long long)gw * lay.c_row;
              char* peer = c.peer_base[s];
              logfmt_encode_blocks(peer != nullptr ? peer + lay.c_slot(set, t, k) : stage, xrow, a.H, 0, a.H / 128);
              __syncwarp();
              if (peer == nullptr) send_row(c, s, lay.c_slot(set, t, k), stage, row_bytes + (int)ll_logfmt_meta_bytes(a.H));
            } else {
              if (c.peer_base[s] == nullptr) {  // puts read symmetric memory: stage the row
                char* stage = c.base + lay.set_offset(set) + lay.c_stage + (long long)gw * lay.c_row;
                warp_copy16(reinterpret_cast<int4*>(stage), reinterpret_cast<const int4*>(xrow), row_bytes / 16);
                from = stage;
              }
              send_row(c, s, lay.c_slot(set, t, k), from, row_bytes);
            }
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
      if (e >= 0 && gone<kS>(e / L)) e = -1;  // a masked rank's experts: the slot drops out
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
        bool is_gone;
        const WaitSite at{kOpLowLatencyCombine, what, word, peer, set, a.sig};
        const long long t0 = clock64();
        if constexpr (kShrink) {
          ok = wait_peer<kS>(c, flags + word, [](long long x) { return x != 0; }, v, is_gone, at);
        } else {
          ok = wait_word<kS>(c, flags + word, [](long long x) { return x != 0; }, v, at);
          is_gone = false;
        }
        if (a.wait_stats != nullptr)
          atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + peer), (unsigned long long)(clock64() - t0));
        if (is_gone) {
          s_on[k] = false;  // masked during this wait: its rows drop out
        } else if (ok && decoded_sig(v) != a.sig) {
          report(c, kErrMismatch, at, decoded_sig(v));
        }
      }
    }
    if (!__syncthreads_and(ok)) break;  // timed out (reported): every later wait returns at once
    if (t == blockIdx.x) stamp(c, 1, kLLTraceArrived);
    if constexpr (kLogfmt) {
      logfmt_reduce_token(c.base + lay.c_slot(set, t, 0), lay.c_row, s_w, s_on, a.K, a.H,
                          reinterpret_cast<int4*>(a.y) + (long long)t * (a.H / 8));
    } else {
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
    }
    __syncthreads();  // s_w, s_on are rewritten for the next token
  }
  stamp(c, 1, kLLTraceCopied, true);
  if (merged) {
    finish_receive<kS>(c, set, lay.c_flag, lay.num_experts, R, 1, a.sig, kLLWaitRankFlag);
  } else {
    finish_receive<kS>(c, set, lay.c_flag, lay.num_experts, a.E, L, a.sig);
  }
  stamp(c, 1, kLLTraceEnd);
}

// This rank failed before joining a call: every peer's waits stop and name it.
__global__ void publish_failure_kernel(const LLCtx c, long long seq) {
  if (threadIdx.x == 0)
    sym::publish_failure(c.peer_base, c.base, c.pe, c.num_ranks, c.rank,
                         c.lay.state + (long long)offsetof(LowLatencyState, peer_failed), c.rank, seq);
}

}  // namespace low_latency

void launch_ll_combine(const LLCtx& c, const LLCombineArgs& a, int num_blocks, cudaStream_t stream) {
  LLCtx cs = c;
  cs.seq = a.seq;
  const auto launch = [&](auto kernel) { kernel<<<num_blocks, kLLThreads, 0, stream>>>(cs, a); };
  if (a.use_logfmt) {
    c.shrink ? launch(low_latency::combine_kernel<true, true>) : launch(low_latency::combine_kernel<true, false>);
  } else {
    c.shrink ? launch(low_latency::combine_kernel<false, true>) : launch(low_latency::combine_kernel<false, false>);
  }
  low_latency::check(cudaGetLastError(), "combine launch");
}

void launch_ll_publish_failure(const LLCtx& c, long long seq, cudaStream_t stream) {
  low_latency::publish_failure_kernel<<<1, 32, 0, stream>>>(c, seq);
  low_latency::check(cudaGetLastError(), "failure publication launch");
}

void ll_touch_combine_kernels() {
  cudaFuncAttributes attr;
  low_latency::check(cudaFuncGetAttributes(&attr, low_latency::publish_failure_kernel),
                     "loading the failure publication kernel");
  low_latency::check(cudaFuncGetAttributes(&attr, low_latency::combine_kernel<false, false>), "loading the combine kernel");
  low_latency::check(cudaFuncGetAttributes(&attr, low_latency::combine_kernel<true, false>),
                     "loading the LogFMT combine kernel");
  low_latency::check(cudaFuncGetAttributes(&attr, low_latency::combine_kernel<false, true>),
                     "loading the rank-mask combine kernel");
  low_latency::check(cudaFuncGetAttributes(&attr, low_latency::combine_kernel<true, true>),
                     "loading the rank-mask LogFMT combine kernel");
}

void ll_touch_kernels() {
  ll_touch_combine_kernels();
  ll_touch_mask_kernels();
  ll_touch_dispatch_kernel();
}

}  // namespace mep
