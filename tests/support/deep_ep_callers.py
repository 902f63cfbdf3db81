"""Worker bodies that drive megatron_ep.deep_ep the way SGLang's and vLLM's DeepEP managers do (run
on every rank of a DistPool), each sequence against the same oracle of DeepEP's semantics as
tests/support/deep_ep_cases.py: a normal prefill (layout with a captured event, asynchronous dispatch on
the communication stream, the caller's wait, the combine), and low-latency decode with the
receive hook for one micro-batch and for two in flight (two-batch overlap: both dispatches
issued before either hook, both combines before either of theirs)."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from deep_ep_cases import _backend, _in_rank, _inputs, _on


def _prefill(buf, deep_ep, x, idx, w, E: int, async_finish: bool):
    """SGLang's normal-mode dispatch and combine (DeepEPNormalDispatcher), experts the identity."""
    previous = deep_ep.Buffer.capture() if async_finish else None
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(
        idx, E, previous_event=previous, async_finish=async_finish, allocate_on_comm_stream=previous is not None)
    recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=ev, async_finish=async_finish,
        allocate_on_comm_stream=ev is not None and async_finish)
    if async_finish:
        ev.current_stream_wait()
    previous = deep_ep.Buffer.capture() if async_finish else None
    y, _, ev = buf.combine(recv_x, handle, async_finish=async_finish, previous_event=previous,
                           allocate_on_comm_stream=previous is not None)
    if async_finish:
        ev.current_stream_wait()
    return recv_x, recv_idx, counts, y


def run_prefill_case(cfg: dict) -> list:
    """Normal mode, synchronous and asynchronous: the combine of the dispatched rows gives each
    token times the number of ranks it went to (DeepEP sums one row per receiving rank); the
    per-expert list counts every received (row, local expert) pair."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep callers prefill R={R} rank={rank} seed={cfg['seed']}]"
    try:
        _backend(cfg)
        from megatron_ep import deep_ep

        errors = []
        E, L = cfg["E"], cfg["E"] // R
        buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=int(1e8))
        x, idx, w = _inputs(cfg, rank)
        x, idx, w = _on(cfg, x.to(torch.bfloat16), idx, w)
        ranks_of = _in_rank(idx.cpu(), L, R).sum(1, keepdim=True).double()
        for async_finish in (False, True):
            for step in range(2):  # a second step on the same buffer, as a server's next batch
                recv_x, recv_idx, counts, y = _prefill(buf, deep_ep, x, idx, w, E, async_finish)
                want_counts = [int((recv_idx.cpu() == e).sum()) for e in range(L)]
                if counts != want_counts:
                    errors.append(f"{tag} async={async_finish} step {step}: counts {counts}, rows give {want_counts}")
                want_y = x.cpu().double() * ranks_of
                if not torch.allclose(y.cpu().double(), want_y, rtol=1e-2, atol=1e-2):
                    errors.append(f"{tag} async={async_finish} step {step}: combine differs from x times the ranks "
                                  f"(max diff {(y.cpu().double() - want_y).abs().max():.3g})")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def _experts(recv, rank: int, L: int):
    """Expert g returns its rows times (g + 1)."""
    return torch.stack([recv[e].float() * (rank * L + e + 1) for e in range(L)]).to(torch.bfloat16)


def _want(x, idx, w):
    return x.cpu().double() * torch.where(idx >= 0, w * (idx + 1).float(), 0.0).cpu().sum(1, keepdim=True).double()


def run_decode_case(cfg: dict) -> list:
    """Low-latency decode with the receive hook (async_finish off, as the managers set it when
    they take the hook): one micro-batch, then two in flight (two-batch overlap), for several
    steps on one buffer; each combine the weighted sum over the token's experts."""
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[deep_ep callers decode R={R} rank={rank} seed={cfg['seed']}]"
    try:
        _backend(cfg)
        from megatron_ep import deep_ep

        errors = []
        E, L, T, H = cfg["E"], cfg["E"] // R, cfg["T"], cfg["H"]
        buf = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                             low_latency_mode=True, num_qps_per_rank=max(1, E // R))
        batches = []
        for b in range(2):
            x, idx, w = _inputs(dict(cfg, seed=cfg["seed"] + 1000 * b), rank)
            batches.append(_on(cfg, x.to(torch.bfloat16), idx, w))

        def check(name, y, x, idx, w):
            want = _want(x, idx, w)
            if not torch.allclose(y.cpu().double(), want, rtol=2e-2, atol=2e-2):
                errors.append(f"{tag} {name}: combine differs from the weighted sum "
                              f"(max diff {(y.cpu().double() - want).abs().max():.3g})")

        for step in range(2):
            x, idx, w = batches[0]
            recv, count, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False, async_finish=False,
                                                                    return_recv_hook=True)
            hook()
            y, _, hook = buf.low_latency_combine(_experts(recv, rank, L), idx, w, handle, async_finish=False,
                                                 return_recv_hook=True)
            hook()
            check(f"step {step}, one micro-batch", y, x, idx, w)
            # two-batch overlap: both dispatches, then both receives; both combines, then both receives
            sent = [buf.low_latency_dispatch(xb, ib, T, E, use_fp8=False, async_finish=False, return_recv_hook=True)
                    for xb, ib, _ in batches]
            for s in sent:
                s[4]()
            outs = [buf.low_latency_combine(_experts(s[0], rank, L), ib, wb, s[2], async_finish=False,
                                            return_recv_hook=True) for s, (_, ib, wb) in zip(sent, batches)]
            for o in outs:
                o[2]()
            for b, (o, (xb, ib, wb)) in enumerate(zip(outs, batches)):
                check(f"step {step}, micro-batch {b} of two in flight", o[0], xb, ib, wb)
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]


def caller_cases(R: int) -> list:
    return [dict(seed=900 + R, E=2 * R, K=3, H=512, T=8, Ts=[8, 0, 5, 3][:R], p_drop=0.2)]
