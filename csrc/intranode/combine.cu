// Intranode combine: stage, pull-and-sum, the expert-major reduce and the partial sums (the
// steps themselves: combine_steps.cuh).

#include "intranode/combine_steps.cuh"

namespace mep {

__global__ void __launch_bounds__(kCopyThreads, 1) stage_combine_kernel(Ctx c, CallArgs call, StageCombineArgs a) {
  stage_combine_step(c, call, a);
}

void launch_stage_combine(const Ctx& ctx, const CallArgs& call, const StageCombineArgs& args, int num_blocks,
                          cudaStream_t stream) {
  stage_combine_kernel<<<num_blocks, kCopyThreads, 0, stream>>>(ctx, call, args);
}

template <bool kFp32>
__global__ void __launch_bounds__(kCopyThreads, 1) combine_kernel(Ctx c, CombineArgs a) {
  combine_step<kFp32>(c, a);
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

void launch_combine(const Ctx& ctx, const CombineArgs& args, int num_blocks, cudaStream_t stream) {
  if (args.partials) {
    if (args.is_fp32)
      combine_partials_kernel<true><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
    else
      combine_partials_kernel<false><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
  } else if (args.is_fp32)
    combine_kernel<true><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
  else
    combine_kernel<false><<<num_blocks, kCopyThreads, 0, stream>>>(ctx, args);
}

void prepare_combine_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, stage_combine_kernel);
  cudaFuncGetAttributes(&attr, combine_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_kernel<false>);
  cudaFuncGetAttributes(&attr, combine_reduce_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_reduce_kernel<false>);
  cudaFuncGetAttributes(&attr, combine_partials_kernel<true>);
  cudaFuncGetAttributes(&attr, combine_partials_kernel<false>);
}

}  // namespace mep
