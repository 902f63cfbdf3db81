"""Analytic performance model of expert-parallel dispatch and combine (docs/design.md §1, §6).

Run ``python -m megatron_ep.tools.model`` (``--help`` for the flags). The defaults are the DeepSeek-V3
training shape of docs/design.md §6: 4096 tokens per rank, hidden 7168, top-8 of 256 experts in 8 groups
with group-limited routing to 4 groups, FP8 dispatch, BF16 combine, 8 GPUs per node, and a
decode shape of 128 tokens per rank for the low-latency path.

Everything is a closed formula; nothing is sampled. The pieces, one module each (every public
name is importable from ``megatron_ep.tools.model``):

* ``shape``: the workload (tokens, the router's rule, row bytes).
* ``machine``: link and SM rates per GPU, and DeepEP V1's published H800 figures.
* ``rates``: bytes / bandwidth, per-SM rates and the SMs that cover a rate.
* ``route``: the expected fan-out of a token and the two-level route's copies per link.
* ``counts``: the same route counted exactly on given routings (rows per rank and link).
* ``kernels``: one normal or low-latency dispatch / combine: bytes, time, GB/s, SMs.
* ``stages``: the two-level path's stages, calibrated on one measurement and predicted.
* ``sm_split``: the SMs of the two copy stages if they ran at once, and which one bounds.
* ``step``: a training step's MoE layers and the share of the step their communication takes.
* ``overlap``: one MoE layer, forward and backward, with its communication under the expert GEMMs
  (token chunks, or per-expert-group arrival counters) against no overlap.
* ``tables`` / ``command``: the printed report and the command line.
"""

from .command import DEFAULT_EPS, build_parser, main
from .counts import LINK_FIELDS, LinkCount, link_count, link_count_from
from .kernels import LowLatencyResult, NormalResult, low_latency, normal_path
from .machine import DEEPEP_V1_INTERNODE, DEEPEP_V1_SOURCE, H800_NVLINK_GBPS, Machine
from .overlap import (MODES, LayerTimes, OverlapCosts, OverlapOptions, best_overlap, costs_of_layer, layer_costs,
                      layer_times)
from ...core.rates import EXPERT_GEMM_TFLOPS_BY_ROWS, expert_gemm_tflops, gbps_of, per_sm_gbps, seconds_at, sm_bound_us, sms_for, us_at
from .route import (RouteCopies, Routing, expected_units_touched, expected_units_touched_exact, max_units_touched,
                    route_copies, routing)
from .shape import Shape
from .sm_split import SmSplit, StageBound, bounding_stage, split_sms, stage_us
from .stages import (STAGE_NAMES, STAGE_OF_MARK, STAGES, TIME_TOLERANCE, StageRates, StageTimes, StageWork, TimeCheck,
                     calibrate_stages, check_stages, combine_stage_work, dispatch_stage_work, phase_stages,
                     predict_stages, verdict, within)
from .step import MoeLayerCost, StepModel, StepResult, moe_layer, step_fraction
from .tables import deepep_internode_check, report

__all__ = [
    "DEEPEP_V1_INTERNODE", "DEEPEP_V1_SOURCE", "DEFAULT_EPS", "EXPERT_GEMM_TFLOPS_BY_ROWS", "H800_NVLINK_GBPS", "LINK_FIELDS", "STAGES",
    "STAGE_NAMES", "STAGE_OF_MARK", "TIME_TOLERANCE",
    "MODES", "LayerTimes", "OverlapCosts", "OverlapOptions", "best_overlap", "costs_of_layer", "layer_costs",
    "layer_times",
    "LinkCount", "LowLatencyResult", "Machine", "MoeLayerCost", "NormalResult", "RouteCopies", "Routing", "Shape",
    "SmSplit", "StageBound", "StageRates", "StageTimes", "StageWork", "StepModel", "StepResult", "TimeCheck",
    "bounding_stage", "build_parser", "calibrate_stages", "check_stages", "combine_stage_work",
    "deepep_internode_check", "dispatch_stage_work", "expected_units_touched", "expected_units_touched_exact",
    "expert_gemm_tflops", "gbps_of", "link_count", "link_count_from", "low_latency", "main", "max_units_touched", "moe_layer",
    "normal_path", "per_sm_gbps", "phase_stages", "predict_stages", "report", "route_copies", "routing",
    "seconds_at", "sm_bound_us", "sms_for", "split_sms", "stage_us", "step_fraction", "us_at", "verdict", "within",
]
