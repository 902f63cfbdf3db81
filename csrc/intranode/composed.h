// The intranode one-crossing entries another extension composes: _C_nvshmem's internode entries
// call them (a new routing's between the RDMA hop and the receive area's release; a cached
// dispatch's and a combine's with the fused kernel's launch as a C++ function, so the intranode
// stage's launch record goes to it directly, not through Python). _C publishes them as a capsule (the entries' addresses)
// and _C_nvshmem reads it once, so neither library links the other and the two build apart.
// Defined in intranode/binding.cpp.
#pragma once

#include <functional>

#include "intranode/calls.h"

namespace mep {

// the intranode push's launch record -> the internode fused dispatch kernel's launch
using FusedDispatch = std::function<void(const IntranodeDispatch&)>;
// the intranode combine's launch record, its output y (and the weights) -> the fused combine's launch
using FusedCombine = std::function<void(const IntranodeCombine&, const Tensor&, const c10::optional<Tensor>&)>;

struct ComposedApi {
  int version;  // kComposedApiVersion of the _C that filled it
  // dispatch_first_call, as it is: a new routing's notify, its host wait and the rows moved
  py::tuple (*dispatch_first_call)(Runtime& rt, const Sig& sig, const Tensor& topk_idx, int E, int align, bool permute,
                                   int groups, bool check, bool want_rank_counts, long long tag,
                                   const py::object& previous, const py::object& notify_marks, double wait_s,
                                   bool fits, const Tensor& data, const c10::optional<Tensor>& scales,
                                   const c10::optional<Tensor>& topk_w, bool push, bool scratch, bool zero_copy,
                                   const py::object& event, bool async_op, const py::object& hook,
                                   const py::object& marks, int num_blocks, int push_blocks, int local_blocks,
                                   bool want_src);
  // dispatch_call (its arguments, in its order) with the push replaced by `fused` (want_src must be
  // false: the fused kernel writes no source tokens)
  py::tuple (*dispatch_call_with)(Runtime& rt, HandleState& st, const Sig& sig, bool first, const Tensor& data,
                                  const c10::optional<Tensor>& scales, const c10::optional<Tensor>& topk_w, bool push,
                                  bool scratch, bool zero_copy, int out_rows, int worst, int comb_rows,
                                  const py::object& previous, const py::object& event, bool async_op,
                                  const py::object& hook, const py::object& marks, int num_blocks, int push_blocks,
                                  int local_blocks, bool want_src, const FusedDispatch& fused);
  // combine_call (its arguments, in its order) with the intranode combine replaced by `fused` (no
  // biases: the internode sum over nodes adds them)
  py::tuple (*combine_call_with)(Runtime& rt, const HandleState& st, const Sig& sig, const Tensor& x,
                                 const c10::optional<Tensor>& weights, const c10::optional<Tensor>& bias0,
                                 const c10::optional<Tensor>& bias1, int variant, bool zero_copy,
                                 const c10::optional<Tensor>& out_y, const c10::optional<Tensor>& out_w,
                                 const py::object& previous, const py::object& event, bool async_op,
                                 const py::object& hook, const py::object& marks, int num_blocks, int local_blocks,
                                 const FusedCombine& fused);
};

// (changes whenever ComposedApi or an entry's arguments change: the two libraries must agree)
constexpr int kComposedApiVersion = 2;
constexpr const char* kComposedApiName = "megatron_ep._C._composed_api";

// _C's entries, read from its capsule at the first use (importing megatron_ep._C if needed);
// static, so its cached pointer is each library's own (calls.h, torch_type, says why).
static inline const ComposedApi& composed_api() {
  static const ComposedApi* api = [] {
    py::module_::import("megatron_ep._C");  // (the capsule is read through the package's attribute)
    const auto* a = static_cast<const ComposedApi*>(PyCapsule_Import(kComposedApiName, 0));
    if (a == nullptr) throw py::error_already_set();
    TORCH_CHECK(a->version == kComposedApiVersion, "megatron_ep: _C's composed entries are version ", a->version,
                ", _C_nvshmem was built for ", kComposedApiVersion, " (rebuild both from one tree)");
    return a;
  }();
  return *api;
}

}  // namespace mep
