"""The cuda backend against the dense oracle, with R = 2, 4, 8 processes sharing one GPU
(virtual ranks: the processes open each other's regions by CUDA IPC; run them under MPS, see
scripts/gate/gpu_check.sh). Outputs are poisoned before every kernel (MEP_POISON=1)."""

import os

import pytest

import cases
import fault_cases
import hostile_cases
import v2_combine_cases
from case_lists import FUZZ_REGRESSIONS, normal_cases
from distpool import flat
from gpu_pools import GPU_MARKS, Alone, GpuPools, closing, gate_subset, run_alone

pytestmark = GPU_MARKS

POOLS = GpuPools(ahead={"test_timeout_names_the_missing_rank": [Alone(2, MEGATRON_EP_TIMEOUT_S="3")],
                        "test_hostile_timeouts": [Alone(2, MEGATRON_EP_TIMEOUT_S="3")]})
pool_ = POOLS.get
_close_pools = closing(POOLS)


@pytest.mark.parametrize("R", [2, 4, 8])
def test_normal_cases(R):
    selected = gate_subset(normal_cases(R))
    errors = flat(pool_(R).run(cases.run_normal_cases, selected, backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4, 8])
def test_v2_combine_order(R):
    """Combine with 0, 1 and 2 biases, bf16 and fp32, both layouts (the expert-major partials and,
    with the input in the buffer, the staged kernel): bit-exact against DeepEP V2's reference
    combine and against the torch backend (tests/support/v2_combine_cases.py)."""
    errors = flat(pool_(R).run(v2_combine_cases.run_v2_combine_cases, v2_combine_cases.v2_combine_cases(R, H=512),
                               backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_bias_refusals(R):
    errors = flat(pool_(R).run(v2_combine_cases.run_bias_refusals, backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4, 8])
@pytest.mark.parametrize("pool", ["none", "rank0"])
def test_push_fallback(R, pool):
    """Rank-major dispatch when some or all ranks have no room in their pool: every rank must
    agree on stage-and-pull inside the push kernel, with the same results."""
    sizing = {"pool_bytes": 256} if pool == "none" else {"pool_bytes_rank0": 256}
    selected = [dict(c, sizing=sizing) for c in normal_cases(R)[:4]]
    errors = flat(pool_(R).run(cases.run_normal_cases, selected, backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4, 8])
def test_cuda_graph(R):
    cfg = dict(seed=77 + R, E=4 * R, K=4, H=512, T=24, align=16)
    errors = flat(pool_(R).run(cases.run_cuda_graph_case, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_cuda_graph_async(R):
    cfg = dict(seed=91 + R, E=4 * R, K=4, H=512, T=24, align=16)
    cfg["async"] = True
    errors = flat(pool_(R).run(cases.run_cuda_graph_case, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4, 8])
def test_repeated_calls(R):
    cfg = dict(seed=5 * R, E=8 * R, K=6, H=256, t_max=40, iters=120)
    errors = flat(pool_(R).run(cases.run_repeated, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_bad_inputs(R):
    errors = flat(pool_(R).run(cases.run_bad_inputs, backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:40])


def test_timeout_names_the_missing_rank():
    errors = flat(run_alone(2, cases.run_timeout_case, 1, timeout=120, MEGATRON_EP_TIMEOUT_S="3"))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("permute", [False, True])
def test_autograd_and_async(R, permute):
    cfg = dict(seed=31 + R, E=4 * R, K=4, H=256, T=20, permute=permute)
    errors = flat(pool_(R).run(cases.run_cuda_autograd_async, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


# ------------------------------------------------------------------------ runtime (faults etc.)
@pytest.mark.parametrize("R", [2, 4])
def test_hostile_use(R):
    """tests/support/hostile_cases.py on the cuda backend: an allocation failing on one rank mid-call,
    arguments refused by name; the Buffer usable afterwards."""
    errors = flat(pool_(R).run(hostile_cases.run_all, backend="cuda", device="cuda", timeout=300))
    assert not errors, "\n".join(errors[:30])


@pytest.mark.parametrize("R", [2, 4])
def test_edges(R):
    """tests/support/edge_cases.py on the cuda backend: a cached dispatch's outputs are the caller's, an
    FP8 dispatch's weights' gradient (a weights-only combine of narrow rows), previous_event of
    the wrong kind, two threads on one Buffer."""
    import edge_cases

    errors = flat(pool_(R).run(edge_cases.run_all, backend="cuda", device="cuda", timeout=300))
    assert not errors, "\n".join(errors[:30])


@pytest.mark.parametrize("R", [2])
def test_double_backward(R):
    """First and second derivatives of dispatch -> f -> combine equal the torch backend's (whose
    gradgradcheck passes on CPU), both layouts."""
    import edge_cases

    errors = flat(pool_(R).run(edge_cases.run_double_backward_matches_reference, timeout=300))
    assert not errors, "\n".join(errors[:20])


def test_hostile_timeouts():
    """Calls on different Buffers, and a destroy on one rank only: CommTimeoutError on every rank
    within the (short) timeout, no hang (fresh processes: the Buffers end broken)."""
    errors = flat(run_alone(2, hostile_cases.run_cuda_timeouts, None, timeout=150, MEGATRON_EP_TIMEOUT_S="3"))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_faults(R):
    """Each fault of the runtime issue on the cuda backend: named errors on every rank within
    2 s (async calls at synchronize()), exact results, the buffer usable afterwards."""
    errors = flat(pool_(R).run(fault_cases.run_all_faults, backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:30])


@pytest.mark.parametrize("R", [2, 4, 8])
def test_fuzz(R):
    """MEP_FUZZ_CASES (default 60; the gate's long mode: 1000) random routings, both layouts,
    bit-exact against the torch backend; a failing seed is printed with its inputs (add it to
    case_lists.FUZZ_REGRESSIONS)."""
    n = int(os.environ.get("MEP_FUZZ_CASES", "60"))
    seeds = [dict(cases=1, seed=s) for s in FUZZ_REGRESSIONS] + [dict(cases=n, seed=100000 * R)]
    errors = []
    for cfg in seeds:
        errors += flat(pool_(R).run(cases.run_fuzz, cfg, timeout=900))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_pool_takeover(R):
    """A block still read on the device is taken over by the next dispatch with a GPU-side wait."""
    errors = flat(pool_(R).run(cases.run_pool_takeover, dict(seed=21 + R, rounds=4), timeout=300))
    assert not errors, "\n".join(errors[:20])


def test_pool_takeover_waits_for_the_consumer_stream():
    """The output read late on another stream and freed there (Megatron's EP overlap: dispatched
    on its comm stream, consumed and freed on its compute stream): the takeover waits for it."""
    errors = flat(pool_(2).run(cases.run_pool_takeover, dict(seed=31, rounds=3, side_stream=True), timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_soak(R):
    """MEP_SOAK_ITERS (default 600; the gate's long mode: 10000) rounds with changing routing."""
    cfg = dict(seed=11, E=8 * R, K=6, H=256, t_max=40, iters=int(os.environ.get("MEP_SOAK_ITERS", "600")), warmup=200)
    errors = flat(pool_(R).run(cases.run_soak, cfg, timeout=900))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_lifetime_and_growth(R):
    errors = flat(pool_(R).run(cases.run_lifetime_growth, dict(seed=3 + R), timeout=600))
    assert not errors, "\n".join(errors[:20])


def test_num_sms_bound():
    errors = flat(pool_(2).run(cases.run_num_sms_bound, timeout=120))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("R", [2])
def test_reserve(R):
    """Collective sizing ahead of sync-free calls (hybridep's static budget relies on it)."""
    errors = flat(pool_(R).run(cases.run_reserve, dict(seed=9), timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4, 8])
def test_chunked_experts(R):
    """megatron_ep.experts.chunked_expert_mlp on the cuda backend: the pipelined chunks give one
    round's outputs and gradients (the CPU test's cases)."""
    import chunked_experts_cases as cc

    errors = flat(pool_(R).run(cc.run_chunked_experts_cases, cc.cases(R), backend="cuda", device="cuda", timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_chunked_edges(R):
    """A second derivative or a second backward through a chunked layer raises naming it; bf16
    probs are taken, their gradient bf16; probs of the wrong kind are named."""
    import chunked_experts_cases as cc

    cfg = dict(seed=352, E=2 * R, K=2, H=16, F=8, Ts=[5, 0], chunks=3, p_drop=0.2)
    errors = flat(pool_(R).run(cc.run_chunked_edges_case, cfg, backend="cuda", device="cuda", timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_chunked_experts_cuda_graph(R):
    """chunked_expert_mlp worst-case sized, forward and backward in one CUDA graph, replayed on new
    inputs, equals the eager layer."""
    import chunked_experts_cases as cc

    errors = flat(pool_(R).run(cc.run_chunked_graph_cases, cc.graph_cases(R), timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_tracing(R):
    """megatron_ep.tools.tracing on the intranode path: each call's phase marks in order from 'start',
    the counters, the notify kernels alone as collective calls of their own (the buffer's calls
    go on in step after them)."""
    import tracing_cases as tc

    errors = flat(pool_(R).run(tc.run_tracing_case, dict(seed=11), backend="cuda", device="cuda", timeout=300))
    assert not errors, "\n".join(errors[:20])
