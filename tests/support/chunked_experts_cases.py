"""Worker bodies for megatron_ep.experts.chunked_expert_mlp (run on every rank of a DistPool):
the chunked pipeline (and one chunk of it) against one round of autograd's dispatch, the expert
MLP and autograd's combine: outputs and the gradients of x, probs, w1 and w2, on
the torch backend (CPU) and the cuda backend (virtual ranks)."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cases import get_buffer
from graph_capture import captured
from refusals import derivative, exact_or_refused
from megatron_ep.core import autograd
from megatron_ep.experts import GroupedLayout, chunked_expert_mlp, expert_mlp


def _inputs(cfg: dict, rank: int, device: str):
    E, K, H, F_ = cfg["E"], cfg["K"], cfg["H"], cfg["F"]
    R = dist.get_world_size()
    T = cfg["Ts"][rank]
    g = torch.Generator().manual_seed(cfg["seed"] + rank)
    x = torch.randn((T, H), generator=g)
    if cfg.get("pattern") == "hot":  # every token's first slot on expert 0, the rest unused
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = 0
    else:
        idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
        idx = torch.where(torch.rand((T, K), generator=g) < cfg.get("p_drop", 0.0), -1, idx)
    probs = torch.rand((T, K), generator=g)
    wg = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)  # this rank's local experts
    L = E // R
    w1 = torch.randn((L, 2 * F_ if cfg.get("glu") else F_, H), generator=wg) / H ** 0.5
    w2 = torch.randn((L, H, F_), generator=wg) / F_ ** 0.5
    grad = torch.randn((T, H), generator=g)
    return [t.to(device) for t in (x, idx, probs, w1, w2, grad)]


def _one_round(buf, leaves, idx, cfg: dict, act) -> torch.Tensor:
    x, probs, w1, w2 = leaves
    align = cfg.get("align", 1)
    out = autograd.dispatch(buf, x, idx, probs, num_experts=cfg["E"], permute=True, expert_alignment=align)
    layout = GroupedLayout.of(out.x, out.tokens_per_expert)
    y = expert_mlp(out.x, out.topk_weights, w1, w2, layout, act, cfg.get("glu", False))
    return autograd.combine(buf, y, out.handle).x


def run_chunked_experts_case(cfg: dict, backend: str = "torch", device: str = "cpu") -> list:
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[chunked experts R={R} rank={rank} seed={cfg['seed']} Ts={cfg['Ts']} chunks={cfg['chunks']}]"
    try:
        buf = get_buffer(backend)
        x, idx, probs, w1, w2, grad = _inputs(cfg, rank, device)
        act = F.silu if cfg.get("glu") else F.gelu
        results = []
        dropped = []
        runs = [("one round", None, None), ("one chunk", 1, None), (f"{cfg['chunks']} chunks", cfg["chunks"], cfg.get("worst"))]
        for _, chunks, worst in runs:
            leaves = [t.detach().clone().requires_grad_(True) for t in (x, probs, w1, w2)]
            if chunks is None:  # the non-overlapped path: autograd's dispatch, the MLP, autograd's combine
                y = _one_round(buf, leaves, idx, cfg, act)
            else:
                y = chunked_expert_mlp(buf, leaves[0], idx, leaves[1], leaves[2], leaves[3], cfg["E"], chunks=chunks,
                                       expert_alignment=cfg.get("align", 1), activation=act, glu=cfg.get("glu", False),
                                       num_worst_tokens=worst, on_dispatch=lambda c, out: dropped.append(out.num_dropped))
            y.backward(grad)
            results.append([y.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves])
        errors = []
        if cfg.get("worst") and int(sum(int(d) for d in dropped if d is not None)) != 0:
            errors.append(f"{tag} a worst-case size of {cfg['worst']} rows dropped rows: the case checks nothing")
        for (label, _, _), many in zip(runs[1:], results[1:]):
            for name, one, got in zip(("output", "grad x", "grad probs", "grad w1", "grad w2"), results[0], many):
                if one.shape != got.shape or not torch.allclose(one, got, rtol=1e-4, atol=1e-5):
                    diff = (one - got).abs().max().item() if one.shape == got.shape else f"shapes {one.shape} {got.shape}"
                    errors.append(f"{tag} {name}: {label} differs from one round (max abs diff {diff})")
        if cfg["Ts"][rank] and not results[0][0].abs().sum() > 0:
            errors.append(f"{tag} the output is all zero: the case checks nothing")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def cases(R: int) -> list:
    """Uneven token counts with an empty rank, -1 slots, one hot expert, more chunks than some
    ranks have tokens, SwiGLU with expert alignment."""
    Ts = [5, 0, 9, 3, 7, 1, 4, 6][:R]
    return [dict(seed=300 + R, E=2 * R, K=2, H=16, F=8, Ts=Ts, chunks=3, p_drop=0.2),
            dict(seed=310 + R, E=4 * R, K=3, H=16, F=8, Ts=[8] * R, chunks=4, pattern="hot"),
            dict(seed=320 + R, E=2 * R, K=2, H=32, F=16, Ts=Ts, chunks=6, glu=True, align=4),
            dict(seed=330 + R, E=2 * R, K=2, H=16, F=8, Ts=Ts, chunks=3, glu=True, align=4, worst=96)]


def run_chunked_experts_cases(cfgs: list, backend: str = "torch", device: str = "cpu") -> list:
    return [e for cfg in cfgs for e in run_chunked_experts_case(cfg, backend, device)]


def run_marks_case(cfg: dict) -> list:
    """The timeline hook sees each chunk's dispatch issued one chunk ahead of its GEMMs."""
    R, rank = dist.get_world_size(), dist.get_rank()
    buf = get_buffer("torch")
    x, idx, probs, w1, w2, _ = _inputs(cfg, rank, "cpu")
    seen = []
    chunked_expert_mlp(buf, x, idx, probs, w1, w2, cfg["E"], chunks=3, mark=lambda point, c: seen.append((point, c)))
    want = [("dispatched", 0), ("dispatched", 1), ("started", 0), ("computed", 0), ("combined", 0),
            ("dispatched", 2), ("started", 1), ("computed", 1), ("combined", 1), ("started", 2), ("computed", 2),
            ("combined", 2)]
    return [] if seen == want else [f"[marks R={R} rank={rank}] {seen}, expected {want}"]


def run_worst_case_drops_case(cfg: dict) -> list:
    """Worst-case sized chunks of one row: rows past it are dropped and counted per chunk (not
    lost silently), and the output still has every token's row."""
    R, rank = dist.get_world_size(), dist.get_rank()
    buf = get_buffer("torch")
    x, idx, probs, w1, w2, _ = _inputs(dict(cfg, Ts=[8] * R), rank, "cpu")
    seen = []
    y = chunked_expert_mlp(buf, x, idx, probs, w1, w2, cfg["E"], chunks=2, num_worst_tokens=1,
                           on_dispatch=lambda c, out: seen.append((c, int(out.num_dropped), out.x.shape[0])))
    errors = []
    if [c for c, _, _ in seen] != [0, 1] or any(rows != 1 for _, _, rows in seen):
        errors.append(f"[worst-case drops rank {rank}] chunks seen {seen}, expected two of one row each")
    total = torch.tensor([sum(d for _, d, _ in seen)])
    dist.all_reduce(total)
    if int(total) == 0:
        errors.append(f"[worst-case drops rank {rank}] no row was counted as dropped with one row per chunk")
    if tuple(y.shape) != tuple(x.shape):
        errors.append(f"[worst-case drops rank {rank}] output {tuple(y.shape)}, expected {tuple(x.shape)}")
    return errors


class _SeenCarveout(torch.autograd.Function):
    """An identity that records torch's SM carveout when its forward and backward run: placed
    between the chunks' GEMMs (as the activation), it sees what the GEMMs beside it saw."""

    @staticmethod
    def forward(ctx, h, seen):
        ctx.seen = seen
        seen.append(("forward", torch._C._get_sm_carveout_experimental()))
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(("backward", torch._C._get_sm_carveout_experimental()))
        return g, None


def run_carveout_case(cfg: dict) -> list:
    """The chunks' expert MLPs, forward and backward, run with `comm_sms` SMs left free, and the
    carveout is restored between them and after (one chunk: none by default)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    buf = get_buffer("torch")
    x, idx, probs, w1, w2, grad = _inputs(dict(cfg, Ts=[8] * R), rank, "cpu")
    before = torch._C._get_sm_carveout_experimental()
    errors = []
    for chunks, comm_sms, want in ((3, 6, 6), (1, None, before)):
        seen = []
        leaves = [t.detach().requires_grad_() for t in (x, probs, w1, w2)]
        y = chunked_expert_mlp(buf, leaves[0], idx, leaves[1], leaves[2], leaves[3], cfg["E"], chunks=chunks,
                               activation=lambda h: F.gelu(_SeenCarveout.apply(h, seen)), comm_sms=comm_sms)
        outside = torch._C._get_sm_carveout_experimental()
        y.backward(grad)
        got = sorted(set(seen))
        expect = [("backward", want), ("forward", want)]
        if got != expect or outside != before or torch._C._get_sm_carveout_experimental() != before:
            errors.append(f"[carveout R={R} rank={rank} chunks={chunks}] inside the GEMMs {got}, expected {expect}; "
                          f"between forward and backward {outside}, after {torch._C._get_sm_carveout_experimental()}, "
                          f"expected {before}")
    return errors


def _bf16(inputs: list) -> list:
    """x, w1, w2 and the output gradient in bf16 (idx and probs as they are): the GEMMs then run
    on the device-side offsets of torch's grouped_mm, with no host sync (fp32 rows take the
    per-expert loop, which reads the counts on the host and cannot be captured)."""
    return [t.to(torch.bfloat16) if i in (0, 3, 4, 5) else t.clone() for i, t in enumerate(inputs)]


def run_chunked_graph_case(cfg: dict) -> list:
    """Worst-case sized chunks (no host sync anywhere) on the cuda backend, forward and backward
    (autograd.grad of the layer's output) captured in one CUDA graph: replays on new tokens,
    routing and output gradients equal the eager layer on the same inputs, and a rank with no
    tokens replays its empty chunks in step with the others."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[chunked graph R={R} rank={rank} chunks={cfg['chunks']}]"
    errors = []  # kept when a later replay raises
    try:
        buf = get_buffer("cuda")
        E, align, act = cfg["E"], cfg.get("align", 1), (F.silu if cfg.get("glu") else F.gelu)
        statics = _bf16(_inputs(cfg, rank, "cuda"))  # x, idx, probs, w1, w2, grad
        leaves = [statics[i].requires_grad_() for i in (0, 2, 3, 4)]

        def step(x, idx, probs, w1, w2, grad):
            y = chunked_expert_mlp(buf, x, idx, probs, w1, w2, E, chunks=cfg["chunks"], expert_alignment=align,
                                   activation=act, glu=cfg.get("glu", False), num_worst_tokens=cfg["worst"])
            grads = torch.autograd.grad(y, (x, probs, w1, w2), grad, allow_unused=True)
            return [y] + [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (x, probs, w1, w2))]

        graph, got = captured(step, *statics, warmups=2)
        for it in range(3):
            fresh = _bf16(_inputs(dict(cfg, seed=cfg["seed"] + 97 * (it + 1)), rank, "cuda"))
            with torch.no_grad():
                for s, f in zip(statics, fresh):
                    s.copy_(f)
            graph.replay()
            want = step(*[f.requires_grad_() if i in (0, 2, 3, 4) else f for i, f in enumerate(fresh)])
            torch.cuda.synchronize()
            for name, g, w in zip(("output", "grad x", "grad probs", "grad w1", "grad w2"), got, want):
                g, w = g.float(), w.float()  # within bf16 rounding of the eager layer's
                scale = w.abs().max().item() if w.numel() else 1.0  # a rank without tokens has empty ones
                if g.shape != w.shape or not torch.allclose(g, w, rtol=1e-2, atol=1e-2 * max(scale, 1e-6)):
                    diff = f"{(g - w).abs().max().item():.3g}" if g.shape == w.shape else f"shapes {tuple(g.shape)}"
                    errors.append(f"{tag} replay {it} {name}: max abs diff {diff} from eager")
            if cfg["Ts"][rank] and not want[0].abs().sum() > 0:
                errors.append(f"{tag} replay {it}: the output is all zero: the case checks nothing")
        dist.barrier()
        del leaves
        return errors
    except Exception:
        return errors + [f"{tag} raised:\n{traceback.format_exc()}"]


def graph_cases(R: int) -> list:
    """An empty rank, -1 slots and SwiGLU with alignment; the worst case covers any routing."""
    Ts = [5, 0, 9, 3, 7, 1, 4, 6][:R]
    worst = R * max(Ts) * 2 + 2 * 2 * 4  # R * T * min(K, L) + L * (align - 1), rounded up
    return [dict(seed=340 + R, E=2 * R, K=2, H=32, F=16, Ts=Ts, chunks=3, glu=True, align=4, p_drop=0.2,
                 worst=worst)]


def run_chunked_graph_cases(cfgs: list) -> list:
    return [e for cfg in cfgs for e in run_chunked_graph_case(cfg)]


def _chunked(buf, leaves, idx, cfg, **options):
    x, probs, w1, w2 = leaves
    return chunked_expert_mlp(buf, x, idx, probs, w1, w2, cfg["E"], chunks=cfg["chunks"], **options)


def run_chunked_edges_case(cfg: dict, backend: str = "torch", device: str = "cpu") -> list:
    """What a chunked layer must not get silently wrong: a second derivative through it raises
    (naming it) instead of missing its part; a second backward after retain_graph=True raises
    instead of failing inside; bf16 router probs are taken and their gradient comes back in bf16,
    equal to the fp32 probs' gradient rounded; on the torch backend an fp64 probs gradient keeps
    fp64 precision (against one round); probs of the wrong kind raise naming `probs`. Each check
    runs on its own (an exception in one is reported, the next still runs: every rank makes the
    same calls)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[chunked edges R={R} rank={rank} {backend}]"
    buf = get_buffer(backend)
    x, idx, probs, w1, w2, grad = _inputs(cfg, rank, device)

    def leaves(dtype=None, probs_dtype=None):
        ts = [t.detach().clone() for t in (x, probs, w1, w2)]
        if dtype is not None:
            ts = [t.to(dtype) for t in ts]
        if probs_dtype is not None:
            ts[1] = ts[1].to(probs_dtype)
        return [t.requires_grad_(True) for t in ts]

    def double_backward():
        lv = leaves()
        y = _chunked(buf, lv, idx, cfg)
        gx = torch.autograd.grad((y * grad).sum(), lv[0], create_graph=True)[0]
        try:
            (gx * gx).sum().backward()
            return ["a double backward through the chunked layer raised nothing"]
        except RuntimeError as e:
            if "chunked_expert_mlp" not in str(e) or "second derivatives" not in str(e):
                return [f"double backward: {e!r} does not say what is unsupported"]
        return []

    def second_backward():
        lv = leaves()
        y = _chunked(buf, lv, idx, cfg)
        y.backward(grad, retain_graph=True)
        try:
            y.backward(grad)
            return ["a second backward through the chunked layer raised nothing"]
        except RuntimeError as e:
            if "second backward" not in str(e):
                return [f"second backward: {e!r} does not say a second backward is not supported"]
        return []

    def bf16_probs():
        got = {}
        for name, pd in (("fp32", None), ("bf16", torch.bfloat16)):
            lv = leaves(probs_dtype=pd)
            _chunked(buf, lv, idx, cfg).backward(grad)
            got[name] = lv[1].grad
        if got["bf16"].dtype != torch.bfloat16:
            return [f"bf16 probs got a {got['bf16'].dtype} gradient"]
        if not torch.allclose(got["bf16"].float(), got["fp32"], rtol=2e-2, atol=1e-2):
            return [f"bf16 probs' gradient differs from fp32's by {(got['bf16'].float() - got['fp32']).abs().max().item():.3g}"]
        return []

    def fp64_probs():  # the torch backend moves fp64 weights; the cuda backend takes fp32
        lv = leaves(dtype=torch.float64)
        _chunked(buf, lv, idx, cfg).backward(grad.double())
        one = leaves(dtype=torch.float64)
        _one_round(buf, one, idx, cfg, F.gelu).backward(grad.double())
        err = (lv[1].grad - one[1].grad).abs().max().item() if lv[1].grad.numel() else 0.0
        if lv[1].grad.dtype != torch.float64 or err > 1e-12:
            return [f"fp64 probs' gradient: {lv[1].grad.dtype}, {err:.3g} from one round"]
        return []

    def integer_probs():
        try:
            _chunked(buf, [x, idx.clone(), w1, w2], idx, cfg)
            return ["integer probs were accepted"]
        except TypeError as e:
            return [] if "probs" in str(e) else [f"integer probs: {e!r} does not name probs"]

    errors = []
    for check in (double_backward, second_backward, bf16_probs) + ((fp64_probs,) if backend == "torch" else ()) + (integer_probs,):
        try:
            errors += [f"{tag} {e}" for e in check()]
        except Exception:
            errors.append(f"{tag} {check.__name__} raised:\n{traceback.format_exc()}")
        dist.barrier()
    return errors


REFUSED = ("chunked_expert_mlp", "second derivatives")  # what its refusal must say


def run_second_derivative_case(cfg: dict) -> list:
    """A second derivative through chunked_expert_mlp is exact (one round's, whose dispatch and
    combine are differentiable to any order) or raises naming the layer: for every subset of x,
    probs, w1, w2 that requires grad, taken by autograd.grad(..., inputs) and by .backward(), with a
    term outside the layer (each input cubed) that a derivative missing the layer's part still has."""
    R, rank = dist.get_world_size(), dist.get_rank()
    buf = get_buffer("torch")
    x, idx, probs, w1, w2, grad = [t.double() if t.is_floating_point() else t for t in _inputs(cfg, rank, "cpu")]
    E = cfg["E"]

    def chunked(x, probs, w1, w2):
        return chunked_expert_mlp(buf, x, idx, probs, w1, w2, E, chunks=cfg["chunks"])

    def one_round(x, probs, w1, w2):
        return _one_round(buf, [x, probs, w1, w2], idx, cfg, F.gelu)

    errors = []
    for mask in range(1, 16):
        wanted = [bool(mask >> i & 1) for i in range(4)]
        names = "+".join(n for n, w in zip(("x", "probs", "w1", "w2"), wanted) if w)
        for how in ("grad", "backward"):
            tag = f"[second derivative R={R} rank={rank} inputs {names}, {how}]"
            try:
                want = derivative(one_round, [x, probs, w1, w2], wanted, grad, how)
                got = derivative(chunked, [x, probs, w1, w2], wanted, grad, how)
                errors += exact_or_refused(tag, got, want, REFUSED)
                if mask == 1 and not isinstance(want, BaseException) and torch.allclose(want[0], 6 * x):
                    errors.append(f"{tag}: the layer adds nothing to the reference: the case checks nothing")
            except Exception:
                errors.append(f"{tag} raised:\n{traceback.format_exc()}")
            dist.barrier()
    return errors


def run_gradgradcheck_case(cfg: dict) -> list:
    """torch.autograd.gradgradcheck of a small fp64 chunked layer (one rank: the numerical
    derivative perturbs only this rank's inputs) passes or raises naming the layer."""
    rank = dist.get_rank()
    buf = get_buffer("torch")
    x, idx, probs, w1, w2, grad = [t.double() if t.is_floating_point() else t for t in _inputs(cfg, rank, "cpu")]
    leaves = [t.requires_grad_() for t in (x, probs, w1, w2)]

    def layer(x, probs, w1, w2):
        return chunked_expert_mlp(buf, x, idx, probs, w1, w2, cfg["E"], chunks=cfg["chunks"])

    try:
        got = torch.autograd.gradgradcheck(layer, leaves, (grad,), raise_exception=True)
    except Exception as e:
        got = e
    return exact_or_refused(f"[gradgradcheck rank={rank}]", got, None, REFUSED) if isinstance(got, BaseException) else []
