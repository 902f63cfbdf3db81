// One wording for a failed CUDA runtime call in host code that cannot use TORCH_CHECK (the
// region, and the nvcc-compiled NVSHMEM files): "megatron_ep[ <path>]: <what>: <CUDA error>".
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace mep {

inline void check_cuda(cudaError_t err, const char* what, const char* path = nullptr) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("megatron_ep") + (path ? std::string(" ") + path : std::string()) + ": " + what +
                             ": " + cudaGetErrorString(err));
}

}  // namespace mep
