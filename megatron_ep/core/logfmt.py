"""LogFMT-10: the low-latency combine's optional wire format for its bf16 rows (DeepEP's
`use_logfmt`), and its reference: what a receiver decodes from a row the sender encoded.

A row travels in blocks of 128 channels. A block whose magnitudes all lie below 1 (log2 of its
largest |x| below 0) and are not all equal is sent as 10 bits per value: a sign bit and a 9-bit
index on a log2 scale from the block's smallest magnitude to its largest (the scale's ends ride
along as the block's bf16 amax and amin), so 128 values take 160 bytes instead of 256. Any other
block is sent as bf16. Per block, with magnitudes a = |x| (bf16 values, exact in fp32):

    log_amax = log2(max a)
    log_amin = max(log2(min a), log_amax - 32)          (a zero magnitude clips to 2^-32 amax)
    encoded  iff log_amax < 0 and log_amin < log_amax
    step     = (log_amax - log_amin) / 510
    index    = min(511, floor(max(0, (log2 a - log_amin) / step + rounding)))
    rounding = 2 - log2((1 + 2^step) / 2) / step        (rounds at the midpoint in linear scale)
    decoded  = 0 for index 0, else sign * 2^((index - 1) * step + log_amin)

so the block's smallest and largest magnitudes decode to themselves, and any other value to
within a factor 2^(step / 2) of itself. The receiver accumulates the decoded values in fp32.
The kernels compute the logarithms with the GPU's approximate log2 / exp2, so their decoded
values may differ from this reference's in the last bits.
"""

from __future__ import annotations

import torch

from .checks import fail

BLOCK = 128  # channels per block (one amax / amin pair)
BITS = 10  # per encoded value: sign + index
LEVELS = 1 << (BITS - 1)  # 512 indices; index 0 is zero, 1 .. 511 span [amin, amax]
CLIP = 32.0  # log2 range below amax a block keeps
THRESHOLD = 0.0  # blocks with log2(amax) at or above it stay bf16
ENCODED_BLOCK_BYTES = BLOCK * BITS // 8  # 160


def block_scale(amax: torch.Tensor, amin: torch.Tensor):
    """(log2 amax, log2 amin clipped to CLIP below it, whether the block is sent encoded) of blocks
    with these fp32 magnitudes' max / min (same shapes)."""
    log_amax = torch.log2(amax)
    log_amin = torch.maximum(torch.log2(amin), log_amax - CLIP)
    return log_amax, log_amin, (log_amax < THRESHOLD) & (log_amin < log_amax)


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] bf16 (H a multiple of 128) -> fp32 [..., H]: each block as a receiver decodes it."""
    fail(x.dtype == torch.bfloat16, f"LogFMT encodes bf16 rows, got {x.dtype}", TypeError)
    H = x.shape[-1]
    fail(H % BLOCK == 0, f"LogFMT: hidden size {H} must be a multiple of {BLOCK}")
    v = x.float().reshape(-1, H // BLOCK, BLOCK)
    a = v.abs()
    log_amax, log_amin, on = block_scale(a.amax(dim=-1, keepdim=True), a.amin(dim=-1, keepdim=True))
    # blocks that stay bf16 get a harmless step (their indices are not used)
    step = torch.where(on, (log_amax - log_amin) / (LEVELS - 2), torch.ones_like(log_amax))
    rounding = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) / step
    index = torch.floor(torch.clamp((torch.log2(a) - torch.where(on, log_amin, torch.zeros_like(log_amin))) / step
                                    + rounding, min=0.0)).clamp(max=LEVELS - 1)
    decoded = torch.where(index == 0, torch.zeros_like(a), torch.exp2((index - 1) * step + log_amin))
    decoded = torch.where(v < 0, -decoded, decoded)
    return torch.where(on, decoded, v).reshape(x.shape)
