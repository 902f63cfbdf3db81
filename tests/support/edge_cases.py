"""Edges where a call used to give a wrong answer without an error, run on every rank of a
DistPool on either backend: a cached dispatch handing back the first dispatch's tensors, second
derivatives of dispatch and combine (cases.run_gradcheck(order=2) on CPU; against it on GPU), the weights' gradient of an FP8 dispatch, a previous_event
of the wrong kind, two threads calling one Buffer at once, a derivative through the plain
calls' outputs. Each body returns error strings."""

from __future__ import annotations

import threading
import types

import torch
import torch.distributed as dist

import megatron_ep as mep
from cases import _per_row, get_buffer, make_buffer
from megatron_cases import guarded
from megatron_ep.core import output_hook as hooks
from megatron_ep.core.errors import BufferBusyError
from oracle import _routing, make_inputs, num_destinations, split_x


def _tag(what: str) -> str:
    return f"[{what} R={dist.get_world_size()} rank={dist.get_rank()}]"


# ------------------------------------------------------------- a cached dispatch's outputs
_META = ("topk_idx", "row_expert", "tokens_per_expert", "num_dropped")


def _meta(out) -> dict:
    return {k: (None if getattr(out, k) is None else getattr(out, k).clone()) for k in _META}


@guarded
def run_cached_outputs_are_the_callers(backend: str = "torch", device: str = "cpu") -> list:
    """Outputs of a call are the caller's: a caller that edits the first dispatch's routing
    outputs in place, then the cached dispatch's, still gets the routing's own values from every
    later cached dispatch, and no two calls share an output tensor (both layouts, with and
    without worst-case sizing)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, Ts = 4 * R, 2, 128, [3 + 2 * s for s in range(R)]
    inputs = make_inputs(905, R, E, K, H, Ts, "bf16", "random", 0.3)
    me = inputs[rank]
    x, idx, w = me["x"].to(device), me["idx"].to(device), me["w"].to(device)
    buf = get_buffer(backend)
    errors = []
    for permute, worst in ((False, 0), (True, 0), (False, 3 * R), (True, 4 * R)):
        tag = _tag(f"cached dispatch permute={permute} worst={worst}")
        opts = dict(num_worst_tokens=worst) if worst else {}
        first = buf.dispatch(x, idx, w, num_experts=E, permute=permute, expert_alignment=4 if permute else 1, **opts)
        want = _meta(first)
        outs = [first]
        for _ in range(2):
            for k in _META:  # what a caller may do to its own outputs
                t = getattr(outs[-1], k)
                if t is not None:
                    t.fill_(0)
            outs.append(buf.dispatch(x, handle=first.handle, topk_weights=w))
            got = _meta(outs[-1])
            for k in _META:
                if (got[k] is None) != (want[k] is None) or (got[k] is not None and not torch.equal(got[k].cpu(), want[k].cpu())):
                    errors.append(f"{tag} {k}: the cached dispatch returned {got[k]} after the caller edited an "
                                  f"earlier call's output, want {want[k]}")
        for k in _META:
            seen = [getattr(o, k) for o in outs if getattr(o, k) is not None]
            if len({t.data_ptr() for t in seen if t.numel()}) != len([t for t in seen if t.numel()]):
                errors.append(f"{tag} {k}: two calls returned the same memory")
        buf.synchronize()
    return errors


# ------------------------------------------------------------------- second derivatives
def _second_order(buf, x, idx, w, E, permute, u, v):
    """d/d(x, w) of <d/d(x, w) <F(x, w), v>, u>, F = dispatch -> per-row function -> combine."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = mep.dispatch(buf, x, idx, w, num_experts=E, permute=permute, expert_alignment=4 if permute else 1)
    f, cw = _per_row(out, permute)
    res = mep.combine(buf, f, out.handle, weights=cw)
    first = torch.autograd.grad((res.x * v[0]).sum() + (res.weights * v[1]).sum(), (x, w), create_graph=True)
    second = torch.autograd.grad((first[0] * u[0]).sum() + (first[1] * u[1]).sum(), (x, w))
    return [t.detach().cpu().double() for t in first + second]


@guarded
def run_double_backward_matches_reference(device: str = "cuda") -> list:
    """The cuda backend's first and second derivatives against the torch backend's (on CPU, the
    one gradgradcheck verifies) for the same fp32 problem, both layouts."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T = 4 * R, 3, 64, 5 + rank
    g = torch.Generator().manual_seed(4100 + rank)
    x = torch.randn((T, H), generator=g)
    w = torch.rand((T, K), generator=g) + 0.5
    idx = _routing(g, T, E, K, R, "random", 0.25)
    v = (torch.randn((T, H), generator=g), torch.randn((T, K), generator=g))
    u = (torch.randn((T, H), generator=g), torch.randn((T, K), generator=g))
    ref_buf, buf = get_buffer("torch"), get_buffer("cuda")
    errors = []
    for permute in (False, True):
        want = _second_order(ref_buf, x, idx, w, E, permute, u, v)
        got = _second_order(buf, x.to(device), idx.to(device), w.to(device), E, permute,
                            tuple(t.to(device) for t in u), tuple(t.to(device) for t in v))
        for name, a, b in zip(("grad x", "grad w", "second x", "second w"), got, want):
            err = (a - b).abs().max().item() if a.numel() else 0.0
            if not torch.isfinite(a).all() or err > 1e-4 * (b.abs().max().item() + 1):
                errors.append(f"{_tag(f'double backward permute={permute}')} {name}: max error {err:.3g}")
        if not any(t.abs().sum() > 0 for t in want[2:]) and T:
            errors.append(f"{_tag('double backward')} the reference's second derivative is zero: nothing checked")
    return errors


# ---------------------------------------------------------------- FP8 x, weights' gradient
@guarded
def run_fp8_weights_gradient(backend: str = "torch", device: str = "cpu") -> list:
    """An FP8 dispatch whose topk_weights require grad: its row weights carry a graph and the
    weights' gradient equals a bf16 dispatch's with the same routing (it depends on the routing
    alone), both layouts; x itself stays without gradient."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, Ts = 4 * R, 3, 256, [4 + s for s in range(R)]
    fp8 = make_inputs(906, R, E, K, H, Ts, "fp8", "random", 0.2)[rank]
    bf16 = make_inputs(906, R, E, K, H, Ts, "bf16", "random", 0.2)[rank]
    idx = fp8["idx"].to(device)
    buf = get_buffer(backend)
    errors = []
    for permute in (False, True):
        tag = _tag(f"fp8 weights gradient permute={permute}")
        grads = []
        for x in (tuple(t.to(device) for t in fp8["x"]), bf16["x"].to(device)):
            w = fp8["w"].to(device).clone().requires_grad_()
            out = mep.dispatch(buf, x, idx, w, num_experts=E, permute=permute, expert_alignment=4 if permute else 1)
            if not out.topk_weights.requires_grad:
                errors.append(f"{tag} out.topk_weights does not require grad for x of {split_x(x)[0].dtype}")
                grads.append(None)
                continue
            g = torch.arange(out.topk_weights.numel(), dtype=torch.float32, device=device).reshape(out.topk_weights.shape)
            (out.topk_weights * g).sum().backward()
            grads.append(w.grad)
        if grads[0] is None or grads[1] is None or not torch.equal(grads[0].cpu(), grads[1].cpu()):
            errors.append(f"{tag} the weights' gradient {grads[0]} differs from the bf16 dispatch's {grads[1]}")
    return errors


# ------------------------------------------------------------------------ previous_event
@guarded
def run_previous_event_of_the_wrong_kind(backend: str = "torch", device: str = "cpu") -> list:
    """A previous_event that is not an EventOverlap raises a TypeError naming it, on every rank,
    before anything is sent; the buffer works afterwards. (Likewise a layout's counts_dtype that
    is neither int64 nor int32.)"""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H = 2 * R, 2, 128
    me = make_inputs(907, R, E, K, H, [4] * R, "bf16", "random", 0.0)[rank]
    x, idx, w = me["x"].to(device), me["idx"].to(device), me["w"].to(device)
    buf = get_buffer(backend)
    good = buf.dispatch(x, idx, w, num_experts=E)
    errors = []
    for name, arg, fn in (
            ("dispatch", "previous_event", lambda: buf.dispatch(x, idx, w, num_experts=E, previous_event="event")),
            ("combine", "previous_event", lambda: buf.combine(split_x(good.x)[0], good.handle, previous_event=3)),
            ("get_dispatch_layout", "counts_dtype", lambda: buf.get_dispatch_layout(idx, E, counts_dtype=torch.float32))):
        try:
            fn()
            errors.append(f"{_tag(name)} a {arg} of the wrong kind was accepted")
        except TypeError as e:
            if arg not in str(e):
                errors.append(f"{_tag(name)} {e!r} does not name {arg}")
    # the SM budget: below 1, or past what this rank may keep resident (cuda), refused by name
    limit = buf.max_num_sms
    for bad in (0, -3) if limit is None else (0, limit + 1):
        try:
            buf.set_num_sms(bad)
            errors.append(f"{_tag('set_num_sms')} num_sms={bad} was accepted (bound {limit})")
        except ValueError as e:
            if "num_sms" not in str(e):
                errors.append(f"{_tag('set_num_sms')} {e!r} does not name num_sms")
    buf.set_num_sms(2)  # the calls below on two SMs a rank (cuda)
    if buf.num_sms != (None if limit is None else 2):
        errors.append(f"{_tag('set_num_sms')} num_sms is {buf.num_sms} after set_num_sms(2)")
    try:
        ok = buf.dispatch(x, idx, w, num_experts=E)
        back = buf.combine(torch.ones_like(split_x(ok.x)[0]), ok.handle)
    finally:
        buf.set_num_sms(None)
    if not torch.equal(back.x.cpu().double(), num_destinations(me, R, E, False).unsqueeze(1).expand(-1, H)):
        errors.append(f"{_tag('previous_event')} the buffer is unusable afterwards")
    return errors


# ------------------------------------------------------------------- two threads, one Buffer
@guarded
def run_two_threads_one_buffer(backend: str = "torch", device: str = "cpu") -> list:
    """Thread A's dispatch is held inside the call (its output hook waits) while thread B calls
    the same Buffer: B's call raises BufferBusyError at once, naming the Buffer and both threads,
    and sends nothing; A's dispatch completes exactly; the Buffer then works from either thread.
    Every rank does the same, so the peers' calls still match."""
    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H = 2 * R, 2, 128
    me = make_inputs(908, R, E, K, H, [5] * R, "bf16", "random", 0.0)[rank]
    x, idx, w = me["x"].to(device), me["idx"].to(device), me["w"].to(device)
    buf = make_buffer(backend, max_tokens_per_rank=8)
    errors, inside, release, results = [], threading.Event(), threading.Event(), {}
    before = hooks._output_hook  # the suite's poisoning hook, if any: kept inside ours

    def hold(t):
        if threading.current_thread().name == "caller-A" and not inside.is_set():
            inside.set()
            release.wait(60)
        return before(t) if before is not None else t

    def call_a():
        try:
            out = buf.dispatch(x, idx, w, num_experts=E)
            results["a"] = buf.combine(torch.ones_like(split_x(out.x)[0]), out.handle).x
        except BaseException as e:  # reported below
            results["a"] = e

    def call_b():
        inside.wait(60)
        try:
            buf.dispatch(x, idx, w, num_experts=E)
            results["b"] = None
        except BaseException as e:
            results["b"] = e
        release.set()

    hooks.set_output_hook(hold)
    try:
        a = threading.Thread(target=call_a, name="caller-A")
        b = threading.Thread(target=call_b, name="caller-B")
        a.start()
        b.start()
        b.join(120)
        a.join(120)
    finally:
        hooks.set_output_hook(before)
    want = num_destinations(me, R, E, False).unsqueeze(1).expand(-1, H)
    tag = _tag("two threads")
    got_b = results.get("b")
    if not isinstance(got_b, BufferBusyError):
        errors.append(f"{tag} thread B's concurrent call gave {got_b!r}, want BufferBusyError")
    elif not all(s in str(got_b) for s in ("caller-A", "caller-B", f"Buffer #{buf.ordinal}")):
        errors.append(f"{tag} {got_b} does not name the Buffer and both threads")
    got_a = results.get("a")
    if not isinstance(got_a, torch.Tensor) or not torch.equal(got_a.cpu().double(), want):
        errors.append(f"{tag} thread A's call gave {got_a!r}, want its exact round trip")
    for who in ("A", "B"):  # the Buffer works afterwards, from either thread
        out = {}

        def again():
            d = buf.dispatch(x, idx, w, num_experts=E)
            out["y"] = buf.combine(torch.ones_like(split_x(d.x)[0]), d.handle).x

        t = threading.Thread(target=again, name=f"after-{who}")
        t.start()
        t.join(120)
        if not torch.equal(out.get("y", torch.empty(0)).cpu().double(), want):
            errors.append(f"{tag} the Buffer is unusable from thread {who} afterwards")
    buf.destroy()
    return errors


# ----------------------------------------------------- the plain calls carry no gradient
@guarded
def run_plain_calls_refuse_gradients(backend: str = "torch", device: str = "cpu") -> list:
    """Buffer's own calls are not differentiable: called with grad on and inputs that require
    it (directly, or in an autograd function's backward under create_graph=True), a derivative
    through their outputs raises naming the call, taken by autograd.grad(..., inputs) or by
    .backward(), instead of leaving their part out: dispatch / combine (autograd's give the exact
    derivative) and, on the torch backend, the low-latency pair (nothing to compare with)."""
    from refusals import derivative, exact_or_refused

    R, rank = dist.get_world_size(), dist.get_rank()
    E, K, H, T = 2 * R, 2, 128, 4 + rank
    g = torch.Generator().manual_seed(4200 + rank)
    x = torch.randn((T, H), generator=g).to(device)
    w = (torch.rand((T, K), generator=g) + 0.5).to(device)
    idx = _routing(g, T, E, K, R, "random", 0.0).to(device)
    grad = torch.randn((T, H), generator=g).to(device)
    buf = get_buffer(backend)

    def normal(call):
        def layer(x, w):
            out = call.dispatch(buf, x, idx, w, num_experts=E)
            return call.combine(buf, torch.tanh(out.x) * out.topk_weights.sum(1, keepdim=True), out.handle).x
        return layer

    plain = types.SimpleNamespace(dispatch=lambda b, *a, **k: b.dispatch(*a, **k),
                                  combine=lambda b, *a, **k: b.combine(*a, **k))

    def low_latency(x, w):
        out = buf.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=8, use_fp8=False)
        return buf.low_latency_combine(torch.tanh(out.x).contiguous(), idx, w, out.handle)

    says = ("is not differentiable", "megatron_ep.dispatch")
    errors = []
    for wanted in ([True, False], [False, True], [True, True]):
        for how in ("grad", "backward"):
            tag = _tag(f"plain calls {wanted} {how}")
            want = derivative(normal(mep), [x, w], wanted, grad, how, order=1)
            errors += exact_or_refused(tag, derivative(normal(plain), [x, w], wanted, grad, how, order=1), want, says,
                                       tol=1e-5)
            if backend == "torch":
                errors += exact_or_refused(f"{tag} low-latency", derivative(low_latency, [x, w], wanted, grad, how,
                                                                            order=1), None, says)
            dist.barrier()
    return errors


def run_all(backend: str = "torch", device: str = "cpu") -> list:
    errors = []
    for fn in (run_cached_outputs_are_the_callers, run_fp8_weights_gradient, run_previous_event_of_the_wrong_kind,
               run_two_threads_one_buffer, run_plain_calls_refuse_gradients):
        errors += fn(backend, device)
        dist.barrier()
    return errors
