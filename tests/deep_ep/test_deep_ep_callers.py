"""megatron_ep.deep_ep driven as SGLang's and vLLM's DeepEP managers drive DeepEP
(tests/support/deep_ep_callers.py): a normal prefill, low-latency decode with the receive hook, two
micro-batches in flight. On the torch backend (CPU processes); tests/deep_ep/test_deep_ep_gpu.py runs
the same sequences on our kernels."""

import pytest

import deep_ep_callers as cc


@pytest.mark.parametrize("R", [2, 4])
def test_prefill_as_the_serving_managers_call_it(pools, R):
    errors = [e for rank in pools(R).run(cc.run_prefill_case, cc.caller_cases(R)[0]) for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_decode_with_the_hook_and_two_batches_in_flight(pools, R):
    errors = [e for rank in pools(R).run(cc.run_decode_case, cc.caller_cases(R)[0]) for e in rank]
    assert not errors, "\n".join(errors[:20])
