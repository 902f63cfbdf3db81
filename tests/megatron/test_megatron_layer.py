"""A real megatron-core MoELayer (DeepSeek-V3-style router: sigmoid scores, group-limited top-k,
expert bias; shared expert; SwiGLU experts) with the flex dispatcher on megatron_ep, against the
same layer with Megatron's alltoall dispatcher: outputs and gradients of the input, router,
routed experts and shared expert. Also Megatron's experts replaced by megatron_ep's
GroupedGemmExperts fed by the hybridep layout. CPU, 2 and 4 gloo processes (see the shims in
megatron_cases.py)."""

import pytest

import megatron.core  # noqa: E402,F401  (CI installs megatron-core: a missing one must fail, not skip)

import megatron_cases as mc  # noqa: E402
import megatron_overlap_cases as oc  # noqa: E402


@pytest.mark.parametrize("R", [2, 4])
def test_moe_layer_flex_matches_alltoall(pools, R):
    case = dict(seed=40 + R, E=2 * R, K=min(4, R), H=16, F=8, S=6,
                variants=[("deepep", "sequential"), ("hybridep", "sequential"), ("hybridep", "grouped"), ("deepep", "grouped")])
    errors = [e for rank in pools(R).run(mc.run_moe_layer_case, case) for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("factor", [4.0, 1.0])
def test_moe_layer_drop_and_pad_through_the_router_matches_alltoall(pools, factor):
    """Megatron's drop-and-pad mode (moe_expert_capacity_factor with
    moe_pad_expert_input_to_capacity) through Megatron's own router, whose map fills every expert
    to capacity with probability-0 pairs (rows name more than top-k experts; at factor 4.0 every
    row names every expert): flex hybridep (megatron-core refuses deepep in this mode) against
    alltoall, outputs and gradients."""
    R = 2
    case = dict(seed=61, E=4 * R, K=2, H=16, F=8, S=6,
                config=dict(moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=True,
                            moe_token_drop_policy="probs"),
                variants=[("hybridep", "sequential"), ("hybridep", "grouped")])
    errors = [e for rank in pools(R).run(mc.run_moe_layer_case, case) for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_moe_layer_chunked_experts_match_alltoall(pools, R):
    """megatron_ep.megatron.chunked: hybridep + GroupedGemmExperts with dispatch, experts and
    combine in 3 pipelined token chunks, against Megatron's alltoall + SequentialMLP: outputs and
    the gradients of the input, router, routed and shared experts."""
    case = dict(seed=90 + R, E=2 * R, K=min(4, R), H=16, F=8, S=6, chunks=3, variants=[("hybridep", "grouped-chunked")])
    errors = [e for rank in pools(R).run(mc.run_moe_layer_case, case) for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_moe_layer_chunked_experts_with_budget_match_alltoall(pools, R):
    """The same with the static budget at the EP-size factor (it never drops): every chunk
    worst-case sized, no host sync."""
    case = dict(seed=95 + R, E=2 * R, K=min(4, R), H=16, F=8, S=6, chunks=3, budget_factor=float(R),
                variants=[("hybridep", "grouped-chunked")])
    errors = [e for rank in pools(R).run(mc.run_moe_layer_case, case) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_chunked_experts_refuse_what_they_do_not_support(pools):
    errors = [e for rank in pools(2).run(mc.run_chunked_refusals_case, dict(E=4, K=2, H=16, F=8)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_grouped_experts_checkpoint_sharding(pools):
    errors = [e for rank in pools(2).run(mc.run_experts_checkpoint_case, dict(E=6)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def overlap_cases(R):
    return [dict(seed=70 + i, backend=backend, E=2 * R, K=2, H=32, S=8, V=64, microbatches=3)
            for i, backend in enumerate(("deepep", "hybridep"))]


def test_ep_overlap_schedule_matches(pools):
    """--overlap-moe-expert-parallel-comm (Megatron's combined 1F1B schedule) with our managers:
    the same losses and gradients as without it (a 2-layer GPTModel, 3 micro-batches, bf16)."""
    errors = [e for case in overlap_cases(2) for rank in pools(2).run(oc.run_overlap_case, case) for e in rank]
    assert not errors, "\n".join(errors[:20])


def chunked_overlap_case(budget):
    return dict(seed=80, backend="hybridep", experts="grouped", chunks=3, budget_factor=budget, E=4, K=2, H=32, S=8,
                V=64, microbatches=3, chunk_tol=1e-2)


@pytest.mark.parametrize("budget", [None, 2.0])
def test_ep_overlap_schedule_with_chunked_experts_matches(pools, budget):
    """The same with hybridep + GroupedGemmExperts and chunked experts (3 chunks) in the MoE
    layer, dynamic or with the static budget (the EP-size factor: no drops): the combined 1F1B
    schedule's dispatch / experts / combine nodes around the chunked pipeline give the ordinary
    schedule's losses and gradients exactly, and those match the same model without chunked
    experts (the expert weight gradients within bf16 rounding: the chunks sum them in another
    order)."""
    errors = [e for rank in pools(2).run(oc.run_overlap_case, chunked_overlap_case(budget)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_launcher_layer_options(pools):
    """`launch --ep-experts grouped --ep-chunks 2`: GroupedGemmExperts and chunked experts in every
    MoELayer built afterwards, Megatron's spec unchanged; a layer that cannot take chunks says why."""
    errors = [e for rank in pools(2).run(mc.run_layer_options_case, dict(E=4, K=2, H=16, F=8)) for e in rank]
    assert not errors, "\n".join(errors[:20])
