// megatron_ep._C_ll: the low-latency path's torch binding. Adapts tensors to the raw-pointer
// launchers of csrc/kernels/low_latency.cu and owns one rank's NVSHMEM buffer (its peers'
// addresses, the mapped error record). Python (megatron_ep/paths/low_latency.py) checks every
// argument first; the checks here only guard against memory errors.
#include <c10/cuda/CUDAStream.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>

#include <vector>

#include "kernels/low_latency.h"
#include "protocol.h"

namespace mep {
namespace {

void cuda_ok(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "megatron_ep low-latency: ", what, ": ", cudaGetErrorString(e));
}

template <typename T>
T* ptr(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), name, " must be a contiguous CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  return static_cast<T*>(t.data_ptr());
}

py::dict layout_dict(const LowLatencyLayout& l) {
  py::dict d;
  d["num_ranks"] = l.num_ranks, d["num_experts"] = l.num_experts, d["max_tokens"] = l.max_tokens;
  d["hidden"] = l.hidden, d["max_topk"] = l.max_topk, d["fp8_only"] = (bool)l.fp8_only;
  d["d_msg"] = l.d_msg, d["c_row"] = l.c_row, d["set_bytes"] = l.set_bytes, d["total"] = l.total;
  d["d_recv"] = l.d_recv, d["c_recv"] = l.c_recv, d["d_count"] = l.d_count, d["c_flag"] = l.c_flag;
  d["release"] = l.release, d["state"] = l.state;
  return d;
}

}  // namespace

class LowLatencyBuffer {
 public:
  // Collective over every PE: allocates the symmetric buffer (plan: num_experts, max_tokens,
  // hidden, max_topk, fp8_only) and maps each rank's PE id to a load/store address when reachable.
  LowLatencyBuffer(int device, int rank, std::vector<int> pes, int num_experts, int max_tokens, int hidden,
                   int max_topk, bool fp8_only, double timeout_s) {
    const int R = (int)pes.size();
    TORCH_CHECK(R >= 1 && R <= kLLMaxRanks, "megatron_ep low-latency: ", R, " ranks; at most ", kLLMaxRanks);
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    ctx_.lay = LowLatencyLayout::plan(R, num_experts, max_tokens, hidden, max_topk, fp8_only);
    ctx_.rank = rank, ctx_.num_ranks = R;
    ctx_.timeout_ns = (unsigned long long)(timeout_s * 1e9);
    ll_touch_kernels();
    base_ = static_cast<char*>(sym_malloc((size_t)ctx_.lay.total));
    ctx_.base = base_;
    std::vector<char*> peers(R);
    for (int r = 0; r < R; ++r) peers[r] = static_cast<char*>(sym_peer_ptr(base_, pes[r]));
    p2p_.resize(R);
    for (int r = 0; r < R; ++r) p2p_[r] = peers[r] != nullptr;
    cuda_ok(cudaMalloc(&peer_dev_, R * sizeof(char*)), "cudaMalloc");
    cuda_ok(cudaMalloc(&pe_dev_, R * sizeof(int)), "cudaMalloc");
    cuda_ok(cudaMemcpy(peer_dev_, peers.data(), R * sizeof(char*), cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda_ok(cudaMemcpy(pe_dev_, pes.data(), R * sizeof(int), cudaMemcpyHostToDevice), "cudaMemcpy");
    ctx_.peer_base = peer_dev_, ctx_.pe = pe_dev_;
    cuda_ok(cudaHostAlloc(&err_host_, sizeof(LowLatencyError), cudaHostAllocMapped), "cudaHostAlloc");
    std::memset((void*)err_host_, 0, sizeof(LowLatencyError));
    cuda_ok(cudaHostGetDevicePointer((void**)&ctx_.err, (void*)err_host_, 0), "cudaHostGetDevicePointer");
  }

  ~LowLatencyBuffer() { release_local(); }

  void dispatch(const torch::Tensor& x, const torch::Tensor& topk_idx, int num_experts, bool fp8, bool round_scale,
                int set, int phases, long long sig, const torch::Tensor& out_x, const c10::optional<torch::Tensor>& out_scales,
                const torch::Tensor& out_count, const torch::Tensor& out_range, const torch::Tensor& out_src,
                const torch::Tensor& out_slot, int num_blocks) {
    live();
    LLDispatchArgs a{};
    a.x = ptr<at::BFloat16>(x, "x", at::kBFloat16);
    a.topk_idx = reinterpret_cast<const long long*>(ptr<int64_t>(topk_idx, "topk_idx", at::kLong));
    a.T = (int)x.size(0), a.K = (int)topk_idx.size(1), a.E = num_experts, a.H = (int)x.size(1);
    a.fp8 = fp8, a.round_scale = round_scale, a.set = set, a.phases = phases, a.sig = sig;
    check_call(a.T, a.K, a.E, a.H, set, num_blocks);
    a.out_x = out_x.data_ptr();
    TORCH_CHECK(out_x.is_contiguous() && out_x.dim() == 3 && out_x.size(2) == a.H, "out_x must be [L, cap, H]");
    a.out_scales = fp8 ? ptr<float>(out_scales.value(), "out_scales", at::kFloat) : nullptr;
    a.out_count = ptr<int>(out_count, "out_count", at::kInt);
    a.out_range = ptr<int>(out_range, "out_range", at::kInt);
    a.out_src = ptr<int>(out_src, "out_src", at::kInt);
    a.out_slot = ptr<int>(out_slot, "out_slot", at::kInt);
    a.out_cap = (int)out_x.size(1);
    TORCH_CHECK(a.out_cap <= ctx_.num_ranks * ctx_.lay.max_tokens, "out_x has more rows per expert than the buffer");
    launch_ll_dispatch(ctx_, a, num_blocks, c10::cuda::getCurrentCUDAStream().stream());
  }

  void combine(const torch::Tensor& x, const torch::Tensor& range, const torch::Tensor& src, const torch::Tensor& slot,
               const torch::Tensor& topk_idx, const torch::Tensor& weights, int num_experts, int set, int phases,
               long long sig, const torch::Tensor& y, int num_blocks) {
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
    a.out_cap = (int)x.size(1), a.set = set, a.phases = phases, a.sig = sig;
    check_call(a.T, a.K, a.E, a.H, set, num_blocks);
    TORCH_CHECK(y.size(0) == a.T && y.size(1) == a.H, "out must be [T, H]");
    launch_ll_combine(ctx_, a, num_blocks, c10::cuda::getCurrentCUDAStream().stream());
  }

  // The kernels' first unread error, or None.
  py::object error() const {
    if (err_host_ == nullptr || err_host_->code == 0) return py::none();
    py::dict d;
    d["code"] = (int)err_host_->code, d["op"] = (int)err_host_->op, d["what"] = (int)err_host_->what;
    d["expert"] = (int)err_host_->expert, d["peer"] = (int)err_host_->peer, d["set"] = (int)err_host_->set;
    d["sig_expected"] = (long long)err_host_->sig_expected, d["sig_got"] = (long long)err_host_->sig_got;
    return d;
  }
  void clear_error() {
    if (err_host_ == nullptr) return;
    err_host_->code = 0;
    err_host_->cleared = err_host_->cleared + 1;  // lets the kernels claim the record again
  }

  std::vector<bool> p2p() const { return p2p_; }
  py::dict layout() const { return layout_dict(ctx_.lay); }

  // Collective (nvshmem_free).
  void close() {
    if (base_ == nullptr) return;
    sym_free(base_);
    base_ = nullptr;
    release_local();
  }

 private:
  void live() const { TORCH_CHECK(base_ != nullptr, "megatron_ep: this low-latency buffer was closed"); }
  void check_call(int T, int K, int E, int H, int set, int num_blocks) const {
    const LowLatencyLayout& l = ctx_.lay;
    TORCH_CHECK(T <= l.max_tokens && K <= l.max_topk && E <= l.num_experts && E % l.num_ranks == 0 && H <= l.hidden,
                "megatron_ep low-latency: the call (T ", T, ", K ", K, ", E ", E, ", H ", H, ") exceeds the buffer");
    TORCH_CHECK(set == 0 || set == 1, "buffer set must be 0 or 1");
    TORCH_CHECK(num_blocks >= 1 && num_blocks <= kLLMaxBlocks, "num_blocks must be in 1..", kLLMaxBlocks);
  }
  void release_local() {
    if (peer_dev_ != nullptr) cudaFree(peer_dev_);
    if (pe_dev_ != nullptr) cudaFree(pe_dev_);
    if (err_host_ != nullptr) cudaFreeHost((void*)err_host_);
    peer_dev_ = nullptr, pe_dev_ = nullptr, err_host_ = nullptr;
  }

  LLCtx ctx_{};
  char* base_ = nullptr;
  char** peer_dev_ = nullptr;
  int* pe_dev_ = nullptr;
  LowLatencyError* err_host_ = nullptr;
  std::vector<bool> p2p_;
};

void bind_internode(py::module_& m);  // csrc/internode_bindings.cpp

}  // namespace mep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ep NVSHMEM paths: low-latency (csrc/kernels/low_latency.cu), internode RDMA domain (csrc/kernels/internode.cu)";
  mep::bind_internode(m);
  m.attr("THREADS") = mep::kLLThreads;
  m.attr("MAX_BLOCKS") = mep::kLLMaxBlocks;
  m.attr("MAX_RANKS") = mep::kLLMaxRanks;
  m.attr("HEADER_BYTES") = mep::kLLHeader;
  m.attr("SEND") = (int)mep::kLLSend;
  m.attr("RECV") = (int)mep::kLLRecv;
  m.def("plan", [](int num_ranks, int num_experts, int max_tokens, int hidden, int max_topk, bool fp8_only) {
    return mep::layout_dict(mep::LowLatencyLayout::plan(num_ranks, num_experts, max_tokens, hidden, max_topk, fp8_only));
  }, "The buffer layout and size (bytes, both sets) for this capacity; no GPU needed.");
  m.def("unique_id", [] { return py::bytes(mep::sym_unique_id()); });
  m.def("init", [](py::bytes uid, int rank, int nranks, int device) { mep::sym_init(std::string(uid), rank, nranks, device); });
  m.def("my_pe", &mep::sym_my_pe);
  m.def("n_pes", &mep::sym_n_pes);
  py::class_<mep::LowLatencyBuffer>(m, "LowLatencyBuffer")
      .def(py::init<int, int, std::vector<int>, int, int, int, int, bool, double>())
      .def("dispatch", &mep::LowLatencyBuffer::dispatch)
      .def("combine", &mep::LowLatencyBuffer::combine)
      .def("error", &mep::LowLatencyBuffer::error)
      .def("clear_error", &mep::LowLatencyBuffer::clear_error)
      .def("p2p", &mep::LowLatencyBuffer::p2p)
      .def("layout", &mep::LowLatencyBuffer::layout)
      .def("close", &mep::LowLatencyBuffer::close);
}
