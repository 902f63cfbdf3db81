// Loads every intranode and runtime kernel up front (and sets their shared-memory limits): a
// kernel loaded lazily at its first launch could wait behind a peer's spinning kernel.

#include "intranode/api.h"

namespace mep {

void prepare_kernels() {
  prepare_notify_kernels();
  prepare_dispatch_kernels();
  prepare_combine_kernels();
  prepare_layout_kernels();
  prepare_runtime_kernels();
}

}  // namespace mep
