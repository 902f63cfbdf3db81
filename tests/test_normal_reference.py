"""The torch reference backend against the dense oracle, on 1, 2, 4 and 8 gloo processes."""

import pytest

import cases
from case_lists import normal_cases


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_normal_path(pools, R):
    errors = pools(R).run(cases.run_normal_cases, normal_cases(R))
    flat = [e for rank_errors in errors for e in rank_errors]
    assert not flat, "\n".join(flat[:20])
