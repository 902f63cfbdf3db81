// Device helpers every kernel family uses: PTX memory-ordering primitives (cross-process and
// cross-GPU handshakes), the global timer, warp reductions, wide copies and bf16 packing. One
// copy of each: the IPC handshake (ipc/handshake.cuh), the NVSHMEM waits (nvshmem/waits.cuh) and
// every path's kernels include this file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace mep {

// ------------------------------------------------------------------------------ memory order
__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }
__device__ __forceinline__ long long ld_volatile(const long long* p) {
  return *reinterpret_cast<const volatile long long*>(p);
}

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

__device__ __forceinline__ long long ld_acquire_sys(const long long* p) {
  long long v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Polling: relaxed loads, then one acquire fence once the word is seen (an acquire pattern in
// PTX's model), so many pollers do not each pay a system-scope acquire per poll.
__device__ __forceinline__ long long ld_relaxed_sys(const long long* p) {
  long long v;
  asm volatile("ld.relaxed.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void st_release_sys(long long* p, long long v) {
  asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Counters that several warps bump after their stores: the one that sees the final count has
// acquired every earlier bump (and, cumulatively, the stores before them) and signals for all.
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ int warp_sum(int v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ------------------------------------------------------------------------------------- copies
// Warp copy of n16 16-byte words, U loads in flight per lane before their stores.
template <int U>
__device__ __forceinline__ void warp_copy(int4* __restrict__ dst, const int4* __restrict__ src, int n16) {
  const int lane = lane_id();
  for (int base = lane; base < n16; base += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (base + j * 32 < n16) v[j] = __ldcg(src + base + j * 32);
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (base + j * 32 < n16) dst[base + j * 32] = v[j];
  }
}

// Grid-wide copy of n16 16-byte words, U independent loads in flight per thread (a streaming
// copy with one load in flight per thread reaches only a fraction of HBM bandwidth).
template <int U>
__device__ __forceinline__ void grid_copy16(int4* __restrict__ dst, const int4* __restrict__ src, long long n16) {
  const long long nthreads = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * nthreads < n16; i += U * nthreads) {
    int4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) v[j] = __ldg(src + i + j * nthreads);
#pragma unroll
    for (int j = 0; j < U; ++j) dst[i + j * nthreads] = v[j];
  }
  for (; i < n16; i += nthreads) dst[i] = __ldg(src + i);
}

// Any byte count and alignment: 16-byte words when both sides allow, else 4-byte, else bytes.
__device__ __forceinline__ void warp_copy_bytes(char* dst, const char* src, int bytes) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(dst) | reinterpret_cast<unsigned long long>(src);
  if ((a & 15) == 0) {
    const int n16 = bytes >> 4;
    warp_copy<4>(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src), n16);
    for (int i = (n16 << 4) + lane_id(); i < bytes; i += 32) dst[i] = src[i];
  } else if ((a & 3) == 0) {
    const int n4 = bytes >> 2;
    for (int i = lane_id(); i < n4; i += 32) reinterpret_cast<int*>(dst)[i] = __ldcg(reinterpret_cast<const int*>(src) + i);
    for (int i = (n4 << 2) + lane_id(); i < bytes; i += 32) dst[i] = src[i];
  } else {
    for (int i = lane_id(); i < bytes; i += 32) dst[i] = src[i];
  }
}

__device__ __forceinline__ void warp_zero_bytes(char* dst, int bytes) {
  if ((reinterpret_cast<unsigned long long>(dst) & 15) == 0) {
    const int n16 = bytes >> 4;
    const int4 z = make_int4(0, 0, 0, 0);
    for (int i = lane_id(); i < n16; i += 32) reinterpret_cast<int4*>(dst)[i] = z;
    for (int i = (n16 << 4) + lane_id(); i < bytes; i += 32) dst[i] = 0;
  } else {
    for (int i = lane_id(); i < bytes; i += 32) dst[i] = 0;
  }
}


// The NVSHMEM paths' row copies (their kernels were tuned with these loop shapes; warp_copy's
// per-lane trip count compiles differently):
// a warp copy of n16 16-byte words, four loads in flight per lane while four words remain.
__device__ __forceinline__ void warp_copy16(int4* dst, const int4* src, int n16) {
  const int lane = threadIdx.x & 31;
  int i = lane;
  for (; i + 96 < n16; i += 128) {
    int4 a = __ldcg(src + i), b = __ldcg(src + i + 32), d = __ldcg(src + i + 64), e = __ldcg(src + i + 96);
    dst[i] = a, dst[i + 32] = b, dst[i + 64] = d, dst[i + 96] = e;
  }
  for (; i < n16; i += 32) dst[i] = __ldcg(src + i);
}

// A warp copy with all of a lane's loads (up to kDepth words) issued before its stores, in
// warp-uniform steps: a 7 KB row in one memory round trip at depth 16 (a warp per row: latency,
// not bandwidth, bounds).
template <int kDepth>
__device__ __forceinline__ void warp_copy16_deep(int4* dst, const int4* src, int n16) {
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < n16; base += 32 * kDepth) {
    int4 v[kDepth];
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      const int j = base + i * 32 + lane;
      if (j < n16) v[i] = __ldcg(src + j);
    }
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      const int j = base + i * 32 + lane;
      if (j < n16) dst[j] = v[i];
    }
  }
}

// ------------------------------------------------------------------------------------- bf16
// acc[0..8) += the 8 bf16 values of a 16-byte word (fp32)
__device__ __forceinline__ void add_bf16x8(float* acc, const int4& word) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&word);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

// acc[0..8) += w * the 8 bf16 values of a 16-byte word (fp32)
__device__ __forceinline__ void axpy_bf16x8(float* acc, float w, const int4& word) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&word);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += w * f.x;
    acc[2 * i + 1] += w * f.y;
  }
}

// 8 fp32 values rounded to bf16 (nearest even), as one 16-byte word
__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
  int4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return out;
}

}  // namespace mep
