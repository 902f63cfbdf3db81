// Host-side launchers of the IPC runtime's own kernels (ipc/fail_call.cu). Raw pointers only, as
// every path's api.h; the paths build on this, never the other way round.
#pragma once

#include <cuda_runtime.h>

#include "ipc/context.h"

namespace mep {

// A rank that fails on the host during a call publishes it at the handshake its peers wait on
// next (`slot`; kSlotCall before the call's first exchange, with the full record), then takes
// part in that handshake, so every rank aborts the call at the same point and the counters stay
// in step. Does nothing when the call was already aborted on the device.
void launch_fail_call(const Ctx& ctx, const CallArgs& call, int slot, cudaStream_t stream);

// Resolve the runtime's kernels now (module loading is lazy by default, and a first launch that
// has to wait behind a spinning kernel of the same process would deadlock).
void prepare_runtime_kernels();

}  // namespace mep
