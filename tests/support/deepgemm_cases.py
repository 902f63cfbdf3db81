"""Worker bodies (every rank of a DistPool, cuda backend, real deep_gemm) for DeepGEMM fed by our
dispatch: the FP8 rows and scales of an expert-major dispatch go into DeepGEMM's FP8 contiguous
GEMM as they arrive, and the chunked experts run on DeepGEMM with SMs left to the communication
kernels. Each returns a list of error strings (empty = pass)."""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ll_cases
from cases import get_buffer
from megatron_ep.core import autograd
from megatron_ep.experts import GroupedLayout, backends as B, chunked_expert_mlp, expert_mlp, grouped_linear_fp8
from megatron_ep.core.fp8 import per_token_cast_back, per_token_cast_to_fp8

# The cases' token counts reach 300 on a rank: more than the suite's shared cuda buffer is sized for
# (tests/support/cases.py CUDA_SIZING), so these cases share a buffer of their own.
MAX_TOKENS = 320


class FakeDeepGemm:
    """CPU emulator of the DeepGEMM kernels our glue calls, per their documented contract:
    d[i] = a[i] @ b[m[i]]^T (nt) or a[i] @ b[m[i]] (nn) for m[i] >= 0, FP8 operands multiplied
    back out per block; rows with m[i] = -1 are left untouched; every 128-row block must belong to
    one expert (or be all -1); K a multiple of 64 (bf16) or 128 (FP8). Records "nt" / "nn" /
    "fp8 nt" calls; an SM count to set and read. Like the kernels, its writes into d carry no
    autograd history, whatever requires grad."""

    ALIGN = 128

    def __init__(self):
        self.calls = []
        self.num_sms = 132

    def get_mk_alignment_for_contiguous_layout(self):
        return self.ALIGN

    def get_num_sms(self):
        return self.num_sms

    def set_num_sms(self, n):
        self.num_sms = n

    def _check(self, a, m, k_step=64):
        assert a.shape[0] % self.ALIGN == 0, f"M={a.shape[0]} is not a multiple of {self.ALIGN}"
        assert a.shape[1] % k_step == 0, f"k % {k_step} == 0"  # DeepGEMM's Hopper kernels assert it
        for blk in m.view(-1, self.ALIGN):
            ids = set(blk.tolist()) - {-1}
            assert len(ids) <= 1, f"a {self.ALIGN}-row block mixes experts {sorted(ids)}"

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, m_indices):
        self._check(a, m_indices)
        self.calls.append("nt")
        with torch.no_grad():
            for i in (m_indices >= 0).nonzero().flatten().tolist():
                d[i] = a[i] @ b[int(m_indices[i])].t()

    def m_grouped_bf16_gemm_nn_contiguous(self, a, b, d, m_indices):
        self._check(a, m_indices)
        self.calls.append("nn")
        with torch.no_grad():
            for i in (m_indices >= 0).nonzero().flatten().tolist():
                d[i] = a[i] @ b[int(m_indices[i])]

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, m_indices):
        (q, s), (wq, ws) = a, b
        self._check(q, m_indices, k_step=128)
        assert s.shape == (q.shape[0], q.shape[1] // 128) and ws.shape[1:] == (-(-wq.shape[1] // 128), wq.shape[2] // 128)
        self.calls.append("fp8 nt")
        x = per_token_cast_back(q, s, torch.float32)
        w = (wq.float() * ws.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :wq.shape[1], :wq.shape[2]])
        with torch.no_grad():
            for i in (m_indices >= 0).nonzero().flatten().tolist():
                d[i] = (x[i] @ w[int(m_indices[i])].t()).to(d.dtype)


@contextlib.contextmanager
def deep_gemm_for(device: str):
    """The DeepGEMM our glue sees in this process inside the block: the real one on a GPU, the
    emulator on the CPU (restored after)."""
    if device != "cpu":
        yield
        return
    saved = (B._deep_gemm, B._deep_gemm_checked)
    B._deep_gemm, B._deep_gemm_checked = FakeDeepGemm(), True
    try:
        yield
    finally:
        B._deep_gemm, B._deep_gemm_checked = saved


def _sync(device: str):
    if device != "cpu":
        torch.cuda.synchronize()


def _on_deepgemm(body, cfg: dict, backend: str, device: str, tag: str) -> list:
    """A case's errors: body(cfg, backend, device, tag, R, rank, dg, align) with the DeepGEMM
    `device` calls for (deep_gemm_for) and its M alignment; a deep_gemm that does not import, or a
    raise, is the case's error."""
    try:
        with deep_gemm_for(device):
            dg = B.deep_gemm_module()
            if dg is None:
                return [f"{tag} deep_gemm does not import in this rank's process"]
            return body(cfg, backend, device, tag, dist.get_world_size(), dist.get_rank(), dg,
                        B.deep_gemm_alignment(dg))
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def _routing(cfg: dict, T: int, g: torch.Generator) -> torch.Tensor:
    E, K = cfg["E"], cfg["K"]
    if cfg.get("pattern") == "hot":  # every token's first slot on expert 0, the rest unused
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = 0
        return idx
    idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
    return torch.where(torch.rand((T, K), generator=g) < cfg.get("p_drop", 0.0), -1, idx)


def _similarity_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """DeepGEMM's own test measure: 1 - 2<a,b> / (|a|^2 + |b|^2), 0 for equal tensors."""
    a, b = a.double(), b.double()
    den = (a * a + b * b).sum().item()
    return 0.0 if den == 0 else 1 - 2 * (a * b).sum().item() / den


def run_fp8_dispatch_into_deepgemm(cfg: dict, backend: str = "cuda", device: str = "cuda") -> list:
    """FP8 dispatch (e4m3 rows + per-128 fp32 scales, expert-major, segments aligned to DeepGEMM's
    M alignment) -> DeepGEMM's m_grouped_fp8_gemm_nt_contiguous, with the dispatch's own tensors
    (no re-quantization, no copy of ours: the GEMM is handed the very storage the dispatch wrote).
    Checked per row against fp64 on the received operands (DeepGEMM's similarity measure per
    expert and a bound on every entry), pad rows exactly 0, and each expert's column sums against
    the tokens its senders routed to it (nothing lost or duplicated on the way)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[fp8 dispatch -> DeepGEMM R={R} rank={rank} seed={cfg['seed']} {backend}]"
    return _on_deepgemm(_fp8_dispatch_into_deepgemm, cfg, backend, device, tag)


def _fp8_dispatch_into_deepgemm(cfg, backend, device, tag, R, rank, dg, align) -> list:
    E, H, N = cfg["E"], cfg["H"], cfg["N"]
    L = E // R
    T = cfg["Ts"][rank]
    g = torch.Generator().manual_seed(cfg["seed"] + rank)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    idx = _routing(cfg, T, g)
    w_all = torch.randn((E, N, H), generator=torch.Generator().manual_seed(cfg["seed"] + 99)) / H ** 0.5
    w = w_all[rank * L:(rank + 1) * L].to(torch.bfloat16).to(device)
    q, s = per_token_cast_to_fp8(x.to(device))
    buf = get_buffer(backend, max_tokens_per_rank=MAX_TOKENS)
    out = buf.dispatch((q, s), idx.to(device), num_experts=E, permute=True, expert_alignment=align)
    rq, rs = out.x
    M = rq.shape[0]
    layout = GroupedLayout(out.tokens_per_expert, M, out.row_expert, align)
    with ll_cases.masked_gemm("deepgemm") as spy:
        y = grouped_linear_fp8((rq, rs), w, layout, backend="deepgemm")
    _sync(device)
    errors = []
    if spy.calls != ["m_grouped_fp8_gemm_nt_contiguous"]:
        return [f"{tag} expected one m_grouped_fp8_gemm_nt_contiguous call, got {spy.calls}"]
    a_q, a_s = spy.args[0][0]
    if a_q.data_ptr() != rq.data_ptr() or a_s.data_ptr() != rs.data_ptr():
        errors.append(f"{tag} DeepGEMM was handed a copy of the dispatched rows or scales, not the dispatch's own")
    rows = out.row_expert.cpu()
    real = rows >= 0
    if M and torch.any(y.cpu()[~real] != 0):
        errors.append(f"{tag} pad rows are not 0")
    w_seen = ll_cases.block_cast_back(w.cpu())  # the weights as DeepGEMM's FP8 kernel sees them
    xr = per_token_cast_back(rq, rs, torch.float32).cpu().double()
    want = torch.zeros((M, N), dtype=torch.float64)
    for e in range(L):
        sel = rows == e
        want[sel] = xr[sel] @ w_seen[e].double().t()
    yd = y.cpu().double()
    for e in range(L):
        sel = rows == e
        if not sel.any():
            continue
        gap = _similarity_gap(yd[sel], want[sel])
        worst = (yd[sel] - want[sel]).abs().max().item()
        if gap > 1e-3 or worst > 0.1:
            errors.append(f"{tag} expert {e}: similarity gap {gap:.3g} (bound 1e-3), largest difference {worst:.3g} (bound 0.1)")
    # every sender's token routed to local expert e arrives once: per expert, the sum of its rows'
    # outputs equals the sum over the tokens the senders routed to it
    Ts = cfg["Ts"]
    xs_all = [torch.zeros((max(Ts), H), dtype=torch.float64) for _ in range(R)]
    idx_all = [torch.full((max(Ts), cfg["K"]), -1, dtype=torch.int64) for _ in range(R)]
    xs_mine = torch.zeros((max(Ts), H), dtype=torch.float64)
    xs_mine[:T] = per_token_cast_back(q, s, torch.float32).cpu().double()
    idx_mine = torch.full((max(Ts), cfg["K"]), -1, dtype=torch.int64)
    idx_mine[:T] = idx
    dist.all_gather(xs_all, xs_mine)
    dist.all_gather(idx_all, idx_mine)
    for e in range(L):
        ge = rank * L + e
        senders = torch.cat([xs[(ix == ge).any(dim=1)] for xs, ix in zip(xs_all, idx_all)])
        expect = (senders @ w_seen[e].double().t()).sum(0)
        got = yd[rows == e].sum(0)
        count = int((rows == e).sum())
        if count != senders.shape[0]:
            errors.append(f"{tag} expert {e} received {count} rows, its senders routed {senders.shape[0]} tokens to it")
        elif (got - expect).abs().max().item() > 0.05 * max(1.0, count ** 0.5):
            errors.append(f"{tag} expert {e}: its outputs' sum is off by {(got - expect).abs().max().item():.3g}")
    return errors


def run_fp8_dispatch_into_deepgemm_cases(cfgs: list, backend: str = "cuda", device: str = "cuda") -> list:
    return [e for cfg in cfgs for e in run_fp8_dispatch_into_deepgemm(cfg, backend, device)]


def fp8_cases(R: int) -> list:
    """Uneven token counts with an empty rank and -1 slots; every token on one expert."""
    Ts = [40, 0, 97, 13, 64, 5, 33, 71][:R]
    return [dict(seed=400 + R, E=2 * R, K=3, H=512, N=256, Ts=Ts, p_drop=0.2),
            dict(seed=410 + R, E=4 * R, K=2, H=256, N=128, Ts=[150] * R, pattern="hot")]


def run_chunked_on_deepgemm(cfg: dict, backend: str = "cuda", device: str = "cuda") -> list:
    """chunked_expert_mlp on DeepGEMM (bf16 SwiGLU, segments at DeepGEMM's alignment) with
    `comm_sms` SMs left free: every GEMM DeepGEMM runs sees its SM count lowered by exactly that
    and the count is restored after; forward and every gradient equal one round of autograd's
    dispatch -> DeepGEMM expert MLP -> combine (bf16: up to the order of sums), and that round
    equals the same round on torch's grouped_mm."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[chunked experts on DeepGEMM R={R} rank={rank} chunks={cfg['chunks']} {backend}]"
    return _on_deepgemm(_chunked_on_deepgemm, cfg, backend, device, tag)


def _chunked_on_deepgemm(cfg, backend, device, tag, R, rank, dg, align) -> list:
    E, K, H, F_ = cfg["E"], cfg["K"], cfg["H"], cfg["F"]
    L, T = E // R, cfg["Ts"][rank]
    g = torch.Generator().manual_seed(cfg["seed"] + rank)
    x = torch.randn((T, H), generator=g)
    idx = _routing(cfg, T, g)
    probs = torch.rand((T, K), generator=g)
    w1 = torch.randn((L, 2 * F_, H), generator=g) / H ** 0.5
    w2 = torch.randn((L, H, F_), generator=g) / F_ ** 0.5
    grad = torch.randn((T, H), generator=g)
    x, w1, w2, grad = (t.to(torch.bfloat16).to(device) for t in (x, w1, w2, grad))
    idx, probs = idx.to(device), probs.to(device)
    buf = get_buffer(backend, max_tokens_per_rank=MAX_TOKENS)
    other = "grouped_mm" if device != "cpu" else "loop"  # torch's grouped_mm is a GPU kernel
    full = dg.get_num_sms()

    def one_round(leaves, backend):
        xx, pp, a, b = leaves
        out = autograd.dispatch(buf, xx, idx, pp, num_experts=E, permute=True, expert_alignment=align)
        layout = GroupedLayout.of(out.x, out.tokens_per_expert)
        if out.row_expert is not None:
            layout = GroupedLayout(out.tokens_per_expert, out.x.shape[0], out.row_expert, align)
        y = expert_mlp(out.x, out.topk_weights, a, b, layout, F.silu, True, backend=backend)
        return autograd.combine(buf, y, out.handle).x

    def run(kind, gemm):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, probs, w1, w2)]
        with ll_cases.masked_gemm("deepgemm" if gemm == "deepgemm" else "torch") as spy:
            if kind == "one round":
                y = one_round(leaves, gemm)
            else:
                y = chunked_expert_mlp(buf, leaves[0], idx, leaves[1], leaves[2], leaves[3], E, chunks=cfg["chunks"],
                                       expert_alignment=align, activation=F.silu, glu=True, backend=gemm,
                                       comm_sms=cfg["comm_sms"])
            y.backward(grad)
            _sync(device)
        return [y.detach().float()] + [t.grad.float() for t in leaves], spy

    base, _ = run("one round", "deepgemm")
    chunked, spy = run("chunked", "deepgemm")
    torch_round, _ = run("one round", other)
    errors = []
    names = ("output", "grad x", "grad probs", "grad w1", "grad w2")
    for label, got in (("chunked", chunked), (f"one round on {other}", torch_round)):
        for name, a, b in zip(names, base, got):
            den = a.norm().item()
            rel = (a - b).norm().item() / den if den else (a - b).norm().item()
            if rel > 2e-2:
                errors.append(f"{tag} {name}: {label} differs from one round on DeepGEMM (relative {rel:.3g}, bound 2e-2)")
    if T and not base[0].abs().sum() > 0:
        errors.append(f"{tag} the output is all zero: the case checks nothing")
    if "m_grouped_bf16_gemm_nt_contiguous" not in spy.calls:
        errors.append(f"{tag} the chunked layer ran no DeepGEMM GEMM: {spy.calls}")
    want = max(1, full - cfg["comm_sms"])
    if any(n != want for n in spy.sms):
        errors.append(f"{tag} DeepGEMM's SM count at its GEMMs {sorted(set(spy.sms))}, expected {want} ({full} - {cfg['comm_sms']})")
    if dg.get_num_sms() != full:
        errors.append(f"{tag} DeepGEMM's SM count is {dg.get_num_sms()} after the layer, was {full}")
    return errors


def chunked_cases(R: int) -> list:
    Ts = [300, 0, 170, 64][:R]
    return [dict(seed=500 + R, E=2 * R, K=2, H=256, F=128, Ts=Ts, chunks=3, comm_sms=24, p_drop=0.2)]


def run_chunked_on_deepgemm_cases(cfgs: list, backend: str = "cuda", device: str = "cuda") -> list:
    return [e for cfg in cfgs for e in run_chunked_on_deepgemm(cfg, backend, device)]
