"""The Megatron integration on a GPU: megatron_ep's flex managers on the cuda backend inside
Megatron's real MoEFlexTokenDispatcher and MoELayer, against Megatron's alltoall dispatcher.
* virtual ranks, R = 2 processes on one GPU (gloo control group; megatron_ep's kernels
  move the tokens by CUDA IPC; Megatron's reference runs on CPU with the test shims, since NCCL
  refuses several ranks on one GPU) -- run under MPS (scripts/gate/gpu_check.sh);
* EP 1 through Megatron's own NCCL group: Megatron's flex dispatcher refuses EP 1 ("Flex token
  dispatcher requires TPxEP > 1"), so there the alltoall layer with megatron_ep's
  GroupedGemmExperts (torch grouped_mm on Hopper, or DeepGEMM when built) is checked against the
  same layer with Megatron's SequentialMLP, in bf16."""

import pytest

import megatron.core  # noqa: F401  (a missing megatron-core must fail, not skip)

import megatron_cases as mc
from gpu_pools import GPU_MARKS, GpuPools, Shared, closing, run_alone
from test_megatron_dispatchers import flex_cases

pytestmark = GPU_MARKS

# TORCHDYNAMO_DISABLE: Megatron's torch.compile'd helpers would compile (Triton, per process) for
# every new shape; what these tests check is our managers (test_setup_metadata_compiles checks
# that setup_metadata compiles)
# MEP_TEST_PRELOAD: each rank imports Megatron while it waits for its first task
POOLS = GpuPools(ahead={"test_moe_layer_cuda_graph_budget": [Shared(2, MEGATRON_EP_RANK_CAPACITY_FACTOR="2.0")]},
                 MEGATRON_EP_BACKEND="auto", MEGATRON_EP_MAX_TOKENS_PER_RANK="64", TORCHDYNAMO_DISABLE="1",
                 MEP_TEST_PRELOAD="megatron_cases")
pool_ = POOLS.get
_close_pools = closing(POOLS)


def _run(pool, fn, cases):
    errors = []
    for case in cases:
        errors += [e for rank in pool.run(fn, case, timeout=600) for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])  # the CPU suite runs R = 2, 4; the kernel suites R = 2, 4, 8
def test_flex_virtual_ranks(R):
    _run(pool_(R), mc.run_flex_vs_alltoall, [dict(c, device="virtual") for c in flex_cases(R)])


@pytest.mark.parametrize("R", [2])
def test_moe_layer_virtual_ranks(R):
    case = dict(seed=40 + R, E=2 * R, K=min(4, R), H=16, F=8, S=6, device="virtual",
                variants=[("deepep", "sequential"), ("hybridep", "grouped"), ("deepep", "grouped")])
    _run(pool_(R), mc.run_moe_layer_case, [case])


@pytest.mark.parametrize("R", [2])
def test_moe_layer_virtual_ranks_bf16(R):
    """bf16 at GEMM-friendly sizes: the cuda backend and the grouped experts inside a real MoELayer
    (reference: alltoall + SequentialMLP in bf16 on CPU, hence the bf16 tolerance)."""
    case = dict(seed=50 + R, E=4 * R, K=4, H=128, F=64, S=32, device="virtual", dtype="bf16", tol=3e-2,
                variants=[("hybridep", "grouped"), ("deepep", "grouped")])
    _run(pool_(R), mc.run_moe_layer_case, [case])


@pytest.mark.parametrize("R", [2])
def test_moe_layer_cuda_graph_budget(R):
    """hybridep's sync-free budget mode under CUDA-graph capture of a whole MoELayer forward."""
    case = dict(seed=60 + R, E=4 * R, K=4, H=128, F=64, S=16, rounds=3)
    # then with chunked experts (megatron_ep.megatron.chunked): the chunks in the same graph
    _run(pool_(R, MEGATRON_EP_RANK_CAPACITY_FACTOR="2.0"), mc.run_moe_layer_graph_case, [case, dict(case, chunks=2)])


@pytest.mark.no_mps
def test_moe_layer_ep1_nccl_grouped_experts():
    """One process with its own NCCL group, as a user runs EP 1: outside MPS (the gate runs the
    no_mps tests after it stops the MPS daemon) and in a fresh pool closed after it: under MPS,
    beside the other tests' pools, it does not finish."""
    case = dict(seed=8, E=8, K=4, H=256, F=128, S=64, device="cuda", dtype="bf16", tol=3e-2,
                variants=[("alltoall", "grouped")])
    errors = [e for rank in run_alone(1, mc.run_moe_layer_case, case, timeout=180, backend="nccl",
                                      TORCHDYNAMO_DISABLE="1") for e in rank]
    assert not errors, "\n".join(errors[:20])


# The cases below are the CPU tests' (test_megatron_dispatchers.py, test_megatron_layer.py), with
# megatron_ep on the GPU (the cuda backend's worst-case sized dispatch, Buffer.reserve, published
# failures) and Megatron's reference on CPU.
@pytest.mark.parametrize("R", [2])
def test_hybridep_budget_virtual_ranks(R):
    """The budget at the EP-size factor never drops (alignment 16; every token on rank 0); one row
    under the worst case drops that row; ranks without tokens budget like the others."""
    import megatron_budget_cases as bc
    from test_megatron_dispatchers import budget_boundary_cases, budget_empty_rank_cases

    _run(pool_(R), bc.run_rank_budget_case,
         [dict(c, device="virtual") for c in budget_boundary_cases(R) + budget_empty_rank_cases(R)])


def test_routing_map_past_topk_virtual_ranks():
    import megatron_budget_cases as bc
    from test_megatron_dispatchers import overfull_routing_cases

    _run(pool_(2), bc.run_overfull_routing_case, [dict(c, device="virtual") for c in overfull_routing_cases(2)])


def test_hybridep_budget_rerun_virtual_ranks():
    """megatron-core's paged-stash rerun protocol: grow_recv_capacity sizes the cuda Buffer."""
    import megatron_budget_cases as bc
    from test_megatron_dispatchers import budget_rerun_cases

    _run(pool_(2), bc.run_budget_rerun_case, [dict(c, device="virtual") for c in budget_rerun_cases(2)])


def test_ep_overlap_virtual_ranks():
    """--overlap-moe-expert-parallel-comm: dispatch / combine on Megatron's communication stream."""
    import megatron_overlap_cases as oc
    from test_megatron_layer import overlap_cases

    _run(pool_(2), oc.run_overlap_case, [dict(c, device="virtual", tol=1e-2) for c in overlap_cases(2)])


def test_ep_overlap_chunked_experts_virtual_ranks():
    """The same with chunked experts in the MoE layer (hybridep + GroupedGemmExperts, 3 chunks),
    dynamic and with the static budget: both schedules agree, and match the unchunked model."""
    import megatron_overlap_cases as oc
    from test_megatron_layer import chunked_overlap_case

    _run(pool_(2), oc.run_overlap_case, [dict(chunked_overlap_case(b), device="virtual", tol=1e-2) for b in (None, 2.0)])


def test_moe_layer_chunked_experts_virtual_ranks():
    """megatron_ep.megatron.chunked on the cuda backend: dispatch, GroupedGemmExperts and combine
    in pipelined token chunks inside a real MoELayer, against Megatron's alltoall on CPU; then
    with the static budget at the EP-size factor (every chunk worst-case sized)."""
    case = dict(seed=92, E=4, K=2, H=16, F=8, S=6, chunks=3, device="virtual", variants=[("hybridep", "grouped-chunked")])
    _run(pool_(2), mc.run_moe_layer_case, [case, dict(case, seed=93, budget_factor=2.0)])
