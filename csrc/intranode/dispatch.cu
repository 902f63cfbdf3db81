// Intranode dispatch: stage (a rank's inputs into its own region), pull (the receiver copies
// the rows it needs from its peers' regions into its outputs), push (the sender writes rows
// straight into the receivers' pooled outputs) and fan-out (expert-major duplication).

#include "intranode/dispatch_steps.cuh"

namespace mep {

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
__global__ void __launch_bounds__(kCopyThreads, 1) dispatch_kernel(Ctx c, int slot, DispatchArgs a) {
  copy_counts(a.counts);
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
__global__ void __launch_bounds__(kCopyThreads, 1) dispatch_push_kernel(Ctx c, CallArgs call, int slot, PushArgs a) {
  copy_counts(a.out.counts);
  if (call_aborted(c)) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) push_announce(c, call, slot, a);
  push_rows<false>(c, slot, a);
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
    if (f.src != nullptr && lane == 0) a.out_src[n] = __ldcg(f.src + n);
  }
  fill_padding(a, gw, tw);
}

void launch_fanout(const Ctx& ctx, const FanoutArgs& args, int num_blocks, cudaStream_t stream) {
  fanout_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
}

void prepare_dispatch_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, stage_kernel);
  cudaFuncGetAttributes(&attr, dispatch_kernel);
  cudaFuncGetAttributes(&attr, dispatch_push_kernel);
  cudaFuncGetAttributes(&attr, fanout_kernel);
}

}  // namespace mep
