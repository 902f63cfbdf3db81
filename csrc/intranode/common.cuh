// What the intranode kernel files share: block shapes and region addressing. The kernels are
// split by stage: notify.cu (counts, the call exchange, row positions), dispatch.cu (stage,
// pull, push, fan-out), combine.cu (stage, pull-and-sum, reduce, partials).
#pragma once

#include <cuda_bf16.h>

#include <climits>

#include "intranode/api.h"
#include "ipc/handshake.cuh"

namespace mep {

constexpr int kCopyThreads = 512;
constexpr int kCopyWarps = kCopyThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// DispatchArgs::counts, by the grid's first block (before anything else: an aborted call's
// outputs are discarded anyway).
__device__ __forceinline__ void copy_counts(const CountsCopy& cc) {
  if (cc.dst == nullptr || blockIdx.x != 0) return;
  for (int i = threadIdx.x; i < cc.n; i += blockDim.x) cc.dst[i] = cc.src[i];
}

// The ids' check, one token per warp (lane k holds slot k's id; `in_token`: the lane holds a slot
// of a token): the lanes whose slot is bad -- an id that is neither -1 nor an expert (`valid`:
// in [0, E)), or an expert an earlier slot of the token names already. The one rule of the check
// on the device (notify's check_ids, launch_check_ids); checks.py states it for the host.
__device__ __forceinline__ unsigned bad_slot_lanes(long long id, bool valid, bool in_token) {
  const int lane = lane_id();
  // lanes without a valid id get a value of their own, so only equal expert ids match
  const unsigned same = __match_any_sync(kFull, valid ? (unsigned long long)id : ~(unsigned long long)lane);
  const bool repeated = valid && (same & ((1u << lane) - 1u)) != 0u;
  return __ballot_sync(kFull, in_token && ((!valid && id != -1) || repeated));
}

template <typename T>
__device__ __forceinline__ T* at(const Ctx& c, int r, long long off) {
  return reinterpret_cast<T*>(region(c, r) + off);
}

}  // namespace mep
