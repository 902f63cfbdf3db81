"""The expert MLP over the expert-major layout, as Megatron's grouped MLP computes it:
    h = fc1(x);  h = act(h[:F]) * h[F:] (GLU) or act(h);  h = (h * prob).to(x.dtype);  y = fc2(h)
with fc1 / fc2 grouped GEMMs (weights [G, out, in]). Probs are applied inside the experts, so
combine stays an unweighted sum (docs/design.md §2)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .backends import grouped_linear
from .layout import GroupedLayout
from .masked import grouped_linear_masked


def _activate(h: torch.Tensor, activation: Callable, glu: bool) -> torch.Tensor:
    if glu:
        a, b = torch.chunk(h, 2, dim=-1)
        return activation(a) * b
    return activation(h)


def expert_mlp(x: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, layout: GroupedLayout,
               activation: Callable = F.gelu, glu: bool = False, backend: Optional[str] = None) -> torch.Tensor:
    """x [M, H], probs [M], w1 [G, F or 2F, H], w2 [G, H, F] -> [M, H]."""
    h = grouped_linear(x, w1, layout, backend)
    h = (_activate(h, activation, glu) * probs.unsqueeze(-1)).to(x.dtype)
    return grouped_linear(h, w2, layout, backend)


def expert_mlp_masked(x, w1: torch.Tensor, w2: torch.Tensor, masked_m: torch.Tensor,
                      activation: Callable = F.gelu, glu: bool = False, expected_m: Optional[int] = None,
                      w1_fp8=None) -> torch.Tensor:
    """Low-latency layout: x [G, max_m, H] (or FP8 tuple) -> [G, max_m, H], zero past masked_m.
    No probs here: low-latency combine applies the routing weights itself. `w1_fp8`: w1's block
    FP8 cast kept by the caller (FP8 x on DeepGEMM; fc2's input is bf16)."""
    h = grouped_linear_masked(x, w1, masked_m, expected_m, w1_fp8)
    h = _activate(h, activation, glu).to(w2.dtype)
    return grouped_linear_masked(h, w2, masked_m, expected_m)
