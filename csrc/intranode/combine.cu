// Intranode combine: stage + pull-and-sum (one launch), the expert-major reduce and the partial sums (the
// steps themselves: combine_steps.cuh).

#include "intranode/combine_steps.cuh"

namespace mep {

// Stage, then pull-and-sum, in one launch (one launch less per call; the internode path's fused
// combine runs the same two steps in its own launch). The pull waits for every rank's staging,
// this rank's included, so every block must be resident: the grid is at most the SMs the rank
// may keep, one block per SM (__launch_bounds__), as for every waiting kernel here.
template <bool kFp32, int kSum>
__global__ void __launch_bounds__(kCopyThreads, 1) stage_and_combine_kernel(Ctx c, CallArgs call, StageCombineArgs s,
                                                                            CombineArgs a) {
  stage_combine_step(c, call, s);
  combine_step<kFp32, kSum>(c, a);
}

static_assert(sizeof(Ctx) + sizeof(CallArgs) + sizeof(StageCombineArgs) + sizeof(CombineArgs) <= 4096,
              "stage_and_combine_kernel's parameters exceed 4 KB");

// The instance of stage_and_combine_kernel for the layout and order of the sum (CombineArgs).
template <bool kFp32>
static auto stage_and_combine_for(const CombineArgs& args) {
  return !args.permute ? stage_and_combine_kernel<kFp32, kSumRankRows>
         : args.single ? stage_and_combine_kernel<kFp32, kSumSlots>
                       : stage_and_combine_kernel<kFp32, kSumGrouped>;
}

void launch_stage_and_combine(const Ctx& ctx, const CallArgs& call, const StageCombineArgs& stage,
                              const CombineArgs& args, int num_blocks, cudaStream_t stream) {
  const auto kernel = args.is_fp32 ? stage_and_combine_for<true>(args) : stage_and_combine_for<false>(args);
  kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, stage, args);
}

template <bool kInFp32>
__global__ void __launch_bounds__(kCopyThreads) combine_reduce_kernel(Ctx c, CallArgs call, CombineReduceArgs a) {
  combine_reduce_step<kInFp32>(c, call, a);
}

void launch_combine_reduce(const Ctx& ctx, const CallArgs& call, const CombineReduceArgs& args, int num_blocks,
                           cudaStream_t stream) {
  if (args.is_fp32)
    combine_reduce_kernel<true><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, args);
  else
    combine_reduce_kernel<false><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, args);
}

template <bool kOutFp32>
__global__ void __launch_bounds__(kCopyThreads, 1) combine_partials_kernel(Ctx c, CombineArgs a) {
  combine_partials_step<kOutFp32>(c, a);
}

void launch_combine_partials(const Ctx& ctx, const CombineArgs& args, int num_blocks, cudaStream_t stream) {
  if (args.is_fp32)
    combine_partials_kernel<true><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
  else
    combine_partials_kernel<false><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
}

void prepare_combine_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, stage_and_combine_kernel<true, kSumRankRows>);
  cudaFuncGetAttributes(&attr, stage_and_combine_kernel<true, kSumGrouped>);
  cudaFuncGetAttributes(&attr, stage_and_combine_kernel<true, kSumSlots>);
  cudaFuncGetAttributes(&attr, stage_and_combine_kernel<false, kSumRankRows>);
  cudaFuncGetAttributes(&attr, stage_and_combine_kernel<false, kSumGrouped>);
  cudaFuncGetAttributes(&attr, stage_and_combine_kernel<false, kSumSlots>);
  cudaFuncGetAttributes(&attr, combine_reduce_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_reduce_kernel<false>);
  cudaFuncGetAttributes(&attr, combine_partials_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_partials_kernel<false>);
}

}  // namespace mep
