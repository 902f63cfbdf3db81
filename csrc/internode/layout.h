// The internode path's symmetric buffer (the RDMA domain), defined once: `InternodeLayout::plan`
// sizes it (Python reads the size through megatron_ep._C_nvshmem) and places every section the
// kernels use. Plain C++ for host and device code; no NVSHMEM, no torch.
//
// Rank (node n, local l) talks over the RDMA domain only with the ranks of the same local index
// l on every node (itself included). Each receive area has one fixed slot per (source node,
// source token), so a sender needs no count exchange to know where a token goes, and the
// forwarder's rows keep (source node, source token) order:
//
//   d_x    [N][mt][row]       dispatch rows (the call's row bytes are the stride)
//   d_s    [N][mt][sc]        fp32 FP8 scales (the call's scale columns are the stride)
//   d_idx  [N][mt][K] int64   each source token's global expert ids, every token of the source
//   d_w    [N][mt][K] fp32    its weights
//   c_y    [N][mt][crow]      combine: the forwarder's intranode sum of each token's rows
//   c_w    [N][mt][K] fp32    combine: the weights scattered back
//   s_*    staging (only when some peer is not load/store reachable: puts read symmetric memory):
//          this rank's x, scales, ids, weights (dispatch); its forwarded rows and weights (combine)
//   head   [2][N] {T, sig}    per direction and source node: its token count and call hash
//   signal [2][N] int64       per direction and source node: calls it sent (written after the data)
//   release[2][N] int64       per direction and destination node: calls that node finished reading
//   state  (local)
#pragma once

#include "nvshmem/common.h"  // MEP_HD, sym_align

namespace mep {

constexpr int kInternodeMaxNodes = 64;
constexpr int kInternodeThreads = 512;
constexpr int kInternodeWarps = kInternodeThreads / 32;
constexpr int kInternodeMaxBlocks = 132;

enum InternodeDir : int { kInternodeDispatch = 0, kInternodeCombine = 1 };
enum InternodeWhat : int {
  kInternodeWaitRelease = 0,  // a sender waited for a destination node to finish reading its last call
  kInternodeWaitSignal = 1,   // a receiver waited for a source node's rows
  kInternodeWaitGrid = 2      // a block of the fused combine waited for this rank's other blocks
};

// Local counters (in the same allocation, never written by peers).
struct InternodeState {
  long long peer_failed;  // rank + 1 of a same-index peer that failed before joining a call (0: none)
  long long sent[2];      // [direction]: calls this rank sent
  long long received[2];  // [direction]: calls this rank received
  unsigned grid_done[4];  // last-block counters: dispatch send, dispatch recv, combine send, combine recv
  unsigned bar_count, bar_gen;  // the fused combine's grid barrier: arrivals, generation
  int failed;             // a wait timed out: every later wait returns at once
  int err_claims;         // error records claimed (the host counts its clears)
};

struct InternodeLayout {
  // capacity
  int num_nodes, max_tokens, max_topk, staged;
  long long x_row, scale_cols, c_row;  // bytes per dispatch row, fp32 columns per scale row, bytes per combine row
  // offsets
  long long d_x, d_s, d_idx, d_w, c_y, c_w, s_x, s_s, s_idx, s_w, s_y, s_cw, head, signal, release, state, total;

  static InternodeLayout plan(int num_nodes, int max_tokens, int max_topk, long long x_row, long long scale_cols,
                              long long c_row, bool staged) {
    InternodeLayout l{};
    l.num_nodes = num_nodes, l.max_tokens = max_tokens, l.max_topk = max_topk, l.staged = staged;
    l.x_row = sym_align(x_row, 16), l.scale_cols = scale_cols, l.c_row = sym_align(c_row, 16);
    const long long slots = (long long)num_nodes * max_tokens, mine = staged ? max_tokens : 0;
    long long o = 0;
    l.d_x = o, o = sym_align(o + slots * l.x_row);
    l.d_s = o, o = sym_align(o + slots * l.scale_cols * 4);
    l.d_idx = o, o = sym_align(o + slots * max_topk * 8);
    l.d_w = o, o = sym_align(o + slots * max_topk * 4);
    l.c_y = o, o = sym_align(o + slots * l.c_row);
    l.c_w = o, o = sym_align(o + slots * max_topk * 4);
    // staging: this rank's own tokens (dispatch), and what it forwards back (combine)
    l.s_x = o, o = sym_align(o + mine * l.x_row);
    l.s_s = o, o = sym_align(o + mine * l.scale_cols * 4);
    l.s_idx = o, o = sym_align(o + mine * max_topk * 8);
    l.s_w = o, o = sym_align(o + mine * max_topk * 4);
    l.s_y = o, o = sym_align(o + (staged ? slots : 0) * l.c_row);
    l.s_cw = o, o = sym_align(o + (staged ? slots : 0) * max_topk * 4);
    l.head = o, o = sym_align(o + 2LL * kInternodeMaxNodes * 16);
    l.signal = o, o = sym_align(o + 2LL * kInternodeMaxNodes * 8);
    l.release = o, o = sym_align(o + 2LL * kInternodeMaxNodes * 8);
    l.state = o, o = sym_align(o + (long long)sizeof(InternodeState));
    l.total = o;
    return l;
  }
  MEP_HD long long head_at(int dir, int node) const { return head + ((long long)dir * kInternodeMaxNodes + node) * 16; }
  MEP_HD long long signal_at(int dir, int node) const { return signal + ((long long)dir * kInternodeMaxNodes + node) * 8; }
  MEP_HD long long release_at(int dir, int node) const { return release + ((long long)dir * kInternodeMaxNodes + node) * 8; }
};

}  // namespace mep
