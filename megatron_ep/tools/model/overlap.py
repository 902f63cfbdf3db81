"""Communication under the expert GEMMs: one MoE layer, forward and backward, with and without
overlap, per rank and micro-batch.

Terms (all in microseconds):

* ``D``, ``C``: one normal dispatch / combine (``kernels.normal_path``); a call also pays a fixed
  cost ``f_d`` / ``f_c`` (the dispatch's notify and launches, the combine's call exchange) that no
  amount of bandwidth removes. Backward: the combine's backward is a dispatch of the output
  gradients, the dispatch's backward a combine of the input gradients; both move BF16 gradient
  rows, so both take ``C`` (the training-step estimate of ``step.py`` counts ``D + C`` there: a
  lower bound).
* ``G``: the expert GEMMs at the routed experts' grouped GEMM rate (``StepModel.expert_tflops``): forward the three GEMMs of the
  expert MLP over ``T * k`` rows; backward the data-gradient GEMMs (as many FLOPs as forward),
  which the next communication waits for, and the weight-gradient GEMMs (as many again), which
  nothing downstream in the layer waits for.
* The SM split: while both run, the communication kernels hold ``s`` of the GPU's ``S`` SMs
  (``NormalResult.sms_all``: what every link needs at the rate it runs) and the GEMMs run on the
  rest; the GEMMs lose ``s / (S - s)`` of the time the two overlap (``_overlapped``).

Mechanisms (``LayerTimes.mode``):

* ``none``: ``f_d + D + G + f_c + C`` forward, the backward alike; the GEMMs have every SM.
* ``chunks``: the tokens cut into ``n`` chunks over two streams. Every chunk is a dispatch and a
  combine of its own, so it pays ``f_d`` and ``f_c`` each time; chunk ``i``'s GEMMs start when its
  dispatch ended, its combine when its GEMMs ended.
* ``arrivals``: one dispatch and one combine call, the local experts in ``n`` groups: the dispatch
  writes a per-group arrival counter the compute stream waits on (a stream memory operation: no
  SM held while waiting), so group ``i``'s GEMMs start once its rows are in, and the combine sends
  each group's rows once its GEMMs are done. The fixed costs are paid once; the dispatch must
  deliver the groups in order.

Both are the same two-resource schedule (``_schedule``): a communication stream that runs the
dispatch pieces in order and each combine piece as soon as its GEMMs are done (a ready combine
first: it frees the rows), and a compute stream that runs the GEMM pieces in order. A schedule
shorter than ``none`` means the overlap pays for its fixed costs and the SMs it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernels import normal_path
from .machine import Machine
from .shape import Shape
from .step import StepModel, moe_layer

MODES = ("none", "chunks", "arrivals")


@dataclass(frozen=True)
class OverlapOptions:
    """The overlap estimate's assumptions (``python -m megatron_ep.tools.model`` flags)."""

    dispatch_fixed_us: float = 49.0  # notify (GPU-bound, one H200 at 4096 tokens) and the launches
    combine_fixed_us: float = 15.0  # the combine's call exchange and launch (assumed)
    max_pieces: int = 16  # chunks or expert groups tried


@dataclass(frozen=True)
class OverlapCosts:
    """What the schedule needs of one MoE layer (us), from the model's per-call terms."""

    dispatch: float  # D: forward dispatch (FP8 or BF16 rows)
    combine: float  # C: forward combine, and either backward transfer (BF16 gradient rows)
    gemm_fwd: float  # G forward at the whole GPU
    gemm_dgrad: float  # backward data gradients at the whole GPU
    gemm_wgrad: float  # backward weight gradients at the whole GPU
    comm_sms: int  # s: SMs the communication kernels hold while they overlap
    sms: int  # S: the GPU's SMs


@dataclass(frozen=True)
class LayerTimes:
    mode: str
    pieces: int  # chunks or expert groups (1 for none)
    forward_us: float
    backward_us: float

    @property
    def total_us(self) -> float:
        return self.forward_us + self.backward_us


def layer_costs(shape: Shape, machine: Machine, step: StepModel) -> OverlapCosts:
    """One MoE layer's communication and GEMM terms at ``step.ep``."""
    d = normal_path(shape, machine, step.ep, shape.dispatch_row_bytes)
    c = normal_path(shape, machine, step.ep, shape.combine_row_bytes)
    fwd_flops = moe_layer(shape, machine, step).expert_flops / 3  # the layer's figure is fwd + bwd = 3x fwd
    g = fwd_flops / (step.expert_rate(shape) * 1e12) * 1e6
    return OverlapCosts(dispatch=d.time_us, combine=c.time_us, gemm_fwd=g, gemm_dgrad=g, gemm_wgrad=g,
                        comm_sms=min(max(d.sms_all, c.sms_all), machine.sms - 1), sms=machine.sms)


def costs_of_layer(tokens: int, hidden: int, topk: int, experts: int, ep: int, moe_ffn: int,
                   machine: Machine | None = None) -> OverlapCosts:
    """layer_costs for a benchmark's MoE layer: `tokens` per rank, BF16 rows both ways, routing
    without group limit (what scripts/bench overlap and scripts/ab_throughput.py run)."""
    shape = Shape(tokens=tokens, hidden=hidden, topk=topk, experts=experts, groups=1, topk_groups=1,
                  fp8_dispatch=False)
    return layer_costs(shape, machine or Machine(), StepModel(ep=ep, moe_ffn=moe_ffn))


def _schedule(dispatch: list[float], gemm: list[float], combine: list[float],
              gemm_tail: float = 0.0) -> tuple[float, float]:
    """The two-stream schedule (module docstring): dispatch piece i, then GEMM piece i on the
    compute stream, then combine piece i; ``gemm_tail`` more compute after the last GEMM piece
    that nothing waits for (the backward's weight gradients). Returns (makespan, the time both
    streams were busy at once)."""
    n = len(dispatch)
    gemm_end = [0.0] * n
    comm, comp = [], []  # busy intervals
    t_comm = t_comp = 0.0
    next_d, next_c = 0, 0

    def run_comm(start: float, length: float) -> float:
        comm.append((start, start + length))
        return start + length

    while next_c < n:
        if next_c < next_d and gemm_end[next_c] <= t_comm:  # a combine piece is ready: it goes first
            t_comm = run_comm(t_comm, combine[next_c])
            next_c += 1
        elif next_d < n:
            t_comm = run_comm(t_comm, dispatch[next_d])
            start = max(t_comp, t_comm)
            t_comp = start + gemm[next_d]
            comp.append((start, t_comp))
            gemm_end[next_d] = t_comp
            next_d += 1
        else:  # only combines left: wait for the next one's GEMMs
            t_comm = run_comm(max(t_comm, gemm_end[next_c]), combine[next_c])
            next_c += 1
    if gemm_tail > 0:
        comp.append((t_comp, t_comp + gemm_tail))
        t_comp += gemm_tail
    both = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in comm for b0, b1 in comp)
    return max(t_comm, t_comp), both


def _overlapped(dispatch: list[float], gemm: list[float], combine: list[float], gemm_tail: float,
                costs: OverlapCosts) -> float:
    """The schedule with the SM split: while both streams are busy the GEMMs run on S - s SMs. The
    first pass finds how long they overlap; the GEMMs are then stretched by the SMs they lost in
    that time (s / (S - s) of it, spread over the pieces) and scheduled again."""
    _, both = _schedule(dispatch, gemm, combine, gemm_tail)
    lost = both * costs.comm_sms / (costs.sms - costs.comm_sms)
    work = sum(gemm) + gemm_tail
    stretch = 1.0 + lost / work if work > 0 else 1.0
    span, _ = _schedule(dispatch, [g * stretch for g in gemm], combine, gemm_tail * stretch)
    return span


def layer_times(costs: OverlapCosts, mode: str, pieces: int = 1, dispatch_fixed_us: float = 49.0,
                combine_fixed_us: float = 15.0) -> LayerTimes:
    """Forward and backward time of one MoE layer under ``mode`` with ``pieces`` chunks or groups."""
    if mode not in MODES:
        raise ValueError(f"overlap mode must be one of {MODES}, got {mode!r}")
    if pieces < 1 or (mode == "none" and pieces != 1):
        raise ValueError(f"pieces must be >= 1 (1 for 'none'), got {pieces}")
    fd, fc = dispatch_fixed_us, combine_fixed_us
    if mode == "none":
        fwd = fd + costs.dispatch + costs.gemm_fwd + fc + costs.combine
        bwd = fd + costs.combine + costs.gemm_dgrad + fc + costs.combine + costs.gemm_wgrad
        return LayerTimes(mode, 1, fwd, bwd)
    n = pieces

    def split(total: float, fixed: float) -> list[float]:
        # chunks pay the fixed cost every time; one call with arrival counters pays it once
        return [total / n + (fixed if mode == "chunks" or i == 0 else 0.0) for i in range(n)]

    fwd = _overlapped(split(costs.dispatch, fd), [costs.gemm_fwd / n] * n, split(costs.combine, fc), 0.0, costs)
    # backward: the output gradients go out as a dispatch, the data-gradient GEMMs follow each
    # piece, the input gradients come back as a combine (BF16 rows both ways);
    # the weight-gradient GEMMs run after the last data-gradient piece (deferred, as Megatron's
    # delayed weight-gradient compute does) and hide the last combines
    bwd = _overlapped(split(costs.combine, fd), [costs.gemm_dgrad / n] * n, split(costs.combine, fc),
                      costs.gemm_wgrad, costs)
    return LayerTimes(mode, n, fwd, bwd)


def best_overlap(costs: OverlapCosts, max_pieces: int, dispatch_fixed_us: float = 49.0,
                 combine_fixed_us: float = 15.0) -> dict[str, LayerTimes]:
    """``none`` and, for each mechanism, the number of pieces in 1..max_pieces with the shortest layer."""
    out = {"none": layer_times(costs, "none", 1, dispatch_fixed_us, combine_fixed_us)}
    for mode in ("chunks", "arrivals"):
        out[mode] = min((layer_times(costs, mode, n, dispatch_fixed_us, combine_fixed_us)
                         for n in range(1, max_pieces + 1)), key=lambda t: t.total_us)
    return out
