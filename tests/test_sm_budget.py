"""The SM budget of the cuda kernels, decided in one place (megatron_ep/cuda/runtime.py): the default
split, the resident limit, and the block count each path's kernels get from CudaRuntime.blocks.
Runs without a GPU: the rule is arithmetic on the runtime's fields."""

import pytest

from megatron_ep.cuda.runtime import CudaRuntime, default_num_sms, max_num_sms


def _runtime(num_sms, ranks_per_device=1, sm_count=132):
    rt = CudaRuntime.__new__(CudaRuntime)  # the fields blocks() reads, without a GPU
    rt.local_sms = max_num_sms(ranks_per_device, sm_count)
    rt.num_sms = num_sms or default_num_sms(ranks_per_device, sm_count)
    return rt


@pytest.mark.parametrize("ranks_per_device", [1, 2, 4, 8])
def test_default_fits_the_resident_limit(ranks_per_device):
    limit = max_num_sms(ranks_per_device, 132)
    assert 1 <= default_num_sms(ranks_per_device, 132) <= limit and limit * ranks_per_device <= 132


def test_blocks_of_each_path():
    """Normal paths: Buffer(num_sms=) or the default split, capped by the path's kernels; the
    low-latency kernels: every SM the rank may keep resident, whatever num_sms says."""
    given = _runtime(num_sms=10)
    assert given.blocks(64) == 10 and given.blocks(4) == 4
    assert given.blocks(1024, latency_bound=True) == max_num_sms(1, 132)
    default = _runtime(num_sms=None)
    assert default.blocks(1024) == default.num_sms < default.blocks(1024, latency_bound=True)
    assert _runtime(num_sms=None, ranks_per_device=8).blocks(1024, latency_bound=True) == max_num_sms(8, 132)
    assert _runtime(num_sms=None, ranks_per_device=8).blocks(8, latency_bound=True) == 8
