// One intranode call's host side in one crossing. megatron_ep/backends/cuda/paths/intranode.py checks the
// inputs and decides (push or stage, partials, output rows); the entries here do the rest: order
// the communication stream after the caller's, allocate the outputs on the caller's stream, launch
// on ours, record the call's event and make the caller's stream wait for it (or, asynchronous,
// mark every tensor the kernels touch as used on ours). What a handle keeps between calls is
// bound once (HandleState). Included by intranode/binding.cpp, the one translation unit of _C
// that sees torch.
#pragma once

#include <torch/csrc/cuda/Event.h>
#include <torch/csrc/cuda/Stream.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "intranode/api.h"
#include "ipc/runtime.h"

namespace mep {

using Sig = std::vector<long long>;

// torch's Python CUDA event and stream types (their C structs are in torch's headers; the type
// objects are not exported, so they are looked up once by name; never freed: they outlive us).
// static: each library its own cache. An inline function's static of a hidden type (py::object)
// gets a library-local object but a guard the loader shares across libraries (STB_GNU_UNIQUE):
// the second library to call it would use a map it never constructed (tests/unit/test_extension_linkage.py).
static inline const py::object& torch_type(const char* name) {
  static std::unordered_map<std::string, py::object*> types;
  auto it = types.find(name);
  if (it == types.end()) it = types.emplace(name, new py::object(py::module_::import("torch._C").attr(name))).first;
  return *it->second;
}

inline at::cuda::CUDAEvent& event_of(const py::handle& e, const char* what) {
  TORCH_CHECK(py::isinstance(e, torch_type("_CudaEventBase")), "megatron_ep: ", what, " must be a torch.cuda.Event");
  return reinterpret_cast<THCPEvent*>(e.ptr())->cuda_event;
}

inline at::cuda::CUDAStream stream_of(const py::handle& s) {
  TORCH_CHECK(py::isinstance(s, torch_type("_CudaStreamBase")), "megatron_ep: expected a torch.cuda.Stream");
  return reinterpret_cast<THCPStream*>(s.ptr())->cuda_stream;
}

// What a dispatch's handle keeps for the calls along its routing (IntranodeState's tensors and
// sizes), bound once when the first call along it needs them.
struct HandleState {
  Tensor topk_idx, rank_pos, slot_pos, recv_info, row_limits;
  Tensor counts;  // [L + 1] int64: tokens_per_expert, then num_dropped (one copy per cached dispatch)
  Tensor tokens_per_expert, num_dropped;  // views of counts
  Tensor own;     // until the first dispatch: where the handle's own copy of notify's counts goes (the
                  // first dispatch returns notify's to the caller), made with the rest of its state
  c10::optional<Tensor> comb_map;
  int T = 0, K = 0, E = 0;
  bool permute = false;

  void keep_counts(const Tensor& c) {
    const int64_t L = c.numel() - 1;
    counts = c, tokens_per_expert = head(c, L), num_dropped = element(c, L);
  }
};

// The streams of one call: ours after `previous` (an event the caller passed) or after everything
// the caller queued so far; at leave(), `event` recorded on ours, and the caller's stream after it
// unless asynchronous.
class CallStreams {
 public:
  // entered=true: the caller already ordered the streams (a new routing's notify ran first)
  CallStreams(Runtime& rt, const py::handle& previous, bool entered)
      : rt_(rt), compute_(c10::cuda::getCurrentCUDAStream()), comm_(rt.comm()) {
    if (entered) return;
    if (!previous.is_none())
      event_of(previous, "previous_event").block(comm_);
    else
      rt.order(compute_.stream(), comm_.stream());
  }
  // an output hook wrote on the caller's stream: ours waits for it
  void after_caller() { rt_.order(compute_.stream(), comm_.stream()); }
  const at::cuda::CUDAStream& comm() const { return comm_; }
  const at::cuda::CUDAStream& compute() const { return compute_; }

  // `event`: the caller's torch.cuda.Event for an asynchronous call (recorded at its end); a
  // synchronous one passes None and the caller's stream waits through the runtime's own event (a
  // new torch event per call would cost an event creation and destruction of host time each)
  void leave(const py::handle& event, bool async_op, const std::vector<const Tensor*>& used) {
    if (!async_op) {
      // the caller's stream waits right away, so what it frees afterwards is reused in stream
      // order: no use needs recording
      rt_.order(comm_.stream(), compute_.stream());
      return;
    }
    // (also under capture: a block freed there would otherwise go back to the graph's pool while
    // our kernels read it)
    for (const Tensor* t : used)
      if (t != nullptr && t->defined()) t->record_stream(comm_);
    event_of(event, "the call's event").record(comm_);
  }

 private:
  Runtime& rt_;
  at::cuda::CUDAStream compute_, comm_;
};

// Benchmarks' phase marks: `marks` is None or a list of torch.cuda.Event / None, recorded on the
// current stream at phase `i`'s end.
inline void mark(const py::handle& marks, size_t i) {
  if (marks.is_none()) return;
  const py::list l = py::reinterpret_borrow<py::list>(marks);
  if (i < l.size() && !l[i].is_none()) event_of(l[i], "a mark").record(c10::cuda::getCurrentCUDAStream());
}

inline const Tensor* opt_ptr(const c10::optional<Tensor>& t) { return t.has_value() ? &*t : nullptr; }

// The output hook (tests: megatron_ep.hooks) on every output, on the caller's stream; true if it ran.
inline bool apply_hook(const py::handle& hook, const std::vector<const Tensor*>& outs) {
  if (hook.is_none()) return false;
  for (const Tensor* t : outs)
    if (t != nullptr && t->defined()) hook(*t);
  return true;
}

}  // namespace mep
