"""Faults of collective calls on the torch backend (gloo, CPU): ranks that disagree, a check that
fails on one rank, unchecked bad ids. Every rank raises a named error within 2 s (or the result
is exact), and the buffer works for the next agreed call. The cuda backend runs the same bodies
on the GPU (tests/cuda/test_cuda_intranode.py)."""

import pytest

import fault_cases
from distpool import flat


@pytest.mark.parametrize("R", [2, 4])
def test_faults(pools, R):
    errors = flat(pools(R).run(fault_cases.run_all_faults, timeout=300))
    assert not errors, "\n".join(errors[:30])


def test_fuzz_harness(pools):
    """The GPU fuzz's harness on the reference against itself (a few cases, incl. drops)."""
    import cases

    errors = flat(pools(2).run(cases.run_fuzz, dict(cases=25, seed=424242), backend="torch", device="cpu", timeout=600))
    assert not errors, "\n".join(errors[:20])


def test_check_inputs_levels():
    """Buffer(check_inputs=...) takes True, False or "no_sync"; anything else is a TypeError naming it."""
    from megatron_ep.core import checks as C

    assert C.check_inputs_level(True) == C.IDS_CHECKED
    assert C.check_inputs_level(False) == C.IDS_UNCHECKED
    assert C.check_inputs_level("no_sync") == C.IDS_CHECKED_FREE
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="check_inputs"):
            C.check_inputs_level(bad)
