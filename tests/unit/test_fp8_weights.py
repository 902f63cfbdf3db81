"""The FP8 weight cache (megatron_ep.experts.fp8_weights): off unless asked for (frozen(), or
enabled); then a weight's cast is reused while the weight visibly holds the values it was cast
from, and is the cast per_block_cast_to_fp8 makes."""

import gc

import pytest
import torch

from megatron_ep.experts import fp8_weights as F


def _w(seed=0, G=2, N=256, K=384):
    return torch.randn((G, N, K), generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.fixture(autouse=True)
def _on():
    F.clear()
    F.enabled = True
    yield
    F.enabled = False
    F.clear()


def _same(a, b):
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_the_cast_is_reused_while_the_values_stay():
    F.clear()
    w = torch.nn.Parameter(_w(), requires_grad=True)
    first = F.fp8_weights(w)
    assert _same(first, F.per_block_cast_to_fp8(w))
    assert F.fp8_weights(w) is first
    assert F.fp8_weights(w.view(2, 256, 384)) is first  # a view of the same values
    assert F.cached_bytes() == 2 * 256 * 384 + 2 * 2 * 3 * 4


def test_an_in_place_write_or_a_new_storage_recasts():
    F.clear()
    w = torch.nn.Parameter(_w(1), requires_grad=True)
    first = F.fp8_weights(w)
    with torch.no_grad():
        w.mul_(3.0)  # the optimizer's step writes in place
    second = F.fp8_weights(w)
    assert second is not first and _same(second, F.per_block_cast_to_fp8(w))
    w.data = _w(2)  # a new storage, no version bump
    third = F.fp8_weights(w)
    assert third is not second and _same(third, F.per_block_cast_to_fp8(w))
    with torch.no_grad():
        w[1].copy_(_w(3)[1])  # a write through a view of one expert
    assert _same(F.fp8_weights(w), F.per_block_cast_to_fp8(w))


def test_views_of_one_base_are_kept_apart():
    F.clear()
    base = _w(4, G=4)
    a, b = F.fp8_weights(base[:2]), F.fp8_weights(base[2:])
    assert _same(a, F.per_block_cast_to_fp8(base[:2])) and _same(b, F.per_block_cast_to_fp8(base[2:]))
    assert F.fp8_weights(base[2:]) is b


def test_entries_go_with_the_weight_and_can_be_turned_off():
    F.clear()
    w = _w(5)
    F.fp8_weights(w)
    assert F.cached_bytes() > 0
    del w
    gc.collect()
    assert F.cached_bytes() == 0
    F.enabled = False
    w = _w(6)
    assert F.fp8_weights(w) is not F.fp8_weights(w) and F.cached_bytes() == 0


def test_inference_tensors_are_cast_every_time():
    F.clear()
    with torch.inference_mode():
        w = _w(7)
    assert _same(F.fp8_weights(w), F.per_block_cast_to_fp8(w)) and F.cached_bytes() == 0


def test_off_by_default_and_frozen_scopes_it():
    """Off unless asked for: a write through another tensor sharing the weight's memory (as
    Megatron's optimizers write parameters) moves neither its version nor its pointer."""
    F.enabled = False
    w = torch.nn.Parameter(_w(8), requires_grad=True)
    alias = w.data
    first = F.fp8_weights(w)
    with torch.no_grad():
        alias.mul_(2.0)  # invisible to w's version counter
    assert _same(F.fp8_weights(w), F.per_block_cast_to_fp8(w)) and F.cached_bytes() == 0
    with F.frozen():
        inside = F.fp8_weights(w)
        assert F.fp8_weights(w) is inside and F.cached_bytes() > 0
    assert not F.enabled and F.cached_bytes() == 0 and first is not inside
