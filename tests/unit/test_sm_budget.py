"""The SM budget of the cuda kernels, decided in one place (megatron_ep/backends/cuda/sm_budget.py): the
default split, the resident limit, and the blocks every launch of every path gets from
SmBudget.blocks(kind). Runs without a GPU: the rule is arithmetic."""

import pytest

from megatron_ep.backends.cuda.sm_budget import KINDS, PUSH_MAX_SMS_EP2, SmBudget, default_num_sms, max_num_sms


@pytest.mark.parametrize("ranks_per_device", [1, 2, 4, 8])
def test_default_fits_the_resident_limit(ranks_per_device):
    limit = max_num_sms(ranks_per_device, 132)
    assert 1 <= default_num_sms(ranks_per_device, 132) <= limit and limit * ranks_per_device <= 132


def test_blocks_of_each_kind():
    """Normal paths' copies: Buffer(num_sms=) or the default split, capped by the path's kernels;
    the low-latency kernels and the local ones: every SM the rank may keep resident, whatever
    num_sms says; the push at EP 2 on GPUs of their own: at most PUSH_MAX_SMS_EP2."""
    given = SmBudget(4, 1, 132, num_sms=10)
    assert given.blocks("copy", 64) == 10 and given.blocks("copy", 4) == 4 and given.blocks("copy") == 10
    assert given.blocks("latency", 1024) == given.blocks("local") == max_num_sms(1, 132)
    assert given.blocks("push") == 10
    default = SmBudget(4, 1, 132)
    assert default.blocks("copy", 1024) == default.num_sms < default.blocks("latency", 1024)
    shared = SmBudget(8, 8, 132)
    assert shared.blocks("latency", 1024) == max_num_sms(8, 132) and shared.blocks("latency", 8) == 8
    assert SmBudget(2, 1, 132, num_sms=24).blocks("push") == PUSH_MAX_SMS_EP2
    assert SmBudget(2, 2, 132, num_sms=24).blocks("push") == 24  # virtual ranks: uncapped
    assert set(given._of) == set(KINDS)
    assert given.normal == (given.blocks("copy"), given.blocks("push"), given.blocks("local"))
    with pytest.raises(KeyError):
        given.blocks("other")


def test_set_moves_every_kind_that_follows_num_sms():
    b = SmBudget(2, 1, 132, num_sms=8)
    assert (b.blocks("copy"), b.blocks("push")) == (8, 8)
    b.set(20)
    assert (b.blocks("copy"), b.blocks("push"), b.blocks("local")) == (20, PUSH_MAX_SMS_EP2, 132) == b.normal
    b.set(None)
    assert b.blocks("copy") == default_num_sms(1, 132)


@pytest.mark.parametrize("bad", [0, 133, 2.5, "8"])
def test_num_sms_outside_the_resident_limit_is_refused(bad):
    with pytest.raises(ValueError, match=r"each rank may use 1\.\.132 SMs"):
        SmBudget(2, 1, 132, num_sms=bad)
