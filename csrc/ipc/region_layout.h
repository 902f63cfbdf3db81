// The communication region of one rank, defined once: the control block at its start, the
// mapped host block through which kernels report to the CPU, the receive-info vector that notify
// leaves for the later kernels, and `plan_region`, the one routine that both sizes the region
// and places every section (so size and layout cannot drift). Plain C++: the kernels, the torch
// binding and the `_protocol` module (which Python reads offsets and sizes from) include it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/protocol.h"

namespace mep {

// A rank's call record: published at the call exchange, read by every peer. Two of them,
// indexed by the call's seq parity: a rank can be at most one call ahead of its slowest peer
// (every call has an all-rank exchange), so the record a peer is still reading is never
// overwritten.
struct CallRecord {
  long long sig[kSigFields];
  int status;  // CallStatus; a rank that fails after the exchange flips it before its next signal
  int msg_len;
  char msg[kMsgBytes];
};

// At offset 0 of every rank's region.
struct Control {
  unsigned long long signal[kNumSlots][kMaxRanks];  // written by peers: [slot][source rank]
  unsigned long long expected[kNumSlots];           // private: handshakes completed so far
  unsigned int grid_done[kNumGridCounters];          // private: blocks finished, per kernel kind
  int abort;                                         // 1 + rank that timed out; stops all spins
  int num_tokens;                                    // published by stage: T of this call
  int has_weights;                                   // published by stage: topk weights staged
  int comb_has_weights;                              // published by combine stage
  int out_pooled;                                    // push dispatch: outputs lie in this region
  int err_claims;                                    // private: error records claimed (host: err_cleared)
  int aborted_calls;                                 // private: calls aborted so far
  int push_pooled;                                   // private: the last push dispatch found every output pooled
  long long out_x_off, out_s_off, out_idx_off, out_w_off;  // push dispatch: where (byte offsets)
  long long out_src_off;                             // push dispatch: each row's source token (-1: not asked)
  long long aborted_seq;                             // private: the call this rank aborted last
  unsigned long long bad_key;                        // private: notify's first bad slot, T * K - slot (0: none)
  CallRecord call[2];                                // by seq parity
};

// Mapped pinned host memory: written by kernels, read by the CPU without a sync.
struct HostInfo {
  volatile long long tag;       // notify writes the launch tag last, after everything below
  volatile int num_rows;        // N: rank-major rows this rank receives
  volatile int num_perm_rows;   // M: expert-major rows (padded)
  volatile int need_tokens;     // the largest T of any rank in this call
  volatile int need_rows;       // the largest N of any rank
  volatile int need_perm_rows;  // the largest M of any rank
  // NotifyArgs::check: the first (token * K + slot) of this rank's topk_idx whose id is out of
  // range (not -1 and not an expert) or repeats an earlier slot's expert; -1 if none
  volatile long long bad_slot;
  // The first error not yet reported. A kernel claims the record (Control::err_claims counts
  // claims, err_cleared counts the host's clears), fills it, and publishes `error` last; the
  // host reads it, then clears `error` and bumps err_cleared.
  volatile int err_cleared;
  volatile int error;           // ErrorCode
  volatile int err_rank;        // rank that reports
  volatile int err_peer;        // rank it waited on / that failed
  volatile int err_slot;        // Slot it waited on
  volatile int err_field;       // mismatch: SigField
  volatile long long err_seq;   // the call
  volatile long long err_expected;
  volatile long long err_observed;
  volatile long long err_values[kMaxRanks];  // mismatch: every rank's value of err_field
  volatile long long err_ops[kMaxRanks];     // mismatch: every rank's op
  volatile int num_aborted;     // calls aborted so far (mismatch, peer failure)
  volatile int err_msg_len;
  volatile char err_msg[kMsgBytes];           // peer failure: that rank's message
  volatile int expert_counts[kMaxExperts];    // raw (unpadded) per-local-expert counts
};

// notify's receive layout of this rank, an int32 vector on the device (and the handle's state).
struct RecvInfo {
  static constexpr int kRows = 0;      // N
  static constexpr int kPermRows = 1;  // M (padded)
  static constexpr int kLocal = 2;     // L
  static constexpr int kDropped = 3;   // real rows past num_worst_tokens (not delivered)
  static constexpr int kHeader = 4;
  // then counts[L], padded[L] (clamped to num_worst_tokens when set), seg_start[L]
  static constexpr int counts(int) { return kHeader; }
  static constexpr int padded(int L) { return kHeader + L; }
  static constexpr int seg_start(int L) { return kHeader + 2 * L; }
  static constexpr int size(int L) { return kHeader + 3 * L; }
};

// Sizing hints, identical on every rank of a group (sizes and places are then identical too).
struct RegionHints {
  int num_ranks = 1;
  int max_tokens = 0;       // T per rank
  int hidden = 0;
  int max_topk = 8;
  int max_experts = kMaxExperts;
  int dtype_bytes = 2;      // dispatch rows
  int combine_bytes = 2;    // combine rows
  int max_alignment = 128;  // for the default combine area
  long long combine_rows = -1;  // < 0: the expert-major worst case (below)
  long long pool_bytes = -1;    // < 0: a worst-case rank-major output + 25%
};

constexpr int kFp8Block = 128;   // channels per FP8 scale
constexpr long long kSectionAlign = 256;

inline long long align_up(long long n, long long a) { return (n + a - 1) / a * a; }

// Byte offsets inside a region; identical on every rank.
struct RegionLayout {
  long long control;       // Control
  long long counts;        // int32 [kCountsInts]: this rank's counts per token group, T, num_worst_tokens (below)
  long long scratch;       // int32 [kScratchRows][kScratchStride] notify's prefixes and bases (private; below)
  long long stage_x;       // [max_tokens, x_row_bytes] dispatch rows (bf16/fp32/fp8 bytes)
  long long stage_scales;  // [max_tokens, scale_cols] float (FP8 scales)
  long long stage_idx;     // [max_tokens, K] int32 expert ids
  long long stage_w;       // [max_tokens, K] float topk weights
  long long stage_rpos;    // [max_tokens, kMaxRanks] int32 row of the token in each rank-major output
  long long stage_spos;    // [max_tokens, K] int32 row of (token, slot) in the expert-major output
  long long comb_x;        // [comb_rows, comb_row_bytes] combine input rows
  long long comb_w;        // [comb_rows, K] float combine weights
  long long pool;          // rank-major dispatch outputs (push)
  long long pool_bytes;
  long long comb_rows;
  long long total;
  int max_tokens, max_topk, max_experts, x_row_bytes, scale_cols, comb_row_bytes, num_ranks, pad_;
};

// RegionLayout's fields, once: the protocol module hands them to Python by name and the binding
// reads them back by the same names (type, name); the static_assert catches a field added to the
// struct but not here.
#define MEP_REGION_LAYOUT_FIELDS(X)                                                                 \
  X(long long, control) X(long long, counts) X(long long, scratch) X(long long, stage_x)            \
  X(long long, stage_scales) X(long long, stage_idx) X(long long, stage_w) X(long long, stage_rpos) \
  X(long long, stage_spos) X(long long, comb_x) X(long long, comb_w) X(long long, pool)             \
  X(long long, pool_bytes) X(long long, comb_rows) X(long long, total) X(int, max_tokens)           \
  X(int, max_topk) X(int, max_experts) X(int, x_row_bytes) X(int, scale_cols) X(int, comb_row_bytes) \
  X(int, num_ranks)
#define MEP_REGION_FIELD_BYTES(type, name) +sizeof(type)
static_assert(0 MEP_REGION_LAYOUT_FIELDS(MEP_REGION_FIELD_BYTES) + sizeof(int) /* pad_ */ == sizeof(RegionLayout),
              "a RegionLayout field is missing from MEP_REGION_LAYOUT_FIELDS");
#undef MEP_REGION_FIELD_BYTES

// The counts area (int32), published by notify's exchange and read by every peer: the tokens of
// each token group g for each destination rank d at kCountsRanks + g * kMaxRanks + d, the rows of
// group g for each expert e at kCountsExperts + g * E + e (G * E <= kMaxExperts: the binding
// checks it), then this call's T and num_worst_tokens.
constexpr int kCountsRanks = 0;
constexpr int kCountsExperts = kCountsRanks + kMaxTokenGroups * kMaxRanks;
constexpr int kCountsT = kCountsExperts + kMaxExperts;
constexpr int kCountsWorst = kCountsT + 1;
constexpr int kCountsInts = kCountsWorst + 1;

// notify's scratch (csrc/intranode/notify.cu), rows of kScratchStride int32 (expert columns, then
// rank columns). The T tokens are G token groups of T / G; each group is cut into blocks of
// kNotifyWarps chunks (a warp each), so no chunk or block straddles a group. A plan's rows:
//   [0, chunks)                       each chunk's prefix inside its block
//   [chunks, chunks + blocks)         each block's totals, turned into its prefix inside its group
//   [chunks + blocks, ... + groups)   each group's bases (where its rows start in each destination)
// A plan keeps within kMaxNotifyBlocks rows, but gives every group one block at least.
constexpr int kNotifyWarps = 8;      // warps per notify block: a block sums its warps' counts in shared memory
constexpr int kNotifyChunkMin = 16;  // tokens per notify warp, at least: short chains of dependent steps
constexpr int kScratchStride = kMaxExperts + kMaxRanks;
constexpr int kScratchRows = std::max(kMaxNotifyBlocks, kMaxTokenGroups * (kNotifyWarps + 2));

struct NotifyPlan {
  int groups, blocks, chunks, chunk;  // blocks and chunks in all (blocks / groups per group), tokens per chunk
};
inline NotifyPlan notify_plan(int T, int groups) {
  const int G = std::max(groups, 1), Tg = T / G;  // T % G == 0 (the binding checks it)
  const int per_group = std::max(1, (kMaxNotifyBlocks / G - 1) / (kNotifyWarps + 1));  // blocks a group may have
  const int chunks = (Tg + kNotifyChunkMin - 1) / kNotifyChunkMin;
  const int blocks = std::min(std::max((chunks + kNotifyWarps - 1) / kNotifyWarps, 1), per_group);
  const int chunk = (Tg + blocks * kNotifyWarps - 1) / (blocks * kNotifyWarps);
  return {G, G * blocks, G * blocks * kNotifyWarps, std::max(chunk, 1)};
}
inline int notify_scratch_rows(const NotifyPlan& p) { return p.chunks + p.blocks + p.groups; }

// Rows an expert-major output can hold in the dropless worst case: every rank's tokens all
// name min(K, L) of this rank's experts, plus each segment's padding.
inline long long worst_expert_major_rows(int R, long long T, int K, int E, int align) {
  const long long L = E / std::max(R, 1);
  return R * T * std::min<long long>(K, L) + L * (align - 1);
}

inline RegionLayout plan_region(const RegionHints& h) {
  RegionLayout lay{};
  const int R = h.num_ranks;
  const long long T = h.max_tokens;
  lay.max_tokens = h.max_tokens;
  lay.max_topk = h.max_topk;
  lay.max_experts = h.max_experts;
  lay.num_ranks = R;
  lay.x_row_bytes = (int)align_up((long long)h.hidden * h.dtype_bytes, 16);
  lay.scale_cols = (h.hidden + kFp8Block - 1) / kFp8Block;
  lay.comb_row_bytes = (int)align_up((long long)h.hidden * h.combine_bytes, 16);
  lay.comb_rows = h.combine_rows >= 0
                      ? h.combine_rows
                      : std::max(R * T, worst_expert_major_rows(R, T, h.max_topk, h.max_experts, h.max_alignment));
  const long long rank_major_row = lay.x_row_bytes + 4LL * lay.scale_cols + 12LL * h.max_topk;
  lay.pool_bytes = h.pool_bytes >= 0 ? h.pool_bytes : 5 * R * T * rank_major_row / 4 + 8 * 256;
  long long off = 0;
  auto place = [&](long long& field, long long size) {
    off = align_up(off, kSectionAlign);
    field = off;
    off += std::max(size, 16LL);
  };
  place(lay.control, sizeof(Control));
  place(lay.counts, 4LL * kCountsInts);
  place(lay.scratch, 4LL * kScratchRows * kScratchStride);
  place(lay.stage_x, T * lay.x_row_bytes);
  place(lay.stage_scales, T * lay.scale_cols * 4);
  place(lay.stage_idx, T * h.max_topk * 4);
  place(lay.stage_w, T * h.max_topk * 4);
  place(lay.stage_rpos, T * kMaxRanks * 4);
  place(lay.stage_spos, T * h.max_topk * 4);
  place(lay.comb_x, lay.comb_rows * lay.comb_row_bytes);
  place(lay.comb_w, lay.comb_rows * h.max_topk * 4);
  place(lay.pool, lay.pool_bytes);
  lay.total = align_up(off, kSectionAlign);
  return lay;
}

}  // namespace mep
