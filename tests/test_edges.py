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
