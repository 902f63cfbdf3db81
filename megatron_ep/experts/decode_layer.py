"""The decode MoE layer on the low-latency path: LL dispatch (FP8 by default) -> the masked
grouped expert MLP (DeepGEMM's masked GEMMs when importable, else a batched matmul,
`megatron_ep.experts.masked`) -> LL combine, which applies the routing weights itself.

Fixed shapes and no host sync after the buffer exists, so a whole decode step can be captured
in a CUDA graph (make one call first: it sizes the low-latency buffer, a collective).

Not differentiable (inference): it runs without autograd. Called with grad on and inputs that
require grad, its output comes through a node that raises when a derivative reaches it, rather
than one that silently lacks the layer's part.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..core.autograd import refuse_gradient
from ..core.checks import fail
from .fp8_weights import Fp8, per_block_cast_to_fp8
from .mlp import expert_mlp_masked


class DecodeMoELayer(torch.nn.Module):
    """y = sum_k w[t, k] * MLP_{e_k}(x[t]) over the EP group of `buffer`.

    Args:
        buffer: a megatron_ep.Buffer (cuda backend for the kernels; the torch backend works too).
        num_experts: E (this rank owns experts [rank * E/R, (rank+1) * E/R)).
        w1: [E/R, F or 2F (GLU), H] this rank's fc1 weights; w2: [E/R, H, F].
        max_tokens_per_rank: the low-latency capacity (every call's T must fit).
        use_fp8: FP8 dispatch (the experts see per-128-channel FP8 inputs) or bf16.
        keep_fp8_weights: with use_fp8, keep fc1's 128x128-block FP8 cast of w1 (what DeepGEMM's
            FP8 GEMM takes) instead of casting it at every call -- also inside a captured CUDA
            graph, where the cast is otherwise replayed each step (milliseconds per layer at
            DeepSeek-V3's sizes). Off by default: a write to w1 (an optimizer step, a checkpoint
            load) is not seen until `refresh_fp8_weights()`.
    """

    def __init__(self, buffer, num_experts: int, w1: torch.Tensor, w2: torch.Tensor, *, max_tokens_per_rank: int = 128,
                 activation: Callable = F.silu, glu: bool = True, use_fp8: bool = True,
                 expected_m: Optional[int] = None, keep_fp8_weights: bool = False):
        super().__init__()
        R = buffer.num_ranks
        fail(num_experts % R == 0, f"num_experts={num_experts} is not divisible by the group size {R}")
        L = num_experts // R
        fail(w1.dim() == 3 and w1.shape[0] == L, f"w1 must be [{L}, F or 2F, H], got {tuple(w1.shape)}")
        fail(w2.dim() == 3 and w2.shape[0] == L and w2.shape[1] == w1.shape[2],
             f"w2 must be [{L}, {w1.shape[2]}, F], got {tuple(w2.shape)}")
        self.buffer, self.num_experts = buffer, num_experts
        self.w1, self.w2 = torch.nn.Parameter(w1, requires_grad=False), torch.nn.Parameter(w2, requires_grad=False)
        self.max_tokens_per_rank, self.activation, self.glu, self.use_fp8 = max_tokens_per_rank, activation, glu, use_fp8
        self.expected_m = expected_m
        self.w1_fp8: Optional[Fp8] = per_block_cast_to_fp8(self.w1.detach()) if keep_fp8_weights and use_fp8 else None

    @torch.no_grad()
    def refresh_fp8_weights(self) -> None:
        """Re-cast the kept FP8 w1 after w1 changed, in place (a captured graph reads the same tensors)."""
        if self.w1_fp8 is None:
            return
        q, s = per_block_cast_to_fp8(self.w1.detach())
        self.w1_fp8[0].copy_(q)
        self.w1_fp8[1].copy_(s)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, topk_idx [T, K] int64 (-1: unused), topk_weights [T, K] fp32 -> [T, H] bf16."""
        return decode_moe(self.buffer, x, topk_idx, topk_weights, self.w1, self.w2, num_experts=self.num_experts,
                          max_tokens_per_rank=self.max_tokens_per_rank, activation=self.activation, glu=self.glu,
                          use_fp8=self.use_fp8, expected_m=self.expected_m, w1_fp8=self.w1_fp8)


def decode_moe(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
               w2: torch.Tensor, *, num_experts: int, max_tokens_per_rank: int, activation: Callable = F.silu,
               glu: bool = True, use_fp8: bool = True, expected_m: Optional[int] = None,
               w1_fp8: Optional[Fp8] = None) -> torch.Tensor:
    """DecodeMoELayer's computation as a function (megatron_ep.megatron.decode calls it with a
    Megatron layer's own expert weights): LL dispatch -> masked expert MLP -> LL combine.
    The expert outputs go to combine in x's dtype (bf16; fp32 on the torch backend only).
    `w1_fp8`: w1's block FP8 cast kept by the caller (DecodeMoELayer(keep_fp8_weights=True)).
    Not differentiable: with grad on, a derivative through its output raises (see the module)."""
    with torch.no_grad():
        y = _decode_moe(buffer, x, topk_idx, topk_weights, w1, w2, num_experts, max_tokens_per_rank, activation, glu,
                        use_fp8, expected_m, w1_fp8)
    return refuse_gradient(NOT_DIFFERENTIABLE.format(what="decode_moe (the low-latency decode layer)"), (y,),
                           (x, topk_weights, w1, w2))[0]


NOT_DIFFERENTIABLE = ("{what} is not differentiable: it runs without autograd, so a derivative through its output "
                      "would leave its part out. Run it under torch.no_grad() (inference); train on the normal path "
                      "(megatron_ep.dispatch / combine, chunked_expert_mlp)")


def _decode_moe(buffer, x, topk_idx, topk_weights, w1, w2, num_experts, max_tokens_per_rank, activation, glu, use_fp8,
                expected_m, w1_fp8) -> torch.Tensor:
    # the weights go with the dispatch: the combine (same tensor) sends one row per token and rank
    out = buffer.low_latency_dispatch(x, topk_idx, num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank,
                                      use_fp8=use_fp8, topk_weights=topk_weights)
    # DeepGEMM's hint of the rows per expert (a tuning value, not a bound)
    expected = expected_m or max(1, buffer.num_ranks * max_tokens_per_rank * topk_idx.shape[1] // num_experts)
    h = expert_mlp_masked(out.x, w1, w2, out.count, activation, glu, expected, w1_fp8 if use_fp8 else None)
    return buffer.low_latency_combine(h.to(x.dtype).contiguous(), topk_idx, topk_weights, out.handle)
