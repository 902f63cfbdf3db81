"""The `cuda` backend: the kernel path the group's shape calls for, on its shared runtime.

A group inside one node (one NVLink domain, at most 8 ranks) runs the intranode normal path. A
group of several nodes -- `ranks_per_node` ranks each, by default the ranks sharing a host;
smaller values make virtual nodes -- runs the two-level internode path
(megatron_ep/backends/cuda/paths/internode.py): the runtime then spans this rank's node, and NVSHMEM carries
the RDMA domain. The path is picked once, here; afterwards the backend calls it through the
path protocol (megatron_ep/backends/cuda/paths/interface.py). The low-latency path
(megatron_ep/backends/cuda/paths/low_latency.py, NVSHMEM, extension `_C_nvshmem`) spans the whole group; it is
created at the first low-latency call, or up front with `low_latency=dict(...)`.
"""

from __future__ import annotations

from typing import Optional, Type

import torch

from ...core import protocol
from ...core.checks import fail
from . import nvshmem
from .hosts import host_names
from .paths.interface import NormalPath, Path
from .paths.intranode import IntranodePath
from .runtime import DEFAULT_TIMEOUT_S
from ...core.types import DispatchLayout

_LL_OPS = (protocol.OP["low_latency_dispatch"], protocol.OP["low_latency_combine"])


def node_size(group, num_ranks: int, requested: Optional[int]) -> int:
    """The node size: `requested` (virtual nodes; Buffer checked it), else the ranks sharing a
    host, which must be equal on every host and contiguous in rank order (node n = ranks
    [n * P, (n + 1) * P))."""
    if requested is not None:
        return requested
    hosts = host_names(group)
    size = hosts.count(hosts[0])
    contiguous = all(hosts[r] == hosts[r - r % size] for r in range(num_ranks)) and num_ranks % size == 0
    fail(contiguous and len(set(hosts)) == num_ranks // size, "the cuda backend needs the same number of ranks on every "
         "host, numbered node by node (ranks [n * P, (n + 1) * P) on host n); pass ranks_per_node= to override")
    return size


def normal_path_for(num_ranks: int, ranks_per_node: int) -> Type[NormalPath]:
    """The normal path of a group of `num_ranks` in nodes of `ranks_per_node`."""
    if ranks_per_node == num_ranks:
        return IntranodePath
    from .paths.internode import InternodePath

    return InternodePath


class CudaBackend:
    name = "cuda"

    def __init__(self, group, rank: int, num_ranks: int, *, max_tokens_per_rank: Optional[int] = None,
                 hidden: Optional[int] = None, num_experts: Optional[int] = None, max_topk: Optional[int] = None,
                 num_sms: Optional[int] = None, dtype_bytes: int = protocol.REGION_HINTS["dtype_bytes"],
                 combine_bytes: int = protocol.REGION_HINTS["combine_bytes"], combine_rows: Optional[int] = None,
                 pool_bytes: Optional[int] = None, max_alignment: int = protocol.REGION_HINTS["max_alignment"],
                 timeout_s: float = DEFAULT_TIMEOUT_S, low_latency: Optional[dict] = None,
                 ranks_per_node: Optional[int] = None, nvshmem_heap_bytes: Optional[int] = None):
        if num_experts is not None:
            fail(num_experts <= protocol.MAX_EXPERTS, f"num_experts={num_experts} exceeds the cuda backend's {protocol.MAX_EXPERTS}")
        if max_topk is not None:
            fail(1 <= max_topk <= protocol.MAX_TOPK, f"max_topk must be in 1..{protocol.MAX_TOPK}")
        fail(1 <= max_alignment <= protocol.MAX_ALIGNMENT, f"max_alignment must be in 1..{protocol.MAX_ALIGNMENT}")
        hints = dict(max_tokens=max_tokens_per_rank, hidden=hidden, max_experts=num_experts, max_topk=max_topk,
                     dtype_bytes=dtype_bytes, combine_bytes=combine_bytes, combine_rows=combine_rows,
                     pool_bytes=pool_bytes, max_alignment=max_alignment)
        self.rank, self.num_ranks = rank, num_ranks
        if nvshmem_heap_bytes is not None:
            fail(isinstance(nvshmem_heap_bytes, int) and nvshmem_heap_bytes > 0,
                 f"nvshmem_heap_bytes must be a positive int, got {nvshmem_heap_bytes!r}")
            nvshmem.reserve(nvshmem_heap_bytes, f"Buffer(nvshmem_heap_bytes={nvshmem_heap_bytes})")
        self.ranks_per_node = node_size(group, num_ranks, ranks_per_node)
        self.path: NormalPath = normal_path_for(num_ranks, self.ranks_per_node).open(
            group, rank, num_ranks, self.ranks_per_node, hints, num_sms, timeout_s)
        self.rt = self.path.rt
        self._ll = None  # the low-latency path, created on first use (see _low_latency)
        if low_latency is not None:
            self._low_latency(low_latency)

    @property
    def num_sms(self) -> int:
        return self.rt.budget.num_sms

    @property
    def max_num_sms(self) -> int:
        return self.rt.budget.local_sms

    def set_num_sms(self, num_sms: Optional[int]) -> None:
        self.rt.budget.set(num_sms)  # the internode path's RDMA kernels read the same budget

    @property
    def comm_stream(self) -> torch.cuda.Stream:
        return self.rt.stream

    def describe(self) -> str:
        return self.path.describe()

    def _path_of(self, call: protocol.Call) -> Path:
        return self._low_latency() if call.op in _LL_OPS else self.path

    def begin(self, call: protocol.Call) -> None:
        """Entry check (errors reported since the last call) of the path that serves `call`."""
        self._path_of(call).begin(call)

    def failed(self, call: protocol.Call, exc: BaseException) -> None:
        """A failure on this rank: its publication to the peers waiting on this call."""
        self._path_of(call).failed(call, exc)

    def destroy(self) -> None:
        if self._ll is not None:
            self._ll.close()
        self.path.close()

    def synchronize(self) -> None:
        """Wait for this buffer's kernels and raise if any of them reported a failure."""
        self.path.synchronize()
        if self._ll is not None:  # low-latency kernels run on the caller's stream
            self._ll.synchronize()

    def reserve(self, need: dict) -> None:
        self.rt.region.reserve(need)

    # ------------------------------------------------------------------------------ layout
    def layout(self, topk_idx: torch.Tensor, num_experts: int, counts_dtype: torch.dtype = torch.int64) -> DispatchLayout:
        """One crossing: the counts in one zeroed buffer, the kernel, on the caller's stream."""
        # (by position, in the binding's order: topk_idx, num_experts, num_ranks, counts_int32)
        return DispatchLayout(*self.rt.ext.layout(topk_idx, num_experts, self.num_ranks, counts_dtype == torch.int32))

    # ---------------------------------------------------------------------- normal path
    @property
    def routing_replay(self):
        """The normal path's replay of its last new routing (megatron_ep/core/replay.py), or None."""
        return getattr(self.path, "routing_replay", None)

    def dispatch(self, call, req):
        return self.path.dispatch(call, req)

    def combine(self, call, req):
        return self.path.combine(call, req)

    # ---------------------------------------------------------------------- low latency
    def _low_latency(self, capacity: Optional[dict] = None):
        """The low-latency path (NVSHMEM); created once, collectively (its first call)."""
        if self._ll is None:
            from .paths.low_latency import LowLatencyPath

            self._ll = LowLatencyPath(self.path.world, capacity)
        return self._ll

    def low_latency_path(self):
        """The low-latency path, or None before its first call (the rank mask's methods need it)."""
        return self._ll

    @property
    def ll_dispatch_replay(self):
        """The low-latency path's replay of its last dispatch (megatron_ep/core/replay.py), or None."""
        return None if self._ll is None else self._ll.dispatch_replay

    @property
    def ll_combine_replay(self):
        """The low-latency path's replay of its last combine (megatron_ep/core/replay.py), or None."""
        return None if self._ll is None else self._ll.combine_replay

    def low_latency_dispatch(self, call, *args, **kwargs):
        """kwargs: return_recv_hook (the output's `hook` launches the receive half)."""
        return self._low_latency().dispatch(call, *args, **kwargs)

    def low_latency_combine(self, call, *args, **kwargs):
        """kwargs: return_recv_hook (returns (y, hook)), out (a [T, H] bf16 tensor to write)."""
        return self._low_latency().combine(call, *args, **kwargs)

    # ------------------------------------------------------------------ zero-copy inputs
    def dispatch_input(self, num_tokens: int, hidden: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """A [T, H] tensor inside this rank's dispatch staging: dispatching it skips one copy.
        Valid until the next dispatch on this buffer."""
        region = self.rt.region
        fail(region.ready, "get_dispatch_input needs a sized buffer (sizing hints, or one dispatch first)", RuntimeError)
        nbytes = hidden * dtype.itemsize
        fail(num_tokens <= region.plan.max_tokens and nbytes <= region.plan.x_row_bytes, "dispatch_input larger than the buffer")
        return region.view(region.plan.stage_x, [num_tokens, hidden], dtype)

    def combine_input(self, num_rows: int, hidden: int, dtype: torch.dtype = torch.bfloat16, device=None) -> torch.Tensor:
        """A [rows, H] tensor inside this rank's combine area: combining it skips one copy
        (experts can write their output there). Valid until the next combine on this buffer."""
        region = self.rt.region
        fail(region.ready, "get_combine_input needs a sized buffer (sizing hints, or one dispatch first)", RuntimeError)
        nbytes = hidden * dtype.itemsize
        fail(num_rows <= region.plan.comb_rows and nbytes <= region.plan.comb_row_bytes, "combine_input larger than the buffer")
        return region.combine_view(num_rows, hidden, dtype)
