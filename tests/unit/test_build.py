"""The CUDA extension is built by setup (CI sets MEGATRON_EP_REQUIRE_EXTENSION=1) and imports, or, on a
machine without a GPU driver, fails to import for that reason only."""

import glob
import os

import pytest

import megatron_ep
from megatron_ep.core import envs, protocol
from megatron_ep.backends.cuda import extension as _ext

PKG = os.path.dirname(megatron_ep.__file__)


def test_extension_built_and_importable():
    built = glob.glob(os.path.join(PKG, "_C*.so"))
    if not envs.flag("MEGATRON_EP_REQUIRE_EXTENSION") and not built:
        pytest.skip("extension not built here (set MEGATRON_EP_REQUIRE_EXTENSION=1 to require it)")
    assert built, f"megatron_ep._C was not built under {PKG}"
    if _ext.available():
        mod = _ext.load()
        assert hasattr(mod, "Runtime") and hasattr(mod.intranode, "notify_call"), "extension lacks its kernel entry points"
        assert mod.NUM_SIG_FIELDS == len(protocol.SIG_FIELDS), "the extension and _protocol disagree on the signature"
    else:
        # acceptable only when the CUDA driver itself is missing
        assert "libcuda" in _ext.import_error(), _ext.import_error()


def test_protocol_module_plans_regions():
    """_protocol (no CUDA) is built everywhere; its plan places every section inside the region,
    in order, aligned, and the default combine area covers the expert-major worst case."""
    plan = protocol.plan_region(dict(num_ranks=8, max_tokens=4096, hidden=7168, max_topk=8, max_experts=256,
                                     max_alignment=128))
    names = ["control", "counts", "scratch", "stage_x", "stage_scales", "stage_idx", "stage_w", "stage_rpos",
             "stage_spos", "comb_x", "comb_w", "pool"]
    offs = [getattr(plan, n) for n in names]
    assert offs == sorted(offs) and offs[0] == 0 and all(o % 256 == 0 for o in offs)
    assert plan.pool + plan.pool_bytes <= plan.total
    worst = protocol.worst_expert_major_rows(8, 4096, 8, 256, 128)
    assert worst == 8 * 4096 * 8 + 32 * 127 and plan.comb_rows >= worst
    assert plan.comb_x + plan.comb_rows * plan.comb_row_bytes <= plan.comb_w
    # the Buffer first: ranks on different Buffers are told so, whatever else differs
    assert protocol.SIG_FIELDS[:3] == ["buffer", "op", "seq"] and protocol.SLOT["call"] == 0


def test_region_layout_is_typed_and_read_only():
    """plan_region returns a RegionLayout: every field of csrc/ipc/region_layout.h an attribute,
    none writable, none readable by key."""
    plan = protocol.plan_region(dict(num_ranks=2, max_tokens=16, hidden=256, max_topk=2, max_experts=4))
    assert type(plan).__name__ == "RegionLayout"
    assert len(protocol.REGION_LAYOUT_FIELDS) == 22 and all(isinstance(getattr(plan, f), int) for f in protocol.REGION_LAYOUT_FIELDS)
    assert f"total={plan.total}" in repr(plan)
    with pytest.raises(AttributeError):
        plan.total = 0
    with pytest.raises(TypeError):
        plan["total"]


def test_region_hints_have_one_owner():
    """The sizing hints and their defaults come from csrc/ipc/region_layout.h (RegionHints) through
    _protocol: planning with every default spelled out equals planning with none, and the cuda
    backend's default arguments are those defaults."""
    import inspect

    from megatron_ep.backends.cuda.backend import CudaBackend

    hints = dict(protocol.REGION_HINTS)
    assert {"max_tokens", "hidden", "dtype_bytes", "combine_bytes", "max_alignment"} <= set(hints)
    given = dict(hints, num_ranks=4, max_tokens=64, hidden=256)
    spelled, implied = protocol.plan_region(given), protocol.plan_region(dict(num_ranks=4, max_tokens=64, hidden=256))
    assert [getattr(spelled, f) for f in protocol.REGION_LAYOUT_FIELDS] == \
        [getattr(implied, f) for f in protocol.REGION_LAYOUT_FIELDS]
    params = inspect.signature(CudaBackend.__init__).parameters
    for name in ("dtype_bytes", "combine_bytes", "max_alignment"):
        assert params[name].default == hints[name], name
