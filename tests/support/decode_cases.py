"""Worker bodies for megatron_ep.megatron.decode (run on every rank of a gloo DistPool): a real
megatron-core MoELayer's decode step on the low-latency path (torch backend) against the same
layer's own forward, same weights and inputs. Returns failure messages (empty = pass)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_cases as mc


class FakeContext:
    """What the inference-context hook reads from Megatron's contexts."""

    def __init__(self, decode_only: bool):
        self.decode_only = decode_only

    def is_decode_only(self) -> bool:
        return self.decode_only


class WithContext(torch.nn.Module):
    """A stand-in for GPTModel / TransformerBlock: forward takes inference_context."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, hidden_states, inference_context=None):
        return self.moe(hidden_states)[0]


def _fake_grouped_gemm():
    """0.16's legacy GroupedMLP calls grouped_gemm's gmm (not installed on CPU): a loop with the
    library's contract, y[seg e] = x[seg e] @ w[e] (trans_b=False)."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    def gmm(x, w, batch_sizes, trans_b=False):
        outs, start = [], 0
        for e, n in enumerate(batch_sizes.tolist()):
            we = w[e].t() if trans_b else w[e]
            outs.append(x[start:start + n] @ we)
            start += n
        return torch.cat(outs) if outs else x.new_zeros((0, w.shape[-1] if not trans_b else w.shape[-2]))

    saved = (gg.assert_grouped_gemm_is_available, getattr(gg, "ops", None))
    gg.assert_grouped_gemm_is_available = lambda: None
    gg.ops = type("ops", (), {"gmm": staticmethod(gmm)})
    return saved


def _restore_grouped_gemm(saved):
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    gg.assert_grouped_gemm_is_available, gg.ops = saved


def _build(case, dispatcher, backend, experts, dtype):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_ep.experts import GroupedGemmExperts
    from megatron_ep.megatron import compat

    extra = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16)
    if case.get("capacity_factor"):  # the router drops (token, expert) pairs: -1 slots
        extra.update(moe_expert_capacity_factor=case["capacity_factor"], moe_token_drop_policy="probs")
    cfg = mc._moe_config(case, dispatcher, backend, **extra)
    mlp = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=experts == "legacy").submodules.mlp
    if experts == "grouped":
        mlp = compat.with_experts(mlp, GroupedGemmExperts)
    torch.manual_seed(case["seed"])  # router, shared expert: the same on every rank
    layer = MoELayer(cfg, compat.moe_submodules(mlp), layer_number=1, pg_collection=mc._pg_collection())
    r = dist.get_rank()
    g = torch.Generator().manual_seed(case["seed"] * 10 + r)  # routed experts differ per rank and per expert
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.router.expert_bias.copy_(torch.randn(case["E"], generator=torch.Generator().manual_seed(1)) * 0.1)
    return layer.eval()


@mc.guarded
def run_decode_vs_normal(case):
    """For each variant: the layer's own forward (Megatron's dispatcher + experts) vs the
    low-latency decode path, in eval mode without gradients."""
    import megatron_ep.megatron.decode as dec

    R, r = dist.get_world_size(), dist.get_rank()
    errors = []
    with mc.cpu_shims():
        mc._init_megatron()
    for dispatcher, backend, experts, dtype_name in case["variants"]:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        tag = f"[R={R} rank={r} {dispatcher}/{backend} {experts} {dtype_name}]"
        saved = _fake_grouped_gemm() if experts == "legacy" else None
        try:
            with mc.cpu_shims():
                layer = _build(case, dispatcher, backend, experts, dtype)
                S = case["S"][r]
                # Megatron's router cannot take 0 tokens (a view of an empty tensor), so for the
                # layer's own forward an idle rank brings one token; its peers' outputs do not
                # depend on it, and the decode step runs with none.
                x_ref = torch.randn((max(S, 1), 2, case["H"]), generator=torch.Generator().manual_seed(case["seed"] + 100 + r)).to(dtype)
                x = x_ref[:S]
                with torch.no_grad():
                    probs, rmap = layer.route(x_ref, None)
                    want = layer(x_ref)[0][:S]
                    shared = layer.shared_experts(x)
                    dec.enable_decode(layer, max_tokens_per_rank=case["max_tokens"])
                    st = layer.megatron_ep_decode
                    normal_again = layer(x_ref)[0][:S]  # outside a decode step: the layer's own path
                    with dec.decode_step():
                        got = layer(x)[0]
                dec.disable_decode(layer)
        finally:
            if saved is not None:
                _restore_grouped_gemm(saved)
        routed_slots = torch.tensor([int(rmap[:S * 2].sum()), S * 2 * case["K"]])
        dist.all_reduce(routed_slots)
        if case.get("capacity_factor") and routed_slots[0] >= routed_slots[1]:
            errors.append(f"{tag} the router dropped nothing: the case has no -1 slots")
        if (st.decode_calls, st.normal_calls) != (1, 1):
            errors.append(f"{tag} decode/normal calls {st.decode_calls}/{st.normal_calls}, want 1/1")
        if not torch.equal(normal_again, want):
            errors.append(f"{tag} outside decode_step the wrapped layer differs from its own forward")
        if got.shape != want.shape or got.dtype != want.dtype:
            errors.append(f"{tag} decode output {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
            continue
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        scale = max(1.0, want.float().abs().max().item()) if want.numel() else 1.0
        diff = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
        if diff > tol * scale:
            errors.append(f"{tag} decode vs Megatron forward: max abs diff {diff:.3g} (tolerance {tol * scale:.3g})")
        if want.numel() and (want.float() - shared.float()).abs().max().item() < 1e-3:
            errors.append(f"{tag} routed experts contribute nothing: the case does not test them")
    return errors


@mc.guarded
def run_decode_context_hook(case):
    """follow_inference_context: decode only when every rank's context is decode-only and its
    tokens fit; otherwise every rank takes the normal path (agreement over the EP group)."""
    import megatron_ep.megatron.decode as dec

    R, r = dist.get_world_size(), dist.get_rank()
    errors = []
    with mc.cpu_shims():
        mc._init_megatron()
        layer = _build(case, "flex", "deepep", "sequential", torch.float32)
        model = WithContext(layer).eval()
        dec.enable_decode(model, max_tokens_per_rank=case["max_tokens"])
        st = layer.megatron_ep_decode
        x = torch.randn((3, 2, case["H"]), generator=torch.Generator().manual_seed(7 + r))
        big = torch.randn((case["max_tokens"] + 1, 1, case["H"]), generator=torch.Generator().manual_seed(9 + r))
        with torch.no_grad():
            want = layer(x)[0]
            steps = [  # (what, input, this rank's context, decode expected)
                ("all decode-only", x, FakeContext(True), True),
                ("rank 0 in prefill", x, FakeContext(r != 0), False),
                ("no context", x, None, False),
                ("too many tokens on the last rank", big if r == R - 1 else x, FakeContext(True), False),
            ]
            for what, inp, ctx, expect in steps:
                before = st.decode_calls
                y = model(inp, inference_context=ctx)
                took = st.decode_calls > before
                if took != expect:
                    errors.append(f"[rank {r}] {what}: decode path taken={took}, want {expect}")
                if inp is x and not torch.allclose(y, want, rtol=1e-5, atol=1e-5):
                    errors.append(f"[rank {r}] {what}: output differs from the layer's own forward "
                                  f"({(y - want).abs().max().item():.3g})")
                if dec.is_decode_step():
                    errors.append(f"[rank {r}] {what}: the decode flag leaked past the model's forward")
        with torch.enable_grad():  # gradients on: never decode (training / prefill with autograd)
            before = st.decode_calls
            model(x, inference_context=FakeContext(True))
            if st.decode_calls != before:
                errors.append(f"[rank {r}] decode path taken with gradients enabled")
        dec.disable_decode(model)
        if "forward" in vars(layer) or getattr(model, "_megatron_ep_decode_hooks", None):
            errors.append(f"[rank {r}] disable_decode left the wrapper or hooks in place")
    return errors


# --------------------------------------------------------------------- refused decode steps
def _decode_layer(case):
    """A flex deepep layer with SequentialMLP experts, decode enabled, on the pool's ranks."""
    import megatron_ep.megatron.decode as dec

    with mc.cpu_shims():
        mc._init_megatron()
        layer = _build(case, "flex", "deepep", "sequential", torch.float32)
    dec.enable_decode(layer, max_tokens_per_rank=case["max_tokens"])
    return layer


def _steps_raise(tag: str, fn, want: dict, limit_s: float = 20.0) -> list:
    """fn() must raise, on this rank, an exception of type want["type"] whose text holds
    want["text"], within limit_s (the peers are told, not left waiting)."""
    import time

    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is checked below
        took = time.monotonic() - start
        if not isinstance(exc, want["type"]) or want["text"] not in str(exc):
            return [f"{tag}: {type(exc).__name__}: {str(exc)[:300]!r}, want {want['type'].__name__} "
                    f"mentioning {want['text']!r}"]
        return [f"{tag}: raised after {took:.1f}s (limit {limit_s}s)"] if took > limit_s else []
    return [f"{tag}: no error"]


@mc.guarded
def run_decode_refusals(case):
    """Decode steps a rank cannot run, on one rank or on all: every rank raises, none waits.
    (1) autograd on with parameters that require grad: refused (a decode step is not
    differentiable: a backward through it would drop the experts' and router's gradients);
    (2) one rank over max_tokens_per_rank; (3) one rank in a decode step while its peer runs
    the layer's normal forward (the decode Buffer is the flex manager's: CallMismatchError)."""
    import megatron_ep.megatron.decode as dec
    from megatron_ep.core.errors import CallMismatchError, PeerFailedError

    R, r = dist.get_world_size(), dist.get_rank()
    layer = _decode_layer(case)
    x = torch.randn((3, 2, case["H"]), generator=torch.Generator().manual_seed(5 + r))
    big = torch.randn((case["max_tokens"] + 1, 1, case["H"]), generator=torch.Generator().manual_seed(6 + r))
    mine = lambda text: dict(type=(RuntimeError, ValueError), text=text)  # noqa: E731
    peer = lambda text: dict(type=PeerFailedError, text=text)  # noqa: E731
    grad_text, tokens_text = "decode step runs without gradients", "more than max_tokens_per_rank"
    errors = []

    def step(inp, grad):
        with mc.cpu_shims(), torch.set_grad_enabled(grad), dec.decode_step():
            y = layer(inp.clone().requires_grad_(grad))[0]
            if grad:  # what a user would do next: a backward that would miss the experts' part
                y.sum().backward()

    errors += _steps_raise(f"[rank {r}] grad on every rank", lambda: step(x, True), dict(type=RuntimeError, text=grad_text))
    errors += _steps_raise(f"[rank {r}] grad on rank 0 only", lambda: step(x, r == 0),
                           mine(grad_text) if r == 0 else peer(grad_text))
    errors += _steps_raise(f"[rank {r}] rank {R - 1} over max_tokens_per_rank",
                           lambda: step(big if r == R - 1 else x, False),
                           mine(tokens_text) if r == R - 1 else peer(tokens_text))

    def half():
        with mc.cpu_shims(), torch.no_grad(), dec.decode_step(r == 0):
            layer(x)

    errors += _steps_raise(f"[rank {r}] decode on rank 0 only", half,
                           dict(type=CallMismatchError, text="low_latency_dispatch"))
    # the layer works afterwards, both ways
    with mc.cpu_shims(), torch.no_grad():
        want = layer(x)[0]
        with dec.decode_step():
            got = layer(x)[0]
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        errors.append(f"[rank {r}] after the refusals decode differs from the layer's forward "
                      f"({(got - want).abs().max().item():.3g})")
    return errors


@mc.guarded
def run_decode_weight_changes(case):
    """keep_weights=True, then the weights change as a user changes them: replaced Parameters
    (load_state_dict(assign=True)) on GroupedGemmExperts and SequentialMLP, and a dtype change
    (layer.to(bfloat16)) followed by refresh_decode_weights. Decode must follow the layer's own
    forward each time (and the refresh must work)."""
    import megatron_ep.megatron.decode as dec

    r = dist.get_rank()
    errors = []
    with mc.cpu_shims():
        mc._init_megatron()
    x = torch.randn((3, 2, case["H"]), generator=torch.Generator().manual_seed(11 + r))

    def compare(tag, layer, inp, tol):
        with mc.cpu_shims(), torch.no_grad():
            want = layer(inp)[0]
            with dec.decode_step():
                got = layer(inp)[0]
        scale = max(1.0, want.float().abs().max().item())
        diff = (got.float() - want.float()).abs().max().item()
        return [f"[rank {r}] {tag}: decode vs the layer's forward, max abs diff {diff:.3g}"] if diff > tol * scale else []

    for experts in ("grouped", "sequential"):
        with mc.cpu_shims():
            layer = _build(case, "flex", "hybridep" if experts == "grouped" else "deepep", experts, torch.float32)
        dec.enable_decode(layer, max_tokens_per_rank=case["max_tokens"], keep_weights=True)
        errors += compare(f"{experts}: before the change", layer, x, 1e-5)
        g = torch.Generator().manual_seed(300 + r)
        new = dict(layer.state_dict())
        for name, p in layer.experts.named_parameters():
            new["experts." + name] = torch.randn(p.shape, generator=g) * 0.3
        layer.load_state_dict(new, assign=True)
        errors += compare(f"{experts}: load_state_dict(assign=True)", layer, x, 1e-5)
        try:
            dec.refresh_decode_weights(layer)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"[rank {r}] {experts}: refresh_decode_weights after assign raised {type(exc).__name__}: {exc}")
        errors += compare(f"{experts}: after refresh", layer, x, 1e-5)
        layer.to(torch.bfloat16)
        try:
            dec.refresh_decode_weights(layer)
            errors += compare(f"{experts}: layer.to(bfloat16) then refresh", layer, x.to(torch.bfloat16), 2e-2)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"[rank {r}] {experts}: bfloat16 after keep_weights raised {type(exc).__name__}: {exc}")
        with torch.no_grad():  # an optimizer's in-place write: followed after a refresh
            for p in layer.experts.parameters():
                p.mul_(0.5)
        dec.refresh_decode_weights(layer)
        errors += compare(f"{experts}: in-place update then refresh", layer, x.to(torch.bfloat16), 2e-2)
        dec.disable_decode(layer)
    return errors
