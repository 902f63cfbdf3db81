// The internode path's RDMA-domain buffer for megatron_ep._C_nvshmem (registered by
// low_latency/binding.cpp, the module's one PYBIND11_MODULE). Adapts tensors to the launchers
// of csrc/internode/kernels.cu and holds one rank's symmetric buffer, its same-index peers'
// addresses and the mapped error record (csrc/nvshmem/symmetric_memory.h). Python (megatron_ep/backends/cuda/paths/internode.py) checks every
// argument first; the checks here only guard against memory errors.
#include <c10/cuda/CUDAStream.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>
#include <string>
#include <vector>

#include "internode/api.h"
#include "intranode/composed.h"
#include "common/protocol.h"
#include "nvshmem/symmetric_memory.h"
#include "common/tensor_args.h"

namespace mep {
// the intranode stage's notify takes one token group per source node
static_assert(kInternodeMaxNodes <= kMaxTokenGroups, "more nodes than notify token groups");

namespace {

py::dict layout_dict(const InternodeLayout& l) {
  py::dict d;
  d["num_nodes"] = l.num_nodes, d["max_tokens"] = l.max_tokens, d["max_topk"] = l.max_topk, d["staged"] = (bool)l.staged;
  d["x_row"] = l.x_row, d["scale_cols"] = l.scale_cols, d["c_row"] = l.c_row;
  d["d_x"] = l.d_x, d["d_s"] = l.d_s, d["d_idx"] = l.d_idx, d["d_w"] = l.d_w, d["c_y"] = l.c_y, d["c_w"] = l.c_w;
  d["s_x"] = l.s_x, d["s_s"] = l.s_s, d["s_idx"] = l.s_idx, d["s_w"] = l.s_w, d["s_y"] = l.s_y, d["s_cw"] = l.s_cw;
  d["total"] = l.total;
  return d;
}

}  // namespace

class InternodeBuffer {
 public:
  // Collective over every PE. `pes`: the PE of the same-index rank of each node (node order).
  InternodeBuffer(int device, int node, int local, int ranks_per_node, std::vector<int> pes, int max_tokens,
                  int max_topk, long long x_row, long long scale_cols, long long c_row, bool staged, double timeout_s) {
    const int N = (int)pes.size();
    TORCH_CHECK(N >= 1 && N <= kInternodeMaxNodes, "megatron_ep internode: ", N, " nodes; at most ", kInternodeMaxNodes);
    cuda_ok(cudaSetDevice(device), "internode", "cudaSetDevice");
    ctx_.lay = InternodeLayout::plan(N, max_tokens, max_topk, x_row, scale_cols, c_row, staged);
    ctx_.node = node, ctx_.local = local, ctx_.ranks_per_node = ranks_per_node;
    ctx_.timeout_ns = (unsigned long long)(timeout_s * 1e9);
    ctx_.seq = -1;
    internode_touch_kernels();
    mem_.open((size_t)ctx_.lay.total, pes, !staged);  // staged: every transfer is a put (from symmetric staging)
    mem_.point(ctx_);
  }

  // Bytes [offset, offset + nbytes) of this rank's buffer as a uint8 tensor (Python views it with
  // its dtype and shape); valid until close().
  torch::Tensor view(long long offset, long long nbytes) {
    live();
    TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset + nbytes <= ctx_.lay.total, "view outside the buffer");
    return torch::from_blob(mem_.base() + offset, {nbytes}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, device()));
  }

  void dispatch_send(const torch::Tensor& x, const c10::optional<torch::Tensor>& scales, const torch::Tensor& topk_idx,
                     const c10::optional<torch::Tensor>& weights, int num_experts, long long sig, int num_blocks) {
    live();
    const InternodeSendArgs a = send_args(x, scales, topk_idx, weights, num_experts, sig, num_blocks, true);
    launch_internode_dispatch_send(ctx_, a, num_blocks, stream());
  }

  // A cached dispatch in one crossing and one data kernel (csrc/internode/fused.cu): _C's
  // dispatch_call (its arguments first, in its order: the intranode stage over the forwarder's rows)
  // with its push replaced by this kernel, which sends send_x over RDMA and then pushes what
  // arrives as the intranode stage's launch record says. `seq`: set_call's.
  py::tuple dispatch_cached_call(Runtime& runtime, HandleState& state, const Sig& sig, bool first, const torch::Tensor& x,
                                 const c10::optional<torch::Tensor>& scales,
                                 const c10::optional<torch::Tensor>& topk_weights, bool push, bool scratch,
                                 bool zero_copy, int out_rows, int num_worst_tokens, int comb_rows,
                                 const py::object& previous_event, const py::object& event, bool async_op,
                                 const py::object& hook, const py::object& marks, int num_blocks, int push_blocks,
                                 int local_blocks, bool want_src, long long seq, const torch::Tensor& send_x,
                                 const c10::optional<torch::Tensor>& send_scales, const torch::Tensor& send_idx,
                                 const c10::optional<torch::Tensor>& send_weights, int num_experts, long long send_sig,
                                 int send_blocks) {
    live();
    ctx_.seq = seq;
    const InternodeSendArgs a = send_args(send_x, send_scales, send_idx, send_weights, num_experts, send_sig,
                                          send_blocks, false);
    const FusedDispatch fused = [&](const IntranodeDispatch& stage) {
      launch_internode_cached_dispatch(ctx_, a, stage, send_blocks, stream());
    };
    return composed_api().dispatch_call_with(runtime, state, sig, first, x, scales, topk_weights, push, scratch,
                                             zero_copy, out_rows, num_worst_tokens, comb_rows, previous_event, event,
                                             async_op, hook, marks, num_blocks, push_blocks, local_blocks, want_src,
                                             fused);
  }

  void dispatch_recv(int topk, int num_experts, long long sig, const torch::Tensor& out_idx,
                     const torch::Tensor& out_tokens, int num_blocks) {
    live();
    recv(topk, num_experts, sig, out_idx, out_tokens, num_blocks);
  }

  // A new routing in one crossing (one not worst-case sized): the RDMA send of send_x and the
  // receive of what the same-index peers sent, into the intranode stage's ids `topk_idx` and
  // `out_tokens` (on the caller's stream), then _C's dispatch_first_call (its arguments first, in
  // its order: the intranode stage over the forwarder's rows), and where that moved the rows (status
  // 0) the receive area's release after them on the communication stream. With status 1 (the host
  // grows the region first) the caller releases it after its dispatch_call. `seq`: set_call's.
  py::tuple dispatch_first_call(Runtime& runtime, const Sig& sig, const torch::Tensor& topk_idx, int num_experts,
                                int expert_alignment, bool permute, int token_groups, bool check_ids, bool rank_counts,
                                long long tag, const py::object& previous_event, const py::object& notify_marks,
                                double wait_s, bool fits, const torch::Tensor& x,
                                const c10::optional<torch::Tensor>& scales,
                                const c10::optional<torch::Tensor>& topk_weights, bool push, bool scratch,
                                bool zero_copy, const py::object& event, bool async_op, const py::object& hook,
                                const py::object& marks, int num_blocks, int push_blocks, int local_blocks,
                                bool want_src, long long seq, const torch::Tensor& send_x,
                                const c10::optional<torch::Tensor>& send_scales, const torch::Tensor& send_idx,
                                const c10::optional<torch::Tensor>& send_weights, int send_num_experts, long long send_sig,
                                const torch::Tensor& out_tokens, const py::object& rdma_marks, int send_blocks) {
    live();
    ctx_.seq = seq;
    const InternodeSendArgs a = send_args(send_x, send_scales, send_idx, send_weights, send_num_experts, send_sig,
                                          send_blocks, true);
    TORCH_CHECK(topk_idx.dim() == 2, "topk_idx must be [N * max_tokens, K]");
    launch_internode_dispatch_send(ctx_, a, send_blocks, stream());
    recv((int)topk_idx.size(1), send_num_experts, send_sig, topk_idx, out_tokens, send_blocks);
    mark(rdma_marks, 0);
    py::tuple out = composed_api().dispatch_first_call(
        runtime, sig, topk_idx, num_experts, expert_alignment, permute, token_groups, check_ids, rank_counts, tag,
        previous_event, notify_marks, wait_s, fits, x, scales, topk_weights, push, scratch, zero_copy, event, async_op,
        hook, marks, num_blocks, push_blocks, local_blocks, want_src);
    if (out[0].cast<int>() == 0) {  // the intranode stage has read the receive area
      c10::cuda::CUDAStreamGuard on_comm(runtime.comm());
      launch_internode_release(ctx_, kInternodeDispatch, stream());
    }
    return out;
  }

  // The call the next launches serve (the Buffer's call number, the same on every rank): a wait
  // in them stops at once when a peer publishes that it failed before joining that call.
  void set_call(long long seq) { ctx_.seq = seq; }

  // This rank failed before its RDMA send of call `seq` (its host raised first): tell every
  // same-index peer, whose waits on it in that call stop and report kErrPeerFailed naming this rank.
  void publish_failure(long long seq) {
    mem_.publish_aside([&](cudaStream_t s) { launch_internode_publish_failure(ctx_, seq, s); });
  }

  void release(int dir) {
    live();
    TORCH_CHECK(dir == kInternodeDispatch || dir == kInternodeCombine, "direction must be 0 or 1");
    launch_internode_release(ctx_, dir, stream());
  }

  // A combine in one crossing and one data kernel (csrc/internode/fused.cu): _C's combine_call (its
  // arguments first, in its order: the intranode combine into the forwarder's rows) with its launch
  // replaced by this kernel: the intranode combine as its launch record says, the RDMA send of
  // those rows, then the sum over nodes into y (and w), starting at the biases. `seq`: set_call's.
  py::tuple combine_call(Runtime& runtime, const HandleState& state, const Sig& sig, const torch::Tensor& x,
                         const c10::optional<torch::Tensor>& weights, const c10::optional<torch::Tensor>& bias0,
                         const c10::optional<torch::Tensor>& bias1, int variant, bool zero_copy,
                         const c10::optional<torch::Tensor>& out, const c10::optional<torch::Tensor>& out_weights,
                         const py::object& previous_event, const py::object& event, bool async_op,
                         const py::object& hook, const py::object& marks, int num_blocks, int local_blocks,
                         long long seq, const torch::Tensor& local_idx, const torch::Tensor& tokens, const torch::Tensor& topk_idx,
                         int num_experts, long long send_sig, const torch::Tensor& y,
                         const c10::optional<torch::Tensor>& w, const c10::optional<torch::Tensor>& sum_bias0,
                         const c10::optional<torch::Tensor>& sum_bias1, int send_blocks) {
    live();
    ctx_.seq = seq;
    const FusedCombine fused = [&](const IntranodeCombine& stage, const torch::Tensor& y_in,
                                   const c10::optional<torch::Tensor>& w_in) {
      combine_fused(stage, y_in, w_in, local_idx, tokens, topk_idx, num_experts, send_sig, y, w, sum_bias0, sum_bias1,
                    send_blocks);
    };
    return composed_api().combine_call_with(runtime, state, sig, x, weights, bias0, bias1, variant, zero_copy, out,
                                            out_weights, previous_event, event, async_op, hook, marks, num_blocks,
                                            local_blocks, fused);
  }

  // The kernels' first unread error, or None (the record's expert and set: node and direction).
  py::object error() const { return mem_.error("node", "direction"); }
  long long error_address() const { return mem_.error_address(); }
  void clear_error() { mem_.clear_error(); }
  std::vector<bool> p2p() const { return mem_.p2p(); }
  py::dict layout() const { return layout_dict(ctx_.lay); }

  void close() { mem_.close(); }  // collective (nvshmem_free)

 private:
  // combine_call's kernel: the intranode combine of record `stage` (its output: y_in, w_in, the
  // forwarder's rows), the RDMA send of those rows, then the sum over nodes into y (and w).
  void combine_fused(const IntranodeCombine& stage, const torch::Tensor& y_in, const c10::optional<torch::Tensor>& w_in,
                     const torch::Tensor& local_idx, const torch::Tensor& tokens, const torch::Tensor& topk_idx,
                     int num_experts, long long sig, const torch::Tensor& y, const c10::optional<torch::Tensor>& w,
                     const c10::optional<torch::Tensor>& bias0, const c10::optional<torch::Tensor>& bias1,
                     int num_blocks) {
    InternodeCombineSendArgs s{};
    TORCH_CHECK(y_in.is_cuda() && y_in.is_contiguous() && y_in.dim() == 2, "y_in must be a contiguous CUDA matrix");
    const long long rows = (long long)ctx_.lay.num_nodes * ctx_.lay.max_tokens;
    TORCH_CHECK(y_in.size(0) == rows && local_idx.size(0) == rows, "y_in and local_idx must have N * max_tokens rows");
    s.y = static_cast<const char*>(y_in.data_ptr());
    s.row_bytes = (int)(y_in.size(1) * y_in.element_size());
    s.local_idx = reinterpret_cast<const long long*>(ptr<int64_t>(local_idx, "local_idx", at::kLong));
    s.K = (int)local_idx.size(1);
    s.w = w_in ? ptr<float>(*w_in, "w_in", at::kFloat) : nullptr;
    s.tokens = ptr<int>(tokens, "tokens", at::kInt);
    s.sig = sig;
    TORCH_CHECK(s.row_bytes % 16 == 0 && s.row_bytes <= ctx_.lay.c_row, "combine rows of ", s.row_bytes, " bytes do not fit");
    check_call(0, s.K, 16, 0, num_blocks);

    InternodeCombineRecvArgs r{};
    r.topk_idx = reinterpret_cast<const long long*>(ptr<int64_t>(topk_idx, "topk_idx", at::kLong));
    r.T = (int)topk_idx.size(0), r.K = (int)topk_idx.size(1), r.E = num_experts, r.sig = sig;
    TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.size(0) == r.T, "y must be a contiguous [T, H] CUDA tensor");
    TORCH_CHECK(y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kFloat, "y must be bf16 or fp32");
    TORCH_CHECK(y.scalar_type() == y_in.scalar_type() && y.size(1) == y_in.size(1), "y and y_in differ in dtype or width");
    r.fp32 = y.scalar_type() == at::kFloat;
    r.H = (int)y.size(1);
    r.y = y.data_ptr();
    r.w = w ? ptr<float>(*w, "weights", at::kFloat) : nullptr;
    for (const auto* b : {&bias0, &bias1})
      TORCH_CHECK(!b->has_value() || ((*b)->is_cuda() && (*b)->is_contiguous() && (*b)->scalar_type() == y.scalar_type() &&
                                      (*b)->sizes() == y.sizes()),
                  "a combine bias must be contiguous, on the GPU, of y's shape and dtype");
    r.bias0 = bias0 ? bias0->data_ptr() : nullptr;
    r.bias1 = bias1 ? bias1->data_ptr() : nullptr;
    TORCH_CHECK((long long)r.H * y.element_size() <= ctx_.lay.c_row && r.H % 8 == 0, "combine rows do not fit");
    check_call(r.T, r.K, 16, 0, num_blocks);
    launch_internode_combine(ctx_, s, r, stage, num_blocks, stream());
  }

  void recv(int K, int num_experts, long long sig, const torch::Tensor& out_idx, const torch::Tensor& out_tokens,
            int num_blocks) {
    InternodeRecvArgs a{};
    a.K = K, a.E = num_experts, a.sig = sig;
    check_call(0, a.K, 16, 0, num_blocks);
    a.out_idx = reinterpret_cast<long long*>(ptr<int64_t>(out_idx, "out_idx", at::kLong));
    a.out_tokens = ptr<int>(out_tokens, "out_tokens", at::kInt);
    TORCH_CHECK(out_idx.numel() == (long long)ctx_.lay.num_nodes * ctx_.lay.max_tokens * K, "out_idx must be [N * max_tokens, K]");
    TORCH_CHECK(out_tokens.numel() == ctx_.lay.num_nodes, "out_tokens must be [N]");
    launch_internode_dispatch_recv(ctx_, a, num_blocks, stream());
  }
  int device() const {
    int d = 0;
    cudaGetDevice(&d);
    return d;
  }
  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
  void live() const { mem_.live(); }
  InternodeSendArgs send_args(const torch::Tensor& x, const c10::optional<torch::Tensor>& scales, const torch::Tensor& topk_idx,
                              const c10::optional<torch::Tensor>& weights, int num_experts, long long sig, int num_blocks,
                              bool ids) const {
    InternodeSendArgs a{};
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2, "x must be a contiguous [T, H] CUDA tensor");
    a.x = static_cast<const char*>(x.data_ptr());
    a.T = (int)x.size(0), a.row_bytes = (int)(x.size(1) * x.element_size());
    a.topk_idx = reinterpret_cast<const long long*>(ptr<int64_t>(topk_idx, "topk_idx", at::kLong));
    a.K = (int)topk_idx.size(1), a.E = num_experts, a.sig = sig, a.ids = ids ? 1 : 0;
    a.scales = scales ? ptr<float>(*scales, "scales", at::kFloat) : nullptr;
    a.scale_cols = scales ? (int)scales->size(1) : 0;
    a.weights = weights ? ptr<float>(*weights, "topk_weights", at::kFloat) : nullptr;
    check_call(a.T, a.K, a.row_bytes, a.scale_cols, num_blocks);
    TORCH_CHECK(topk_idx.size(0) == a.T, "topk_idx rows differ from x's");
    return a;
  }
  void check_call(int T, int K, long long row_bytes, int scale_cols, int num_blocks) const {
    const InternodeLayout& l = ctx_.lay;
    TORCH_CHECK(T <= l.max_tokens && K <= l.max_topk && K >= 1 && K <= kMaxTopk && row_bytes <= l.x_row &&
                    row_bytes % 16 == 0 && scale_cols <= l.scale_cols,
                "megatron_ep internode: the call (T ", T, ", K ", K, ", row bytes ", row_bytes, ", scale columns ",
                scale_cols, ") exceeds the buffer");
    TORCH_CHECK(num_blocks >= 1 && num_blocks <= kInternodeMaxBlocks, "num_blocks must be in 1..", kInternodeMaxBlocks);
  }

  InternodeCtx ctx_{};
  SymmetricMemory mem_{"internode"};
};

void bind_internode(py::module_& m) {
  m.attr("INTERNODE_THREADS") = kInternodeThreads;
  m.attr("INTERNODE_MAX_BLOCKS") = kInternodeMaxBlocks;
  m.attr("INTERNODE_MAX_NODES") = kInternodeMaxNodes;
  m.attr("COMPOSED_API_VERSION") = kComposedApiVersion;
  m.def("composed_api_version", [] { return composed_api().version; },
        "The version of _C's entries this module's internode path composes (intranode/composed.h); raises "
        "where _C has none or another one (the two built from different trees).");
  m.def("internode_plan", [](int num_nodes, int max_tokens, int max_topk, long long x_row, long long scale_cols,
                             long long c_row, bool staged) {
    return layout_dict(InternodeLayout::plan(num_nodes, max_tokens, max_topk, x_row, scale_cols, c_row, staged));
  }, "The internode RDMA-domain buffer's layout and size in bytes; no GPU needed.");
  py::class_<InternodeBuffer>(m, "InternodeBuffer")
      .def(py::init<int, int, int, int, std::vector<int>, int, int, long long, long long, long long, bool, double>())
      .def("view", &InternodeBuffer::view, py::arg("offset"), py::arg("nbytes"))
      .def("dispatch_send", &InternodeBuffer::dispatch_send, py::arg("x"), py::arg("scales"), py::arg("topk_idx"), py::arg("weights"), py::arg("num_experts"), py::arg("sig"), py::arg("num_blocks"))
      .def("dispatch_recv", &InternodeBuffer::dispatch_recv, py::arg("topk"), py::arg("num_experts"), py::arg("sig"), py::arg("out_idx"), py::arg("out_tokens"), py::arg("num_blocks"))
      .def("dispatch_first_call", &InternodeBuffer::dispatch_first_call, py::arg("runtime"), py::arg("sig"), py::arg("topk_idx"), py::arg("num_experts"), py::arg("expert_alignment"), py::arg("permute"), py::arg("token_groups"), py::arg("check_ids"), py::arg("rank_counts"), py::arg("tag"), py::arg("previous_event"), py::arg("notify_marks"), py::arg("wait_s"), py::arg("fits"), py::arg("x"), py::arg("scales"), py::arg("topk_weights"), py::arg("push"), py::arg("scratch"), py::arg("zero_copy"), py::arg("event"), py::arg("async_op"), py::arg("hook"), py::arg("marks"), py::arg("num_blocks"), py::arg("push_blocks"), py::arg("local_blocks"), py::arg("want_src"), py::arg("seq"), py::arg("send_x"), py::arg("send_scales"), py::arg("send_idx"), py::arg("send_weights"), py::arg("send_num_experts"), py::arg("send_sig"), py::arg("out_tokens"), py::arg("rdma_marks"), py::arg("send_blocks"))
      .def("release", &InternodeBuffer::release, py::arg("dir"))
      .def("set_call", &InternodeBuffer::set_call, py::arg("seq"))
      .def("publish_failure", &InternodeBuffer::publish_failure, py::arg("seq"))
      .def("dispatch_cached_call", &InternodeBuffer::dispatch_cached_call, py::arg("runtime"), py::arg("state"), py::arg("sig"), py::arg("first"), py::arg("x"), py::arg("scales"), py::arg("topk_weights"), py::arg("push"), py::arg("scratch"), py::arg("zero_copy"), py::arg("out_rows"), py::arg("num_worst_tokens"), py::arg("comb_rows"), py::arg("previous_event"), py::arg("event"), py::arg("async_op"), py::arg("hook"), py::arg("marks"), py::arg("num_blocks"), py::arg("push_blocks"), py::arg("local_blocks"), py::arg("want_src"), py::arg("seq"), py::arg("send_x"), py::arg("send_scales"), py::arg("send_idx"), py::arg("send_weights"), py::arg("num_experts"), py::arg("send_sig"), py::arg("send_blocks"))
      .def("combine_call", &InternodeBuffer::combine_call, py::arg("runtime"), py::arg("state"), py::arg("sig"), py::arg("x"), py::arg("weights"), py::arg("bias0"), py::arg("bias1"), py::arg("variant"), py::arg("zero_copy"), py::arg("out"), py::arg("out_weights"), py::arg("previous_event"), py::arg("event"), py::arg("async_op"), py::arg("hook"), py::arg("marks"), py::arg("num_blocks"), py::arg("local_blocks"), py::arg("seq"), py::arg("local_idx"), py::arg("tokens"), py::arg("topk_idx"), py::arg("num_experts"), py::arg("send_sig"), py::arg("y"), py::arg("w"), py::arg("sum_bias0"), py::arg("sum_bias1"), py::arg("send_blocks"))
      .def("error", &InternodeBuffer::error)
      .def("error_address", &InternodeBuffer::error_address)
      .def("clear_error", &InternodeBuffer::clear_error)
      .def("p2p", &InternodeBuffer::p2p)
      .def("layout", &InternodeBuffer::layout)
      .def("close", &InternodeBuffer::close);
}

}  // namespace mep
