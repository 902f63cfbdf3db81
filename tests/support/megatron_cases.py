"""Worker bodies for the Megatron integration tests (run on every rank of a gloo DistPool).

Each case builds the same global inputs on every rank from one seed, runs them through
Megatron's real dispatchers (`MoEAlltoAllTokenDispatcher` as the reference, and
`MoEFlexTokenDispatcher` with megatron_ep's managers installed) or through a real `MoELayer`,
and returns a list of failure messages (empty = pass). All collectives run before any check.

CPU shims (this harness only; megatron-core 0.16/0.19 assume a GPU in a few places):
* `moe_utils.te_general_gemm` is referenced without TransformerEngine (NameError) -> None, so
  the router gating falls back to torch.mm;
* the router moves its weight and expert-bias buffers to `torch.cuda.current_device()`, and
  the alltoall dispatcher makes a D2H side stream (`torch.cuda.Stream`, `current_stream`,
  `torch.cuda.stream`) -> "cpu" and no-op stream/event stand-ins;
* the alltoall dispatcher passes its splits to `all_to_all_single` as CPU *tensors* when they
  never were on a GPU (on GPU it converts them to numpy) -> convert on CPU too.
All are patched only while a case runs, and restored after (recipes/cpu_shims.py, shared with
the training script).
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback

import torch
import torch.distributed as dist

from graph_capture import captured
from oracle import make_inputs


# ------------------------------------------------------------------------------- CPU shims
def cpu_shims():
    from recipes.cpu_shims import patched  # the recipe's shims, restored after each case

    return patched()


def side(case, which):
    """(context, device) for one side of a comparison. case["device"]:
    "cpu" (default): both sides on CPU under the shims;
    "virtual": Megatron's reference on CPU under the shims, megatron_ep on the GPU (virtual
      ranks: R processes on one GPU with a gloo group, the cuda backend's own transport);
    "cuda": both on the GPU, no shims (a real NCCL group, e.g. EP 1).
    case["manager"] == "megatron" (Megatron's own _DeepepManager on megatron_ep.deep_ep): that
    side runs without the shims."""
    mode = case.get("device", "cpu")
    on_gpu = mode == "cuda" or (mode == "virtual" and which == "ours")
    if which == "ours" and case.get("manager") == "megatron":
        return contextlib.nullcontext(), "cuda" if on_gpu else "cpu"  # Megatron's _DeepepManager on CPU needs no shim
    return (contextlib.nullcontext() if on_gpu else cpu_shims()), ("cuda" if on_gpu else "cpu")


def _to(d, device):
    """Every tensor of a (nested) dict/list moved to `device` (results compared on CPU)."""
    if torch.is_tensor(d):
        return d.to(device)
    if isinstance(d, dict):
        return {k: _to(v, device) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return type(d)(_to(v, device) for v in d)
    return d


def check_cuda_buffers(case, tag):
    """On a GPU side megatron_ep must have run its cuda backend, not the reference."""
    if case.get("device", "cpu") == "cpu":
        return []
    from megatron_ep.megatron import buffers

    backends = sorted({b for _, b in buffers._BUFFERS})
    return [] if "cuda" in backends else [f"{tag} megatron_ep buffers {backends}: the cuda backend did not run"]


def _routing_map(idx, E):
    """[T, E] bool map of the experts each token names (-1 slots ignored)."""
    routing_map = torch.zeros((idx.shape[0], E), dtype=torch.bool)
    rows, slots = (idx >= 0).nonzero(as_tuple=True)
    routing_map[rows, idx[rows, slots]] = True
    return routing_map


def _init_megatron(install: bool = True):
    """Megatron's parallel state on the pool's gloo world: TP = PP = 1, EP = world size; our
    flex managers installed unless `install` is False (Megatron's own managers)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    if install:
        import megatron_ep.megatron as mep_megatron

        mep_megatron.install()


def deep_ep_shim_first():
    """megatron_ep's `deep_ep` folder first on sys.path (what `export PYTHONPATH=$(python -m
    megatron_ep.deep_ep --path)` does), so Megatron's fused_a2a, imported after this, imports
    megatron_ep.deep_ep as `deep_ep`."""
    import sys

    from megatron_ep.deep_ep import SHIM_DIR

    if sys.path[0] != SHIM_DIR:
        sys.path.insert(0, SHIM_DIR)


def _pg_collection():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def guarded(fn):
    """Turn an exception into a failure message (so peers are not left waiting on a
    collective that the failing rank will never join, every rank runs the same code)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            return [f"rank {dist.get_rank()}: {fn.__name__} raised:\n{traceback.format_exc()}"]

    return wrapper


def make_config(E, K, H, dispatcher, backend="deepep", **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E, moe_router_topk=K,
              moe_ffn_hidden_size=2 * H, ffn_hidden_size=2 * H, use_cpu_initialization=True,
              moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend=backend,
              expert_model_parallel_size=dist.get_world_size(), add_bias_linear=False,
              gradient_accumulation_fusion=False, moe_router_load_balancing_type="none",
              moe_router_dtype="fp32", params_dtype=torch.float32, bf16=False)
    kw.update(extra)
    return TransformerConfig(**kw)


# ---------------------------------------------------------------------- dispatcher level
def _make_dispatcher(kind, E, K, H, **extra):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher

    R, r = dist.get_world_size(), dist.get_rank()
    L = E // R
    if kind == "alltoall":
        cfg = make_config(E, K, H, "alltoall", **extra)
        cls = MoEAlltoAllTokenDispatcher
    else:
        cfg = make_config(E, K, H, "flex", kind, **extra)
        cls = MoEFlexTokenDispatcher
    return cls(L, list(range(r * L, (r + 1) * L)), config=cfg, pg_collection=_pg_collection())


def _toy_experts(x, tokens_per_expert, probs, W):
    """y = (x @ W[e]) * prob per expert segment: row-wise, so any expert-major layout works."""
    counts = [int(c) for c in tokens_per_expert.tolist()]
    assert sum(counts) == x.shape[0], f"tokens_per_expert sums to {sum(counts)} but there are {x.shape[0]} rows"
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append((x[start:start + n] @ W[e]) * probs[start:start + n].unsqueeze(1).to(x.dtype))
        start += n
    return torch.cat(outs) if outs else x.new_zeros((0, W.shape[-1]))


def _global_problem(case):
    """Every rank's tokens, routing map, dense probs and an upstream gradient, from one seed."""
    R = dist.get_world_size()
    E, K, H, Ts = case["E"], case["K"], case["H"], case["Ts"]
    inputs = make_inputs(case["seed"], R, E, K, H, Ts, dtype="fp32", pattern=case.get("pattern", "random"),
                         p_drop=case.get("p_drop", 0.2))
    g = torch.Generator().manual_seed(case["seed"] + 7)
    W = torch.randn((E, H, H), generator=g) / H ** 0.5
    upstream = [torch.randn((Ts[s], H), generator=g) for s in range(R)]
    probs_full = [torch.rand((Ts[s], E), generator=g) + 0.1 for s in range(R)]
    if "pad_capacity_factor" in case:
        # What the router does before a drop-and-pad dispatch: at most `capacity` tokens per
        # expert from each rank (the first ones).
        from megatron.core.transformer.moe.moe_utils import get_capacity

        for s, inp in enumerate(inputs):
            cap = get_capacity(num_tokens=Ts[s] * K, num_experts=E, capacity_factor=case["pad_capacity_factor"])
            seen = [0] * E
            for t in range(Ts[s]):
                for k in range(K):
                    e = int(inp["idx"][t, k])
                    if e >= 0:
                        seen[e] += 1
                        if seen[e] > cap:
                            inp["idx"][t, k] = -1
    return inputs, W, upstream, probs_full


def _run_dispatcher(disp, x, routing_map, probs_leaf, W_local, upstream):
    """Forward + backward through Megatron's dispatcher protocol; returns what to compare."""
    probs = probs_leaf * routing_map  # zero off the routing map, gradient only on it
    hidden, p = disp.dispatch_preprocess(x, routing_map, probs)
    hidden, p = disp.token_dispatch(hidden, p)
    perm_x, tpe, perm_p = disp.dispatch_postprocess(hidden, p)
    out = _toy_experts(perm_x, tpe, perm_p, W_local)
    out = disp.combine_preprocess(out)
    out = disp.token_combine(out)
    y = disp.combine_postprocess(out)
    (y * upstream).sum().backward()
    return dict(y=y.detach(), perm_x=perm_x.detach(), perm_p=perm_p.detach(), tpe=tpe.detach().cpu(),
                gx=_grad(x), gp=_grad(probs_leaf))


def _grad(t):
    return t.grad.clone() if t.grad is not None else torch.zeros_like(t)


@guarded
def run_flex_vs_alltoall(case):
    """Flex (deepep | hybridep on megatron_ep) against Megatron's alltoall dispatcher."""
    megatrons_own = case.get("manager") == "megatron"  # Megatron's _DeepepManager on `import deep_ep`
    if megatrons_own:
        deep_ep_shim_first()
    ctx, _ = side(case, "ref")
    with ctx:
        _init_megatron(install=not megatrons_own)
    R, r = dist.get_world_size(), dist.get_rank()
    E, K, H = case["E"], case["K"], case["H"]
    L = E // R
    inputs, W, upstream, probs_full = _global_problem(case)
    mine = inputs[r]
    routing_map = _routing_map(mine["idx"], E)
    W_local = W[r * L:(r + 1) * L]
    results = {}
    extra = dict(case.get("config", {}))
    if "pad_capacity_factor" in case:
        extra.update(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=case["pad_capacity_factor"])
    elif case.get("p_drop", 0) > 0 or case.get("pattern") == "one_expert":
        # Tokens with fewer than top-k experts only occur when the router drops (capacity
        # factor set); megatron-core 0.19's alltoall sizes dropless outputs as T * topk.
        extra.setdefault("moe_expert_capacity_factor", float(E))
    for kind in ("alltoall", case["backend"]):
        ctx, dev = side(case, "ref" if kind == "alltoall" else "ours")
        with ctx:
            disp = _make_dispatcher(kind, E, K, H, **extra)
            if kind != "alltoall" and megatrons_own:
                problem = _not_megatrons_deepep(disp._comm_manager)
                if problem:
                    return [problem]
            elif kind != "alltoall":
                mgr = disp._comm_manager
                if type(mgr).__module__.split(".")[0] != "megatron_ep":
                    return [f"flex {kind} built {type(mgr).__name__}, not megatron_ep's manager: install() had no effect"]
                if "align" in case:  # FP8 configs (the only way to ask for padding) need TE
                    mgr.align = case["align"]
                want_sms = extra.get("moe_flex_dispatcher_num_sms")
                if want_sms is not None and mgr.num_sms != want_sms:
                    return [f"flex {kind}: num_sms {mgr.num_sms}, but moe_flex_dispatcher_num_sms is {want_sms}"]
                if "want_align" in case and mgr.align != case["want_align"]:
                    return [f"flex {kind}: alignment {mgr.align}, want {case['want_align']} for {case.get('config')}"]
            x = mine["x"].to(dev).clone().requires_grad_(True)
            probs_leaf = probs_full[r].to(dev).clone().requires_grad_(True)
            got = _run_dispatcher(disp, x, routing_map.to(dev), probs_leaf, W_local.to(dev), upstream[r].to(dev))
            results[kind] = _to(got, "cpu")
            if kind != "alltoall":
                results["align"] = getattr(disp._comm_manager, "align", 1)
    align = results.pop("align")
    dist.barrier()

    tag = f"[R={R} rank={r} {case['backend']} seed={case['seed']} {case.get('device', 'cpu')}]"
    errors = check_cuda_buffers(case, tag)
    ref, got = results["alltoall"], results[case["backend"]]

    def close(name, a, b, tol=1e-5):
        if a.shape != b.shape:
            errors.append(f"{tag} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif a.numel() and not torch.allclose(a, b, rtol=tol, atol=tol):
            errors.append(f"{tag} {name}: max abs diff {(a - b).abs().max().item():.3g}")

    close("output", got["y"], ref["y"])
    close("grad hidden", got["gx"], ref["gx"])
    close("grad probs", got["gp"], ref["gp"])
    if not torch.any(ref["gp"] != 0) and routing_map.any():
        errors.append(f"{tag} reference probs gradient is all zero: the case does not exercise it")

    if "pad_capacity_factor" in case:
        # Drop-and-pad: both give every local expert capacity * R rows. Megatron pads each
        # source's chunk with copies of other tokens (prob 0), we pad the segment's tail with
        # zero rows; the real rows (prob > 0) must be the same, in the same order.
        if got["tpe"].tolist() != ref["tpe"].tolist():
            errors.append(f"{tag} tokens_per_expert {got['tpe'].tolist()} != alltoall's {ref['tpe'].tolist()}")
        real_got, real_ref = got["perm_p"] != 0, ref["perm_p"] != 0
        if not torch.equal(got["perm_x"][real_got], ref["perm_x"][real_ref]):
            errors.append(f"{tag} drop-and-pad: real dispatched rows differ from alltoall's")
        if torch.any(got["perm_x"][~real_got] != 0):
            errors.append(f"{tag} drop-and-pad: pad rows are not zero")
        return errors

    # Layout: Megatron's alltoall delivers each local expert's rows by (source rank, token);
    # ours must be the same rows, each segment padded with zero rows to the alignment.
    want_tpe = ref["tpe"].long()
    padded = (want_tpe + align - 1) // align * align
    if got["tpe"].long().tolist() != padded.tolist():
        errors.append(f"{tag} tokens_per_expert {got['tpe'].tolist()} != {padded.tolist()} (alltoall {want_tpe.tolist()}, align {align})")
    else:
        if any(int(c) % align for c in got["tpe"].tolist()):
            errors.append(f"{tag} tokens_per_expert {got['tpe'].tolist()} not multiples of {align}")
        keep = torch.cat([torch.arange(n) < c for n, c in zip(padded.tolist(), want_tpe.tolist())]) if L else torch.zeros(0, dtype=torch.bool)
        if got["perm_x"].shape[0] != keep.numel():
            errors.append(f"{tag} {got['perm_x'].shape[0]} dispatched rows, want {keep.numel()}")
        else:
            if not torch.equal(got["perm_x"][keep], ref["perm_x"]):
                errors.append(f"{tag} dispatched rows differ from alltoall's")
            if not torch.equal(got["perm_p"][keep].float(), ref["perm_p"].float()):
                errors.append(f"{tag} dispatched probs differ from alltoall's")
            if torch.any(got["perm_x"][~keep] != 0) or torch.any(got["perm_p"][~keep] != 0):
                errors.append(f"{tag} pad rows are not zero")
    return errors


def _not_megatrons_deepep(mgr):
    """Why the flex dispatcher does not run Megatron's own _DeepepManager on megatron_ep.deep_ep
    (None when it does)."""
    from megatron.core.transformer.moe import fused_a2a
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron_ep import deep_ep

    if type(mgr).__module__ != td.__name__ or type(mgr).__name__ != "_DeepepManager":
        return f"flex deepep built {type(mgr).__module__}.{type(mgr).__name__}, not Megatron's own _DeepepManager"
    if getattr(fused_a2a, "Buffer", None) is not deep_ep.Buffer:
        return (f"Megatron's fused_a2a uses Buffer {getattr(fused_a2a, 'Buffer', None)!r}, not megatron_ep.deep_ep's "
                "(was it imported before the shim folder was on sys.path?)")
    return None


@guarded
def run_setup_metadata_compiles(case):
    """setup_metadata traces into one graph (no graph break) under torch.compile."""
    with cpu_shims():
        _init_megatron()
        import torch._dynamo

        E, K, H = case["E"], case["K"], case["H"]
        errors = []
        for backend in ("deepep", "hybridep"):
            disp = _make_dispatcher(backend, E, K, H)
            mgr = disp._comm_manager
            T = 6
            g = torch.Generator().manual_seed(5)
            probs = torch.rand((T, E), generator=g)
            rmap = torch.zeros((T, E), dtype=torch.bool)
            rmap[torch.arange(T).unsqueeze(1), torch.topk(probs, K, dim=1).indices] = True
            rmap[0] = False  # a token routed nowhere
            probs = probs * rmap
            torch._dynamo.reset()
            compiled = torch.compile(mgr.setup_metadata, fullgraph=True, backend="eager")
            compiled(rmap.view(T, dist.get_world_size(), -1), probs.view(T, dist.get_world_size(), -1))
            got = {n: getattr(mgr, n) for n in ("token_probs", "token_indices", "routing_map") if getattr(mgr, n, None) is not None}
            mgr.setup_metadata(rmap, probs)
            for n, v in got.items():
                if not torch.equal(v, getattr(mgr, n)):
                    errors.append(f"{backend}: compiled setup_metadata gives a different {n}")
            if backend == "deepep":
                idx = mgr.token_indices
                if not torch.equal(idx[0], torch.full_like(idx[0], -1)):
                    errors.append(f"deepep: a token routed nowhere got indices {idx[0].tolist()}")
                for t in range(1, T):
                    if sorted(idx[t].tolist()) != sorted(rmap[t].nonzero().flatten().tolist()):
                        errors.append(f"deepep: token {t} indices {idx[t].tolist()} != routing map")
        return errors


# -------------------------------------------------------------------------- MoELayer level
def _moe_config(case, dispatcher, backend="deepep", **extra):
    R = dist.get_world_size()
    E = case["E"]
    return make_config(
        E, case["K"], case["H"], dispatcher, backend,
        moe_ffn_hidden_size=case["F"], gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=R, moe_router_group_topk=max(1, R // 2), moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=case["F"], **extra)


def _build_moe_layer(config, experts_cls=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron_ep.megatron import compat

    mlp = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False).submodules.mlp
    if experts_cls is not None:
        mlp = compat.with_experts(mlp, experts_cls)
    return MoELayer(config, compat.moe_submodules(mlp), layer_number=1, pg_collection=_pg_collection())


def _copy_weights(src, dst):
    """src has Megatron's SequentialMLP experts; dst either the same or GroupedGemmExperts."""
    sd = src.state_dict()
    if hasattr(dst.experts, "weight1"):
        L = dst.experts.num_local_experts
        with torch.no_grad():
            dst.experts.weight1.copy_(torch.stack([sd[f"experts.local_experts.{i}.linear_fc1.weight"] for i in range(L)]))
            dst.experts.weight2.copy_(torch.stack([sd[f"experts.local_experts.{i}.linear_fc2.weight"] for i in range(L)]))
        sd = {k: v for k, v in sd.items() if not k.startswith("experts.")}
        missing, unexpected = dst.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"experts.weight1", "experts.weight2"}, (missing, unexpected)
    else:
        dst.load_state_dict(sd)


def _expert_grads(layer):
    if hasattr(layer.experts, "weight1"):
        return layer.experts.weight1.grad, layer.experts.weight2.grad
    L = len(layer.experts.local_experts)
    return (torch.stack([layer.experts.local_experts[i].linear_fc1.weight.grad for i in range(L)]),
            torch.stack([layer.experts.local_experts[i].linear_fc2.weight.grad for i in range(L)]))


@guarded
def run_moe_layer_case(case):
    """A real MoELayer (sigmoid group-limited router with expert bias, shared expert, SwiGLU
    experts): flex on megatron_ep vs Megatron's alltoall, same weights and input."""
    ctx, _ = side(case, "ref")
    with ctx:
        _init_megatron()
    from megatron_ep.experts import GroupedGemmExperts

    R, r = dist.get_world_size(), dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.get("dtype", "fp32")]
    torch.manual_seed(case["seed"])  # same non-expert weights on every rank
    g = torch.Generator().manual_seed(case["seed"] + r)
    S, B, H = case["S"], 2, case["H"]
    x0 = torch.randn((S, B, H), generator=g)
    upstream = torch.randn((S, B, H), generator=g)
    cfg_extra = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, **case.get("config", {}))

    def build(dispatcher, backend, experts_cls, which):
        ctx, dev = side(case, which)
        with ctx:
            layer = _build_moe_layer(_moe_config(case, dispatcher, backend, **cfg_extra), experts_cls).to(dev)
        return layer, which

    ref = build("alltoall", "deepep", None, "ref")
    with torch.no_grad():
        ref[0].router.expert_bias.copy_(torch.randn(case["E"], generator=torch.Generator().manual_seed(1)) * 0.1)
    variants = [("alltoall", ref)]
    for backend, experts in case["variants"]:
        cls = GroupedGemmExperts if experts in ("grouped", "grouped-chunked") else None
        if backend == "alltoall":
            built = build("alltoall", "deepep", cls, "ref")
        else:
            built = build("flex", backend, cls, "ours")
        _copy_weights(ref[0], built[0])
        if case.get("budget_factor") and backend == "hybridep":  # the static budget (0.16 has no config field)
            m = built[0].token_dispatcher._comm_manager
            m.moe_expert_rank_capacity_factor = m._factor = case["budget_factor"]
        if experts == "grouped-chunked":  # dispatch / experts / combine in pipelined token chunks
            from megatron_ep.megatron.chunked import enable_chunked_experts

            enable_chunked_experts(built[0], case.get("chunks", 3))
        mgr = getattr(built[0].token_dispatcher, "_comm_manager", None)
        if backend != "alltoall" and type(mgr).__module__.split(".")[0] != "megatron_ep":
            return [f"flex {backend} built {type(mgr).__name__}, not megatron_ep's manager"]
        variants.append((f"{backend}+{experts}", built))
    outs = {}
    for name, (layer, which) in variants:
        ctx, dev = side(case, which)  # a fresh context each time (the shims are single-use)
        with ctx:
            x = x0.to(dev, dtype).clone().requires_grad_(True)
            y, bias = layer(x)
            (y * upstream.to(dev, dtype)).sum().backward()
            w1, w2 = _expert_grads(layer)
            shared = [p.grad for p in layer.shared_experts.parameters()]
            got = dict(y=y.detach(), gx=_grad(x), grouter=_grad(layer.router.weight), gw1=w1, gw2=w2, shared=shared)
            outs[name] = _to(got, "cpu")
    dist.barrier()

    tol = case.get("tol", 1e-5)

    def differs(a, b):
        """fp32: rtol = atol = tol. bf16: atol scales with the reference's magnitude (rounding of
        sums in a different order)."""
        a, b = a.float(), b.float()
        atol = tol if dtype == torch.float32 else tol * max(1.0, b.abs().max().item())
        return not torch.allclose(a, b, rtol=tol, atol=atol) and f"max abs diff {(a - b).abs().max().item():.3g}"

    errors = check_cuda_buffers(case, f"[R={R} rank={r}]") if any(b != "alltoall" for b, _ in case["variants"]) else []
    want = outs["alltoall"]
    for name, got in outs.items():
        if name == "alltoall":
            continue
        tag = f"[R={R} rank={r} {name} {case.get('device', 'cpu')} {case.get('dtype', 'fp32')}]"
        for key in ("y", "gx", "grouter", "gw1", "gw2"):
            a, b = got[key], want[key]
            if a is None or b is None or a.shape != b.shape:
                errors.append(f"{tag} {key}: missing or shape mismatch")
            elif differs(a, b):
                errors.append(f"{tag} {key}: {differs(a, b)}")
        for i, (a, b) in enumerate(zip(got["shared"], want["shared"])):
            if differs(a, b):
                errors.append(f"{tag} shared expert grad {i}: {differs(a, b)}")
    if not torch.any(want["grouter"] != 0):
        errors.append(f"[R={R} rank={r}] reference router gradient is zero: case does not exercise the probs path")
    return errors


# ------------------------------------------------------------------ CUDA graph of a MoE layer
@guarded
def run_moe_layer_graph_case(case):
    """hybridep with a static budget (MEGATRON_EP_RANK_CAPACITY_FACTOR in the pool's environment:
    no host sync anywhere in the dispatch): a real MoELayer's forward (router, flex dispatcher,
    GroupedGemmExperts, shared expert) captured in one CUDA graph, replayed on new inputs, equals
    the eager forward on the same inputs, bit for bit."""
    if not os.environ.get("MEGATRON_EP_RANK_CAPACITY_FACTOR"):
        return ["run_moe_layer_graph_case needs MEGATRON_EP_RANK_CAPACITY_FACTOR in the pool's environment"]
    _init_megatron()
    from megatron_ep.experts import GroupedGemmExperts

    R, r = dist.get_world_size(), dist.get_rank()
    errors, tag = [], f"[graph R={R} rank={r}]"
    torch.manual_seed(case["seed"])  # same non-expert weights on every rank
    config = _moe_config(case, "flex", "hybridep", params_dtype=torch.bfloat16, bf16=True)
    layer = _build_moe_layer(config, GroupedGemmExperts).cuda()
    if case.get("chunks"):  # chunked experts: every chunk worst-case sized under the budget
        from megatron_ep.megatron.chunked import enable_chunked_experts

        enable_chunked_experts(layer, case["chunks"])
    g = torch.Generator(device="cuda").manual_seed(case["seed"] + r)
    shape = (case["S"], 2, case["H"])
    x_static = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    with torch.no_grad():
        graph, (y_static, _) = captured(layer, x_static, warmups=3)
        for i in range(case["rounds"]):
            x_new = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
            x_static.copy_(x_new)
            graph.replay()
            y_eager, _ = layer(x_new)
            torch.cuda.synchronize()
            if not torch.equal(y_static, y_eager):
                errors.append(f"{tag} replay {i}: max abs diff {(y_static.float() - y_eager.float()).abs().max().item():.3g} "
                              "from the eager forward")
            if not torch.isfinite(y_static.float()).all() or not torch.any(y_static != 0):
                errors.append(f"{tag} replay {i}: output is not finite or all zero")
    dist.barrier()
    return errors


@guarded
def run_experts_checkpoint_case(case):
    """GroupedGemmExperts' distributed-checkpoint entries: rank r's weights are experts
    [r*L, (r+1)*L) of global [E, ...] tensors."""
    with cpu_shims():
        _init_megatron()
        from megatron_ep.experts import GroupedGemmExperts

        R, r = dist.get_world_size(), dist.get_rank()
        E, L = case["E"], case["E"] // R
        cfg = make_config(E, 2, 16, "flex", "hybridep", moe_ffn_hidden_size=8, gated_linear_unit=True)
        mod = GroupedGemmExperts(L, cfg, pg_collection=_pg_collection())
        sd = mod.sharded_state_dict(prefix="decoder.layers.mlp.experts.", sharded_offsets=((0, 3, 5),))
    errors = []
    for name, local in (("weight1", (L, 16, 16)), ("weight2", (L, 16, 8))):
        st = sd.get(f"decoder.layers.mlp.experts.{name}")
        if st is None:
            errors.append(f"rank {r}: no sharded entry for {name}")
            continue
        want_global = (5, E) + local[1:]
        want_offset = (3, r * L, 0, 0)
        if tuple(st.global_shape) != want_global or tuple(st.global_offset) != want_offset or tuple(st.local_shape) != local:
            errors.append(f"rank {r} {name}: global {tuple(st.global_shape)} offset {tuple(st.global_offset)} local {tuple(st.local_shape)}; "
                          f"want {want_global} / {want_offset} / {local}")
        if getattr(getattr(mod, name), "allreduce", None) is not False:
            errors.append(f"rank {r} {name}: expert weights must be marked allreduce=False")
    return errors


@guarded
def run_chunked_refusals_case(case):
    """enable_chunked_experts names why a layer does not qualify, before changing any layer: the
    alltoall dispatcher, Megatron's SequentialMLP experts, the deepep manager, Megatron's combined
    1F1B schedule with fp8 (set on the built layer's config: Megatron's fp8 needs
    TransformerEngine); and a bad chunks."""
    ctx, _ = side(case, "ref")
    with ctx:
        _init_megatron()
    from megatron_ep.experts import GroupedGemmExperts
    from megatron_ep.megatron.chunked import enable_chunked_experts

    errors = []
    tries = [("alltoall", "deepep", GroupedGemmExperts, {}, {}, "chunked experts need flex"),
             ("flex", "hybridep", None, {}, {}, "need megatron_ep.experts.GroupedGemmExperts"),
             ("flex", "deepep", GroupedGemmExperts, {}, {}, "hybridep manager"),
             ("flex", "hybridep", GroupedGemmExperts, {}, dict(overlap_moe_expert_parallel_comm=True, fp8="e4m3"),
              "overlap_moe_expert_parallel_comm is set with fp8")]
    for dispatcher, backend, cls, extra, after, want in tries:
        with side(case, "ours")[0]:
            layer = _build_moe_layer(_moe_config(case, dispatcher, backend, **extra), cls)
        for k, v in after.items():
            setattr(layer.config, k, v)
        before = (layer.dispatch, layer.combine)
        try:
            enable_chunked_experts(layer, 2)
            errors.append(f"{dispatcher}/{backend}/{cls}: no error, expected {want!r}")
        except ValueError as e:
            if want not in str(e):
                errors.append(f"{dispatcher}/{backend}/{cls}: {e} (expected {want!r})")
        if (layer.dispatch, layer.combine) != before:
            errors.append(f"{dispatcher}/{backend}/{cls}: the layer was changed although it was refused")
    with side(case, "ours")[0]:
        layer = _build_moe_layer(_moe_config(case, "flex", "hybridep"), GroupedGemmExperts)
    for bad, exc in ((0, ValueError), (2.5, TypeError)):
        try:
            enable_chunked_experts(layer, bad)
            errors.append(f"chunks={bad}: no error")
        except exc:
            pass
    return errors


def run_layer_options_case(case):
    """What `launch --ep-experts grouped --ep-chunks 2` puts in place: every MoELayer built after
    use_in_moe_layers() has GroupedGemmExperts (Megatron's spec unchanged) and chunked experts; a
    layer that cannot take chunks (deepep) stops its construction naming why; use_in_moe_layers
    ("megatron") restores the spec's experts. MoELayer.__init__ is restored at the end."""
    ctx, _ = side(case, "ref")
    with ctx:
        _init_megatron()
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_ep.experts import GroupedGemmExperts
    from megatron_ep.megatron import layer_options

    errors, original = [], MoELayer.__init__
    try:
        with side(case, "ours")[0]:
            layer_options.use_in_moe_layers("grouped", chunks=2)
            layer = _build_moe_layer(_moe_config(case, "flex", "hybridep"))
            if not isinstance(layer.experts, GroupedGemmExperts):
                errors.append(f"experts are {type(layer.experts).__name__}, not GroupedGemmExperts")
            if getattr(layer, "_mep_chunks", None) != 2:
                errors.append("the layer did not get chunked experts x2")
            try:
                _build_moe_layer(_moe_config(case, "flex", "deepep"))
                errors.append("a deepep layer took chunked experts")
            except ValueError as e:
                if "hybridep manager" not in str(e):
                    errors.append(f"deepep layer: {e} does not say why")
            layer_options.use_in_moe_layers("megatron")
            layer = _build_moe_layer(_moe_config(case, "flex", "hybridep"))
            if isinstance(layer.experts, GroupedGemmExperts) or hasattr(layer, "_mep_chunks"):
                errors.append("use_in_moe_layers('megatron') left megatron_ep's experts in place")
    finally:
        MoELayer.__init__ = original
        layer_options._STATE.clear()
    return errors


@guarded
def run_fused_a2a_second_derivative(case):
    """Megatron's fused_a2a (FusedDispatch / FusedCombine, whose backwards call the other
    megatron_ep.deep_ep call) around a nonlinear per-row map: a second derivative, by
    autograd.grad(..., inputs) and by .backward(), for x, probs and both, equals the one through
    megatron_ep's own differentiable dispatch / combine (rank-major, the same rows) or raises
    saying the Buffer call is not differentiable."""
    from refusals import derivative, exact_or_refused

    deep_ep_shim_first()
    from megatron.core.transformer.moe import fused_a2a

    import megatron_ep as mep
    from cases import get_buffer

    if fused_a2a.fused_dispatch is None or getattr(fused_a2a, "Buffer", None).__module__.split(".")[0] != "megatron_ep":
        return [f"Megatron's fused_a2a does not run on megatron_ep.deep_ep (Buffer {getattr(fused_a2a, 'Buffer', None)!r})"]
    R, r = dist.get_world_size(), dist.get_rank()
    E, K, H, T = case["E"], case["K"], case["H"], case["Ts"][r]
    g = torch.Generator().manual_seed(case["seed"] + r)
    x = torch.randn((T, H), generator=g)
    idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices
    probs = torch.rand((T, K), generator=g)
    grad = torch.randn((T, H), generator=g)
    group, buf = dist.group.WORLD, get_buffer("torch")

    def rows_map(rows, w):  # nonlinear in the rows and their weights: a second derivative has cross terms
        return torch.tanh(rows) * (1 + w.sum(1, keepdim=True)) ** 2

    def megatrons(x, probs):
        rows, _, w, _, handle = fused_a2a.fused_dispatch(x, idx, probs, E, group)
        return fused_a2a.fused_combine(rows_map(rows, w), group, handle)[0]

    def ours(x, probs):
        out = mep.dispatch(buf, x, idx, probs, num_experts=E, permute=False)
        return mep.combine(buf, rows_map(out.x, out.topk_weights), out.handle).x

    errors = []
    for wanted in ([True, False], [False, True], [True, True]):
        for how in ("grad", "backward"):
            tag = f"[fused_a2a second derivative R={R} rank={r} {wanted} {how}]"
            want = derivative(ours, [x, probs], wanted, grad, how)
            got = derivative(megatrons, [x, probs], wanted, grad, how)
            errors += exact_or_refused(tag, got, want, ("is not differentiable", "megatron_ep.dispatch"), tol=1e-5)
            dist.barrier()
    return errors
