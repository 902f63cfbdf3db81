// `megatron_ep._protocol`: the protocol and region layout of csrc/common/protocol.h and
// csrc/ipc/region_layout.h, for Python. No CUDA and no torch, so it builds and imports everywhere
// (CI included); Python reads every offset, size, slot and field name from here instead of
// restating them.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "ipc/region_layout.h"

namespace py = pybind11;
using namespace mep;

namespace {

// Every sizing hint by its Python name: plan() reads them, REGION_HINTS gives each one's default.
template <typename F>
void for_each_hint(RegionHints& h, F f) {
  f("num_ranks", h.num_ranks);
  f("max_tokens", h.max_tokens);
  f("hidden", h.hidden);
  f("max_topk", h.max_topk);
  f("max_experts", h.max_experts);
  f("dtype_bytes", h.dtype_bytes);
  f("combine_bytes", h.combine_bytes);
  f("max_alignment", h.max_alignment);
  f("combine_rows", h.combine_rows);
  f("pool_bytes", h.pool_bytes);
}

RegionLayout plan(const py::dict& hints) {
  RegionHints h;
  for_each_hint(h, [&](const char* k, auto& field) {
    if (hints.contains(k) && !hints[k].is_none()) field = hints[k].cast<std::decay_t<decltype(field)>>();
  });
  return plan_region(h);
}

template <typename F>
py::dict names(int n, F name) {
  py::dict d;
  for (int i = 0; i < n; ++i) d[py::int_(i)] = name(i);
  return d;
}

}  // namespace

PYBIND11_MODULE(_protocol, m) {
  m.doc() = "megatron_ep call protocol and region layout (csrc/common/protocol.h, csrc/ipc/region_layout.h)";
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_TOPK") = kMaxTopk;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_ALIGNMENT") = kMaxAlignment;
  m.attr("MAX_NOTIFY_BLOCKS") = kMaxNotifyBlocks;
  m.attr("MAX_TOKEN_GROUPS") = kMaxTokenGroups;
  m.attr("NOTIFY_WARPS") = kNotifyWarps;
  m.attr("NOTIFY_SCRATCH_ROWS") = kScratchRows;
  m.attr("MSG_BYTES") = kMsgBytes;
  m.attr("FP8_BLOCK") = kFp8Block;
  m.attr("CONTROL_BYTES") = (long long)sizeof(Control);
  m.attr("HOST_INFO_BYTES") = (long long)sizeof(HostInfo);
  m.attr("NUM_SIG_FIELDS") = (int)kSigFields;
  m.attr("SIG_FIELDS") = [] {
    py::list l;
    for (int f = 0; f < kSigFields; ++f) l.append(sig_field_name(f));
    return l;
  }();
  m.attr("SLOTS") = names(kNumSlots + 1, slot_name);
  m.attr("OPS") = names(kOpLowLatencyBarrier + 1, [](int i) { return op_name(i); });
  py::dict slots;
  slots["call"] = (int)kSlotCall; slots["staged"] = (int)kSlotStaged; slots["dispatch_done"] = (int)kSlotDispatchDone;
  slots["combine_done"] = (int)kSlotCombDone; slots["out_loc"] = (int)kSlotOutLoc; slots["push_done"] = (int)kSlotPushDone;
  m.attr("SLOT") = slots;
  py::dict ops;
  ops["dispatch"] = (int)kOpDispatch; ops["cached_dispatch"] = (int)kOpCachedDispatch; ops["combine"] = (int)kOpCombine;
  ops["low_latency_dispatch"] = (int)kOpLowLatencyDispatch; ops["low_latency_combine"] = (int)kOpLowLatencyCombine;
  ops["low_latency_barrier"] = (int)kOpLowLatencyBarrier;
  m.attr("OP") = ops;
  py::dict dtypes;
  dtypes["bfloat16"] = (int)kDtypeBf16; dtypes["float32"] = (int)kDtypeFp32; dtypes["float8_e4m3fn"] = (int)kDtypeFp8;
  dtypes["float64"] = (int)kDtypeFp64;
  m.attr("DTYPE") = dtypes;
  py::dict errs;
  errs["none"] = (int)kErrNone;
  errs["timeout"] = (int)kErrTimeout; errs["peer_aborted"] = (int)kErrPeerAborted; errs["mismatch"] = (int)kErrMismatch;
  errs["peer_failed"] = (int)kErrPeerFailed;
  m.attr("ERROR") = errs;
  m.attr("CALL_FAILED") = (int)kCallFailed;
  m.attr("COMBINE_VARIANTS") = py::make_tuple((int)kCombineStaged, (int)kCombinePartials, (int)kCombineSingle);
  py::dict ri;
  ri["rows"] = RecvInfo::kRows; ri["perm_rows"] = RecvInfo::kPermRows; ri["local"] = RecvInfo::kLocal;
  ri["dropped"] = RecvInfo::kDropped; ri["header"] = RecvInfo::kHeader;
  m.attr("RECV_INFO") = ri;
  // The region layout as a typed, read-only object: every field of MEP_REGION_LAYOUT_FIELDS an
  // attribute (byte offsets and sizes, capacities), so Python reads `layout.comb_x`, not a key.
  auto layout = py::class_<RegionLayout>(m, "RegionLayout", "One rank's communication region, as plan_region placed it");
#define MEP_FIELD(type, name) layout.def_readonly(#name, &RegionLayout::name);
  MEP_REGION_LAYOUT_FIELDS(MEP_FIELD)
#undef MEP_FIELD
  layout.def("__repr__", [](const RegionLayout& l) {
    std::string s = "RegionLayout(";
#define MEP_FIELD(type, name) s += std::string(#name) + "=" + std::to_string(l.name) + ", ";
    MEP_REGION_LAYOUT_FIELDS(MEP_FIELD)
#undef MEP_FIELD
    s.resize(s.size() - 2);
    return s + ")";
  });
  m.attr("REGION_LAYOUT_FIELDS") = [] {
    py::list names;
#define MEP_FIELD(type, name) names.append(#name);
    MEP_REGION_LAYOUT_FIELDS(MEP_FIELD)
#undef MEP_FIELD
    return names;
  }();
  m.attr("REGION_HINTS") = [] {
    RegionHints h;
    py::dict d;
    for_each_hint(h, [&](const char* k, auto& v) { d[k] = v; });
    return d;
  }();
  m.def("plan_region", &plan, py::arg("hints"), "Sizes and offsets of a region planned from these hints");
  m.def("worst_expert_major_rows", &worst_expert_major_rows, py::arg("num_ranks"), py::arg("max_tokens"),
        py::arg("topk"), py::arg("num_experts"), py::arg("alignment"));
  m.def("error_is_fatal", &error_is_fatal);
  m.def("notify_plan", [](int T, int groups) {
    const NotifyPlan p = notify_plan(T, groups);
    py::dict d;
    d["groups"] = p.groups, d["blocks"] = p.blocks, d["chunks"] = p.chunks, d["chunk"] = p.chunk;
    d["scratch_rows"] = notify_scratch_rows(p);
    return d;
  }, py::arg("num_tokens"), py::arg("groups"), "notify's chunk plan (csrc/ipc/region_layout.h): blocks, chunks, "
     "tokens per chunk, scratch rows");
}
