// Tensor helpers of the torch bindings: for the NVSHMEM paths' (low_latency/binding.cpp,
// internode/binding.cpp, nvshmem/symmetric_memory.h) one wording for a failed CUDA call and for a
// tensor that is not what a kernel reads (Python checks every argument first; these only guard
// against memory errors); for every binding, tensors of one lifetime in one allocation.
#pragma once

#include <cuda_runtime.h>
#include <c10/util/strides.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

namespace mep {

// `path` names the path in the message ("low-latency", "internode").
inline void cuda_ok(cudaError_t e, const char* path, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "megatron_ep ", path, ": ", what, ": ", cudaGetErrorString(e));
}

// The data of a contiguous CUDA tensor of `dtype`, as T*.
template <typename T>
T* ptr(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), name, " must be a contiguous CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  return static_cast<T*>(t.data_ptr());
}

// A tensor of `dtype` over `base`'s storage: these sizes and strides, from `offset` elements of
// `dtype` past the storage's start (arena_tensors' sections, alias's views).
inline torch::Tensor on_storage(const torch::Tensor& base, caffe2::TypeMeta dtype, c10::IntArrayRef sizes,
                                c10::IntArrayRef strides, int64_t offset) {
  torch::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), dtype);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  t.unsafeGetTensorImpl()->set_storage_offset(offset);
  return t;
}

// Tensors that live and die together (a handle's state) in one allocation: one call into the
// caching allocator instead of one per tensor (each costs microseconds of host time), every
// tensor an alias of the one storage, each section 256-byte aligned. The storage goes back when
// the last of them dies, so only for tensors of one lifetime.
struct ArenaPart {
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
};
inline std::vector<torch::Tensor> arena_tensors(const std::vector<ArenaPart>& parts, const at::TensorOptions& opts) {
  constexpr int64_t kAlign = 256;
  std::vector<int64_t> offsets(parts.size());
  int64_t total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    int64_t n = (int64_t)c10::elementSize(parts[i].dtype);
    for (const int64_t d : parts[i].sizes) n *= d;
    offsets[i] = total;
    total += (n + kAlign - 1) / kAlign * kAlign;
  }
  const torch::Tensor block = at::empty({std::max<int64_t>(total, 1)}, opts.dtype(at::kByte));
  std::vector<torch::Tensor> out;
  out.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i)
    out.push_back(on_storage(block, c10::scalarTypeToTypeMeta(parts[i].dtype), parts[i].sizes,
                             c10::contiguous_strides(parts[i].sizes),
                             offsets[i] / (int64_t)c10::elementSize(parts[i].dtype)));
  return out;
}

// A tensor over `base`'s storage with these sizes and strides, `offset` elements past base's
// start: what narrow / select / a column give, without the ATen dispatcher (a view through it costs
// a microsecond or more of host time, and a new routing made ten). No view record is kept: for the
// integer outputs and handle state of one call, which never carry autograd history.
inline torch::Tensor alias(const torch::Tensor& base, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                           int64_t offset) {
  return on_storage(base, base.dtype(), sizes, strides, base.storage_offset() + offset);
}
// c[:n] and c[n] of a contiguous 1-d tensor; column j of a contiguous [rows, cols] one
inline torch::Tensor head(const torch::Tensor& c, int64_t n) { return alias(c, {n}, {1}, 0); }
inline torch::Tensor element(const torch::Tensor& c, int64_t n) { return alias(c, {}, {}, n); }
inline torch::Tensor column(const torch::Tensor& m, int64_t j) { return alias(m, {m.size(0)}, {m.size(1)}, j); }

}  // namespace mep
