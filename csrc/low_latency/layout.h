// The low-latency path's symmetric buffer, defined once: `LowLatencyLayout::plan` both sizes it
// (the hint Python reads through megatron_ep._C_nvshmem) and places every section the kernels use,
// so size and layout cannot drift. Plain C++ usable from host and device code, no NVSHMEM,
// no torch.
//
// One buffer per rank, allocated with nvshmem_malloc (same offsets on every PE). Two identical
// sets alternate between calls, so two calls can be in flight (a recv hook not yet called);
// every stride comes from the capacity (not the call), so a call never writes outside its set.
//
//   per set:
//     d_send  [mt][d_msg]              dispatch staging: the FP8 cast (or bf16 copy) of each token
//     d_meta  [mt][K][16]              dispatch staging: table entries, for puts
//     d_rows  [R][mt][d_msg]           dispatch receive area: a token's row once per (source, receiver),
//                                      at its position among the source's tokens bound for this rank
//     d_table [L][R][mt][16]           dispatch receive table: entry (local expert, source, position) =
//                                      (row position in d_rows, top-k slot, token): which row is that copy
//     c_stage [warps][c_row]           combine staging for puts (one row per warp in flight)
//     c_recv  [mt][K][c_row]           combine receive area: slot (token, top-k slot); a row is the
//                                      bf16 row, then LogFMT's meta words (low_latency/logfmt.cuh)
//     d_count [L][R] int64             count signals (dispatch): -1 - (count | sig << 32)
//     c_flag  [E] int64                arrival flags (combine), one per global expert (merged: one per
//                                      sending rank, words [0, R))
//     release [R] int64                written by each receiver: its completed calls on this set
//   state (local, once): counters that never leave this rank
//
// A dispatch message is [16 bytes (unused: the table entry says whose row it is)][H data bytes]
// [H/128 fp32 scales]; DeepEP's accounting counts the 16 bytes, so the size is kept.
// A token's row crosses the link once per receiving rank, not once per expert copy: the copies
// of a row are table entries, and the receiver's copy-out expands them into expert segments.
#pragma once

#include <cstddef>
#include <cstdint>

#include "nvshmem/common.h"  // MEP_HD, sym_align, SymmetricError

namespace mep {

constexpr int kLLMaxRanks = 64;        // count signals and release tokens per set
constexpr int kLLThreads = 512;        // threads per block of both kernels (16 warps)
constexpr int kLLWarps = kLLThreads / 32;
constexpr int kLLMaxBlocks = 132;      // one H200's SMs: bounds the combine staging rows
constexpr int kLLIdsSmemBytes = 100 << 10;  // dispatch: the call's T*K expert ids and E counts in shared memory up to this
constexpr int kLLMaskTokens = 1024;    // dispatch: per-token receiving-rank masks (static shared memory) up to this T
constexpr int kLLHeader = 16;          // dispatch message header bytes (DeepEP's accounting too)
constexpr int kLLEntry = 16;           // dispatch table entry: int4 (row position, top-k slot, token, 0)

// Local counters (in the same allocation; peers write only `peer_failed` and `sync`).
struct LowLatencyState {
  long long peer_failed;                 // rank + 1 of a peer that failed before joining a call (0: none)
  unsigned int d_finish[2][1024];        // [set][global expert]: copies sent (dispatch)
  unsigned int c_finish[2][1024];        // [set][local expert * R + dst] (L * R = E): rows sent (combine)
  unsigned int grid_done[2];             // [set]: blocks past the receive half
  long long set_calls[2];                // [set]: calls this rank completed on the set
  int failed;                            // a wait timed out: every later wait returns at once
  int err_claims;                        // error records claimed (the host counts its clears)
  // The rank mask (a Buffer made with rank_mask: DeepEP's shrink mode). mask[r] = 1: rank r is
  // skipped by every kernel of this rank (no rows, signals or waits), set by the host or by a wait
  // on r that timed out. Written only by this rank (its kernels and its host's mask kernel).
  int mask[kLLMaxRanks];
  long long barriers;                    // barriers this rank entered (each is two rounds)
  long long sync[kLLMaxRanks];           // written by rank r: its `barriers` count (barrier_kernel)
};

// What a low-latency wait names in the error record (SymmetricError::what).
enum LLWhat : int {
  kLLWaitRelease = 0,   // the send half waited for a receiver to release the buffer set
  kLLWaitCount = 1,     // dispatch receive waited for (local expert, source)'s count signal
  kLLWaitFlag = 2,      // combine receive waited for a global expert's rows from its owner
  kLLWaitRankFlag = 3,  // merged combine receive waited for a rank's rows (`expert` = that rank)
  kLLWaitBarrier = 4    // the barrier waited for a rank to enter it
};

// Bytes of one dispatch message for a call (header + data + scales).
constexpr MEP_HD long long ll_dispatch_msg_bytes(long long hidden, bool fp8) {
  return kLLHeader + (fp8 ? hidden + hidden / 128 * 4 : hidden * 2);
}

// Bytes after a combine row for LogFMT's meta words (one per 128 channels), whole int4 words.
constexpr MEP_HD long long ll_logfmt_meta_bytes(long long hidden) { return (hidden / 128 * 4 + 15) / 16 * 16; }

struct LowLatencyLayout {
  // capacity
  int num_ranks, num_experts, max_tokens, hidden, max_topk, fp8_only;
  // strides
  long long d_msg, c_row;
  // offsets inside a set, and the set size
  long long d_send, d_meta, d_rows, d_table, c_stage, c_recv, d_count, c_flag, release, set_bytes;
  long long state, total;

  static LowLatencyLayout plan(int num_ranks, int num_experts, int max_tokens, int hidden, int max_topk,
                               bool fp8_only) {
    LowLatencyLayout l{};
    l.num_ranks = num_ranks, l.num_experts = num_experts, l.max_tokens = max_tokens, l.hidden = hidden;
    l.max_topk = max_topk, l.fp8_only = fp8_only;
    const long long L = num_experts / num_ranks;
    // 16-byte multiples: every message and row is copied in int4 words
    l.d_msg = sym_align(ll_dispatch_msg_bytes(hidden, fp8_only), 16);  // a bf16 message is the larger
    // a bf16 row, then (LogFMT) one meta word per 128 channels (low_latency/logfmt.cuh)
    l.c_row = sym_align(2LL * hidden + ll_logfmt_meta_bytes(hidden), 16);
    long long o = 0;
    l.d_send = o, o = sym_align(o + (long long)max_tokens * l.d_msg);
    l.d_meta = o, o = sym_align(o + (long long)max_tokens * max_topk * kLLEntry);
    l.d_rows = o, o = sym_align(o + (long long)num_ranks * max_tokens * l.d_msg);
    l.d_table = o, o = sym_align(o + L * num_ranks * max_tokens * kLLEntry);
    l.c_stage = o, o = sym_align(o + (long long)kLLMaxBlocks * kLLWarps * l.c_row);
    l.c_recv = o, o = sym_align(o + (long long)max_tokens * max_topk * l.c_row);
    l.d_count = o, o = sym_align(o + L * num_ranks * 8);
    l.c_flag = o, o = sym_align(o + (long long)num_experts * 8);
    l.release = o, o = sym_align(o + (long long)kLLMaxRanks * 8);
    l.set_bytes = o;
    l.state = 2 * l.set_bytes;
    l.total = sym_align(l.state + (long long)sizeof(LowLatencyState));
    return l;
  }
  MEP_HD long long set_offset(int set) const { return set * set_bytes; }
  // dispatch row from source rank `src` at position `pos` (of the source's rows for this rank)
  MEP_HD long long d_row(int set, int src, int pos) const {
    return set_offset(set) + d_rows + ((long long)src * max_tokens + pos) * d_msg;
  }
  // dispatch table entry of copy (local expert, source rank, position)
  MEP_HD long long d_entry(int set, int le, int src, int pos) const {
    return set_offset(set) + d_table + (((long long)le * num_ranks + src) * max_tokens + pos) * kLLEntry;
  }
  // combine slot of (token, top-k slot)
  MEP_HD long long c_slot(int set, int token, int k) const {
    return set_offset(set) + c_recv + ((long long)token * max_topk + k) * c_row;
  }
};

}  // namespace mep
