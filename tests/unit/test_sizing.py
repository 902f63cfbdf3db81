"""The cuda backend's region sizing rule (megatron_ep.backends.cuda.region.merge_hints, the one owner of how
hints and call needs combine), on CPU: plan_region is plain C++ in the _protocol module."""

import random

from megatron_ep.core import protocol as P
from megatron_ep.backends.cuda.region import merge_hints

import cases
from case_lists import FUZZ_REGRESSIONS


def _row_bytes(h, key):
    return h.get("hidden", 0) * h.get(key, 2)


def test_a_narrow_wide_element_call_fits_a_wide_narrow_buffer():
    """Fuzz seed 800000 (R = 8): a 256-wide fp32 sync-free call on a buffer sized for 7168-wide
    bf16 rows needs no larger rows; the old rule asked for 7168 x 4 bytes and refused the call."""
    buffer = dict(num_ranks=8, max_tokens=64, hidden=7168, max_experts=256, max_topk=16, combine_rows=8192)
    c = cases.fuzz_config(800000, 8)
    assert 800000 in FUZZ_REGRESSIONS and (c["H"], c["dtype"]) == (256, "fp32")
    need = dict(max_tokens=max(c["Ts"]), hidden=c["H"], dtype_bytes=4, combine_bytes=4, max_topk=c["K"],
                max_experts=c["E"])
    have, merged = P.plan_region(buffer), P.plan_region(merge_hints(buffer, need))
    for key in ("x_row_bytes", "comb_row_bytes", "scale_cols", "max_tokens", "comb_rows"):
        assert getattr(merged, key) == getattr(have, key), key


def test_merged_hints_fit_each_of_them():
    """For random hint sets, the merged plan holds every set's rows, scales, tokens and top-k,
    and its rows are no wider than the widest set's row (rounded to 16 bytes) plus one element
    per channel of the widest hidden size."""
    rnd = random.Random(5)
    for _ in range(500):
        hints = [dict(num_ranks=4, max_tokens=rnd.randint(1, 512), hidden=rnd.choice([128, 256, 1000, 2048, 7168]),
                      dtype_bytes=rnd.choice([1, 2, 4]), combine_bytes=rnd.choice([2, 4]),
                      max_topk=rnd.randint(1, 16), max_experts=rnd.choice([8, 64, 256]))
                 for _ in range(rnd.randint(1, 4))]
        for h in hints:
            if rnd.random() < 0.3:
                del h["dtype_bytes"]  # RegionHints' default (2) applies
        plan = P.plan_region(merge_hints(*hints))
        H = max(h["hidden"] for h in hints)
        for h in hints:
            one = P.plan_region(h)
            for key in ("x_row_bytes", "comb_row_bytes", "scale_cols", "max_tokens", "max_topk", "max_experts"):
                assert getattr(plan, key) >= getattr(one, key), (key, hints)
        widest = max(_row_bytes(h, "dtype_bytes") for h in hints)
        assert plan.x_row_bytes <= (widest + H + 15) // 16 * 16, hints
