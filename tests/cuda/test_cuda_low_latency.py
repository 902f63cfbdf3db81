"""The cuda low-latency path (NVSHMEM, megatron_ep._C_nvshmem) against the dense oracle and the torch
backend's contract, with R = 2 (one process per GPU when there are two) and R = 4, 8 virtual
ranks (several processes per GPU; run under MPS, see scripts/gate/gpu_check.sh). Outputs are poisoned
before every kernel (MEP_POISON=1)."""

import pytest

import cases
import ll_cases
import megatron_ep
from case_lists import _token_counts
from distpool import flat
from gpu_pools import GPU_MARKS, Alone, GpuPools, closing, gate_subset, run_alone
from megatron_ep.experts.backends import deep_gemm_module

pytestmark = GPU_MARKS

POOLS = GpuPools(ahead={"test_peer_failure_is_published": [Alone(2)],
                        "test_timeout_names_the_missing_rank": [Alone(2, MEGATRON_EP_TIMEOUT_S="3")]})
pool_ = POOLS.get
_close_pools = closing(POOLS)


def ll_cases_for(R):
    """Both wire formats, -1 slots, empty ranks, 1 to 128 tokens, the decode shape, power-of-two
    scales, UE8M0 scales, FP8 edge values, the LogFMT combine (every case also checks the receive statistics); the merged combine (weights given at dispatch) on half of them,
    including 9 copies of a token on one rank and the decode shape."""
    out = []
    for i, (epr, K, H, fp8, pattern, t_max, extra) in enumerate([
        (4, 4, 256, True, "random", 20, {}),
        (4, 4, 256, False, "random", 20, {"merged": True}),
        (1, 2, 128, True, "one_expert", 20, {"merged": True}),
        (32, 9, 128, False, "same_rank", 40, {"merged": True}),
        (8, 8, 1024, True, "hot", 64, {"round_scale": True, "merged": True}),
        (4, 4, 512, True, "random", 14, {"x_edge": True}),
        # UE8M0 scales (packed exponents, column-major) with edge values
        (4, 4, 1024, True, "random", 14, {"x_edge": True, "round_scale": True, "ue8m0": True}),
        (16, 8, 2048, True, "random", 1, {"Ts": [1] * R}),
        # LogFMT combine: one row per copy, and merged (several copies of a token per rank)
        (4, 4, 512, False, "random", 14, {"logfmt": True}),
        (8, 6, 384, False, "same_rank", 20, {"logfmt": True, "merged": True}),
        # the decode shape (E = 256, H = 7168); 128 tokens at R = 2, 32 with virtual ranks (the oracle's
        # host copies of every rank's [E/R, R*mt, H] outputs grow with E * mt)
        (256 // R, 8, 7168, True, "random", 128, {"Ts": [128 if R == 2 else 32] * R, "merged": True}),
    ]):
        seed = 7000 * R + i
        Ts = extra.pop("Ts", None) or _token_counts(seed, R, t_max)
        mt = max(Ts) if t_max == 128 else max(Ts) + 3
        if extra.get("ue8m0"):
            mt = -(-mt // 4) * 4  # R * mt a multiple of 4 (TMA-aligned column-major scales)
        out.append(dict(seed=seed, E=epr * R, K=K, H=H, fp8=fp8, pattern=pattern, Ts=Ts, max_tokens=mt, **extra))
    return out


@pytest.mark.parametrize("R", [2, 4, 8])
def test_low_latency_cases(R):
    selected = gate_subset(ll_cases_for(R))
    errors = flat(pool_(R).run(cases.run_low_latency_cases, selected, backend="cuda", device="cuda", timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4, 8])
def test_cuda_graph_replays(R):
    """Dispatch + combine captured once and replayed 30 times with new data."""
    cfg = dict(seed=91 + R, E=8 * R, K=8, H=1024, T=48, max_tokens=64, fp8=True, replays=30)
    errors = flat(pool_(R).run(ll_cases.run_ll_graph_case, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_hook_and_buffer_sets(R):
    cfg = dict(seed=17 + R, E=8 * R, K=6, H=512, T=32, max_tokens=32)
    errors = flat(pool_(R).run(ll_cases.run_ll_hook_case, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_signature_mismatch(R):
    errors = flat(pool_(R).run(ll_cases.run_ll_mismatch_case, timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_logfmt_must_match_on_every_rank(R):
    errors = flat(pool_(R).run(ll_cases.run_ll_logfmt_mismatch_case, backend="cuda", device="cuda", timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_bad_inputs(R):
    errors = flat(pool_(R).run(ll_cases.run_ll_bad_inputs, timeout=300))
    errors += flat(pool_(R).run(ll_cases.run_ll_combine_out_case, backend="cuda", device="cuda", timeout=300))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_peer_failure_is_published(R):
    """(fresh processes: the case leaves broken buffers behind)"""
    errors = flat(run_alone(R, ll_cases.run_ll_peer_failure_case, R - 1, timeout=240))
    assert not errors, "\n".join(errors[:20])


def test_timeout_names_the_missing_rank():
    errors = flat(run_alone(2, ll_cases.run_ll_timeout_case, 1, timeout=180, MEGATRON_EP_TIMEOUT_S="3"))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("R", [2, 4])
def test_rank_mask(R):
    """Masked ranks skipped both ways, exact for the rest; unmask + barrier rejoins; a stopped rank
    masked by the others' timed-out waits (fresh processes: the stopped rank's buffer is left
    behind out of step)."""
    cfg = dict(seed=300 + R, E=4 * R, K=4, H=256, T=24, max_tokens=32, mask_timeout_s=3.0)
    errors = flat(run_alone(R, ll_cases.run_ll_rank_mask_case, cfg, timeout=200))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_decode_layer(R):
    """LL dispatch -> masked grouped GEMM -> LL combine against a dense reference, eager and graph
    (DeepGEMM's masked GEMMs when deep_gemm imports, else the fallback; R = 2 has 64 rows per
    expert, which the DeepGEMM glue pads to its 128-row tile)."""
    cfg = dict(seed=5 + R, E=8 * R, K=4, H=512, F=256, T=24, max_tokens=32)
    errors = flat(pool_(R).run(ll_cases.run_ll_decode_layer_case, cfg, timeout=600))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("gemm", [
    pytest.param("deepgemm", marks=pytest.mark.skipif(
        deep_gemm_module() is None, reason="deep_gemm does not import (optional: docs/megatron.md, 'Experts')")),
    "torch"])
def test_decode_layer_one_graph(gemm):
    """The whole decode MoE layer in ONE CUDA graph at R = 2: LL dispatch (FP8) -> DeepGEMM's masked
    FP8 fc1 -> SwiGLU -> its masked bf16 fc2 -> LL combine ('deepgemm'; both GEMMs must have been
    called), or the same with the batched-matmul fallback ('torch'). Replayed on 4 fresh sets of
    tokens and routings, each against the eager layer on the same inputs and the dense reference.
    max_m = R * 64 = 128 rows per expert: DeepGEMM's tile, no padding copy (test_decode_layer's
    R = 2 case, 64 rows, takes the padded path). fc1's FP8 cast is kept by the layer; after the
    replays w1 is halved in place, the cast refreshed, and a last replay must follow."""
    cfg = dict(seed=41, E=8, K=4, H=512, F=256, T=48, max_tokens=64, replays=4, gemm=gemm, keep_fp8=True)
    # a short answer time: a rank that crashes in DeepGEMM must not hold the 'torch' case back
    errors = flat(pool_(2).run(ll_cases.run_ll_decode_layer_case, cfg, timeout=180))
    assert not errors, "\n".join(errors[:20])
