"""The analytic performance model (megatron_ep/model.py): hand-computed cases, a Monte-Carlo
cross-check of the exact routing formula, and the CLI."""

import math
import os
import random
import subprocess
import sys
from fractions import Fraction

import pytest

from megatron_ep import model as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert s.compute_ms == pytest.approx((s.expert_flops + s.other_flops) / 400e12 * 1e3)
    d = M.normal_path(M.Shape(), M.Machine(), 64, 7392).time_us
    c = M.normal_path(M.Shape(), M.Machine(), 64, 14336).time_us
    assert s.comm_ms == pytest.approx(58 * 2 * (d + c) / 1e3)
    assert s.fraction == pytest.approx(s.comm_ms / (s.comm_ms + s.compute_ms))
    assert 0.15 < s.fraction < 0.30 and s.fraction_overlapped == 0.0
    slow = M.step_fraction(M.Shape(), M.Machine(nic_gbps=5.0), M.StepModel())
    assert slow.fraction > s.fraction and slow.fraction_overlapped > 0


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_help_and_default_run():
    # both subprocesses at once: each pays the package's torch import
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmds = [[sys.executable, "-m", "megatron_ep.model", "--help"],
            [sys.executable, "-m", "megatron_ep.model"]]
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
    with pytest.raises(SystemExit) as e:
        M.main(["--topk-groups", "9"])
    assert e.value.code == 2 and "topk_groups" in capsys.readouterr().err
