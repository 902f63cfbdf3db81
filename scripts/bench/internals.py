"""The benchmarks' two reaches past public APIs. What they measure of megatron_ep itself goes
through its public `megatron_ep.tools.tracing`; what is left here is:

    guarded(call)          a measurement through a hook that may fail: None ("n/a") instead
    comm_manager(disp)     megatron-core's private `token_dispatcher._comm_manager`
"""

from __future__ import annotations

import torch.distributed as dist


def guarded(call):
    """For measurements through hooks that may not fit a build: None ("n/a") if the call fails."""
    try:
        return call()
    except (AttributeError, TypeError, KeyError, RuntimeError) as exc:
        print(f"[rank {dist.get_rank()}] internal hook failed, reported as n/a: {type(exc).__name__}: {exc}", flush=True)
        return None


def comm_manager(dispatcher):
    """megatron-core's private `token_dispatcher._comm_manager`: the flex dispatcher's manager
    (megatron_ep's or Megatron's own), or None (another dispatcher, or none)."""
    return getattr(dispatcher, "_comm_manager", None)
