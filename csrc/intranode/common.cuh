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

template <typename T>
__device__ __forceinline__ T* at(const Ctx& c, int r, long long off) {
  return reinterpret_cast<T*>(region(c, r) + off);
}

}  // namespace mep
