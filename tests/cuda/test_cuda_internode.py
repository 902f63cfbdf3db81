"""The two-level internode path (RDMA domain over NVSHMEM, then the intranode path inside each
node) against the dense oracle, on virtual nodes: `ranks_per_node` smaller than the group makes
groups of ranks act as nodes. R processes on the visible GPU(s) (rank r on GPU r % GPUs; several
per GPU under MPS, see scripts/gate/gpu_check.sh). Outputs are poisoned before every kernel."""

import pytest

import cases
import v2_combine_cases
from case_lists import normal_cases
from distpool import flat
from gpu_pools import GPU_MARKS, Alone, GpuPools, Shared, closing, gate_subset, run_alone

pytestmark = GPU_MARKS

POOLS = GpuPools(ahead={"test_internode_puts": [Shared(4, MEGATRON_EP_INTERNODE_FORCE_PUTS="1")],
                        "test_internode_peer_failure_is_published": [Alone(2, NVSHMEM_DISABLE_MNNVL="1")]},
                 NVSHMEM_DISABLE_MNNVL="1")
pool_ = POOLS.get
_close_pools = closing(POOLS)
# (ranks, ranks per node): 2 nodes x 1, 2 x 2, 2 x 4, 4 x 2
LAYOUTS = [(2, 1), (4, 2), (8, 4), (8, 2)]


def _sized(cfgs, P, **extra):
    return [dict(c, sizing={"ranks_per_node": P, **extra}) for c in cfgs]


@pytest.mark.parametrize("R,P", LAYOUTS)
def test_internode_cases(R, P):
    """Every normal-path case (rank- and expert-major, cached, worst-case sized with drops,
    FP8, -1 slots, empty ranks, one expert, combine with weights, round trip)."""
    selected = gate_subset(normal_cases(R))
    errors = flat(pool_(R).run(cases.run_normal_cases, _sized(selected, P), backend="cuda", device="cuda", timeout=900))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R,P", LAYOUTS)
def test_internode_v2_combine_order(R, P):
    """Combine with 0, 1 and 2 biases, both layouts: bit-exact against DeepEP V2's hybrid
    reference combine over the virtual nodes (each node's sum rounded, then the biases + the
    nodes in the order of their last slot; tests/support/v2_combine_cases.py)."""
    cfgs = _sized(v2_combine_cases.v2_combine_cases(R, H=512), P)
    errors = flat(pool_(R).run(v2_combine_cases.run_v2_combine_cases, cfgs, backend="cuda", device="cuda", timeout=900))
    assert not errors, "\n".join(errors[:20])


def test_internode_node_limited_routing():
    """DeepSeek-V3-style routing: each token's experts on at most 2 of 4 nodes."""
    R, P = 8, 2
    cfgs = [dict(seed=7100 + i, E=8 * R, K=8, H=512, align=align, dtype=dtype, pattern="node_limited", p_drop=0.1,
                 Ts=[24, 0, 17, 24, 5, 24, 24, 9]) for i, (align, dtype) in enumerate([(1, "bf16"), (16, "fp8")])]
    errors = flat(pool_(R).run(cases.run_normal_cases, _sized(cfgs, P), backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:20])


def test_internode_puts():
    """The same cases with every RDMA-domain transfer as an NVSHMEM put from symmetric staging
    (the code path InfiniBand takes), here over NVSHMEM's P2P transport."""
    R, P = 4, 2
    errors = flat(pool_(R, MEGATRON_EP_INTERNODE_FORCE_PUTS="1").run(cases.run_normal_cases, _sized(normal_cases(R)[:6], P),
                                                      backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R,P", [(4, 2), (8, 4)])
def test_internode_cuda_graph(R, P):
    cfg = dict(seed=91 + R, E=4 * R, K=4, H=512, T=24, align=16, sizing={"ranks_per_node": P})
    errors = flat(pool_(R).run(cases.run_cuda_graph_case, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R,P", [(4, 2)])
def test_internode_repeated(R, P):
    cfg = dict(seed=13 * R, E=8 * R, K=6, H=256, t_max=40, iters=60, sizing={"ranks_per_node": P})
    errors = flat(pool_(R).run(cases.run_repeated, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R,P,failing", [(2, 1, 1)])
def test_internode_peer_failure_is_published(R, P, failing):
    """A rank failing before its RDMA send: its same-index peers stop at once (PeerFailedFatalError)
    (fresh processes: broken buffers stay behind). Not (4, 2): there the ranks whose buffers did
    not break would wait in destroy's collective free for the broken ones."""
    errors = flat(run_alone(R, cases.run_internode_peer_failure_case,
                            dict(seed=61 + R, ranks_per_node=P, failing_rank=failing), timeout=300,
                            NVSHMEM_DISABLE_MNNVL="1"))
    assert not errors, "\n".join(errors[:20])


def test_internode_tracing():
    """megatron_ep.tools.tracing on the internode path (2 virtual nodes x 2): phase marks and counters;
    no notify-only kernels there."""
    import tracing_cases as tc

    cfg = dict(seed=13, internode=True, sizing={"ranks_per_node": 2})
    errors = flat(pool_(4).run(tc.run_tracing_case, cfg, backend="cuda", device="cuda", timeout=300))
    assert not errors, "\n".join(errors[:20])
