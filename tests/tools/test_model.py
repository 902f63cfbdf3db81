"""The analytic performance model (megatron_ep/tools/model.py): hand-computed cases, a Monte-Carlo
cross-check of the exact routing formula, and the CLI."""

import math
import os
import random
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from megatron_ep.tools import model as M

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------
# Expected fan-out


def test_issue_figure_363_and_seed_530():
    # 128 experts in 4 groups (nodes), top-8, no group limit: 4 * (1 - C(96,8)/C(128,8)) = 3.63
    assert round(M.expected_units_touched(128, 4, 4, 4, 8), 2) == 3.63
    # 256 experts over 8 nodes, no limit (seed, section 1.1)
    assert round(M.expected_units_touched(256, 8, 8, 8, 8), 2) == 5.29  # the seed rounds 5.2947 to 5.30
    # closed form of the no-limit case, exactly
    assert M.expected_units_touched_exact(128, 4, 4, 4, 8) == 4 * (1 - Fraction(math.comb(96, 8), math.comb(128, 8)))


def test_group_limit_to_4_of_8_nodes_equals_the_128_expert_case():
    # DeepSeek-V3 at EP64: 8 nodes = 8 groups, 4 selected: the token lives on 4 nodes' 128 experts
    e = M.expected_units_touched_exact(256, 8, 8, 4, 8)
    assert e == M.expected_units_touched_exact(128, 4, 4, 4, 8)
    assert 3.5 < e <= 4
    # groups = nodes = 8 but the routing limit is what bounds it: never above topk_groups
    assert M.expected_units_touched(256, 8, 8, 2, 8) <= 2
    assert M.max_units_touched(256, 8, 8, 4, 8) == 4


def test_degenerate_limits():
    assert M.expected_units_touched_exact(256, 1, 8, 4, 8) == 1  # one node
    assert M.expected_units_touched_exact(256, 64, 8, 4, 1) == 1  # top-1 hits one unit
    assert M.expected_units_touched_exact(64, 64, 1, 1, 8) == 8  # one expert per unit: k units
    assert M.expected_units_touched_exact(8, 8, 1, 1, 8) == 8  # every expert chosen
    # 2 nodes, top-8: min(topk, nodes) = 2 bounds it; the miss probability is C(128,8)/C(256,8)
    e = M.expected_units_touched_exact(256, 2, 1, 1, 8)
    assert e == 2 * (1 - Fraction(math.comb(128, 8), math.comb(256, 8)))
    assert M.max_units_touched(256, 2, 1, 1, 8) == 2
    assert M.max_units_touched(256, 256, 8, 4, 8) == 8


def test_hand_case_groups_nested_in_nodes():
    # 8 experts, 4 groups of 2, 2 nodes of 4 (two groups each); pick 2 groups, then top-2.
    # Both groups on one node: P = 2/6, token on 1 node. Otherwise (4/6) the 4 experts are split
    # 2 + 2 and both nodes are hit unless both picks land on one node: 2 of C(4,2)=6 pairs.
    # E = 2/6 * 1 + 4/6 * (1 * 2/6 + 2 * 4/6) = 1/3 + 4/6 * 10/6 = 13/9
    assert M.expected_units_touched_exact(8, 2, 4, 2, 2) == Fraction(13, 9)


def test_hand_case_nodes_nested_in_groups():
    # 8 experts, 2 groups of 4, 4 nodes of 2; pick 1 group then top-2 of its 4 experts:
    # the 2 nodes of that group are both hit unless the pair is one node (2 of 6): E = 1*2/6 + 2*4/6
    assert M.expected_units_touched_exact(8, 4, 2, 1, 2) == Fraction(10, 6)


def _sample_units(rng, experts, units, groups, topk_groups, topk):
    gs, us = experts // groups, experts // units
    sel = rng.sample(range(groups), topk_groups)
    pool = [g * gs + i for g in sel for i in range(gs)]
    return len({e // us for e in rng.sample(pool, topk)})


@pytest.mark.parametrize("experts,units,groups,topk_groups,topk", [
    (256, 8, 8, 4, 8),    # EP64 nodes, groups = nodes
    (256, 2, 8, 4, 8),    # EP16 nodes: 4 groups per node
    (256, 16, 8, 4, 8),   # EP128 nodes: a group spans 2 nodes
    (256, 64, 8, 4, 8),   # EP64 ranks
    (96, 4, 3, 2, 5),     # groups of 32 and units of 24 do not nest
])
def test_exact_formula_matches_monte_carlo(experts, units, groups, topk_groups, topk):
    rng = random.Random(1234)
    n = 4000
    mc = sum(_sample_units(rng, experts, units, groups, topk_groups, topk) for _ in range(n)) / n
    exact = M.expected_units_touched(experts, units, groups, topk_groups, topk)
    # standard deviation of the count is below 1.2 in these cases: 5 standard errors ~ 0.1
    assert abs(mc - exact) < 0.1, (mc, exact)


def test_routing_copy_counts():
    r = M.routing(M.Shape(), M.Machine(), 64)
    assert (r.nodes, r.ranks_per_node) == (8, 8)
    assert r.nodes_touched == pytest.approx(3.6290, abs=1e-4)
    assert r.rdma_copies == pytest.approx(r.nodes_touched * 7 / 8)  # 3.18 in the seed
    assert round(r.rdma_copies, 2) == 3.18
    assert r.nvlink_copies == pytest.approx(r.ranks_touched * 7 / 8)
    assert r.ranks_per_touched_node == pytest.approx(r.ranks_touched / r.nodes_touched)
    one = M.routing(M.Shape(), M.Machine(), 8)
    assert (one.nodes, one.nodes_touched, one.rdma_copies) == (1, 1.0, 0.0)
    with pytest.raises(ValueError, match="multiple"):
        M.routing(M.Shape(), M.Machine(), 12)


# ---------------------------------------------------------------------------------------------
# Normal path


def test_bytes_tiny_one_level():
    # 1 node, EP2, 4 experts (2 per rank), top-2 of all: E[ranks] = 2 * (1 - C(2,2)/C(4,2)) = 5/3;
    # 6 tokens, hidden 128 FP8 = 132 B/row, NVLink copies 5/3 * 1/2 -> 6 * 5/6 * 132 = 660 B
    shape = M.Shape(tokens=6, hidden=128, topk=2, experts=4, groups=1, topk_groups=1)
    mach = M.Machine(nvlink_gbps=100.0)
    assert shape.dispatch_row_bytes == 132 and shape.combine_row_bytes == 256
    r = M.normal_path(shape, mach, 2, shape.dispatch_row_bytes)
    assert not r.two_level and r.rdma_bytes == 0
    assert r.nvlink_bytes == pytest.approx(660)
    assert r.time_us == pytest.approx(660 / 100e9 * 1e6)
    # DeepEP counts the rank's own rows too: 6 * 5/3 * 132 B in the same time = 2x the link
    assert r.deepep_nvlink_gbps == pytest.approx(200.0)
    c = M.normal_path(shape, mach, 2, shape.combine_row_bytes)
    assert c.nvlink_bytes == pytest.approx(6 * 5 / 6 * 256)


def test_bytes_tiny_two_level():
    # 2 nodes x 2 GPUs, one expert per rank, top-4 = every expert: each token reaches both nodes
    # (1 RDMA copy) and all 4 ranks (NVLink copies 4 * 1/2 = 2). 10 tokens of 132 B.
    shape = M.Shape(tokens=10, hidden=128, topk=4, experts=4, groups=1, topk_groups=1)
    mach = M.Machine(gpus_per_node=2, nic_gbps=1.0, nvlink_gbps=10.0, sm_rdma_gbps=0.3, sm_nvlink_gbps=0.5)
    r = M.normal_path(shape, mach, 4, 132)
    assert r.two_level and r.bound == "RDMA"
    assert r.rdma_bytes == pytest.approx(1320) and r.nvlink_bytes == pytest.approx(2640)
    assert r.time_us == pytest.approx(1.32)
    assert r.deepep_rdma_gbps == pytest.approx(2.0)  # 10 tokens x 2 nodes (own included) x 132 B
    assert r.deepep_nvlink_gbps == pytest.approx(4.0)  # 10 x 4 ranks x 132 B
    assert r.sms_bound == 4  # ceil(1 / 0.3)
    assert r.sms_all == 4 + 4  # NVLink runs at 2640 B / 1.32 us = 2 GB/s -> ceil(2 / 0.5)
    fast_nic = M.normal_path(shape, M.Machine(gpus_per_node=2, nic_gbps=100.0, nvlink_gbps=10.0), 4, 132)
    assert fast_nic.bound == "NVLink" and fast_nic.time_us == pytest.approx(0.264)


def test_intranode_time_hand_computed():
    # EP8 on one node, 8 experts, top-8: every token goes to the 7 other ranks.
    # 1000 tokens x 7 x 7392 B (FP8 7168 + 56 scales x 4) = 51.744 MB at 370 GB/s = 139.85 us
    shape = M.Shape(tokens=1000, topk=8, experts=8, groups=1, topk_groups=1)
    r = M.normal_path(shape, M.Machine(), 8, shape.dispatch_row_bytes)
    assert shape.dispatch_row_bytes == 7392
    assert r.nvlink_bytes == pytest.approx(51.744e6)
    assert r.time_us == pytest.approx(139.848649, rel=1e-6)
    assert r.bound == "NVLink"


def test_sm_saturation():
    r = M.normal_path(M.Shape(), M.Machine(), 8, 7392)
    assert r.sms_bound == r.sms_all == 9  # ceil(370 / 45)
    assert M.normal_path(M.Shape(), M.Machine(sm_nvlink_gbps=37.0), 8, 7392).sms_bound == 10  # exact ratio
    r64 = M.normal_path(M.Shape(), M.Machine(), 64, 7392)
    assert r64.bound == "RDMA" and r64.sms_bound == 2  # ceil(50 / 45)
    assert M.sms_for(0.0, 45.0) == 0 and M.sms_for(45.1, 45.0) == 2


def test_deepseek_ep64_dispatch_is_rdma_bound():
    # 4096 tokens x 3.18 remote nodes x 7392 B over 50 GB/s ~ 1.92 ms
    r = M.normal_path(M.Shape(), M.Machine(), 64, 7392)
    rt = M.routing(M.Shape(), M.Machine(), 64)
    assert r.time_us == pytest.approx(4096 * rt.rdma_copies * 7392 / 50e9 * 1e6)
    assert 1900 < r.time_us < 1950
    # in DeepEP's accounting the RDMA figure exceeds the NIC by E[nodes] / E[remote nodes] = 8/7
    assert r.deepep_rdma_gbps == pytest.approx(50 * 8 / 7)


# ---------------------------------------------------------------------------------------------
# Low latency and the training step


def test_low_latency_bytes_and_time():
    shape = M.Shape()
    mach = M.Machine()
    d = M.low_latency(shape, mach, 16, 7392)
    total = 128 * 8 * 7392
    assert d.total_bytes == total
    assert d.rdma_bytes == pytest.approx(total / 2) and d.nvlink_bytes == pytest.approx(total * 7 / 16)
    assert d.time_us == pytest.approx(40 + total / 2 / 50e9 * 1e6)
    one = M.low_latency(shape, mach, 8, 14336)
    assert one.rdma_bytes == 0
    assert one.time_us == pytest.approx(40 + 128 * 8 * 14336 * 7 / 8 / 370e9 * 1e6)


def test_step_fraction():
    s = M.step_fraction(M.Shape(), M.Machine(), M.StepModel())
    assert s.expert_flops == 58 * 18 * 4096 * 8 * 7168 * 2048  # 3 GEMMs fwd, 2x bwd
    routed = 58 * 8 * 3 * 7168 * 2048
    assert s.other_flops == pytest.approx(6 * (37e9 - routed) * 4096)
    # the routed experts at the grouped GEMM rate measured at EP64's 8192 rows per expert, the rest at the assumed dense rate
    assert s.compute_ms == pytest.approx((s.expert_flops / 531e12 + s.other_flops / 400e12) * 1e3)
    d = M.normal_path(M.Shape(), M.Machine(), 64, 7392).time_us
    c = M.normal_path(M.Shape(), M.Machine(), 64, 14336).time_us
    assert s.comm_ms == pytest.approx(58 * 2 * (d + c) / 1e3)
    assert s.fraction == pytest.approx(s.comm_ms / (s.comm_ms + s.compute_ms))
    assert 0.15 < s.fraction < 0.30 and s.fraction_overlapped == 0.0
    slow = M.step_fraction(M.Shape(), M.Machine(nic_gbps=5.0), M.StepModel())
    assert slow.fraction > s.fraction and slow.fraction_overlapped > 0


def test_expert_gemm_rate_defaults_to_the_measured_one():
    """The routed experts' GEMMs run at the rate measured at each EP's rows per expert
    (rates.expert_gemm_tflops: docs/performance.md's "Expert GEMMs, one H200", DeepGEMM bf16 416 /
    507 / 528 / 531 TFLOP/s at 256 / 1024 / 4096 / 8192 rows) unless `expert_tflops` fixes it, in
    the step and in the overlap model's layer; `tflops` times only the rest of the model."""
    assert M.expert_gemm_tflops(8192) == 531.0 and M.expert_gemm_tflops(256) == 416.0
    assert M.expert_gemm_tflops(100) == 416.0 and M.expert_gemm_tflops(1e6) == 531.0  # the nearest point outside
    assert M.expert_gemm_tflops(512) == pytest.approx((416.0 + 507.0) / 2)  # linear in log2(rows)
    shape, mach = M.Shape(), M.Machine()  # 4096 tokens x top-8 over 256 experts: 128 x EP rows per expert
    assert M.StepModel(ep=64).expert_rate(shape) == 531.0 and M.StepModel(ep=2).expert_rate(shape) == 416.0
    fwd_flops = M.moe_layer(shape, mach, M.StepModel()).expert_flops / 3
    assert M.layer_costs(shape, mach, M.StepModel()).gemm_fwd == pytest.approx(fwd_flops / 531e12 * 1e6)
    assert M.layer_costs(shape, mach, M.StepModel(tflops=100.0)).gemm_fwd == pytest.approx(fwd_flops / 531e12 * 1e6)
    assert M.layer_costs(shape, mach, M.StepModel(ep=8)).gemm_fwd == pytest.approx(fwd_flops / 507e12 * 1e6)
    assert M.layer_costs(shape, mach, M.StepModel(expert_tflops=255.0)).gemm_fwd == pytest.approx(fwd_flops / 255e12 * 1e6)
    same = M.step_fraction(shape, mach, M.StepModel(expert_tflops=400.0))  # one rate for all compute
    assert same.compute_ms == pytest.approx((same.expert_flops + same.other_flops) / 400e12 * 1e3)
    assert same.compute_ms > M.step_fraction(shape, mach, M.StepModel()).compute_ms


def test_cli_expert_tflops(capsys):
    assert M.main(["--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "expert GEMMs 531 TFLOP/s (measured, by rows per expert), the rest 400 TFLOP/s" in out  # EP64
    gemms = {ln.split()[0]: ln.split()[2] for ln in out.splitlines() if ln.split()[:1] in (["2"], ["64"])}
    assert gemms == {"2": "20.81", "64": "16.31"}  # fwd + bwd GEMMs of one layer, ms: 416 / 531 TFLOP/s
    assert M.main(["--ep", "8", "--expert-tflops", "400", "--tflops", "300"]) == 0
    out = capsys.readouterr().out
    assert "expert GEMMs 400 TFLOP/s, the rest 300 TFLOP/s" in out
    assert [ln.split()[2] for ln in out.splitlines() if ln.split()[:1] == ["64"]][-1] == "21.65"
    with pytest.raises(SystemExit) as e:
        M.main(["--expert-tflops", "0"])
    assert e.value.code == 2 and "--expert-tflops must be > 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_help_and_default_run():
    # both subprocesses at once: each pays the package's torch import
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmds = [[sys.executable, "-m", "megatron_ep.tools.model", "--help"],
            [sys.executable, "-m", "megatron_ep.tools.model"]]
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    (h_out, _), (d_out, d_err) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0 and "--nvlink-gbps" in h_out
    assert procs[1].returncode == 0, d_err
    lines = d_out.splitlines()
    ep64 = [ln.split() for ln in lines if ln.split()[:2] == ["64", "8"]]
    assert ep64 and ep64[0][2] == "3.63"  # E[nodes] at EP64
    assert any(ln.split()[:2] == ["256", "2-level"] for ln in lines)
    assert "upper bound" in d_out


def test_cli_in_process(capsys):
    assert M.main(["--ep", "8", "64", "--nic-gbps", "25"]) == 0
    out = capsys.readouterr().out
    assert "NIC 25 GB/s" in out
    assert "DeepEP V1 published" in out and "3b1045d" in out
    ep64 = [ln.split() for ln in out.splitlines() if ln.split()[:3] == ["64", "8", "3.63"]]
    # EP64 beside DeepEP's 51 / 50 GB/s (here at a 25 GB/s NIC: the model's 29 GB/s is below them)
    assert ep64 and ep64[-1][5] == "51" and ep64[-1][8] == "50"
    assert float(ep64[-1][6]) == pytest.approx(float(ep64[-1][4]) / 51, abs=0.01)
    with pytest.raises(SystemExit) as e:
        M.main(["--topk-groups", "9"])
    assert e.value.code == 2 and "topk_groups" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Exact per-link counts of a routing (link_count) against brute force, the reference backend's
# dispatch, and the analytic expectation


def _brute_force(dests, R, P):
    """Per-link rows per rank from each token's destination ranks, written with sets and loops
    (the route of docs/design.md §1, independently of model.route_copies): dests[s] = one set of
    destination ranks per token of source rank s."""
    out = {k: [0] * R for k in M.LINK_FIELDS}
    for s, tokens in enumerate(dests):
        n, l = divmod(s, P)
        for D in tokens:
            for d in D:
                out["recv_rows"][d] += 1
            for m in sorted({d // P for d in D}):
                landing = m * P + l
                out["deepep_rdma"][s] += 1
                if m != n:
                    out["rdma_sent"][s] += 1
                    out["rdma_recv"][landing] += 1
                for d in D:
                    if d // P == m and d != landing:
                        out["nvlink_sent"][landing] += 1
                        out["nvlink_recv"][d] += 1
    return out


def _dests(idx, E, R):
    return [{e // (E // R) for e in row if e >= 0} for row in idx.tolist()]


def test_route_copies_is_the_model_route():
    # one token of rank (node 0, local 1), 2 nodes x 2: destinations ranks 0, 1 (own node) and 3
    # (node 1, lands on rank 3 = (1, 1)): 1 RDMA copy; NVLink: rank 1 -> 0 and nothing on node 1
    c = M.route_copies(2, 1, 3, 2)
    assert (c.rdma, c.nvlink, c.deepep_rdma, c.deepep_nvlink) == (1, 1, 2, 3)
    lc = M.link_count_from(torch.tensor([[0, 2, 7, -1]]), 8, 4, 2, 1, row_bytes=10)
    assert lc.rdma_sent == [0, 1, 0, 0] and lc.rdma_recv == [0, 0, 0, 1]
    assert lc.deepep_rdma == [0, 2, 0, 0] and lc.nvlink_sent == [0, 1, 0, 0] and lc.nvlink_recv == [1, 0, 0, 0]
    assert lc.recv_rows == [1, 1, 0, 1]
    assert lc.rdma_bytes == [0, 10, 0, 0] and lc.deepep_rdma_bytes == [0, 20, 0, 0] and lc.nvlink_bytes == [0, 10, 0, 0]
    # the analytic model takes its copies from the same function (expected arguments)
    r = M.routing(M.Shape(), M.Machine(), 32)
    e = M.route_copies(r.nodes_touched, r.nodes_touched / 4, r.ranks_touched, r.ranks_touched / 8)
    assert r.rdma_copies == pytest.approx(e.rdma) and r.nvlink_copies == pytest.approx(e.nvlink)
    with pytest.raises(ValueError, match="outside"):
        M.link_count_from(torch.tensor([[8]]), 8, 4, 2, 0)
    with pytest.raises(ValueError, match="divid"):
        M.link_count_from(torch.tensor([[0]]), 8, 4, 3, 0)


@pytest.mark.parametrize("R,P", [(4, 1), (4, 2), (8, 2), (8, 4), (6, 3), (4, 4)])
def test_link_count_equals_brute_force(R, P):
    g = torch.Generator().manual_seed(R * 10 + P)
    E, K = 4 * R, 5
    routings = []
    for s in range(R):
        T = 0 if s == 1 else 20 + 7 * s
        idx = torch.randint(-1, E, (T, K), generator=g)  # -1 slots, repeated ranks, repeated experts
        routings.append(idx)
    lc = M.link_count(routings, E, P, row_bytes=3)
    want = _brute_force([_dests(i, E, R) for i in routings], R, P)
    for f in M.LINK_FIELDS:
        assert getattr(lc, f) == want[f], f
    assert sum(lc.rdma_sent) == sum(lc.rdma_recv) and sum(lc.nvlink_sent) == sum(lc.nvlink_recv)
    assert lc.rdma_bytes == [3 * v for v in want["rdma_sent"]]
    if P == R:
        assert lc.rdma_sent == [0] * R and lc.deepep_rdma == [len([d for d in _dests(i, E, R) if d])
                                                             for i in routings]


def reference_destinations(E, K, T_of_rank):
    """Runs on every rank of a gloo pool: a rank-major dispatch of the torch reference backend
    whose rows carry (source rank, token) in their first channels; returns this rank's routing
    and the (source rank, token) of every row it received."""
    import torch.distributed as dist

    import megatron_ep as mep

    rank = dist.get_rank()
    T = T_of_rank[rank]
    g = torch.Generator().manual_seed(77 + rank)
    idx = torch.rand((T, E), generator=g).argsort(dim=1)[:, :K]  # distinct experts (the contract)
    idx = idx.masked_fill(torch.rand((T, K), generator=g) < 0.2, -1)  # and -1 slots
    x = torch.zeros((T, 128), dtype=torch.bfloat16)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T) % 128
    x[:, 2] = torch.arange(T) // 128
    buf = mep.Buffer(dist.group.WORLD, backend="torch")
    out = buf.dispatch(x, idx, torch.ones((T, K)), num_experts=E)
    got = out.x.float()
    src = [(int(a), int(b) + 128 * int(c)) for a, b, c in got[:, :3].tolist()]
    return idx, src


@pytest.mark.parametrize("P", [1, 2])
def test_link_count_equals_reference_dispatch(pools, P):
    # The reference backend has no nodes; what it does say is which ranks receive each token
    # (the rank-major rows). The route is a function of those sets: count it by brute force.
    R, E, K = 4, 16, 4
    T_of_rank = [50, 0, 33, 70]
    res = pools(R).run(reference_destinations, E, K, T_of_rank)
    routings = [r[0] for r in res]
    dests = [[set() for _ in range(T_of_rank[s])] for s in range(R)]
    for d, (_, src) in enumerate(res):
        for s, t in src:
            assert d not in dests[s][t]  # one row per (token, destination rank)
            dests[s][t].add(d)
    assert dests == [_dests(i, E, R) for i in routings]  # the reference delivers to the experts' owners
    lc = M.link_count(routings, E, P)
    want = _brute_force(dests, R, P)
    for f in M.LINK_FIELDS:
        assert getattr(lc, f) == want[f], f
    assert lc.recv_rows == [len(r[1]) for r in res]  # rank-major rows = DeepEP's NVLink accounting


def _group_limited(T, E, G, g, k, gen):
    """The analytic model's routing: g of G groups uniformly, then k experts uniformly among them."""
    grp = torch.rand((T, G), generator=gen).topk(g, dim=1).indices
    mask = torch.zeros((T, G), dtype=torch.bool).scatter_(1, grp, True).repeat_interleave(E // G, dim=1)
    return torch.rand((T, E), generator=gen).masked_fill(~mask, -1.0).topk(k, dim=1).indices


def _deepseek_v3_router(T, E, G, g, k, gen):
    """DeepSeek-V3's group-limited router on i.i.d. scores: group score = sum of its top-2 expert
    scores, top-g groups, then the top-k experts of those groups."""
    s = torch.rand((T, E), generator=gen)
    grp = s.view(T, G, E // G).topk(2, dim=-1).values.sum(-1).topk(g, dim=1).indices
    mask = torch.zeros((T, G), dtype=torch.bool).scatter_(1, grp, True).repeat_interleave(E // G, dim=1)
    return s.masked_fill(~mask, -1.0).topk(k, dim=1).indices


@pytest.mark.parametrize("ep,groups,topk_groups", [
    (16, 8, 4), (32, 8, 4), (64, 8, 4),  # DeepSeek-V3 training shape, group-limited
    (16, 1, 1), (64, 1, 1),  # uniform top-8 of 256
    (64, 8, 8),  # 8 groups, no limit
])
def test_mean_link_count_converges_to_the_model(ep, groups, topk_groups):
    shape = M.Shape(tokens=1024, groups=groups, topk_groups=topk_groups)
    mach = M.Machine()
    row = shape.dispatch_row_bytes
    gen = torch.Generator().manual_seed(ep + groups)
    total = None
    draws = 2
    for _ in range(draws):
        rt = [_group_limited(shape.tokens, shape.experts, groups, topk_groups, shape.topk, gen) for _ in range(ep)]
        c = M.link_count(rt, shape.experts, mach.gpus_per_node, row)
        total = c if total is None else total + c
    n = draws * ep  # rank-draws
    mean = lambda xs: sum(xs) / n  # noqa: E731
    r = M.routing(shape, mach, ep)
    npath = M.normal_path(shape, mach, ep, row)
    assert mean(total.rdma_bytes) == pytest.approx(npath.rdma_bytes, rel=0.02)
    assert mean(total.nvlink_bytes) == pytest.approx(npath.nvlink_bytes, rel=0.02)
    assert mean(total.deepep_rdma_bytes) == pytest.approx(shape.tokens * r.nodes_touched * row, rel=0.02)
    assert mean(total.bytes("recv_rows")) == pytest.approx(shape.tokens * r.ranks_touched * row, rel=0.02)
    # every rank, not only the mean: one rank's 1024 x 2 tokens are within a few % too
    for f, expect in (("rdma_sent", r.rdma_copies), ("nvlink_sent", r.nvlink_copies)):
        for v in getattr(total, f):
            assert v / draws == pytest.approx(shape.tokens * expect, rel=0.06), f


def test_deepseek_v3_router_spreads_wider_than_the_model():
    # The analytic model draws experts uniformly inside the selected groups. DeepSeek-V3's router
    # on i.i.d. scores picks groups for their high scores, so a token's experts spread over more
    # of its groups: node-limited all the same (<= 4 nodes at EP64), but E[nodes] is ~9% higher.
    gen = torch.Generator().manual_seed(3)
    ep, E = 64, 256
    rt = [_deepseek_v3_router(512, E, 8, 4, 8, gen) for _ in range(ep)]
    nodes = torch.stack([torch.zeros((512, 8)).scatter_(1, i // 32, 1).sum(1) for i in rt])
    assert int(nodes.max()) <= M.max_units_touched(E, 8, 8, 4, 8) == 4
    c = M.link_count(rt, E, 8)
    r = M.routing(M.Shape(), M.Machine(), ep)
    ratio = sum(c.deepep_rdma) / (ep * 512) / r.nodes_touched
    assert 1.04 < ratio < 1.14, ratio


def test_bench_normal_smoke_model_check():
    # scripts/bench normal on CPU (torch backend, 2 gloo ranks, 2 virtual nodes x 1): the
    # model check's exact counts equal the bench's own RDMA count and the rows delivered
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench"), "normal", "--smoke",
                        "--ranks-per-node", "1", "--no-nccl"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "model check" in p.stdout and "equal on every rank" in p.stdout
    assert "equal to the count on every rank" in p.stdout
    assert "times: n/a (no SM count: torch backend" in p.stdout  # the time check: test_bench_model_check_* below


# ---------------------------------------------------------------------------------------------
# The two-level time check: per-SM rates calibrated on one measured op predict the others
# (megatron_ep.tools.model's stages; scripts/bench normal prints them in its model check)

# One recorded run of `python3 scripts/bench normal --ranks 2 --ranks-per-node 1 --num-sms 24
# --no-deepep` on two GPUs (docs/records/performance-history.md), 4096 tokens, H 7168, top-8 of 256.
# Loop-mode µs per call and per phase mark (mean over ranks), as that run printed them.
NOV30_H = 7168
NOV30_CALLS = {"layout": 41.8, "dispatch": 895.8, "dispatch_cached": 455.7, "dispatch_fp8_cached": 309.6,
               "dispatch_expert": 1256.3, "dispatch_expert_cached": 951.4, "dispatch_expert_fp8_cached": 572.9,
               "combine": 1080.1, "combine_expert": 2051.7, "intra_dispatch_cached": 342.8, "intra_combine": 327.7}
NOV30_PHASES = {  # the FP8 ops were not traced in that run
    "dispatch": {"rdma": 230.0, "notify": 69.0, "push": 201.0, "reorder": 194.0},
    "dispatch_cached": {"rdma": 221.8, "push": 156.6, "reorder": 84.0},
    "dispatch_expert_cached": {"rdma": 223.0, "push": 165.0, "fanout": 217.0, "reorder": 345.0},
    "combine": {"reorder": 178.3, "stage": 113.2, "pull": 201.0, "rdma": 594.9},
    "combine_expert": {"reorder": 864.0, "reduce": 305.0, "pull": 286.0, "rdma": 603.0},
}
NOV30_ROWS, NOV30_PAIRS, NOV30_EXPERT_ROWS = 8168, 8168, 40832  # per rank (mean): rank-major, (token, node), expert-major


def test_phase_stages_map_the_internode_marks():
    t = M.phase_stages({"rdma": 1.0, "notify": 2.0, "stage": 4.0, "push": 8.0, "pull": 16.0, "reduce": 32.0,
                        "fanout": 64.0, "reorder": 128.0, "someday": 256.0})
    assert (t.rdma_us, t.fixed_us, t.local_us) == (1.0, 2.0, 192.0)
    assert t.node_us == 4 + 8 + 16 + 32 + 256  # unknown marks are the intranode path's
    assert t.total_us == 511.0


def test_stage_work_bytes():
    d = M.dispatch_stage_work(10, 20, 100, 4, 8)
    assert (d.rdma_bytes, d.node_bytes, d.local_bytes, d.blocks, d.sms) == (1000, 2000, 0, 4, 8)  # no local work
    assert M.dispatch_stage_work(10, 20, 100, 4, 8, reorder=True).local_bytes == 4000  # a reorder: 2 x rows
    e = M.dispatch_stage_work(10, 20, 100, 4, 8, expert_rows=50, fixed_us=3.0)
    assert e.local_bytes == (20 + 50) * 100 and e.fixed_us == 3.0  # fan-out reads 20, writes 50
    er = M.dispatch_stage_work(10, 20, 100, 4, 8, expert_rows=50, reorder=True)
    assert er.local_bytes == (20 + 3 * 50) * 100  # and a reorder 2 x 50
    c = M.combine_stage_work(10, 20, 64, 4, 8)
    assert (c.rdma_bytes, c.node_bytes, c.local_bytes) == (1280, 2560, 0)
    assert M.combine_stage_work(10, 20, 64, 4, 8, reorder=True).local_bytes == 5120
    ce = M.combine_stage_work(10, 20, 64, 4, 8, expert_rows=50, reorder=True)
    assert (ce.rdma_bytes, ce.node_bytes, ce.local_bytes) == (1280, 20 * 256, 2 * 50 * 128)  # fp32 partials
    assert M.combine_stage_work(10, 20, 64, 4, 8, expert_rows=50).local_bytes == 0
    assert M.combine_stage_work(10, 20, 64, 4, 8, expert_rows=50, partials=False).node_bytes == 50 * 128


def test_stages_without_local_work():
    """The path without a reorder: a rank-major op calibrates no local rate, predicts rank-major
    ops, and refuses to predict local work (the fan-out) without a rate."""
    work = M.dispatch_stage_work(100, 200, 1000, 4, 8)
    rates = M.calibrate_stages(work, M.StageTimes(rdma_us=10.0, node_us=20.0))
    assert rates.local_gbps is None
    again = M.predict_stages(work, rates)
    assert (round(again.rdma_us, 6), round(again.node_us, 6), again.local_us) == (10.0, 20.0, 0.0)
    with pytest.raises(ValueError, match="no local rate"):
        M.predict_stages(M.dispatch_stage_work(100, 200, 1000, 4, 8, expert_rows=400), rates)
    with pytest.raises(ValueError, match="local work needs bytes"):
        M.calibrate_stages(work, M.StageTimes(rdma_us=10.0, node_us=20.0, local_us=5.0))


def test_calibrate_and_predict_hand_computed():
    # 1e9 B over the hop in 1000 us on 10 blocks = 100 GB/s per block; 2e9 B intranode in 500 us on 20 SMs = 200
    w = M.StageWork(rdma_bytes=1e9, node_bytes=2e9, local_bytes=3e9, blocks=10, sms=20)
    r = M.calibrate_stages(w, M.StageTimes(rdma_us=1000.0, node_us=500.0, local_us=1000.0))
    assert r.rdma_per_sm == pytest.approx(100.0) and r.node_per_sm == pytest.approx(200.0)
    assert r.local_gbps == pytest.approx(3000.0)
    assert M.predict_stages(w, r).total_us == pytest.approx(2500.0)  # its own calibration: exact
    # other SM counts: hop and intranode stage scale with their SMs, the local work does not
    p = M.predict_stages(M.StageWork(1e9, 2e9, 3e9, blocks=20, sms=40, fixed_us=7.0), r)
    assert (p.rdma_us, p.node_us, p.local_us, p.fixed_us) == pytest.approx((500.0, 250.0, 1000.0, 7.0))
    chk = M.check_stages("x", M.StageWork(1e9, 2e9, 3e9, 20, 40), r, call_us=1400.0,
                         measured=M.StageTimes(400.0, 250.0, 1000.0))
    assert chk.ratio == pytest.approx(1750 / 1400) and chk.within  # 1.25: the edge is within
    assert chk.stage_ratio("rdma") == pytest.approx(1.25) and chk.stage_ratio("fixed") is None
    assert chk.outside_marks_us == pytest.approx(-250.0)
    assert M.verdict(0.74) == "OUTSIDE 25%" and M.verdict(1.2) == "within 25%"
    with pytest.raises(ValueError, match="RDMA hop"):
        M.calibrate_stages(w, M.StageTimes(rdma_us=0.0, node_us=500.0, local_us=1000.0))


def test_sm_split_both_finish_together():
    # SM-bound: hop work 6e6 B / 1 GB/s per SM = 6000 SM-us, intranode 2e6 / 1 = 2000: 3/4 of 8 SMs to the hop
    s = M.split_sms(8, 6e6, 2e6, 1.0, 1.0)
    assert (s.rdma_sms, s.node_sms) == (6, 2)
    assert s.bound.rdma_us == pytest.approx(1000.0) and s.bound.node_us == pytest.approx(1000.0)
    assert s.ideal_us == pytest.approx(1000.0) and s.time_us == pytest.approx(1000.0)  # = sequential on all 8
    assert s.bound.stage == "rdma" and s.bound.limited_by == "SMs"  # a tie goes to the hop
    # a slow link: the hop needs only the SMs that cover its link, the rest go to the intranode stage
    # (the link takes 4.5e6 B / 2 GB/s = 2250 us; 3 SMs cover it (2000 us), a 4th would only slow the
    # intranode stage: 400 -> 500 us)
    n = M.split_sms(8, 6e6, 2e6, 1.0, 1.0, nic_gbps=2.0, rdma_link_bytes=4.5e6)
    assert n.bound.stage == "rdma" and n.bound.limited_by == "link" and n.time_us == pytest.approx(2250.0)
    assert (n.rdma_sms, n.node_sms) == (3, 5) and n.ideal_us == pytest.approx(2250.0)
    assert n.bound.node_us == pytest.approx(400.0)
    b = M.bounding_stage(6e6, 2e6, 4, 4, 1.0, 1.0)
    assert (b.stage, b.limited_by) == ("rdma", "SMs") and b.time_us == pytest.approx(1500.0)
    b = M.bounding_stage(1e6, 2e6, 4, 4, 1.0, 1.0, nvlink_gbps=0.5)
    assert (b.stage, b.limited_by) == ("node", "link") and b.node_us == pytest.approx(4000.0)
    assert b.describe() == "the intranode stage (NVLink)"
    assert M.split_sms(8, 0.0, 2e6, 1.0, 1.0).node_sms == 8
    with pytest.raises(ValueError):
        M.split_sms(1, 1e6, 1e6, 1.0, 1.0)


def test_nov30_predictions_on_paper():
    # Rates from the bf16 cached rank-major dispatch's own marks; the other ops predicted. The
    # figures are of code that reordered after the intranode stage (reorder=True).
    H, N, Q, E = NOV30_H, NOV30_ROWS, NOV30_PAIRS, NOV30_EXPERT_ROWS
    bf16, fp8 = 2 * H, H + H // 128 * 4
    cal = M.phase_stages(NOV30_PHASES["dispatch_cached"])
    r = M.calibrate_stages(M.dispatch_stage_work(Q, N, bf16, 24, 24, reorder=True), cal)
    assert r.rdma_per_sm == pytest.approx(22.0, abs=0.05)  # 8168 x 14336 B / 221.8 us / 24
    assert r.node_per_sm == pytest.approx(31.2, abs=0.05)
    assert r.local_gbps == pytest.approx(2788, abs=1)  # 2 x 117.1 MB / 84 us
    fp = M.check_stages("fp8", M.dispatch_stage_work(Q, N, fp8, 24, 24, reorder=True), r, NOV30_CALLS["dispatch_fp8_cached"])
    assert fp.predicted.total_us == pytest.approx(462.4 * fp8 / bf16)  # the same rows at 7392 of 14336 B
    assert round(fp.ratio, 2) == 0.77 and fp.within
    notify = M.phase_stages(NOV30_PHASES["dispatch"])
    nt = M.check_stages("notify", M.dispatch_stage_work(Q, N, bf16, 24, 24, fixed_us=notify.fixed_us, reorder=True), r,
                        NOV30_CALLS["dispatch"], notify)
    assert nt.predicted.total_us == pytest.approx(462.4 + 69.0)
    assert round(nt.ratio, 2) == 0.59 and not nt.within  # the first call's sort and host sync: no model term
    assert round(nt.stage_ratio("local"), 2) == 0.43 and round(nt.stage_ratio("rdma"), 2) == 0.96
    assert nt.outside_marks_us == pytest.approx(895.8 - 694.0)
    em = M.check_stages("expert", M.dispatch_stage_work(Q, N, bf16, 24, 24, expert_rows=E, reorder=True), r,
                        NOV30_CALLS["dispatch_expert_cached"], M.phase_stages(NOV30_PHASES["dispatch_expert_cached"]))
    assert round(em.ratio, 2) == 1.10 and em.within and round(em.stage_ratio("local"), 2) == 1.20
    em8 = M.check_stages("expert fp8", M.dispatch_stage_work(Q, N, fp8, 24, 24, expert_rows=E, reorder=True), r,
                         NOV30_CALLS["dispatch_expert_fp8_cached"])
    assert round(em8.ratio, 2) == 0.95
    # combine: rates from the rank-major combine, the expert-major one predicted
    rc = M.calibrate_stages(M.combine_stage_work(Q, N, H, 24, 24, reorder=True), M.phase_stages(NOV30_PHASES["combine"]))
    assert rc.rdma_per_sm == pytest.approx(8.2, abs=0.05) and rc.node_per_sm == pytest.approx(15.5, abs=0.05)
    ce = M.check_stages("combine expert", M.combine_stage_work(Q, N, H, 24, 24, expert_rows=E, reorder=True), rc,
                        NOV30_CALLS["combine_expert"], M.phase_stages(NOV30_PHASES["combine_expert"]))
    assert [round(ce.stage_ratio(s), 2) for s in ("rdma", "node", "local")] == [0.99, 1.06, 1.03]
    assert round(ce.ratio, 2) == 1.03 and ce.within
    # fused on 24 SMs: 14 / 10, no faster than the two stages one after the other (both SM-bound)
    w = M.dispatch_stage_work(Q, N, bf16, 24, 24, reorder=True)
    s = M.split_sms(24, w.rdma_bytes, w.node_bytes, r.rdma_per_sm, r.node_per_sm)
    assert (s.rdma_sms, s.node_sms, s.bound.stage, s.bound.limited_by) == (14, 10, "rdma", "SMs")
    assert s.ideal_us == pytest.approx(221.8 + 156.6)


def _load_bench():
    """The normal bench's parser and its model check (scripts/bench/normal.py, model_check.py)."""
    import types

    scripts = os.path.join(ROOT, "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from bench import model_check, normal

    return types.SimpleNamespace(parse=normal.parse, model_check=model_check.model_check)


def _nov30_allres(sweep: bool = False):
    """allres as the normal bench's workers gather it, with the recorded run's figures on both ranks (loop =
    isolated), 2 virtual nodes x 1 rank. `sweep`: also 16 SMs, the hop and intranode phases
    24/16 longer (the per-SM rates of 24 SMs) and the local work unchanged."""
    rdma_sent, deepep, recv = [4083, 4086], [8167, 8169], [8170, 8166]  # consistent: recv = own pairs + landed

    def at(sms, scale):
        t = {k: (v * (scale if k in ("dispatch_cached", "combine") else 1), v, 0, True) for k, v in NOV30_CALLS.items()}
        ph = {}
        for op, marks in NOV30_PHASES.items():
            ph[op] = {f"{m}(loop)": v * (scale if M.STAGE_OF_MARK.get(m, "node") in ("rdma", "node") else 1)
                      for m, v in marks.items()}
        if scale != 1:
            for op in ("dispatch_cached", "combine"):
                t[op] = (0.0, sum(ph[op].values()), 0, True)
        return {"num_sms": sms, "rdma_blocks": sms, "t": t, "phases": ph, "skipped": None, "rows_expert_major": 40832}

    allres = []
    for r in range(2):
        sms = {"24": at(24, 1.0)}
        if sweep:
            sms = {"16": at(16, 24 / 16), **sms}
        for o in sms.values():
            o.update(rows_rank_major=recv[r], rdma_rows_sent=deepep[r],
                     links={"rdma_sent": rdma_sent if r == 0 else [0, 0], "rdma_recv": [4086, 4083] if r == 0 else [0, 0],
                            "deepep_rdma": deepep if r == 0 else [0, 0], "nvlink_sent": [0, 0], "nvlink_recv": [0, 0],
                            "recv_rows": recv if r == 0 else [0, 0]})
        allres.append({"rank": r, "sms": sms})
    return allres


def test_bench_model_check_prints_the_nov30_verdicts(capsys):
    bench = _load_bench()
    args = bench.parse(["--ranks", "2", "--ranks-per-node", "1", "--num-sms", "24", "--no-deepep"])
    text = bench.model_check(args, _nov30_allres(), "24", 2 * NOV30_H, ref_key="24")
    print(text)
    assert "equal on every rank" in text and "equal to the count on every rank" in text
    assert "calibrated on the bf16 cached rank-major dispatch" in text
    assert "RDMA hop 22.0 GB/s per block" in text and "intranode stage 31.2 GB/s per SM" in text
    assert "RDMA hop 8.2 GB/s per block" in text and "intranode stage 15.5 GB/s per SM" in text  # the combine's
    line = lambda start: next(ln for ln in text.splitlines() if ln.strip().startswith(start))  # noqa: E731
    assert line("FP8 cached, rank-major").endswith("309.6 per call: 0.77 (within 25%)")
    assert line("incl. notify, rank-major").endswith("895.8 per call: 0.59 (OUTSIDE 25%)")
    assert "notify 69.0 (measured, no model term)" in line("incl. notify, rank-major")
    assert line("cached, expert-major").endswith(": 1.10 (within 25%)")
    assert line("FP8 cached, expert-major").endswith(": 0.95 (within 25%)")
    assert line("expert-major (reorder").endswith(": 1.03 (within 25%)")
    assert "time check: 4 of 5 predictions within 25% of the measured call; OUTSIDE: incl. notify, rank-major 0.59" in text
    assert "split 24 SMs as 14 RDMA hop / 10 intranode stage" in text and "bound by the RDMA hop (its SMs)" in text
    assert "bound by the RDMA hop (the NIC)" in text
    assert "SM sweep" not in text  # one SM count


def test_bench_model_check_without_a_reorder():
    """Phases of the path that writes the contract's order in its intranode stage (no 'reorder'
    mark): the rank-major ops have no local work, and the expert-major dispatch takes its local
    rate from its own fan-out phase."""
    bench = _load_bench()
    args = bench.parse(["--ranks", "2", "--ranks-per-node", "1", "--num-sms", "24", "--no-deepep"])
    allres = _nov30_allres()
    for r in allres:
        for o in r["sms"].values():
            o["phases"] = {op: {m: v for m, v in marks.items() if not m.startswith("reorder")}
                           for op, marks in o["phases"].items()}
    text = bench.model_check(args, allres, "24", 2 * NOV30_H, ref_key="24")
    assert "reorders after its intranode stage" not in text
    assert "local none (no local work)" in text
    line = lambda start: next(ln for ln in text.splitlines() if ln.strip().startswith(start))  # noqa: E731
    assert "its local rate from its own fan-out phase" in line("cached, expert-major")
    assert "n/a" in line("FP8 cached, expert-major")  # not traced in that run: no fan-out phase of its own
    assert "reorder of the expert rows" not in line("expert-major (")


def test_bench_model_check_sm_sweep():
    # rates of 16 SMs predict 24 SMs: built so that they do exactly (hop and intranode stage 24/16 slower at 16)
    bench = _load_bench()
    args = bench.parse(["--ranks", "2", "--ranks-per-node", "1", "--num-sms", "16,24", "--no-deepep"])
    allres = _nov30_allres(sweep=True)
    text = bench.model_check(args, allres, "24", 2 * NOV30_H, ref_key="16")
    assert "SM sweep: rates calibrated at 16 SMs (16 blocks) predict 24 SMs (24 blocks)" in text
    sweep = text.split("SM sweep")[1].splitlines()
    disp = next(ln for ln in sweep if ln.strip().startswith("cached dispatch, rank-major"))
    assert "predicted RDMA hop 221.8 + intranode stage 156.6 + local work 84.0 = 462.4" in disp
    assert disp.endswith("455.7 per call: 1.01 (within 25%)")
    comb = next(ln for ln in sweep if ln.strip().startswith("combine, rank-major"))
    assert "predicted RDMA hop 594.9 + intranode stage 314.2 + local work 178.3 = 1087.4" in comb
    assert comb.endswith("1080.1 per call: 1.01 (within 25%)")
    # the 16-SM block itself calibrates and predicts at 16 SMs, no sweep line
    assert "SM sweep" not in bench.model_check(args, allres, "16", 2 * NOV30_H, ref_key="16")


# Communication under the expert GEMMs (megatron_ep/tools/model/overlap.py)
def _costs(ep):
    from megatron_ep.tools.model import Machine, Shape, StepModel, layer_costs
    return layer_costs(Shape(), Machine(), StepModel(ep=ep))


def test_overlap_schedule_bounds():
    """Every mechanism and piece count lies between the busier stream alone and no overlap plus
    the SMs it takes; one piece is the same for both mechanisms; fixed costs per chunk make many
    chunks worse than arrival counters with as many groups."""
    from megatron_ep.tools.model import layer_times
    for ep in (2, 8, 64):
        c = _costs(ep)
        none = layer_times(c, "none")
        comm_fwd, comm_bwd = c.dispatch + c.combine, 2 * c.combine
        assert none.forward_us == pytest.approx(49 + 15 + comm_fwd + c.gemm_fwd)
        for mode in ("chunks", "arrivals"):
            for n in (1, 2, 4, 8, 16):
                t = layer_times(c, mode, n)
                assert t.forward_us >= max(comm_fwd, c.gemm_fwd) and t.backward_us >= max(comm_bwd, c.gemm_dgrad + c.gemm_wgrad)
                slowest = none.total_us * c.sms / (c.sms - c.comm_sms) + 2 * n * (49 + 15)
                assert t.total_us <= slowest
        assert layer_times(c, "chunks", 1).total_us == pytest.approx(layer_times(c, "arrivals", 1).total_us)
        assert layer_times(c, "chunks", 16).total_us > layer_times(c, "arrivals", 16).total_us


@pytest.mark.parametrize("expert_tflops, share", [(510.0, 0.2), (400.0, 0.1)])
def test_overlap_hides_most_communication_at_ep64(expert_tflops, share):
    """At EP64 the layer's communication (forward and backward, ~13 ms) is of the order of its
    GEMMs (~17 ms at the measured expert rate, ~22 ms at 400 TFLOP/s): the best schedule leaves
    under a fifth of it exposed, under a tenth with the slower GEMMs."""
    from megatron_ep.tools.model import Machine, Shape, StepModel, best_overlap, layer_costs
    c = layer_costs(Shape(), Machine(), StepModel(ep=64, expert_tflops=expert_tflops))
    b = best_overlap(c, 16)
    exposed = b["arrivals"].total_us - 3 * c.gemm_fwd
    assert exposed < share * (b["none"].total_us - 3 * c.gemm_fwd)
    assert b["none"].total_us / b["arrivals"].total_us > 1.4


def test_overlap_refuses_bad_arguments():
    from megatron_ep.tools.model import layer_times
    c = _costs(8)
    with pytest.raises(ValueError, match="overlap mode"):
        layer_times(c, "pipelined", 2)
    with pytest.raises(ValueError, match="pieces"):
        layer_times(c, "chunks", 0)
    with pytest.raises(ValueError, match="pieces"):
        layer_times(c, "none", 4)
