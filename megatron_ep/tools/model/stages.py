"""The two-level path's stages, timed from per-SM rates calibrated on one measured operation (the
model check of scripts/bench normal).

Our internode path runs the RDMA-domain hop ((token, node) pairs x row bytes on its blocks), the
intranode stage (rank-major rows x row bytes on the Buffer's SMs) and local work (the expert-major
fan-out; bytes read + written, on the GPU) one after the other. Before the intranode stage
delivered rows in the contract's order, a local reorder followed it (``reorder=True``: what the
recorded figures of that code measured). Per-SM rates calibrated on one measured
operation's phase marks predict the others from exact row counts (``counts.link_count``): FP8
rows, expert-major layouts, other SM counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.rates import gbps_of, us_at

# An internode normal dispatch runs three stages one after the other (cuda/paths/internode.py):
#   rdma   the RDMA-domain hop: every (token, destination node) pair, the own node's included
#          (the same kernels copy it locally), on the path's RDMA blocks;
#   node   the intranode stage (the intranode path over the node's ranks): the rank-major rows it
#          delivers, on the Buffer's SMs;
#   local  local HBM work on the rank's whole share of the GPU: the expert-major fan-out (and, in
#          code before the intranode stage wrote the contract's order, the reorder into it: a torch
#          index_select / index_copy_); counted as bytes read + written, at a per-GPU rate (it does
#          not scale with --num-sms); none for rank-major rows;
# plus `fixed`: measured terms the model has no formula for (the notify kernel), added as they
# are. Combine runs the same stages in reverse. Rates are calibrated per direction (dispatch on
# a dispatch, combine on a combine): the kernels differ (the combine's hop sums in fp32, its
# reorder scatters).

TIME_TOLERANCE = 0.25  # predicted/measured within 1 +- this: "within 25%"
STAGES = ("rdma", "node", "local", "fixed")
STAGE_NAMES = {"rdma": "RDMA hop", "node": "intranode stage", "local": "local work", "fixed": "notify"}
# The internode path's phase marks (Runtime.mark in cuda/paths/internode.py and cuda/paths/intranode.py) ->
# stage. "reduce" (expert-major combine) takes the place of the staging copy ("stage"): both
# write the rows that cross the intranode stage into the combine area. "fanout" spreads the
# received rank-major rows into expert segments on the local SMs; "reorder" is the local reorder
# of code before the intranode stage wrote the contract's order (recorded figures).
STAGE_OF_MARK = {"rdma": "rdma", "notify": "fixed", "stage": "node", "push": "node", "pull": "node",
                 "reduce": "node", "fanout": "local", "reorder": "local"}


@dataclass(frozen=True)
class StageWork:
    """What one two-level operation moves per rank in each stage, and on how many SMs."""

    rdma_bytes: float  # (token, node) pairs x row bytes
    node_bytes: float  # rank-major rows x the row bytes that cross the intranode stage
    local_bytes: float  # bytes the local fan-out (and reorder) read and write
    blocks: int  # the RDMA-domain kernels' blocks
    sms: int  # the intranode stage's SMs
    fixed_us: float = 0.0  # measured terms without a formula (notify)


@dataclass(frozen=True)
class StageRates:
    """Calibrated rates, GB/s: per block of the RDMA hop, per SM of the intranode stage, and of
    the local work on the rank's GPU share (bytes read + written; None when the calibrating
    operation had no local work)."""

    rdma_per_sm: float
    node_per_sm: float
    local_gbps: float | None


@dataclass(frozen=True)
class StageTimes:
    """µs per stage of one operation (measured phases or a prediction)."""

    rdma_us: float = 0.0
    node_us: float = 0.0
    local_us: float = 0.0
    fixed_us: float = 0.0

    def of(self, stage: str) -> float:
        return getattr(self, f"{stage}_us")

    @property
    def total_us(self) -> float:
        return self.rdma_us + self.node_us + self.local_us + self.fixed_us


def dispatch_stage_work(pairs: float, rows: float, row_bytes: int, blocks: int, sms: int,
                        expert_rows: float | None = None, fixed_us: float = 0.0, reorder: bool = False) -> StageWork:
    """A two-level dispatch of ``row_bytes`` rows (bf16: 2H; FP8: H + H/128 x 4 scale bytes):
    ``pairs`` (token, node) pairs over the hop, ``rows`` rank-major rows through the intranode
    stage; local work: rank-major, none; expert-major, the fan-out reads ``rows`` and writes
    ``expert_rows`` (padding included). ``reorder``: also a reorder that reads and writes every
    output row (``rows`` or ``expert_rows``)."""
    out = rows if expert_rows is None else expert_rows
    local = (0 if expert_rows is None else rows + expert_rows) + (2 * out if reorder else 0)
    return StageWork(pairs * row_bytes, rows * row_bytes, local * row_bytes, blocks, sms, fixed_us)


def combine_stage_work(pairs: float, rows: float, hidden: int, blocks: int, sms: int,
                       expert_rows: float | None = None, partials: bool = True,
                       elem_bytes: int = 2, reorder: bool = False) -> StageWork:
    """A two-level combine of rows of ``hidden`` x ``elem_bytes`` (bf16): the intranode stage
    carries ``rows`` rank-major rows -- expert-major with ``partials``, each a token's rows of the
    rank pre-summed in fp32 (4 x hidden bytes), else every expert row; the hop carries ``pairs``
    rows back. No local work, unless ``reorder``: a reorder back to the intranode stage's order
    that reads and writes the input rows (``rows`` rank-major, or ``expert_rows``)."""
    row = hidden * elem_bytes
    if expert_rows is None:
        node, local = rows * row, 2 * rows * row
    else:
        node = rows * 4 * hidden if partials else expert_rows * row
        local = 2 * expert_rows * row
    return StageWork(pairs * row, node, local if reorder else 0.0, blocks, sms)


def phase_stages(phases: dict) -> StageTimes:
    """The internode path's phase marks ({mark: µs}) summed into the stages (``STAGE_OF_MARK``;
    a mark it does not know is the intranode path's, so the intranode stage's)."""
    t = {s: 0.0 for s in STAGES}
    for mark, us in phases.items():
        t[STAGE_OF_MARK.get(mark, "node")] += us
    return StageTimes(*(t[s] for s in STAGES))


def calibrate_stages(work: StageWork, measured: StageTimes) -> StageRates:
    """Rates of one measured operation's phases: hop bytes / time / blocks, intranode bytes /
    time / SMs, local bytes / time (no local rate when the operation has no local work and no
    local phase)."""
    no_local = work.local_bytes == 0 and measured.local_us == 0
    for stage, nbytes in (("rdma", work.rdma_bytes), ("node", work.node_bytes), ("local", work.local_bytes)):
        if stage == "local" and no_local:
            continue
        if not (nbytes > 0 and measured.of(stage) > 0):
            raise ValueError(f"calibrate_stages: the {STAGE_NAMES[stage]} needs bytes and a measured time "
                             f"(got {nbytes} B in {measured.of(stage)} µs)")
    return StageRates(rdma_per_sm=gbps_of(work.rdma_bytes, measured.rdma_us * 1e-6, work.blocks),
                      node_per_sm=gbps_of(work.node_bytes, measured.node_us * 1e-6, work.sms),
                      local_gbps=None if no_local else gbps_of(work.local_bytes, measured.local_us * 1e-6))


def predict_stages(work: StageWork, rates: StageRates) -> StageTimes:
    """Each stage's time at the calibrated rates (SM-bound: bytes / (SMs x per-SM rate)). Local
    work needs a local rate (ValueError without one)."""
    if work.local_bytes > 0 and rates.local_gbps is None:
        raise ValueError("predict_stages: the operation has local work and the rates have no local rate")
    local = us_at(work.local_bytes, rates.local_gbps) if work.local_bytes > 0 else 0.0
    return StageTimes(rdma_us=us_at(work.rdma_bytes, rates.rdma_per_sm, work.blocks),
                      node_us=us_at(work.node_bytes, rates.node_per_sm, work.sms),
                      local_us=local, fixed_us=work.fixed_us)


def within(ratio: float, tol: float = TIME_TOLERANCE) -> bool:
    return abs(ratio - 1) <= tol


def verdict(ratio: float, tol: float = TIME_TOLERANCE) -> str:
    return f"{'within' if within(ratio, tol) else 'OUTSIDE'} {100 * tol:g}%"


@dataclass(frozen=True)
class TimeCheck:
    """A prediction of one operation against its measurement: per stage (when its phases were
    traced) and in total against the measured time per call."""

    name: str
    predicted: StageTimes
    measured: StageTimes | None  # the operation's own phase marks (None: not traced)
    call_us: float  # measured µs per call

    def stage_ratio(self, stage: str) -> float | None:
        if self.measured is None or self.measured.of(stage) <= 0:
            return None
        return self.predicted.of(stage) / self.measured.of(stage)

    @property
    def ratio(self) -> float:
        return self.predicted.total_us / self.call_us

    @property
    def within(self) -> bool:
        return within(self.ratio)

    @property
    def outside_marks_us(self) -> float | None:
        """The measured call time outside the phase marks (host work, launches, counts)."""
        return None if self.measured is None else self.call_us - self.measured.total_us


def check_stages(name: str, work: StageWork, rates: StageRates, call_us: float,
                 measured: StageTimes | None = None) -> TimeCheck:
    return TimeCheck(name, predict_stages(work, rates), measured, call_us)
