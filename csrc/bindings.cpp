// Python binding: the only translation unit that sees torch. It checks what the kernels assume
// (device, dtype, contiguity, sizes) with TORCH_CHECK, builds the kernel context, and launches
// on the current stream (the caller makes that the buffer's communication stream).
//
// `Runtime` is what every kernel path shares (region, pool, host block, errors, failure
// publication); each path's launchers are free functions in a submodule of their own
// (`_C.intranode`), taking the runtime.

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <climits>
#include <cstring>
#include <memory>

#include "kernels/api.h"
#include "pool.h"
#include "region.h"

namespace py = pybind11;
using torch::Tensor;

namespace mep {
namespace {

// A tensor over region memory at `p`; `keep` (the pooled block's owner, or the region) lives as
// long as its storage holds the memory. The storage is resizable, with torch's CUDA allocator
// behind it, because Megatron's schedule frees a node's input early with
// `untyped_storage().resize_(0)`: that must drop our memory (a pooled block goes back once
// its last tensor lets go), as it would a torch allocation, instead of raising.
Tensor region_tensor(char* p, const std::vector<int64_t>& shape, at::ScalarType st, int device,
                     std::shared_ptr<void> keep) {
  return at::for_blob(p, shape)
      .options(torch::TensorOptions().dtype(st).device(torch::kCUDA, device))
      .deleter([keep = std::move(keep)](void*) {})
      .allocator(c10::cuda::CUDACachingAllocator::get())
      .resizeable_storage()
      .make_tensor();
}

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

// A call record from Python: the signature (kSigFields int64), a status and a message.
CallArgs make_call(const std::vector<long long>& sig, int status, const std::string& msg) {
  TORCH_CHECK((int)sig.size() == kSigFields, "megatron_ep: a call signature has ", kSigFields, " fields");
  CallArgs a{};
  for (int f = 0; f < kSigFields; ++f) a.sig[f] = sig[f];
  a.status = status;
  a.msg_len = (int)std::min<size_t>(msg.size(), kMsgBytes);
  std::memcpy(a.msg, msg.data(), a.msg_len);
  return a;
}

RegionLayout layout_from(const py::dict& d) {
  RegionLayout l{};
  auto ll = [&](const char* k) { return d[k].cast<long long>(); };
  l.control = ll("control");
  l.counts = ll("counts");
  l.scratch = ll("scratch");
  l.stage_x = ll("stage_x");
  l.stage_scales = ll("stage_scales");
  l.stage_idx = ll("stage_idx");
  l.stage_w = ll("stage_w");
  l.stage_rpos = ll("stage_rpos");
  l.stage_spos = ll("stage_spos");
  l.comb_x = ll("comb_x");
  l.comb_w = ll("comb_w");
  l.pool = ll("pool");
  l.pool_bytes = ll("pool_bytes");
  l.comb_rows = ll("comb_rows");
  l.total = ll("total");
  l.max_tokens = (int)ll("max_tokens");
  l.max_topk = (int)ll("max_topk");
  l.max_experts = (int)ll("max_experts");
  l.x_row_bytes = (int)ll("x_row_bytes");
  l.scale_cols = (int)ll("scale_cols");
  l.comb_row_bytes = (int)ll("comb_row_bytes");
  l.num_ranks = (int)ll("num_ranks");
  return l;
}

class Runtime {
 public:
  // `layout` comes from megatron_ep._protocol.plan_region (the same C++ routine, so the offsets
  // the kernels use are the ones Python planned with).
  Runtime(int device, int rank, int num_ranks, const py::dict& layout, double timeout_s) {
    TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "megatron_ep: group size ", num_ranks, " is outside 1..", kMaxRanks);
    lay_ = layout_from(layout);
    TORCH_CHECK(lay_.control == 0, "megatron_ep: the control block must start the region");
    rank_ = rank;
    num_ranks_ = num_ranks;
    timeout_ns_ = (unsigned long long)(timeout_s * 1e9);
    c10::cuda::CUDAGuard guard(device);
    region_ = std::make_shared<Region>(device, lay_.total);
    pool_ = std::make_shared<Pool>(device, lay_.pool, lay_.pool_bytes);
    prepare_kernels();
  }

  // Rank-major dispatch outputs for `rows` rows in the pool: (x, scales, idx, w, offsets...),
  // or None when the pool has no room. The tensors share one block, returned to the pool (on
  // `stream`, the caller's) when the last of them dies; the block keeps the region alive.
  // `comm_only`: every use of the block is a kernel on the communication stream (the expert-major
  // push's rank-major buffer), so it is free again as soon as its last tensor dies.
  py::object pool_rank_major(int rows, int hidden, py::object x_dtype, int row_bytes, int scale_cols, int K, bool has_w,
                             long long stream_ptr, bool comm_only, long long order_stream_ptr) {
    const RankMajorBlock b(rows, row_bytes, scale_cols, K, has_w);
    const long long off = pool_->alloc(b.total, reinterpret_cast<cudaStream_t>(order_stream_ptr));
    if (off < 0) return py::none();
    struct Owner {  // returns the block when the last tensor over it dies (never copied)
      std::shared_ptr<Pool> pool;
      std::shared_ptr<Region> region;
      long long off, bytes;
      cudaStream_t stream;
      bool comm_only;
      Owner(std::shared_ptr<Pool> p, std::shared_ptr<Region> r, long long o, long long b, cudaStream_t s, bool c)
          : pool(std::move(p)), region(std::move(r)), off(o), bytes(b), stream(s), comm_only(c) {}
      Owner(const Owner&) = delete;
      Owner& operator=(const Owner&) = delete;
      ~Owner() {
        if (comm_only)
          pool->release_now(off, bytes);
        else
          pool->release(off, bytes, stream);
      }
    };
    auto owner = std::make_shared<Owner>(pool_, region_, off, b.total, reinterpret_cast<cudaStream_t>(stream_ptr), comm_only);
    return rank_major_tensors(off, b, rows, hidden, x_dtype, scale_cols, K, has_w, owner);
  }

  // The same block laid out at `offset` of the region (the expert-major push's buffer in the
  // combine area), or None when it would reach past `limit`; the tensors keep the region alive.
  py::object rank_major_at(long long offset, long long limit, int rows, int hidden, py::object x_dtype, int row_bytes,
                           int scale_cols, int K, bool has_w) {
    alive();
    const RankMajorBlock b(rows, row_bytes, scale_cols, K, has_w);
    if (offset + b.total > limit) return py::none();
    return rank_major_tensors(offset, b, rows, hidden, x_dtype, scale_cols, K, has_w, region_);
  }

  long long pool_free_bytes() { return pool_->free_bytes(); }
  // (stream_waits, host_waits, misses) of the output pool so far (Pool::Stats)
  py::tuple pool_stats() {
    const Pool::Stats s = pool_->stats();
    return py::make_tuple(s.stream_waits, s.host_waits, s.misses);
  }

  py::bytes ipc_handle() const { return py::bytes(region_->ipc_handle()); }

  void open_peers(const std::vector<std::string>& handles) {
    TORCH_CHECK((int)handles.size() == num_ranks_, "megatron_ep: expected ", num_ranks_, " IPC handles");
    region_->open_peers(handles, rank_);
  }

  // The group agreed nobody reads this region any more: unmap the peers and drop this owner.
  // The memory itself is freed when the last tensor over it dies.
  void close() {
    if (!region_) return;
    region_->close_peers();
    region_.reset();
    pool_.reset();
  }

  // A tensor over region memory (zero-copy inputs); it keeps the region alive.
  Tensor view(long long offset, std::vector<int64_t> shape, py::object dtype) {
    alive();
    const auto st = torch::python::detail::py_object_to_dtype(dtype);
    return region_tensor(region_->base() + offset, shape, st, region_->device(), region_);
  }

  long long base_ptr() const { return reinterpret_cast<long long>(region_ ? region_->base() : nullptr); }

  // ---- host block
  long long host_tag() const { return host()->tag; }
  py::dict host_counts(int L) const {
    const HostInfo* h = host();
    std::vector<int> counts(L);
    for (int i = 0; i < L; ++i) counts[i] = h->expert_counts[i];
    py::dict d;
    d["num_rows"] = (int)h->num_rows;
    d["num_perm_rows"] = (int)h->num_perm_rows;
    d["need_tokens"] = (int)h->need_tokens;
    d["need_rows"] = (int)h->need_rows;
    d["need_perm_rows"] = (int)h->need_perm_rows;
    d["counts"] = counts;
    return d;
  }
  int num_aborted() const { return host()->num_aborted; }
  // The first error not yet reported, as a dict (None if none); clear=True lets the kernels
  // record the next one.
  py::object take_error(bool clear) {
    HostInfo* h = host();
    if (h->error == kErrNone) return py::none();
    py::dict d;
    d["code"] = (int)h->error;
    d["rank"] = (int)h->err_rank;
    d["peer"] = (int)h->err_peer;
    d["slot"] = (int)h->err_slot;
    d["field"] = (int)h->err_field;
    d["seq"] = (long long)h->err_seq;
    d["expected"] = (long long)h->err_expected;
    d["observed"] = (long long)h->err_observed;
    std::vector<long long> values(num_ranks_), ops(num_ranks_);
    for (int r = 0; r < num_ranks_; ++r) values[r] = h->err_values[r], ops[r] = h->err_ops[r];
    d["values"] = values;
    d["ops"] = ops;
    const int n = std::max(0, std::min((int)h->err_msg_len, kMsgBytes));
    std::string msg(n, '\0');
    for (int i = 0; i < n; ++i) msg[i] = h->err_msg[i];
    d["message"] = py::bytes(msg);
    d["num_aborted"] = (int)h->num_aborted;
    if (clear) {
      h->error = kErrNone;
      h->err_cleared = h->err_cleared + 1;  // after `error`: a kernel may claim the record again
    }
    return d;
  }

  // ---- the runtime's own kernel
  void fail_call(const std::vector<long long>& sig, const std::string& msg, int slot) {
    TORCH_CHECK(slot >= 0 && slot < kNumSlots, "megatron_ep: bad slot ", slot);
    const CallArgs call = make_call(sig, kCallFailed, msg);
    launch_fail_call(ctx(call.sig[kSigSeq]), call, slot, stream());
    check_launch("fail_call");
  }

  Ctx ctx(long long seq) const {
    alive();
    Ctx c;
    c.peers = region_->peers();
    c.lay = lay_;
    c.host = region_->host_device();
    c.rank = rank_;
    c.num_ranks = num_ranks_;
    c.timeout_ns = timeout_ns_;
    c.seq = seq;
    return c;
  }
  const RegionLayout& lay() const { return lay_; }
  int num_ranks() const { return num_ranks_; }

 private:
  // One rank-major block: x, FP8 scales, top-k ids (int64), weights, each section Pool-aligned.
  struct RankMajorBlock {
    long long bx, bs, bi, bw, total;
    RankMajorBlock(int rows, int row_bytes, int scale_cols, int K, bool has_w)
        : bx(align((long long)rows * row_bytes)), bs(align((long long)rows * scale_cols * 4)),
          bi(align((long long)rows * K * 8)), bw(has_w ? align((long long)rows * K * 4) : 0),
          total(bx + bs + bi + bw) {}
    static long long align(long long n) { return (n + Pool::kAlign - 1) / Pool::kAlign * Pool::kAlign; }
  };

  // (x, scales, idx, w, x_off, s_off, idx_off, w_off) over the block at `off`; `keep` lives
  // as long as any of the tensors (-1 / None for sections the block does not have).
  py::tuple rank_major_tensors(long long off, const RankMajorBlock& b, int rows, int hidden, py::object x_dtype,
                               int scale_cols, int K, bool has_w, std::shared_ptr<void> keep) {
    auto make = [&](long long o, std::vector<int64_t> shape, at::ScalarType st) {
      return region_tensor(region_->base() + o, shape, st, region_->device(), keep);
    };
    const auto xt = torch::python::detail::py_object_to_dtype(x_dtype);
    Tensor x = make(off, {rows, hidden}, xt);
    py::object s = scale_cols > 0 ? py::cast(make(off + b.bx, {rows, scale_cols}, at::kFloat)) : py::none();
    Tensor idx = make(off + b.bx + b.bs, {rows, K}, at::kLong);
    py::object w = has_w ? py::cast(make(off + b.bx + b.bs + b.bi, {rows, K}, at::kFloat)) : py::none();
    return py::make_tuple(x, s, idx, w, off, scale_cols > 0 ? off + b.bx : -1, off + b.bx + b.bs,
                          has_w ? off + b.bx + b.bs + b.bi : -1);
  }

  void alive() const { TORCH_CHECK(region_ && region_->peers_open(), "megatron_ep: this runtime was closed"); }
  HostInfo* host() const {
    TORCH_CHECK(region_, "megatron_ep: this runtime was closed");
    return region_->host();
  }

  std::shared_ptr<Region> region_;
  std::shared_ptr<Pool> pool_;
  RegionLayout lay_{};
  int rank_ = 0, num_ranks_ = 1;
  unsigned long long timeout_ns_ = 0;
};

// ------------------------------------------------------------------------------ intranode path
using Sig = std::vector<long long>;

void notify(Runtime& rt, const Sig& sig, const Tensor& topk_idx, int E, int align, bool permute, int worst,
            Tensor& rank_pos, Tensor& slot_pos, Tensor& recv_info, Tensor& row_limits, Tensor& tpe, Tensor& dropped,
            long long tag) {
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
  TORCH_CHECK(recv_info.numel() >= RecvInfo::size(E / R), "recv_info too small");
  TORCH_CHECK(rank_pos.numel() >= (int64_t)T * R && slot_pos.numel() >= (int64_t)T * K, "position tensors too small");
  TORCH_CHECK(row_limits.numel() >= R && tpe.numel() >= E / R && dropped.numel() >= 1, "notify outputs too small");
  const CallArgs call = make_call(sig, kCallOk, "");
  NotifyArgs a{static_cast<const long long*>(topk_idx.data_ptr()), T, K, E, align, permute ? 1 : 0, worst,
               rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>(), recv_info.data_ptr<int>(), row_limits.data_ptr<int>(),
               reinterpret_cast<long long*>(tpe.data_ptr<int64_t>()), reinterpret_cast<long long*>(dropped.data_ptr<int64_t>()),
               tag};
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

void dispatch_push(Runtime& rt, const Sig& sig, int slot, const Tensor& x, int T, int row_bytes,
                   const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
                   const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos, int E,
                   int out_rows, bool permute, const Tensor& recv_info, Tensor& out_x,
                   const c10::optional<Tensor>& out_scales, const c10::optional<Tensor>& out_idx,
                   const c10::optional<Tensor>& out_w, const c10::optional<Tensor>& out_row_expert,
                   const c10::optional<Tensor>& comb_map, std::vector<long long> offsets, int num_blocks) {
  TORCH_CHECK(offsets.size() == 4, "offsets: x, scales, idx, w");
  const CallArgs call = make_call(sig, kCallOk, "");
  PushArgs a;
  a.in = stage_args(rt, x, T, row_bytes, scales, scale_cols, topk_idx, topk_w, rank_pos, slot_pos);
  const int K = a.in.K;
  a.out = dispatch_args(row_bytes, scale_cols, K, E, permute, topk_w.has_value(), out_rows, recv_info, out_x, out_scales,
                        out_idx, out_w, out_row_expert, c10::nullopt, comb_map);
  a.out_x_off = offsets[0];
  a.out_s_off = offsets[1];
  a.out_idx_off = offsets[2];
  a.out_w_off = offsets[3];
  launch_dispatch_push(rt.ctx(call.sig[kSigSeq]), call, slot, a, num_blocks, stream());
  check_launch("dispatch_push");
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
void combine_reduce(Runtime& rt, const Sig& sig, const Tensor& x, int rows, int H, bool is_fp32, const Tensor& comb_map,
                    const Tensor& recv_info, const c10::optional<Tensor>& w, int num_blocks) {
  const RegionLayout& l = rt.lay();
  check_tensor(comb_map, "comb_map", at::kInt);
  TORCH_CHECK(x.is_contiguous() && x.size(0) == rows && x.size(1) == H, "combine_reduce: bad x");
  TORCH_CHECK(H % 4 == 0, "combine_reduce: hidden must be a multiple of 4");
  TORCH_CHECK(rows <= l.comb_rows, "megatron_ep: combine input has ", rows, " rows; the region holds ", l.comb_rows);
  TORCH_CHECK(comb_map.size(0) * H * 4 <= l.comb_rows * l.comb_row_bytes, "combine_reduce: the partials exceed the combine area");
  const CallArgs call = make_call(sig, kCallOk, "");
  CombineReduceArgs a{x.data_ptr(), rows, H, is_fp32 ? 1 : 0, comb_map.data_ptr<int>(), recv_info.data_ptr<int>(),
                      (int)comb_map.size(1), ptr_or_null<const float>(w)};
  launch_combine_reduce(rt.ctx(call.sig[kSigSeq]), call, a, num_blocks, stream());
  check_launch("combine_reduce");
}

void stage_combine(Runtime& rt, const Sig& sig, const c10::optional<Tensor>& x, int rows, int row_bytes,
                   const c10::optional<Tensor>& w, int w_cols, int num_blocks) {
  const RegionLayout& l = rt.lay();
  TORCH_CHECK(rows <= l.comb_rows, "megatron_ep: combine input has ", rows, " rows; the region holds ", l.comb_rows);
  TORCH_CHECK(row_bytes <= l.comb_row_bytes && row_bytes % 16 == 0, "megatron_ep: bad combine row size ", row_bytes);
  TORCH_CHECK(w_cols <= l.max_topk, "megatron_ep: combine weight columns exceed the region's");
  const CallArgs call = make_call(sig, kCallOk, "");
  StageCombineArgs a{x.has_value() ? x->data_ptr() : nullptr, rows, row_bytes, ptr_or_null<const float>(w), w_cols};
  launch_stage_combine(rt.ctx(call.sig[kSigSeq]), call, a, num_blocks, stream());
  check_launch("stage_combine");
}

void combine(Runtime& rt, const Sig& sig, int T, int H, int K, int E, bool permute, bool is_fp32, bool has_weights,
             bool partials, const Tensor& row_limits, const Tensor& topk_idx, const Tensor& rank_pos, const Tensor& slot_pos, Tensor& y,
             const c10::optional<Tensor>& w_out, int num_blocks) {
  check_tensor(topk_idx, "topk_idx", at::kLong);
  check_tensor(row_limits, "row_limits", at::kInt);
  TORCH_CHECK(y.is_contiguous() && y.size(0) == T && y.size(1) == H, "y has the wrong shape");
  CombineArgs a{T, H, K, E, permute ? 1 : 0, is_fp32 ? 1 : 0, has_weights ? 1 : 0, partials ? 1 : 0, row_limits.data_ptr<int>(),
                static_cast<const long long*>(topk_idx.data_ptr()), rank_pos.data_ptr<int>(),
                slot_pos.data_ptr<int>(), y.data_ptr(), ptr_or_null<float>(w_out)};
  launch_combine(rt.ctx(sig.at(kSigSeq)), a, num_blocks, stream());
  check_launch("combine");
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
  m.def("layout", &mep::layout);
  py::class_<mep::Runtime>(m, "Runtime")
      .def(py::init<int, int, int, const py::dict&, double>())
      .def("ipc_handle", &mep::Runtime::ipc_handle)
      .def("open_peers", &mep::Runtime::open_peers)
      .def("close", &mep::Runtime::close)
      .def("view", &mep::Runtime::view)
      .def("base_ptr", &mep::Runtime::base_ptr)
      .def("host_tag", &mep::Runtime::host_tag)
      .def("host_counts", &mep::Runtime::host_counts)
      .def("num_aborted", &mep::Runtime::num_aborted)
      .def("take_error", &mep::Runtime::take_error, py::arg("clear"))
      .def("fail_call", &mep::Runtime::fail_call)
      .def("pool_rank_major", &mep::Runtime::pool_rank_major)
      .def("rank_major_at", &mep::Runtime::rank_major_at)
      .def("pool_free_bytes", &mep::Runtime::pool_free_bytes)
      .def("pool_stats", &mep::Runtime::pool_stats);
  auto intra = m.def_submodule("intranode", "the intranode normal path (csrc/kernels/intranode.cu)");
  intra.def("notify", &mep::notify);
  intra.def("stage", &mep::stage);
  intra.def("dispatch", &mep::dispatch);
  intra.def("dispatch_push", &mep::dispatch_push);
  intra.def("fanout", &mep::fanout);
  intra.def("combine_reduce", &mep::combine_reduce);
  intra.def("stage_combine", &mep::stage_combine);
  intra.def("combine", &mep::combine);
}
