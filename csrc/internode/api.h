// Host entry points of the internode path's RDMA-domain kernels (csrc/internode/kernels.cu).
// Raw pointers only and no NVSHMEM headers (the torch binding includes this with g++).
#pragma once

#include <cuda_runtime.h>

#include "internode/layout.h"
#include "intranode/api.h"  // IntranodeDispatch, IntranodeCombine: the intranode stage a fused kernel runs

namespace mep {

void internode_touch_kernels();  // load every kernel now (lazy loading deadlocks spinning kernels)

// Fixed per buffer.
struct InternodeCtx {
  char* base;              // this rank's symmetric buffer
  char* const* peer_base;  // [N] device array: the same-index rank of node n, load/store address or null
  const int* pe;           // [N] its NVSHMEM PE
  SymmetricError* err;    // device view of the mapped host error record
  InternodeLayout lay;
  int node, local, ranks_per_node;
  unsigned long long timeout_ns;
  long long seq;  // the call the next launches serve (Buffer's call number; -1: none): peers' failure publications name it
};

// Send half of a dispatch: every token to the same-index rank of each node that owns one of
// its experts, into slot (this node, token); ids and weights of every token to every node.
struct InternodeSendArgs {
  const char* x;              // [T][row_bytes]
  const float* scales;        // [T][scale_cols] or null
  const long long* topk_idx;  // [T][K] global expert ids (others: unused slots)
  const float* weights;       // [T][K] or null
  int T, K, E, row_bytes, scale_cols;
  int ids;                    // send the ids too (a new routing; a cached dispatch's receivers keep theirs)
  long long sig;              // the call's signature hash (31 bits)
};

// Receive half: wait for every source node, then the forwarder's view of its receive area:
// node-local expert ids (-1 past each source's T or off this node).
struct InternodeRecvArgs {
  int K, E;
  long long sig;
  long long* out_idx;  // [N * mt][K]
  int* out_tokens;     // [N]: tokens each source node sent
};

// Combine, send half: the forwarder's intranode sums back to the rank each token came from.
struct InternodeCombineSendArgs {
  const char* y;                // [N * mt][row_bytes] the intranode combine's output
  const float* w;               // [N * mt][K] weights scattered back, or null
  const long long* local_idx;   // [N * mt][K] the dispatch's node-local ids (a row with none: not sent)
  const int* tokens;            // [N] the dispatch's per-source token counts
  int K, row_bytes;
  long long sig;
};

// Combine, receive half: y[t] = the biases + the intranode sum of each node t went to, nodes in the
// order of their last top-k slot of t (as the intranode stage orders ranks), one fp32 accumulator.
struct InternodeCombineRecvArgs {
  const long long* topk_idx;  // [T][K] this rank's global ids
  int T, K, E, H, fp32;       // fp32: rows (in and out) are fp32, else bf16
  long long sig;
  void* y;                    // [T][H]
  float* w;                   // [T][K] or null
  const void* bias0;          // [T][H] y's dtype, the accumulator's start (+ bias1), or null
  const void* bias1;          // [T][H] or null
};

void launch_internode_dispatch_send(const InternodeCtx& c, const InternodeSendArgs& a, int num_blocks, cudaStream_t stream);
void launch_internode_dispatch_recv(const InternodeCtx& c, const InternodeRecvArgs& a, int num_blocks, cudaStream_t stream);
void launch_internode_release(const InternodeCtx& c, int dir, cudaStream_t stream);
// A cached dispatch in two launches (fused.cu): cached_notify (the RDMA send's release wait, and
// the intranode push's announcement of where this rank's outputs lie) then one dispatch kernel
// (the RDMA send, the wait for every source node, the intranode push of what arrived, the release).
void launch_internode_cached_dispatch(const InternodeCtx& c, const InternodeSendArgs& s, const IntranodeDispatch& in,
                                      int num_blocks, cudaStream_t stream);
// A combine in two launches (fused.cu): cached_notify (the RDMA send's release wait) then one
// combine kernel (the intranode combine into the forwarder's rows, a grid barrier, the RDMA send of
// those sums, the receive and sum over nodes, the release).
void launch_internode_combine(const InternodeCtx& c, const InternodeCombineSendArgs& s, const InternodeCombineRecvArgs& r,
                              const IntranodeCombine& in, int num_blocks, cudaStream_t stream);
void internode_touch_fused_kernels();
// This rank failed before its RDMA send of call `seq`: tell every same-index peer (their peer_failed word).
void launch_internode_publish_failure(const InternodeCtx& c, long long seq, cudaStream_t stream);

}  // namespace mep
