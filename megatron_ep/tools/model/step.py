"""A training step: the share of it spent in dispatch and combine.

Per rank and micro-batch, expert FLOPs per MoE layer are ``2 * T * k * hidden * moe_ffn * 3``
forward (three GEMMs of the expert MLP) and twice that backward, at the routed experts' grouped
GEMM rate (``StepModel.expert_rate``: measured, by rows per expert, ``rates.expert_gemm_tflops``,
unless ``expert_tflops`` fixes it); the rest of the
model is ``6 * (active params - routed-expert active params)`` per token (attention-score FLOPs
left out) at the dense rate (``StepModel.tflops``, assumed).
Communication per MoE layer is forward dispatch + combine plus the same two backward (4
transfers). The main fraction assumes no overlap at all, ``comm / (comm + compute)``: an upper
bound on the exposed communication under this model; the lower bound (perfect overlap) is
``max(comm - compute, 0) / max(comm, compute)``.

A step is composed from per-layer terms: ``moe_layer`` gives one MoE layer's expert GEMMs and its
communication as separate figures, and ``step_fraction`` decides how much of the communication
stays exposed (``_exposed_share``: the two bounds above), so a model of the communication running
under the expert GEMMs on a share of the SMs is one more composition of the same two terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .kernels import normal_path
from .machine import Machine
from ...core.rates import expert_gemm_tflops
from .shape import Shape


@dataclass(frozen=True)
class StepModel:
    """A DeepSeek-V3 training step, per rank and micro-batch of ``Shape.tokens`` tokens."""

    ep: int = 64
    moe_ffn: int = 2048  # expert MLP intermediate size
    moe_layers: int = 58
    layers: int = 61
    active_params: float = 37e9  # activated parameters per token (DeepSeek-V3)
    tflops: float = 400.0  # achieved dense TFLOP/s per GPU outside the routed experts (assumed)
    # the routed experts' grouped GEMMs, bf16 fwd + bwd; None: the rate measured at this EP's rows
    # per expert (rates.expert_gemm_tflops)
    expert_tflops: Optional[float] = None

    def expert_rate(self, shape: Shape) -> float:
        """TFLOP/s of the routed experts' GEMMs: `expert_tflops`, else the measured rate at the
        rows each local expert gets with balanced routing (tokens x top-k x EP / experts)."""
        if self.expert_tflops is not None:
            return self.expert_tflops
        return expert_gemm_tflops(shape.tokens * shape.topk * self.ep / shape.experts)


@dataclass(frozen=True)
class MoeLayerCost:
    """One MoE layer per rank and micro-batch, forward + backward."""

    expert_flops: int  # the expert MLP's three GEMMs over T*k rows; backward = 2x forward
    routed_params: int  # routed-expert parameters one token activates in the layer
    comm_us: float  # dispatch + combine forward and the same two backward


@dataclass(frozen=True)
class StepResult:
    ep: int
    expert_flops: float  # per rank, all MoE layers, forward + backward
    other_flops: float  # per rank, 6 * non-routed active params * tokens
    compute_ms: float
    comm_ms: float  # all MoE layers, 2 dispatches + 2 combines each
    comm_per_layer_us: float
    fraction: float  # comm / (comm + compute), no overlap: an upper bound
    fraction_overlapped: float  # max(comm - compute, 0) / max(comm, compute): perfect overlap


def moe_layer(shape: Shape, machine: Machine, step: StepModel) -> MoeLayerCost:
    """One MoE layer's expert FLOPs, routed parameters and normal-path communication at ``step.ep``."""
    t, k, h, f = shape.tokens, shape.topk, shape.hidden, step.moe_ffn
    expert_fwd = 2 * t * k * h * f * 3  # gate, up, down GEMMs over T*k rows
    comm_us = 2 * (normal_path(shape, machine, step.ep, shape.dispatch_row_bytes).time_us
                   + normal_path(shape, machine, step.ep, shape.combine_row_bytes).time_us)
    return MoeLayerCost(expert_flops=3 * expert_fwd, routed_params=k * 3 * h * f, comm_us=comm_us)


def _exposed_share(comm_s: float, compute_s: float) -> tuple[float, float]:
    """The step's share of exposed communication with no overlap (upper bound) and with all of
    it hidden under the compute (lower bound)."""
    return comm_s / (comm_s + compute_s), max(comm_s - compute_s, 0.0) / max(comm_s, compute_s)


def step_fraction(shape: Shape, machine: Machine, step: StepModel) -> StepResult:
    """Share of a training step spent in dispatch/combine if nothing overlaps (upper bound)."""
    layer = moe_layer(shape, machine, step)
    expert = step.moe_layers * layer.expert_flops
    other = 6 * max(step.active_params - step.moe_layers * layer.routed_params, 0.0) * shape.tokens
    compute_s = expert / (step.expert_rate(shape) * 1e12) + other / (step.tflops * 1e12)
    comm_s = step.moe_layers * layer.comm_us * 1e-6
    return StepResult(step.ep, expert, other, compute_s * 1e3, comm_s * 1e3, layer.comm_us,
                      *_exposed_share(comm_s, compute_s))
