"""LogFMT-10 (megatron_ep.core.logfmt), the low-latency combine's wire format, as a receiver decodes it:
which blocks it encodes, how close the decoded values are, and the values it keeps exact."""

import pytest
import torch

from megatron_ep.core import logfmt as F


def _rows(seed, scale=0.1, rows=4, H=512):
    return (torch.randn((rows, H), generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def test_encoded_blocks_decode_within_half_a_step():
    x = _rows(0)
    x[0, :128:9] = 0  # a zero: amin clips at 2^-32 amax, the widest step
    y = F.roundtrip(x).double()
    v = x.double().view(-1, F.BLOCK)
    a = v.abs()
    amax = a.amax(1, keepdim=True)
    lo = torch.maximum(torch.log2(a.amin(1, keepdim=True)), torch.log2(amax) - F.CLIP)  # a zero: amax - 32
    step = (torch.log2(amax) - lo) / (F.LEVELS - 2)
    bound = (torch.exp2(step / 2) - 1).expand_as(v) + 1e-6  # relative, per value
    rel = ((y.view_as(v) - v).abs() / a.clamp(min=1e-30))
    nz = a > 0
    assert bool((rel[nz] <= bound[nz]).all())
    assert bool((y.view_as(v)[~nz] == 0).all())
    assert torch.equal(torch.sign(y.view_as(v)[nz]), torch.sign(v[nz]))
    assert not torch.equal(y, x.double())  # the blocks were encoded


def test_a_blocks_extremes_decode_exactly():
    x = _rows(1)
    y = F.roundtrip(x).view(-1, F.BLOCK)
    v = x.float().view(-1, F.BLOCK)
    i_max, i_min = v.abs().argmax(1), v.abs().argmin(1)
    rows = torch.arange(v.shape[0])
    assert torch.allclose(y[rows, i_max], v[rows, i_max], rtol=1e-5, atol=0)
    assert torch.allclose(y[rows, i_min], v[rows, i_min], rtol=1e-5, atol=0)


@pytest.mark.parametrize("what", ["at_least_one", "all_equal", "all_zero", "nan", "inf"])
def test_blocks_that_stay_bf16(what):
    x = _rows(2, rows=1, H=256)
    block = {"at_least_one": lambda b: b.mul_(40.0), "all_equal": lambda b: b.fill_(0.25),
             "all_zero": lambda b: b.zero_(), "nan": lambda b: b.index_fill_(0, torch.tensor([3]), float("nan")),
             "inf": lambda b: b.index_fill_(0, torch.tensor([3]), float("inf"))}[what]
    block(x[0, :128])
    y = F.roundtrip(x)
    assert torch.equal(y[0, :128].nan_to_num(), x[0, :128].float().nan_to_num())  # kept bf16
    assert not torch.equal(y[0, 128:], x[0, 128:].float())  # the other block encoded


def test_refuses_what_it_cannot_encode():
    with pytest.raises(TypeError, match="bf16"):
        F.roundtrip(torch.zeros((1, 128)))
    with pytest.raises(ValueError, match="multiple of 128"):
        F.roundtrip(torch.zeros((1, 96), dtype=torch.bfloat16))
