// Layout: the routing summary of one rank's tokens (get_dispatch_layout), and the ids' check of
// the calls that cannot make it in notify. Local, no peers.

#include "common/cuda_check.h"
#include "intranode/api.h"
#include "intranode/common.cuh"

namespace mep {

constexpr int kLayoutThreads = 256;

__device__ __forceinline__ void add_count(long long* p, int v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}
__device__ __forceinline__ void add_count(int* p, int v) { atomicAdd(p, v); }

// C: the counts' type (int64 for Buffer.get_dispatch_layout, int32 for DeepEP's)
template <typename C>
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(const long long* __restrict__ topk_idx, int T, int K,
                                                                int E, int R, C* tokens_per_rank, C* tokens_per_expert,
                                                                bool* token_in_rank) {
  extern __shared__ int hist[];  // [E] experts, then [R] ranks
  for (int i = threadIdx.x; i < E + R; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const int L = E / R;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
    unsigned ranks = 0;  // R <= 32 in this kernel's contract
    for (int k = 0; k < K; ++k) {
      const long long e = topk_idx[(long long)t * K + k];
      if (e >= 0 && e < E) {
        atomicAdd(&hist[e], 1);
        ranks |= 1u << (e / L);
      }
    }
    for (int r = 0; r < R; ++r) {
      const bool in = (ranks >> r) & 1u;
      token_in_rank[(long long)t * R + r] = in;
      if (in) atomicAdd(&hist[E + r], 1);
    }
  }
  __syncthreads();
  if (gridDim.x == 1) {  // the whole count: stored (nothing zeroed them)
    for (int i = threadIdx.x; i < E; i += blockDim.x) tokens_per_expert[i] = hist[i];
    for (int i = threadIdx.x; i < R; i += blockDim.x) tokens_per_rank[i] = hist[E + i];
    return;
  }
  for (int i = threadIdx.x; i < E; i += blockDim.x)
    if (hist[i]) add_count(tokens_per_expert + i, hist[i]);
  for (int i = threadIdx.x; i < R; i += blockDim.x)
    if (hist[E + i]) add_count(tokens_per_rank + i, hist[E + i]);
}

void launch_layout(const long long* topk_idx, int T, int K, int E, int R, void* tokens_per_rank, void* tokens_per_expert,
                   bool counts_int32, bool* token_in_rank, cudaStream_t stream) {
  const int blocks = T > 0 ? (T + kLayoutThreads - 1) / kLayoutThreads : 1;
  const int grid = blocks < 132 ? blocks : 132, smem = (E + R) * (int)sizeof(int);
  if (grid > 1)  // the blocks add their counts (one block, up to 256 tokens, stores them: no memset call)
    check_cuda(cudaMemsetAsync(tokens_per_rank, 0, (size_t)(R + E) * (counts_int32 ? 4 : 8), stream),
               "zeroing the layout's counts");
  if (counts_int32)
    layout_kernel<int><<<grid, kLayoutThreads, smem, stream>>>(
        topk_idx, T, K, E, R, static_cast<int*>(tokens_per_rank), static_cast<int*>(tokens_per_expert), token_in_rank);
  else
    layout_kernel<long long><<<grid, kLayoutThreads, smem, stream>>>(topk_idx, T, K, E, R,
                                                                      static_cast<long long*>(tokens_per_rank),
                                                                      static_cast<long long*>(tokens_per_expert),
                                                                      token_in_rank);
}

// One warp per token, lane k on slot k: the first bad slot (bad_slot_lanes) offered as the
// largest T * K - slot, so the lowest slot wins (0: none), as notify's check does.
__global__ void __launch_bounds__(kLayoutThreads) check_ids_kernel(const long long* __restrict__ topk_idx, int T, int K,
                                                                   int E, unsigned long long* key) {
  const int lane = lane_id(), warps = gridDim.x * (kLayoutThreads / 32);
  for (int t = blockIdx.x * (kLayoutThreads / 32) + threadIdx.x / 32; t < T; t += warps) {
    const long long id = lane < K ? topk_idx[(long long)t * K + lane] : -1;
    const unsigned bad = bad_slot_lanes(id, id >= 0 && id < E, lane < K);
    if (bad != 0u && lane == __ffs(bad) - 1)
      atomicMax(key, (unsigned long long)((long long)T * K - ((long long)t * K + lane)));
  }
}

void launch_check_ids(const long long* topk_idx, int T, int K, int E, unsigned long long* key, cudaStream_t stream) {
  const int per_block = kLayoutThreads / 32, blocks = T > 0 ? (T + per_block - 1) / per_block : 1;
  check_ids_kernel<<<blocks < 132 ? blocks : 132, kLayoutThreads, 0, stream>>>(topk_idx, T, K, E, key);
}

void prepare_layout_kernels() {
  cudaFuncAttributes attr;
  const int smem = (16384 + 32) * (int)sizeof(int);
  cudaFuncGetAttributes(&attr, layout_kernel<int>);
  cudaFuncSetAttribute(layout_kernel<int>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncGetAttributes(&attr, check_ids_kernel);
  cudaFuncGetAttributes(&attr, layout_kernel<long long>);
  cudaFuncSetAttribute(layout_kernel<long long>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
}

}  // namespace mep
