// Host entry points of the low-latency path (csrc/low_latency/): the two kernels'
// launchers (NVSHMEM set-up: csrc/nvshmem/bootstrap.h). Raw pointers only, and no NVSHMEM
// headers here: the torch binding includes this file with g++, which cannot parse NVSHMEM's.
#pragma once

#include <cuda_runtime.h>

#include "low_latency/layout.h"
#include "nvshmem/bootstrap.h"

namespace mep {

void ll_touch_kernels();            // load every kernel now (lazy loading deadlocks spinning kernels)
void ll_touch_dispatch_kernel();     // dispatch.cu's part of it
void ll_touch_combine_kernels();     // combine.cu's part of it
void ll_touch_mask_kernels();        // rank_mask.cu's part of it

enum LLPhase : int { kLLSend = 1, kLLRecv = 2 };

// Where a kernel's time goes (scripts/bench low-latency --trace): each block stamps these
// points (ns, %globaltimer); "last warp" points are the max over the block's warps.
enum LLTracePoint : int {
  kLLTraceEntry = 0,      // thread 0 at entry
  kLLTraceReleased = 1,   // the receivers released the set (send half may start)
  kLLTraceZero = 2,       // dispatch: last warp done with the zero-count signals
  kLLTraceCast = 3,       // dispatch: last warp done casting the block's tokens into staging (before the release wait)
  kLLTraceSent = 4,       // last warp done sending rows (and their count signals / flags)
  kLLTraceArrived = 5,    // last warp saw its signals (dispatch counts; combine: the first token's flags)
  kLLTraceCopied = 6,     // last warp done copying out (dispatch) or reducing (combine)
  kLLTraceEnd = 7,        // thread 0 after the set's hand-back (the last block also cleared the words)
  kLLTraceScanned = 8,    // dispatch: last warp done with its row's position scans (before any store)
  kLLTraceStored = 9,     // last warp done storing its rows (dispatch: entries and row share), before the
                          // counter bump and the signal
  kLLTracePoints = 10
};
// Their names, in order: Python reads them from here (_C_nvshmem.TRACE_POINT_NAMES).
constexpr const char* kLLTraceNames[kLLTracePoints] = {"entry", "released", "zero",    "cast", "sent",
                                                       "arrived", "copied", "end", "scanned", "stored"};

// Fixed per buffer.
struct LLCtx {
  char* base;                // this rank's symmetric buffer
  char* const* peer_base;    // [R] device array: nvshmem_ptr(base, pe of rank r), null without P2P
  const int* pe;             // [R] device array: the NVSHMEM PE of each rank of the group
  SymmetricError* err;      // device view of the mapped host error record
  LowLatencyLayout lay;
  int rank, num_ranks;
  unsigned long long timeout_ns;
  unsigned long long* trace;  // null, or [2 kernels][kLLMaxBlocks][kLLTracePoints] globaltimer stamps (a bench's probe)
  long long seq;              // the call a launch serves (set per launch from its args): matches peers' failure publications
  int shrink;                 // the rank mask is on (LowLatencyState::mask): waits mask a peer instead of failing
};

struct LLDispatchArgs {
  const void* x;              // [T, H] bf16
  const long long* topk_idx;  // [T, K]; ids outside [0, E) are unused slots
  int T, K, E, H, fp8, round_scale, set, phases;
  long long sig;              // this call's signature hash (31 bits), checked against every sender
  long long seq;              // this call's sequence number (peers' failure publications name it)
  void* out_x;                // [L, R*mt, H] fp8 or bf16 (mt = the buffer's capacity, see out_cap)
  float* out_scales;          // [L, R*mt, H/128] (fp8 with fp32 scales), else null
  // fp8 with UE8M0 scales instead (round_scale): each scale's exponent byte, four per int32 along
  // hidden, stored column-major per expert ([L, H/512, out_cap] int32, as DeepGEMM reads them)
  int* out_ue8m0;
  int* out_count;             // [L]
  int* out_range;             // [L, R, 2] (begin, count)
  long long* out_layout;      // [L, R] begin << 32 | count: the same, as DeepEP's layout_range (optional)
  int* out_src;               // [L, R*mt] source token, -1 past the count
  int* out_slot;              // [L, R*mt] source top-k slot (the combine's return address)
  int out_cap;                // rows per expert in the outputs (R * the call's max_tokens_per_rank)
  // With the weights (optional, [T, K] fp32): they ride in the table entries, and the receive
  // half records, for the merged combine, each row's weight and per (source, token, top-k slot)
  // the row holding that copy here (entries of copies elsewhere are left as they were: the
  // combine validates each one against out_src / out_slot / out_range before use)
  const float* weights;       // null: no merged combine for this dispatch
  float* out_w;               // [L, R*mt] the row's top-k weight
  int* out_pairs;             // [R, mt, K] row of copy (source, token, slot) here
  // Statistics, each optional and added to (never reset here): the rows each local expert
  // received [L], and the SM clock cycles the receive half waited for each source's counts [R]
  int* recv_stats;
  long long* wait_stats;
};

struct LLCombineArgs {
  const void* x;              // [L, out_cap, H] bf16 expert outputs
  const int* range;           // [L, R, 2] from the dispatch
  const int* src;             // [L, out_cap]
  const int* slot;            // [L, out_cap]
  const long long* topk_idx;  // [T, K] (this rank's tokens)
  const float* weights;       // [T, K]
  // merged (the dispatch carried the weights): a token's copies here go back as one row, their
  // weighted sum rounded to bf16 (a single copy goes back as is and is weighted at its source)
  const int* pairs;           // [R, mt, K] from the dispatch (out_pairs), or null: one row per copy
  const float* row_w;         // [L, out_cap] from the dispatch (out_w)
  int T, K, E, H, out_cap, set, phases;
  int use_logfmt;             // rows travel as LogFMT-10 where a block allows (low_latency/logfmt.cuh)
  long long sig, seq;
  void* y;                    // [T, H] bf16
  long long* wait_stats;      // optional [R]: SM clock cycles the receive half waited for each rank's rows (added to)
};

void launch_ll_dispatch(const LLCtx& c, const LLDispatchArgs& a, int num_blocks, cudaStream_t stream);
void launch_ll_combine(const LLCtx& c, const LLCombineArgs& a, int num_blocks, cudaStream_t stream);
// This rank failed before joining call `seq`: tell every peer (their peer_failed word).
void launch_ll_publish_failure(const LLCtx& c, long long seq, cudaStream_t stream);

// The rank mask (c.shrink). A barrier over the ranks this rank does not mask, which also resets
// the buffer sets' protocol state on every rank (see barrier_kernel); a rank that does not enter
// it within the timeout is masked.
void launch_ll_barrier(const LLCtx& c, cudaStream_t stream);
enum LLMaskOp : int { kLLMaskSet = 0, kLLMaskQuery = 1, kLLMaskClear = 2 };
// kLLMaskSet: mask[rank] = value; kLLMaskQuery: out[r] = mask[r] for every r; kLLMaskClear: all 0.
void launch_ll_mask(const LLCtx& c, int op, int rank, int value, int* out, cudaStream_t stream);

}  // namespace mep
