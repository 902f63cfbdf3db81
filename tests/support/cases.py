"""Case bodies that run on every rank of a DistPool (module-level so workers can import them).

Each function checks one rank's outputs against the dense oracle and returns a list of
failure messages (empty when all is well); all collectives run before any check, so a failing
rank never leaves its peers waiting. The same bodies drive the torch backend on CPU and the
cuda backend on the GPU (backend= and device=).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

import megatron_ep as mep
from megatron_ep.tools import tracing
from graph_capture import captured
from oracle import (
    bits,
    expected_combine,
    expected_expert_major,
    expected_rank_major,
    make_inputs,
    num_destinations,
    split_x,
)

_buffers = {}

# One cuda buffer per process fits every case of the suite (the region is sized from these).
CUDA_SIZING = dict(max_tokens_per_rank=64, hidden=7168, num_experts=256, max_topk=16, combine_rows=8192)


def make_buffer(backend: str, **sizing) -> mep.Buffer:
    if backend == "cuda":
        if os.environ.get("MEP_POISON") == "1":  # every output filled with garbage before its kernel
            from megatron_ep.core import output_hook as hooks

            hooks.set_output_hook(poison_)
        sizing = {**CUDA_SIZING, **sizing}
        rank0_pool = sizing.pop("pool_bytes_rank0", None)  # e.g. one rank without room: mixed push/pull
        if rank0_pool is not None and dist.get_rank() == 0:
            sizing["pool_bytes"] = rank0_pool
    return mep.Buffer(dist.group.WORLD, backend=backend, **sizing)


def get_buffer(backend: str, fuzz_reference: bool = False, **sizing) -> mep.Buffer:
    """One buffer per (backend, sizing) and process; `fuzz_reference` gives the fuzz its own
    reference buffer (its calls must not share a sequence with the buffer under test)."""
    key = (backend, fuzz_reference, tuple(sorted(sizing.items())))
    if key not in _buffers:
        _buffers[key] = make_buffer(backend, **sizing)
    return _buffers[key]


def to_dev(x, device):
    if isinstance(x, tuple):
        return tuple(t.to(device) for t in x)
    return x.to(device)


def poison_(t):
    """Fill with a value no correct output holds (the cuda backend's outputs are poisoned too)."""
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.uint8:  # the torch backend's packed receive rows
        t.fill_(0xA5)
    else:
        t.fill_(-12345)
    return t


class Checker:
    def __init__(self, tag):
        self.tag, self.errors = tag, []

    def equal(self, what, got, want):
        got = got.cpu() if got is not None else None
        if got is None or want is None:
            if (got is None) != (want is None):
                self.errors.append(f"{self.tag} {what}: got {'None' if got is None else 'a tensor'}, want {'None' if want is None else 'a tensor'}")
            return
        if tuple(got.shape) != tuple(want.shape):
            self.errors.append(f"{self.tag} {what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        elif got.dtype != want.dtype:
            self.errors.append(f"{self.tag} {what}: dtype {got.dtype} != {want.dtype}")
        elif not torch.equal(bits(got), bits(want)):
            bad = (bits(got) != bits(want)).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten()[:5].tolist() if got.dim() else []
            self.errors.append(f"{self.tag} {what}: not bit-exact (first bad rows {bad})")

    def close(self, what, got, want, rel):
        got = got.cpu().double()
        if tuple(got.shape) != tuple(want.shape):
            self.errors.append(f"{self.tag} {what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        if want.numel() == 0:
            return
        if not torch.isfinite(got).all():
            self.errors.append(f"{self.tag} {what}: non-finite values")
            return
        scale = want.abs().max().item() + 1e-6
        err = (got - want).abs().max().item()
        if err > rel * scale:
            self.errors.append(f"{self.tag} {what}: max error {err:.3g} > {rel} * {scale:.3g}")


def _expert_transform(R, E, permute, seed):
    """Per-destination (rank-major) or per-expert (expert-major) affine map v*scale + bias."""
    g = torch.Generator().manual_seed(seed + 99)
    n = E if permute else R
    scale = torch.tensor([2.0 ** int(torch.randint(-2, 3, (1,), generator=g)) for _ in range(n)], dtype=torch.float64)
    return scale, torch.randn((n,), generator=g).to(torch.bfloat16).double()


def _ref_dtype(x):
    data, _ = split_x(x)
    return data.dtype


def run_normal_case(cfg: dict, backend: str = "torch", device: str = "cpu") -> list:
    """Rank-major and expert-major dispatch, cached dispatch, combine (+weights), round trip."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, align = cfg["E"], cfg["K"], cfg["H"], cfg["align"]
    inputs = make_inputs(cfg["seed"], R, E, K, H, cfg["Ts"], cfg["dtype"], cfg["pattern"], cfg.get("p_drop", 0.2))
    me = inputs[rank]
    buf = get_buffer(backend, **cfg.get("sizing", {}))
    chk = Checker(f"[R={R} rank={rank} {cfg}]")
    worst = cfg.get("worst", 0)
    x, idx, w = to_dev(me["x"], device), me["idx"].to(device), me["w"].to(device)
    L = E // R

    # ---- layout
    lay = buf.get_dispatch_layout(idx, E)
    tir = torch.zeros((idx.shape[0], R), dtype=torch.bool)
    for t, row in enumerate(me["idx"].tolist()):
        for e in row:
            if e >= 0:
                tir[t, e // L] = True
    tpe_global = torch.zeros(E, dtype=torch.int64)
    for e in me["idx"].flatten().tolist():
        if e >= 0:
            tpe_global[e] += 1
    chk.equal("layout.token_in_rank", lay.token_in_rank, tir)
    chk.equal("layout.tokens_per_rank", lay.tokens_per_rank, tir.sum(0))
    chk.equal("layout.tokens_per_expert", lay.tokens_per_expert, tpe_global)
    lay32 = buf.get_dispatch_layout(idx, E, counts_dtype=torch.int32)  # DeepEP's count type
    chk.equal("layout (int32 counts).token_in_rank", lay32.token_in_rank, tir)
    chk.equal("layout (int32 counts).tokens_per_rank", lay32.tokens_per_rank, tir.sum(0).to(torch.int32))
    chk.equal("layout (int32 counts).tokens_per_expert", lay32.tokens_per_expert, tpe_global.to(torch.int32))

    # ---- rank-major dispatch (with num_worst_tokens below what arrives, the rows past it are
    # dropped and counted: n rows are delivered of the oracle's n_all)
    out = buf.dispatch(x, idx, w, num_experts=E, num_worst_tokens=worst)
    exp = expected_rank_major(inputs, rank, R, E)
    n_all = exp["x"].shape[0]
    n = min(n_all, worst) if worst else n_all
    got_x, got_s = split_x(out.x)
    if worst:
        chk.equal("worst rows", torch.tensor(got_x.shape[0]), torch.tensor(worst))
        chk.equal("worst topk_idx padding", out.topk_idx[n:].cpu(), torch.full((worst - n, K), -1, dtype=torch.int64))
    chk.equal("rank-major x", got_x[:n], exp["x"][:n])
    if got_s is not None:
        chk.equal("rank-major scales", got_s[:n], exp["scales"][:n])
    chk.equal("rank-major topk_idx", out.topk_idx[:n], exp["idx"][:n])
    chk.equal("rank-major topk_weights", out.topk_weights[:n], exp["w"][:n])
    kept_idx = exp["idx"][:n]
    chk.equal("rank-major tokens_per_expert", out.tokens_per_expert, torch.bincount(kept_idx[kept_idx >= 0], minlength=E // R))
    chk.equal("rank-major num_dropped", out.num_dropped, torch.tensor(n_all - n))
    if out.row_expert is not None:
        chk.errors.append("rank-major row_expert should be None")

    # ---- each rank-major row's source token (source_index=True, what DeepEP V2's
    # recv_src_metadata is made of): its index on its source rank, -1 past the rows that arrived
    if not worst:
        srcd = buf.dispatch(x, idx, w, num_experts=E, source_index=True)
        src = srcd.handle.recv_src_token
        chk.equal("source_index recv_src_token", src[:n_all], torch.tensor([t for _, t in exp["src"]], dtype=torch.int32))
        if src.shape[0] > n_all and bool((src[n_all:] != -1).any()):
            chk.errors.append(f"{chk.tag} source_index: rows past the {n_all} that arrived are not -1")

    # ---- cached dispatch of new values along the same routing
    def new_values(inp):
        data, scales = split_x(inp["x"])
        if scales is not None:
            return (data.view(torch.uint8).flip(1).contiguous().view(data.dtype), (scales.flip(1) * 3).contiguous())
        return (data.double() * -3 + 1).to(data.dtype)

    inputs2 = [dict(i, x=new_values(i), w=i["w"] * 3) for i in inputs]
    out2 = buf.dispatch(to_dev(inputs2[rank]["x"], device), topk_weights=inputs2[rank]["w"].to(device), handle=out.handle)
    exp2 = expected_rank_major(inputs2, rank, R, E)
    chk.equal("cached x", split_x(out2.x)[0][:n], exp2["x"][:n])
    if exp2["scales"] is not None:
        chk.equal("cached scales", split_x(out2.x)[1][:n], exp2["scales"][:n])
    chk.equal("cached topk_weights", out2.topk_weights[:n], exp2["w"][:n])
    chk.equal("cached topk_idx", out2.topk_idx[:n], exp["idx"][:n])

    # ---- expert-major dispatch
    outp = buf.dispatch(x, idx, w, num_experts=E, permute=True, expert_alignment=align, num_worst_tokens=worst)
    expp = expected_expert_major(inputs, rank, R, E, align)
    m_all = expp["x"].shape[0]
    m = min(m_all, worst) if worst else m_all
    px, ps = split_x(outp.x)
    chk.equal("expert-major x", px[:m], expp["x"][:m])
    if ps is not None:
        chk.equal("expert-major scales", ps[:m], expp["scales"][:m])
    chk.equal("expert-major weights", outp.topk_weights[:m], expp["w"][:m])
    chk.equal("expert-major row_expert", outp.row_expert[:m], expp["row_expert"][:m])
    tpe_want = expp["tokens_per_expert"]
    if worst:  # segments clamped to the rows that exist
        ends = torch.cumsum(tpe_want, 0)
        tpe_want = ends.clamp(max=worst) - (ends - tpe_want).clamp(max=worst)
    chk.equal("expert-major tokens_per_expert", outp.tokens_per_expert, tpe_want)
    chk.equal("expert-major num_dropped", outp.num_dropped, (expp["row_expert"][m:] >= 0).sum())
    if worst:
        chk.equal("worst row_expert padding", outp.row_expert[m:].cpu(), torch.full((worst - m,), -1, dtype=torch.int32))
    if outp.topk_idx is not None:
        chk.errors.append("expert-major topk_idx should be None")
    host = buf.dispatch(x, idx, None, num_experts=E, permute=True, expert_alignment=align, host_counts=True, num_worst_tokens=worst)
    if host.tokens_per_expert_host != tpe_want.tolist():
        chk.errors.append(f"{chk.tag} host counts {host.tokens_per_expert_host} != {tpe_want.tolist()}")
    if host.topk_weights is not None:
        chk.errors.append("dispatch without weights returned weights")
    outp2 = buf.dispatch(to_dev(inputs2[rank]["x"], device), handle=outp.handle)
    expp2 = expected_expert_major(inputs2, rank, R, E, align)
    chk.equal("cached expert-major x", split_x(outp2.x)[0][:m], expp2["x"][:m])

    if cfg["dtype"] != "fp8":
        _check_combine(cfg, buf, inputs, rank, R, out, exp, outp, expp, chk, device)
    return chk.errors


def _check_combine(cfg, buf, inputs, rank, R, out, exp, outp, expp, chk, device):
    E, K = cfg["E"], cfg["K"]
    L = E // R
    me = inputs[rank]
    dtype = _ref_dtype(me["x"])
    rel = 2e-2 if dtype == torch.bfloat16 else 1e-5
    worst = cfg.get("worst", 0)
    n, m = exp["x"].shape[0], expp["x"].shape[0]
    if worst:
        n, m = min(n, worst), min(m, worst)

    # rank-major: this rank maps its received rows v -> v * scale[rank] + bias[rank]
    scale, bias = _expert_transform(R, E, False, cfg["seed"])
    rows = split_x(out.x)[0].double()
    rows = (rows * scale[rank] + bias[rank]).to(dtype)
    rows[n:] = 7.0  # worst-case padding rows must be ignored
    wrows = torch.where(out.topk_idx >= 0, out.topk_weights * 2 + out.topk_idx.clamp(min=0).float(), torch.zeros_like(out.topk_weights))
    res = buf.combine(rows.contiguous(), out.handle, weights=wrows.contiguous())
    # ---- expert-major: rows of global expert e -> v * scale[e] + bias[e]; pad rows set to garbage
    scale_e, bias_e = _expert_transform(R, E, True, cfg["seed"])
    re = outp.row_expert.long()
    g_e = (re + rank * L).clamp(min=0).cpu()
    prow = split_x(outp.x)[0].double()
    prow = (prow * scale_e[g_e].unsqueeze(1).to(prow.device) + bias_e[g_e].unsqueeze(1).to(prow.device)).to(dtype)
    prow[re < 0] = 1000.0
    pw = torch.where(re >= 0, outp.topk_weights * 2 + re.clamp(min=0).float(), torch.full_like(outp.topk_weights, 555.0))
    resp = buf.combine(prow.contiguous(), outp.handle, weights=pw.contiguous())
    # ---- round trip of all-ones
    ones = buf.combine(torch.ones_like(split_x(out.x)[0]), out.handle)
    onesp = buf.combine(torch.ones_like(split_x(outp.x)[0]), outp.handle)

    # rows dropped past num_worst_tokens (on any destination) contribute nothing
    lost_rm, lost_em = _dropped(inputs, rank, R, E, False, 1, worst), _dropped(inputs, rank, R, E, True, cfg["align"], worst)
    idx = me["idx"]
    v = split_x(me["x"])[0].double()
    H = v.shape[1]
    y_ref = expected_combine(me, rank, R, E, False, scale, bias)
    w_ref = torch.where(idx >= 0, me["w"] * 2 + (idx - (idx // L) * L).clamp(min=0).float(), torch.zeros_like(me["w"]))
    ones_ref = num_destinations(me, R, E, False).unsqueeze(1).expand(-1, H).clone()
    w_ref_rm = w_ref.clone()
    for t, d in lost_rm:
        y_ref[t] -= v[t] * scale[d] + bias[d]
        ones_ref[t] -= 1
        w_ref_rm[t] = torch.where((idx[t] >= 0) & (idx[t] // L == d), torch.zeros_like(w_ref[t]), w_ref_rm[t])
    yp_ref = expected_combine(me, rank, R, E, True, scale_e, bias_e)
    onesp_ref = num_destinations(me, R, E, True).unsqueeze(1).expand(-1, H).clone()
    w_ref_em = w_ref.clone()
    for t, k in lost_em:
        e = int(idx[t, k])
        yp_ref[t] -= v[t] * scale_e[e] + bias_e[e]
        onesp_ref[t] -= 1
        w_ref_em[t, k] = 0.0
    chk.close("rank-major combine", res.x, y_ref, rel)
    if res.x.dtype != dtype:
        chk.errors.append(f"combine returned {res.x.dtype}, want {dtype}")
    chk.close("rank-major combine weights", res.weights, w_ref_rm.double(), 1e-6)
    chk.close("expert-major combine", resp.x, yp_ref, rel)
    chk.close("expert-major combine weights", resp.weights, w_ref_em.double(), 1e-6)
    chk.close("round trip rank-major", ones.x, ones_ref, 1e-6)
    chk.close("round trip expert-major", onesp.x, onesp_ref, 1e-6)


def _dropped(inputs, rank, R, E, permute, align, worst):
    """This rank's (token, destination rank) or (token, slot) pairs whose row fell past
    num_worst_tokens on its destination (every destination's oracle layout)."""
    lost = set()
    if not worst:
        return lost
    for d in range(R):
        src = expected_expert_major(inputs, d, R, E, align)["src"] if permute else expected_rank_major(inputs, d, R, E)["src"]
        for row, item in enumerate(src):
            if row >= worst and item is not None and item[0] == rank:
                lost.add((item[1], item[2]) if permute else (item[1], d))
    return lost


def run_each(run_case, cfgs, *args, label: str = "", most: int = 0) -> list:
    """run_case(cfg, *args) for each cfg in turn: a case that raises is reported with its
    traceback and the next one runs (the ranks stay in step); with `most` (> 0), the cases stop
    once more than that many errors were found."""
    errors = []
    for cfg in cfgs:
        try:
            errors += run_case(cfg, *args)
        except Exception:
            errors.append(f"[{label}{cfg}] raised:\n{traceback.format_exc()}")
        if most and len(errors) > most:
            break
    return errors


def run_normal_cases(cfgs: list, backend: str = "torch", device: str = "cpu") -> list:
    return run_each(run_normal_case, cfgs, backend, device)


# ------------------------------------------------------------------------------ low latency
def run_low_latency_case(cfg: dict, backend: str = "torch", device: str = "cpu") -> list:
    from oracle import expected_low_latency

    import ll_cases

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, mt, use_fp8 = cfg["E"], cfg["K"], cfg["H"], cfg["max_tokens"], cfg["fp8"]
    round_scale = cfg.get("round_scale", False)
    L = E // R
    inputs = make_inputs(cfg["seed"], R, E, K, H, cfg["Ts"], "bf16", cfg["pattern"], cfg.get("p_drop", 0.2))
    if cfg.get("x_edge"):
        ll_cases.edge_values_(inputs)
    me = inputs[rank]
    # the cuda low-latency buffer is sized once per process for every case (ll_cases.LL_SIZING)
    buf = ll_cases.ll_buffer() if backend == "cuda" else get_buffer(backend, **cfg.get("sizing", {}))
    chk = Checker(f"[LL R={R} rank={rank} {cfg}]")
    # merged: the weights go with the dispatch, and the combine given that same tensor sends a
    # token's copies per rank as one row (cuda backend)
    merged = cfg.get("merged", False)
    ue8m0 = cfg.get("ue8m0", False)
    w = me["w"].to(device)
    # the statistics are added to: start from values already there
    recv_stats = torch.arange(L, dtype=torch.int32, device=device) * 1000 + 7
    recv_stats_before = recv_stats.clone()
    wait_stats = [torch.zeros(R, dtype=torch.int64, device=device) for _ in range(2)]  # dispatch, combine
    out = buf.low_latency_dispatch(me["x"].to(device), me["idx"].to(device), num_experts=E, max_tokens_per_rank=mt,
                                   use_fp8=use_fp8, round_scale=round_scale, topk_weights=w if merged else None,
                                   use_ue8m0=ue8m0, cumulative_local_expert_recv_stats=recv_stats,
                                   dispatch_wait_recv_cost_stats=wait_stats[0])
    if merged and backend == "cuda" and not out.handle.state.merges(w):
        chk.errors.append("merged case: the combine would not merge (the dispatch kept no weights)")
    exp = expected_low_latency(inputs, rank, R, E, mt, use_fp8)
    if round_scale:
        ll_cases.round_scale_expected_(exp, inputs, R)
    got_x, got_s = split_x(out.x)
    if ue8m0:
        got_s = ll_cases.ue8m0_scales(chk, got_s, L, R * mt, H)
    chk.equal("cumulative_local_expert_recv_stats", recv_stats, recv_stats_before.cpu() + exp["count"])
    chk.equal("count", out.count, exp["count"])
    chk.equal("layout_range", out.handle.layout_range, exp["layout_range"])
    for e in range(L):
        n = int(exp["count"][e])
        chk.equal(f"x[{e}]", got_x[e, :n], exp["x"][e, :n])
        if use_fp8:
            chk.equal(f"scales[{e}]", got_s[e, :n], exp["scales"][e, :n])
        chk.equal(f"src_token[{e}]", out.handle.src_token[e, :n], exp["src_token"][e, :n])

    # combine: expert e maps its rows v -> v * scale[e] + bias[e]; unused rows hold garbage
    scale, bias = _expert_transform(R, E, True, cfg["seed"])
    rows = got_x.float() if not use_fp8 else (got_x.float().view(L, -1, H // 128, 128) * got_s.unsqueeze(-1)).view(L, -1, H)
    ge = torch.arange(L) + rank * L
    rows = (rows.double().cpu() * scale[ge].view(L, 1, 1) + bias[ge].view(L, 1, 1)).to(torch.bfloat16)
    logfmt = cfg.get("logfmt", False)
    if logfmt:  # magnitudes below 1 and a zero per 128 channels: every block encodes, at its widest step
        rows = ll_cases.logfmt_rows(rows)
    for e in range(L):
        rows[e, int(exp["count"][e]):] = 3000.0
    y = buf.low_latency_combine(rows.to(device), me["idx"].to(device), w, out.handle,
                                combine_wait_recv_cost_stats=wait_stats[1], use_logfmt=logfmt)
    ll_cases.check_wait_stats(chk, backend, wait_stats, me["idx"], E, R)
    # a different weights tensor (even equal values): one row per copy, weighted here
    ys = [("low-latency combine", y, merged and backend == "cuda")] + (
        [("combine, weights not the dispatch's", buf.low_latency_combine(
            rows.to(device), me["idx"].to(device), w.clone(), out.handle, use_logfmt=logfmt), False)] if merged else [])

    # oracle: the value each (token, expert) row held on its expert's rank, weighted and summed
    from oracle import fp8_cast

    x = me["x"]
    if use_fp8:
        q, s = ll_cases.pow2_cast(x) if round_scale else fp8_cast(x)
        x = (q.float().view(-1, H // 128, 128) * s.unsqueeze(-1)).view(-1, H)
    def row_of(t, e):  # the bf16 row expert e returned for token t
        row = (x[t].double() * scale[e] + bias[e]).to(torch.bfloat16)
        return ll_cases.logfmt_rows(row) if logfmt else row

    y_ref = torch.zeros((x.shape[0], H), dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(me["idx"][t, k])
            if e >= 0:
                y_ref[t] += float(me["w"][t, k]) * row_of(t, e).double()
    if not logfmt:
        for name, got, _ in ys:
            chk.close(name, got, y_ref, 2e-2)
            if got.dtype != torch.bfloat16:
                chk.errors.append(f"{name} returned {got.dtype}")
        return chk.errors
    # LogFMT: the sum of the rows as a receiver decodes them; merged, a rank's rows of one token
    # travel as their weighted sum (bf16), encoded once
    for name, got, was_merged in ys:
        want = ll_cases.logfmt_combine_ref(me["idx"], me["w"], row_of, E // R, H, merged=was_merged)
        chk.close(name, got, want, 1e-2)
        ll_cases.check_closer_than_bf16(chk, name, got, want, y_ref)
    return chk.errors


def run_low_latency_cases(cfgs: list, backend: str = "torch", device: str = "cpu") -> list:
    return run_each(run_low_latency_case, cfgs, backend, device)


# --------------------------------------------------------------------------------- autograd
class _GatherSame(torch.autograd.Function):
    """all_gather whose backward keeps this rank's slice of a gradient that every rank holds
    identically: it turns the distributed dispatch->f->combine into one global function that
    every rank evaluates in lock step, which is what gradcheck needs. It and _SliceSame are each
    other's adjoints, and each backward is the other (so gradgradcheck sees through both)."""

    @staticmethod
    def forward(ctx, t):
        R = dist.get_world_size()
        ctx.n = t.shape[0]
        parts = [torch.empty_like(t) for _ in range(R)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        return _SliceSame.apply(g, ctx.n)


class _SliceSame(torch.autograd.Function):
    """This rank's slice of a global tensor that every rank holds identically; the backward
    all-gathers the slices' gradients, so each rank sees the gradient of the whole input."""

    @staticmethod
    def forward(ctx, t, n):
        rank = dist.get_rank()
        return t[rank * n:(rank + 1) * n].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _GatherSame.apply(g), None


def _per_row(out, permute):
    """A nonlinear per-row function of the dispatched rows and weights, and combine weights,
    so gradients reach x and topk_weights through both dispatch paths."""
    rw = out.topk_weights
    if permute:
        return out.x * (1 + rw).unsqueeze(1) ** 2, rw * rw
    return out.x * (1 + rw.sum(1, keepdim=True)) ** 2, rw * 3


def run_gradcheck(cfg: dict, backend: str = "torch", order: int = 1) -> list:
    """torch.autograd.gradcheck (order 1) or gradgradcheck (order 2) of dispatch -> a nonlinear
    per-row function -> combine, as one global function every rank evaluates in lock step."""
    from oracle import _routing

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T, permute, align = cfg["E"], cfg["K"], cfg["H"], cfg["T"], cfg["permute"], cfg["align"]
    g = torch.Generator().manual_seed(cfg["seed"])
    X = torch.randn((R * T, H), generator=g, dtype=torch.float64).requires_grad_()
    W = (torch.rand((R * T, K), generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    idx = _routing(g, R * T, E, K, R, "random", 0.25)
    buf = get_buffer(backend)
    sl = slice(rank * T, (rank + 1) * T)

    def F(X, W):
        out = mep.dispatch(buf, _SliceSame.apply(X, T), idx[sl].contiguous(), _SliceSame.apply(W, T), num_experts=E,
                           permute=permute, expert_alignment=align)
        f, cw = _per_row(out, permute)
        res = mep.combine(buf, f, out.handle, weights=cw)
        return _GatherSame.apply(res.x), _GatherSame.apply(res.weights)

    check = torch.autograd.gradcheck if order == 1 else torch.autograd.gradgradcheck
    tag = f"[{check.__name__} R={R} rank={rank} {cfg}]"
    try:
        ok = check(F, (X, W), eps=1e-6, atol=1e-6, rtol=1e-4, raise_exception=True)
    except Exception as exc:
        return [f"{tag} {exc}"]
    return [] if ok else [f"{tag} failed"]


# ------------------------------------------------------------------------------- bad inputs
def run_bad_inputs(backend: str = "torch", device: str = "cpu") -> list:
    """Every bad input raises the right error on every rank, and the buffer stays usable."""
    import pytest

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T = 4 * R, 3, 256, 6
    inputs = make_inputs(77, R, E, K, H, [T] * R, "bf16", "random", 0.2)
    me = inputs[rank]
    x, idx, w = me["x"].to(device), me["idx"].to(device), me["w"].to(device)
    buf = get_buffer(backend, max_tokens_per_rank=T)
    other = make_buffer(backend, max_tokens_per_rank=T)
    good = buf.dispatch(x, idx, w, num_experts=E)
    goodp = buf.dispatch(x, idx, w, num_experts=E, permute=True, expert_alignment=16)
    errors = []
    hi, lo, dup = idx.clone(), idx.clone(), idx.clone()
    hi[0, 0] = E
    lo[0, 0] = -2
    dup[0, 0], dup[0, 1] = 1, 1
    fp8 = (torch.zeros((T, 100), dtype=torch.float8_e4m3fn, device=device), torch.ones((T, 1), device=device))
    fp8_bad_scales = (torch.zeros((T, H), dtype=torch.float8_e4m3fn, device=device), torch.ones((T, 1), device=device))
    nc = torch.randn((H, T), device=device).to(torch.bfloat16).t()
    big = torch.randn((T + 1, H), device=device).to(torch.bfloat16)
    big_idx = torch.zeros((T + 1, K), dtype=torch.int64, device=device)
    cases = [
        ("expert id >= E", lambda: buf.dispatch(x, hi, w, num_experts=E), ValueError, "num_experts"),
        ("expert id < -1", lambda: buf.dispatch(x, lo, w, num_experts=E), ValueError, ">= -1"),
        ("duplicate expert", lambda: buf.dispatch(x, dup, w, num_experts=E), ValueError, "twice"),
        ("K mismatch", lambda: buf.dispatch(x, idx, w[:, :K - 1].contiguous(), num_experts=E), ValueError, "K mismatch"),
        ("FP8 H % 128", lambda: buf.dispatch(fp8, idx, w, num_experts=E), ValueError, "multiple of 128"),
        ("FP8 scales shape", lambda: buf.dispatch(fp8_bad_scales, idx, w, num_experts=E), ValueError, "scales"),
        ("x dtype", lambda: buf.dispatch(x.to(torch.int32), idx, w, num_experts=E), TypeError, "x must have dtype"),
        ("topk_idx dtype", lambda: buf.dispatch(x, idx.to(torch.int32), w, num_experts=E), TypeError, "topk_idx"),
        ("weights dtype", lambda: buf.dispatch(x, idx, w.to(torch.bfloat16), num_experts=E), TypeError, "topk_weights"),
        ("non-contiguous x", lambda: buf.dispatch(nc, idx, w, num_experts=E), ValueError, "contiguous"),
        ("too many tokens", lambda: buf.dispatch(big, big_idx, None, num_experts=E), ValueError, "sized for"),
        ("rows mismatch topk", lambda: buf.dispatch(x[:-1].contiguous(), idx, w, num_experts=E), ValueError, "rows"),
        ("missing num_experts", lambda: buf.dispatch(x, idx, w), TypeError, "num_experts"),
        ("cached with topk_idx", lambda: buf.dispatch(x, idx, handle=good.handle), ValueError, "topk_idx=None"),
        ("cached wrong T", lambda: buf.dispatch(x[:-1].contiguous(), handle=good.handle), ValueError, "handle"),
        ("foreign handle", lambda: other.combine(split_x(good.x)[0], good.handle), ValueError, "different Buffer"),
        ("combine rows", lambda: buf.combine(split_x(good.x)[0][1:].contiguous(), good.handle), ValueError, "rows"),
        ("combine weights shape", lambda: buf.combine(split_x(goodp.x)[0], goodp.handle, weights=torch.zeros((good.handle.num_recv_rows, K), device=device)), ValueError, "weights must have shape"),
        ("combine fp8", lambda: buf.combine((split_x(good.x)[0].to(torch.float8_e4m3fn), torch.ones((good.handle.num_recv_rows, 2), device=device)), good.handle), TypeError, "FP8"),
        ("LL too many tokens", lambda: buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T - 1), ValueError, "sized for"),
        ("LL fp8 hidden", lambda: buf.low_latency_dispatch(x[:, :100].contiguous(), idx, num_experts=E, max_tokens_per_rank=T), ValueError, "multiple of 128"),
        ("backend name", lambda: mep.Buffer(dist.group.WORLD, backend="nccl"), ValueError, "backend"),
    ]
    if R > 1:
        cases.append(("E % R", lambda: buf.dispatch(x, idx, w, num_experts=E + 1), ValueError, "divisible"))
    for name, fn, exc, text in cases:
        try:
            with pytest.raises(exc, match=None) as info:
                fn()
            if text not in str(info.value):
                errors.append(f"[rank {rank}] {name}: message {str(info.value)!r} does not mention {text!r}")
        except BaseException as e:  # pytest.raises failure is an exception too
            errors.append(f"[rank {rank}] {name}: {type(e).__name__}: {e}")
        # the buffer must still work after every rejected call
        ok = buf.dispatch(x, idx, w, num_experts=E)
        back = buf.combine(torch.ones_like(split_x(ok.x)[0]), ok.handle)
        want = num_destinations(me, R, E, False).unsqueeze(1).expand(-1, H)
        if not torch.equal(back.x.cpu().double(), want):
            errors.append(f"[rank {rank}] buffer unusable after {name}")
    other.destroy()
    return errors


# -------------------------------------------------------------------------------- main job
def run_demo(argv: list) -> list:
    from megatron_ep.tools import demo

    return demo.run(demo.parse_args(argv))


# ------------------------------------------------------------------------------- cuda only
def run_cuda_graph_case(cfg: dict) -> list:
    """Worst-case sized dispatch + combine captured in a CUDA graph, replayed on new inputs.
    cfg["async"]: both calls asynchronous, and the combine's input freed on the caller's stream
    right after the call, with an allocation of its size after it: the capture must not hand the
    freed block to that allocation while the communication stream still reads it (its NaNs would
    race the combine), so the two addresses must differ."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T, align = cfg["E"], cfg["K"], cfg["H"], cfg["T"], cfg["align"]
    L = E // R
    buf = get_buffer("cuda", **cfg.get("sizing", {}))
    chk = Checker(f"[graph R={R} rank={rank}]")
    worst = R * T * min(K, L) + L * align
    inputs = make_inputs(cfg["seed"], R, E, K, H, [T] * R, "bf16", "random", 0.2)
    x = inputs[rank]["x"].cuda()
    idx = inputs[rank]["idx"].cuda()
    w = inputs[rank]["w"].cuda()

    reused = []

    def step():
        if not cfg.get("async"):
            out = buf.dispatch(x, idx, w, num_experts=E, permute=True, expert_alignment=align, num_worst_tokens=worst)
            return out, buf.combine(out.x * 2, out.handle, weights=out.topk_weights * 3)
        out = buf.dispatch(x, idx, w, num_experts=E, permute=True, expert_alignment=align, num_worst_tokens=worst,
                           async_op=True)
        out.event.current_stream_wait()
        rows = out.x * 2
        res = buf.combine(rows, out.handle, weights=out.topk_weights * 3, async_op=True)
        freed = rows.data_ptr()
        del rows
        poison = torch.full((worst, H), float("nan"), dtype=torch.bfloat16, device=x.device)
        if torch.cuda.is_current_stream_capturing():
            reused.append(poison.data_ptr() == freed)
        res.event.current_stream_wait()
        return out, res

    graph, (out, res) = captured(step)
    if reused != ([False] if cfg.get("async") else []):
        chk.errors.append(f"{chk.tag} the capture handed the asynchronous combine's input to a later allocation "
                          f"while the communication stream read it ({reused})")
    for it in range(4):
        fresh = make_inputs(cfg["seed"] + 17 * (it + 1), R, E, K, H, [T] * R, "bf16", "random", 0.2)
        x.copy_(fresh[rank]["x"])
        idx.copy_(fresh[rank]["idx"])
        w.copy_(fresh[rank]["w"])
        graph.replay()
        torch.cuda.synchronize()
        exp = expected_expert_major(fresh, rank, R, E, align)
        m = exp["x"].shape[0]
        chk.equal(f"replay {it} x", out.x[:m], exp["x"])
        chk.equal(f"replay {it} row_expert", out.row_expert[:m], exp["row_expert"])
        chk.equal(f"replay {it} row_expert pad", out.row_expert[m:].cpu(), torch.full((worst - m,), -1, dtype=torch.int32))
        chk.equal(f"replay {it} tokens_per_expert", out.tokens_per_expert, exp["tokens_per_expert"])
        y_ref = expected_combine(fresh[rank], rank, R, E, True, torch.full((E,), 2.0, dtype=torch.float64), torch.zeros(E, dtype=torch.float64))
        chk.close(f"replay {it} combine", res.x, y_ref, 2e-2)
        me = fresh[rank]
        chk.close(f"replay {it} combine weights", res.weights, (me["w"] * 3).double(), 1e-6)
    buf.synchronize()
    return chk.errors


def run_repeated(cfg: dict, backend: str = "cuda", device: str = "cuda") -> list:
    """Many calls with changing routing: round trip every call, full check every tenth."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H = cfg["E"], cfg["K"], cfg["H"]
    buf = get_buffer(backend, **cfg.get("sizing", {}))
    chk = Checker(f"[repeat R={R} rank={rank}]")
    for it in range(cfg["iters"]):
        g = torch.Generator().manual_seed(cfg["seed"] + it)
        Ts = torch.randint(0, cfg["t_max"] + 1, (R,), generator=g).tolist()
        permute = it % 2 == 1
        inputs = make_inputs(cfg["seed"] + 1000 + it, R, E, K, H, Ts, "bf16", "random", 0.3)
        me = inputs[rank]
        out = buf.dispatch(me["x"].to(device), me["idx"].to(device), me["w"].to(device), num_experts=E,
                           permute=permute, expert_alignment=16 if permute else 1)
        back = buf.combine(torch.ones_like(out.x), out.handle)
        chk.close(f"iter {it} round trip", back.x, num_destinations(me, R, E, permute).unsqueeze(1).expand(-1, H), 1e-6)
        if it % 10 == 0:
            if permute:
                exp = expected_expert_major(inputs, rank, R, E, 16)
                chk.equal(f"iter {it} x", out.x, exp["x"])
            else:
                exp = expected_rank_major(inputs, rank, R, E)
                chk.equal(f"iter {it} x", out.x, exp["x"])
                chk.equal(f"iter {it} idx", out.topk_idx, exp["idx"])
    buf.synchronize()
    return chk.errors


def run_timeout_case(absent_rank: int) -> list:
    """One rank never joins a dispatch: the others must raise, naming the rank they waited on."""
    rank = dist.get_rank()
    buf = make_buffer("cuda")
    dist.barrier()
    if rank == absent_rank:
        return []
    x = torch.randn((4, 256), device="cuda").to(torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 4, device="cuda")
    try:
        buf.dispatch(x, idx, None, num_experts=2 * dist.get_world_size())
        buf.synchronize()
    except RuntimeError as exc:
        msg = str(exc)
        if f"waiting for rank {absent_rank}" in msg or f"because rank" in msg:
            return []
        return [f"rank {rank}: unexpected message {msg!r}"]
    return [f"rank {rank}: dispatch without rank {absent_rank} did not raise"]


def run_cuda_autograd_async(cfg: dict) -> list:
    """Forward and backward through mep.dispatch/combine on the cuda backend equal the torch
    backend's (fp32, CPU); async_op/previous_event give the same bytes as synchronous calls."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T, permute = cfg["E"], cfg["K"], cfg["H"], cfg["T"], cfg["permute"]
    align = 16 if permute else 1
    inputs = make_inputs(cfg["seed"], R, E, K, H, [T] * R, "fp32", "random", 0.2)
    me = inputs[rank]
    g = torch.Generator().manual_seed(cfg["seed"] + 7 * rank)
    coef_y, coef_w = torch.randn((T, H), generator=g), torch.randn((T, K), generator=g)
    chk = Checker(f"[autograd/async R={R} rank={rank} permute={permute}]")

    def run(buf, device):
        x = me["x"].to(device).requires_grad_()
        w = me["w"].to(device).requires_grad_()
        out = mep.dispatch(buf, x, me["idx"].to(device), w, num_experts=E, permute=permute, expert_alignment=align)
        f, cw = _per_row(out, permute)
        res = mep.combine(buf, f, out.handle, weights=cw)
        loss = (res.x * coef_y.to(device)).sum() + (res.weights * coef_w.to(device)).sum()
        loss.backward()
        return [t.detach().cpu().double() for t in (res.x, res.weights, x.grad, w.grad)]

    got = run(get_buffer("cuda"), "cuda")
    want = run(get_buffer("torch"), "cpu")
    for name, a, b in zip(("y", "weights", "dx", "dw"), got, want):
        chk.close(name, a, b, 1e-5)

    buf = get_buffer("cuda")
    x, idx, w = me["x"].cuda(), me["idx"].cuda(), me["w"].cuda()
    sync = buf.dispatch(x, idx, w, num_experts=E, permute=permute, expert_alignment=align)
    prev = mep.EventOverlap(torch.cuda.Event())
    prev.event.record()
    asy = buf.dispatch(x, idx, w, num_experts=E, permute=permute, expert_alignment=align, async_op=True, previous_event=prev)
    asy.event.current_stream_wait()
    chk.equal("async dispatch x", asy.x, sync.x.cpu())
    cs = buf.combine(sync.x, sync.handle)
    ca = buf.combine(asy.x, asy.handle, async_op=True)
    ca.event.current_stream_wait()
    chk.equal("async combine", ca.x, cs.x.cpu())
    buf.synchronize()
    return chk.errors


# ------------------------------------------------------------------------- fuzz and soak (cuda)
def fuzz_config(seed: int, R: int) -> dict:
    """A random routing case, the same on every rank (drawn from `seed`)."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    E = pick([e for e in (1, 2, 4, 8, 32) if e * R <= CUDA_SIZING["num_experts"]]) * R
    K = int(torch.randint(1, min(9, E) + 1, (1,), generator=g))
    dtype = pick(["bf16", "bf16", "fp32", "fp8"])
    H = pick([128, 256, 512, 1024] if dtype == "fp32" else [128, 256, 512, 1024, 7168])
    t_max = 8 if H >= 7168 else CUDA_SIZING["max_tokens_per_rank"]
    Ts = torch.randint(0, t_max + 1, (R,), generator=g).tolist()
    shape = pick(["uneven", "uneven", "one_empty", "only_one"])
    if shape == "one_empty" and R > 1:
        Ts[int(torch.randint(R, (1,), generator=g))] = 0
    elif shape == "only_one":
        keep = int(torch.randint(R, (1,), generator=g))
        Ts = [t_max if r == keep else 0 for r in range(R)]
    cfg = dict(seed=seed, E=E, K=K, H=H, dtype=dtype, Ts=Ts, pattern=pick(["random", "random", "hot", "one_expert", "same_rank"]),
               p_drop=pick([0.0, 0.1, 0.3, 1.0]), align=pick([1, 16, 128]), weights=bool(torch.randint(2, (1,), generator=g)))
    worst = [0] * R
    if int(torch.randint(4, (1,), generator=g)) == 0:  # worst-case sized: enough, or too few (drops)
        hi = 2 * sum(Ts) * min(K, E // R) + 2
        # sometimes a different row budget on every rank (Megatron's per-rank static budget)
        n = R if int(torch.randint(2, (1,), generator=g)) else 1
        worst = torch.randint(1, hi, (n,), generator=g).tolist() * (R // n)
        worst = [min(w, CUDA_SIZING["combine_rows"]) for w in worst]  # sync-free calls cannot grow the buffer
    cfg["worst"] = worst
    return cfg


def _combine_rows_from(x):
    """A deterministic combine input computed from dispatched rows (identical on both backends)."""
    data, scales = split_x(x)
    if scales is not None:
        v = data.float().view(data.shape[0], scales.shape[1], 128) * scales.unsqueeze(-1)
        return (v.view(data.shape) * 0.5 + 1).to(torch.bfloat16)
    return (data.float() * 0.5 + 1).to(data.dtype)


def run_fuzz(cfg: dict, backend: str = "cuda", device: str = "cuda") -> list:
    """`cases` random routings from seed `seed` on; each: rank-major and expert-major dispatch
    bit-exact against the torch backend (gloo, CPU), cached dispatch, combine with weights.
    (backend="torch" on the CPU checks the harness itself: the reference against itself.)"""
    R, rank = dist.get_world_size(), dist.get_rank()
    cuda, ref = get_buffer(backend), get_buffer("torch", fuzz_reference=True)
    configs = (fuzz_config(cfg["seed"] + i, R) for i in range(cfg["cases"]))
    errors = run_each(_fuzz_one, configs, cuda, ref, R, rank, device, label=f"fuzz on rank {rank}: ", most=20)
    cuda.synchronize()
    return errors


def _fuzz_one(c, cuda, ref, R, rank, device) -> list:
    inputs = make_inputs(c["seed"], R, c["E"], c["K"], c["H"], c["Ts"], c["dtype"], c["pattern"], c["p_drop"])
    me = inputs[rank]
    w = me["w"] if c["weights"] else None
    chk = Checker(f"fuzz seed {c['seed']} rank {rank} ({c})")
    for permute in (False, True):
        kw = dict(num_experts=c["E"], permute=permute, expert_alignment=c["align"] if permute else 1,
                  num_worst_tokens=c["worst"][rank])
        got = cuda.dispatch(to_dev(me["x"], device), me["idx"].to(device), w.to(device) if w is not None else None, **kw)
        want = ref.dispatch(me["x"], me["idx"], w, **kw)
        name = "expert-major" if permute else "rank-major"
        for field in ("topk_idx", "topk_weights", "row_expert", "tokens_per_expert", "num_dropped"):
            chk.equal(f"{name} {field}", getattr(got, field), getattr(want, field))
        gx, gs = split_x(got.x)
        wx, ws = split_x(want.x)
        chk.equal(f"{name} x", gx, wx)
        chk.equal(f"{name} scales", gs, ws)
        # cached dispatch of the same rows (the routing's second use) must match as well
        again = cuda.dispatch(to_dev(me["x"], device), handle=got.handle, topk_weights=w.to(device) if w is not None else None)
        chk.equal(f"{name} cached x", split_x(again.x)[0], wx)
        rows = _combine_rows_from(want.x)
        cw = want.topk_weights * 2 if want.topk_weights is not None else None
        y = cuda.combine(rows.to(device), got.handle, weights=cw.to(device) if cw is not None else None)
        y_ref = ref.combine(rows, want.handle, weights=cw)
        chk.close(f"{name} combine", y.x, y_ref.x.double(), 2e-2 if rows.dtype == torch.bfloat16 else 1e-5)
        if cw is not None:
            chk.equal(f"{name} combine weights", y.weights, y_ref.weights)
    return chk.errors


def run_soak(cfg: dict) -> list:
    """`iters` dispatch + combine rounds with changing routing (both layouts, sometimes cached):
    every round trip of all-ones exact (checked on the device, one sync at the end), a full
    oracle check every 1000 rounds and at the last, and memory flat: allocated bytes and the pool's free bytes
    equal after the warm-up and at the end."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H = cfg["E"], cfg["K"], cfg["H"]
    L = E // R
    buf = get_buffer("cuda")
    errors = []
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(cfg["seed"] + rank)
    mem0 = pool0 = None
    for it in range(cfg["iters"]):
        T = int(torch.randint(0, cfg["t_max"] + 1, (1,)).item()) if it % 7 else cfg["t_max"]
        scores = torch.rand((T, E), device="cuda", generator=g)
        idx = scores.topk(K, dim=1).indices
        idx = torch.where(torch.rand((T, K), device="cuda", generator=g) < 0.2, -1, idx)
        x = torch.randn((T, H), device="cuda", generator=g).to(torch.bfloat16)
        permute = it % 2 == 1
        out = buf.dispatch(x, idx, None, num_experts=E, permute=permute, expert_alignment=16 if permute else 1)
        if it % 5 == 0:
            out = buf.dispatch(x, handle=out.handle)
        back = buf.combine(torch.ones_like(out.x), out.handle)
        valid = idx >= 0
        if permute:
            want = valid.sum(1)
        else:
            dst = torch.where(valid, idx // L, R)
            want = torch.nn.functional.one_hot(dst, R + 1)[..., :R].amax(1).sum(1)
        bad += (back.x.float() != want.unsqueeze(1).float()).any(dim=1).sum()
        if it % 1000 == 999 or it == cfg["iters"] - 1:  # (and the last round, for a short soak)
            torch.cuda.synchronize()
            exp = (expected_expert_major if permute else expected_rank_major)(*_gather_inputs(x, idx, R), rank, R, E,
                                                                              *([16] if permute else []))
            if not torch.equal(bits(out.x.cpu()), bits(exp["x"])):
                errors.append(f"[soak rank {rank}] iteration {it}: dispatch not exact")
        if it == cfg["warmup"]:
            torch.cuda.synchronize()
            mem0, pool0 = torch.cuda.memory_allocated(), buf._impl.rt.region.runtime.pool_free_bytes()
    del out, back
    torch.cuda.synchronize()
    if int(bad) != 0:
        errors.append(f"[soak rank {rank}] {int(bad)} tokens with a wrong round trip in {cfg['iters']} iterations")
    mem1, pool1 = torch.cuda.memory_allocated(), buf._impl.rt.region.runtime.pool_free_bytes()
    if mem0 is not None and mem1 > mem0 + (1 << 20):
        errors.append(f"[soak rank {rank}] allocated memory grew from {mem0} to {mem1} bytes")
    if pool0 is not None and pool1 < pool0:
        errors.append(f"[soak rank {rank}] pool free bytes fell from {pool0} to {pool1}")
    buf.synchronize()
    return errors


def _gather_inputs(x, idx, R):
    """Every rank's (x, idx) on the CPU, as oracle inputs (a gloo all_gather_object)."""
    mine = {"x": x.cpu(), "idx": idx.cpu(), "w": torch.zeros(idx.shape)}
    every = [None] * R
    dist.all_gather_object(every, mine)
    return (every,)


def run_lifetime_growth(cfg: dict) -> list:
    """A buffer without sizing hints: the first dispatch sizes it, a larger one grows it (on
    every rank together); outputs and handles from before stay valid; destroy() frees nothing a
    live tensor points into."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E = 4 * R
    chk = Checker(f"[lifetime R={R} rank={rank}]")
    buf = mep.Buffer(dist.group.WORLD, backend="cuda")
    small = make_inputs(cfg["seed"], R, E, 3, 256, [8] * R, "bf16", "random", 0.2)
    big = make_inputs(cfg["seed"] + 1, R, E, 3, 1024, [48] * R, "bf16", "random", 0.2)
    s, b = small[rank], big[rank]
    out1 = buf.dispatch(s["x"].cuda(), s["idx"].cuda(), s["w"].cuda(), num_experts=E)
    outp1 = buf.dispatch(s["x"].cuda(), s["idx"].cuda(), s["w"].cuda(), num_experts=E, permute=True, expert_alignment=16)
    region = buf._impl.rt.region
    total0 = region.plan.total
    out2 = buf.dispatch(b["x"].cuda(), b["idx"].cuda(), b["w"].cuda(), num_experts=E)
    if region.grown < 1 or region.plan.total <= total0:
        chk.errors.append(f"{chk.tag} the buffer did not grow for a larger call (grown {region.grown})")
    chk.equal("first output after growth", out1.x, expected_rank_major(small, rank, R, E)["x"])
    chk.equal("grown output", out2.x, expected_rank_major(big, rank, R, E)["x"])
    back = buf.combine(torch.ones_like(outp1.x), outp1.handle)  # a handle from before the growth
    chk.close("old handle round trip", back.x, num_destinations(s, R, E, True).unsqueeze(1).expand(-1, 256), 1e-6)
    again = buf.dispatch(s["x"].cuda(), handle=out1.handle)
    chk.equal("old handle cached dispatch", again.x, expected_rank_major(small, rank, R, E)["x"])
    # Megatron's schedule frees a node's input early with untyped_storage().resize_(0): pooled
    # outputs and zero-copy views allow it like torch allocations, and the block goes back
    freed = buf.dispatch(s["x"].cuda(), s["idx"].cuda(), s["w"].cuda(), num_experts=E)
    scratch = buf.get_combine_input(4, 256)
    try:
        for t in (freed.x, freed.topk_idx, freed.topk_weights, scratch):
            t.untyped_storage().resize_(0)
    except RuntimeError as e:
        chk.errors.append(f"{chk.tag} resize_(0) of a dispatch output or combine-input view raised: {e}")
    del freed, scratch
    again = buf.dispatch(s["x"].cuda(), handle=out1.handle)
    chk.equal("cached dispatch after outputs were resized away", again.x, expected_rank_major(small, rank, R, E)["x"])
    view = buf.get_combine_input(4, 256)
    view.fill_(1.5)
    out3 = buf.dispatch(b["x"].cuda(), b["idx"].cuda(), b["w"].cuda(), num_experts=E)
    buf.destroy()
    torch.cuda.synchronize()
    chk.equal("pooled output after destroy", out3.x, expected_rank_major(big, rank, R, E)["x"])
    if float(view.float().sum()) != 1.5 * 4 * 256:
        chk.errors.append(f"{chk.tag} a combine-input view changed after destroy")
    return chk.errors


def run_pool_takeover(cfg: dict) -> list:
    """The output pool holds one rank-major output: a cached dispatch (no host sync) made while the
    previous output is freed but still read on the device (behind a long kernel; with
    `side_stream`, on another stream it is freed on) takes its block over with a GPU-side wait
    and pushes (no host wait, no stage-and-pull); the late reader still sees the old rows."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T = 4 * R, 3, 256, 64
    chk = Checker(f"[pool takeover R={R} rank={rank}]")
    # room for one worst-case output (R*T rows of data, ids and weights): one real output fits, two
    # do not (a rank receives ~61-88% of the worst case here)
    pool_bytes = R * T * (2 * H + 12 * K) + 4096
    buf = mep.Buffer(dist.group.WORLD, backend="cuda", max_tokens_per_rank=T, hidden=H, num_experts=E, max_topk=K,
                     pool_bytes=pool_bytes)
    try:
        # looked up at each use: the first dispatch may re-create the region (and its pool)
        stats = lambda: list(tracing.counters(buf)["pool"].values())  # noqa: E731
        inp = make_inputs(cfg["seed"], R, E, K, H, [T] * R, "bf16", "random", 0.0)
        me = inp[rank]
        out = buf.dispatch(me["x"].cuda(), me["idx"].cuda(), me["w"].cuda(), num_experts=E)
        handle = out.handle
        chk.equal("first output", out.x, expected_rank_major(inp, rank, R, E)["x"])
        g = torch.Generator().manual_seed(cfg["seed"] + 1)  # the same new rows on every rank
        for i in range(cfg["rounds"]):
            for r in range(R):
                inp[r]["x"] = torch.randn((T, H), generator=g).to(torch.bfloat16)
            want = expected_rank_major(inp, rank, R, E)["x"]
            want_sum = float(out.x.float().sum())
            # on the GPU before the sleep: a blocking .cuda() after it would wait for the stream, so
            # the late read and the block's release would be done before the dispatch (no takeover)
            x_new = inp[rank]["x"].cuda()
            # side_stream: the late read runs on another stream, and the output dies there (as a
            # consumer on Megatron's compute stream frees a dispatch made on its comm stream): the
            # pool must wait for that stream too, torch's record_stream does not reach it
            reader = torch.cuda.Stream() if cfg.get("side_stream") else torch.cuda.current_stream()
            reader.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(reader):
                torch.cuda._sleep(100_000_000)  # ~50 ms: the last read below, and so the release, wait for it
                late_sum = out.x.float().sum()
                del out  # its block goes back to the pool behind the late read (an event on this stream)
            before = stats()
            out = buf.dispatch(x_new, handle=handle)
            d = [b - a for a, b in zip(before, stats())]
            if d != [1, 0]:
                chk.errors.append(f"{chk.tag} round {i}: pool (GPU-side waits, misses) moved by {d}, "
                                  "expected one GPU-side takeover")
            torch.cuda.synchronize()  # the late read may be on another stream
            if float(late_sum) != want_sum:
                chk.errors.append(f"{chk.tag} round {i}: the previous output read behind the takeover summed to "
                                  f"{float(late_sum)}, expected {want_sum}: the new push overwrote it too early")
            chk.equal(f"round {i} output", out.x, want)
        torch.cuda.synchronize()
    finally:
        buf.destroy()
    return chk.errors


def run_num_sms_bound(_cfg=None) -> list:
    import pytest

    try:
        with pytest.raises(ValueError, match="num_sms"):
            mep.Buffer(dist.group.WORLD, backend="cuda", num_sms=100000, max_tokens_per_rank=8, hidden=128)
    except BaseException as exc:  # noqa: BLE001
        return [f"rank {dist.get_rank()}: num_sms bound: {exc}"]
    return []


def run_reserve(cfg: dict) -> list:
    """Buffer.reserve sizes an unsized buffer, then grows a sized one, for the largest of every
    rank's needs (each rank asks for a different number of combine rows); afterwards a
    worst-case sized dispatch of that many rows fits on every rank and is exact."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T = 4 * R, 3, 256, 8
    chk = Checker(f"[reserve R={R} rank={rank}]")
    buf = mep.Buffer(dist.group.WORLD, backend="cuda")
    inputs = make_inputs(cfg["seed"], R, E, K, H, [T] * R, "bf16", "random", 0.2)
    me = inputs[rank]
    for base, step in ((200, 100), (5000, 1000)):  # first sizes, then grows
        rows = base + step * rank  # every rank asks for a different number of rows
        buf.reserve(max_tokens=T, hidden=H, dtype_bytes=2, topk=K, num_experts=E, combine_rows=rows)
        widest = base + step * (R - 1)  # the largest request: what the buffer must now hold
        out = buf.dispatch(me["x"].cuda(), me["idx"].cuda(), me["w"].cuda(), num_experts=E, permute=True,
                           expert_alignment=16, num_worst_tokens=widest)
        exp = expected_expert_major(inputs, rank, R, E, 16)
        m = exp["x"].shape[0]
        chk.equal(f"reserved {rows}: x", out.x[:m], exp["x"])
        back = buf.combine(torch.ones_like(out.x), out.handle)
        chk.close(f"reserved {rows}: round trip", back.x, num_destinations(me, R, E, True).unsqueeze(1).expand(-1, H), 1e-6)
    buf.synchronize()
    buf.destroy()
    return chk.errors


def run_internode_peer_failure_case(cfg: dict) -> list:
    """Internode path: a failure before a rank's RDMA send is published to its same-index peers.
    (1) Every rank fails the same dispatch (an argument error): nothing waited, the buffer stays
    usable and the next dispatch is exact. (2) Only `failing_rank` fails (an expert id out of
    range on that rank alone): it raises its own ValueError; every other rank stops waiting for it
    at once (long before the 60 s timeout) and raises PeerFailedFatalError naming it, then
    BufferBrokenError."""
    import time

    from megatron_ep.core.errors import BufferBrokenError, PeerFailedFatalError

    R, rank, P, failing = dist.get_world_size(), dist.get_rank(), cfg["ranks_per_node"], cfg["failing_rank"]
    E, K, H, T = 4 * R, 2, 256, 8
    chk = Checker(f"[internode peer failure R={R} P={P} rank={rank}]")
    buf = mep.Buffer(dist.group.WORLD, backend="cuda", ranks_per_node=P, timeout_s=60.0, max_tokens_per_rank=T,
                     hidden=H, num_experts=E, max_topk=K)
    try:
        inp = make_inputs(cfg["seed"], R, E, K, H, [T] * R, "bf16", "random", 0.0)
        me = {k: v.cuda() for k, v in inp[rank].items()}
        try:  # (1) every rank: num_experts not a multiple of the group, refused before anything is sent
            buf.dispatch(me["x"], me["idx"], me["w"], num_experts=E + 1)
            chk.errors.append(f"{chk.tag} num_experts={E + 1} did not raise")
        except ValueError:
            pass
        out = buf.dispatch(me["x"], me["idx"], me["w"], num_experts=E)
        chk.equal("after a call every rank failed", out.x, expected_rank_major(inp, rank, R, E)["x"])
        del out
        buf.synchronize()
        dist.barrier()
        # (2) one rank fails alone
        t0 = time.monotonic()
        idx = me["idx"].clone()
        if rank == failing:
            idx[0, 0] = E + 5
        try:
            buf.dispatch(me["x"], idx, me["w"], num_experts=E)
            buf.synchronize()
            if rank == failing or rank % P == failing % P:  # the failing rank, and its same-index peers
                chk.errors.append(f"{chk.tag} the dispatch rank {failing} failed did not raise here")
        except ValueError:
            if rank != failing:
                chk.errors.append(f"{chk.tag} raised the failing rank's ValueError")
        except PeerFailedFatalError as exc:
            if rank == failing or f"rank {failing}" not in str(exc):
                chk.errors.append(f"{chk.tag} unexpected {exc}")
            if time.monotonic() - t0 > 20:
                chk.errors.append(f"{chk.tag} stopped after {time.monotonic() - t0:.0f} s (the publication did not "
                                  "stop the wait)")
            try:
                buf.dispatch(me["x"], me["idx"], me["w"], num_experts=E)
                chk.errors.append(f"{chk.tag} a buffer broken by a peer's failure accepted a dispatch")
            except BufferBrokenError:
                pass
        except Exception as exc:  # noqa: BLE001
            if rank == failing:
                chk.errors.append(f"{chk.tag} the failing rank raised {type(exc).__name__}: {exc}")
            # other ranks of the failing rank's node may see the intranode stage's PeerFailedError first
    finally:
        try:
            buf.destroy()
        except Exception:  # noqa: BLE001 - broken buffers skip their collective free
            pass
    return chk.errors


# ------------------------------------------------------------------- one case of each path
def run_one_case_of_each_path(normal_cfg: dict, ll_cfg: dict) -> list:
    """A small case of each cuda path in this one pool: intranode, internode (every rank a node
    of its own) and low-latency (for a compute-sanitizer run: one pool start-up under the tool)."""
    errors = run_normal_cases([normal_cfg], backend="cuda", device="cuda")
    errors += run_normal_cases([dict(normal_cfg, sizing={"ranks_per_node": 1})], backend="cuda", device="cuda")
    errors += run_low_latency_cases([ll_cfg], backend="cuda", device="cuda")
    return errors
