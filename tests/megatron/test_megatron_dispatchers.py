"""megatron_ep's flex managers driven through Megatron's real MoEFlexTokenDispatcher, against
Megatron's own alltoall dispatcher on the same inputs: outputs, hidden-state and routing-prob
gradients, dispatched rows and padding rules. CPU, 2 and 4 gloo processes."""

import pytest

import megatron.core  # noqa: E402,F401  (CI installs megatron-core: a missing one must fail, not skip)

import megatron_budget_cases as bc  # noqa: E402
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


def grouped_tensor_cases(R):
    """megatron-core main: under moe_use_grouped_tensor TE's grouped-tensor experts skip their
    own padding and expect 256-row segments from the dispatcher; moe_flex_dispatcher_num_sms
    reaches the manager."""
    cfg = dict(moe_grouped_gemm=True, moe_use_grouped_tensor=True, moe_flex_dispatcher_num_sms=24)
    return [dict(seed=350 + R + i, backend=backend, E=2 * R, K=3, H=8, Ts=[7 + s for s in range(R)], pattern="random",
                 p_drop=0.0, config=cfg, want_align=256) for i, backend in enumerate(("deepep", "hybridep"))]


@pytest.mark.parametrize("R", [2])
def test_flex_grouped_tensor_alignment(pools, R):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not hasattr(TransformerConfig, "moe_use_grouped_tensor"):
        pytest.skip(f"megatron-core {megatron.core.__version__} has no moe_use_grouped_tensor (main has)")
    _run(pools(R), mc.run_flex_vs_alltoall, grouped_tensor_cases(R))


def test_setup_metadata_compiles(pools):
    errors = flat(pools(2).run(mc.run_setup_metadata_compiles, dict(E=8, K=3, H=8)))
    assert not errors, "\n".join(errors[:20])


def _run(pool, fn, cases):
    errors = []
    for case in cases:
        errors += flat(pool.run(fn, case))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_hybridep_rank_budget(pools, R):
    """moe_expert_rank_capacity_factor: a budget nothing exceeds, and one most ranks exceed."""
    _run(pools(R), bc.run_rank_budget_case, [
        dict(seed=300 * R + i, E=2 * R, K=3, H=8, Ts=[9 + 2 * s for s in range(R)], factor=factor, align=align,
             expect_drop=expect_drop, p_drop=0.0)
        for i, (factor, align, expect_drop) in enumerate([(4.0, 4, False), (0.3, 2, True)])])


def budget_boundary_cases(R):
    """A factor equal to the EP size never drops, whatever the padding: 6 tokens per rank at
    alignment 16 (the padding alone outgrew the old budget), and every token's copies on rank 0
    (the worst case itself); one real row less than that worst case drops exactly that row."""
    T, K = 64, 4
    return [dict(seed=310 + R, E=4 * R, K=3, H=8, Ts=[6] * R, factor=float(R), align=16, expect_drop=False, p_drop=0.0),
            dict(seed=311 + R, E=4 * R, K=K, H=8, Ts=[T] * R, pattern="first_rank", factor=float(R), align=16,
                 expect_drop=False, p_drop=0.0),
            dict(seed=312 + R, E=4 * R, K=K, H=8, Ts=[T] * R, pattern="first_rank", factor=R - 1 / (T * K), align=1,
                 expect_drop=True, p_drop=0.0)]


@pytest.mark.parametrize("R", [2, 4])
def test_hybridep_budget_factor_ep_size_never_drops(pools, R):
    _run(pools(R), bc.run_rank_budget_case, budget_boundary_cases(R))


def budget_empty_rank_cases(R):
    """Ranks without tokens under a static budget: they make the same worst-case sized dispatch
    as the others and still receive their experts' rows (the budget's T is the group's largest)."""
    Ts = [0, 9] if R == 2 else [0, 9, 0, 13]
    return [dict(seed=320 + R, E=2 * R, K=3, H=8, Ts=Ts, factor=float(R), align=4, expect_drop=False, p_drop=0.0),
            dict(seed=321 + R, E=2 * R, K=3, H=8, Ts=Ts, factor=0.3, align=2, expect_drop=True, p_drop=0.0)]


@pytest.mark.parametrize("R", [2, 4])
def test_hybridep_budget_rank_without_tokens(pools, R):
    _run(pools(R), bc.run_rank_budget_case, budget_empty_rank_cases(R))


def overfull_routing_cases(R):
    base = dict(E=2 * R, K=2, H=8, Ts=[6] * R, p_drop=0.0)
    return [dict(base, seed=330 + i, backend=backend, extra=extra, bad_ranks=bad, budget=budget)
            for i, (backend, extra, bad, budget) in enumerate([
                ("deepep", "one", [R - 1], False), ("deepep", "all", list(range(R)), False),
                ("hybridep", "one", [0], False), ("hybridep", "all", list(range(R)), False),
                ("hybridep", "one", [0], True), ("hybridep", "all", [R - 1], True)])]


def test_routing_map_past_topk(pools):
    """A routing map with more than top-k experts in a row: rejected, naming the row (the
    dynamic modes), or counted as dropped (the budget mode); never silently truncated."""
    _run(pools(2), bc.run_overfull_routing_case, overfull_routing_cases(2))


@pytest.mark.parametrize("R", [2, 3])
def test_hybridep_budget_growth_is_seen_by_every_rank(pools, R):
    """Rank 0's token count grows tenfold after the budget was agreed: the drops this causes on
    the other ranks raise over_budget on every rank, rank 0 (whose rows come back wrong)
    included."""
    steps = [[4] * R, [40] + [4] * (R - 1)]
    _run(pools(R), bc.run_budget_growth_case, [dict(seed=360 + R, E=2 * R, K=3, H=8, steps=steps, align=1, p_drop=0.0,
                                                    pattern="random")])


def budget_rerun_cases(R):
    return [dict(seed=340 + R, E=2 * R, K=3, H=8, Ts=[8] * R, factor=0.4, align=2, p_drop=0.0)]


def test_hybridep_budget_rerun_drops_nothing(pools):
    """megatron-core's paged-stash rerun of an over-budget step (main's PagedStashRunner; the same
    hook protocol driven directly on versions whose runner lacks the hooks): no row lost, and
    the grown budget fits the next step without a rerun."""
    _run(pools(2), bc.run_budget_rerun_case, budget_rerun_cases(2))


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_routing_inputs_of_the_wrong_kind(pools, backend):
    """A float or int routing map, probs shaped unlike it, a rank capacity factor of NaN, inf, 0
    or below: refused by name, and the manager works afterwards."""
    _run(pools(2), bc.run_bad_routing_inputs_case, [dict(seed=350, backend=backend, E=4, K=2, H=8, Ts=[6, 6], p_drop=0.0)])
