"""DeepGEMM fed by our dispatch on virtual ranks (R processes on one GPU, cuda backend): an FP8
expert-major dispatch's rows and scales straight into DeepGEMM's FP8 contiguous GEMM, and the
chunked experts on DeepGEMM with SMs left to the communication kernels (worker bodies and what
they check: tests/support/deepgemm_cases.py). The single-process DeepGEMM cases are in
tests/unit/test_experts.py. Needs deep_gemm importable (scripts/env/build_deepgemm.sh; the gate builds it
when the tree is there), else every test here skips saying so."""

import pytest
import torch

from distpool import flat
from gpu_pools import GPU_MARKS, GpuPools, closing
from megatron_ep.experts import backends as B

pytestmark = GPU_MARKS + [pytest.mark.skipif(
    not torch.cuda.is_available() or B.deep_gemm_module() is None,
    reason="needs a GPU and deep_gemm importable (scripts/env/build_deepgemm.sh)")]

POOLS = GpuPools()
pool_ = POOLS.get
_close_pools = closing(POOLS)


@pytest.mark.parametrize("R", [2, 4])
def test_fp8_dispatch_into_deepgemm(R):
    """FP8 rows + per-128 scales of an expert-major dispatch -> DeepGEMM's FP8 contiguous GEMM, the
    dispatch's own tensors, against fp64; nothing lost or duplicated per expert."""
    import deepgemm_cases as dc

    errors = flat(pool_(R).run(dc.run_fp8_dispatch_into_deepgemm_cases, dc.fp8_cases(R), timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_chunked_experts_on_deepgemm(R):
    """chunked_expert_mlp on DeepGEMM with comm_sms left free, forward and backward, against one
    round on DeepGEMM and on torch's grouped_mm."""
    import deepgemm_cases as dc

    errors = flat(pool_(R).run(dc.run_chunked_on_deepgemm_cases, dc.chunked_cases(R), timeout=300))
    assert not errors, "\n".join(errors[:20])
