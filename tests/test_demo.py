"""The README's main job (megatron_ep.demo) end to end: distributed MoE layer vs dense fp64."""

import pytest

import cases


@pytest.mark.parametrize("R,argv", [(4, []), (2, ["--rank-major", "--steps", "1"]), (1, ["--steps", "1"])])
def test_demo_matches_dense(pools, R, argv):
    stats = pools(R).run(cases.run_demo, ["--backend", "torch"] + argv)[0]
    assert len(stats) == R
    for s in stats:
        assert s["fwd_err"] < 2e-2 and s["grad_err"] < 2e-2, s
    assert sum(s["rows"] for s in stats) > 0
