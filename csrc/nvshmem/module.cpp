// megatron_ep._C_nvshmem: the module of the NVSHMEM paths. NVSHMEM's start-up (this folder) and
// each path's binding, registered here: low-latency (csrc/low_latency/binding.cpp) and the
// internode RDMA domain (csrc/internode/binding.cpp). The paths depend on nvshmem/, not the
// other way round: only this entry names them.
#include <torch/extension.h>

#include <string>

#include "nvshmem/bootstrap.h"

namespace mep {
void bind_low_latency(py::module_& m);  // csrc/low_latency/binding.cpp
void bind_internode(py::module_& m);    // csrc/internode/binding.cpp
}  // namespace mep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ep NVSHMEM paths: low-latency (csrc/low_latency/), internode RDMA domain (csrc/internode/)";
  m.def("unique_id", [] { return py::bytes(mep::sym_unique_id()); });
  m.def("init", [](py::bytes uid, int rank, int nranks, int device) { mep::sym_init(std::string(uid), rank, nranks, device); });
  m.def("my_pe", &mep::sym_my_pe);
  m.def("n_pes", &mep::sym_n_pes);
  mep::bind_internode(m);
  mep::bind_low_latency(m);
}
