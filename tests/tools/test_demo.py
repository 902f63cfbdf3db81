"""The README's main job (megatron_ep.tools.demo) end to end: distributed MoE layer vs dense fp64."""

import pytest

import cases


@pytest.mark.parametrize("R,argv", [(4, []), (2, ["--rank-major", "--steps", "1"]), (1, ["--steps", "1"])])
def test_demo_matches_dense(pools, R, argv):
    stats = pools(R).run(cases.run_demo, ["--backend", "torch"] + argv)[0]
    assert len(stats) == R
    for s in stats:
        assert s["fwd_err"] < 2e-2 and s["grad_err"] < 2e-2, s
    assert sum(s["rows"] for s in stats) > 0


def test_demo_with_a_rank_without_tokens(pools):
    """--tokens 30 at 4 ranks leaves rank 2 with none: its dense reference and its distributed
    layer still run forward and backward (an empty gradient, no error), the others match."""
    stats = pools(4).run(cases.run_demo, ["--backend", "torch", "--tokens", "30", "--steps", "1"])[0]
    assert [s["tokens"] for s in stats] == [30, 13, 0, 10], stats
    for s in stats:
        assert s["fwd_err"] < 2e-2 and s["grad_err"] < 2e-2, s
