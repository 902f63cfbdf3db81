"""megatron_ep's flex managers driven through Megatron's real MoEFlexTokenDispatcher, against
Megatron's own alltoall dispatcher on the same inputs: outputs, hidden-state and routing-prob
gradients, dispatched rows and padding rules. CPU, 2 and 4 gloo processes."""

import pytest

import megatron.core  # noqa: E402,F401  (CI installs megatron-core: a missing one must fail, not skip)

import megatron_cases as mc  # noqa: E402
from distpool import flat


def flex_cases(R):
    out = []
    for i, (backend, epr, K, H, pattern, p_drop, extra) in enumerate([
        ("deepep", 2, 3, 16, "random", 0.2, {}),
        ("deepep", 4, 4, 8, "same_rank", 0.0, {"align": 16}),
        ("hybridep", 2, 3, 16, "random", 0.2, {}),
        ("hybridep", 1, 2, 8, "one_expert", 0.0, {}),
        ("hybridep", 4, 4, 8, "random", 0.1, {"align": 8}),
    ]):
        seed = 100 * R + i
        Ts = [5 + 3 * s for s in range(R)]
        Ts[-1] = 0 if i % 2 else Ts[-1]  # a rank without tokens
        out.append(dict(seed=seed, backend=backend, E=epr * R, K=K, H=H, Ts=Ts, pattern=pattern, p_drop=p_drop, **extra))
    # drop-and-pad (moe_pad_expert_input_to_capacity): same token count on every rank, as Megatron assumes
    out.append(dict(seed=100 * R + 9, backend="hybridep", E=2 * R, K=3, H=8, Ts=[12] * R, pattern="random", p_drop=0.0,
                    pad_capacity_factor=1.0))
    return out


@pytest.mark.parametrize("R", [2, 4])
def test_flex_matches_alltoall(pools, R):
    errors = []
    for case in flex_cases(R):
        errors += flat(pools(R).run(mc.run_flex_vs_alltoall, case))
    assert not errors, "\n".join(errors[:20])


def test_setup_metadata_compiles(pools):
    errors = flat(pools(2).run(mc.run_setup_metadata_compiles, dict(E=8, K=3, H=8)))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_hybridep_rank_budget(pools, R):
    """moe_expert_rank_capacity_factor: a budget nothing exceeds, and one most ranks exceed."""
    errors = []
    for i, (factor, align, expect_drop) in enumerate([(4.0, 4, False), (0.3, 2, True)]):
        Ts = [9 + 2 * s for s in range(R)]
        case = dict(seed=300 * R + i, E=2 * R, K=3, H=8, Ts=Ts, factor=factor, align=align, expect_drop=expect_drop, p_drop=0.0)
        errors += flat(pools(R).run(mc.run_rank_budget_case, case))
    assert not errors, "\n".join(errors[:20])
