"""The torch reference backend against the dense oracle, on 1, 2, 4 and 8 gloo processes."""

import pytest

import cases
from case_lists import normal_cases
from distpool import flat


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_normal_path(pools, R):
    errors = flat(pools(R).run(cases.run_normal_cases, normal_cases(R)))
    assert not errors, "\n".join(errors[:20])
