"""FP8 helpers against the independent oracle cast (tests/oracle.py) and their contract."""

import pytest
import torch

import megatron_ep as mep
from oracle import fp8_cast


@pytest.mark.parametrize("H", [128, 7168])
def test_cast_matches_oracle_bit_exact(H):
    g = torch.Generator().manual_seed(H)
    x = (torch.randn((33, H), generator=g) * torch.rand((33, 1), generator=g) * 50).to(torch.bfloat16)
    x[3] = 0  # an all-zero row: scale floors at 1e-4 / 448, data 0
    q, s = mep.per_token_cast_to_fp8(x)
    q_ref, s_ref = fp8_cast(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (33, H // 128)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    back = mep.per_token_cast_back(q, s, torch.float32)
    err = (back - x.float()).abs() / (x.float().abs().amax(dim=1, keepdim=True) + 1e-6)
    assert err.max() < 2 ** -4  # e4m3 keeps 3 mantissa bits


def test_round_scale_gives_powers_of_two_that_cover_amax():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn((17, 256), generator=g) * 30).to(torch.bfloat16)
    q, s = mep.per_token_cast_to_fp8(x, round_scale=True)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5), "scales must be exact powers of two"
    amax = x.float().view(17, 2, 128).abs().amax(-1).clamp(min=1e-4)
    assert torch.all(s >= amax / 448) and torch.all(s < 2 * amax / 448)
    assert torch.isfinite(q.float()).all()
    back = mep.per_token_cast_back(q, s, torch.float32)
    assert ((back - x.float()).abs().max() / x.float().abs().max()) < 2 ** -3


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 128"):
        mep.per_token_cast_to_fp8(torch.zeros((2, 100), dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        mep.per_token_cast_to_fp8(torch.zeros((2, 128), dtype=torch.int32))
    with pytest.raises(ValueError, match="scales must have shape"):
        mep.per_token_cast_back(torch.zeros((2, 128), dtype=torch.float8_e4m3fn), torch.ones((2, 2)))
