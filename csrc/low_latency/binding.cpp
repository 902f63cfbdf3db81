// megatron_ep._C_nvshmem: the low-latency path's torch binding. Adapts tensors to the raw-pointer
// launchers of csrc/low_latency/ and holds one rank's NVSHMEM buffer (its peers'
// addresses, the mapped error record: csrc/nvshmem/symmetric_memory.h). Python
// (megatron_ep/backends/cuda/paths/low_latency.py) checks every argument first; the checks here only guard
// against memory errors.
#include <c10/cuda/CUDAStream.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <vector>

#include "low_latency/api.h"
#include "common/protocol.h"
#include "nvshmem/symmetric_memory.h"
#include "common/tensor_args.h"

namespace mep {
namespace {

py::dict layout_dict(const LowLatencyLayout& l) {
  py::dict d;
  d["num_ranks"] = l.num_ranks, d["num_experts"] = l.num_experts, d["max_tokens"] = l.max_tokens;
  d["hidden"] = l.hidden, d["max_topk"] = l.max_topk, d["fp8_only"] = (bool)l.fp8_only;
  d["d_msg"] = l.d_msg, d["c_row"] = l.c_row, d["set_bytes"] = l.set_bytes, d["total"] = l.total;
  d["d_rows"] = l.d_rows, d["d_table"] = l.d_table, d["c_recv"] = l.c_recv, d["d_count"] = l.d_count, d["c_flag"] = l.c_flag;
  d["release"] = l.release, d["state"] = l.state;
  return d;
}

}  // namespace

class LowLatencyBuffer {
 public:
  // Collective over every PE: allocates the symmetric buffer (plan: num_experts, max_tokens,
  // hidden, max_topk, fp8_only) and maps each rank's PE id to a load/store address when reachable.
  // shrink: the rank mask is on (a wait that times out masks its peer instead of failing).
  LowLatencyBuffer(int device, int rank, std::vector<int> pes, int num_experts, int max_tokens, int hidden,
                   int max_topk, bool fp8_only, double timeout_s, bool shrink) {
    const int R = (int)pes.size();
    TORCH_CHECK(R >= 1 && R <= kLLMaxRanks, "megatron_ep low-latency: ", R, " ranks; at most ", kLLMaxRanks);
    cuda_ok(cudaSetDevice(device), "low-latency", "cudaSetDevice");
    ctx_.lay = LowLatencyLayout::plan(R, num_experts, max_tokens, hidden, max_topk, fp8_only);
    ctx_.rank = rank, ctx_.num_ranks = R;
    ctx_.timeout_ns = (unsigned long long)(timeout_s * 1e9);
    ctx_.shrink = shrink ? 1 : 0;
    ll_touch_kernels();
    mem_.open((size_t)ctx_.lay.total, pes, true);
    mem_.point(ctx_);
  }

  void dispatch(const torch::Tensor& x, const torch::Tensor& topk_idx, int num_experts, bool fp8, bool round_scale,
                int set, int phases, long long sig, long long seq, const torch::Tensor& out_x, const c10::optional<torch::Tensor>& out_scales,
                const torch::Tensor& out_count, const torch::Tensor& out_range,
                const c10::optional<torch::Tensor>& out_layout, const torch::Tensor& out_src,
                const torch::Tensor& out_slot, const c10::optional<torch::Tensor>& weights,
                const c10::optional<torch::Tensor>& out_w, const c10::optional<torch::Tensor>& out_pairs,
                const c10::optional<torch::Tensor>& out_ue8m0, const c10::optional<torch::Tensor>& recv_stats,
                const c10::optional<torch::Tensor>& wait_stats, int num_blocks) {
    live();
    LLDispatchArgs a{};
    a.x = ptr<at::BFloat16>(x, "x", at::kBFloat16);
    a.topk_idx = reinterpret_cast<const long long*>(ptr<int64_t>(topk_idx, "topk_idx", at::kLong));
    a.T = (int)x.size(0), a.K = (int)topk_idx.size(1), a.E = num_experts, a.H = (int)x.size(1);
    a.fp8 = fp8, a.round_scale = round_scale, a.set = set, a.phases = phases, a.sig = sig, a.seq = seq;
    check_call(a.T, a.K, a.E, a.H, set, num_blocks);
    a.out_x = out_x.data_ptr();
    TORCH_CHECK(out_x.is_contiguous() && out_x.dim() == 3 && out_x.size(2) == a.H, "out_x must be [L, cap, H]");
    TORCH_CHECK(!(out_scales.has_value() && out_ue8m0.has_value()), "out_scales and out_ue8m0 are exclusive");
    TORCH_CHECK(!fp8 || out_scales.has_value() || (out_ue8m0.has_value() && round_scale && a.H % 512 == 0),
                "fp8 needs out_scales, or out_ue8m0 with round_scale and H % 512 == 0");
    a.out_scales = fp8 && out_scales.has_value() ? ptr<float>(*out_scales, "out_scales", at::kFloat) : nullptr;
    if (fp8 && out_ue8m0.has_value()) {  // [L, H/512, cap] int32 storage (the column-major view's)
      TORCH_CHECK(out_ue8m0->numel() == out_x.size(0) * (a.H / 512) * out_x.size(1), "out_ue8m0 must have L * H/512 * cap elements");
      a.out_ue8m0 = ptr<int>(*out_ue8m0, "out_ue8m0", at::kInt);
    }
    a.out_count = ptr<int>(out_count, "out_count", at::kInt);
    a.out_range = ptr<int>(out_range, "out_range", at::kInt);
    if (out_layout.has_value()) {
      TORCH_CHECK(out_layout->numel() * 2 == out_range.numel(), "out_layout must be [L, R]");
      a.out_layout = reinterpret_cast<long long*>(ptr<int64_t>(*out_layout, "out_layout", at::kLong));
    }
    a.out_src = ptr<int>(out_src, "out_src", at::kInt);
    a.out_slot = ptr<int>(out_slot, "out_slot", at::kInt);
    a.out_cap = (int)out_x.size(1);
    TORCH_CHECK(a.out_cap <= ctx_.num_ranks * ctx_.lay.max_tokens, "out_x has more rows per expert than the buffer");
    if (weights.has_value()) {  // the merged combine's inputs
      TORCH_CHECK(out_w.has_value() && out_pairs.has_value(), "weights need out_w and out_pairs");
      TORCH_CHECK(weights->numel() == (int64_t)a.T * a.K && out_w->numel() == out_src.numel() &&
                      out_pairs->numel() == (int64_t)a.out_cap * a.K, "weights / out_w / out_pairs sizes");
      a.weights = ptr<float>(*weights, "topk_weights", at::kFloat);
      a.out_w = ptr<float>(*out_w, "out_w", at::kFloat);
      a.out_pairs = ptr<int>(*out_pairs, "out_pairs", at::kInt);
    }
    if (recv_stats.has_value()) {
      TORCH_CHECK(recv_stats->numel() == out_x.size(0), "recv_stats must have one entry per local expert");
      a.recv_stats = ptr<int>(*recv_stats, "cumulative_local_expert_recv_stats", at::kInt);
    }
    a.wait_stats = rank_stats(wait_stats, "dispatch_wait_recv_cost_stats");
    launch_ll_dispatch(ctx_, a, num_blocks, c10::cuda::getCurrentCUDAStream().stream());
  }

  void combine(const torch::Tensor& x, const torch::Tensor& range, const torch::Tensor& src, const torch::Tensor& slot,
               const torch::Tensor& topk_idx, const torch::Tensor& weights, int num_experts, int set, int phases,
               long long sig, long long seq, const torch::Tensor& y, const c10::optional<torch::Tensor>& pairs,
               const c10::optional<torch::Tensor>& row_w, const c10::optional<torch::Tensor>& wait_stats, bool use_logfmt,
               int num_blocks) {
    live();
    LLCombineArgs a{};
    a.x = ptr<at::BFloat16>(x, "x", at::kBFloat16);
    a.range = ptr<int>(range, "layout_range", at::kInt);
    a.src = ptr<int>(src, "src_token", at::kInt);
    a.slot = ptr<int>(slot, "src_slot", at::kInt);
    a.topk_idx = reinterpret_cast<const long long*>(ptr<int64_t>(topk_idx, "topk_idx", at::kLong));
    a.weights = ptr<float>(weights, "topk_weights", at::kFloat);
    a.y = ptr<at::BFloat16>(y, "out", at::kBFloat16);
    a.T = (int)topk_idx.size(0), a.K = (int)topk_idx.size(1), a.E = num_experts, a.H = (int)x.size(2);
    a.out_cap = (int)x.size(1), a.set = set, a.phases = phases, a.sig = sig, a.seq = seq;
    a.use_logfmt = use_logfmt ? 1 : 0;
    check_call(a.T, a.K, a.E, a.H, set, num_blocks);
    TORCH_CHECK(!use_logfmt || a.H % 128 == 0, "use_logfmt: hidden must be a multiple of 128");
    TORCH_CHECK(y.size(0) == a.T && y.size(1) == a.H, "out must be [T, H]");
    if (pairs.has_value()) {  // merged: the dispatch carried the weights
      TORCH_CHECK(row_w.has_value() && pairs->numel() == (int64_t)a.out_cap * a.K && row_w->numel() == src.numel(),
                  "pairs / row_w sizes");
      a.pairs = ptr<int>(*pairs, "pairs", at::kInt);
      a.row_w = ptr<float>(*row_w, "row_w", at::kFloat);
    }
    a.wait_stats = rank_stats(wait_stats, "combine_wait_recv_cost_stats");
    launch_ll_combine(ctx_, a, num_blocks, c10::cuda::getCurrentCUDAStream().stream());
  }

  // A dispatch's host side in one crossing: its outputs, allocated here on the current stream (as
  // torch.empty would), then -- with `launch` -- its launch. Returns (out_x, out_scales, out_ue8m0,
  // count, layout_range, DeepEP's packed layout_range, src_token, src_slot, row_w, pairs), None where
  // the call has none; the receive half of a call launched with phases = SEND later goes through
  // dispatch() with them.
  // `launch` is off only when a test's output hook must see the outputs before any kernel.
  py::tuple dispatch_call(const torch::Tensor& x, const torch::Tensor& topk_idx, int num_experts, bool fp8,
                          bool round_scale, bool ue8m0, int set, int phases, long long sig, long long seq,
                          int max_tokens, const c10::optional<torch::Tensor>& weights,
                          const c10::optional<torch::Tensor>& recv_stats, const c10::optional<torch::Tensor>& wait_stats,
                          int num_blocks, bool launch) {
    live();
    const int R = ctx_.num_ranks, H = (int)x.size(1), K = (int)topk_idx.size(1);
    TORCH_CHECK(num_experts % R == 0 && max_tokens >= 1 && max_tokens <= ctx_.lay.max_tokens,
                "megatron_ep low-latency: bad num_experts or max_tokens_per_rank");
    const int64_t L = num_experts / R, cap = (int64_t)R * max_tokens;
    const auto i32 = x.options().dtype(at::kInt);
    const torch::Tensor out_x = at::empty({L, cap, H}, x.options().dtype(fp8 ? at::kFloat8_e4m3fn : at::kBFloat16));
    c10::optional<torch::Tensor> out_s, out_ue8m0, row_w, pairs;
    if (fp8 && !ue8m0) out_s = at::empty({L, cap, H / 128}, x.options().dtype(at::kFloat));
    if (ue8m0) out_ue8m0 = at::empty({L, H / 512, cap}, i32);  // the caller takes its column-major view
    // the counts and what the handle keeps in one allocation (tensor_args.h arena_tensors): small,
    // and they die with the handle (the counts are a few bytes beside them)
    // (the layout twice: ours, and DeepEP's packed form for megatron_ep.deep_ep, written by the same stores)
    std::vector<ArenaPart> parts{{at::kInt, {L}}, {at::kInt, {L, R, 2}}, {at::kLong, {L, R}}, {at::kInt, {L, cap}},
                                 {at::kInt, {L, cap}}};
    if (weights.has_value())  // they ride with the copies: the combine merges a token's copies per rank
      parts.insert(parts.end(), {{at::kFloat, {L, cap}}, {at::kInt, {(int64_t)R, (int64_t)max_tokens, (int64_t)K}}});
    const std::vector<torch::Tensor> small = arena_tensors(parts, x.options());
    const torch::Tensor &count = small[0], &range = small[1], &packed = small[2], &src = small[3], &slot = small[4];
    if (weights.has_value()) row_w = small[5], pairs = small[6];  // (stale entries of pairs are checked)
    if (launch)
      dispatch(x, topk_idx, num_experts, fp8, round_scale, set, phases, sig, seq, out_x, out_s, count, range, packed, src,
               slot, weights, row_w, pairs, out_ue8m0, recv_stats, wait_stats, num_blocks);
    const auto opt = [](const c10::optional<torch::Tensor>& t) { return t.has_value() ? py::cast(*t) : py::none(); };
    return py::make_tuple(out_x, opt(out_s), opt(out_ue8m0), count, range, packed, src, slot, opt(row_w), opt(pairs));
  }

  // A combine's host side in one crossing: y allocated here on the current stream unless given, then
  // the launch; returns y.
  torch::Tensor combine_call(const torch::Tensor& x, const torch::Tensor& range, const torch::Tensor& src,
                             const torch::Tensor& slot, const torch::Tensor& topk_idx, const torch::Tensor& weights,
                             int num_experts, int set, int phases, long long sig, long long seq,
                             const c10::optional<torch::Tensor>& out, const c10::optional<torch::Tensor>& pairs,
                             const c10::optional<torch::Tensor>& row_w, const c10::optional<torch::Tensor>& wait_stats,
                             bool use_logfmt, int num_blocks) {
    const torch::Tensor y = out.has_value() ? *out : at::empty({topk_idx.size(0), x.size(2)}, x.options());
    combine(x, range, src, slot, topk_idx, weights, num_experts, set, phases, sig, seq, y, pairs, row_w, wait_stats,
            use_logfmt, num_blocks);
    return y;
  }

  // This rank failed before joining call `seq` (its host raised first): tell every peer, whose
  // waits on it in that call stop and report kErrPeerFailed naming this rank, instead of waiting
  // for the timeout.
  void publish_failure(long long seq) {
    mem_.publish_aside([&](cudaStream_t s) { launch_ll_publish_failure(ctx_, seq, s); });
  }

  // The rank mask (a buffer made with shrink), on the current stream.
  void barrier() {
    live();
    needs_mask();
    launch_ll_barrier(ctx_, c10::cuda::getCurrentCUDAStream().stream());
  }
  void set_mask(int rank, bool masked) {
    live();
    needs_mask();
    TORCH_CHECK(rank >= 0 && rank < ctx_.num_ranks, "rank ", rank, " outside the group's ", ctx_.num_ranks, " ranks");
    launch_ll_mask(ctx_, kLLMaskSet, rank, masked ? 1 : 0, nullptr, c10::cuda::getCurrentCUDAStream().stream());
  }
  void query_mask(const torch::Tensor& out) {
    live();
    needs_mask();
    TORCH_CHECK(out.is_cuda() && out.numel() == ctx_.num_ranks, "mask_status must have one entry per rank on the GPU");
    launch_ll_mask(ctx_, kLLMaskQuery, -1, 0, ptr<int>(out, "mask_status", at::kInt),
                   c10::cuda::getCurrentCUDAStream().stream());
  }
  void clear_mask() {
    live();
    needs_mask();
    launch_ll_mask(ctx_, kLLMaskClear, -1, 0, nullptr, c10::cuda::getCurrentCUDAStream().stream());
  }

  // The kernels' first unread error, or None.
  py::object error() const { return mem_.error("expert", "set"); }
  long long error_address() const { return mem_.error_address(); }
  void clear_error() { mem_.clear_error(); }

  // Attach (or with None detach) the kernels' trace stamps: int64 [2, MAX_BLOCKS, TRACE_POINTS] on
  // this device, zeroed by the caller before each traced call (the stamps take the max).
  void set_trace(const c10::optional<torch::Tensor>& trace) {
    if (trace.has_value()) {
      TORCH_CHECK(trace->is_cuda() && trace->scalar_type() == at::kLong && trace->is_contiguous() &&
                      trace->numel() == 2LL * kLLMaxBlocks * kLLTracePoints,
                  "trace must be a contiguous int64 CUDA tensor of [2, ", kLLMaxBlocks, ", ", (int)kLLTracePoints, "]");
    }
    trace_ = trace.has_value() ? *trace : torch::Tensor();
    ctx_.trace = trace.has_value() ? reinterpret_cast<unsigned long long*>(trace_.data_ptr()) : nullptr;
  }

  std::vector<bool> p2p() const { return mem_.p2p(); }
  py::dict layout() const { return layout_dict(ctx_.lay); }

  void close() { mem_.close(); }  // collective (nvshmem_free)

 private:
  void live() const { mem_.live(); }
  void needs_mask() const { TORCH_CHECK(ctx_.shrink, "megatron_ep low-latency: this buffer was made without the rank mask"); }
  // An optional [R] int64 statistics tensor the kernel adds to, or null.
  long long* rank_stats(const c10::optional<torch::Tensor>& t, const char* name) const {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->numel() == ctx_.num_ranks, name, " must have one entry per rank");
    return reinterpret_cast<long long*>(ptr<int64_t>(*t, name, at::kLong));
  }
  void check_call(int T, int K, int E, int H, int set, int num_blocks) const {
    const LowLatencyLayout& l = ctx_.lay;
    TORCH_CHECK(T <= l.max_tokens && K <= l.max_topk && E <= l.num_experts && E % l.num_ranks == 0 && H <= l.hidden,
                "megatron_ep low-latency: the call (T ", T, ", K ", K, ", E ", E, ", H ", H, ") exceeds the buffer");
    TORCH_CHECK(set == 0 || set == 1, "buffer set must be 0 or 1");
    TORCH_CHECK(num_blocks >= 1 && num_blocks <= kLLMaxBlocks, "num_blocks must be in 1..", kLLMaxBlocks);
  }

  LLCtx ctx_{};
  torch::Tensor trace_;  // keeps the attached trace alive
  SymmetricMemory mem_{"low-latency"};
};

void bind_low_latency(py::module_& m) {
  m.attr("THREADS") = mep::kLLThreads;
  m.attr("MAX_BLOCKS") = mep::kLLMaxBlocks;
  m.attr("MAX_RANKS") = mep::kLLMaxRanks;
  m.attr("HEADER_BYTES") = mep::kLLHeader;
  m.attr("SEND") = (int)mep::kLLSend;
  m.attr("RECV") = (int)mep::kLLRecv;
  m.attr("TRACE_POINTS") = (int)mep::kLLTracePoints;
  m.attr("TRACE_POINT_NAMES") = [] {
    py::tuple names((size_t)mep::kLLTracePoints);
    for (int i = 0; i < mep::kLLTracePoints; ++i) names[i] = mep::kLLTraceNames[i];
    return names;
  }();
  m.def("plan", [](int num_ranks, int num_experts, int max_tokens, int hidden, int max_topk, bool fp8_only) {
    return mep::layout_dict(mep::LowLatencyLayout::plan(num_ranks, num_experts, max_tokens, hidden, max_topk, fp8_only));
  }, "The buffer layout and size (bytes, both sets) for this capacity; no GPU needed.");
  py::class_<mep::LowLatencyBuffer>(m, "LowLatencyBuffer")
      .def(py::init<int, int, std::vector<int>, int, int, int, int, bool, double, bool>())
      .def("dispatch", &mep::LowLatencyBuffer::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("num_experts"), py::arg("fp8"), py::arg("round_scale"), py::arg("set"), py::arg("phases"), py::arg("sig"), py::arg("seq"), py::arg("out_x"), py::arg("out_scales"), py::arg("out_count"), py::arg("out_range"), py::arg("out_layout"), py::arg("out_src"), py::arg("out_slot"), py::arg("weights"), py::arg("out_w"), py::arg("out_pairs"), py::arg("out_ue8m0"), py::arg("recv_stats"), py::arg("wait_stats"), py::arg("num_blocks"))
      .def("combine", &mep::LowLatencyBuffer::combine, py::arg("x"), py::arg("range"), py::arg("src"), py::arg("slot"), py::arg("topk_idx"), py::arg("weights"), py::arg("num_experts"), py::arg("set"), py::arg("phases"), py::arg("sig"), py::arg("seq"), py::arg("y"), py::arg("pairs"), py::arg("row_w"), py::arg("wait_stats"), py::arg("use_logfmt"), py::arg("num_blocks"))
      .def("dispatch_call", &mep::LowLatencyBuffer::dispatch_call)
      .def("combine_call", &mep::LowLatencyBuffer::combine_call)
      .def("publish_failure", &mep::LowLatencyBuffer::publish_failure, py::arg("seq"))
      .def("barrier", &mep::LowLatencyBuffer::barrier)
      .def("set_mask", &mep::LowLatencyBuffer::set_mask, py::arg("rank"), py::arg("masked"))
      .def("query_mask", &mep::LowLatencyBuffer::query_mask, py::arg("out"))
      .def("clear_mask", &mep::LowLatencyBuffer::clear_mask)
      .def("error", &mep::LowLatencyBuffer::error)
      .def("error_address", &mep::LowLatencyBuffer::error_address)
      .def("clear_error", &mep::LowLatencyBuffer::clear_error)
      .def("set_trace", &mep::LowLatencyBuffer::set_trace, py::arg("trace").none(true))
      .def("p2p", &mep::LowLatencyBuffer::p2p)
      .def("layout", &mep::LowLatencyBuffer::layout)
      .def("close", &mep::LowLatencyBuffer::close);
}

}  // namespace mep
