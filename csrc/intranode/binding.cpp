// The intranode path's torch binding (module megatron_ep._C): the IPC runtime (ipc/runtime.h)
// and the intranode launchers, bound with named arguments in the submodule `_C.intranode`. It
// checks what the kernels assume (device, dtype, contiguity, sizes) with TORCH_CHECK, builds the
// kernel arguments and launches on the current stream (the caller makes that the buffer's
// communication stream). The only translation unit of _C that sees torch.

#include "intranode/api.h"
#include "ipc/runtime.h"

namespace mep {
namespace {

// ------------------------------------------------------------------------------ intranode path
using Sig = std::vector<long long>;

void notify(Runtime& rt, const Sig& sig, const Tensor& topk_idx, int E, int align, bool permute, int worst,
            Tensor& rank_pos, Tensor& slot_pos, Tensor& recv_info, Tensor& row_limits, Tensor& tpe, Tensor& dropped,
            long long tag, int groups, bool check, const c10::optional<Tensor>& rank_counts) {
  check_tensor(topk_idx, "topk_idx", at::kLong);
  check_tensor(rank_pos, "rank_pos", at::kInt);
  check_tensor(slot_pos, "slot_pos", at::kInt);
  check_tensor(recv_info, "recv_info", at::kInt);
  check_tensor(row_limits, "row_limits", at::kInt);
  check_tensor(tpe, "tokens_per_expert", at::kLong);
  check_tensor(dropped, "num_dropped", at::kLong);
  const int T = (int)topk_idx.size(0), K = (int)topk_idx.size(1), R = rt.num_ranks();
  TORCH_CHECK(K >= 1 && K <= kMaxTopk, "megatron_ep: topk ", K, " outside 1..", kMaxTopk);
  TORCH_CHECK(E >= R && E <= kMaxExperts && E % R == 0, "megatron_ep: bad num_experts ", E);
  TORCH_CHECK(align >= 1 && align <= kMaxAlignment, "megatron_ep: bad expert alignment ", align);
  TORCH_CHECK(groups >= 1 && groups <= kMaxTokenGroups && T % groups == 0 && (long long)groups * E <= kMaxExperts,
              "megatron_ep: ", groups, " token groups do not fit ", T, " tokens and ", E, " experts");
  TORCH_CHECK(notify_scratch_rows(notify_plan(T, groups)) <= kScratchRows, "notify plan exceeds the scratch");
  TORCH_CHECK(recv_info.numel() >= RecvInfo::size(E / R), "recv_info too small");
  TORCH_CHECK(rank_pos.numel() >= (int64_t)T * R && slot_pos.numel() >= (int64_t)T * K, "position tensors too small");
  TORCH_CHECK(row_limits.numel() >= R && tpe.numel() >= E / R && dropped.numel() >= 1, "notify outputs too small");
  if (rank_counts.has_value()) {
    check_tensor(*rank_counts, "rank_counts", at::kInt);
    TORCH_CHECK(rank_counts->numel() == (int64_t)groups * R * R, "rank_counts must hold groups * R x R counts");
  }
  const CallArgs call = make_call(sig, kCallOk, "");
  NotifyArgs a{static_cast<const long long*>(topk_idx.data_ptr()), T, K, E, align, permute ? 1 : 0, worst, groups,
               check ? 1 : 0,
               rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>(), recv_info.data_ptr<int>(), row_limits.data_ptr<int>(),
               reinterpret_cast<long long*>(tpe.data_ptr<int64_t>()), reinterpret_cast<long long*>(dropped.data_ptr<int64_t>()),
               tag, ptr_or_null<int>(rank_counts)};
  launch_notify(rt.ctx(call.sig[kSigSeq]), call, a, stream());
  check_launch("notify");
}

StageArgs stage_args(const Runtime& rt, const c10::optional<Tensor>& x, int T, int row_bytes,
                     const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
                     const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos) {
  const RegionLayout& l = rt.lay();
  TORCH_CHECK(T <= l.max_tokens, "megatron_ep: ", T, " tokens exceed the region's ", l.max_tokens);
  TORCH_CHECK(row_bytes <= l.x_row_bytes && row_bytes % 16 == 0, "megatron_ep: bad dispatch row size ", row_bytes);
  TORCH_CHECK(scale_cols <= l.scale_cols, "megatron_ep: too many scale columns");
  const int K = (int)topk_idx.size(1);
  TORCH_CHECK(K <= l.max_topk, "megatron_ep: topk exceeds the region's");
  return StageArgs{x.has_value() ? x->data_ptr() : nullptr, T, row_bytes, ptr_or_null<const float>(scales), scale_cols,
                   static_cast<const long long*>(topk_idx.data_ptr()), ptr_or_null<const float>(topk_w), K,
                   rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>()};
}

void stage(Runtime& rt, const Sig& sig, int slot, const c10::optional<Tensor>& x, int T, int row_bytes,
           const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
           const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos, int num_blocks) {
  const CallArgs call = make_call(sig, kCallOk, "");
  const StageArgs a = stage_args(rt, x, T, row_bytes, scales, scale_cols, topk_idx, topk_w, rank_pos, slot_pos);
  launch_stage(rt.ctx(call.sig[kSigSeq]), call, slot, a, num_blocks, stream());
  check_launch("stage");
}

DispatchArgs dispatch_args(int row_bytes, int scale_cols, int K, int E, bool permute, bool has_weights, int out_rows,
                           const Tensor& recv_info, Tensor& out_x, const c10::optional<Tensor>& out_scales,
                           const c10::optional<Tensor>& out_idx, const c10::optional<Tensor>& out_w,
                           const c10::optional<Tensor>& out_row_expert, const c10::optional<Tensor>& out_tpe,
                           const c10::optional<Tensor>& comb_map) {
  TORCH_CHECK(out_x.is_contiguous() && out_x.nbytes() >= (size_t)out_rows * row_bytes, "out_x too small");
  TORCH_CHECK(permute ? out_row_expert.has_value() : out_idx.has_value(), "missing index output");
  if (comb_map.has_value()) {
    check_tensor(*comb_map, "comb_map", at::kInt);
    TORCH_CHECK(permute && comb_map->dim() == 2 && comb_map->size(1) == K, "comb_map must be [rows, K] (expert-major)");
  }
  return DispatchArgs{row_bytes, scale_cols, K, E, permute ? 1 : 0, has_weights ? 1 : 0, out_rows,
                      recv_info.data_ptr<int>(), static_cast<char*>(out_x.data_ptr()), ptr_or_null<float>(out_scales),
                      ptr_or_null<long long>(out_idx), ptr_or_null<float>(out_w), ptr_or_null<int>(out_row_expert),
                      ptr_or_null<long long>(out_tpe), ptr_or_null<int>(comb_map)};
}

void dispatch(Runtime& rt, const Sig& sig, int slot, int row_bytes, int scale_cols, int K, int E, bool permute,
              bool has_weights, int out_rows, const Tensor& recv_info, Tensor& out_x,
              const c10::optional<Tensor>& out_scales, const c10::optional<Tensor>& out_idx,
              const c10::optional<Tensor>& out_w, const c10::optional<Tensor>& out_row_expert,
              const c10::optional<Tensor>& out_tpe, const c10::optional<Tensor>& comb_map, int num_blocks) {
  const DispatchArgs a = dispatch_args(row_bytes, scale_cols, K, E, permute, has_weights, out_rows, recv_info, out_x,
                                       out_scales, out_idx, out_w, out_row_expert, out_tpe, comb_map);
  launch_dispatch(rt.ctx(sig.at(kSigSeq)), slot, a, num_blocks, stream());
  check_launch("dispatch");
}

InnodeDispatch push_launch(Runtime& rt, const Sig& sig, int slot, const Tensor& x, int T, int row_bytes,
                           const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
                           const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos, int E,
                           int out_rows, bool permute, const Tensor& recv_info, Tensor& out_x,
                           const c10::optional<Tensor>& out_scales, const c10::optional<Tensor>& out_idx,
                           const c10::optional<Tensor>& out_w, const c10::optional<Tensor>& out_row_expert,
                           const c10::optional<Tensor>& comb_map, const std::vector<long long>& offsets) {
  TORCH_CHECK(offsets.size() == 4, "offsets: x, scales, idx, w");
  InnodeDispatch d{};
  d.call = make_call(sig, kCallOk, "");
  d.ctx = rt.ctx(d.call.sig[kSigSeq]);
  d.slot = slot;
  PushArgs& a = d.push;
  a.in = stage_args(rt, x, T, row_bytes, scales, scale_cols, topk_idx, topk_w, rank_pos, slot_pos);
  const int K = a.in.K;
  a.out = dispatch_args(row_bytes, scale_cols, K, E, permute, topk_w.has_value(), out_rows, recv_info, out_x, out_scales,
                        out_idx, out_w, out_row_expert, c10::nullopt, comb_map);
  a.out_x_off = offsets[0];
  a.out_s_off = offsets[1];
  a.out_idx_off = offsets[2];
  a.out_w_off = offsets[3];
  return d;
}

void dispatch_push(Runtime& rt, const Sig& sig, int slot, const Tensor& x, int T, int row_bytes,
                   const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
                   const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos, int E,
                   int out_rows, bool permute, const Tensor& recv_info, Tensor& out_x,
                   const c10::optional<Tensor>& out_scales, const c10::optional<Tensor>& out_idx,
                   const c10::optional<Tensor>& out_w, const c10::optional<Tensor>& out_row_expert,
                   const c10::optional<Tensor>& comb_map, std::vector<long long> offsets, int num_blocks) {
  const InnodeDispatch d = push_launch(rt, sig, slot, x, T, row_bytes, scales, scale_cols, topk_idx, topk_w, rank_pos,
                                       slot_pos, E, out_rows, permute, recv_info, out_x, out_scales, out_idx, out_w,
                                       out_row_expert, comb_map, offsets);
  launch_dispatch_push(d.ctx, d.call, d.slot, d.push, num_blocks, stream());
  check_launch("dispatch_push");
}

template <typename T>
py::bytes as_bytes(const T& v) {
  return py::bytes(reinterpret_cast<const char*>(&v), sizeof(T));
}

// The same push for the internode path's fused dispatch: its launch record, not launched.
py::bytes push_record(Runtime& rt, const Sig& sig, int slot, const Tensor& x, int T, int row_bytes,
                      const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
                      const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos, int E,
                      int out_rows, bool permute, const Tensor& recv_info, Tensor& out_x,
                      const c10::optional<Tensor>& out_scales, const c10::optional<Tensor>& out_idx,
                      const c10::optional<Tensor>& out_w, const c10::optional<Tensor>& out_row_expert,
                      const c10::optional<Tensor>& comb_map, std::vector<long long> offsets) {
  return as_bytes(push_launch(rt, sig, slot, x, T, row_bytes, scales, scale_cols, topk_idx, topk_w, rank_pos, slot_pos, E,
                              out_rows, permute, recv_info, out_x, out_scales, out_idx, out_w, out_row_expert, comb_map,
                              offsets));
}

// The pooled rank-major rows of an expert-major push (pool_rank_major's tensors; its int64 index
// columns hold (expert-major row, local expert) int32 pairs) into the expert-major outputs.
void fanout(Runtime& rt, const Sig& sig, const Tensor& rows, const c10::optional<Tensor>& scales, const Tensor& map,
            const c10::optional<Tensor>& w, int row_bytes, int scale_cols, int K, int E, bool has_weights, int out_rows,
            const Tensor& recv_info, Tensor& out_x, const c10::optional<Tensor>& out_scales,
            const c10::optional<Tensor>& out_w, const Tensor& out_row_expert, const Tensor& comb_map, int num_blocks) {
  TORCH_CHECK(map.scalar_type() == at::kLong && map.dim() == 2 && map.size(1) == K, "fanout: bad map");
  FanoutArgs a;
  a.out = dispatch_args(row_bytes, scale_cols, K, E, true, has_weights, out_rows, recv_info, out_x, out_scales,
                        c10::nullopt, out_w, out_row_expert, c10::nullopt, comb_map);
  a.rows = static_cast<const char*>(rows.data_ptr());
  a.scales = ptr_or_null<const float>(scales);
  a.map = static_cast<const int*>(map.data_ptr());
  a.w = ptr_or_null<const float>(w);
  launch_fanout(rt.ctx(sig.at(kSigSeq)), a, num_blocks, stream());
  check_launch("fanout");
}

// Expert-major combine, first half: the local pre-reduction into fp32 partials (replaces stage_combine).
CombineReduceArgs combine_reduce_args(Runtime& rt, const Tensor& x, int rows, int H, bool is_fp32, const Tensor& comb_map,
                                      const Tensor& recv_info, const c10::optional<Tensor>& w) {
  const RegionLayout& l = rt.lay();
  check_tensor(comb_map, "comb_map", at::kInt);
  TORCH_CHECK(x.is_contiguous() && x.size(0) == rows && x.size(1) == H, "combine_reduce: bad x");
  TORCH_CHECK(H % 4 == 0, "combine_reduce: hidden must be a multiple of 4");
  TORCH_CHECK(rows <= l.comb_rows, "megatron_ep: combine input has ", rows, " rows; the region holds ", l.comb_rows);
  TORCH_CHECK(comb_map.size(0) * H * 4 <= l.comb_rows * l.comb_row_bytes, "combine_reduce: the partials exceed the combine area");
  return CombineReduceArgs{x.data_ptr(), rows, H, is_fp32 ? 1 : 0, comb_map.data_ptr<int>(), recv_info.data_ptr<int>(),
                           (int)comb_map.size(1), ptr_or_null<const float>(w)};
}

void combine_reduce(Runtime& rt, const Sig& sig, const Tensor& x, int rows, int H, bool is_fp32, const Tensor& comb_map,
                    const Tensor& recv_info, const c10::optional<Tensor>& w, int num_blocks) {
  const CombineReduceArgs a = combine_reduce_args(rt, x, rows, H, is_fp32, comb_map, recv_info, w);
  const CallArgs call = make_call(sig, kCallOk, "");
  launch_combine_reduce(rt.ctx(call.sig[kSigSeq]), call, a, num_blocks, stream());
  check_launch("combine_reduce");
}

StageCombineArgs stage_combine_args(Runtime& rt, const c10::optional<Tensor>& x, int rows, int row_bytes,
                                    const c10::optional<Tensor>& w, int w_cols) {
  const RegionLayout& l = rt.lay();
  TORCH_CHECK(rows <= l.comb_rows, "megatron_ep: combine input has ", rows, " rows; the region holds ", l.comb_rows);
  TORCH_CHECK(row_bytes <= l.comb_row_bytes && row_bytes % 16 == 0, "megatron_ep: bad combine row size ", row_bytes);
  TORCH_CHECK(w_cols <= l.max_topk, "megatron_ep: combine weight columns exceed the region's");
  return StageCombineArgs{x.has_value() ? x->data_ptr() : nullptr, rows, row_bytes, ptr_or_null<const float>(w), w_cols};
}

void stage_combine(Runtime& rt, const Sig& sig, const c10::optional<Tensor>& x, int rows, int row_bytes,
                   const c10::optional<Tensor>& w, int w_cols, int num_blocks) {
  const StageCombineArgs a = stage_combine_args(rt, x, rows, row_bytes, w, w_cols);
  const CallArgs call = make_call(sig, kCallOk, "");
  launch_stage_combine(rt.ctx(call.sig[kSigSeq]), call, a, num_blocks, stream());
  check_launch("stage_combine");
}

CombineArgs combine_args(int T, int H, int K, int E, bool permute, bool is_fp32, bool has_weights, bool partials,
                         const Tensor& row_limits, const Tensor& topk_idx, const Tensor& rank_pos, const Tensor& slot_pos,
                         Tensor& y, const c10::optional<Tensor>& w_out) {
  check_tensor(topk_idx, "topk_idx", at::kLong);
  check_tensor(row_limits, "row_limits", at::kInt);
  TORCH_CHECK(y.is_contiguous() && y.size(0) == T && y.size(1) == H, "y has the wrong shape");
  return CombineArgs{T, H, K, E, permute ? 1 : 0, is_fp32 ? 1 : 0, has_weights ? 1 : 0, partials ? 1 : 0,
                     row_limits.data_ptr<int>(), static_cast<const long long*>(topk_idx.data_ptr()),
                     rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>(), y.data_ptr(), ptr_or_null<float>(w_out)};
}

void combine(Runtime& rt, const Sig& sig, int T, int H, int K, int E, bool permute, bool is_fp32, bool has_weights,
             bool partials, const Tensor& row_limits, const Tensor& topk_idx, const Tensor& rank_pos, const Tensor& slot_pos, Tensor& y,
             const c10::optional<Tensor>& w_out, int num_blocks) {
  const CombineArgs a = combine_args(T, H, K, E, permute, is_fp32, has_weights, partials, row_limits, topk_idx, rank_pos,
                                     slot_pos, y, w_out);
  launch_combine(rt.ctx(sig.at(kSigSeq)), a, num_blocks, stream());
  check_launch("combine");
}

// A whole in-node combine (its first half: stage, or the pre-reduction with `partials`; then the
// pull-and-sum into y) for the internode path's fused combine: its launch record, not launched.
py::bytes combine_record(Runtime& rt, const Sig& sig, const c10::optional<Tensor>& x, int rows, int row_bytes,
                         const c10::optional<Tensor>& weights, int weight_cols, bool partials,
                         const c10::optional<Tensor>& comb_map, const Tensor& recv_info, int T, int H, int K, int E,
                         bool permute, bool is_fp32, bool has_weights, const Tensor& row_limits, const Tensor& topk_idx,
                         const Tensor& rank_pos, const Tensor& slot_pos, Tensor& y, const c10::optional<Tensor>& w_out) {
  InnodeCombine d{};
  d.call = make_call(sig, kCallOk, "");
  d.ctx = rt.ctx(d.call.sig[kSigSeq]);
  d.partials = partials ? 1 : 0;
  if (partials) {
    TORCH_CHECK(comb_map.has_value() && x.has_value(), "combine_record: partials need x and comb_map");
    d.reduce = combine_reduce_args(rt, *x, rows, H, is_fp32, *comb_map, recv_info, weights);
  } else {
    d.stage = stage_combine_args(rt, x, rows, row_bytes, weights, weight_cols);
  }
  d.comb = combine_args(T, H, K, E, permute, is_fp32, has_weights, partials, row_limits, topk_idx, rank_pos, slot_pos, y,
                        w_out);
  return as_bytes(d);
}

void layout(const Tensor& topk_idx, int E, int R, Tensor& tokens_per_rank, Tensor& tokens_per_expert,
            Tensor& token_in_rank) {
  check_tensor(topk_idx, "topk_idx", at::kLong);
  check_tensor(tokens_per_rank, "tokens_per_rank", at::kLong);
  check_tensor(tokens_per_expert, "tokens_per_expert", at::kLong);
  check_tensor(token_in_rank, "token_in_rank", at::kBool);
  TORCH_CHECK(R >= 1 && R <= 32 && E % R == 0 && E <= 16384, "megatron_ep: layout needs 1 <= R <= 32 and R | E");
  c10::cuda::CUDAGuard guard(topk_idx.device());
  launch_layout(static_cast<const long long*>(topk_idx.data_ptr()), (int)topk_idx.size(0), (int)topk_idx.size(1), E, R,
                reinterpret_cast<long long*>(tokens_per_rank.data_ptr<int64_t>()), reinterpret_cast<long long*>(tokens_per_expert.data_ptr<int64_t>()),
                token_in_rank.data_ptr<bool>(), stream());
  check_launch("layout");
}

}  // namespace
}  // namespace mep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ep CUDA kernels: the shared runtime and the intranode normal path";
  m.attr("CONTROL_BYTES") = (long long)sizeof(mep::Control);
  m.attr("HOST_INFO_BYTES") = (long long)sizeof(mep::HostInfo);
  m.attr("NUM_SIG_FIELDS") = (int)mep::kSigFields;
  m.def("layout", &mep::layout, py::arg("topk_idx"), py::arg("E"), py::arg("R"), py::arg("tokens_per_rank"), py::arg("tokens_per_expert"), py::arg("token_in_rank"));
  py::class_<mep::Runtime>(m, "Runtime")
      .def(py::init([](int device, int rank, int num_ranks, const py::object& layout, double timeout_s) {
             auto rt = std::make_unique<mep::Runtime>(device, rank, num_ranks, layout, timeout_s);
             c10::cuda::CUDAGuard guard(device);
             mep::prepare_kernels();  // every intranode kernel resolved before the first call
             return rt;
           }),
           py::arg("device"), py::arg("rank"), py::arg("num_ranks"), py::arg("layout"), py::arg("timeout_s"))
      .def("ipc_handle", &mep::Runtime::ipc_handle)
      .def("open_peers", &mep::Runtime::open_peers)
      .def("close", &mep::Runtime::close)
      .def("view", &mep::Runtime::view)
      .def("base_ptr", &mep::Runtime::base_ptr)
      .def("host_tag", &mep::Runtime::host_tag)
      .def("wait_tag", &mep::Runtime::wait_tag, py::arg("tag"), py::arg("timeout_s"))
      .def("host_counts", &mep::Runtime::host_counts)
      .def("num_aborted", &mep::Runtime::num_aborted)
      .def("take_error", &mep::Runtime::take_error, py::arg("clear"))
      .def("fail_call", &mep::Runtime::fail_call)
      .def("pool_rank_major", &mep::Runtime::pool_rank_major)
      .def("rank_major_at", &mep::Runtime::rank_major_at)
      .def("pool_free_bytes", &mep::Runtime::pool_free_bytes)
      .def("pool_stats", &mep::Runtime::pool_stats);
  auto intra = m.def_submodule("intranode", "the intranode normal path (csrc/intranode/)");
  // argument names: the Python side's (megatron_ep/cuda/paths/intranode.py passes them by name)
  intra.def("notify", &mep::notify, py::arg("rt"), py::arg("sig"), py::arg("topk_idx"), py::arg("num_experts"), py::arg("expert_alignment"), py::arg("permute"), py::arg("num_worst_tokens"), py::arg("rank_pos"), py::arg("slot_pos"), py::arg("recv_info"), py::arg("row_limits"), py::arg("tokens_per_expert"), py::arg("num_dropped"), py::arg("tag"), py::arg("token_groups") = 1, py::arg("check_ids") = false, py::arg("rank_counts") = py::none());
  intra.def("stage", &mep::stage, py::arg("rt"), py::arg("sig"), py::arg("slot"), py::arg("x"), py::arg("num_tokens"), py::arg("row_bytes"), py::arg("scales"), py::arg("scale_cols"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("rank_pos"), py::arg("slot_pos"), py::arg("num_blocks"));
  intra.def("dispatch", &mep::dispatch, py::arg("rt"), py::arg("sig"), py::arg("slot"), py::arg("row_bytes"), py::arg("scale_cols"), py::arg("topk"), py::arg("num_experts"), py::arg("permute"), py::arg("has_weights"), py::arg("out_rows"), py::arg("recv_info"), py::arg("out_x"), py::arg("out_scales"), py::arg("out_topk_idx"), py::arg("out_weights"), py::arg("out_row_expert"), py::arg("out_tokens_per_expert"), py::arg("comb_map"), py::arg("num_blocks"));
  intra.def("dispatch_push", &mep::dispatch_push, py::arg("rt"), py::arg("sig"), py::arg("slot"), py::arg("x"), py::arg("num_tokens"), py::arg("row_bytes"), py::arg("scales"), py::arg("scale_cols"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("rank_pos"), py::arg("slot_pos"), py::arg("num_experts"), py::arg("out_rows"), py::arg("permute"), py::arg("recv_info"), py::arg("out_x"), py::arg("out_scales"), py::arg("out_topk_idx"), py::arg("out_weights"), py::arg("out_row_expert"), py::arg("comb_map"), py::arg("offsets"), py::arg("num_blocks"));
  intra.def("fanout", &mep::fanout, py::arg("rt"), py::arg("sig"), py::arg("x"), py::arg("scales"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("row_bytes"), py::arg("scale_cols"), py::arg("topk"), py::arg("num_experts"), py::arg("has_weights"), py::arg("out_rows"), py::arg("recv_info"), py::arg("out_x"), py::arg("out_scales"), py::arg("out_weights"), py::arg("out_row_expert"), py::arg("comb_map"), py::arg("num_blocks"));
  intra.def("push_record", &mep::push_record, py::arg("rt"), py::arg("sig"), py::arg("slot"), py::arg("x"), py::arg("num_tokens"), py::arg("row_bytes"), py::arg("scales"), py::arg("scale_cols"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("rank_pos"), py::arg("slot_pos"), py::arg("num_experts"), py::arg("out_rows"), py::arg("permute"), py::arg("recv_info"), py::arg("out_x"), py::arg("out_scales"), py::arg("out_topk_idx"), py::arg("out_weights"), py::arg("out_row_expert"), py::arg("comb_map"), py::arg("offsets"));
  intra.def("combine_record", &mep::combine_record, py::arg("rt"), py::arg("sig"), py::arg("x"), py::arg("rows"), py::arg("row_bytes"), py::arg("weights"), py::arg("weight_cols"), py::arg("partials"), py::arg("comb_map"), py::arg("recv_info"), py::arg("num_tokens"), py::arg("hidden"), py::arg("topk"), py::arg("num_experts"), py::arg("permute"), py::arg("is_fp32"), py::arg("has_weights"), py::arg("row_limits"), py::arg("topk_idx"), py::arg("rank_pos"), py::arg("slot_pos"), py::arg("y"), py::arg("out_weights"));
  intra.attr("INNODE_DISPATCH_BYTES") = (long long)sizeof(mep::InnodeDispatch);
  intra.attr("INNODE_COMBINE_BYTES") = (long long)sizeof(mep::InnodeCombine);
  intra.def("combine_reduce", &mep::combine_reduce, py::arg("rt"), py::arg("sig"), py::arg("x"), py::arg("rows"), py::arg("hidden"), py::arg("is_fp32"), py::arg("comb_map"), py::arg("recv_info"), py::arg("weights"), py::arg("num_blocks"));
  intra.def("stage_combine", &mep::stage_combine, py::arg("rt"), py::arg("sig"), py::arg("x"), py::arg("rows"), py::arg("row_bytes"), py::arg("weights"), py::arg("weight_cols"), py::arg("num_blocks"));
  intra.def("combine", &mep::combine, py::arg("rt"), py::arg("sig"), py::arg("num_tokens"), py::arg("hidden"), py::arg("topk"), py::arg("num_experts"), py::arg("permute"), py::arg("is_fp32"), py::arg("has_weights"), py::arg("partials"), py::arg("row_limits"), py::arg("topk_idx"), py::arg("rank_pos"), py::arg("slot_pos"), py::arg("y"), py::arg("out_weights"), py::arg("num_blocks"));
}
