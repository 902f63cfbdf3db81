"""megatron_ep.experts: every grouped GEMM backend against a per-row dense reference, forward and
backward (dgrad and wgrad), on the layouts the dispatch produces (empty experts, zero rows, pad
rows, aligned and unaligned segments), plus the low-latency (masked) and FP8 entry points.

DeepGEMM is not installed here: its glue (m_indices, re-laying segments to its 128-row
alignment, skipped -1 rows, dgrad/wgrad wiring) runs against `FakeDeepGemm`, an emulator of the
two contiguous kernels' documented contract, which also asserts the alignment DeepGEMM needs;
the masked glue (max_m padded to the 128-row tile, rows past masked_m zeroed, FP8 weights cast per
block, the shapes DeepGEMM refuses left to the fallback) runs against `FakeMaskedDeepGemm`, which
computes and stores whole tiles as DeepGEMM's SM90 masked kernels do.

GPU tests (-m gpu): the real kernels, DeepGEMM's when `deep_gemm` imports (optional, built by
the user: docs/megatron.md, "Experts"), including the masked GEMMs and
the decode experts captured in a CUDA graph; tests/cuda/test_cuda_low_latency.py has the whole decode
layer (LL dispatch -> masked GEMMs -> LL combine) in one graph.
"""

import pytest
import torch
import torch.nn.functional as F

import ll_cases
from deepgemm_cases import FakeDeepGemm
from refusals import derivative, exact_or_refused
import megatron_ep.experts as X
from megatron_ep.experts import backends as B
from megatron_ep.experts import masked as M
from megatron_ep.core.fp8 import per_token_cast_back, per_token_cast_to_fp8


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
    _check_linear("deepgemm", counts, align, torch.float32, mark_pad=True, tol=1e-4, H=64, N=128)  # fp32 sums over up to 256 rows
    if sum(counts):
        assert fake_deep_gemm.calls[:1] == ["nt"] and "nn" in fake_deep_gemm.calls


def test_deepgemm_uses_dispatch_alignment_without_relayout(fake_deep_gemm, monkeypatch):
    """A layout already aligned to 128 by the dispatch goes to DeepGEMM as is."""
    x, row_expert, layout = make_layout([100, 3], 128, 64, torch.float32, seed=1)
    monkeypatch.setattr(B, "_AlignedRows", None)  # would raise if the re-layout ran
    w = torch.randn((2, 64, 64))
    torch.testing.assert_close(X.grouped_linear(x, w, layout, "deepgemm").double(), dense_rows(x, w, row_expert), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K,N,fp8,why", [(7168, 2048, False, None), (2048, 7168, True, None), (16, 64, False, "K=16"),
                                          (64, 24, False, "N=24"), (192, 64, True, "K=192"), (128, 20, True, "N=20")])
def test_deepgemm_shape_rule(K, N, fp8, why):
    got = B.deep_gemm_shape_error(K, N, fp8)
    assert (got is None) if why is None else (why in got)


def test_deepgemm_refuses_shapes_it_cannot_take(fake_deep_gemm):
    """Asked for by name, DeepGEMM with a K or N its kernels cannot read raises naming the shape,
    before any GEMM (DeepGEMM itself would stop on an assertion inside its C++)."""
    x, _, layout = make_layout([5, 3], 128, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match="K=16 is not a multiple of 64"):
        X.grouped_linear(x, torch.randn((2, 64, 16)), layout, "deepgemm")
    x, _, layout = make_layout([5, 3], 128, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match="N=24 is not a multiple of 64"):
        X.grouped_linear(x, torch.randn((2, 24, 64)), layout, "deepgemm")
    x, _, layout = make_layout([5, 3], 128, 128, torch.float32, seed=2)
    with pytest.raises(ValueError, match="N=20 is not a multiple of 8"):
        X.grouped_linear_fp8(per_token_cast_to_fp8(x), torch.randn((2, 20, 128)), layout, backend="deepgemm")
    assert fake_deep_gemm.calls == []


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
    from megatron_ep.core.permute import attach_expert_rows

    attach_expert_rows(x, torch.tensor([0, 0, -1, -1, 1, 1], dtype=torch.int32), 2)
    lay = X.GroupedLayout.of(x, tpe)
    assert lay.alignment == 2 and lay.m_indices("cpu").tolist() == [0, 0, -1, -1, 1, 1]
    lay2 = X.GroupedLayout(tpe, 6)
    assert lay2.m_indices("cpu").tolist() == [0, 0, 0, 0, 1, 1]


def test_worst_case_tail_is_not_computed():
    """A worst-case sized dispatch: Megatron's segments fold the tail of pad rows into the last
    expert; the real segments ride along, the grouped_mm offsets stop there, the tail is 0."""
    from megatron_ep.core.permute import attach_expert_rows

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


# ----------------------------------------------------------------- DeepGEMM's masked kernels
class FakeMaskedDeepGemm:
    """DeepGEMM's two masked kernels as its SM90 code runs them (54e2261): [G, max_m] is addressed
    as G * max_m flat rows in BLOCK_M-row tiles from each group's start; a tile is computed when it
    starts below masked_m[g] and stored whole, so rows past masked_m get whatever the input holds
    there and a tile reaching past max_m lands in the next group's rows (groups run last to first,
    so such a spill is what stays). Asserts what the real entry points assert."""

    def __init__(self, block_m: int = 128):
        self.block_m, self.calls = block_m, []

    def _run(self, a, b, d, masked_m, expected_m):  # a [G, M, K], b [G, N, K], both fp32
        G, M_, K = a.shape
        N = b.shape[1]
        assert tuple(d.shape) == (G, M_, N) and d.dtype == torch.bfloat16 and d.is_contiguous()
        assert masked_m.dtype == torch.int32 and masked_m.is_contiguous() and masked_m.numel() == G
        assert isinstance(expected_m, int) and expected_m > 0
        fa, fd = a.reshape(G * M_, K), d.view(G * M_, N)
        for g in reversed(range(G)):
            for start in range(0, int(masked_m[g]), self.block_m):
                r0 = g * M_ + start
                r1 = min(r0 + self.block_m, G * M_)
                fd[r0:r1] = (fa[r0:r1] @ b[g].t()).to(d.dtype)

    def m_grouped_bf16_gemm_nt_masked(self, a, b, d, masked_m, expected_m):
        assert a.dtype == b.dtype == torch.bfloat16 and a.is_contiguous() and b.is_contiguous()
        assert a.shape[2] % 64 == 0, "the SM90 bf16 masked kernel asserts k % 64 == 0"
        self.calls.append("bf16")
        self._run(a.float(), b.float(), d, masked_m, expected_m)

    def m_grouped_fp8_gemm_nt_masked(self, a, b, d, masked_m, expected_m):
        (qa, sa), (qb, sb) = a, b
        G, M_, K = qa.shape
        N = qb.shape[1]
        assert qa.dtype == qb.dtype == torch.float8_e4m3fn and qa.is_contiguous() and qb.is_contiguous()
        assert sa.dtype == sb.dtype == torch.float32 and K % 128 == 0
        assert tuple(sa.shape) == (G, M_, K // 128) and tuple(sb.shape) == (G, -(-N // 128), K // 128)
        self.calls.append("fp8")
        fa = qa.float() * sa.repeat_interleave(128, -1)
        fb = qb.float() * sb.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N]
        self._run(fa, fb, d, masked_m, expected_m)


def masked_rows(masked_m, max_m, K, device="cpu", seed=0):
    """x [G, max_m, K] bf16 with NaN in every row past masked_m (the low-latency layout leaves
    them unspecified), masked_m int32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((len(masked_m), max_m, K), generator=g)
    for e, m in enumerate(masked_m):
        x[e, m:] = float("nan")
    return x.to(torch.bfloat16).to(device), torch.tensor(masked_m, dtype=torch.int32, device=device)


def masked_operands(masked_m, max_m, K, N, device="cpu", seed=0):
    x, mm = masked_rows(masked_m, max_m, K, device, seed)
    w = torch.randn((len(masked_m), N, K), generator=torch.Generator().manual_seed(seed + 1)) / K ** 0.5
    return x, w.to(torch.bfloat16).to(device), mm


def fp8_rows(x):
    """What FP8 low-latency dispatch delivers: per-token, per-128-channel casts of [G, max_m, K]."""
    G, max_m, K = x.shape
    q, s = per_token_cast_to_fp8(x.reshape(-1, K))
    return q.view(G, max_m, K), s.view(G, max_m, K // 128)


def masked_reference(x, w, masked_m):
    """fp64 y[g, :m] = x[g, :m] @ w[g]^T (an FP8 x cast back in fp32); NaN past masked_m."""
    if isinstance(x, tuple):
        x = per_token_cast_back(x[0], x[1], torch.float32)
    x, w = x.double().cpu(), w.double().cpu()
    y = torch.full((x.shape[0], x.shape[1], w.shape[1]), float("nan"), dtype=torch.float64)
    for g, m in enumerate(masked_m.tolist()):
        y[g, :m] = x[g, :m] @ w[g].t()
    return y


def check_masked(y, want, masked_m, tol, what):
    y = y.cpu()
    assert tuple(y.shape) == tuple(want.shape), f"{what}: shape {tuple(y.shape)}, want {tuple(want.shape)}"
    for g, m in enumerate(masked_m.tolist()):
        assert torch.all(y[g, m:] == 0), f"{what}: group {g} has non-zero rows past masked_m = {m}"
        torch.testing.assert_close(y[g, :m].double(), want[g, :m], rtol=tol, atol=tol,
                                   msg=lambda m_, g=g: f"{what}: group {g}: {m_}")


MASKED_GLUE_CASES = [
    # masked_m per group (zero, full, partial), max_m below, at and above the 128-row tile
    ([96, 40, 0], 96),
    ([0, 128, 5], 128),
    ([64, 1, 64], 64),
    ([130, 0, 200], 200),
]


@pytest.mark.parametrize("masked_m,max_m", MASKED_GLUE_CASES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_deep_gemm_masked_glue(fp8, masked_m, max_m):
    """Our call of DeepGEMM's masked GEMMs against the emulator of its kernels: max_m padded to
    the tile (no spill into the next group), rows past masked_m zero whatever the kernel and the
    input left there, FP8 weights cast per 128x128 block, bf16 out."""
    x, w, mm = masked_operands(masked_m, max_m, K=256, N=24, seed=max_m)
    xin = fp8_rows(x) if fp8 else x
    assert M.deep_gemm_takes_masked(xin, w)
    fake = FakeMaskedDeepGemm()
    y = M.deep_gemm_masked(fake, xin, w, mm, 7)
    assert fake.calls == ["fp8" if fp8 else "bf16"] and y.dtype == torch.bfloat16
    want = masked_reference(xin, ll_cases.block_cast_back(w) if fp8 else w, mm)
    check_masked(y, want, mm, 2e-2, "fp8" if fp8 else "bf16")
    if fp8:  # the weights' cast kept by the caller: used as given, the same result
        kept = M.per_block_cast_to_fp8(w)
        y2 = M.deep_gemm_masked(fake, xin, w, mm, 7, w_fp8=(kept[0], kept[1] * 2))
        check_masked(y2, masked_reference(xin, ll_cases.block_cast_back(w).double() * 2, mm), mm, 2e-2, "fp8 kept")


def test_decode_layer_keeps_and_refreshes_its_fp8_weights():
    """DecodeMoELayer(keep_fp8_weights=True) casts w1 once; refresh_fp8_weights() re-casts it into
    the same tensors (a captured graph reads those) after w1 changed."""
    import types

    from megatron_ep.experts.decode_layer import DecodeMoELayer

    w1, w2 = torch.randn(2, 256, 128).to(torch.bfloat16), torch.randn(2, 128, 128).to(torch.bfloat16)
    plain = DecodeMoELayer(types.SimpleNamespace(num_ranks=1), 2, w1.clone(), w2)
    assert plain.w1_fp8 is None
    layer = DecodeMoELayer(types.SimpleNamespace(num_ranks=1), 2, w1.clone(), w2, keep_fp8_weights=True)
    q, s = layer.w1_fp8
    want = M.per_block_cast_to_fp8(w1)
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1])
    layer.w1.data.mul_(0.5)  # as an optimizer writes: the kept cast is stale until refreshed
    assert torch.equal(layer.w1_fp8[1], want[1])
    layer.refresh_fp8_weights()
    assert layer.w1_fp8[0] is q and layer.w1_fp8[1] is s
    want = M.per_block_cast_to_fp8(w1 * 0.5)
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1])


def test_masked_kernel_tiles_spill_without_padding():
    """Why the glue pads max_m: fed [G, 96, K] directly, the emulated kernel's 128-row tile of the
    full group 0 lands on group 1's first 32 rows."""
    x, w, mm = masked_operands([96, 40, 0], 96, K=128, N=16)
    d = torch.zeros((3, 96, 16), dtype=torch.bfloat16)
    FakeMaskedDeepGemm().m_grouped_bf16_gemm_nt_masked(x, w, d, mm, 8)
    want = masked_reference(x, w, mm)
    assert not torch.allclose(d[1, :32].double(), want[1, :32], rtol=0.1, atol=0.1)
    torch.testing.assert_close(d[1, 32:40].double(), want[1, 32:40], rtol=2e-2, atol=2e-2)


def test_deep_gemm_takes_masked_shapes(monkeypatch):
    """Shapes DeepGEMM's masked kernels refuse go to the fallback instead of its asserts; CPU
    tensors never reach it."""
    x, w, mm = masked_operands([3, 0], 8, K=192, N=16)
    assert M.deep_gemm_takes_masked(x, w)
    assert not M.deep_gemm_takes_masked(x.float(), w.float())  # bf16 only
    assert not M.deep_gemm_takes_masked(x[..., :160].contiguous(), w[..., :160].contiguous())  # bf16: K % 64
    assert not M.deep_gemm_takes_masked(x, w[:, :12])  # N % 8 (16-byte output rows)
    assert not M.deep_gemm_takes_masked(x[:1], w)  # groups differ
    xq, wq = fp8_rows(x[..., :128].contiguous()), w[..., :128]
    assert M.deep_gemm_takes_masked(xq, wq)
    assert not M.deep_gemm_takes_masked((xq[0], xq[1][:, :4]), wq)  # scales do not match the rows
    q192 = torch.zeros((2, 8, 192)).to(torch.float8_e4m3fn)
    assert not M.deep_gemm_takes_masked((q192, torch.ones((2, 8, 1))), w)  # FP8: K % 128
    fake = FakeMaskedDeepGemm()
    monkeypatch.setattr(B, "_deep_gemm", fake)
    monkeypatch.setattr(B, "_deep_gemm_checked", True)
    y = X.grouped_linear_masked(x.float(), w.float(), mm)
    assert fake.calls == [] and torch.all(y[0, 3:] == 0) and torch.all(y[1] == 0)


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
    assert X.choose_backend(torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda"), n=128) == want
    # shapes DeepGEMM's kernels cannot read go to grouped_mm, whether DeepGEMM is there or not
    assert X.choose_backend(torch.zeros(2, 16, dtype=torch.bfloat16, device="cuda"), n=128) == "grouped_mm"
    assert X.choose_backend(torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda"), n=24) == "grouped_mm"


def _masked_gemms():
    no_gpu = not torch.cuda.is_available()
    return [pytest.param("torch", marks=pytest.mark.skipif(no_gpu, reason="needs a GPU")),
            pytest.param("deepgemm", marks=pytest.mark.skipif(no_gpu or B.deep_gemm_module() is None, reason=(
                "needs a GPU and deep_gemm importable (optional: docs/megatron.md, 'Experts')")))]


@pytest.mark.gpu
@pytest.mark.parametrize("masked_m,max_m", [([0, 128, 37, 1], 128), ([96, 0, 96, 50], 96)])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("gemm", _masked_gemms())
def test_grouped_linear_masked_cuda(gemm, fp8, masked_m, max_m):
    """The masked GEMMs on the GPU through our glue (DeepGEMM's kernels, or the torch fallback):
    zero, full and partial groups, NaN in every row past masked_m, max_m at and not at a multiple
    of DeepGEMM's 128-row tile. Against the fp64 reference on the operands each path multiplies
    (DeepGEMM, FP8 inputs: the weights cast to FP8 per 128x128 block), and DeepGEMM against the
    fallback (FP8: up to the weights' FP8 rounding)."""
    x, w, mm = masked_operands(masked_m, max_m, K=512, N=512, device="cuda", seed=max_m)
    xin = fp8_rows(x) if fp8 else x
    kind = "fp8" if fp8 else "bf16"
    with ll_cases.masked_gemm(gemm) as spy:
        y = X.grouped_linear_masked(xin, w, mm, expected_m=64)
    torch.cuda.synchronize()
    if spy is not None:
        assert spy.calls == [f"m_grouped_{kind}_gemm_nt_masked"]
    assert y.dtype == torch.bfloat16
    w_seen = ll_cases.block_cast_back(w.cpu()) if fp8 and gemm == "deepgemm" else w
    want = masked_reference(xin, w_seen, mm)
    if fp8 and gemm == "deepgemm":
        # Hopper's FP8 MMA accumulates with a short mantissa between DeepGEMM's fp32 promotions
        # (every 128 channels): measured 0.2% of the entries off by up to 0.05 at K = 512. The
        # check is DeepGEMM's own (1 - cosine-like similarity < 1e-3 per group), and 0.1 apart at most.
        check_masked(y, want, mm, 0.1, f"{gemm} {kind}")
        for g, m in enumerate(mm.tolist()):
            a_, b_ = y[g, :m].double().cpu(), want[g, :m]
            diff = (1 - 2 * (a_ * b_).sum() / (a_ * a_ + b_ * b_).sum()).item() if m else 0.0
            assert diff < 1e-3, f"{gemm} {kind}: group {g}: DeepGEMM's similarity check gives {diff:.3g}"
    else:
        check_masked(y, want, mm, 2e-2, f"{gemm} {kind}")
    if gemm == "deepgemm":
        with ll_cases.masked_gemm("torch"):
            y_torch = X.grouped_linear_masked(xin, w, mm)
        rel = ((y.double() - y_torch.double()).norm() / y_torch.double().norm()).item()
        assert rel < (0.05 if fp8 else 1e-2), f"DeepGEMM vs the torch fallback ({kind}): relative difference {rel:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", _masked_gemms())
def test_masked_expert_mlp_cuda_graph(gemm):
    """The decode experts alone (FP8 fc1 -> SwiGLU -> bf16 fc2 over the masked layout) captured in
    one CUDA graph after one eager call (DeepGEMM compiles its kernels at the first call), then
    replayed on new rows and new masked_m (read on the device, so one capture serves every step):
    each replay against the eager call on the same inputs and the fp64 reference, zero past
    masked_m."""
    G, max_m, H, Fh = 4, 128, 512, 256
    g = torch.Generator().manual_seed(5)
    w1 = (torch.randn((G, 2 * Fh, H), generator=g) / H ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn((G, H, Fh), generator=g) / Fh ** 0.5).to(torch.bfloat16).cuda()
    steps = [[0, 128, 37, 1], [128, 128, 128, 128], [5, 0, 0, 77], [0, 0, 0, 0]]

    def inputs(i):
        x, mm = masked_rows(steps[i], max_m, H, "cuda", seed=100 + i)
        return fp8_rows(x), mm

    (q, s), mm = inputs(0)

    def mlp():
        return X.expert_mlp_masked((q, s), w1, w2, mm, F.silu, glu=True, expected_m=64)

    with ll_cases.masked_gemm(gemm) as spy:
        mlp()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mlp()
        fc1 = ll_cases.block_cast_back(w1.cpu()) if gemm == "deepgemm" else w1.cpu().float()
        for i, masked in enumerate(steps):
            (qi, si), mmi = inputs(i)
            q.copy_(qi)
            s.copy_(si)
            mm.copy_(mmi)
            graph.replay()
            eager = mlp()
            torch.cuda.synchronize()
            xq = per_token_cast_back(qi, si, torch.float32).cpu().double()
            want = torch.full((G, max_m, H), float("nan"), dtype=torch.float64)
            for e, m in enumerate(masked):
                a, b = (xq[e, :m] @ fc1[e].double().t()).chunk(2, dim=-1)
                want[e, :m] = (F.silu(a) * b) @ w2[e].cpu().double().t()
            scale = max(1.0, want.nan_to_num().abs().max().item())
            check_masked(y, want, mmi, 3e-2 * scale, f"{gemm} replay {i} vs reference")
            check_masked(y, eager.double().cpu(), mmi, 1e-2 * scale, f"{gemm} replay {i} vs eager")
    if spy is not None:
        assert set(ll_cases.MASKED_GEMMS) <= set(spy.calls), spy.calls


def test_sms_left_free_sets_and_restores(monkeypatch):
    """The carveout (torch's and DeepGEMM's SM count) holds inside and is restored after, also
    when the body raises; 0 changes nothing."""

    class SmCounter:
        def __init__(self):
            self.n = 132

        def get_num_sms(self):
            return self.n

        def set_num_sms(self, n):
            self.n = n

    fake = SmCounter()
    monkeypatch.setattr(B, "_deep_gemm", fake)
    monkeypatch.setattr(B, "_deep_gemm_checked", True)
    before = torch._C._get_sm_carveout_experimental()
    with B.sms_left_free(0):
        assert torch._C._get_sm_carveout_experimental() == before and fake.n == 132
    with B.sms_left_free(12):
        assert torch._C._get_sm_carveout_experimental() == 12 and fake.n == 120
    assert torch._C._get_sm_carveout_experimental() == before and fake.n == 132
    with pytest.raises(RuntimeError, match="inside"):
        with B.sms_left_free(8):
            raise RuntimeError("inside")
    assert torch._C._get_sm_carveout_experimental() == before and fake.n == 132



@pytest.mark.parametrize("R", [2])
def test_fp8_dispatch_into_deepgemm_glue(pools, R):
    """The FP8 dispatch -> DeepGEMM FP8 contiguous case of tests/unit/test_deepgemm.py on the torch
    backend against the emulator (the glue, the routing checks and the case itself on CPU)."""
    import deepgemm_cases as dc

    errors = [e for rank in pools(R).run(dc.run_fp8_dispatch_into_deepgemm_cases, dc.fp8_cases(R), backend="torch",
                                         device="cpu") for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("R", [2])
def test_chunked_experts_on_deepgemm_glue(pools, R):
    """The chunked-experts-on-DeepGEMM case of tests/unit/test_deepgemm.py on the torch backend
    against the emulator (SM count lowered by comm_sms inside the GEMMs, restored after)."""
    import deepgemm_cases as dc

    errors = [e for rank in pools(R).run(dc.run_chunked_on_deepgemm_cases, dc.chunked_cases(R), backend="torch",
                                         device="cpu") for e in rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("backend", ["grouped_mm", "deepgemm"])
def test_grouped_linear_second_derivative_exact_or_refused(fake_deep_gemm, backend):
    """A second derivative through grouped_linear (squared, so the output gradient depends on the
    inputs too) equals the loop backend's (plain matmuls: exact) or raises naming the backend,
    by autograd.grad(..., inputs) and by .backward(), for x, w and both. DeepGEMM's dgrad is a
    kernel autograd does not see (FakeDeepGemm's writes carry no history either)."""
    x, _, layout = make_layout([130, 2, 0], 8, 64, torch.float32, seed=11)  # grouped_mm takes no fp64
    w = torch.randn((3, 128, 64), generator=torch.Generator().manual_seed(12)) / 8
    grad = torch.randn((x.shape[0], 128), generator=torch.Generator().manual_seed(13))

    def layer(name):
        return lambda x, w: X.grouped_linear(x, w, layout, name) ** 2

    errors = []
    for wanted in ([True, False], [False, True], [True, True]):
        for how in ("grad", "backward"):
            want = derivative(layer("loop"), [x, w], wanted, grad, how)
            got = derivative(layer(backend), [x, w], wanted, grad, how)
            errors += exact_or_refused(f"{backend} {wanted} {how}", got, want, (backend, "second derivatives"), tol=1e-4)
    assert not errors, "\n".join(errors)
    if backend == "deepgemm":
        assert "nn" in fake_deep_gemm.calls  # its own dgrad ran


def test_grouped_linear_fp8_on_deepgemm_refuses_w_gradient(fake_deep_gemm):
    """DeepGEMM's FP8 GEMM is forward only: a gradient of w through it raises naming
    grouped_linear_fp8 (the fallback's is exact), by autograd.grad and by .backward()."""
    H, N = 128, 16
    x, _, layout = make_layout([3, 0, 5], 128, H, torch.float32, seed=14)
    xq = per_token_cast_to_fp8(x)
    w = torch.randn((3, N, H), generator=torch.Generator().manual_seed(15)) / 8
    grad = torch.randn((x.shape[0], N), generator=torch.Generator().manual_seed(16))
    errors = []
    for how in ("grad", "backward"):
        want = derivative(lambda w: X.grouped_linear_fp8(xq, w, layout, backend="loop"), [w], [True], grad, how, order=1)
        got = derivative(lambda w: X.grouped_linear_fp8(xq, w, layout, backend="deepgemm"), [w], [True], grad, how,
                         order=1)
        errors += exact_or_refused(f"fp8 {how}", got, want, ("grouped_linear_fp8", "gradient to w"), tol=1e-3)
    assert not errors, "\n".join(errors)
    assert "fp8 nt" in fake_deep_gemm.calls
