"""megatron_ep.experts.chunked_expert_mlp on the torch backend (CPU, gloo): the pipelined chunks
give one round's outputs and gradients (tests/chunked_experts_cases.py)."""

import pytest

import chunked_experts_cases as cc
from megatron_ep.experts import chunk_bounds


@pytest.mark.parametrize("R", [2, 4])
def test_chunked_matches_one_round(pools, R):
    errors = [e for rank in pools(R).run(cc.run_chunked_experts_cases, cc.cases(R)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_chunk_bounds_cover_every_token_once():
    for T in (0, 1, 5, 16, 17):
        for n in (1, 2, 3, 8):
            b = chunk_bounds(T, n)
            assert len(b) == n and b[0][0] == 0 and b[-1][1] == T
            assert all(b[i][1] == b[i + 1][0] for i in range(n - 1))
            assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


def test_bad_chunks_raise():
    import torch

    from megatron_ep.experts import chunked_expert_mlp

    x, idx, probs = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        chunked_expert_mlp(None, x, idx, probs, None, None, 2, chunks=0)
    with pytest.raises(TypeError, match="chunks must be an int"):
        chunked_expert_mlp(None, x, idx, probs, None, None, 2, chunks=2.0)
    with pytest.raises(ValueError, match="probs must have"):
        chunked_expert_mlp(None, x, idx, torch.zeros(2, 2), None, None, 2)
