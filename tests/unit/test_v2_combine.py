"""The torch backend's combine with biases against DeepEP V2's reference combine, bit for bit
(tests/support/v2_combine_cases.py), on 1, 2 and 4 gloo processes; and the bias's checks."""

import pytest

import v2_combine_cases as V
from distpool import flat


@pytest.mark.parametrize("R", [1, 2, 4])
def test_v2_combine_order(pools, R):
    errors = flat(pools(R).run(V.run_v2_combine_cases, V.v2_combine_cases(R)))
    assert not errors, "\n".join(errors[:20])


def test_v2_reference_restated():
    """The restated reference on hand-made tokens, where the order and the rounding show."""
    import torch

    # fp32, three ranks of one expert each: rank 2 (slot 0) joins first, then rank 1 (slot 1),
    # then rank 0 (slot 2): 2^24 + 1 + 1 = 2^24 (each +1 a tie, to even); by rank it is 2^24 + 2
    y = torch.tensor([[[2.0 ** 24], [1.0], [1.0]]])
    idx = torch.tensor([[2, 1, 0]])
    assert V.v2_reference(y, idx, 3, 3, None, reduce_in_local=True).item() == 2.0 ** 24
    # bf16: rank 0's slots 0 and 1 give 1 + 2^-8, rounded to 1 (a tie, to even) before rank 1's
    # 2^-8 joins: 1; unrounded the sum is 1 + 2^-7
    y = torch.tensor([[[1.0], [2.0 ** -8], [2.0 ** -8]]]).to(torch.bfloat16)
    idx = torch.tensor([[0, 1, 2]])  # E=4, R=2: experts 0, 1 on rank 0, 2 on rank 1
    assert V.v2_reference(y, idx, 2, 4, None, reduce_in_local=True).item() == 1.0
    assert V.v2_reference(y, idx, 2, 4, None, reduce_in_local=False).item() == 1.0 + 2.0 ** -7
    # the biases start the sum: b0 + b1 in fp32 first
    b = (torch.tensor([[2.0 ** -8]]).to(torch.bfloat16), torch.tensor([[2.0 ** -8]]).to(torch.bfloat16))
    y = torch.tensor([[[1.0]]]).to(torch.bfloat16)
    assert V.v2_reference(y, torch.tensor([[0]]), 1, 1, b, reduce_in_local=True).item() == 1.0 + 2.0 ** -7


@pytest.mark.parametrize("R", [2])
def test_bias_refusals(pools, R):
    errors = flat(pools(R).run(V.run_bias_refusals))
    assert not errors, "\n".join(errors[:20])
