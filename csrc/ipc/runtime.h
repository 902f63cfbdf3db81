// The IPC runtime as the torch binding sees it: the `Runtime` class (one rank's region, its
// output pool, the mapped host block, errors and failure publication) and the torch-side helpers
// the launchers share (tensor checks, call records, region tensors). Included by the one
// translation unit that binds the intranode path (intranode/binding.cpp), which sees torch.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <memory>
#include <thread>

#include "common/tensor_args.h"  // arena_tensors
#include "ipc/api.h"
#include "ipc/host_clock.h"
#include "ipc/pool.h"
#include "ipc/region.h"

namespace mep {

namespace py = pybind11;
using torch::Tensor;


// A tensor over region memory at `p`; `keep` (the pooled block's owner, or the region) lives as
// long as its storage holds the memory. The storage is resizable, with torch's CUDA allocator
// behind it, because Megatron's schedule frees a node's input early with
// `untyped_storage().resize_(0)`: that must drop our memory (a pooled block goes back once
// its last tensor lets go), as it would a torch allocation, instead of raising.
inline Tensor region_tensor(char* p, const std::vector<int64_t>& shape, at::ScalarType st, int device,
                     std::shared_ptr<void> keep) {
  return at::for_blob(p, shape)
      .options(torch::TensorOptions().dtype(st).device(torch::kCUDA, device))
      .deleter([keep = std::move(keep)](void*) {})
      .allocator(c10::cuda::CUDACachingAllocator::get())
      .resizeable_storage()
      .make_tensor();
}

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "megatron_ep: launch of ", what, " failed: ", cudaGetErrorString(err));
}

inline void check_tensor(const Tensor& t, const char* name, c10::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

template <typename T>
inline T* ptr_or_null(const c10::optional<Tensor>& t) {
  return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

// A call record from Python: the signature (kSigFields int64), a status and a message.
inline CallArgs make_call(const std::vector<long long>& sig, int status, const std::string& msg) {
  TORCH_CHECK((int)sig.size() == kSigFields, "megatron_ep: a call signature has ", kSigFields, " fields");
  CallArgs a{};
  for (int f = 0; f < kSigFields; ++f) a.sig[f] = sig[f];
  a.status = status;
  a.msg_len = (int)std::min<size_t>(msg.size(), kMsgBytes);
  std::memcpy(a.msg, msg.data(), a.msg_len);
  return a;
}

// The region layout Python passes back (megatron_ep._protocol.plan_region's RegionLayout), read
// by the attribute names of MEP_REGION_LAYOUT_FIELDS: the two modules are built against different
// pybind11 copies (torch's and the build's), so the type itself does not cross between them.
inline RegionLayout layout_from(const py::object& o) {
  RegionLayout l{};
#define MEP_FIELD(type, name) l.name = o.attr(#name).cast<type>();
  MEP_REGION_LAYOUT_FIELDS(MEP_FIELD)
#undef MEP_FIELD
  return l;
}

// Rank-major rows in region memory (a pooled block, or the combine area): the tensors and their
// byte offsets in the region (x, scales, idx, w, src; -1 where the block has no such section).
struct RankMajor {
  Tensor x, idx;
  c10::optional<Tensor> scales, w, src;
  std::vector<long long> offsets;
};

class Runtime {
 public:
  // `layout` comes from megatron_ep._protocol.plan_region (the same C++ routine, so the offsets
  // the kernels use are the ones Python planned with).
  Runtime(int device, int rank, int num_ranks, const py::object& layout, double timeout_s) {
    TORCH_CHECK(num_ranks >= 1 && num_ranks <= kMaxRanks, "megatron_ep: group size ", num_ranks, " is outside 1..", kMaxRanks);
    lay_ = layout_from(layout);
    TORCH_CHECK(lay_.control == 0, "megatron_ep: the control block must start the region");
    rank_ = rank;
    num_ranks_ = num_ranks;
    timeout_ns_ = (unsigned long long)(timeout_s * 1e9);
    c10::cuda::CUDAGuard guard(device);
    region_ = std::make_shared<Region>(device, lay_.total);
    pool_ = std::make_shared<Pool>(device, lay_.pool, lay_.pool_bytes);
    prepare_runtime_kernels();  // the paths' kernels: their binding prepares them (intranode/api.h)
  }

  // Rank-major dispatch outputs for `rows` rows in the pool (false when the pool has no room).
  // The tensors share one block, returned to the pool (on `stream`, the caller's) when the last
  // of them dies; the block keeps the region alive. `comm_only`: every use of the block is a
  // kernel on the communication stream (the expert-major push's rank-major buffer), so it is free
  // again as soon as its last tensor dies. `order`: the block's first writer (0: the default stream).
  bool pool_block(int rows, int hidden, at::ScalarType x_dtype, int row_bytes, int scale_cols, int K, bool has_w,
                  bool has_src, cudaStream_t stream, bool comm_only, cudaStream_t order, RankMajor& out) {
    const RankMajorBlock b(rows, row_bytes, scale_cols, K, has_w, has_src);
    const long long off = pool_->alloc(b.total, order);
    if (off < 0) return false;
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
        if (comm_only) {
          pool->release_now(off, bytes);
        } else {
          // also the stream current where the last tensor died: a consumer there (record_stream
          // does not reach this pool) finishes before the block is reused
          const cudaStream_t now = c10::cuda::getCurrentCUDAStream(region->device()).stream();
          pool->release(off, bytes, stream, &now);
        }
      }
    };
    auto owner = std::make_shared<Owner>(pool_, region_, off, b.total, stream, comm_only);
    out = rank_major_tensors(off, b, rows, hidden, x_dtype, scale_cols, K, has_w, has_src, owner);
    return true;
  }

  // The same block laid out at `offset` of the region (the expert-major push's buffer in the
  // combine area); false when it would reach past `limit`. The tensors keep the region alive.
  bool block_at(long long offset, long long limit, int rows, int hidden, at::ScalarType x_dtype, int row_bytes,
                int scale_cols, int K, bool has_w, bool has_src, RankMajor& out) {
    alive();
    const RankMajorBlock b(rows, row_bytes, scale_cols, K, has_w, has_src);
    if (offset + b.total > limit) return false;
    out = rank_major_tensors(offset, b, rows, hidden, x_dtype, scale_cols, K, has_w, has_src, region_);
    return true;
  }

  long long pool_free_bytes() { return pool_->free_bytes(); }
  // The output pool's counters so far, by name (Pool::Stats: the one list of them)
  // the one-crossing entries' step times (host_clock.h), for the host bench
  HostClock& clock() { return clock_; }
  void set_host_clock(bool on) { clock_.on = on; }
  py::dict host_clock(bool reset) { return clock_.read(reset); }

  py::dict pool_stats() {
    const Pool::Stats s = pool_->stats();
    py::dict d;
    d["stream_waits"] = s.stream_waits;
    d["misses"] = s.misses;
    return d;
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

  // ---- streams: the communication stream (the Python runtime's, set once after creation) and
  // one event to order it after another stream without allocating one per call
  void set_comm_stream(const at::cuda::CUDAStream& s) {
    if (order_ == nullptr) {
      c10::cuda::CUDAGuard guard(s.device_index());
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&order_, cudaEventDisableTiming));
    }
    comm_ = s;
  }
  const at::cuda::CUDAStream& comm() const {
    TORCH_CHECK(comm_.has_value(), "megatron_ep: the runtime has no communication stream");
    return *comm_;
  }
  // `after` runs what is queued from here on only after everything queued on `before` so far
  void order(cudaStream_t before, cudaStream_t after) {
    C10_CUDA_CHECK(cudaEventRecord(order_, before));
    C10_CUDA_CHECK(cudaStreamWaitEvent(after, order_, 0));
  }
  ~Runtime() {
    if (order_ != nullptr) cudaEventDestroy(order_);
  }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // ---- host block
  long long host_tag() const { return host()->tag; }
  // The tag of the last notify launched here: after an exception out of a crossing that launches
  // notify and then moves rows, the caller tells by it whether its peers already wait at the
  // rows' first handshake (dispatch_first_call).
  long long notified_tag() const { return notified_tag_; }
  void set_notified(long long tag) { notified_tag_ = tag; }
  // Wait until notify's sizes for `tag` reached the host block: 0 once they did, 1 if a fatal
  // error was recorded first, 2 after timeout_s. One crossing for the whole wait, without the GIL:
  // poll for 2 ms (the GPU finishing the work queued before notify is the common case), then
  // yield the core until 20 ms, then sleep, backing off to 1 ms (a slow peer keeps no core busy).
  int wait_tag(long long tag, double timeout_s) const {
    const HostInfo* h = host();
    if (h->tag == tag) {
      std::atomic_thread_fence(std::memory_order_acquire);  // the counts were written before the tag
      return 0;
    }
    py::gil_scoped_release nogil;
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    long long pause_us = 50;
    for (unsigned long long spins = 1;; ++spins) {
      if (h->tag == tag) {
        std::atomic_thread_fence(std::memory_order_acquire);
        return 0;
      }
      if (spins & 255) continue;
      const int err = h->error;
      if (err != kErrNone && error_is_fatal(err)) return 1;
      const double s = std::chrono::duration<double>(clock::now() - start).count();
      if (s > timeout_s) return 2;
      if (s > 0.02) {
        std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
        pause_us = std::min<long long>(1000, pause_us * 2);
      } else if (s > 0.002) {
        std::this_thread::yield();
      }
    }
  }
  // wait_tag, then (0, host_counts) once the sizes arrived, else (1 or 2, None) (notify_call ends with it)
  py::tuple wait_counts(long long tag, double timeout_s, int L) const {
    const int waited = wait_tag(tag, timeout_s);
    return py::make_tuple(waited, waited == 0 ? py::object(host_counts(L)) : py::object(py::none()));
  }
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
    d["bad_slot"] = (long long)h->bad_slot;
    d["counts"] = counts;
    return d;
  }
  int num_aborted() const { return host()->num_aborted; }
  // Where HostInfo::error lies in this process (mapped host memory): the entry check of every call
  // reads it there (ctypes) and crosses into take_error only when it is set.
  long long error_address() const { return reinterpret_cast<long long>(&host()->error); }
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
  int rank() const { return rank_; }

 private:
  // One rank-major block: x, FP8 scales, top-k ids (int64), weights, each section Pool-aligned.
  struct RankMajorBlock {
    long long bx, bs, bi, bw, bsrc, total;
    RankMajorBlock(int rows, int row_bytes, int scale_cols, int K, bool has_w, bool has_src)
        : bx(align((long long)rows * row_bytes)), bs(align((long long)rows * scale_cols * 4)),
          bi(align((long long)rows * K * 8)), bw(has_w ? align((long long)rows * K * 4) : 0),
          bsrc(has_src ? align((long long)rows * 4) : 0), total(bx + bs + bi + bw + bsrc) {}
    static long long align(long long n) { return (n + Pool::kAlign - 1) / Pool::kAlign * Pool::kAlign; }
  };

  // The tensors and region offsets of the block at `off`; `keep` lives as long as any of the
  // tensors (-1 / none for sections the block does not have).
  RankMajor rank_major_tensors(long long off, const RankMajorBlock& b, int rows, int hidden, at::ScalarType xt,
                               int scale_cols, int K, bool has_w, bool has_src, std::shared_ptr<void> keep) {
    auto make = [&](long long o, std::vector<int64_t> shape, at::ScalarType st) {
      return region_tensor(region_->base() + o, shape, st, region_->device(), keep);
    };
    RankMajor m;
    m.x = make(off, {rows, hidden}, xt);
    if (scale_cols > 0) m.scales = make(off + b.bx, {rows, scale_cols}, at::kFloat);
    m.idx = make(off + b.bx + b.bs, {rows, K}, at::kLong);
    if (has_w) m.w = make(off + b.bx + b.bs + b.bi, {rows, K}, at::kFloat);
    const long long src_off = off + b.bx + b.bs + b.bi + b.bw;
    if (has_src) m.src = make(src_off, {rows}, at::kInt);
    m.offsets = {off, scale_cols > 0 ? off + b.bx : -1, off + b.bx + b.bs, has_w ? off + b.bx + b.bs + b.bi : -1,
                 has_src ? src_off : -1};
    return m;
  }

  void alive() const { TORCH_CHECK(region_ && region_->peers_open(), "megatron_ep: this runtime was closed"); }
  HostInfo* host() const {
    TORCH_CHECK(region_, "megatron_ep: this runtime was closed");
    return region_->host();
  }

  std::shared_ptr<Region> region_;
  std::shared_ptr<Pool> pool_;
  RegionLayout lay_{};
  c10::optional<at::cuda::CUDAStream> comm_;
  cudaEvent_t order_ = nullptr;
  int rank_ = 0, num_ranks_ = 1;
  HostClock clock_;
  unsigned long long timeout_ns_ = 0;
  long long notified_tag_ = 0;
};

}  // namespace mep
