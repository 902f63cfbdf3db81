// Host-side launchers of every kernel family. Raw pointers only: no torch headers here, so the
// .cu files compile quickly; csrc/intranode/binding.cpp adapts tensors to these.
#pragma once

#include <cuda_runtime.h>

#include "ipc/api.h"
#include "ipc/context.h"

namespace mep {

// ---- layout.cu -------------------------------------------------------------------------------
// One pass over topk_idx: tokens per rank (each token once per rank), (token, expert) pairs per
// expert (int64, or int32 with counts_int32), token_in_rank [T, R]. Ids outside [0, E) count as
// unused. The counts are one array, tokens_per_expert right after tokens_per_rank's R: one block
// stores them, several add to them after zeroing them here.
void launch_layout(const long long* topk_idx, int T, int K, int E, int R, void* tokens_per_rank, void* tokens_per_expert,
                   bool counts_int32, bool* token_in_rank, cudaStream_t stream);
// The ids' check where notify cannot make it (a sync-free dispatch, the low-latency path): the
// first slot (token * K + k, K <= 32) whose id is neither -1 nor in [0, E) or repeats an earlier
// slot's expert, as *key = T * K - slot (the largest wins); *key zeroed by the caller, 0 after: none.
void launch_check_ids(const long long* topk_idx, int T, int K, int E, unsigned long long* key, cudaStream_t stream);

// ---- intranode.cu ----------------------------------------------------------------------------
// notify: counts, the call exchange (records + counts with every peer), prefix sums, and for
// each (token, rank) and (token, slot) the row it will occupy in the destination's rank-major /
// expert-major output; this rank's receive layout (RecvInfo) on the device and, with `tag` last,
// the sizes and the group's largest needs in the mapped host block. Three launches: per-chunk
// counts (grid), exchange (one block), positions (grid). (A one-launch version with grid
// barriers is slower: its token passes run on 2 SMs; docs/performance.md.)
// A destination's rows are ordered (expert or rank, token group, source rank, token): the T
// tokens of every rank are `groups` contiguous groups of T / groups (1: the intranode Buffer; the
// internode intranode stage: one per source node, the contract's order without a reorder pass).
struct NotifyArgs {
  const long long* topk_idx;  // [T, K]
  int T, K, E, align, permute, worst;
  int groups;  // token groups: 1..kMaxTokenGroups, T % groups == 0, groups * E <= kMaxExperts
  int check;   // find the first id out of range or repeated in its token (HostInfo::bad_slot)
  int* rank_pos;   // [T, R] out
  int* slot_pos;   // [T, K] out
  int* recv_info;  // [RecvInfo::size(L)] out
  int* row_limits;        // [R] out: rows each rank delivers at most (its num_worst_tokens, or INT_MAX)
  long long* out_tpe;     // [L] out: tokens_per_expert (padded and clamped when permuted; zeros for
                          // rank-major with num_worst_tokens: the pull counts the delivered rows)
  long long* out_dropped; // [1] out: real rows past num_worst_tokens
  long long tag;
  int* rank_counts;       // [G * R][R] out, or nullptr: tokens (group g, rank s) sends to rank d, at row
                          // g * R + s (one group: rank s to rank d; the internode intranode stage's
                          // groups are source nodes, so the row is the global source rank)
  int* rank_prefix;       // [G * R][R] out with rank_counts: its inclusive prefix sums over the rows
                          // (DeepEP's rank_prefix_matrix), or nullptr
  long long* topk_copy;   // [T, K] out, or nullptr: the handle's copy of topk_idx, written as the ids
                          // are counted (a copy of its own would cost the host a call more)
};
void launch_notify(const Ctx& ctx, const CallArgs& call, const NotifyArgs& args, cudaStream_t stream);

// Copy this call's dispatch inputs into the region and signal `slot` (kSlotStaged after notify;
// kSlotCall for a cached dispatch, publishing `call` with it).
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
void launch_stage(const Ctx& ctx, const CallArgs& call, int slot, const StageArgs& args, int num_blocks,
                  cudaStream_t stream);

// A cached dispatch's counts (tokens per expert, then the dropped rows): the handle's, copied into
// the caller's own by the first block of the kernel that moves the rows (a copy of their own
// would cost the host a call more). dst nullptr: nothing to copy.
struct CountsCopy {
  const long long* src;
  long long* dst;
  int n;
};

// Pull every row destined to this rank from the peers' staging into the outputs (after `slot`).
// Rows whose position is >= out_rows are not written (num_worst_tokens: counted by notify).
struct DispatchArgs {
  int row_bytes, scale_cols, K, E, permute, has_weights;
  int out_rows;            // rows allocated (N, M, or num_worst_tokens)
  const int* recv_info;    // from notify
  char* out_x;             // [out_rows, row_bytes]
  float* out_scales;       // [out_rows, scale_cols] or nullptr
  long long* out_idx;      // rank-major [out_rows, K] local ids, else nullptr
  float* out_w;            // rank-major [out_rows, K] / expert-major [out_rows], or nullptr
  int* out_row_expert;     // expert-major [out_rows], else nullptr
  long long* out_tpe;      // rank-major, num_worst_tokens: (row, local expert) pairs delivered, zeroed; else nullptr
  int* comb_map;           // expert-major: [N, K] expert-major row of each (rank-major row, slot), -1 where
                           // none or dropped -- the combine's local pre-reduction reads it; else nullptr
  CountsCopy counts;       // the pull or the push copies them (never the fan-out)
  int* out_src;            // [rank-major rows] the source token of each rank-major row (its source rank is
                           // its segment), or nullptr: not asked (DeepEP V2's recv_src_metadata)
};
void launch_dispatch(const Ctx& ctx, int slot, const DispatchArgs& args, int num_blocks, cudaStream_t stream);

// Dispatch by push: each rank publishes where its rank-major rows go (at `slot`: kSlotOutLoc
// after notify, kSlotCall with `call` for a cached dispatch); when every rank's lie in its region
// (pool), senders read each of their rows once and write it straight into every destination
// (NVLink stores are posted; a pull pays a round trip per load). Rank-major: those are the
// outputs. Expert-major: a pooled rank-major buffer whose index columns carry (expert-major row,
// local expert) pairs, which launch_fanout then spreads into the expert segments. Otherwise all
// ranks stage and pull straight into the outputs, in the same kernel.
struct PushArgs {
  StageArgs in;       // this rank's inputs
  DispatchArgs out;   // this rank's outputs (local pointers) and receive layout
  long long out_x_off, out_s_off, out_idx_off, out_w_off;  // rank-major rows in this region; x_off < 0: not pooled
  long long out_src_off;  // the rows' source tokens in this region, or -1 (not asked)
};
void launch_dispatch_push(const Ctx& ctx, const CallArgs& call, int slot, const PushArgs& args, int num_blocks,
                          cudaStream_t stream);

// Expert-major push, second half (local, no handshake): every received rank-major row into each
// of its expert segments, the per-row weight and expert id, the padding, and `out.comb_map`.
// Does nothing when the push fell back to stage + pull (which wrote all of that itself).
struct FanoutArgs {
  DispatchArgs out;   // the expert-major outputs (permute = 1)
  const char* rows;   // [N, row_bytes] the pooled rank-major rows
  const float* scales;  // [N, scale_cols] or nullptr
  const int* map;     // [N, K, 2] (expert-major row, local expert) or -1
  const float* w;     // [N, K] or nullptr
  const int* src;     // [N] the pooled rows' source tokens, copied to out.out_src; or nullptr
};
void launch_fanout(const Ctx& ctx, const FanoutArgs& args, int num_blocks, cudaStream_t stream);

// A combine's staging: copy the input (unless it already lies in the region) and weights; publish
// `call` and signal kSlotCall (a combine's first exchange). Run before the pull-and-sum in the same
// launch (launch_stage_and_combine, and the internode path's fused combine).
struct StageCombineArgs {
  const void* x;  // [rows, row_bytes] or nullptr (zero copy)
  int rows, row_bytes;
  const float* w;  // [rows, w_cols] or nullptr
  int w_cols;
};

// Expert-major combine, first half (local): each rank-major row's expert rows summed in fp32, in
// slot order, and rounded to x's dtype into the combine area (a partial per (token, rank): one
// row crosses the link per token and rank instead of one per (token, expert)), the weights
// staged; publishes `call` and signals kSlotCall like the staging, which it replaces.
struct CombineReduceArgs {
  const void* x;      // [rows, H] expert-major rows (bf16 or fp32), local
  int rows, H, is_fp32;
  const int* map;     // [N, K] the dispatch's comb_map
  const int* recv_info;  // N
  int K;
  const float* w;     // [rows] or nullptr
};
void launch_combine_reduce(const Ctx& ctx, const CallArgs& call, const CombineReduceArgs& args, int num_blocks,
                           cudaStream_t stream);

// y[t] = the token's biases + its rows, pulled from their ranks' combine staging, in one fp32
// accumulator rounded once (the order: combine_steps.cuh, DeepEP V2's reference): ranks in the
// order of their last top-k slot; rank-major one row per rank, expert-major each rank's slots
// summed in slot order and rounded to x's dtype first, or with `single` every slot's row a term
// of its own in slot order (V2's allow_multiple_reduction=False). With `partials` (after
// launch_combine_reduce) the rows are those rounded partials, one per rank.
// Only rows the dispatch delivered are read: ids outside [0, E), negative positions and
// positions past the owner's row limit (its num_worst_tokens) are skipped.
// launch_stage_and_combine: the staging, then the sum of the staged rows, in one launch;
// launch_combine_partials: the sum of the partials launch_combine_reduce wrote.
struct CombineArgs {
  int T, H, K, E, permute, is_fp32, has_weights, partials, single;
  const int* row_limits;      // [R] from notify: rows each rank's combine input holds at most
  const long long* topk_idx;  // [T, K] (expert-major: owner of each slot)
  const int* rank_pos;        // [T, R]
  const int* slot_pos;        // [T, K]
  void* y;                    // [T, H]
  float* w_out;               // [T, K] or nullptr
  const void* bias0;          // [T, H] x's dtype, the accumulator's start (+ bias1), or nullptr
  const void* bias1;          // [T, H] or nullptr (never in the internode path's intranode stage)
};
// The pull's sum, one kernel each (two in one function spill: ptxas allocates for both at once).
enum CombineSum : int { kSumRankRows = 0, kSumGrouped = 1, kSumSlots = 2 };
void launch_stage_and_combine(const Ctx& ctx, const CallArgs& call, const StageCombineArgs& stage,
                              const CombineArgs& args, int num_blocks, cudaStream_t stream);
void launch_combine_partials(const Ctx& ctx, const CombineArgs& args, int num_blocks, cudaStream_t stream);

// ---- the intranode stage of the internode path's fused kernels ----------------------------------
// An intranode push or combine that the internode path runs inside its own fused launch
// (csrc/internode/fused.cu, extension _C_nvshmem) instead of the launches above: the context and
// arguments _C's binding builds, handed across the two extensions as bytes (both compile this
// header; the receiver checks the size).
struct IntranodeDispatch {
  Ctx ctx;
  CallArgs call;
  int slot;  // kSlotCall: a cached dispatch's first exchange
  PushArgs push;
};

struct IntranodeCombine {
  Ctx ctx;
  CallArgs call;
  int partials;              // expert-major pre-reduction (reduce + partial sums), else stage + pull-and-sum
  StageCombineArgs stage;    // !partials
  CombineReduceArgs reduce;  // partials
  CombineArgs comb;          // out: the intranode sums, one row per forwarded token
};

// Resolve every kernel now (module loading is lazy by default, and a first launch that has to
// wait behind a spinning kernel of the same process would deadlock) and raise smem limits:
// prepare_kernels() runs each file's part (notify.cu, dispatch.cu, combine.cu, layout.cu, and
// the runtime's: ipc/api.h); the binding calls it when it creates a Runtime.
void prepare_kernels();
void prepare_notify_kernels();
void prepare_dispatch_kernels();
void prepare_combine_kernels();
void prepare_layout_kernels();

}  // namespace mep
