"""The printed report of ``python -m megatron_ep.tools.model``: routing, the normal and low-latency
paths per EP size, the check against DeepEP V1's published figures, the training step and one
MoE layer with its communication under the expert GEMMs."""

from __future__ import annotations

import dataclasses

from .kernels import low_latency, normal_path
from .machine import DEEPEP_V1_INTERNODE, DEEPEP_V1_SOURCE, H800_NVLINK_GBPS, Machine
from .overlap import OverlapOptions, best_overlap, layer_costs
from .route import routing
from .shape import Shape
from .step import StepModel, step_fraction


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def report(shape: Shape, machine: Machine, step: StepModel, eps: list[int], overlap: OverlapOptions | None = None) -> str:
    """The text ``python -m megatron_ep.tools.model`` prints for these inputs and EP sizes."""
    out = []
    d_row, c_row = shape.dispatch_row_bytes, shape.combine_row_bytes
    out.append(
        f"megatron_ep analytic model: {shape.tokens} tokens/rank, hidden {shape.hidden}, "
        f"top-{shape.topk} of {shape.experts} experts, {shape.groups} groups, "
        f"{shape.topk_groups} per token; dispatch {'FP8' if shape.fp8_dispatch else 'BF16'} "
        f"{d_row} B/row, combine {c_row} B/row")
    out.append(
        f"machine: {machine.gpus_per_node} GPUs/node, NVLink {machine.nvlink_gbps:g} GB/s, "
        f"NIC {machine.nic_gbps:g} GB/s per GPU; per SM {machine.sm_nvlink_gbps:g} GB/s (NVLink copy), "
        f"{machine.sm_rdma_gbps:g} GB/s (RDMA issue)")

    rs = [routing(shape, machine, ep) for ep in eps]
    out.append("\nrouting (expected per token, uniform group-limited routing, exact)")
    out.append(_table(
        ["EP", "nodes", "E[nodes]", "max", "E[RDMA copies]", "E[ranks]", "E[GPUs/touched node]",
         "E[NVLink copies]"],
        [[str(r.ep), str(r.nodes), f"{r.nodes_touched:.2f}", str(r.max_nodes), f"{r.rdma_copies:.2f}",
          f"{r.ranks_touched:.2f}", f"{r.ranks_per_touched_node:.2f}", f"{r.nvlink_copies:.2f}"]
         for r in rs]))

    for name, row in (("dispatch", d_row), ("combine", c_row)):
        res = [normal_path(shape, machine, ep, row) for ep in eps]
        out.append(f"\nnormal {name} ({row} B/row), per rank; GB/s in DeepEP's accounting")
        out.append(_table(
            ["EP", "path", "RDMA MB", "NVLink MB", "time us", "bound", "RDMA GB/s", "NVL GB/s",
             "SMs bound", "SMs all"],
            [[str(x.ep), "2-level" if x.two_level else "1-level", f"{x.rdma_bytes / 1e6:.1f}",
              f"{x.nvlink_bytes / 1e6:.1f}", f"{x.time_us:.0f}", x.bound,
              f"{x.deepep_rdma_gbps:.0f}" if x.two_level else "-", f"{x.deepep_nvlink_gbps:.0f}",
              str(x.sms_bound), str(x.sms_all)] for x in res]))

    out.append(deepep_internode_check(shape, machine))

    out.append(f"\nlow-latency ({shape.decode_tokens} tokens/rank, every (token, expert) copy sent, "
               f"fixed {machine.ll_fixed_us:g} us + bytes/bandwidth)")
    rows = []
    for ep in eps:
        d = low_latency(shape, machine, ep, d_row)
        c = low_latency(shape, machine, ep, c_row)
        rows.append([str(ep), f"{d.total_bytes / 1e6:.2f}", f"{d.rdma_bytes / 1e6:.2f}",
                     f"{d.nvlink_bytes / 1e6:.2f}", f"{d.time_us:.0f}", f"{c.total_bytes / 1e6:.2f}",
                     f"{c.rdma_bytes / 1e6:.2f}", f"{c.nvlink_bytes / 1e6:.2f}", f"{c.time_us:.0f}"])
    out.append(_table(["EP", "disp MB", "RDMA MB", "NVL MB", "disp us", "comb MB", "RDMA MB",
                       "NVL MB", "comb us"], rows))

    s = step_fraction(shape, machine, step)
    out.append(
        f"\ntraining step at EP{s.ep} ({step.moe_layers} MoE of {step.layers} layers, expert FFN "
        f"{step.moe_ffn}, {step.active_params / 1e9:g}B active params, expert GEMMs "
        f"{step.expert_rate(shape):.0f} TFLOP/s{'' if step.expert_tflops is not None else ' (measured, by rows per expert)'}, "
        f"the rest {step.tflops:g} TFLOP/s), "
        f"per rank and micro-batch:")
    out.append(f"  compute {s.compute_ms:.0f} ms (experts {s.expert_flops / 1e12:.0f} TFLOP, "
               f"rest {s.other_flops / 1e12:.0f} TFLOP); dispatch+combine fwd+bwd "
               f"{s.comm_per_layer_us:.0f} us per MoE layer, {s.comm_ms:.0f} ms in all")
    out.append(f"  communication share with no overlap: {100 * s.fraction:.1f}% "
               f"(an upper bound: any overlap lowers it); with perfect overlap "
               f"{100 * s.fraction_overlapped:.1f}% (the lower bound)")
    out.append(overlap_table(shape, machine, step, overlap or OverlapOptions()))
    return "\n".join(out)


def overlap_table(shape: Shape, machine: Machine, step: StepModel, o: OverlapOptions) -> str:
    """One MoE layer (forward + backward) with no overlap and under each mechanism of overlap.py,
    at EP 2, 8 and the step's EP; then the step with the best mechanism."""
    out = [f"\ncommunication under the expert GEMMs (megatron_ep/tools/model/overlap.py), one MoE layer fwd + bwd per "
           f"rank and micro-batch, ms; fixed cost {o.dispatch_fixed_us:g} us per dispatch call and "
           f"{o.combine_fixed_us:g} us per combine call, at most {o.max_pieces} chunks or expert groups, "
           f"weight gradients deferred"]
    rows, best_at_step = [], None
    for ep in sorted({2, 8, step.ep}):
        st = dataclasses.replace(step, ep=ep)
        costs = layer_costs(shape, machine, st)
        b = best_overlap(costs, o.max_pieces, o.dispatch_fixed_us, o.combine_fixed_us)
        none, chunks, arr = b["none"], b["chunks"], b["arrivals"]
        best = min(chunks, arr, key=lambda t: t.total_us)
        rows.append([str(ep), f"{(costs.dispatch + costs.combine) / 1e3:.2f}", f"{3 * costs.gemm_fwd / 1e3:.2f}",
                     str(costs.comm_sms), f"{none.total_us / 1e3:.2f}",
                     f"{chunks.total_us / 1e3:.2f} ({chunks.pieces})", f"{arr.total_us / 1e3:.2f} ({arr.pieces})",
                     f"{none.total_us / best.total_us:.2f}x"])
        if ep == step.ep:
            best_at_step = (none, best, costs)
    out.append(_table(["EP", "D+C fwd", "GEMMs", "comm SMs", "no overlap", "chunks (n)", "arrivals (n)",
                       "best gain"], rows))
    s = step_fraction(shape, machine, step)
    none, best, costs = best_at_step
    other_ms = s.compute_ms - step.moe_layers * 3 * costs.gemm_fwd / 1e3
    t_none = other_ms + step.moe_layers * none.total_us / 1e3
    t_best = other_ms + step.moe_layers * best.total_us / 1e3
    out.append(f"  step at EP{step.ep}: {t_none:.0f} ms with no overlap (backward transfers at BF16 size), "
               f"{t_best:.0f} ms with {best.mode} ({best.pieces}): {t_none / t_best:.2f}x")
    return "\n".join(out)


def deepep_internode_check(shape: Shape, machine: Machine) -> str:
    """EP16-EP64 two-level predictions in DeepEP's RDMA accounting beside its published figures,
    with DeepEP's test routing (one group per node, min(nodes, 4) per token) and H800 NVLink."""
    m = dataclasses.replace(machine, nvlink_gbps=H800_NVLINK_GBPS)
    rows = []
    for ep, (pub_d, pub_c) in sorted(DEEPEP_V1_INTERNODE.items()):
        n = ep // m.gpus_per_node
        if ep % m.gpus_per_node or n < 2 or shape.experts % ep or shape.experts % n:
            continue
        s = dataclasses.replace(shape, groups=n, topk_groups=min(n, 4), fp8_dispatch=True, combine_elem_bytes=2)
        d, c = normal_path(s, m, ep, s.dispatch_row_bytes), normal_path(s, m, ep, s.combine_row_bytes)
        r = routing(s, m, ep)
        rows.append([str(ep), str(n), f"{r.nodes_touched:.2f}", d.bound, f"{d.deepep_rdma_gbps:.0f}", f"{pub_d:g}",
                     f"{d.deepep_rdma_gbps / pub_d:.2f}", f"{c.deepep_rdma_gbps:.0f}", f"{pub_c:g}",
                     f"{c.deepep_rdma_gbps / pub_c:.2f}"])
    head = (f"\ntwo-level vs DeepEP V1 published: RDMA GB/s in DeepEP's accounting ((token, node) pairs incl. own "
            f"node x row bytes / time)\n  model at NVLink {H800_NVLINK_GBPS:g} GB/s (H800), NIC {m.nic_gbps:g} GB/s, "
            f"DeepEP's test routing (groups = nodes, min(nodes, 4) per token), FP8 dispatch, BF16 combine\n"
            f"  published: {DEEPEP_V1_SOURCE}")
    if not rows:
        return head + "\n  (no EP16-EP64 two-level case at this --gpus-per-node / --experts)"
    return head + "\n" + _table(["EP", "nodes", "E[nodes]", "bound", "disp model", "DeepEP", "ratio", "comb model",
                                 "DeepEP", "ratio"], rows)
