"""Worker bodies for Megatron's EP overlap (`overlap_moe_expert_parallel_comm`, the combined 1F1B
schedule) with megatron_ep's flex managers (run on every rank of a gloo DistPool; helpers and
the device modes are megatron_cases.py's)."""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist

from megatron_cases import _init_megatron, check_cuda_buffers, guarded, side


@contextlib.contextmanager
def schedule_on_cpu():
    """megatron-core's pipeline schedules allocate a few scalars on device="cuda" and call
    record_stream on the layer's residual: on CPU the former land on the CPU and the latter does
    nothing (streams are the cpu_shims stand-ins there); attention forks the CUDA RNG tracker
    (dropout is 0): a no-op here. The schedule's logic is untouched."""
    from torch.overrides import TorchFunctionMode

    from megatron.core.tensor_parallel import random as tp_random

    class _CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs = dict(kwargs, device="cpu")
            return func(*args, **kwargs)

    record_stream, tracker = torch.Tensor.record_stream, tp_random.get_cuda_rng_tracker()
    fork = tracker.__dict__.get("fork")
    torch.Tensor.record_stream = lambda self, stream: record_stream(self, stream) if self.is_cuda else None
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        with _CudaOnCpu():
            yield
    finally:
        torch.Tensor.record_stream = record_stream
        if fork is None:
            del tracker.fork
        else:
            tracker.fork = fork


def _overlap_model(case, overlap: bool, device, chunks: int = 0):
    """The case's 2-layer GPTModel (layer 2 MoE). case["experts"] == "grouped": megatron_ep's
    GroupedGemmExperts in the MoE layer (the recipe's spec); case["budget_factor"]: the hybridep
    static budget at that factor; `chunks`: with chunked experts."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    R = dist.get_world_size()
    torch.manual_seed(case["seed"])  # the same weights for both runs (and the replicated ones on every rank)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=case["H"], num_attention_heads=2, ffn_hidden_size=2 * case["H"], normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, expert_model_parallel_size=R,
        num_moe_experts=case["E"], moe_layer_freq=[0, 1], moe_ffn_hidden_size=case["H"] // 2, moe_router_topk=case["K"],
        moe_router_load_balancing_type="none", moe_router_dtype="fp32", moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend=case["backend"], overlap_moe_expert_parallel_comm=overlap)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    if case.get("experts") == "grouped":  # the recipe's spec: GroupedGemmExperts in every MoE layer
        from recipes.train_moe import decoder_block_spec

        spec = decoder_block_spec(cfg, types.SimpleNamespace(experts_impl="grouped"))
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=case["V"], max_sequence_length=case["S"],
                     position_embedding_type="rope")
    if case.get("budget_factor"):  # the static budget on every MoE layer (0.16 has no config field)
        for m in model.modules():
            if hasattr(m, "token_dispatcher"):
                mgr = m.token_dispatcher._comm_manager
                mgr.moe_expert_rank_capacity_factor = mgr._factor = case["budget_factor"]
    if chunks:
        from megatron_ep.megatron.chunked import enable_chunked_experts

        enable_chunked_experts(model, chunks)
    return model.to(device)


def _compare(tag, what, base, got, tol):
    """Losses and gradients of run `got` against run `base`: within `tol` (relative; 0: exact)."""
    (l0, g0), (l1, g1) = base, got
    errors = []
    if any(abs(a - b) > tol * abs(a) for a, b in zip(l0, l1)) or len(l0) != len(l1):
        errors.append(f"{tag} losses {what} {l1} != {l0}")
    if set(g0) != set(g1) or not g0:
        errors.append(f"{tag} {what}: gradients of {sorted(set(g0) ^ set(g1))[:4]} exist in one run only (or none)")
    for name in sorted(set(g0) & set(g1)):
        a, b = g1[name], g0[name]
        if not torch.allclose(a, b, rtol=tol, atol=tol * max(1e-6, b.abs().max().item())):
            errors.append(f"{tag} grad {name}: max abs diff {(a - b).abs().max().item():.3g} {what}")
    return errors


@guarded
def run_overlap_case(case):
    """--overlap-moe-expert-parallel-comm: Megatron's combined 1F1B schedule (dispatch / combine
    of one micro-batch beside the other's compute, on its communication stream) with our flex
    managers gives the same losses and gradients as Megatron's ordinary schedule, same model and
    data. CPU: exact; GPU: within case["tol"] (relative).

    case["chunks"] (with case["experts"] == "grouped"): the MoE layers have chunked experts
    (megatron_ep.megatron.chunked), so the schedule's dispatch, experts and combine nodes run our
    pass-through dispatch, the whole chunked pipeline and our pass-through combine; the two
    schedules must still agree as above, and the ordinary schedule's chunked run must match the
    same model without chunked experts within case["chunk_tol"] (the chunks sum the weight
    gradients in another order)."""
    ctx, dev = side(case, "ours")
    with ctx:
        _init_megatron()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    R, r = dist.get_world_size(), dist.get_rank()
    S, B, V, MB = case["S"], 2, case["V"], case["microbatches"]
    chunks = case.get("chunks", 0)
    g = torch.Generator().manual_seed(case["seed"] + 100 + r)
    data = [(torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)) for _ in range(MB)]
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None].to(dev)
    pos = torch.arange(S).unsqueeze(0).expand(B, -1).to(dev)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach()}

    plans = []

    def forward_step(data_iterator, model, return_schedule_plan=False):
        tokens, labels = (t.to(dev) for t in next(data_iterator))
        if return_schedule_plan:  # the combined 1F1B schedule asks for a plan instead of running the model
            plans.append(1)
            return model.build_schedule_plan(tokens, pos, mask, labels=labels), loss_func
        return model(tokens, pos, mask, labels=labels), loss_func

    results, errors = {}, []
    extras = "".join(f" {k}={case[k]}" for k in ("experts", "chunks", "budget_factor") if case.get(k))
    tag = f"[R={R} rank={r} overlap {case['backend']}{extras} {case.get('device', 'cpu')}]"
    runs = [(False, chunks), (True, chunks)] + ([(False, 0)] if chunks else [])
    for overlap, run_chunks in runs:
        plans.clear()
        with side(case, "ours")[0], (schedule_on_cpu() if dev == "cpu" else contextlib.nullcontext()):
            if dev == "cuda":
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(case["seed"])
            model = _overlap_model(case, overlap, dev, run_chunks)
            mgr = [m for m in model.modules() if hasattr(m, "token_dispatcher")][0].token_dispatcher._comm_manager
            if type(mgr).__module__.split(".")[0] != "megatron_ep":
                return [f"{tag} flex {case['backend']} built {type(mgr).__name__}, not megatron_ep's manager"]
            calls = []
            if run_chunks:  # count the chunked pipeline's runs (one per micro-batch)
                chunked_experts = mgr.chunked_experts
                mgr.chunked_experts = lambda *a, **k: calls.append(1) or chunked_experts(*a, **k)
            out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(data), model=[model],
                                              num_microbatches=MB, seq_length=S, micro_batch_size=B, forward_only=False)
        if overlap and len(plans) != MB:
            errors.append(f"{tag} the combined 1F1B schedule built {len(plans)} schedule plans for {MB} micro-batches")
        if not overlap and plans:
            errors.append(f"{tag} the ordinary schedule asked for schedule plans")
        if case.get("budget_factor") and mgr.budget is None:
            errors.append(f"{tag} overlap={overlap} chunks={run_chunks}: the static budget did not run")
        if run_chunks and len(calls) != MB:
            errors.append(f"{tag} overlap={overlap}: the chunked experts ran {len(calls)} times for {MB} micro-batches")
        if len(out) != MB:
            errors.append(f"{tag} overlap={overlap}: {len(out)} losses for {MB} micro-batches")
        results[overlap, run_chunks] = ([float(o["loss"]) for o in out],
                                        {n: p.grad.float().cpu().clone() for n, p in model.named_parameters()
                                         if p.grad is not None})
    dist.barrier()
    errors += check_cuda_buffers(case, tag)
    errors += _compare(tag, "with the overlap", results[False, chunks], results[True, chunks], case.get("tol", 0.0))
    if chunks:
        errors += _compare(tag, "chunked vs not", results[False, 0], results[False, chunks], case["chunk_tol"])
    routers = [g for n, g in results[True, chunks][1].items() if n.endswith("router.weight")]
    if not routers or not all(torch.any(g != 0) for g in routers):
        errors.append(f"{tag} no (or a zero) router gradient with the overlap: the probs' gradient path is untested")
    return errors
