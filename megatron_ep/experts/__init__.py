"""Grouped-GEMM expert MLPs fed directly by megatron_ep's dispatch layouts.

* `grouped_linear(x, w, layout)`: y[i] = x[i] @ w[e(i)]^T over the expert-major layout
  (DeepGEMM -> torch grouped_mm -> per-expert loop), differentiable in x and w;
* `grouped_linear_masked` / `grouped_linear_fp8`: the low-latency layout and FP8 inputs;
* `expert_mlp` / `expert_mlp_masked`: fc1 -> activation (GLU) x probs -> fc2;
* `GroupedGemmExperts`: the same as Megatron's `experts` submodule (needs megatron-core);
* `chunked_expert_mlp`: dispatch, `expert_mlp` and combine in pipelined token chunks, the
  communication of one chunk under the GEMMs of another (forward and backward).
"""

from .backends import BACKENDS, choose_backend, grouped_linear
from .layout import GroupedLayout
from .fp8_weights import per_block_cast_to_fp8
from .masked import grouped_linear_fp8, grouped_linear_masked
from .mlp import expert_mlp, expert_mlp_masked
from .overlap import chunk_bounds, chunked_expert_mlp


def __getattr__(name):  # the Megatron module imports megatron-core; only load it when asked
    if name == "GroupedGemmExperts":
        from .megatron_module import GroupedGemmExperts

        return GroupedGemmExperts
    raise AttributeError(name)


__all__ = ["BACKENDS", "GroupedGemmExperts", "GroupedLayout", "choose_backend", "chunk_bounds", "chunked_expert_mlp",
           "expert_mlp", "expert_mlp_masked",
           "grouped_linear", "grouped_linear_fp8", "grouped_linear_masked", "per_block_cast_to_fp8"]
