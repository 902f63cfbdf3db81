"""Grouped GEMMs for the low-latency (masked) layout and for FP8 inputs.

Low-latency dispatch delivers x [G, max_m, K] per local expert with `masked_m[g]` valid rows
(rows past it are unspecified). y[g, i] = x[g, i] @ w[g]^T for i < masked_m[g], 0 elsewhere.
DeepGEMM's `m_grouped_{bf16,fp8}_gemm_nt_masked` when importable on CUDA (forward only: decode),
else a batched matmul with the invalid rows zeroed (differentiable).

FP8 inputs are the dispatch's (x_fp8, per-128-channel scales) tuples. With DeepGEMM the weights
are cast per 128x128 block and the FP8 GEMM runs; otherwise the input is cast back to bf16 and
the bf16 path runs (same result up to the weights' FP8 rounding).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..fp8 import FP8_MAX, per_token_cast_back
from .backends import deep_gemm_module, grouped_linear
from .layout import GroupedLayout

Fp8 = Tuple[torch.Tensor, torch.Tensor]


def _valid_rows(masked_m: torch.Tensor, max_m: int, device) -> torch.Tensor:
    return torch.arange(max_m, device=device).unsqueeze(0) < masked_m.to(device).unsqueeze(1)  # [G, max_m]


def per_block_cast_to_fp8(w: torch.Tensor, block: int = 128) -> Fp8:
    """w [G, N, K] -> (fp8 [G, N, K], scales [G, ceil(N/128), ceil(K/128)] fp32), 128x128 blocks."""
    G, N, K = w.shape
    pn, pk = -N % block, -K % block
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    blocks = wp.view(G, (N + pn) // block, block, (K + pk) // block, block)
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-4)
    scale = amax / FP8_MAX
    q = (blocks / scale).to(torch.float8_e4m3fn).view(G, N + pn, K + pk)[:, :N, :K].contiguous()
    return q, scale.view(G, (N + pn) // block, (K + pk) // block)


def grouped_linear_masked(x: Union[torch.Tensor, Fp8], w: torch.Tensor, masked_m: torch.Tensor,
                          expected_m: Optional[int] = None) -> torch.Tensor:
    """x [G, max_m, K] (or an FP8 tuple with scales [G, max_m, K/128]), w [G, N, K] -> [G, max_m, N]."""
    is_fp8 = isinstance(x, tuple)
    data = x[0] if is_fp8 else x
    G, max_m, _ = data.shape
    dg = deep_gemm_module()
    needs_grad = torch.is_grad_enabled() and (w.requires_grad or (not is_fp8 and x.requires_grad))
    if dg is not None and data.is_cuda and not needs_grad:
        expected = expected_m or max(1, max_m // 4)
        out = torch.zeros((G, max_m, w.shape[1]), dtype=torch.bfloat16, device=data.device)
        m = masked_m.to(torch.int32)
        if is_fp8:
            dg.m_grouped_fp8_gemm_nt_masked((x[0], x[1]), per_block_cast_to_fp8(w), out, m, expected)
        else:
            dg.m_grouped_bf16_gemm_nt_masked(x, w.to(torch.bfloat16).contiguous(), out, m, expected)
        return out
    if is_fp8:
        data = per_token_cast_back(x[0], x[1], w.dtype)
    valid = _valid_rows(masked_m, max_m, data.device).unsqueeze(-1)
    data = torch.where(valid, data, torch.zeros_like(data))  # rows past masked_m may hold anything
    return torch.bmm(data, w.transpose(1, 2))


def grouped_linear_fp8(x: Fp8, w: torch.Tensor, layout: GroupedLayout, backend: Optional[str] = None) -> torch.Tensor:
    """FP8 rows in the contiguous layout (forward only); bf16 out."""
    data, scales = x
    dg = deep_gemm_module()
    if dg is not None and data.is_cuda and backend in (None, "deepgemm"):
        from .backends import deep_gemm_alignment

        if layout.alignment % deep_gemm_alignment(dg) == 0:
            out = torch.zeros((data.shape[0], w.shape[1]), dtype=torch.bfloat16, device=data.device)
            dg.m_grouped_fp8_gemm_nt_contiguous((data, scales), per_block_cast_to_fp8(w), out, layout.m_indices(data.device))
            return out
    return grouped_linear(per_token_cast_back(data, scales, w.dtype), w, layout, None if backend == "deepgemm" else backend)
