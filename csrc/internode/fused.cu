// The internode path in one data kernel per direction, as a profiler sees DeepEP's: a cached
// dispatch is cached_notify + dispatch_kernel, a combine cached_notify + combine_kernel. The
// steps are those of the separate launches (internode/steps.cuh, the intranode path's
// dispatch_steps.cuh and combine_steps.cuh), run in one launch with the order between them kept
// inside it:
//
//   cached_notify   one block: the intranode push's announcement (where this rank's outputs lie,
//                   and its call record: a cached dispatch), then the wait until every destination
//                   node released this rank's previous call of the direction.
//   dispatch_kernel the RDMA send of this rank's rows; every block waits for every source node;
//                   the intranode push of the forwarded rows (read through L2: they arrived during
//                   this launch); the last block releases the receive area to its senders.
//   combine_kernel  the intranode combine into the forwarder's rows (stage + pull-and-sum, or the
//                   expert-major pre-reduction + partial sums); a grid barrier; the RDMA send of
//                   those sums; the receive and fp32 sum over the token's nodes; the release.
//
// Nothing inside waits for a later step of another rank, so one launch cannot deadlock on itself:
// the RDMA send waits for nothing (its release wait ran in cached_notify), the intranode stage
// waits only for the node's ranks' announcements and sends, the receive only for RDMA sends. Every
// block must be resident (as for every kernel of ours that waits on peers: the host's SM budget).
// A new routing's dispatch keeps the separate launches (kernels.cu): its intranode notify needs
// the forwarded ids, and the host reads the sizes before the rows move.
#include "common/cuda_check.h"
#include "internode/steps.cuh"
#include "intranode/combine_steps.cuh"
#include "intranode/dispatch_steps.cuh"

namespace mep {
namespace internode {

// Every block of the grid has finished what came before (thread 0 of each block arrives; the last
// one to arrive opens the next generation). Bounded like every wait: a block left waiting past the
// timeout reports it and the path fails.
__device__ __forceinline__ bool grid_sync(const InternodeCtx& c, long long sig) {
  __shared__ int s_ok;
  InternodeState* st = state_of(c);
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* gen = &st->bar_gen;
    const unsigned g = *gen;
    __threadfence();  // this block's writes, and the generation read, before the arrival
    bool ok = true;
    if (atomicAdd(&st->bar_count, 1u) == gridDim.x - 1) {
      st->bar_count = 0;
      __threadfence();
      atomicAdd(&st->bar_gen, 1u);
    } else {
      long long v;
      ok = sym::spin(waiter(c), [&] { return (long long)*gen; }, [&](long long x) { return (unsigned)x != g; }, v,
                     sym::WaitSite{kOpCombine, kInternodeWaitGrid, c.node, peer_rank(c, c.node), kInternodeCombine, sig});
    }
    __threadfence();
    s_ok = ok;
  }
  __syncthreads();
  return s_ok;
}

template <bool kAnnounce>
__global__ void __launch_bounds__(kInternodeThreads, 1) cached_notify_kernel(const InternodeCtx c, int dir, long long sig,
                                                                             const IntranodeDispatch in) {
  if (kAnnounce && threadIdx.x == 0 && !call_aborted(in.ctx)) push_announce(in.ctx, in.call, in.slot, in.push);
  const long long call = *reinterpret_cast<volatile long long*>(&state_of(c)->sent[dir]) + 1;
  wait_released(c, dir, call, dir == kInternodeDispatch ? kOpDispatch : kOpCombine, sig);  // failed: the sends skip
}

__global__ void __launch_bounds__(kInternodeThreads, 1) dispatch_kernel(const InternodeCtx c, const InternodeSendArgs s,
                                                                        const IntranodeDispatch in) {
  __shared__ int tokens[kInternodeMaxNodes];
  copy_counts(in.push.out.counts);  // (a cached dispatch's: the intranode stage's counts)
  InternodeState* st = state_of(c);
  const long long sent = *reinterpret_cast<volatile long long*>(&st->sent[kInternodeDispatch]) + 1;
  const long long got = *reinterpret_cast<volatile long long*>(&st->received[kInternodeDispatch]) + 1;
  if (!failed(c)) send_rows(c, s);
  finish_send(c, kInternodeDispatch, sent, nullptr, s.T, s.sig, &st->grid_done[0]);
  // every block waits for every source (a few words each); a failed wait leaves stale rows, which
  // the host's check turns into the call's error
  wait_sources(c, kInternodeDispatch, got, kOpDispatch, s.sig, tokens);
  if (!call_aborted(in.ctx)) push_rows<true>(in.ctx, in.slot, in.push);
  finish_receive(c, kInternodeDispatch, got, &st->grid_done[1], true);  // the intranode stage has read the area
}

// kMode: how the intranode stage sums (one kernel each: ptxas allocates a function's registers for
// every path in it): kStagedRank, kStagedExpert (stage + pull-and-sum), kPartials (the expert-major
// pre-reduction + the partials' sum)
enum { kStagedRank = 0, kStagedExpert = 1, kPartials = 2 };

template <bool kFp32, int kMode>
__global__ void __launch_bounds__(kInternodeThreads, 1)
    combine_kernel(const InternodeCtx c, const InternodeCombineSendArgs s, const InternodeCombineRecvArgs r,
                   const IntranodeCombine in) {
  InternodeState* st = state_of(c);
  const long long sent = *reinterpret_cast<volatile long long*>(&st->sent[kInternodeCombine]) + 1;
  if constexpr (kMode == kPartials) {
    combine_reduce_step<kFp32>(in.ctx, in.call, in.reduce);
    combine_partials_step<kFp32>(in.ctx, in.comb);
  } else {
    stage_combine_step(in.ctx, in.call, in.stage);
    combine_step<kFp32, kMode == kStagedExpert ? kSumGrouped : kSumRankRows>(in.ctx, in.comb);
  }
  const bool ok = grid_sync(c, s.sig);  // the forwarder's rows are complete
  if (ok && !failed(c)) combine_send_rows(c, s);
  finish_send(c, kInternodeCombine, sent, s.tokens, 0, s.sig, &st->grid_done[2]);
  combine_recv_sum(c, r, &st->grid_done[3]);
}

template <bool kFp32>
void launch_combine_kernel(const InternodeCtx& c, const InternodeCombineSendArgs& s, const InternodeCombineRecvArgs& r,
                           const IntranodeCombine& in, int num_blocks, cudaStream_t stream) {
  const auto kernel = in.partials ? combine_kernel<kFp32, kPartials>
                      : in.comb.permute ? combine_kernel<kFp32, kStagedExpert>
                                        : combine_kernel<kFp32, kStagedRank>;
  kernel<<<num_blocks, kInternodeThreads, 0, stream>>>(c, s, r, in);
}

}  // namespace internode
using namespace internode;  // the launchers below (this file only)

static_assert(sizeof(InternodeCtx) + sizeof(InternodeCombineSendArgs) + sizeof(InternodeCombineRecvArgs) +
                  sizeof(IntranodeCombine) <= 4096 &&
              sizeof(InternodeCtx) + sizeof(InternodeSendArgs) + sizeof(IntranodeDispatch) <= 4096,
              "a fused kernel's parameters exceed 4 KB");

void launch_internode_cached_dispatch(const InternodeCtx& c, const InternodeSendArgs& s, const IntranodeDispatch& in,
                                      int num_blocks, cudaStream_t stream) {
  cached_notify_kernel<true><<<1, kInternodeThreads, 0, stream>>>(c, kInternodeDispatch, s.sig, in);
  check_cuda(cudaGetLastError(), "cached notify launch", "internode");
  dispatch_kernel<<<num_blocks, kInternodeThreads, 0, stream>>>(c, s, in);
  check_cuda(cudaGetLastError(), "fused dispatch launch", "internode");
}

void launch_internode_combine(const InternodeCtx& c, const InternodeCombineSendArgs& s, const InternodeCombineRecvArgs& r,
                              const IntranodeCombine& in, int num_blocks, cudaStream_t stream) {
  cached_notify_kernel<false><<<1, kInternodeThreads, 0, stream>>>(c, kInternodeCombine, s.sig, IntranodeDispatch{});
  check_cuda(cudaGetLastError(), "cached notify launch", "internode");
  if (r.fp32)
    launch_combine_kernel<true>(c, s, r, in, num_blocks, stream);
  else
    launch_combine_kernel<false>(c, s, r, in, num_blocks, stream);
  check_cuda(cudaGetLastError(), "fused combine launch", "internode");
}

void internode_touch_fused_kernels() {
  cudaFuncAttributes attr;
  const char* what = "loading the fused internode kernels";
  check_cuda(cudaFuncGetAttributes(&attr, cached_notify_kernel<true>), what, "internode");
  check_cuda(cudaFuncGetAttributes(&attr, cached_notify_kernel<false>), what, "internode");
  check_cuda(cudaFuncGetAttributes(&attr, dispatch_kernel), what, "internode");
  for (const auto kernel : {combine_kernel<true, kStagedRank>, combine_kernel<true, kStagedExpert>,
                            combine_kernel<true, kPartials>, combine_kernel<false, kStagedRank>,
                            combine_kernel<false, kStagedExpert>, combine_kernel<false, kPartials>})
    check_cuda(cudaFuncGetAttributes(&attr, kernel), what, "internode");
}

}  // namespace mep
