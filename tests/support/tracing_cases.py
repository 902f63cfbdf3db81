"""Worker bodies for megatron_ep.tools.tracing (run on every rank of a DistPool): the phase marks, the
counters, the notify kernels alone and the low-latency stamps, on the torch backend (CPU: each
hook has nothing to report) and the cuda backend's paths (virtual ranks)."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from cases import get_buffer
from megatron_ep.tools import tracing


def run_tracing_case(cfg: dict, backend: str = "torch", device: str = "cpu") -> list:
    R, rank = dist.get_world_size(), dist.get_rank()
    tag = f"[tracing {backend} R={R} rank={rank} {cfg.get('sizing', {})}]"
    try:
        buf = get_buffer(backend, **cfg.get("sizing", {}))
        E, K, H, T = 2 * R, 2, 64, 8 + rank
        g = torch.Generator().manual_seed(cfg["seed"] + rank)
        x = torch.randn((T, H), generator=g).to(device, torch.bfloat16 if device == "cuda" else torch.float32)
        idx = torch.rand((T, E), generator=g).topk(K, dim=1).indices.to(device)
        errors = []
        first = buf.dispatch(x, idx, num_experts=E)
        with tracing.phases(buf) as d_marks:
            out = buf.dispatch(x, idx, num_experts=E)
        with tracing.phases(buf) as c_marks:
            buf.combine(out.x, out.handle)
        with tracing.phases(buf) as outside:
            pass
        with tracing.host_steps(buf) as steps:  # a cached dispatch: one crossing, its steps timed
            buf.dispatch(x, handle=out.handle)
        marks = d_marks + c_marks
        names = [[name for name, _ in m] for m in (d_marks, c_marks)]
        counters = tracing.counters(buf)
        if backend == "torch":
            if marks or counters or steps or tracing.notify_only(buf, idx, E) is not None:
                errors.append(f"{tag} the torch backend reported {names}, {counters}, {steps}")
            with tracing.low_latency_stamps(buf) as stamps:
                if stamps is not None:
                    errors.append(f"{tag} the torch backend yielded low-latency stamps")
            return errors
        torch.cuda.synchronize()
        if any(len(n) < 2 or n[0] != "start" or n.count("start") != 1 for n in names) or outside:
            errors.append(f"{tag} phases {names} (expected a dispatch's and a combine's, each from 'start'); "
                          f"an empty block recorded {len(outside)}")
        times = [a.elapsed_time(b) for (_, a), (_, b) in zip(marks, marks[1:])]
        if any(t < 0 for t in times):
            errors.append(f"{tag} phase marks out of order: {times}")
        d = steps.get("dispatch_call", {})
        if cfg.get("internode"):  # the intranode stage's crossings, as many as the path makes
            if not d or any(v <= 0 for e in steps.values() for v in e.values()):
                errors.append(f"{tag} host_steps of one cached internode dispatch: {steps}")
        elif d.get("calls") != 1 or not {"streams", "outputs", "launch", "counts", "leave", "return"} <= set(d) \
                or any(v <= 0 for v in d.values()) or set(steps) != {"dispatch_call"}:
            errors.append(f"{tag} host_steps of one cached dispatch: {steps}")
        if counters.get("num_sms") != buf.num_sms or set(counters.get("pool", {})) != {"stream_waits", "misses"}:
            errors.append(f"{tag} counters {counters}")
        run = tracing.notify_only(buf, idx, E)
        if (run is None) != bool(cfg.get("internode")):
            errors.append(f"{tag} notify_only gave {run} on the {'internode' if cfg.get('internode') else 'intranode'} path")
        if run is not None:  # its own collective calls; the buffer's calls go on in step afterwards
            run(T)
            run(0)
            again = buf.dispatch(x, idx, num_experts=E)
            if not torch.equal(again.x, first.x):
                errors.append(f"{tag} a dispatch after notify_only differs from the one before it")
        return errors
    except Exception:
        return [f"{tag} raised:\n{traceback.format_exc()}"]
