"""Per-token, per-128-channel FP8 (e4m3) cast and cast-back.

The arithmetic is fixed so that our CUDA kernels reproduce it bit for bit:
    amax  = max(|x|) over each 128-channel block, in fp32, floored at 1e-4
    scale = amax / 448                      (IEEE fp32 division)
    scale = 2 ** ceil(log2(scale))           only with round_scale=True (exact, via frexp)
    q     = e4m3(x / scale)                  (IEEE fp32 division, round to nearest even)
so that x ~= q * scale. x is taken in fp32 (float64 rounded to fp32 first, to nearest even).

The cast runs over chunks of whole rows (CAST_CHUNK_ELEMS elements each): a token's blocks lie
in its row, so each chunk's fp32 copy, maxima and quotients are those of the whole-tensor formula,
and no fp32 copy of the whole activation is made.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .checks import FP8_BLOCK, FP8_DTYPE, check_activation, fail

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
CAST_CHUNK_ELEMS = 1 << 22  # elements of x one chunk of the cast takes to fp32 (16 MiB)


def round_scale_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= scale (scale > 0), exact."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H % 128 == 0) -> (x_fp8 [T, H] float8_e4m3fn, scales [T, H/128] float32)."""
    T, H, is_fp8 = check_activation("x", x)
    fail(not is_fp8, "x is already FP8", TypeError)
    fail(H % FP8_BLOCK == 0, f"x: hidden size {H} must be a multiple of {FP8_BLOCK} for FP8")
    blocks = x.view(T, H // FP8_BLOCK, FP8_BLOCK)
    q = torch.empty((T, H // FP8_BLOCK, FP8_BLOCK), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((T, H // FP8_BLOCK), dtype=torch.float32, device=x.device)
    step = max(1, CAST_CHUNK_ELEMS // H)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        xf = blocks[r0:r1].float()
        scale = xf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_MAX
        if round_scale:
            scale = round_scale_pow2(scale)
        q[r0:r1] = (xf / scale.unsqueeze(-1)).to(FP8_DTYPE)
        scales[r0:r1] = scale
    return q.view(T, H), scales


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(x_fp8 [..., H], scales [..., H/128]) -> x [..., H] in dtype."""
    fail(x_fp8.dtype == FP8_DTYPE, f"x_fp8 must be {FP8_DTYPE}, got {x_fp8.dtype}", TypeError)
    H = x_fp8.shape[-1]
    fail(H % FP8_BLOCK == 0, f"x_fp8: hidden size {H} must be a multiple of {FP8_BLOCK}")
    fail(tuple(scales.shape) == tuple(x_fp8.shape[:-1]) + (H // FP8_BLOCK,), f"scales must have shape {tuple(x_fp8.shape[:-1]) + (H // FP8_BLOCK,)}, got {tuple(scales.shape)}")
    blocks = x_fp8.float().view(*x_fp8.shape[:-1], H // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scales.float().unsqueeze(-1)).view(x_fp8.shape).to(dtype)


UE8M0_PACK = 4  # scales per int32: DeepGEMM's UE8M0 layout packs four exponent bytes along hidden


def pack_ue8m0(scales: torch.Tensor, checked: bool = True) -> torch.Tensor:
    """Power-of-two fp32 scales [..., n] (n % 4 == 0; round_scale=True makes them so) -> int32
    [..., n/4]: each scale's exponent byte (UE8M0: 2 ** (byte - 127)), scale j in byte j % 4 of
    int32 j / 4 (little-endian). `checked=False` skips the power-of-two check (a host sync on
    GPU) for scales known to be exponents only, e.g. unpack_ue8m0's."""
    fail(scales.dtype == torch.float32, f"scales must be float32, got {scales.dtype}", TypeError)
    n = scales.shape[-1]
    fail(n % UE8M0_PACK == 0, f"scales: {n} per row, must be a multiple of {UE8M0_PACK}")
    bits = scales.contiguous().view(torch.int32)
    if checked:
        fail(bool(((bits & 0x807FFFFF) == 0).all()), "scales must be positive powers of two (round_scale=True)")
    exp = (bits >> 23).to(torch.uint8)
    return exp.view(*scales.shape[:-1], n // UE8M0_PACK, UE8M0_PACK).view(torch.int32).view(*scales.shape[:-1], n // UE8M0_PACK)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., m] of packed exponent bytes -> fp32 scales [..., 4m] (inverse of pack_ue8m0)."""
    fail(packed.dtype == torch.int32, f"packed scales must be int32, got {packed.dtype}", TypeError)
    # reshape(-1), not contiguous(): a [n, 1] column-major slice counts as contiguous with a last
    # stride > 1, which a byte view refuses
    exp = packed.reshape(-1).view(torch.uint8).to(torch.int32)
    return (exp << 23).view(torch.float32).view(*packed.shape[:-1], packed.shape[-1] * UE8M0_PACK)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """[L, rows, n] with the same values, stored column-major per L ([L, n, rows] underneath,
    the TMA-aligned layout DeepGEMM reads scales in)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)
