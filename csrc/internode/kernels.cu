// The internode normal path's RDMA-domain half (the NVLink half is the intranode path, run by
// each node's forwarders on what arrives here; megatron_ep/backends/cuda/paths/internode.py composes them).
//
// Dispatch, send: each token goes once to the same-index rank of every node that owns one of
// its experts, into the fixed slot (this node, token) of that rank's receive area; the ids and
// weights of every token go to every node in one contiguous copy, so a receiver can tell which
// slots are live without a count exchange. Destinations are staggered per token (no incast).
// After its rows, the last block writes each node's header (token count, call hash) and its
// signal (calls sent). Receive: wait for every source node's signal, check its hash, and lay
// out the forwarder's view: node-local expert ids (-1 off this node or past the source's count).
// The intranode stage takes the rows as one token group per source node, so it delivers them in
// the contract's order with no key or sort. A release kernel, queued after the intranode stage has
// read the area, tells each sender that its slots are free again; a sender waits for that before
// its next call.
//
// Combine is the reverse: each forwarder sends its intranode sum of every token back to the slot
// (its node, token) of the token's rank, which sums the slots of the nodes the token went to in
// fp32 and releases them at once.
//
// These are the separate launches of a new routing's dispatch (send, receive, release); a cached
// dispatch and every combine run the same steps (internode/steps.cuh) in one kernel each, with
// the intranode stage inside it (fused.cu).
//
// Transport as in the low-latency kernels (csrc/low_latency/): stores through nvshmem_ptr when the peer is load/store
// reachable (NVLink, the same GPU), else NVSHMEM puts from symmetric staging (IBGDA/IB across
// nodes) completed with nvshmem_quiet before the signal. Every wait is bounded (sym::spin).
#include "common/cuda_check.h"
#include "internode/steps.cuh"

namespace mep {
// The kernels live in the named namespace mep::internode so profilers show them as such.
namespace internode {

// ------------------------------------------------------------------------------------ dispatch
__global__ void __launch_bounds__(kInternodeThreads, 1) dispatch_send_kernel(const InternodeCtx c, const InternodeSendArgs a) {
  InternodeState* st = state_of(c);
  const long long call = *reinterpret_cast<volatile long long*>(&st->sent[kInternodeDispatch]) + 1;
  if (wait_released(c, kInternodeDispatch, call, kOpDispatch, a.sig)) send_rows(c, a);
  finish_send(c, kInternodeDispatch, call, nullptr, a.T, a.sig, &st->grid_done[0]);
}

__global__ void __launch_bounds__(kInternodeThreads, 1) dispatch_recv_kernel(const InternodeCtx c, const InternodeRecvArgs a) {
  __shared__ int tokens[kInternodeMaxNodes];
  const int N = c.lay.num_nodes, mt = c.lay.max_tokens;
  InternodeState* st = state_of(c);
  const long long call = *reinterpret_cast<volatile long long*>(&st->received[kInternodeDispatch]) + 1;
  const InternodeLayout& lay = c.lay;
  wait_sources(c, kInternodeDispatch, call, kOpDispatch, a.sig, tokens);  // tokens are 0 where it failed
  if (blockIdx.x == 0)
    for (int n = threadIdx.x; n < N; n += blockDim.x) a.out_tokens[n] = tokens[n];
  const int experts_per_node = a.E / N, first = c.node * experts_per_node;
  const long long* ids = reinterpret_cast<const long long*>(c.base + lay.d_idx);
  const long long total = (long long)N * mt * a.K;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / a.K;
    const int n = (int)(row / mt), t = (int)(row % mt);
    long long v = -1;
    if (t < tokens[n]) {
      const long long g = __ldcg(ids + i);
      if (g >= first && g < first + experts_per_node) v = g - first;
    }
    a.out_idx[i] = v;
  }
  finish_receive(c, kInternodeDispatch, call, &st->grid_done[1], false);  // released after the intranode stage
}

// One block: tell every sender of `dir` that this rank finished reading its last call.
__global__ void release_kernel(const InternodeCtx c, int dir) {
  release_senders(c, dir, *reinterpret_cast<volatile long long*>(&state_of(c)->received[dir]));
}


// This rank failed before its RDMA send of a call: every same-index peer's waits on it stop and name it.
__global__ void publish_failure_kernel(const InternodeCtx c, long long seq) {
  if (threadIdx.x == 0)
    sym::publish_failure(c.peer_base, c.base, c.pe, c.lay.num_nodes, c.node,
                         c.lay.state + (long long)offsetof(InternodeState, peer_failed), peer_rank(c, c.node), seq);
}

void check(cudaError_t e, const char* what) { check_cuda(e, what, "internode"); }

}  // namespace internode
using namespace internode;  // the launchers below (this file only)

// ------------------------------------------------------------------------------------ launchers
void launch_internode_dispatch_send(const InternodeCtx& c, const InternodeSendArgs& a, int num_blocks, cudaStream_t stream) {
  dispatch_send_kernel<<<num_blocks, kInternodeThreads, 0, stream>>>(c, a);
  check(cudaGetLastError(), "dispatch send launch");
}
void launch_internode_dispatch_recv(const InternodeCtx& c, const InternodeRecvArgs& a, int num_blocks, cudaStream_t stream) {
  dispatch_recv_kernel<<<num_blocks, kInternodeThreads, 0, stream>>>(c, a);
  check(cudaGetLastError(), "dispatch receive launch");
}
void launch_internode_release(const InternodeCtx& c, int dir, cudaStream_t stream) {
  release_kernel<<<1, 64, 0, stream>>>(c, dir);
  check(cudaGetLastError(), "release launch");
}

void launch_internode_publish_failure(const InternodeCtx& c, long long seq, cudaStream_t stream) {
  publish_failure_kernel<<<1, 32, 0, stream>>>(c, seq);
  check(cudaGetLastError(), "failure publication launch");
}

void internode_touch_kernels() {
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, publish_failure_kernel), "loading the failure publication kernel");
  check(cudaFuncGetAttributes(&attr, dispatch_send_kernel), "loading the dispatch send kernel");
  check(cudaFuncGetAttributes(&attr, dispatch_recv_kernel), "loading the dispatch receive kernel");
  check(cudaFuncGetAttributes(&attr, release_kernel), "loading the release kernel");
  internode_touch_fused_kernels();
}

}  // namespace mep
