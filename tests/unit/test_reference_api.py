"""Low-latency path, autograd and argument checking of the torch reference backend, on 1, 2, 4
and 8 gloo processes."""

import pytest

import cases
from case_lists import _token_counts
from distpool import flat


def low_latency_cases(R):
    out = []
    for i, (epr, K, H, fp8, pattern) in enumerate([
        (4, 4, 256, True, "random"),
        (4, 4, 256, False, "random"),
        (1, 2, 128, True, "one_expert"),
        (32, 8, 7168, True, "random"),
        (32, 9, 128, False, "same_rank"),
        (4, 4, 512, True, "random"),  # UE8M0 scales
        (8, 6, 384, False, "same_rank"),  # LogFMT combine (several copies of a token per rank)
    ]):
        seed = 3000 * R + i
        t_max = 6 if H >= 7168 else 20
        Ts = _token_counts(seed, R, t_max)
        # odd cases give the weights at dispatch too (the API the cuda backend merges with)
        ue8m0 = i == 5
        mt = max(Ts) + 3
        out.append(dict(seed=seed, E=epr * R, K=K, H=H, fp8=fp8, pattern=pattern, Ts=Ts,
                        max_tokens=-(-mt // 4) * 4 if ue8m0 else mt, merged=i % 2 == 1,
                        **({"round_scale": True, "ue8m0": True} if ue8m0 else {}), **({"logfmt": True} if i == 6 else {})))
    return out


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_low_latency(pools, R):
    errors = flat(pools(R).run(cases.run_low_latency_cases, low_latency_cases(R)))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("permute", [False, True])
def test_gradcheck(pools, R, permute):
    cfg = dict(seed=5 + R, E=2 * R, K=3, H=4, T=2, permute=permute, align=4 if permute else 1)
    errors = flat(pools(R).run(cases.run_gradcheck, cfg))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_bad_inputs(pools, R):
    errors = flat(pools(R).run(cases.run_bad_inputs))
    assert not errors, "\n".join(errors[:40])


def test_low_latency_logfmt_must_match_on_every_rank(pools):
    import ll_cases

    errors = flat(pools(2).run(ll_cases.run_ll_logfmt_mismatch_case))
    assert not errors, "\n".join(errors[:20])
