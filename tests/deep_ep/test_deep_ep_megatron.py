"""Megatron's own flex dispatcher with its own `_DeepepManager` (megatron-core's fused_a2a, which
does `import deep_ep`) on megatron_ep.deep_ep: the shim folder first on sys.path in each worker,
megatron_ep's managers not installed. Its outputs, hidden-state and routing-prob gradients and
dispatched rows against Megatron's alltoall dispatcher on the same inputs. CPU, 2 and 4 gloo
processes, the torch backend."""

import pytest

import megatron.core  # noqa: F401  (CI installs megatron-core: a missing one must fail, not skip)

import megatron_cases as mc  # noqa: E402
from distpool import DistPool, flat  # noqa: E402


@pytest.fixture(scope="module")
def fresh_pools():
    """Pools of their own: fused_a2a binds `deep_ep` when first imported, so these workers must
    not have imported Megatron before the shim folder is on their sys.path (the session's shared
    pools may have)."""
    made = {}

    def get(R: int) -> DistPool:
        if R not in made or made[R].broken:
            made[R] = DistPool(R, env={"MEGATRON_EP_DEEP_EP_BACKEND": "torch"})
        return made[R]

    yield get
    for pool in made.values():
        pool.close()


def megatron_manager_cases(R):
    """Uneven token counts with an empty rank and dropped slots; every token's experts on one
    rank; every token on one expert."""
    Ts = [5 + 3 * s for s in range(R)]
    Ts[-1] = 0
    return [dict(seed=900 + 10 * R + i, backend="deepep", manager="megatron", E=epr * R, K=K, H=H, Ts=ts,
                 pattern=pattern, p_drop=p_drop)
            for i, (epr, K, H, ts, pattern, p_drop) in enumerate([
                (2, 3, 16, Ts, "random", 0.2),
                (4, 4, 8, [6] * R, "same_rank", 0.0),
                (1, 2, 8, Ts, "one_expert", 0.0)])]


@pytest.mark.parametrize("R", [2, 4])
def test_megatrons_deepep_manager_on_our_deep_ep_matches_alltoall(fresh_pools, R):
    errors = [e for case in megatron_manager_cases(R) for e in flat(fresh_pools(R).run(mc.run_flex_vs_alltoall, case))]
    assert not errors, "\n".join(errors[:20])


def test_second_derivative_through_fused_a2a_is_exact_or_refused(fresh_pools):
    """Megatron's fused_a2a backwards call megatron_ep.deep_ep's combine / dispatch, which carry
    no gradient: under create_graph a second derivative through them must raise, not drop them."""
    case = dict(seed=930, E=4, K=2, H=8, Ts=[5, 3])
    errors = flat(fresh_pools(2).run(mc.run_fused_a2a_second_derivative, case))
    assert not errors, "\n".join(errors[:20])
