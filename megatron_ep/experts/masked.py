"""Grouped GEMMs for the low-latency (masked) layout and for FP8 inputs.

Low-latency dispatch delivers x [G, max_m, K] per local expert with `masked_m[g]` valid rows
(rows past it are unspecified). y[g, i] = x[g, i] @ w[g]^T for i < masked_m[g], 0 elsewhere.
DeepGEMM's `m_grouped_{bf16,fp8}_gemm_nt_masked` when importable on CUDA (forward only: decode),
else a batched matmul with the invalid rows zeroed (differentiable).

FP8 inputs are the dispatch's (x_fp8, per-128-channel scales) tuples. With DeepGEMM the weights
are cast per 128x128 block (once per weight value: fp8_weights.py) and the FP8 GEMM runs; otherwise the input is cast back to bf16 and
the bf16 path runs (same result up to the weights' FP8 rounding).

DeepGEMM's masked kernels (54e2261, SM90; `m_grouped_{fp8,bf16}_gemm_nt_masked(a, b, d,
masked_m, expected_m)`, masked_m int32 read on the device: no host sync, capturable) compute
whole BLOCK_M-row tiles (64 or 128) and address `[G, max_m]` as G * max_m flat rows, so:
* rows of a group's last tile past masked_m are written with whatever the input holds there,
  and no tile past it is written (its scheduler runs ceil(masked_m / BLOCK_M) tiles per group):
  the output starts zeroed and only each group's last-tile rows past masked_m are zeroed after
  (a fill of at most 128 rows per group, instead of a select over the whole output);
* with max_m not a multiple of the tile, a full group's last tile would run into the next
  group's first rows: the input is then copied into [G, max_m rounded up to 128, K] first
  (low-latency capacities R * max_tokens_per_rank are usually multiples of 128 already).
Shapes its kernels refuse (bf16: K % 64; FP8: K % 128; N % 8, the output's 16-byte TMA rows;
a GPU other than SM90/SM100) take the batched-matmul path instead of failing in its asserts.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..core.autograd import refuse_gradient
from ..core.fp8 import per_token_cast_back
from .backends import deep_gemm_module, grouped_linear
from .fp8_weights import Fp8, fp8_weights, per_block_cast_to_fp8  # noqa: F401 (per_block_cast_to_fp8: re-exported)
from .layout import GroupedLayout



def _valid_rows(masked_m: torch.Tensor, max_m: int, device) -> torch.Tensor:
    return torch.arange(max_m, device=device).unsqueeze(0) < masked_m.to(device).unsqueeze(1)  # [G, max_m]


DEEP_GEMM_MASKED_ROWS = 128  # max_m is padded to a multiple of the masked kernels' largest BLOCK_M


def deep_gemm_takes_masked(x: Union[torch.Tensor, Fp8], w: torch.Tensor) -> bool:
    """Whether DeepGEMM's masked kernels accept these operands (checked on the host)."""
    is_fp8 = isinstance(x, tuple)
    data = x[0] if is_fp8 else x
    if data.dim() != 3 or w.dim() != 3 or data.shape[0] != w.shape[0] or data.shape[2] != w.shape[2]:
        return False
    G, max_m, K = data.shape
    N = w.shape[1]
    if min(G, max_m, N, K) == 0 or N % 8:
        return False
    if is_fp8:  # per-token, per-128-channel fp32 scales (the dispatch's); the weights are cast per 128x128 block
        ok = (data.dtype == torch.float8_e4m3fn and K % 128 == 0 and x[1].dtype == torch.float32
              and tuple(x[1].shape) == (G, max_m, K // 128))
    else:
        ok = data.dtype == torch.bfloat16 and K % 64 == 0
    if ok and data.is_cuda:
        # Blackwell's FP8 kernels take UE8M0 (power-of-two) scales: handed our fp32 scales, DeepGEMM
        # rounds them to powers of two and the rows are read back wrong; its bf16 kernels run there
        ok = torch.cuda.get_device_capability(data.device)[0] in ((9,) if is_fp8 else (9, 10))
    return ok


def _zero_tile_tails_(d: torch.Tensor, m: torch.Tensor, G: int, rows: int) -> None:
    """Zero the rows masked_m[g] .. the end of its last DEEP_GEMM_MASKED_ROWS-row tile of each group
    of d [G * rows + 1, N] (flat; the extra last row takes the indices past a tile's end). No host
    sync: the indices are made on the device."""
    j = torch.arange(DEEP_GEMM_MASKED_ROWS, device=d.device)
    r = m.long().unsqueeze(1) + j  # [G, 128] rows from masked_m on
    end = (-(-m.long() // DEEP_GEMM_MASKED_ROWS) * DEEP_GEMM_MASKED_ROWS).clamp(max=rows).unsqueeze(1)
    flat = torch.arange(G, device=d.device).unsqueeze(1) * rows + r
    d.index_fill_(0, torch.where(r < end, flat, torch.full_like(flat, G * rows)).view(-1), 0)


def deep_gemm_masked(dg, x: Union[torch.Tensor, Fp8], w: torch.Tensor, masked_m: torch.Tensor,
                     expected_m: int, w_fp8: Optional[Fp8] = None) -> torch.Tensor:
    """One `m_grouped_{fp8,bf16}_gemm_nt_masked` call (rules in the module docstring) -> bf16
    [G, max_m, N], zero past masked_m. Operands must pass `deep_gemm_takes_masked`. `w_fp8`: w's
    128x128-block FP8 cast, made by the caller (kept across calls), else cast here."""
    is_fp8 = isinstance(x, tuple)
    data = x[0] if is_fp8 else x
    G, max_m, K = data.shape
    rows = -(-max_m // DEEP_GEMM_MASKED_ROWS) * DEEP_GEMM_MASKED_ROWS

    def rows_of(t: torch.Tensor) -> torch.Tensor:  # contiguous [G, rows, ...]; the extra rows are past masked_m
        if rows == max_m:
            return t.contiguous()
        out = t.new_empty((G, rows) + tuple(t.shape[2:]))
        out[:, :max_m].copy_(t)
        return out

    N = w.shape[1]
    flat = torch.zeros((G * rows + 1, N), dtype=torch.bfloat16, device=data.device)  # + one row for the fill
    d = flat[:G * rows].view(G, rows, N)
    m = masked_m.to(device=data.device, dtype=torch.int32).contiguous()
    if is_fp8:
        dg.m_grouped_fp8_gemm_nt_masked((rows_of(data), rows_of(x[1])), w_fp8 if w_fp8 is not None else fp8_weights(w),
                                        d, m, int(expected_m))
    else:
        dg.m_grouped_bf16_gemm_nt_masked(rows_of(data), w.to(torch.bfloat16).contiguous(), d, m, int(expected_m))
    _zero_tile_tails_(flat, m, G, rows)
    return d[:, :max_m]


def grouped_linear_masked(x: Union[torch.Tensor, Fp8], w: torch.Tensor, masked_m: torch.Tensor,
                          expected_m: Optional[int] = None, w_fp8: Optional[Fp8] = None) -> torch.Tensor:
    """x [G, max_m, K] (or an FP8 tuple with scales [G, max_m, K/128]), w [G, N, K] -> [G, max_m, N]
    (bf16 from DeepGEMM; x's dtype, or w's for FP8 x, from the fallback). `w_fp8`: w's block FP8
    cast kept by the caller (DeepGEMM's FP8 path uses it instead of casting w)."""
    is_fp8 = isinstance(x, tuple)
    data = x[0] if is_fp8 else x
    G, max_m, _ = data.shape
    dg = deep_gemm_module()
    needs_grad = torch.is_grad_enabled() and (w.requires_grad or (not is_fp8 and x.requires_grad))
    if dg is not None and data.is_cuda and not needs_grad and deep_gemm_takes_masked(x, w):
        return deep_gemm_masked(dg, x, w, masked_m, expected_m or max(1, max_m // 4), w_fp8)
    if is_fp8:
        data = per_token_cast_back(x[0], x[1], w.dtype)
    valid = _valid_rows(masked_m, max_m, data.device).unsqueeze(-1)
    data = torch.where(valid, data, torch.zeros_like(data))  # rows past masked_m may hold anything
    return torch.bmm(data, w.transpose(1, 2))


def grouped_linear_fp8(x: Fp8, w: torch.Tensor, layout: GroupedLayout, backend: Optional[str] = None) -> torch.Tensor:
    """FP8 rows in the contiguous layout (forward only); bf16 out."""
    data, scales = x
    dg = deep_gemm_module()
    # auto: DeepGEMM on the GPU; asked for by name, also on CPU tensors (its emulator in tests)
    if dg is not None and (backend == "deepgemm" or (backend is None and data.is_cuda)):
        from .backends import deep_gemm_alignment, deep_gemm_shape_error

        why = deep_gemm_shape_error(data.shape[1], w.shape[1], fp8=True)
        if why is None and data.is_cuda and torch.cuda.get_device_capability(data.device)[0] != 9:
            why = "DeepGEMM's FP8 kernels off Hopper take UE8M0 scales, not the dispatch's fp32 ones"
        if why is not None and backend == "deepgemm":
            raise ValueError(f"grouped GEMM backend 'deepgemm' cannot take FP8 rows {tuple(data.shape)}, "
                             f"w {tuple(w.shape)}: {why}")
        if why is None and layout.alignment % deep_gemm_alignment(dg) == 0:
            out = torch.zeros((data.shape[0], w.shape[1]), dtype=torch.bfloat16, device=data.device)
            dg.m_grouped_fp8_gemm_nt_contiguous((data, scales), fp8_weights(w), out, layout.m_indices(data.device))
            # the kernel's output carries no gradient to w: a backward that reaches it raises
            return refuse_gradient("grouped_linear_fp8: DeepGEMM's FP8 GEMM is forward only: it carries no "
                                   "gradient to w (the fallback, backend 'grouped_mm' or 'loop', does)", (out,), (w,))[0]
    return grouped_linear(per_token_cast_back(data, scales, w.dtype), w, layout, None if backend == "deepgemm" else backend)
