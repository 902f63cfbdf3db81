"""megatron_ep.experts: every grouped GEMM backend against a per-row dense reference, forward and
backward (dgrad and wgrad), on the layouts the dispatch produces (empty experts, zero rows, pad
rows, aligned and unaligned segments), plus the low-latency (masked) and FP8 entry points.

DeepGEMM is not installed here: its glue (m_indices, re-laying segments to its 128-row
alignment, skipped -1 rows, dgrad/wgrad wiring) runs against `FakeDeepGemm`, an emulator of the
two contiguous kernels' documented contract, which also asserts the alignment DeepGEMM needs.
"""

import pytest
import torch
import torch.nn.functional as F

import megatron_ep.experts as X
from megatron_ep.experts import backends as B
from megatron_ep.fp8 import per_token_cast_back, per_token_cast_to_fp8


class FakeDeepGemm:
    """d[i] = a[i] @ b[m[i]]^T (nt) or a[i] @ b[m[i]] (nn) for m[i] >= 0; rows with m[i] = -1
    are left untouched; every 128-row block must belong to one expert (or be all -1)."""

    ALIGN = 128

    def __init__(self):
        self.calls = []

    def get_mk_alignment_for_contiguous_layout(self):
        return self.ALIGN

    def _check(self, a, m):
        assert a.shape[0] % self.ALIGN == 0, f"M={a.shape[0]} is not a multiple of {self.ALIGN}"
        for blk in m.view(-1, self.ALIGN):
            ids = set(blk.tolist()) - {-1}
            assert len(ids) <= 1, f"a {self.ALIGN}-row block mixes experts {sorted(ids)}"

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, m_indices):
        self._check(a, m_indices)
        self.calls.append("nt")
        for i in (m_indices >= 0).nonzero().flatten().tolist():
            d[i] = a[i] @ b[int(m_indices[i])].t()

    def m_grouped_bf16_gemm_nn_contiguous(self, a, b, d, m_indices):
        self._check(a, m_indices)
        self.calls.append("nn")
        for i in (m_indices >= 0).nonzero().flatten().tolist():
            d[i] = a[i] @ b[int(m_indices[i])]


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    fake = FakeDeepGemm()
    monkeypatch.setattr(B, "_deep_gemm", fake)
    monkeypatch.setattr(B, "_deep_gemm_checked", True)
    return fake


def make_layout(counts, align, H, dtype, seed, mark_pad=True):
    """Expert-major rows as the hybridep dispatch delivers them: each segment padded with zero
    rows to `align`; row_expert -1 on those pad rows."""
    g = torch.Generator().manual_seed(seed)
    padded = [-(-c // align) * align for c in counts]
    xs, re = [], []
    for e, (c, p) in enumerate(zip(counts, padded)):
        xs.append(torch.randn((c, H), generator=g))
        xs.append(torch.zeros((p - c, H)))
        re += [e] * c + [-1] * (p - c)
    x = torch.cat(xs).to(dtype)
    row_expert = torch.tensor(re, dtype=torch.int32)
    layout = X.GroupedLayout(torch.tensor(padded), x.shape[0], row_expert if mark_pad else None, align if mark_pad else 1)
    return x, row_expert, layout


def dense_rows(x, w, row_expert):
    """Reference: y[i] = x[i] @ w[e_i]^T in fp64, 0 on pad rows."""
    y = torch.zeros((x.shape[0], w.shape[1]), dtype=torch.float64)
    for i, e in enumerate(row_expert.tolist()):
        if e >= 0:
            y[i] = x[i].double() @ w[e].double().t()
    return y


LAYOUTS = [
    # counts per expert, alignment
    ([5, 0, 7], 1),
    ([3, 9, 0, 1], 16),
    ([0, 0], 1),
    ([130, 2, 0], 8),
    ([128, 256], 128),
]


def _check_linear(backend, counts, align, dtype, mark_pad, tol, device="cpu", H=16, N=24):
    x, row_expert, layout = make_layout(counts, align, H, dtype, seed=sum(counts) + align)
    if not mark_pad:
        layout = X.GroupedLayout(layout.tokens_per_expert, layout.num_rows)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn((len(counts), N, H), generator=g) / 4).to(dtype)
    gy = torch.randn((x.shape[0], N), generator=g).to(dtype) * (row_expert >= 0).unsqueeze(1)
    xd, wd = x.to(device).requires_grad_(True), w.to(device).requires_grad_(True)
    y = X.grouped_linear(xd, wd, layout, backend)
    y.backward(gy.to(device))
    y, gx, gw = y.cpu(), xd.grad.cpu(), wd.grad.cpu()
    want = dense_rows(x, w, row_expert)
    assert y.dtype == dtype and y.shape == want.shape
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    # dgrad / wgrad from the definition: dx[i] = gy[i] @ w[e_i], dw[e] = sum_i gy[i]^T x[i]
    dx = torch.zeros((x.shape[0], H), dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    for i, e in enumerate(row_expert.tolist()):
        if e >= 0:
            dx[i] = gy[i].double() @ w[e].double()
            dw[e] += torch.outer(gy[i].double(), x[i].double())
    torch.testing.assert_close(gx.double(), dx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw.double(), dw, rtol=tol, atol=tol)


@pytest.mark.parametrize("counts,align", LAYOUTS)
@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_grouped_linear(backend, counts, align):
    _check_linear(backend, counts, align, torch.float32, mark_pad=True, tol=1e-5)
    _check_linear(backend, counts, align, torch.float32, mark_pad=False, tol=1e-5)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_grouped_linear_bf16(backend):
    _check_linear(backend, [5, 0, 20], 8, torch.bfloat16, mark_pad=True, tol=5e-2)


@pytest.mark.parametrize("counts,align", LAYOUTS)
def test_grouped_linear_deepgemm_glue(fake_deep_gemm, counts, align):
    _check_linear("deepgemm", counts, align, torch.float32, mark_pad=True, tol=1e-5)
    if sum(counts):
        assert fake_deep_gemm.calls[:1] == ["nt"] and "nn" in fake_deep_gemm.calls


def test_deepgemm_uses_dispatch_alignment_without_relayout(fake_deep_gemm, monkeypatch):
    """A layout already aligned to 128 by the dispatch goes to DeepGEMM as is."""
    x, row_expert, layout = make_layout([100, 3], 128, 16, torch.float32, seed=1)
    monkeypatch.setattr(B, "_AlignedRows", None)  # would raise if the re-layout ran
    w = torch.randn((2, 8, 16))
    torch.testing.assert_close(X.grouped_linear(x, w, layout, "deepgemm").double(), dense_rows(x, w, row_expert), rtol=1e-5, atol=1e-5)


def test_auto_backend_on_cpu_is_loop(monkeypatch):
    monkeypatch.delenv("MEGATRON_EP_GEMM_BACKEND", raising=False)
    assert X.choose_backend(torch.zeros(2, 2, dtype=torch.bfloat16)) == "loop"
    monkeypatch.setenv("MEGATRON_EP_GEMM_BACKEND", "grouped_mm")
    assert X.choose_backend(torch.zeros(2, 2)) == "grouped_mm"


def _dense_mlp(x, probs, w1, w2, row_expert, act, glu):
    y = torch.zeros_like(x, dtype=torch.float64)
    for i, e in enumerate(row_expert.tolist()):
        if e < 0:
            continue
        h = x[i].double() @ w1[e].double().t()
        if glu:
            a, b = h.chunk(2)
            h = act(a) * b
        else:
            h = act(h)
        y[i] = (h * probs[i].double()) @ w2[e].double().t()
    return y


@pytest.mark.parametrize("glu,act", [(False, F.gelu), (True, F.silu)])
@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_expert_mlp_forward_backward(backend, glu, act):
    H, Fh = 16, 8
    counts, align = [6, 0, 11, 2], 4
    x, row_expert, layout = make_layout(counts, align, H, torch.float32, seed=7)
    g = torch.Generator().manual_seed(11)
    G = len(counts)
    w1 = (torch.randn((G, 2 * Fh if glu else Fh, H), generator=g) / 4).requires_grad_(True)
    w2 = (torch.randn((G, H, Fh), generator=g) / 4).requires_grad_(True)
    probs = (torch.rand(x.shape[0], generator=g) * (row_expert >= 0)).requires_grad_(True)
    x.requires_grad_(True)
    gy = torch.randn((x.shape[0], H), generator=g)
    y = X.expert_mlp(x, probs, w1, w2, layout, act, glu, backend)
    y.backward(gy)

    leaves = [t.detach().double().requires_grad_(True) for t in (x, probs, w1, w2)]
    want = _dense_mlp(*leaves, row_expert, act, glu)
    want.backward(gy.double() * (row_expert >= 0).unsqueeze(1))
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    for name, got, ref in zip(("x", "probs", "w1", "w2"), (x, probs, w1, w2), leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-5, atol=1e-5, msg=f"grad {name}")
    # pad rows contribute nothing: no output there, no gradient to their inputs
    pad = row_expert < 0
    assert pad.any() and torch.all(y[pad] == 0) and torch.all(x.grad[pad] == 0)


def test_grouped_linear_masked_and_mlp():
    g = torch.Generator().manual_seed(2)
    G, max_m, H, N = 3, 10, 128, 16
    masked_m = torch.tensor([4, 0, 10], dtype=torch.int32)
    x = torch.randn((G, max_m, H), generator=g)
    x[0, 4:] = float("nan")  # rows past masked_m are unspecified in the low-latency layout
    w = torch.randn((G, N, H), generator=g) / 8
    y = X.grouped_linear_masked(x, w, masked_m)
    for e in range(G):
        m = int(masked_m[e])
        torch.testing.assert_close(y[e, :m], x[e, :m] @ w[e].t())
        assert torch.all(y[e, m:] == 0)
    # FP8 input (what low-latency dispatch delivers): cast back, same rows
    xf = torch.nan_to_num(x)
    q, s = per_token_cast_to_fp8(xf.view(-1, H))
    yq = X.grouped_linear_masked((q.view(G, max_m, H), s.view(G, max_m, -1)), w, masked_m)
    deq = per_token_cast_back(q, s, torch.float32).view(G, max_m, H)
    for e in range(G):
        m = int(masked_m[e])
        torch.testing.assert_close(yq[e, :m], deq[e, :m] @ w[e].t())
    w1 = torch.randn((G, 2 * N, H), generator=g) / 8
    w2 = torch.randn((G, H, N), generator=g) / 8
    out = X.expert_mlp_masked(xf, w1, w2, masked_m, F.silu, glu=True)
    for e in range(G):
        m = int(masked_m[e])
        a, b = (xf[e, :m] @ w1[e].t()).chunk(2, dim=-1)
        torch.testing.assert_close(out[e, :m], (F.silu(a) * b) @ w2[e].t(), rtol=1e-5, atol=1e-5)
        assert torch.all(out[e, m:] == 0)


def test_grouped_linear_fp8_contiguous():
    H, N = 256, 16
    x, row_expert, layout = make_layout([3, 0, 5], 4, H, torch.float32, seed=4)
    q, s = per_token_cast_to_fp8(x)
    w = torch.randn((3, N, H)) / 8
    y = X.grouped_linear_fp8((q, s), w, layout)
    torch.testing.assert_close(y.double(), dense_rows(per_token_cast_back(q, s, torch.float32), w, row_expert), rtol=1e-5, atol=1e-5)


def test_per_block_cast_to_fp8_roundtrip():
    w = torch.randn((2, 200, 130))
    q, s = X.per_block_cast_to_fp8(w)
    assert q.shape == w.shape and s.shape == (2, 2, 2)
    back = q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :130]
    torch.testing.assert_close(back, w, rtol=0.07, atol=1e-3)


def test_layout_of_picks_up_dispatch_tags():
    x = torch.zeros(6, 4)
    tpe = torch.tensor([4, 2])
    assert X.GroupedLayout.of(x, tpe).row_expert is None
    from megatron_ep.permute import attach_expert_rows

    attach_expert_rows(x, torch.tensor([0, 0, -1, -1, 1, 1], dtype=torch.int32), 2)
    lay = X.GroupedLayout.of(x, tpe)
    assert lay.alignment == 2 and lay.m_indices("cpu").tolist() == [0, 0, -1, -1, 1, 1]
    lay2 = X.GroupedLayout(tpe, 6)
    assert lay2.m_indices("cpu").tolist() == [0, 0, 0, 0, 1, 1]


def test_worst_case_tail_is_not_computed():
    """A worst-case sized dispatch: Megatron's segments fold the tail of pad rows into the last
    expert; the real segments ride along, the grouped_mm offsets stop there, the tail is 0."""
    from megatron_ep.permute import attach_expert_rows

    x = torch.randn(8, 4)
    megatron_tpe, real_tpe = torch.tensor([2, 6]), torch.tensor([2, 2])
    x[4:] = 0
    attach_expert_rows(x, torch.tensor([0, 0, 1, 1, -1, -1, -1, -1], dtype=torch.int32), 1, real_tpe)
    lay = X.GroupedLayout.of(x, megatron_tpe)
    assert lay.offsets("cpu").tolist() == [2, 4]  # grouped_mm skips rows 4..7
    assert lay.tokens_per_expert.tolist() == [2, 6]  # what Megatron handed us is unchanged
    w = torch.randn(2, 3, 4)
    y = X.grouped_linear(x, w, lay, backend="loop")
    torch.testing.assert_close(y[:2], x[:2] @ w[0].t())
    torch.testing.assert_close(y[2:4], x[2:4] @ w[1].t())
    assert y[4:].abs().sum() == 0


# ------------------------------------------------------------------------------- GPU (H200)
def _gpu_backends():
    out = [pytest.param("grouped_mm", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper or newer"))]
    out.append(pytest.param("deepgemm", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or B.deep_gemm_module() is None, reason="needs a GPU and deep_gemm built from source")))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("counts,align", [([130, 0, 7, 64], 8), ([128, 256, 0], 128), ([3, 1], 1)])
@pytest.mark.parametrize("backend", _gpu_backends())
def test_grouped_linear_cuda_bf16(backend, counts, align):
    """The real kernels (torch grouped_mm on Hopper; DeepGEMM when built) at GEMM-friendly sizes,
    forward, dgrad and wgrad against the fp64 per-row reference."""
    _check_linear(backend, counts, align, torch.bfloat16, mark_pad=True, tol=5e-2, device="cuda", H=256, N=512)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper or newer")
def test_auto_backend_on_hopper_is_grouped(monkeypatch):
    monkeypatch.delenv("MEGATRON_EP_GEMM_BACKEND", raising=False)
    want = "deepgemm" if B.deep_gemm_module() is not None else "grouped_mm"
    assert X.choose_backend(torch.zeros(2, 2, dtype=torch.bfloat16, device="cuda")) == want
