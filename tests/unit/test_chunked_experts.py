"""megatron_ep.experts.chunked_expert_mlp on the torch backend (CPU, gloo): the pipelined chunks
give one round's outputs and gradients (tests/support/chunked_experts_cases.py)."""

import pytest

import chunked_experts_cases as cc
from megatron_ep.experts import chunk_bounds


@pytest.mark.parametrize("R", [2, 4])
def test_chunked_matches_one_round(pools, R):
    errors = [e for rank in pools(R).run(cc.run_chunked_experts_cases, cc.cases(R)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_chunk_bounds_cover_every_token_once():
    for T in (0, 1, 5, 16, 17):
        for n in (1, 2, 3, 8):
            b = chunk_bounds(T, n)
            assert len(b) == n and b[0][0] == 0 and b[-1][1] == T
            assert all(b[i][1] == b[i + 1][0] for i in range(n - 1))
            assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


def test_bad_chunks_raise():
    import torch

    from megatron_ep.experts import chunked_expert_mlp

    x, idx, probs = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        chunked_expert_mlp(None, x, idx, probs, None, None, 2, chunks=0)
    with pytest.raises(TypeError, match="chunks must be an int"):
        chunked_expert_mlp(None, x, idx, probs, None, None, 2, chunks=2.0)
    with pytest.raises(ValueError, match="probs must have"):
        chunked_expert_mlp(None, x, idx, torch.zeros(2, 2), None, None, 2)


def test_worst_case_sized_chunks_count_their_drops(pools):
    errors = [e for rank in pools(2).run(cc.run_worst_case_drops_case, dict(seed=5, E=4, K=2, H=16, F=8)) for e in rank]
    assert not errors, "\n".join(errors)


def test_timeline_marks_show_the_pipeline(pools):
    errors = [e for rank in pools(2).run(cc.run_marks_case, cc.cases(2)[0]) for e in rank]
    assert not errors, "\n".join(errors)


def test_bench_overlap_smoke_and_bad_arguments():
    """scripts/bench overlap on CPU processes (torch backend): its table, and one-line errors."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "scripts", "bench")
    run = lambda *args: subprocess.run([sys.executable, script, "overlap", *args], capture_output=True, text=True, timeout=300)  # noqa: E731
    ok = run("--ranks", "2", "--cpu", "--tokens", "16", "--hidden", "64", "--ffn", "32", "--experts", "4",
             "--topk", "2", "--chunks", "2", "--iters", "1", "--warmup", "0")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "not speed claims" in ok.stdout and "\n     2 " in ok.stdout and "\n     1 " in ok.stdout
    bad = run("--ranks", "3", "--experts", "4", "--cpu")
    assert bad.returncode == 2 and "must be a multiple of --ranks" in bad.stderr


def test_chunk_count_from_the_environment(monkeypatch):
    from megatron_ep.megatron.chunked import ENV, chunks_from_env

    monkeypatch.delenv(ENV, raising=False)
    assert chunks_from_env() == 0
    monkeypatch.setenv(ENV, " 4 ")
    assert chunks_from_env() == 4
    for bad in ("four", "0", "-2", "2.5"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            chunks_from_env()


def test_chunked_gemms_leave_the_communication_sms_free(pools):
    errors = [e for rank in pools(2).run(cc.run_carveout_case, dict(seed=7, E=4, K=2, H=16, F=8)) for e in rank]
    assert not errors, "\n".join(errors)


def test_bad_comm_sms_raise():
    import torch

    from megatron_ep.experts import chunked_expert_mlp

    x, idx, probs = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1)
    with pytest.raises(ValueError, match="comm_sms must be >= 0"):
        chunked_expert_mlp(None, x, idx, probs, None, None, 2, chunks=2, comm_sms=-1)


def test_on_dispatch_runs_after_the_wait_for_the_rows():
    """A chunk's on_dispatch (the hybridep manager counts drops there, on the caller's stream)
    comes after the caller's stream was made to wait for that chunk's dispatch, never before:
    a fake buffer records the order on the host."""
    import torch

    from megatron_ep.experts import chunked_expert_mlp
    from megatron_ep.core.types import CombineOutput, DispatchOutput

    seen = []

    class Event:
        def __init__(self, what):
            self.what = what

        def current_stream_wait(self):
            seen.append(("wait", self.what))

    class FakeBuffer:
        num_sms = None
        calls = 0

        def dispatch(self, x, topk_idx, topk_weights, **kwargs):
            c = FakeBuffer.calls
            FakeBuffer.calls += 1
            rows = x.repeat_interleave(topk_idx.shape[1], 0)
            tpe = torch.tensor([rows.shape[0]])
            out = DispatchOutput(rows, None, topk_weights.reshape(-1).float(), None, tpe, None, event=Event(("dispatch", c)))
            out.handle = ("handle", c, x.shape[0], topk_idx.shape[1])
            return out

        def combine(self, y, handle, async_op=False):
            _, c, T, K = handle
            return CombineOutput(y.reshape(T, K, -1).sum(1), None, Event(("combine", c)))

    x, idx = torch.randn(6, 4), torch.zeros(6, 2, dtype=torch.int64)
    probs = torch.rand(6, 2)
    w1, w2 = torch.randn(1, 8, 4), torch.randn(1, 4, 8)
    chunked_expert_mlp(FakeBuffer(), x, idx, probs, w1, w2, 1, chunks=3,
                       on_dispatch=lambda c, out: seen.append(("on_dispatch", c)))
    for c in range(3):
        assert seen.index(("wait", ("dispatch", c))) < seen.index(("on_dispatch", c)), seen


@pytest.mark.parametrize("R", [2, 3])
def test_chunked_edges(pools, R):
    cfg = dict(seed=350 + R, E=2 * R, K=2, H=16, F=8, Ts=[5, 0, 7][:R], chunks=3, p_drop=0.2)
    errors = [e for rank in pools(R).run(cc.run_chunked_edges_case, cfg) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_second_derivative_is_exact_or_refused_both_ways(pools):
    """autograd.grad(..., inputs) visits only the nodes between its outputs and its inputs: the
    refusal must lie on that path, not only on what .backward() visits."""
    cfg = dict(seed=360, E=4, K=2, H=8, F=4, Ts=[5, 3], chunks=2)
    errors = [e for rank in pools(2).run(cc.run_second_derivative_case, cfg) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_gradgradcheck_is_exact_or_refused(pools):
    cfg = dict(seed=361, E=2, K=2, H=4, F=3, Ts=[3], chunks=2)
    errors = [e for rank in pools(1).run(cc.run_gradgradcheck_case, cfg) for e in rank]
    assert not errors, "\n".join(errors)
