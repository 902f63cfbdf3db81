"""A training step: the share of it spent in dispatch and combine.

Per rank and micro-batch, expert FLOPs per MoE layer are ``2 * T * k * hidden * moe_ffn * 3``
forward (three GEMMs of the expert MLP) and twice that backward; the rest of the model is
``6 * (active params - routed-expert active params)`` per token (attention-score FLOPs left out).
Communication per MoE layer is forward dispatch + combine plus the same two backward (4
transfers). The main fraction assumes no overlap at all, ``comm / (comm + compute)``: an upper
bound on the exposed communication under this model; the lower bound (perfect overlap) is
``max(comm - compute, 0) / max(comm, compute)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernels import normal_path
from .machine import Machine
from .shape import Shape


@dataclass(frozen=True)
class StepModel:
    """A DeepSeek-V3 training step, per rank and micro-batch of ``Shape.tokens`` tokens."""

    ep: int = 64
    moe_ffn: int = 2048  # expert MLP intermediate size
    moe_layers: int = 58
    layers: int = 61
    active_params: float = 37e9  # activated parameters per token (DeepSeek-V3)
    tflops: float = 400.0  # achieved dense TFLOP/s per GPU


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


def step_fraction(shape: Shape, machine: Machine, step: StepModel) -> StepResult:
    """Share of a training step spent in dispatch/combine if nothing overlaps (upper bound)."""
    t, k, h, f = shape.tokens, shape.topk, shape.hidden, step.moe_ffn
    expert_fwd = 2 * t * k * h * f * 3  # gate, up, down GEMMs over T*k rows
    expert = step.moe_layers * 3 * expert_fwd  # backward = 2x forward
    routed_params = step.moe_layers * k * 3 * h * f
    other = 6 * max(step.active_params - routed_params, 0.0) * t
    compute_s = (expert + other) / (step.tflops * 1e12)
    per_layer_us = 2 * (normal_path(shape, machine, step.ep, shape.dispatch_row_bytes).time_us
                        + normal_path(shape, machine, step.ep, shape.combine_row_bytes).time_us)
    comm_s = step.moe_layers * per_layer_us * 1e-6
    return StepResult(step.ep, expert, other, compute_s * 1e3, comm_s * 1e3, per_layer_us,
                      comm_s / (comm_s + compute_s),
                      max(comm_s - compute_s, 0.0) / max(comm_s, compute_s))
