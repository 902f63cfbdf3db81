"""Hostile use on the torch backend (CPU, gloo): two Buffers mixed up, an allocation failing on
one rank mid-call, a call on a Buffer one rank destroyed, arguments refused by name
(tests/support/hostile_cases.py; the cuda backend runs the same cases in tests/cuda/test_cuda_intranode.py)."""

import pytest

import hostile_cases as hc
from distpool import flat


@pytest.mark.parametrize("R", [2, 4])
def test_hostile_use(pools, R):
    errors = flat(pools(R).run(hc.run_all, backend="torch", device="cpu", timeout=300))
    assert not errors, "\n".join(errors[:30])
