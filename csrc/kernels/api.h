// Host-side launchers of every kernel family. Raw pointers only: no torch headers here, so the
// .cu files compile quickly; csrc/bindings.cpp adapts tensors to these.
#pragma once

#include <cuda_runtime.h>

#include "../common.h"

namespace mep {

// ---- layout.cu -------------------------------------------------------------------------------
// One pass over topk_idx: tokens per rank (each token once per rank), (token, expert) pairs per
// expert, token_in_rank [T, R]. Outputs must be zeroed by the caller.
void launch_layout(const long long* topk_idx, int T, int K, int E, int R, long long* tokens_per_rank,
                   long long* tokens_per_expert, bool* token_in_rank, cudaStream_t stream);

// Counts, count exchange with every peer, prefix sums: writes for each (token, rank) and each
// (token, slot) the row it will occupy in the destination's rank-major / expert-major output,
// and this rank's receive layout (recv_info: N, M, L, counts[L], padded[L], seg_start[L]) on the
// device and, with `tag` last, in the mapped host block.
struct NotifyArgs {
  const long long* topk_idx;  // [T, K]
  int T, K, E, align;
  int* rank_pos;   // [T, R] out
  int* slot_pos;   // [T, K] out
  int* recv_info;  // [3 + 3L] out
  long long tag;
};
void launch_notify(const Ctx& ctx, const NotifyArgs& args, cudaStream_t stream);
int notify_smem_bytes(int E);

// ---- intranode.cu ----------------------------------------------------------------------------
// Copy this call's dispatch inputs into the region and signal every puller.
struct StageArgs {
  const void* x;  // [T, row_bytes] or nullptr when x already lies in the region (zero copy)
  int T, row_bytes;
  const float* scales;  // [T, scale_cols] or nullptr
  int scale_cols;
  const long long* topk_idx;  // [T, K] (handle's or caller's)
  const float* topk_w;        // [T, K] or nullptr
  int K;
  const int* rank_pos;  // [T, R]
  const int* slot_pos;  // [T, K]
};
void launch_stage(const Ctx& ctx, const StageArgs& args, int num_blocks, cudaStream_t stream);

// Pull every row destined to this rank from the peers' staging into the outputs.
struct DispatchArgs {
  int row_bytes, scale_cols, K, E, permute, has_weights;
  int out_rows;            // rows allocated (N, M, or the worst-case count)
  const int* recv_info;    // from notify
  char* out_x;             // [out_rows, row_bytes]
  float* out_scales;       // [out_rows, scale_cols] or nullptr
  long long* out_idx;      // rank-major [out_rows, K] local ids, else nullptr
  float* out_w;            // rank-major [out_rows, K] / expert-major [out_rows], or nullptr
  int* out_row_expert;     // expert-major [out_rows], else nullptr
};
void launch_dispatch(const Ctx& ctx, const DispatchArgs& args, int num_blocks, cudaStream_t stream);

// Rank-major dispatch by push: each rank publishes where its outputs are; when every rank's
// outputs lie in its region (pool), senders read each of their rows once and write it straight
// into every destination's output. Otherwise all ranks stage and pull, in the same kernel.
struct PushArgs {
  StageArgs in;       // this rank's inputs
  DispatchArgs out;   // this rank's outputs (local pointers) and receive layout
  long long out_x_off, out_s_off, out_idx_off, out_w_off;  // outputs inside this region; x_off < 0: not pooled
};
void launch_dispatch_push(const Ctx& ctx, const PushArgs& args, int num_blocks, cudaStream_t stream);

// Copy the combine input (unless it already lies in the region) and weights; signal pullers.
struct StageCombineArgs {
  const void* x;  // [rows, row_bytes] or nullptr (zero copy)
  int rows, row_bytes;
  const float* w;  // [rows, w_cols] or nullptr
  int w_cols;
};
void launch_stage_combine(const Ctx& ctx, const StageCombineArgs& args, int num_blocks, cudaStream_t stream);

// y[t] = sum of this token's rows, pulled from their ranks' combine staging (fp32 accumulation).
struct CombineArgs {
  int T, H, K, E, permute, is_fp32, has_weights;
  const long long* topk_idx;  // [T, K] (expert-major: owner of each slot)
  const int* rank_pos;        // [T, R]
  const int* slot_pos;        // [T, K]
  void* y;                    // [T, H]
  float* w_out;               // [T, K] or nullptr
};
void launch_combine(const Ctx& ctx, const CombineArgs& args, int num_blocks, cudaStream_t stream);

// Resolve every kernel now (module loading is lazy by default, and a first launch that has to
// wait behind a spinning kernel of the same process would deadlock) and raise smem limits.
void prepare_kernels();

}  // namespace mep
