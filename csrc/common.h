// Definitions shared by host code and kernels: the layout of each rank's communication region,
// the control block at its start, and the mapped host block that carries receive counts and
// errors back to the CPU. Plain C++ (no torch, no CUDA-only syntax).
#pragma once

#include <cstdint>

namespace mep {

constexpr int kMaxRanks = 8;          // one NVLink domain; the internode path forwards to this
constexpr int kMaxTopk = 32;          // one warp lane per top-k slot
constexpr int kMaxExperts = 1024;     // notify keeps per-warp histograms of this many in smem
constexpr int kNumSlots = 8;          // signal slots, one per kind of handshake
constexpr int kNumGridCounters = 8;   // "last block done" counters, one per kernel kind

// Handshakes. Each is a monotonic counter per (slot, source rank) in the receiver's control
// block: a sender adds 1 per call, a waiter expects (calls seen so far + 1). The counters of
// what was seen live on the device too, so graph replays stay in step.
enum Slot : int {
  kSlotNotify = 0,        // counts published (notify kernel)
  kSlotStaged = 1,        // dispatch inputs staged (stage kernel) -> pullers may read
  kSlotDispatchDone = 2,  // puller finished reading this rank's dispatch staging
  kSlotCombStaged = 3,    // combine inputs staged
  kSlotCombDone = 4,      // puller finished reading this rank's combine staging
  kSlotOutLoc = 5,        // push dispatch: this rank published where its outputs are
  kSlotPushDone = 6,      // push dispatch: a sender finished writing into this rank's outputs
};

enum GridCounter : int {
  kGridStage = 0, kGridDispatch = 1, kGridStageComb = 2, kGridCombine = 3, kGridBarrier = 4, kGridPush = 5
};

enum ErrorCode : int { kErrNone = 0, kErrTimeout = 1, kErrPeerAborted = 2 };

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
  long long out_x_off, out_s_off, out_idx_off, out_w_off;  // push dispatch: where (byte offsets)
  int pad_[2];
};

// Byte offsets inside a region; identical on every rank (all ranks size from the same hints).
struct RegionLayout {
  long long counts;        // int32 [kMaxRanks] tokens per destination rank, then [max_experts]
  long long stage_x;       // [max_tokens, x_row_bytes] dispatch rows (bf16/fp32/fp8 bytes)
  long long stage_scales;  // [max_tokens, scale_cols] float (FP8 scales)
  long long stage_idx;     // [max_tokens, K] int32 expert ids
  long long stage_w;       // [max_tokens, K] float topk weights
  long long stage_rpos;    // [max_tokens, kMaxRanks] int32 row of the token in each rank-major output
  long long stage_spos;    // [max_tokens, K] int32 row of (token, slot) in the expert-major output
  long long comb_x;        // [comb_rows, comb_row_bytes] combine input rows
  long long comb_w;        // [comb_rows, K] float combine weights
  long long total;
  int max_tokens, max_topk, max_experts, x_row_bytes, scale_cols, comb_rows, comb_row_bytes, pad_;
};

// Mapped pinned host memory: written by kernels, read by the CPU without a sync.
struct HostInfo {
  volatile long long tag;      // notify writes the launch tag last, after the counts
  volatile int num_rows;       // N: rank-major rows this rank receives
  volatile int num_perm_rows;  // M: expert-major rows (padded)
  volatile int error;          // ErrorCode of the first failure
  volatile int err_rank;       // rank that reports
  volatile int err_peer;       // rank it waited on
  volatile int err_slot;       // Slot it waited on
  volatile long long err_expected;
  volatile long long err_observed;
  volatile int expert_counts[kMaxExperts];  // raw (unpadded) per-local-expert counts
};

struct Peers {
  char* base[kMaxRanks];  // every rank's region, mapped here (own region included)
};

// What every kernel needs to find its peers and report trouble.
struct Ctx {
  Peers peers;
  RegionLayout lay;
  HostInfo* host;  // device view of the mapped host block
  int rank;
  int num_ranks;
  unsigned long long timeout_ns;
};

}  // namespace mep
