"""Edges that used to give wrong answers without an error, on the torch backend (CPU, gloo):
a cached dispatch returning the first dispatch's tensors, second derivatives of dispatch and
combine, an FP8 dispatch's weights' gradient, a previous_event of the wrong kind, two threads on
one Buffer (tests/edge_cases.py; the cuda backend runs the same bodies in
tests/test_cuda_intranode.py)."""

import pytest

import cases
import edge_cases as ec
from distpool import flat


@pytest.mark.parametrize("R", [2, 3])
def test_edges(pools, R):
    errors = flat(pools(R).run(ec.run_all, backend="torch", device="cpu", timeout=300))
    assert not errors, "\n".join(errors[:30])


@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("permute", [False, True])
def test_gradgradcheck(pools, R, permute):
    cfg = dict(seed=17 + R, E=2 * R, K=2, H=3, T=2, permute=permute, align=4 if permute else 1)
    errors = flat(pools(R).run(cases.run_gradcheck, cfg, order=2, timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("row,slot", [([0, 9, 1], 1), ([0, 1, -3], 2), ([2, 1, 2], 2), ([-1, -1, 3], None)])
def test_a_bad_slot_found_on_the_device_is_worded_as_the_host_check(row, slot):
    """The cuda intranode path's notify reports the first bad slot (an id outside [-1, E), or an
    expert an earlier slot of its token names) and the host words it (checks.bad_slot_error) as
    the host check words the same defect (checks.check_topk_values)."""
    import torch
    from megatron_ep import checks as C

    E = 4
    idx = torch.tensor([[0, 1, 2], row])
    if slot is None:
        C.check_topk_values(idx, E)  # a row of unused slots and one expert is fine
        return
    with pytest.raises(ValueError) as host:
        C.check_topk_values(idx, E)
    assert str(C.bad_slot_error(idx, 3 + slot, E)) == str(host.value)
