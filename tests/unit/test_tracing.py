"""megatron_ep.tools.tracing on the torch backend (CPU, gloo): every hook has nothing to report, and
says so (an empty list or dict, None) instead of failing (tests/support/tracing_cases.py; the cuda
backend's cases are GPU tests in test_cuda_intranode.py and test_cuda_internode.py)."""

import tracing_cases as tc

from megatron_ep.tools import tracing


def test_tracing_on_the_torch_backend(pools):
    errors = [e for rank in pools(2).run(tc.run_tracing_case, dict(seed=3)) for e in rank]
    assert not errors, "\n".join(errors)


def test_low_latency_points_match_the_kernels():
    """The names the built extension gives the low-latency trace points (kLLTraceNames), one per
    LLTracePoint of csrc/low_latency/api.h, in the enum's order."""
    import os

    api = open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc", "low_latency",
                            "api.h")).read()
    import re

    points = re.findall(r"kLLTrace(\w+) = (\d+),", api)
    assert [name.lower() for name, _ in points] == list(tracing.low_latency_points())
    assert [int(v) for _, v in points] == list(range(len(points)))
    assert f"kLLTracePoints = {len(points)}" in api
