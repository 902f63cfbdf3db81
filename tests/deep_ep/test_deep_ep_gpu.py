"""megatron_ep.deep_ep on the cuda backend (our kernels), R = 2 and 4 virtual ranks: the normal
mode (intranode kernels) and the low-latency mode (statistics, UE8M0 scales, the zero-copy
combine) against the same oracle of DeepEP's semantics as the torch backend's CPU cases
(tests/support/deep_ep_cases.py, tests/deep_ep/test_deep_ep.py); DeepEP V2's ElasticBuffer likewise
(tests/support/deep_ep_elastic_cases.py)."""

import os

import pytest

import deep_ep_cases as dc
from distpool import flat
from gpu_pools import GPU_MARKS, GpuPools, closing

pytestmark = GPU_MARKS
# short kernel waits and a bounded run: a rank that stops (an error on one rank only) fails the
# case within the test's limit, with each silent rank's stack, instead of running past it
POOLS = GpuPools(MEGATRON_EP_TIMEOUT_S="10")
RUN_S = float(os.environ.get("MEP_DEEP_EP_RUN_S", "120"))
pool_ = POOLS.get
_close_pools = closing(POOLS)

ON_CUDA = dict(backend="cuda", device="cuda")


@pytest.mark.parametrize("R", [2, 4])
def test_normal_mode_on_our_kernels(R):
    errors = flat(pool_(R).run(dc.run_deep_ep_normal_cases, [dict(c, **ON_CUDA) for c in dc.normal_cases(R)], timeout=RUN_S))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_low_latency_mode_on_our_kernels(R):
    # pools of its own: processes that hold no normal-mode buffer, as DeepEP's low-latency callers
    # run (the normal-mode test's pools keep theirs)
    pool = pool_(R, MEP_DEEP_EP_POOL="low_latency")
    errors = flat(pool.run(dc.run_deep_ep_low_latency_cases, [dict(c, **ON_CUDA) for c in dc.low_latency_cases(R)],
                           timeout=RUN_S))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_previous_event_with_the_callers_stream_busy(R):
    errors = flat(pool_(R).run(dc.run_deep_ep_stream_order_cases, [dict(c, **ON_CUDA) for c in dc.stream_order_cases(R)],
                               timeout=RUN_S))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_dispatch_by_is_token_in_rank_on_our_kernels(R):
    """dispatch without topk_idx, FP8 with column-major and with UE8M0 int32 scales, cached
    dispatch and combine on our kernels, against DeepEP's rows, list and handle."""
    errors = flat(pool_(R).run(dc.run_deep_ep_by_rank_cases, [dict(c, **ON_CUDA) for c in dc.by_rank_cases(R)],
                               timeout=RUN_S))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_serving_managers_call_sequences_on_our_kernels(R):
    """The call sequences of SGLang's and vLLM's DeepEP managers (tests/support/deep_ep_callers.py): a normal
    prefill, low-latency decode with the receive hook, two micro-batches in flight."""
    import deep_ep_callers as cc

    cfg = dict(cc.caller_cases(R)[0], **ON_CUDA)
    errors = flat(pool_(R).run(cc.run_prefill_case, cfg, timeout=RUN_S))
    errors += flat(pool_(R, MEP_DEEP_EP_POOL="low_latency").run(cc.run_decode_case, cfg, timeout=RUN_S))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_num_worst_tokens_below_r_times_t_on_our_kernels(R):
    """num_worst_tokens = what the busiest rank receives, below R x T: the worst-case sized dispatch
    fits the buffer megatron_ep.deep_ep reserved for it and delivers DeepEP's rows."""
    cfg = dict(seed=31, E=4, K=2, H=16, Ts=[3, 4], pattern="hot", **ON_CUDA)
    errors = flat(pool_(R).run(dc.run_deep_ep_worst_below_rt_case, cfg, timeout=RUN_S))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_bad_ids_refused_by_the_dispatch_on_our_kernels(R):
    """An id out of range on every rank: the layout lets it pass (no host sync), our notify kernel
    finds it and every rank raises ValueError before any row moves; the next dispatch is DeepEP's."""
    cfg = dict(seed=31, E=4, K=2, H=16, Ts=[3, 4], **ON_CUDA)
    errors = flat(pool_(R).run(dc.run_deep_ep_bad_ids_case, cfg, timeout=RUN_S))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_elastic_buffer_on_our_kernels(R):
    """DeepEP V2's ElasticBuffer on our kernels against the oracle of V2's semantics and the call
    sequences of Megatron-LM's, SGLang's and vLLM's V2 backends (tests/support/deep_ep_elastic_cases.py)."""
    import deep_ep_elastic_cases as ec

    cfgs = [dict(c, **ON_CUDA) for c in ec.elastic_cases(R)]
    errors = flat(pool_(R).run(ec.run_elastic_cases, cfgs, timeout=RUN_S))
    errors += flat(pool_(R).run(ec.run_elastic_callers_cases, [cfgs[0], cfgs[2]], timeout=RUN_S))
    assert not errors, "\n".join(errors[:20])
