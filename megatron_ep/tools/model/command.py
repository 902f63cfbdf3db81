"""The command line of ``python -m megatron_ep.tools.model``: options, their validation and ``main``."""

from __future__ import annotations

import argparse

from ..cli import ArgumentParser
from ...core.protocol import FP8_BLOCK
from .machine import Machine
from .overlap import OverlapOptions
from .tables import report
from .shape import Shape
from .step import StepModel

PROG = "python -m megatron_ep.tools.model"
DEFAULT_EPS = (8, 16, 32, 64, 128, 256)


def build_parser() -> argparse.ArgumentParser:
    S, M, T, O = Shape(), Machine(), StepModel(), OverlapOptions()
    p = ArgumentParser(
        prog=PROG,
        description="Analytic model of EP dispatch/combine: bytes per link, time, DeepEP-style "
                    "GB/s, SMs, low-latency time and the communication share of a training step.")
    p.add_argument("--ep", type=int, nargs="+", default=list(DEFAULT_EPS), help="EP sizes to tabulate")
    g = p.add_argument_group("shape")
    g.add_argument("--tokens", type=int, default=S.tokens, help="tokens per rank, normal path")
    g.add_argument("--decode-tokens", type=int, default=S.decode_tokens, help="tokens per rank, low-latency path")
    g.add_argument("--hidden", type=int, default=S.hidden,
                   help="hidden size (a multiple of 128 with FP8 dispatch: one scale per 128 channels)")
    g.add_argument("--topk", type=int, default=S.topk, help="experts per token")
    g.add_argument("--experts", type=int, default=S.experts, help="routed experts (a multiple of --groups and of each EP)")
    g.add_argument("--groups", type=int, default=S.groups, help="expert groups of the router")
    g.add_argument("--topk-groups", type=int, default=S.topk_groups,
                   help="groups a token may use (= --groups: no group limit)")
    g.add_argument("--bf16-dispatch", action="store_true", help="BF16 dispatch rows instead of FP8 + scales")
    m = p.add_argument_group("machine (GB/s = 1e9 B/s, one direction, per GPU)")
    m.add_argument("--gpus-per-node", type=int, default=M.gpus_per_node, help="GPUs per NVLink domain (node)")
    m.add_argument("--nvlink-gbps", type=float, default=M.nvlink_gbps,
                   help="practical NVLink bandwidth: ~370 H100/H200 (of 450), ~160 H800")
    m.add_argument("--nic-gbps", type=float, default=M.nic_gbps, help="NIC bandwidth (400 Gb/s IB = 50)")
    m.add_argument("--sm-nvlink-gbps", type=float, default=M.sm_nvlink_gbps,
                   help="bytes/s one SM copies (measured, megatron_ep.core.rates.PER_SM_COPY_GBPS)")
    m.add_argument("--sm-rdma-gbps", type=float, default=M.sm_rdma_gbps,
                   help="bytes/s one SM stages and issues as RDMA puts (assumed = the copy rate)")
    m.add_argument("--ll-fixed-us", type=float, default=M.ll_fixed_us,
                   help="low-latency fixed cost per call (DeepEP V1 H800 figures exceed "
                        "bytes/bandwidth by 34-57 us)")
    t = p.add_argument_group("training step")
    t.add_argument("--step-ep", type=int, default=T.ep, help="EP size of the training-step estimate")
    t.add_argument("--moe-ffn", type=int, default=T.moe_ffn, help="expert MLP intermediate size")
    t.add_argument("--moe-layers", type=int, default=T.moe_layers, help="MoE layers (at most --layers)")
    t.add_argument("--layers", type=int, default=T.layers, help="transformer layers in all")
    t.add_argument("--active-params", type=float, default=T.active_params,
                   help="activated parameters per token (DeepSeek-V3: 37e9)")
    t.add_argument("--tflops", type=float, default=T.tflops,
                   help="achieved dense TFLOP/s per GPU outside the routed experts (assumed)")
    t.add_argument("--expert-tflops", type=float, default=T.expert_tflops,
                   help="the routed experts' grouped GEMM rate, bf16 forward + backward (default: the rate "
                        "measured on one H200 at each EP's rows per expert, docs/performance.md, "
                        "\"Expert GEMMs, one H200\")")
    o = p.add_argument_group("communication under the expert GEMMs (megatron_ep/tools/model/overlap.py)")
    o.add_argument("--sms", type=int, default=M.sms, help="SMs per GPU (the GEMMs get what communication leaves)")
    o.add_argument("--dispatch-fixed-us", type=float, default=O.dispatch_fixed_us,
                   help="fixed cost of one dispatch call (notify, launches), paid by every chunk")
    o.add_argument("--combine-fixed-us", type=float, default=O.combine_fixed_us,
                   help="fixed cost of one combine call (call exchange, launch), paid by every chunk")
    o.add_argument("--max-pieces", type=int, default=O.max_pieces, help="most chunks or expert groups tried")
    return p


def _validate(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Sizes and rates the formulas divide by: refused with one line before any arithmetic."""
    for name in ("tokens", "decode_tokens", "hidden", "topk", "experts", "groups", "topk_groups", "gpus_per_node",
                 "step_ep", "moe_ffn", "moe_layers", "layers", "max_pieces"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("nvlink_gbps", "nic_gbps", "sm_nvlink_gbps", "sm_rdma_gbps", "active_params", "tflops",
                 "expert_tflops"):
        if getattr(a, name) is not None and not getattr(a, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    for name in ("ll_fixed_us", "dispatch_fixed_us", "combine_fixed_us"):
        if getattr(a, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if a.sms < 2:
        parser.error(f"--sms must be >= 2 (communication and GEMMs share them), got {a.sms}")
    bad = [ep for ep in a.ep if ep < 1]
    if bad:
        parser.error(f"--ep sizes must be >= 1, got {bad}")
    if a.moe_layers > a.layers:
        parser.error(f"--moe-layers {a.moe_layers} is more than --layers {a.layers}")
    if not a.bf16_dispatch and a.hidden % FP8_BLOCK:
        parser.error(f"--hidden {a.hidden} must be a multiple of {FP8_BLOCK} for FP8 dispatch (one scale per "
                     f"{FP8_BLOCK} channels), or pass --bf16-dispatch")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    _validate(parser, a)
    shape = Shape(tokens=a.tokens, decode_tokens=a.decode_tokens, hidden=a.hidden, topk=a.topk,
                  experts=a.experts, groups=a.groups, topk_groups=a.topk_groups,
                  fp8_dispatch=not a.bf16_dispatch)
    machine = Machine(gpus_per_node=a.gpus_per_node, nvlink_gbps=a.nvlink_gbps, nic_gbps=a.nic_gbps,
                      sm_nvlink_gbps=a.sm_nvlink_gbps, sm_rdma_gbps=a.sm_rdma_gbps,
                      ll_fixed_us=a.ll_fixed_us, sms=a.sms)
    step = StepModel(ep=a.step_ep, moe_ffn=a.moe_ffn, moe_layers=a.moe_layers, layers=a.layers,
                     active_params=a.active_params, tflops=a.tflops, expert_tflops=a.expert_tflops)
    try:
        text = report(shape, machine, step, a.ep, OverlapOptions(a.dispatch_fixed_us, a.combine_fixed_us, a.max_pieces))
    except ValueError as e:
        parser.error(str(e))
    print(text)
    return 0
