// The rank mask's kernels (a Buffer made with the rank mask; DeepEP's shrink mode): the host's
// edits and queries of the mask, and the barrier over the ranks this rank does not mask.
//
// Why the barrier also resets the buffer sets: a sender waits until each receiver released the
// set (release words, counted in calls), and a receiver sends no release to a rank it masks.
// Once ranks were masked, their counts are out of step, so a rank unmasked later would wait on
// stale release words, time out and be masked again. In two rounds: (1) every rank has entered,
// so every kernel of the ranks before it has finished and nothing is in flight to this rank;
// each rank then clears its signal words and counters, restarts its call counts at 0 and writes
// 0 into its release word at every unmasked peer; (2) every rank has done so, so no rank sends
// into a set before its receivers' words were cleared. The host starts again at set 0.
#include "low_latency/device.cuh"

namespace mep {
namespace low_latency {

__device__ __forceinline__ long long sync_offset(const LLCtx& c) {
  return c.lay.state + (long long)offsetof(LowLatencyState, sync) + (long long)c.rank * 8;
}

// One round: enter (this rank's count to every unmasked peer), then wait until every unmasked
// peer entered as often; a peer that does not within the timeout is masked. Block-wide.
__device__ void barrier_round(const LLCtx& c) {
  LowLatencyState* st = state_of(c);
  __syncthreads();
  if (threadIdx.x == 0) {
    const long long n = ++st->barriers;
    __threadfence_system();  // this rank's writes before the round (the resets) first
    for (int r = 0; r < c.num_ranks; ++r)
      if (!masked_now(c, r)) put_signal(c, r, sync_offset(c), n, false);
  }
  __syncthreads();
  const long long n = ld_volatile(&st->barriers);
  for (int r = threadIdx.x; r < c.num_ranks; r += blockDim.x) {
    if (masked_now(c, r)) continue;
    long long v;
    bool is_gone;
    wait_peer(c, &st->sync[r], [&](long long x) { return x >= n; }, v, is_gone,
              WaitSite{kOpLowLatencyBarrier, kLLWaitBarrier, -1, r, 0, 0});
  }
  __syncthreads();
}

__global__ void barrier_kernel(const LLCtx c) {
  LowLatencyState* st = state_of(c);
  const LowLatencyLayout& lay = c.lay;
  const int L = lay.num_experts / lay.num_ranks;
  barrier_round(c);
  for (int set = 0; set < 2; ++set) {
    long long* count = reinterpret_cast<long long*>(c.base + lay.set_offset(set) + lay.d_count);
    long long* flag = reinterpret_cast<long long*>(c.base + lay.set_offset(set) + lay.c_flag);
    for (int i = threadIdx.x; i < L * lay.num_ranks; i += blockDim.x) count[i] = 0;
    for (int i = threadIdx.x; i < lay.num_experts; i += blockDim.x) flag[i] = 0;
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) st->d_finish[set][i] = 0, st->c_finish[set][i] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    st->grid_done[0] = st->grid_done[1] = 0;
    st->set_calls[0] = st->set_calls[1] = 0;
    __threadfence_system();
    for (int set = 0; set < 2; ++set) {
      const long long off = lay.set_offset(set) + lay.release + (long long)c.rank * 8;
      for (int r = 0; r < c.num_ranks; ++r)
        if (!masked_now(c, r)) put_signal(c, r, off, 0, false);
    }
  }
  barrier_round(c);
}

__global__ void mask_kernel(const LLCtx c, int op, int rank, int value, int* out) {
  int* mask = state_of(c)->mask;
  for (int r = threadIdx.x; r < c.num_ranks; r += blockDim.x) {
    if (op == kLLMaskSet && r == rank) mask[r] = value;
    if (op == kLLMaskQuery) out[r] = ld_volatile(mask + r);
    if (op == kLLMaskClear) mask[r] = 0;
  }
}

}  // namespace low_latency

void launch_ll_barrier(const LLCtx& c, cudaStream_t stream) {
  LLCtx cs = c;
  cs.seq = -1;  // serves no call: peers' failure publications do not stop it
  low_latency::barrier_kernel<<<1, 64, 0, stream>>>(cs);
  low_latency::check(cudaGetLastError(), "barrier launch");
}

void launch_ll_mask(const LLCtx& c, int op, int rank, int value, int* out, cudaStream_t stream) {
  low_latency::mask_kernel<<<1, 64, 0, stream>>>(c, op, rank, value, out);
  low_latency::check(cudaGetLastError(), "rank mask launch");
}

void ll_touch_mask_kernels() {
  cudaFuncAttributes attr;
  low_latency::check(cudaFuncGetAttributes(&attr, low_latency::barrier_kernel), "loading the barrier kernel");
  low_latency::check(cudaFuncGetAttributes(&attr, low_latency::mask_kernel), "loading the rank mask kernel");
}

}  // namespace mep
