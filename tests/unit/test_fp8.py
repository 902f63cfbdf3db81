"""FP8 helpers against the independent oracle cast (tests/support/oracle.py) and their contract."""

import math

import pytest
import torch

import megatron_ep as mep
from megatron_ep.core import fp8
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


# ---------------------------------------------------------------------------------------------
# The casts without a full fp32 copy of their input, byte for byte against the whole-tensor
# formulas they replace (x.float() of everything, then |x|'s block maxima and the division)

def _whole_tensor_token_cast(x, round_scale):
    T, H = x.shape
    blocks = x.float().view(T, H // 128, 128)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-4) / 448.0
    if round_scale:
        scale = fp8.round_scale_pow2(scale)
    return (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(T, H), scale


def _whole_tensor_block_cast(w, block=128):
    G, N, K = w.shape
    pn, pk = -N % block, -K % block
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    blocks = wp.view(G, (N + pn) // block, block, (K + pk) // block, block)
    scale = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-4) / 448.0
    q = (blocks / scale).to(torch.float8_e4m3fn).view(G, N + pn, K + pk)[:, :N, :K]
    return q, scale.view(G, (N + pn) // block, (K + pk) // block)


def _hard_values(shape, dtype, seed):
    """Normal values over a wide range of magnitudes per row (dtype's own range: tiny and huge),
    with all-zero, signed-zero, single-value, inf and NaN rows, and values past fp32's range in
    float64 (they round to inf in fp32)."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    lo, hi = max(torch.finfo(dtype).tiny, 1e-45), min(info.max, 1e300)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    logmag = torch.empty(shape[:-1] + (1,), dtype=torch.float64).uniform_(math.log(lo), math.log(hi) - 1, generator=g)
    x = x * logmag.exp()
    rows = x.view(-1, shape[-1])
    n = rows.shape[0]
    if n > 6:
        rows[0] = 0
        rows[1] = -0.0
        rows[2] = 0
        rows[2, -1] = -3.0
        rows[3, 5] = float("inf")
        rows[4, 7] = float("nan")
        rows[5] *= 1e-30  # mostly below the 1e-4 floor, or subnormal
        rows[6, :3] = info.max
    return x.to(dtype)


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("T, H", [(0, 128), (1, 128), (37, 384), (130, 1024)])
@pytest.mark.parametrize("round_scale", [False, True])
def test_token_cast_bytes_equal_the_whole_tensor_formula(monkeypatch, dtype, T, H, round_scale):
    monkeypatch.setattr(fp8, "CAST_CHUNK_ELEMS", 5 * H)  # several chunks, the last one short
    x = _hard_values((T, H), dtype, seed=T * H)
    q, s = mep.per_token_cast_to_fp8(x, round_scale=round_scale)
    q_ref, s_ref = _whole_tensor_token_cast(x, round_scale)
    assert q.shape == (T, H) and s.shape == (T, H // 128) and s.is_contiguous()
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(_bits(s), _bits(s_ref))


def test_token_cast_refuses_fp16_as_before():
    with pytest.raises(TypeError, match="dtype"):
        mep.per_token_cast_to_fp8(torch.ones((2, 128), dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("G, N, K, chunk", [(3, 256, 384, 128 * 384), (2, 200, 300, 128 * 384),
                                            (5, 130, 129, 1 << 22), (1, 513, 256, 128 * 256), (0, 128, 128, 1 << 22)])
def test_block_cast_bytes_equal_the_whole_tensor_formula(monkeypatch, dtype, G, N, K, chunk):
    """Whole experts per chunk, 128-row groups of one expert per chunk, partial blocks on both dims."""
    from megatron_ep.experts import fp8_weights
    monkeypatch.setattr(fp8_weights, "CAST_CHUNK_ELEMS", chunk)
    w = _hard_values((G, N, K), dtype, seed=G * N + K)
    q, s = fp8_weights.per_block_cast_to_fp8(w)
    q_ref, s_ref = _whole_tensor_block_cast(w)
    assert q.shape == (G, N, K) and s.shape == (G, -(-N // 128), -(-K // 128)) and q.is_contiguous()
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(_bits(s), _bits(s_ref))


def test_casts_make_no_full_size_fp32_copy(monkeypatch):
    """Every fp32 tensor the casts produce (aten ops recorded under a dispatch mode) is at most
    one chunk of their input; the whole-tensor formulas make several of the input's size."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from megatron_ep.experts import fp8_weights

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.fp32 = max(self.fp32, t.numel())
            return out

    def largest(fn, *a):
        with Largest() as m:
            fn(*a)
        return m.fp32

    chunk = 4 * 1024
    monkeypatch.setattr(fp8, "CAST_CHUNK_ELEMS", chunk)
    monkeypatch.setattr(fp8_weights, "CAST_CHUNK_ELEMS", 128 * 256)
    x = torch.randn((64, 1024)).to(torch.bfloat16)
    assert largest(mep.per_token_cast_to_fp8, x) <= chunk
    assert largest(_whole_tensor_token_cast, x, False) >= x.numel()
    w = torch.randn((4, 256, 256)).to(torch.bfloat16)
    assert largest(fp8_weights.per_block_cast_to_fp8, w) <= 128 * 256
    assert largest(_whole_tensor_block_cast, w) >= w.numel()
