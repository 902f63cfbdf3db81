"""UE8M0 scales (megatron_ep.core.fp8.pack_ue8m0 / unpack_ue8m0): the byte layout DeepEP and DeepGEMM
read, checked against frexp, and what the packer refuses."""

import pytest
import torch

from megatron_ep.core.fp8 import column_major, pack_ue8m0, per_token_cast_to_fp8, unpack_ue8m0


def _pow2_scales(rows=5, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((rows, n * 128), generator=g) * 10.0 ** torch.randint(-6, 6, (rows, 1), generator=g)).bfloat16()
    return per_token_cast_to_fp8(x, round_scale=True)[1]


def test_bytes_are_the_exponents_little_endian():
    s = _pow2_scales()
    packed = pack_ue8m0(s)
    assert packed.dtype == torch.int32 and packed.shape == (5, 2)
    _, exponent = torch.frexp(s)  # s = 0.5 * 2**exponent: biased exponent byte = exponent - 1 + 127
    for j in range(8):
        byte = (packed[:, j // 4] >> (8 * (j % 4))) & 0xFF
        assert torch.equal(byte, (exponent[:, j] + 126).to(torch.int32))


def test_unpack_inverts_pack():
    s = _pow2_scales(rows=3, n=16, seed=1)
    assert torch.equal(unpack_ue8m0(pack_ue8m0(s)), s)


def test_refuses_scales_that_are_not_powers_of_two():
    s = per_token_cast_to_fp8(torch.randn((2, 512)).bfloat16(), round_scale=False)[1]
    with pytest.raises(ValueError, match="powers of two"):
        pack_ue8m0(s)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_ue8m0(_pow2_scales(n=2))


def test_column_major_keeps_values():
    t = torch.arange(2 * 6 * 3, dtype=torch.int32).view(2, 6, 3)
    c = column_major(t)
    assert torch.equal(c, t) and c.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("n", [4, 16])  # one int32 per row (hidden 512), and four
def test_unpack_reads_column_major_slices(n):
    """The dispatch hands scales column-major per expert ([L, rows, n/4] over [L, n/4, rows]):
    a slice of one expert's first rows unpacks as the rows' own scales, also with one int32 per
    row: torch counts that slice as contiguous with a last stride above 1, and some torch
    versions (2.11) refuse to view it as bytes."""
    s = _pow2_scales(rows=6, n=n, seed=2).view(2, 3, n)
    packed = column_major(pack_ue8m0(s))
    for e in range(2):
        assert torch.equal(unpack_ue8m0(packed[e, :2]), s[e, :2])
