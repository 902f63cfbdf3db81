"""megatron_ep.deep_ep, DeepEP V1's Python API on our Buffer: its helpers against DeepEP's numbers
(CPU), and the normal mode on the torch backend (CPU processes) against an oracle of DeepEP's
semantics (tests/deep_ep_cases.py)."""

import pytest
import torch

import deep_ep_cases as dc
from megatron_ep import deep_ep


def test_config_and_size_hints_follow_deepep():
    cfg = deep_ep.Config(20, 6, 256)
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) == 335709824  # DeepEP's own number for this config
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288) == 2146961792
    assert deep_ep.Buffer.get_dispatch_config(8).num_max_nvl_chunked_send_tokens == 6
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 1"):
        deep_ep.Buffer.get_dispatch_config(1)
    with pytest.raises(AssertionError, match="must be even"):
        deep_ep.Buffer.set_num_sms(7)
    with pytest.raises(AssertionError):
        deep_ep.Config(20, 256, 256)  # nvl send chunk not below the receive chunk
    assert deep_ep.topk_idx_t is torch.int64


def test_event_overlap_without_an_event():
    ev = deep_ep.EventOverlap(None)
    with ev:
        pass
    with pytest.raises(AssertionError):
        ev.current_stream_wait()


@pytest.mark.parametrize("R", [2, 4])
def test_normal_mode_matches_deepep(pools, R):
    errors = [e for rank in pools(R).run(dc.run_deep_ep_normal_cases, dc.normal_cases(R)) for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_low_latency_mode_matches_deepep(pools, R):
    errors = [e for rank in pools(R).run(dc.run_deep_ep_low_latency_cases, dc.low_latency_cases(R)) for e in rank]
    assert not errors, "\n".join(errors[:20])
