// LogFMT-10 for the low-latency combine's rows (megatron_ep/core/logfmt.py defines the format and is
// its reference). A row in a combine slot, with LogFMT:
//   block b (128 channels) at byte b * 256: 160 bytes of 10-bit codes when the block is encoded
//   (code j at bit 10 * j, little-endian words: index in bits 0-8, sign in bit 9), else its 256
//   bf16 bytes;
//   at byte 2 * H: one word per block, bf16 amax (low half) and amin (high half) of its
//   magnitudes, from which sender and receiver both decide "encoded" and the log scale.
// Blocks keep their bf16 positions, so a receiver finds block b without a prefix over the others;
// an encoded block's last 96 bytes are not sent.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "common/device.cuh"  // pack_bf16x8

namespace mep {
namespace low_latency {

constexpr int kLogfmtBlock = 128;            // channels per block
constexpr int kLogfmtBlockBytes = 256;       // its bf16 bytes (its place in the slot)
constexpr int kLogfmtEncodedBytes = 160;     // 128 codes x 10 bits
constexpr int kLogfmtLevels = 512;           // indices 0 (zero), 1 .. 511 over [amin, amax]
constexpr float kLogfmtClip = 32.f;          // log2 range below amax a block keeps
constexpr float kLogfmtThreshold = 0.f;      // blocks with log2(amax) at or above it stay bf16

struct LogfmtScale {
  bool on;
  float log_amin, step;
};

__device__ __forceinline__ LogfmtScale logfmt_scale(float amax, float amin) {
  LogfmtScale s{false, 0.f, 1.f};
  if (!(amax > 0.f)) return s;  // an all-zero block stays bf16, as does one with a NaN
  const float log_amax = log2f(amax);
  s.log_amin = amin > 0.f ? fmaxf(log2f(amin), log_amax - kLogfmtClip) : log_amax - kLogfmtClip;
  s.on = log_amax < kLogfmtThreshold && s.log_amin < log_amax;
  if (s.on) s.step = (log_amax - s.log_amin) / (float)(kLogfmtLevels - 2);
  return s;
}

// Not inlined (nor is logfmt_reduce_token below): inlined, their registers pushed the combine kernel
// into spills.
// Warp: blocks [b0, b1) of the bf16 row `src` (local memory) into `dst` (a peer's slot, or a local
// staging row) in the layout above: each block's code words or bf16 bytes at dst + b * 256, its
// meta word at dst + 2H + 4b. Stores only; the caller orders them before its flag.
__device__ __noinline__ void logfmt_encode_blocks(char* dst, const char* src, int H, int b0, int b1) {
  const int lane = threadIdx.x & 31;
  uint32_t* meta = reinterpret_cast<uint32_t*>(dst + 2LL * H);
  for (int b = b0; b < b1; ++b) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src + (long long)b * kLogfmtBlockBytes + lane * 8);
    const uint16_t h[4] = {(uint16_t)(raw.x & 0xffffu), (uint16_t)(raw.x >> 16), (uint16_t)(raw.y & 0xffffu),
                           (uint16_t)(raw.y >> 16)};
    float a[4], amax = 0.f, amin = INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = __uint_as_float((uint32_t)(h[i] & 0x7fffu) << 16);  // |bf16| as fp32, exact
      amax = fmaxf(amax, a[i]), amin = fminf(amin, a[i]);
    }
    for (int o = 16; o; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      amin = fminf(amin, __shfl_xor_sync(0xffffffffu, amin, o));
    }
    // fmaxf drops NaN: a block holding one stays bf16 on both sides (its amax sent as NaN)
    if (__any_sync(0xffffffffu, isnan(a[0]) || isnan(a[1]) || isnan(a[2]) || isnan(a[3]))) amax = NAN;
    // the meta carries them as bf16: exact, they are bf16 magnitudes (NaN's top half is a bf16 NaN)
    const uint32_t m = (__float_as_uint(amax) >> 16) | (__float_as_uint(amin) & 0xffff0000u);
    if (lane == 0) meta[b] = m;
    const LogfmtScale s = logfmt_scale(amax, amin);
    char* out = dst + (long long)b * kLogfmtBlockBytes;
    if (!s.on) {
      *reinterpret_cast<uint2*>(out + lane * 8) = raw;
      continue;
    }
    const float rounding = 2.f - log2f((1.f + exp2f(s.step)) * 0.5f) / s.step;
    unsigned long long v = 0;  // this lane's 4 codes, 40 bits
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      unsigned idx = 0;
      if (a[i] > 0.f) idx = (unsigned)fminf(floorf(fmaxf((log2f(a[i]) - s.log_amin) / s.step + rounding, 0.f)),
                                            (float)(kLogfmtLevels - 1));
      v |= (unsigned long long)(idx | ((h[i] >> 15) << 9)) << (10 * i);
    }
    // the block's 1280 bits as 40 words: word w holds bits [32w, 32w + 32), from lanes 32w / 40 on
    uint32_t* words = reinterpret_cast<uint32_t*>(out);
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const int w = lane + pass * 32, bit = 32 * w;
      const int l0 = min(bit / 40, 31), off = bit - 40 * l0;
      const unsigned long long lo = __shfl_sync(0xffffffffu, v, l0);
      const unsigned long long hi = __shfl_sync(0xffffffffu, v, min(l0 + 1, 31));
      const uint32_t word = (uint32_t)((lo >> off) | (off > 8 ? hi << (40 - off) : 0ull));
      if (w < kLogfmtEncodedBytes / 4) words[w] = word;
    }
  }
}

// Thread: acc[0..8) += w * the decoded channels 8v .. 8v + 7 of the slot's row (layout above).
__device__ __forceinline__ void logfmt_axpy8(float* acc, float w, const char* slot, int H, int v) {
  const int b = v / (kLogfmtBlock / 8), j0 = (v % (kLogfmtBlock / 8)) * 8;
  const uint32_t m = __ldcg(reinterpret_cast<const unsigned*>(slot + 2LL * H) + b);
  const LogfmtScale s = logfmt_scale(__uint_as_float(m << 16), __uint_as_float(m & 0xffff0000u));
  if (!s.on) {
    axpy_bf16x8(acc, w, __ldcg(reinterpret_cast<const int4*>(slot) + v));
    return;
  }
  // codes j0 .. j0 + 7: bits [10 j0, 10 j0 + 80) of the block, inside words q .. q + 3
  const unsigned* words = reinterpret_cast<const unsigned*>(slot + (long long)b * kLogfmtBlockBytes);
  const int q = 10 * j0 / 32;
  unsigned u[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) u[i] = __ldcg(words + q + i);  // word 40 at most: inside the block's 256 bytes
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int p = 10 * (j0 + i) - 32 * q, wi = p / 32, off = p % 32;
    const unsigned long long two = (unsigned long long)u[wi] | ((unsigned long long)(wi + 1 < 4 ? u[wi + 1] : 0u) << 32);
    const unsigned code = (unsigned)(two >> off) & 0x3ffu, idx = code & 0x1ffu;
    const float mag = idx == 0 ? 0.f : exp2f((float)(idx - 1) * s.step + s.log_amin);
    acc[i] += w * ((code >> 9) ? -mag : mag);
  }
}

// Block: y[v] = bf16(sum over k with on[k] of w[k] x the decoded row of slot k), 16-byte words v of
// a token's output; `slot0` the token's slot 0, slots `c_row` bytes apart. Not inlined (above).
__device__ __noinline__ void logfmt_reduce_token(const char* slot0, long long c_row, const float* w, const bool* on, int K,
                                                 int H, int4* y) {
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < K; ++k)  // k ascending, as the reference sums
      if (on[k]) logfmt_axpy8(acc, w[k], slot0 + k * c_row, H, v);
    y[v] = pack_bf16x8(acc);
  }
}

}  // namespace low_latency
}  // namespace mep
