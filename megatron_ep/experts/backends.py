"""Grouped GEMM backends over the expert-major layout: y[i] = x[i] @ w[e(i)]^T, w [G, N, K].

In order of preference (`MEGATRON_EP_GEMM_BACKEND` = deepgemm | grouped_mm | loop forces one):
* deepgemm: `m_grouped_bf16_gemm_nt_contiguous` with m_indices (segments re-laid to DeepGEMM's
  M alignment, 128, on the device when the dispatch did not already align them), dgrad with
  `m_grouped_bf16_gemm_nn_contiguous`, wgrad with torch grouped_mm; CUDA + bf16, when
  `deep_gemm` imports. FP8 inputs use `m_grouped_fp8_gemm_nt_contiguous`; the low-latency
  layout uses the `*_masked` variants.
* grouped_mm: torch's grouped GEMM with int32 segment offsets (no host sync); CUDA + bf16 on
  Hopper or newer. Forward, dgrad and wgrad are grouped_mm calls (our autograd function; also
  runs on CPU in fp32, which is how the CPU tests cover it).
* loop: one matmul per expert (host counts); any device and dtype.

Second derivatives: exact on grouped_mm (its backward is grouped_mm calls, which autograd
differentiates) and loop; deepgemm's backward writes its dgrad through a kernel autograd does not
see, so under create_graph=True its gradients come out through a node that raises when a
second derivative reaches it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

from ..core import envs
from ..core.autograd import refuse_second_derivative
from ..core.permute import padded_counts, padded_host_counts, round_up
from .layout import GroupedLayout

BACKENDS = ("deepgemm", "grouped_mm", "loop")
_deep_gemm = None  # the imported module; tests may substitute an emulator
_deep_gemm_checked = False


def deep_gemm_module():
    global _deep_gemm, _deep_gemm_checked
    if not _deep_gemm_checked:
        _deep_gemm_checked = True
        try:
            import deep_gemm  # optional, built from source by users

            _deep_gemm = deep_gemm
        except Exception:
            _deep_gemm = None
    return _deep_gemm


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def deep_gemm_shape_error(K: int, N: int, fp8: bool = False) -> Optional[str]:
    """Why DeepGEMM's contiguous kernels refuse y = x @ w^T with x [M, K], w [G, N, K], or None.
    They read K in blocks: 64 for bf16 (asserted by DeepGEMM's Hopper kernel, and our dgrad is the
    nn kernel with N as its K), 128 for FP8 (one scale per 128 channels); the output rows must be
    16-byte aligned for TMA."""
    step = 128 if fp8 else 64
    if K % step:
        return f"K={K} is not a multiple of {step}"
    if not fp8 and N % 64:
        return f"N={N} is not a multiple of 64 (the backward's nn GEMM reads N as its K)"
    if N % 8:
        return f"N={N} is not a multiple of 8"
    return None


GEMM_ENV = "MEGATRON_EP_GEMM_BACKEND"


def gemm_backend_from_env() -> str:
    """MEGATRON_EP_GEMM_BACKEND ("auto" when unset or empty); a value that names no backend raises."""
    raw = envs.raw(GEMM_ENV) or ""
    value = raw.strip() or "auto"
    if value != "auto" and value not in BACKENDS:
        raise ValueError(f"{GEMM_ENV}={raw!r} names no grouped GEMM backend: use one of {', '.join(BACKENDS)} or auto")
    return value


def choose_backend(x: torch.Tensor, requested: Optional[str] = None, n: Optional[int] = None) -> str:
    """The backend for x [M, K] times weights with `n` output channels (None: not known yet, only K
    is checked): the requested one, else the first of BACKENDS that takes these operands."""
    requested = requested or gemm_backend_from_env()
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"grouped GEMM backend must be one of {BACKENDS} or auto, got {requested!r}")
        return requested
    cuda_bf16 = x.is_cuda and x.dtype == torch.bfloat16
    if cuda_bf16 and deep_gemm_module() is not None and deep_gemm_shape_error(x.shape[-1], 64 if n is None else n) is None:
        return "deepgemm"
    if cuda_bf16 and _grouped_mm_fn() is not None and torch.cuda.get_device_capability(x.device)[0] >= 9:
        return "grouped_mm"
    return "loop"


@contextmanager
def sms_left_free(n: int):
    """The GEMMs issued inside leave `n` of the GPU's SMs unused, for communication kernels that
    run beside them: torch's SM carveout (cuBLAS and grouped_mm size their grids by it; their
    persistent kernels would otherwise hold every SM until they end) and DeepGEMM's SM count.
    Restores both on exit. n = 0, or a torch without the carveout, changes nothing."""
    set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if not n or set_carveout is None:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    dg = deep_gemm_module()
    dg_before = dg.get_num_sms() if dg is not None and hasattr(dg, "set_num_sms") else None
    set_carveout(n)
    if dg_before is not None:
        dg.set_num_sms(max(1, dg_before - n))
    try:
        yield
    finally:
        set_carveout(before)
        if dg_before is not None:
            dg.set_num_sms(dg_before)


# --------------------------------------------------------------------------------- loop
def loop_linear(x: torch.Tensor, w: torch.Tensor, layout: GroupedLayout) -> torch.Tensor:
    counts = layout.host_counts()
    parts = x.split(counts)
    outs = [p @ w[e].t() for e, p in enumerate(parts)]
    return torch.cat(outs) if outs else x.new_zeros((0, w.shape[1]))


# --------------------------------------------------------------------------- grouped_mm
class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return _grouped_mm_fn()(x, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        gmm = _grouped_mm_fn()
        g = g.contiguous()
        dx = gmm(g, w, offs=offs) if ctx.needs_input_grad[0] else None  # [M,N] x [G,N,K]
        dw = gmm(g.t(), x, offs=offs) if ctx.needs_input_grad[1] else None  # [N,M] x [M,K] -> [G,N,K]
        if torch.is_grad_enabled():  # create_graph=True: autograd differentiates these grouped_mm calls,
            dx, dw = (None if t is None else _ContiguousGrad.apply(t) for t in (dx, dw))  # given dense grads
        return dx, dw, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes its gradient contiguous: torch's own grouped_mm backward
    refuses the stride-0 gradient a sum() hands it ("Invalid strides/sizes")."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _mm_aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    """grouped_mm needs 16-byte aligned row strides for every operand it sees."""
    return all(d * x.element_size() % 16 == 0 for d in (x.shape[1], w.shape[1]))


def grouped_mm_linear(x: torch.Tensor, w: torch.Tensor, layout: GroupedLayout) -> torch.Tensor:
    if layout.num_groups == 0 or x.shape[0] == 0 or not _mm_aligned(x, w):
        return loop_linear(x, w, layout)
    return _GroupedMM.apply(x, w, layout.offsets(x.device))


# ----------------------------------------------------------------------------- deepgemm
def deep_gemm_alignment(dg) -> int:
    for name in ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout"):
        fn = getattr(dg, name, None)
        if fn is not None:
            return int(fn())
    return 128


class _AlignedRows:
    """Re-lay segments so each is a multiple of `align` rows (device-side, no host sync):
    worst-case sized, unused rows carry m_indices -1 (DeepGEMM skips them)."""

    def __init__(self, layout: GroupedLayout, align: int, device):
        tpe = layout.tokens_per_expert.to(device=device, dtype=torch.int64)
        G, M = layout.num_groups, layout.num_rows
        padded = padded_counts(tpe, align)
        rows = M + G * (align - 1)
        self.num_rows = round_up(rows, align)
        seg = layout.m_indices(device).long()
        seg_of_row = torch.repeat_interleave(torch.arange(G, device=device), tpe, output_size=M)
        start = torch.cumsum(tpe, 0) - tpe
        new_start = torch.cumsum(padded, 0) - padded
        self.dst = new_start[seg_of_row] + torch.arange(M, device=device) - start[seg_of_row]
        m_idx = torch.full((self.num_rows,), -1, dtype=torch.int32, device=device)
        self.m_indices = m_idx.index_copy(0, self.dst, seg.to(torch.int32))
        self.offsets = torch.cumsum(padded, 0).to(torch.int32)  # for the wgrad grouped_mm

    def pack(self, x):
        return x.new_zeros((self.num_rows,) + tuple(x.shape[1:])).index_copy(0, self.dst, x)

    def unpack(self, y):
        return y.index_select(0, self.dst)


class _DeepGemmLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, m_indices, offsets, counts_host):
        dg = deep_gemm_module()
        d = x.new_zeros((x.shape[0], w.shape[1]))  # rows with m_indices -1 are not written
        dg.m_grouped_bf16_gemm_nt_contiguous(x, w.contiguous(), d, m_indices)
        ctx.save_for_backward(x, w, m_indices, offsets)
        ctx.counts_host = counts_host
        return d

    @staticmethod
    def backward(ctx, g):
        x, w, m_indices, offsets = ctx.saved_tensors
        dg = deep_gemm_module()
        g = g.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = g.new_zeros((g.shape[0], w.shape[2]))
            if hasattr(dg, "m_grouped_bf16_gemm_nn_contiguous"):
                dg.m_grouped_bf16_gemm_nn_contiguous(g, w.contiguous(), dx, m_indices)
            else:
                dg.m_grouped_bf16_gemm_nt_contiguous(g, w.transpose(1, 2).contiguous(), dx, m_indices)
        if ctx.needs_input_grad[1]:
            gmm = _grouped_mm_fn()
            if gmm is not None and (g.is_cuda or g.dtype == torch.float32):
                dw = gmm(g.t(), x, offs=offsets)
            else:  # rows past each segment's real length are zero in x and g
                counts = ctx.counts_host
                dw = torch.stack([gs.t() @ xs for gs, xs in zip(g.split(counts), x.split(counts))])
        if torch.is_grad_enabled():  # create_graph=True: dx came from a kernel, outside autograd
            dx, dw = refuse_second_derivative("grouped GEMM backend 'deepgemm'", (dx, dw), (x, w, g))
        return dx, dw, None, None, None


def deepgemm_linear(x: torch.Tensor, w: torch.Tensor, layout: GroupedLayout) -> torch.Tensor:
    dg = deep_gemm_module()
    if dg is None:
        raise RuntimeError("grouped GEMM backend 'deepgemm' requested but deep_gemm is not importable")
    why = deep_gemm_shape_error(x.shape[1], w.shape[1])
    if why is not None:
        raise ValueError(f"grouped GEMM backend 'deepgemm' cannot take x {tuple(x.shape)}, w {tuple(w.shape)}: {why}; "
                         f"use 'grouped_mm' or 'loop', or leave the backend to auto")
    if x.shape[0] == 0 or layout.num_groups == 0:
        return loop_linear(x, w, layout)
    align = deep_gemm_alignment(dg)
    if layout.alignment % align == 0:
        m_idx = layout.m_indices(x.device)
        counts = None if x.is_cuda else layout.host_counts()
        return _DeepGemmLinear.apply(x, w, m_idx, layout.offsets(x.device), counts)
    re = _AlignedRows(layout, align, x.device)
    counts = None
    if not x.is_cuda:  # (CPU emulation in tests) per-segment lengths of the re-laid rows
        padded = padded_host_counts(layout.host_counts(), align)
        counts = padded[:-1] + [re.num_rows - sum(padded[:-1])]
    y = _DeepGemmLinear.apply(re.pack(x), w, re.m_indices, re.offsets, counts)
    return re.unpack(y)


# ---------------------------------------------------------------------------- dispatch
def grouped_linear(x: torch.Tensor, w: torch.Tensor, layout: GroupedLayout, backend: Optional[str] = None) -> torch.Tensor:
    """y[i] = x[i] @ w[e(i)]^T over the expert-major layout; differentiable in x and w."""
    if w.dim() != 3 or w.shape[0] != layout.num_groups or w.shape[2] != x.shape[-1]:
        raise ValueError(f"weight must be [G={layout.num_groups}, N, K={x.shape[-1]}], got {tuple(w.shape)}")
    if x.shape[0] != layout.num_rows:
        raise ValueError(f"x has {x.shape[0]} rows but the layout has {layout.num_rows}")
    name = choose_backend(x, backend, w.shape[1])
    y = {"deepgemm": deepgemm_linear, "grouped_mm": grouped_mm_linear, "loop": loop_linear}[name](x, w, layout)
    mask = layout.pad_mask(x.device)
    return y if mask is None else torch.where(mask, y, torch.zeros_like(y))
