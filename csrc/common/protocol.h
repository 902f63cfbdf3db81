// The call protocol every kernel path shares, defined once: limits, handshake slots, the call
// signature that ranks must agree on, and the error codes a kernel reports. Plain C++ (no CUDA,
// no torch): the kernels, the torch binding and the small `_protocol` module that Python reads
// these names and numbers from all include this header.
#pragma once

#include <cstdint>

namespace mep {

constexpr int kMaxRanks = 8;           // one NVLink domain; the internode path forwards to this
constexpr int kMaxTopk = 32;           // one warp lane per top-k slot
constexpr int kMaxExperts = 1024;      // counts area and notify's per-block histograms
constexpr int kMaxAlignment = 1024;    // expert-major segment alignment (int32 row sums stay small)
constexpr int kNumSlots = 8;           // signal slots, one per kind of handshake
constexpr int kNumGridCounters = 8;    // "last block done" counters, one per kernel kind
constexpr int kMaxNotifyBlocks = 256;  // notify scratch rows a plan aims at: chunk prefixes, block totals, bases
constexpr int kMaxTokenGroups = 64;    // notify token groups (the internode intranode stage: one per source node)
constexpr int kMsgBytes = 200;         // a failing rank's message, carried to its peers

// Handshakes. Each is a monotonic counter per (slot, source rank) in the receiver's control
// block: a sender adds 1 per call, a waiter expects (calls seen so far + 1). The counters of
// what was seen live on the device too, so graph replays stay in step.
//
// kSlotCall is the first exchange of every call, whatever the op: each rank publishes its
// call record (signature, status) with it, and every rank checks all records before anything
// is written into a peer's memory. Ranks that called different ops therefore still meet here.
enum Slot : int {
  kSlotCall = 0,          // first exchange of a call: records published (+ counts for notify)
  kSlotStaged = 1,        // dispatch inputs staged after notify -> pullers may read
  kSlotDispatchDone = 2,  // puller finished reading this rank's dispatch staging
  kSlotCombDone = 3,      // puller finished reading this rank's combine staging
  kSlotOutLoc = 4,        // push dispatch after notify: this rank published where its outputs are
  kSlotPushDone = 5,      // push dispatch: a sender finished writing into this rank's outputs
};
inline const char* slot_name(int s) {
  switch (s) {
    case kSlotCall: return "call exchange (signatures, counts)";
    case kSlotStaged: return "dispatch staging";
    case kSlotDispatchDone: return "end of dispatch";
    case kSlotCombDone: return "end of combine";
    case kSlotOutLoc: return "push dispatch: output locations";
    case kSlotPushDone: return "end of push dispatch";
    case kNumSlots: return "grid barrier (blocks not co-resident)";
    default: return "unknown handshake";
  }
}

enum GridCounter : int {
  kGridStage = 0, kGridDispatch = 1, kGridStageComb = 2, kGridCombine = 3, kGridBarrier = 4, kGridPush = 5,
  kGridFail = 6
};

// What a call does. Ranks must call the same op with the same arguments (below) in the same order.
enum Op : int {
  kOpNone = 0, kOpDispatch = 1, kOpCachedDispatch = 2, kOpCombine = 3, kOpLowLatencyDispatch = 4,
  kOpLowLatencyCombine = 5, kOpLowLatencyBarrier = 6
};
inline const char* op_name(long long op) {
  switch (op) {
    case kOpDispatch: return "dispatch";
    case kOpCachedDispatch: return "cached dispatch";
    case kOpCombine: return "combine";
    case kOpLowLatencyDispatch: return "low_latency_dispatch";
    case kOpLowLatencyCombine: return "low_latency_combine";
    case kOpLowLatencyBarrier: return "low_latency_barrier";
    default: return "none";
  }
}

// The call signature: every field must be equal on every rank, or the call is aborted on all of
// them (nothing written) and each raises, naming the field and every rank's value.
enum SigField : int {
  kSigBuffer = 0,      // which Buffer of the group: its ordinal there (first, so it is named first)
  kSigOp,              // Op
  kSigSeq,             // calls this buffer made so far (a rank that skipped one is caught here)
  kSigRouting,         // seq of the dispatch that built the handle (cached dispatch, combine)
  kSigDtype,           // DType of the rows
  kSigHidden,          // H
  kSigRowBytes,        // bytes per row
  kSigTopk,            // K
  kSigExperts,         // E
  kSigPermute,         // expert-major layout
  kSigAlignment,       // expert-major segment alignment
  kSigWorstSized,      // outputs worst-case sized (num_worst_tokens > 0; the count may differ per rank)
  kSigWeights,         // DType of the weights that travel with the rows (0: none)
  kSigVariant,         // kernel variant (dispatch: push or stage+pull; combine: CombineVariant); must match
  kSigCapacity,        // low-latency: max_tokens_per_rank (fixes every rank's receive layout)
  kSigFields
};
// (namespace-scope constants: each library its own copy, none shared by the loader)
constexpr const char* kSigFieldNames[kSigFields] = {"buffer", "op", "seq", "routing", "dtype", "hidden", "row_bytes",
                                                    "topk", "num_experts", "permute", "expert_alignment",
                                                    "worst_case_sized", "weights", "variant", "max_tokens_per_rank"};
inline const char* sig_field_name(int f) { return (f >= 0 && f < kSigFields) ? kSigFieldNames[f] : "?"; }

// A normal combine's kSigVariant: how the rows are summed (the ranks' kernels must pair).
enum CombineVariant : int {
  kCombineStaged = 0,    // staged rows pulled and summed (expert-major: per rank first, rounded)
  kCombinePartials = 1,  // expert-major: each rank's partials reduced locally, then pulled
  kCombineSingle = 2,    // expert-major: every slot's row a term of its own (single_reduction)
};

enum DType : int { kDtypeNone = 0, kDtypeBf16 = 1, kDtypeFp32 = 2, kDtypeFp8 = 3, kDtypeFp64 = 4 };

enum CallStatus : int { kCallOk = 0, kCallFailed = 1 };

// Errors a kernel records in the mapped host block. Mismatch and peer failure abort one call
// on every rank at the same handshake, so the handshake counters stay in step and the buffer
// stays usable; a timeout leaves them out of step, so the buffer must be re-created.
enum ErrorCode : int {
  kErrNone = 0,
  kErrTimeout = 1,      // fatal: this rank waited past the timeout
  kErrPeerAborted = 2,  // fatal: another rank timed out and stopped everyone
  kErrMismatch = 3,     // call aborted: the ranks' signatures differ
  kErrPeerFailed = 4,   // call aborted: a rank published a failure (its message is carried)
};
inline bool error_is_fatal(int code) { return code == kErrTimeout || code == kErrPeerAborted; }

}  // namespace mep
