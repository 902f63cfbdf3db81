"""megatron_ep.deep_ep, DeepEP V1's Python API on our Buffer: its helpers against DeepEP's numbers
(CPU), and the normal mode on the torch backend (CPU processes) against an oracle of DeepEP's
semantics (tests/support/deep_ep_cases.py)."""

import logging
import types

import pytest
import torch

import deep_ep_cases as dc
from megatron_ep import deep_ep
from refusals import refusals


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
def test_dispatch_by_is_token_in_rank_matches_deepep(pools, R):
    """dispatch without topk_idx (and FP8 input with column-major scales) against DeepEP's rows,
    list and handle."""
    errors = [e for rank in pools(R).run(dc.run_deep_ep_by_rank_cases, dc.by_rank_cases(R)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_internode_handle_past_eight_ranks(pools):
    """16 ranks (2 nodes of 8, as DeepEP's internode_dispatch): the normal cases with DeepEP's
    10-entry internode handle."""
    errors = [e for rank in pools(16).run(dc.run_deep_ep_normal_cases, dc.normal_cases(16)[:1]) for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2, 4])
def test_low_latency_mode_matches_deepep(pools, R):
    errors = [e for rank in pools(R).run(dc.run_deep_ep_low_latency_cases, dc.low_latency_cases(R)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_events_on_cpu_processes(pools):
    """EventHandle without CUDA holds no event; the asynchronous calls work on CPU ranks."""
    errors = [e for rank in pools(2).run(dc.run_deep_ep_cpu_event_case, dict(seed=5, E=4, K=2, H=16, Ts=[5, 3]))
              for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_import_deep_ep_through_the_shim(tmp_path):
    """With the shim's folder on PYTHONPATH, unmodified `import deep_ep` code (Megatron's
    fused_a2a imports deep_ep.utils' EventHandle and EventOverlap) gets megatron_ep's, and the
    import says so, naming a DeepEP install it shadows."""
    import os
    import subprocess
    import sys

    shim = subprocess.run([sys.executable, "-m", "megatron_ep.deep_ep", "--path"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert shim == deep_ep.SHIM_DIR
    real = tmp_path / "deep_ep"
    real.mkdir()
    (real / "__init__.py").write_text("raise ImportError('the real DeepEP must not be imported')\n")
    code = ("import deep_ep\nfrom deep_ep.utils import EventHandle, EventOverlap\n"
            "print(deep_ep.Buffer.__module__, deep_ep.topk_idx_t)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim, str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["megatron_ep.deep_ep.buffer", "torch.int64"], r.stdout
    assert "megatron_ep's implementation" in r.stderr and f"shadows the DeepEP at {real}" in r.stderr, r.stderr


def test_clean_low_latency_buffer(pools):
    errors = [e for rank in pools(2).run(dc.run_deep_ep_clean_case, dict(seed=9, E=4, K=2, H=256)) for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_entry_point_help_and_its_required_option():
    """`python -m megatron_ep.deep_ep --help` answers through the project's parser; without
    --path it says in one line that --path is required."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "megatron_ep.deep_ep"]
    helped = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--path" in helped.stdout and "--debug" in helped.stdout, helped.stdout + helped.stderr
    bare = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = bare.stderr.strip().splitlines()
    assert bare.returncode == 2 and len(lines) == 1 and "required: --path" in lines[0], bare.stderr


# ------------------------------------------------------------------------ hostile use of the module
HOSTILE = dict(seed=31, E=4, K=2, H=16, Ts=[3, 4])


def _clean(per_rank) -> None:
    errors = [e for rank in per_rank for e in rank]
    assert not errors, "\n".join(errors[:20])


def test_num_worst_tokens_below_what_a_rank_receives_raises_on_every_rank(pools):
    """Every token goes to rank 0 (7 rows there); num_worst_tokens=5 is refused on both ranks,
    naming the rank and its count, instead of returning 5 rows of which 7 should have come."""
    _clean(pools(2).run(dc.run_deep_ep_worst_overflow_case, dict(HOSTILE, pattern="hot"), timeout=120))


def test_bad_ids_pass_the_layout_and_are_refused_by_the_dispatch(pools):
    _clean(pools(2).run(dc.run_deep_ep_bad_ids_case, HOSTILE, timeout=120))


def test_destroy_on_one_rank_fails_the_peers_calls_at_once(pools):
    _clean(pools(2).run(dc.run_deep_ep_destroyed_on_one_rank_case, HOSTILE, timeout=120))


def test_every_method_after_destroy_says_the_buffer_was_destroyed(pools):
    _clean(pools(2).run(dc.run_deep_ep_use_after_destroy_case, HOSTILE, timeout=120))


def test_handles_copy_and_deepcopy(pools):
    _clean(pools(2).run(dc.run_deep_ep_handle_copy_case, HOSTILE, timeout=120))


def test_zero_copy_buffer_of_another_handle_names_both_shapes(pools):
    _clean(pools(2).run(dc.run_deep_ep_zero_copy_other_handle_case, HOSTILE, timeout=120))


def test_buffer_arguments_are_refused_by_name(pools):
    _clean(pools(2).run(dc.run_deep_ep_buffer_argument_case, HOSTILE, timeout=120))


def test_flags_are_taken_as_deepeps_binding_takes_them():
    """pybind11's converting bool: a bool, None (False), a number by its truth value; a string is a
    TypeError naming the flag (it would read as true)."""
    from megatron_ep.deep_ep.config import flag

    import numpy as np

    assert [flag("f", v) for v in (True, False, 1, 0, None, 2.0, np.bool_(True), np.int64(0))] == \
        [True, False, True, False, False, True, True, False]
    with pytest.raises(TypeError, match="async_finish must be a bool, got str 'False'"):
        flag("async_finish", "False")


def test_config_and_static_arguments_are_refused_by_name():
    """Config's values, set_num_sms, the size hints and the config tables: ValueError (also an
    AssertionError, as DeepEP asserts) or TypeError naming the argument, its value and range, at
    the call; a refused set_num_sms leaves the count as it was."""
    B, before = deep_ep.Buffer, deep_ep.Buffer.num_sms
    cfg = deep_ep.Config(20, 6, 256)
    try:
        errors = _static_refusals(B, cfg)
    finally:
        changed, B.num_sms = B.num_sms, before
    if changed != before:
        errors.append(f"a refused set_num_sms changed Buffer.num_sms from {before} to {changed}")
    assert not errors, "\n".join(errors)


def _static_refusals(B, cfg) -> list:
    return refusals([
        ("Config num_sms -1", lambda: deep_ep.Config(-1), ValueError, "num_sms=-1 is outside its range: it must be in 0.."),
        ("Config num_sms str", lambda: deep_ep.Config("20"), TypeError, "num_sms must be an int, got str"),
        ("Config nvl send 0", lambda: deep_ep.Config(20, 0), ValueError,
         "num_max_nvl_chunked_send_tokens=0 is outside its range: it must be in 1.."),
        ("Config nvl recv", lambda: deep_ep.Config(20, 6, 6), ValueError,
         "num_max_nvl_chunked_recv_tokens=6 is outside its range: it must be in 7..2147483647 (above "
         "num_max_nvl_chunked_send_tokens=6)"),
        ("Config rdma send 0", lambda: deep_ep.Config(20, 6, 256, 0), ValueError,
         "num_max_rdma_chunked_send_tokens=0 is outside its range"),
        ("Config rdma recv -1", lambda: deep_ep.Config(20, 6, 256, 6, -1), ValueError,
         "num_max_rdma_chunked_recv_tokens=-1 is outside its range"),
        ("Config rdma two chunks", lambda: deep_ep.Config(20, 6, 256, 128, 128), ValueError,
         "num_max_rdma_chunked_recv_tokens=128 (rounded up to 128, whole chunks of num_max_rdma_chunked_send_tokens=128) "
         "must hold at least two send chunks"),
        ("set_num_sms -2", lambda: B.set_num_sms(-2), ValueError, "new_num_sms=-2 is outside its range: it must be in 2.."),
        ("set_num_sms 0", lambda: B.set_num_sms(0), ValueError, "new_num_sms=0 is outside its range"),
        ("set_num_sms 7", lambda: B.set_num_sms(7), AssertionError, "new_num_sms=7: the SM count must be even"),
        ("set_num_sms 24.0", lambda: B.set_num_sms(24.0), TypeError, "new_num_sms must be an int, got float"),
        ("get_dispatch_config 3", lambda: B.get_dispatch_config(3), ValueError,
         "Unsupported number of EP ranks: 3 (num_ranks must be one of [2, 4, 8, 16"),
        ("get_combine_config '8'", lambda: B.get_combine_config("8"), TypeError, "num_ranks must be an int, got str"),
        ("nvl hint num_ranks 12", lambda: cfg.get_nvl_buffer_size_hint(7168 * 2, 12), ValueError,
         "num_ranks=12 is not a DeepEP group size"),
        ("nvl hint hidden_bytes", lambda: cfg.get_nvl_buffer_size_hint(-2, 8), ValueError, "hidden_bytes=-2 is outside its range"),
        ("rdma hint odd SMs", lambda: deep_ep.Config(21, 6, 256).get_rdma_buffer_size_hint(7168 * 2, 16), ValueError,
         "num_ranks=16: past 8 ranks the Config's num_sms must be even"),
        ("low-latency hint tokens 0", lambda: B.get_low_latency_rdma_size_hint(0, 7168, 8, 288), ValueError,
         "num_max_dispatch_tokens_per_rank=0 is outside its range"),
    ])


def test_sm_count_is_handed_to_our_budget(monkeypatch, caplog):
    """Buffer.set_num_sms / a call's Config -> our kernels' budget (set_num_sms), once per new
    count; 0 -> our default rule (None); past what a rank may keep resident -> that bound, said."""
    handed = []
    runtime = types.SimpleNamespace(max_num_sms=8, set_num_sms=handed.append)
    me = types.SimpleNamespace(_sms_asked=None, _sms_capped=set(), runtime=runtime)
    monkeypatch.setattr(deep_ep.Buffer, "num_sms", 6)
    hand = deep_ep.Buffer._hand_sms
    hand(me, None)
    hand(me, None)  # the same count: nothing handed again
    hand(me, deep_ep.Config(4, 6, 256, 6, 128))
    hand(me, deep_ep.Config(0, 6, 256, 6, 128))
    with caplog.at_level(logging.WARNING, logger="megatron_ep.deep_ep"):
        hand(me, deep_ep.Config(24, 6, 256, 6, 128))
        hand(me, None)
        hand(me, deep_ep.Config(24, 6, 256, 6, 128))  # the same count again: handed, not said again
    assert handed == [6, 4, None, 8, 6, 8], handed
    assert caplog.text.count("num_sms=24 is above the 8 SMs") == 1, caplog.text
    torch_runtime = types.SimpleNamespace(max_num_sms=None, set_num_sms=handed.append)
    hand(types.SimpleNamespace(_sms_asked=None, _sms_capped=set(), runtime=torch_runtime), None)  # no kernels
    assert handed == [6, 4, None, 8, 6, 8]
