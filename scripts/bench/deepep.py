"""DeepEP V1 as a competitor: its intranode kernels (normal path, at our SM counts) and its
low-latency kernels (decode path), when the `deep_ep` package imports (built on the GPU machine
from a fetched snapshot, never part of this repository). Only its public Buffer API is called."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from bench import harness
from bench.baselines import expert_major_perm

DEFAULT_SMS = 24  # DeepEP's SM count when --num-sms has 0 (our analytic default)


def load():
    """(the deep_ep module, None), or (None, the ImportError) when it does not import."""
    try:
        import deep_ep
    except ImportError as exc:
        return None, exc
    return deep_ep, None


class Intranode:
    """DeepEP V1 intranode: one buffer for the whole sweep, `set_num_sms` per SM count."""

    def __init__(self, args):
        self.args, self.error, self.buffer, self.label = args, None, None, None
        deep_ep, exc = load()
        if deep_ep is None:
            self.error = f"deep_ep not importable: {exc}"
            return
        self.deep_ep = deep_ep
        self.label = os.environ.get("MEP_DEEPEP_LABEL") or self._describe(deep_ep)
        try:
            self.buffer = deep_ep.Buffer(dist.group.WORLD, int(2e9), 0, explicitly_destroy=True)
        except Exception as exc:  # noqa: BLE001  (reported, the rest of the run goes on)
            self.error = f"deep_ep.Buffer failed: {type(exc).__name__}: {exc}"

    @staticmethod
    def _describe(deep_ep) -> str:
        """Where the package lives and, if its build left one, the commit in a DEEPEP_COMMIT file
        at the root of its source tree (MEP_DEEPEP_LABEL overrides)."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(deep_ep.__file__)))
        try:
            with open(os.path.join(root, "DEEPEP_COMMIT")) as f:
                commit = f.read().strip()[:12]
        except OSError:
            commit = "unknown"
        return f"DeepEP V1 from {root} (commit {commit})"

    def run(self, n, inp, timer, t):
        """Its ops at `n` SMs per rank (0: DEFAULT_SMS) into `t`; a reason string when it cannot
        run at that count, else None."""
        deep_ep, buffer = self.deep_ep, self.buffer
        E, R = self.args.experts, self.args.ranks
        L = E // R
        sms = n or DEFAULT_SMS
        if sms % 2:
            return f"DeepEP needs an even SM count, got {sms}"
        deep_ep.Buffer.set_num_sms(sms)
        dcfg, ccfg = deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)
        x, x_fp8, w = inp["x"], inp["x_fp8"], inp["w"]
        idx = inp["idx"].to(getattr(deep_ep, "topk_idx_t", torch.int64))

        def layout_and_dispatch(data):
            ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idx, E)
            return buffer.dispatch(data, num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
                                   topk_idx=idx, topk_weights=w, config=dcfg)

        def full_plus_permute():
            recv_x, recv_idx = layout_and_dispatch(x)[:2]
            return recv_x.index_select(0, expert_major_perm(recv_idx, L))

        recv_x, recv_idx, _, _, handle, _ = layout_and_dispatch(x)
        perm = expert_major_perm(recv_idx, L)

        def fp8_cached_plus_permute():
            rx, rs = buffer.dispatch(x_fp8, handle=handle, config=dcfg)[0]
            return rx.index_select(0, perm), rs.index_select(0, perm)

        y = recv_x.clone()
        y_expert = recv_x.index_select(0, perm)  # expert-major rows as the experts return them

        def unpermute_plus_combine():  # a manager's unpermute (sum per received row), then combine
            rows = torch.zeros_like(y).index_add_(0, perm, y_expert)
            return buffer.combine(rows, handle, config=ccfg)

        t["deepep_layout"] = timer(lambda: buffer.get_dispatch_layout(idx, E))
        t["deepep_dispatch"] = timer(lambda: layout_and_dispatch(x))
        t["deepep_dispatch_plus_permute"] = timer(full_plus_permute)
        t["deepep_dispatch_cached"] = timer(lambda: buffer.dispatch(x, handle=handle, config=dcfg))
        t["deepep_dispatch_fp8_cached"] = timer(lambda: buffer.dispatch(x_fp8, handle=handle, config=dcfg))
        t["deepep_dispatch_cached_plus_permute"] = timer(
            lambda: buffer.dispatch(x, handle=handle, config=dcfg)[0].index_select(0, perm))
        t["deepep_dispatch_fp8_cached_plus_permute"] = timer(fp8_cached_plus_permute)
        t["deepep_combine"] = timer(lambda: buffer.combine(y, handle, config=ccfg))
        t["deepep_unpermute_plus_combine"] = timer(unpermute_plus_combine)
        return None

    def close(self):
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None


def low_latency(a, T, x, idx, w, E, K, H, nccl):
    """DeepEP V1's low-latency kernels: µs per call of dispatch, combine, both, and both with
    receive hooks (eager loops of --loop calls), and the kernel times."""
    import deep_ep

    R = dist.get_world_size(nccl)
    mt = max(a.tokens)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(mt, H, R, E)
    buf = deep_ep.Buffer(nccl, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // R)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, mt, E, use_fp8=a.fp8)
    y = torch.randn((E // R, R * mt, H), device=x.device).to(torch.bfloat16)

    def d():
        buf.low_latency_dispatch(x, idx, mt, E, use_fp8=a.fp8)

    def c():
        buf.low_latency_combine(y, idx, w, handle)

    def dc():
        _, _, h, _, _ = buf.low_latency_dispatch(x, idx, mt, E, use_fp8=a.fp8)
        buf.low_latency_combine(y, idx, w, h)

    def dc_hook():
        _, _, h, _, hook = buf.low_latency_dispatch(x, idx, mt, E, use_fp8=a.fp8, return_recv_hook=True)
        hook()
        _, _, hook = buf.low_latency_combine(y, idx, w, h, return_recv_hook=True)
        hook()

    # eager loops: capturing its LL calls in a CUDA graph here ended in its dispatch receive
    # timing out and an illegal memory access (2026-11-30, 2 x H200), so its figures include
    # its host launch overhead where that exceeds the kernels (1-32 tokens)
    def looped(fn):
        return lambda: [fn() for _ in range(a.loop)]

    fns = {"dispatch": d, "combine": c, "both": dc, "hook": dc_hook}
    res = {name: harness.median_us(looped(fn), a.reps, 1) / a.loop for name, fn in fns.items()}
    dist.barrier(group=nccl)
    res.update(harness.kernel_figures(d, c, dc_hook, a.kernel_iters))
    res["timing"] = "eager"
    return res
