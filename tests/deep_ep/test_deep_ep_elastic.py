"""megatron_ep.deep_ep's ElasticBuffer (DeepEP V2's API) on the torch backend (CPU processes) against
an oracle of V2's semantics (tests/support/deep_ep_elastic_cases.py), with V2's edges: an empty rank,
duplicate ids in a token, ranks with different num_max_tokens_per_rank, num_sms=0."""

import pytest
import torch

import deep_ep_elastic_cases as ec


@pytest.mark.parametrize("R", [2, 4])
def test_elastic_buffer_matches_v2(pools, R):
    errors = [e for rank in pools(R).run(ec.run_elastic_cases, ec.elastic_cases(R)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_elastic_buffer_refuses_construction_under_capture(monkeypatch):
    """Inside a CUDA-graph capture the constructor refuses at once, before any collective."""
    from megatron_ep.deep_ep import elastic

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        elastic.ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=16)


def test_elastic_buffer_refuses_cpu_memory():
    from megatron_ep.deep_ep import ElasticBuffer

    with pytest.raises(NotImplementedError, match="num_cpu_bytes"):
        ElasticBuffer(None, num_cpu_bytes=1 << 21)


@pytest.mark.parametrize("R", [2, 4])
def test_elastic_buffer_callers(pools, R):
    """Megatron-LM dev's, SGLang's and vLLM's call sequences on ElasticBuffer."""
    cfgs = ec.elastic_cases(R)
    errors = [e for rank in pools(R).run(ec.run_elastic_callers_cases, [cfgs[0], cfgs[2]]) for e in rank]
    assert not errors, "\n".join(errors[:20])
