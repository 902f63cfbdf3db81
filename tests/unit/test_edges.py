"""Edges that used to give wrong answers without an error, on the torch backend (CPU, gloo):
a cached dispatch returning the first dispatch's tensors, second derivatives of dispatch and
combine, an FP8 dispatch's weights' gradient, a previous_event of the wrong kind, two threads on
one Buffer (tests/support/edge_cases.py; the cuda backend runs the same bodies in
tests/cuda/test_cuda_intranode.py)."""

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
    from megatron_ep.core import checks as C

    E = 4
    idx = torch.tensor([[0, 1, 2], row])
    if slot is None:
        C.check_topk_values(idx, E)  # a row of unused slots and one expert is fine
        return
    with pytest.raises(ValueError) as host:
        C.check_topk_values(idx, E)
    assert str(C.bad_slot_error(idx, 3 + slot, E)) == str(host.value)


def test_a_cuda_handle_state_copies_without_its_native_binding():
    """copy.deepcopy of a dispatch handle's intranode state (megatron_ep.deep_ep's handles copy,
    and so may a caller's) copies the tensors and leaves the compiled binding to be made again
    from the copy at its first use: a compiled object does not copy."""
    import copy

    import torch
    from megatron_ep.backends.cuda.paths.intranode import IntranodeState

    counts = torch.arange(5)
    st = IntranodeState(rank_pos=torch.zeros(2, 2, dtype=torch.int32), slot_pos=torch.zeros(2, 1, dtype=torch.int32),
                        recv_info=torch.zeros(16, dtype=torch.int32), row_limits=torch.zeros(2, dtype=torch.int32),
                        tokens_per_expert=counts[:4], num_dropped=counts[4], num_rows=3, num_perm_rows=None,
                        counts=[1, 2], topk_idx=torch.zeros(2, 1, dtype=torch.int64), device_counts=counts,
                        native=object(), fitted=(8, 2))
    dup = copy.deepcopy(st)
    assert dup.native is None and dup.fitted == (8, 2) and dup.counts == [1, 2] and dup.num_rows == 3
    assert torch.equal(dup.device_counts, counts) and dup.device_counts.data_ptr() != counts.data_ptr()
