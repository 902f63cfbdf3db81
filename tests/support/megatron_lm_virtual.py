"""Test-only: run `megatron_ep.megatron.launch [OPTIONS] SCRIPT ARGS` as one of several ranks that
share one GPU (virtual ranks, under MPS), which Megatron-LM's own scripts do not expect:

* Megatron sets the device from LOCAL_RANK: every rank is put on cuda:0;
* NCCL refuses two ranks on one GPU: the process groups are gloo (the default group is created
  here, before Megatron, which then keeps it; a group asked for with NCCL gets gloo);
* gloo has no coalesced collectives for CUDA tensors, nor reduce-scatter: Megatron's DDP
  gradient buckets are reduced one by one inside its `_coalescing_manager`, and reduce-scatter /
  all-gather into one tensor go through all-reduce / all-gather of a list;
* CUDA modules are loaded eagerly (CUDA_MODULE_LOADING=EAGER, set before CUDA starts, whatever the
  environment says): under MPS the ranks share one context, and a kernel loaded lazily at its first
  launch would wait behind a peer's dispatch or combine kernel that waits for this rank
  (megatron_ep/backends/cuda/sharing.py). One rank per GPU never meets that.

    torchrun --nproc-per-node 2 tests/support/megatron_lm_virtual.py [--ep-* OPTIONS] pretrain_gpt.py ...

Never for speed: the ranks share one GPU and gloo moves Megatron's own collectives through the host.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import types

import torch
import torch.distributed as dist

_pending: list = []  # the works of the innermost _coalescing_manager, waited for at its end


def _record(work):
    if work is not None and _pending:
        _pending[-1].append(work)
    return work


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    works: list = []
    cm = types.SimpleNamespace(works=works, wait=lambda: [w.wait() for w in works])
    _pending.append(works)
    try:
        yield cm
    finally:
        _pending.pop()
    if not async_ops:
        cm.wait()


def _patch_collectives() -> None:
    all_reduce, all_gather, new_group = dist.all_reduce, dist.all_gather, dist.new_group

    def all_reduce_recorded(tensor, *args, **kwargs):
        return _record(all_reduce(tensor, *args, **kwargs))

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        full = input.clone()
        all_reduce(full, op=op, group=group)
        n = output.numel()
        output.copy_(full.view(-1)[dist.get_rank(group) * n:(dist.get_rank(group) + 1) * n].view_as(output))
        return _record(_Done()) if async_op else None

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        parts = list(output.view(dist.get_world_size(group), -1).unbind(0))
        gathered = [torch.empty_like(p) for p in parts]
        all_gather(gathered, input.reshape(-1).contiguous(), group=group)
        for p, g in zip(parts, gathered):
            p.copy_(g)
        return _record(_Done()) if async_op else None

    def new_group_gloo(*args, **kwargs):
        if kwargs.get("backend") not in (None, "gloo"):
            kwargs["backend"] = "gloo"
            kwargs.pop("pg_options", None)
        return new_group(*args, **kwargs)

    dist.all_reduce = all_reduce_recorded
    dist.reduce_scatter_tensor = reduce_scatter_tensor
    dist._reduce_scatter_base = reduce_scatter_tensor
    dist.all_gather_into_tensor = all_gather_into_tensor
    dist._all_gather_base = all_gather_into_tensor
    dist._coalescing_manager = _one_by_one
    dist.new_group = new_group_gloo


class _Done:
    def wait(self, *args):
        return True

    def is_completed(self):
        return True


def main() -> int:
    from megatron_ep.backends.cuda import sharing

    sharing.prepare_shared_gpu()  # before the first CUDA call below
    os.environ["LOCAL_RANK"] = "0"
    torch.cuda.set_device(0)
    _patch_collectives()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    from megatron_ep.megatron import launch

    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
