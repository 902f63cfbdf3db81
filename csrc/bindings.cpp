// Python binding: the only translation unit that sees torch. It checks what the kernels assume
// (device, dtype, contiguity, sizes) with TORCH_CHECK, builds the kernel context, and launches
// on the current stream (the caller makes that the buffer's communication stream).

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <memory>

#include "kernels/api.h"
#include "pool.h"
#include "region.h"

namespace py = pybind11;
using torch::Tensor;

namespace mep {
namespace {

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "megatron_ep: launch of ", what, " failed: ", cudaGetErrorString(err));
}

void check_tensor(const Tensor& t, const char* name, c10::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

template <typename T>
T* ptr_or_null(const c10::optional<Tensor>& t) {
  return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

class Runtime {
 public:
  Runtime(int device, int rank, int num_ranks, const py::dict& layout, double timeout_s) {
    TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "megatron_ep: group size ", num_ranks, " is outside 1..", kMaxRanks);
    auto get = [&](const char* k) { return layout[k].cast<long long>(); };
    lay_.counts = get("counts");
    lay_.stage_x = get("stage_x");
    lay_.stage_scales = get("stage_scales");
    lay_.stage_idx = get("stage_idx");
    lay_.stage_w = get("stage_w");
    lay_.stage_rpos = get("stage_rpos");
    lay_.stage_spos = get("stage_spos");
    lay_.comb_x = get("comb_x");
    lay_.comb_w = get("comb_w");
    lay_.total = get("total");
    lay_.max_tokens = (int)get("max_tokens");
    lay_.max_topk = (int)get("max_topk");
    lay_.max_experts = (int)get("max_experts");
    lay_.x_row_bytes = (int)get("x_row_bytes");
    lay_.scale_cols = (int)get("scale_cols");
    lay_.comb_rows = (int)get("comb_rows");
    lay_.comb_row_bytes = (int)get("comb_row_bytes");
    rank_ = rank;
    num_ranks_ = num_ranks;
    timeout_ns_ = (unsigned long long)(timeout_s * 1e9);
    c10::cuda::CUDAGuard guard(device);
    region_ = std::make_shared<Region>(device, lay_.total);
    pool_ = std::make_shared<Pool>(device, get("pool"), get("pool_bytes"));
    prepare_kernels();
  }

  // Rank-major dispatch outputs for `rows` rows in the pool: (x, scales, idx, w, offsets...),
  // or None when the pool has no room. The tensors share one block, returned to the pool (on
  // `stream`, the caller's) when the last of them dies.
  py::object pool_rank_major(int rows, int hidden, py::object x_dtype, int row_bytes, int scale_cols, int K, bool has_w,
                             long long stream_ptr) {
    auto align = [](long long n) { return (n + Pool::kAlign - 1) / Pool::kAlign * Pool::kAlign; };
    const long long bx = align((long long)rows * row_bytes), bs = align((long long)rows * scale_cols * 4);
    const long long bi = align((long long)rows * K * 8), bw = has_w ? align((long long)rows * K * 4) : 0;
    const long long total = bx + bs + bi + bw;
    const long long off = pool_->alloc(total);
    if (off < 0) return py::none();
    struct Owner {  // returns the block when the last tensor over it dies (never copied)
      std::shared_ptr<Pool> pool;
      std::shared_ptr<Region> region;
      long long off, bytes;
      cudaStream_t stream;
      Owner(std::shared_ptr<Pool> p, std::shared_ptr<Region> r, long long o, long long b, cudaStream_t s)
          : pool(std::move(p)), region(std::move(r)), off(o), bytes(b), stream(s) {}
      Owner(const Owner&) = delete;
      Owner& operator=(const Owner&) = delete;
      ~Owner() { pool->release(off, bytes, stream); }
    };
    auto owner = std::make_shared<Owner>(pool_, region_, off, total, reinterpret_cast<cudaStream_t>(stream_ptr));
    auto make = [&](long long o, std::vector<int64_t> shape, at::ScalarType st) {
      auto opts = torch::TensorOptions().dtype(st).device(torch::kCUDA, region_->device());
      return torch::from_blob(region_->base() + o, shape, [owner](void*) {}, opts);
    };
    const auto xt = torch::python::detail::py_object_to_dtype(x_dtype);
    Tensor x = make(off, {rows, hidden}, xt);
    py::object s = scale_cols > 0 ? py::cast(make(off + bx, {rows, scale_cols}, at::kFloat)) : py::none();
    Tensor idx = make(off + bx + bs, {rows, K}, at::kLong);
    py::object w = has_w ? py::cast(make(off + bx + bs + bi, {rows, K}, at::kFloat)) : py::none();
    return py::make_tuple(x, s, idx, w, off, scale_cols > 0 ? off + bx : -1, off + bx + bs, has_w ? off + bx + bs + bi : -1);
  }

  long long pool_free_bytes() { return pool_->free_bytes(); }

  py::bytes ipc_handle() const { return py::bytes(region_->ipc_handle()); }

  void open_peers(const std::vector<std::string>& handles) {
    TORCH_CHECK((int)handles.size() == num_ranks_, "megatron_ep: expected ", num_ranks_, " IPC handles");
    region_->open_peers(handles, rank_);
  }

  void close() { region_->close(); }

  // A tensor over region memory (zero-copy inputs); it keeps the region alive.
  Tensor view(long long offset, std::vector<int64_t> shape, py::object dtype) {
    const auto st = torch::python::detail::py_object_to_dtype(dtype);
    auto keep = region_;
    auto opts = torch::TensorOptions().dtype(st).device(torch::kCUDA, region_->device());
    return torch::from_blob(region_->base() + offset, shape, [keep](void*) {}, opts);
  }

  long long base_ptr() const { return reinterpret_cast<long long>(region_->base()); }

  // ---- host block
  long long host_tag() const { return region_->host()->tag; }
  py::tuple host_counts(int L) const {
    const HostInfo* h = region_->host();
    std::vector<int> counts(L);
    for (int i = 0; i < L; ++i) counts[i] = h->expert_counts[i];
    return py::make_tuple((int)h->num_rows, (int)h->num_perm_rows, counts);
  }
  py::object host_error() const {
    const HostInfo* h = region_->host();
    if (h->error == kErrNone) return py::none();
    return py::make_tuple((int)h->error, (int)h->err_rank, (int)h->err_peer, (int)h->err_slot,
                          (long long)h->err_expected, (long long)h->err_observed);
  }

  // ---- kernels
  void notify(const Tensor& topk_idx, int E, int align, Tensor& rank_pos, Tensor& slot_pos, Tensor& recv_info,
              long long tag) {
    check_tensor(topk_idx, "topk_idx", at::kLong);
    check_tensor(rank_pos, "rank_pos", at::kInt);
    check_tensor(slot_pos, "slot_pos", at::kInt);
    check_tensor(recv_info, "recv_info", at::kInt);
    const int T = (int)topk_idx.size(0), K = (int)topk_idx.size(1);
    TORCH_CHECK(K >= 1 && K <= kMaxTopk, "megatron_ep: topk ", K, " outside 1..", kMaxTopk);
    TORCH_CHECK(E <= kMaxExperts && E % num_ranks_ == 0, "megatron_ep: bad num_experts ", E);
    TORCH_CHECK(recv_info.numel() >= 3 + 3 * (E / num_ranks_), "recv_info too small");
    NotifyArgs a{static_cast<const long long*>(topk_idx.data_ptr()), T, K, E, align, rank_pos.data_ptr<int>(),
                 slot_pos.data_ptr<int>(), recv_info.data_ptr<int>(), tag};
    launch_notify(ctx(), a, stream());
    check_launch("notify");
  }

  void stage(const c10::optional<Tensor>& x, int T, int row_bytes, const c10::optional<Tensor>& scales, int scale_cols,
             const Tensor& topk_idx, const c10::optional<Tensor>& topk_w, const Tensor& rank_pos,
             const Tensor& slot_pos, int num_blocks) {
    TORCH_CHECK(T <= lay_.max_tokens, "megatron_ep: ", T, " tokens exceed the region's ", lay_.max_tokens);
    TORCH_CHECK(row_bytes <= lay_.x_row_bytes && row_bytes % 16 == 0, "megatron_ep: bad dispatch row size ", row_bytes);
    TORCH_CHECK(scale_cols <= lay_.scale_cols, "megatron_ep: too many scale columns");
    const int K = (int)topk_idx.size(1);
    TORCH_CHECK(K <= lay_.max_topk, "megatron_ep: topk exceeds the region's");
    StageArgs a{x.has_value() ? x->data_ptr() : nullptr, T, row_bytes, ptr_or_null<const float>(scales), scale_cols,
                static_cast<const long long*>(topk_idx.data_ptr()), ptr_or_null<const float>(topk_w), K,
                rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>()};
    launch_stage(ctx(), a, num_blocks, stream());
    check_launch("stage");
  }

  void dispatch(int row_bytes, int scale_cols, int K, int E, bool permute, bool has_weights, int out_rows,
                const Tensor& recv_info, Tensor& out_x, const c10::optional<Tensor>& out_scales,
                const c10::optional<Tensor>& out_idx, const c10::optional<Tensor>& out_w,
                const c10::optional<Tensor>& out_row_expert, int num_blocks) {
    TORCH_CHECK(out_x.is_contiguous() && out_x.nbytes() >= (size_t)out_rows * row_bytes, "out_x too small");
    TORCH_CHECK(permute ? out_row_expert.has_value() : out_idx.has_value(), "missing index output");
    DispatchArgs a{row_bytes, scale_cols, K, E, permute ? 1 : 0, has_weights ? 1 : 0, out_rows,
                   recv_info.data_ptr<int>(), static_cast<char*>(out_x.data_ptr()), ptr_or_null<float>(out_scales),
                   ptr_or_null<long long>(out_idx), ptr_or_null<float>(out_w), ptr_or_null<int>(out_row_expert)};
    launch_dispatch(ctx(), a, num_blocks, stream());
    check_launch("dispatch");
  }

  void dispatch_push(const Tensor& x, int T, int row_bytes, const c10::optional<Tensor>& scales, int scale_cols,
                     const Tensor& topk_idx, const c10::optional<Tensor>& topk_w, const Tensor& rank_pos,
                     const Tensor& slot_pos, int E, int out_rows, const Tensor& recv_info, Tensor& out_x,
                     const c10::optional<Tensor>& out_scales, const Tensor& out_idx, const c10::optional<Tensor>& out_w,
                     std::vector<long long> offsets, int num_blocks) {
    TORCH_CHECK(T <= lay_.max_tokens, "megatron_ep: ", T, " tokens exceed the region's ", lay_.max_tokens);
    TORCH_CHECK(row_bytes <= lay_.x_row_bytes && row_bytes % 16 == 0, "megatron_ep: bad dispatch row size ", row_bytes);
    TORCH_CHECK(offsets.size() == 4, "offsets: x, scales, idx, w");
    const int K = (int)topk_idx.size(1);
    TORCH_CHECK(K <= lay_.max_topk, "megatron_ep: topk exceeds the region's");
    PushArgs a;
    a.in = StageArgs{x.data_ptr(), T, row_bytes, ptr_or_null<const float>(scales), scale_cols,
                     static_cast<const long long*>(topk_idx.data_ptr()), ptr_or_null<const float>(topk_w), K,
                     rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>()};
    a.out = DispatchArgs{row_bytes, scale_cols, K, E, 0, topk_w.has_value() ? 1 : 0, out_rows, recv_info.data_ptr<int>(),
                         static_cast<char*>(out_x.data_ptr()), ptr_or_null<float>(out_scales),
                         static_cast<long long*>(out_idx.data_ptr()), ptr_or_null<float>(out_w), nullptr};
    a.out_x_off = offsets[0];
    a.out_s_off = offsets[1];
    a.out_idx_off = offsets[2];
    a.out_w_off = offsets[3];
    launch_dispatch_push(ctx(), a, num_blocks, stream());
    check_launch("dispatch_push");
  }

  void stage_combine(const c10::optional<Tensor>& x, int rows, int row_bytes, const c10::optional<Tensor>& w,
                     int w_cols, int num_blocks) {
    TORCH_CHECK(rows <= lay_.comb_rows, "megatron_ep: combine input has ", rows, " rows; the region holds ", lay_.comb_rows);
    TORCH_CHECK(row_bytes <= lay_.comb_row_bytes && row_bytes % 16 == 0, "megatron_ep: bad combine row size ", row_bytes);
    TORCH_CHECK(w_cols <= lay_.max_topk, "megatron_ep: combine weight columns exceed the region's");
    StageCombineArgs a{x.has_value() ? x->data_ptr() : nullptr, rows, row_bytes, ptr_or_null<const float>(w), w_cols};
    launch_stage_combine(ctx(), a, num_blocks, stream());
    check_launch("stage_combine");
  }

  void combine(int T, int H, int K, int E, bool permute, bool is_fp32, bool has_weights, const Tensor& topk_idx,
               const Tensor& rank_pos, const Tensor& slot_pos, Tensor& y, const c10::optional<Tensor>& w_out,
               int num_blocks) {
    check_tensor(topk_idx, "topk_idx", at::kLong);
    TORCH_CHECK(y.is_contiguous() && y.size(0) == T && y.size(1) == H, "y has the wrong shape");
    CombineArgs a{T, H, K, E, permute ? 1 : 0, is_fp32 ? 1 : 0, has_weights ? 1 : 0,
                  static_cast<const long long*>(topk_idx.data_ptr()), rank_pos.data_ptr<int>(),
                  slot_pos.data_ptr<int>(), y.data_ptr(), ptr_or_null<float>(w_out)};
    launch_combine(ctx(), a, num_blocks, stream());
    check_launch("combine");
  }

 private:
  Ctx ctx() const {
    Ctx c;
    c.peers = region_->peers();
    c.lay = lay_;
    c.host = region_->host_device();
    c.rank = rank_;
    c.num_ranks = num_ranks_;
    c.timeout_ns = timeout_ns_;
    return c;
  }

  std::shared_ptr<Region> region_;
  std::shared_ptr<Pool> pool_;
  RegionLayout lay_{};
  int rank_ = 0, num_ranks_ = 1;
  unsigned long long timeout_ns_ = 0;
};

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
  m.doc() = "megatron_ep CUDA kernels (intranode normal path)";
  m.attr("MAX_RANKS") = mep::kMaxRanks;
  m.attr("MAX_TOPK") = mep::kMaxTopk;
  m.attr("MAX_EXPERTS") = mep::kMaxExperts;
  m.attr("CONTROL_BYTES") = (long long)sizeof(mep::Control);
  m.def("layout", &mep::layout);
  m.def("launch_notify", [] {}, "marker: the kernel entry points are present");
  py::class_<mep::Runtime>(m, "Runtime")
      .def(py::init<int, int, int, const py::dict&, double>())
      .def("ipc_handle", &mep::Runtime::ipc_handle)
      .def("open_peers", &mep::Runtime::open_peers)
      .def("close", &mep::Runtime::close)
      .def("view", &mep::Runtime::view)
      .def("base_ptr", &mep::Runtime::base_ptr)
      .def("host_tag", &mep::Runtime::host_tag)
      .def("host_counts", &mep::Runtime::host_counts)
      .def("host_error", &mep::Runtime::host_error)
      .def("notify", &mep::Runtime::notify)
      .def("stage", &mep::Runtime::stage)
      .def("dispatch", &mep::Runtime::dispatch)
      .def("dispatch_push", &mep::Runtime::dispatch_push)
      .def("pool_rank_major", &mep::Runtime::pool_rank_major)
      .def("pool_free_bytes", &mep::Runtime::pool_free_bytes)
      .def("stage_combine", &mep::Runtime::stage_combine)
      .def("combine", &mep::Runtime::combine);
}
