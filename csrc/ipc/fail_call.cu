// Path-agnostic kernels of the runtime: publishing a host-side failure to the peers.

#include "ipc/handshake.cuh"
#include "ipc/api.h"

namespace mep {

// One thread. The peers are (or will be) waiting on `slot` for this call; this rank's record
// says it failed and why, and the handshake completes normally so the counters stay in step.
__global__ void fail_call_kernel(Ctx c, CallArgs call, int slot) {
  if (call_aborted(c)) return;  // the device already aborted this call everywhere: nobody waits
  Control* me = ctrl_of(c, c.rank);
  const unsigned long long target = me->expected[slot] + 1;
  if (slot == kSlotCall) {
    write_record(c, call);
  } else {  // the record of this call was published at its exchange; flip it to failed
    CallRecord* rec = record_of(c, c.rank);
    const int n = call.msg_len < kMsgBytes ? call.msg_len : kMsgBytes;
    for (int i = 0; i < n; ++i) rec->msg[i] = call.msg[i];
    rec->msg_len = n;
    rec->status = kCallFailed;
  }
  reinterpret_cast<volatile long long*>(&me->aborted_seq)[0] = c.seq;
  signal_all(c, slot);
  for (int r = 0; r < c.num_ranks; ++r)
    if (!wait_signal(c, slot, r, target)) return;
  me->expected[slot] = target;
}

void launch_fail_call(const Ctx& ctx, const CallArgs& call, int slot, cudaStream_t stream) {
  fail_call_kernel<<<1, 1, 0, stream>>>(ctx, call, slot);
}

void prepare_runtime_kernels() {
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, fail_call_kernel);
}

}  // namespace mep
