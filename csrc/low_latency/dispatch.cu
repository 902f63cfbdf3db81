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
//
// This file: the dispatch kernel (send and receive halves) and its launcher.
#include "low_latency/device.cuh"

namespace mep {
namespace low_latency {

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

// `ids_in_smem`: the T*K ids and an E-entry copy count fit in the dynamic shared memory
// (kLLIdsSmemBytes) and T in the static token masks (kLLMaskTokens), else each scan reads the ids
// from global memory.
__global__ void __launch_bounds__(kLLThreads, 1) dispatch_kernel(const LLCtx c, const LLDispatchArgs a,
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
  // the rank mask: ranks masked here are neither sent to nor waited for (0 tokens from them)
  take_mask(c);
  stamp(c, 0, kLLTraceEntry);

  if (a.phases & kLLSend) {
    // every copy's expert (-1: unused slot) once per block, and the copies per expert: the
    // prefix counts below scan the ids up to their copy, the counts answer "how many" at once
    // and per token the mask of its receiving ranks (R <= 64): a row's position scan then tests
    // one bit per earlier token instead of dividing K ids by L (the integer divisions would
    // dominate the scans)
    // A thread's first kIdsAhead ids are loaded here and stored after the cast below, so their
    // loads and the cast's overlap instead of being two memory round trips one after the other
    // at the kernel's start; 2 per thread cover T*K <= 1024, the decode shape.
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
    const bool released = wait_released(c, set, kOpLowLatencyDispatch, a.sig);  // (a block barrier: s_ids and staging are filled)
    take_mask(c);  // with the receivers a release wait masked
    if (released) {
      stamp(c, 0, kLLTraceReleased);
      // experts this rank sends nothing to: their count (0) first, before this warp has stores in
      // flight (a release store then waits for none); by the blocks without a token when there
      // are some (T < blocks), else one warp each from the last blocks
      const int idle_warps = gridDim.x > a.T ? (gridDim.x - a.T) * kLLWarps : 0;
      const int zw = idle_warps > 0 ? gw - a.T * kLLWarps : num_warps - 1 - gw;
      const int zstride = idle_warps > 0 ? idle_warps : num_warps;
      for (int e = zw; zw >= 0 && e < a.E; e += zstride)
        if (!gone(e / L) && copies_to(e) == 0 && lane == 0)
          put_signal(c, e / L, count_offset(e), encode(0, a.sig), false);  // orders nothing
      stamp(c, 0, kLLTraceZero, true);
      // the warps of one row: a fixed number for the whole call (a copy's count closes after
      // copies x `per` parts), enough for min(K, R) destinations to use every warp
      const int per = max(1, kLLWarps / max(1, min(a.K, R))), n16 = payload / 16, chunk = (n16 + per - 1) / per;
      for (int t = blockIdx.x; t < a.T; t += gridDim.x) {
        const char* stage = c.base + lay.set_offset(set) + lay.d_send + (long long)t * lay.d_msg;
        // this token's receiving ranks, each once, in slot order
        if (warp == 0) {
          const int e = lane < a.K ? id(t * a.K + lane) : -1;
          const int d = e >= 0 && !gone(e / L) ? e / L : -1;
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
      if (gone(r)) continue;  // a masked source sends nothing
      long long v;
      bool is_gone;
      const WaitSite at{kOpLowLatencyDispatch, kLLWaitCount, e, r, set, a.sig};
      const long long t0 = clock64();
      const bool arrived = wait_peer(c, counts + (long long)e * R + r, [](long long x) { return x != 0; }, v, is_gone, at);
      ok &= arrived;
      // every unit waits for all sources (its rows go after theirs); the wait charged to source s
      // is the one of the unit that copies s's rows, so each (expert, source) counts once
      if (a.wait_stats != nullptr && g == 0 && r == s)
        atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + s), (unsigned long long)(clock64() - t0));
      if (!arrived || is_gone) continue;  // masked during this wait: 0 tokens from it
      int n = decoded_count(v);
      if (decoded_sig(v) != a.sig) {
        if (g == 0 && s == 0) report(c, kErrMismatch, at, decoded_sig(v));
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
      if (a.out_layout != nullptr) a.out_layout[(long long)e * R + s] = ((long long)before << 32) | (unsigned)mine;
      if (s == 0) {
        a.out_count[e] = total;
        if (a.recv_stats != nullptr) atomicAdd(a.recv_stats + e, total);
      }
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
      const auto put_scale = [&](int j, float v) {
        if (a.out_ue8m0 == nullptr) {
          a.out_scales[row * nsc + j] = v;
        } else {  // the exponent byte (v is a power of two: round_scale), byte j % 4 of int32 (e, j / 4, row)
          const long long word = ((long long)e * (nsc / 4) + j / 4) * a.out_cap + (row - (long long)e * a.out_cap);
          reinterpret_cast<uint8_t*>(a.out_ue8m0)[word * 4 + j % 4] = (uint8_t)(__float_as_uint(v) >> 23);
        }
      };
#pragma unroll
      for (int r = 0; r < kLLScaleRegs; ++r)
        if (lane + r * 32 < nsc) put_scale(lane + r * 32, sc_reg[r]);
      for (int j = lane + kLLScaleRegs * 32; j < nsc; j += 32) put_scale(j, __ldcg(sc + j));
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


}  // namespace low_latency

void launch_ll_dispatch(const LLCtx& c, const LLDispatchArgs& a, int num_blocks, cudaStream_t stream) {
  const long long ids_bytes = ((long long)a.T * a.K + a.E) * sizeof(int);  // ids, then the per-expert counts
  const bool ids_in_smem = ids_bytes <= kLLIdsSmemBytes && a.T <= kLLMaskTokens;
  LLCtx cs = c;
  cs.seq = a.seq;
  low_latency::dispatch_kernel<<<num_blocks, kLLThreads, ids_in_smem ? ids_bytes : 0, stream>>>(cs, a, ids_in_smem);
  low_latency::check(cudaGetLastError(), "dispatch launch");
}

void ll_touch_dispatch_kernel() {
  cudaFuncAttributes attr;
  low_latency::check(cudaFuncGetAttributes(&attr, low_latency::dispatch_kernel), "loading the dispatch kernel");
  low_latency::check(cudaFuncSetAttribute(low_latency::dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kLLIdsSmemBytes),
                     "the dispatch kernel's shared memory");
}

}  // namespace mep
