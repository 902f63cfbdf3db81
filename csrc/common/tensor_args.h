// Argument helpers of the NVSHMEM paths' torch bindings (low_latency/binding.cpp,
// internode/binding.cpp, nvshmem/symmetric_memory.h): one wording for a failed CUDA call and for a
// tensor that is not what a kernel reads. Python checks every argument first; these only guard
// against memory errors.
#pragma once

#include <cuda_runtime.h>
#include <torch/extension.h>

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

}  // namespace mep
