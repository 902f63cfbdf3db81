"""The cuda backend's runtime of one Buffer (one per rank), shared by the kernel paths in
megatron_ep/backends/cuda/paths/ (intranode, and the intranode stage of internode; low-latency takes its
SM budget): three parts, one job each, and what ties them to this rank's GPU.

* `region` (megatron_ep/backends/cuda/region.py): the communication region shared by CUDA IPC, its
  sizing, growth and views;
* `ledger` (megatron_ep/backends/cuda/ledger.py): the calls' failure publication and the kernels' error
  record decoded into named exceptions (and the path's failure state);
* `budget` (megatron_ep/backends/cuda/sm_budget.py): the SMs of every launch of every path;
* here: who shares this GPU, the communication stream, and the benchmarks' phase marks.
"""

from __future__ import annotations

import logging
import socket
from typing import Dict, Optional

import torch

from ...core import envs
from . import extension as _ext
from ...core import protocol
from ...core.checks import fail
from ...core.output_hook import new_outputs
from .ledger import CallLedger
from .collectives import gather
from .region import Region
from .sm_budget import SmBudget

log = logging.getLogger("megatron_ep")

DEFAULT_TIMEOUT_S = envs.number("MEGATRON_EP_TIMEOUT_S", 60.0, above=0)

COMM_STREAM_PRIORITY = -1  # torch: lower is higher; the default (compute) streams have 0


class CudaRuntime:
    """Region, call ledger and SM budget of one Buffer's cuda backend (one per rank). `kind` names
    the path it serves in messages (the intranode path, or internode's intranode stage)."""

    def __init__(self, group, rank: int, num_ranks: int, *, hints: Dict[str, Optional[int]], num_sms: Optional[int],
                 timeout_s: float = DEFAULT_TIMEOUT_S, device_group=None, kind: str = "intranode"):
        self.ext = _ext.load()
        fail(torch.cuda.is_available(), "backend='cuda' needs a CUDA device", RuntimeError)
        if num_ranks > protocol.MAX_RANKS:
            raise ValueError(f"the intranode cuda path supports up to {protocol.MAX_RANKS} ranks, got {num_ranks}")
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.device = torch.device("cuda", torch.cuda.current_device())
        cap = torch.cuda.get_device_capability(self.device)
        if cap[0] < 9:
            raise RuntimeError(f"the cuda backend's kernels are built for Hopper (sm_90); this GPU is sm_{cap[0]}{cap[1]}: "
                               f"use backend='torch'")
        self.timeout_s = timeout_s
        # who shares my GPU: virtual ranks share one HBM and one set of SMs
        props = torch.cuda.get_device_properties(self.device)
        me = (socket.gethostname(), str(getattr(props, "uuid", self.device.index)))
        # (device_group: every rank that may share it, when this runtime spans only a node of them)
        peers = gather(me, device_group or group)
        # MEGATRON_EP_DEVICE_SHARERS: processes on this GPU outside the group too (virtual ranks of several
        # groups, e.g. Megatron's EP groups of a test on one GPU): every one of them needs its
        # blocks resident at once, so the SM budget is split over all of them
        self.ranks_per_device = max(sum(p == me for p in peers), envs.integer("MEGATRON_EP_DEVICE_SHARERS", 0, minimum=1) or 0)
        self.sm_count = props.multi_processor_count
        self.budget = SmBudget(num_ranks, self.ranks_per_device, self.sm_count, num_sms)
        # high priority: when SMs free up, the block scheduler places our kernels' blocks (which wait
        # on peers, and need all of them resident) ahead of those of GEMMs queued beside them
        self.stream = torch.cuda.Stream(device=self.device, priority=COMM_STREAM_PRIORITY)
        self.region = Region(self.ext, group, rank, num_ranks, self.device, timeout_s, self.stream, hints)
        self.ledger = CallLedger(kind, self.region, self.ranks_per_device)
        # ranks sharing a GPU under lazy module loading can stop each other (cuda/sharing.py):
        # said once here, and again in every timeout message
        if self.ledger.lazy_hazard and rank == 0:
            log.warning("megatron_ep: %s", self.ledger.lazy_hazard)
        self.trace: Optional[list] = None  # benchmarks: (phase, event) pairs on the comm stream
        self.region.create_if_hinted(self.budget.num_sms)

    def close(self) -> None:
        self.region.close()

    # ----------------------------------------------------------------------- hooks and marks
    def new_outputs(self, tensors) -> bool:
        """Apply the output hook (tests; megatron_ep.core.output_hook); True when it ran (the comm stream
        must then wait)."""
        return new_outputs(tensors)

    def mark(self, name: str, stream=None, first: bool = False) -> None:
        """Benchmarks: the end of phase `name` on `stream` (default: the communication stream).
        `first`: a path's opening mark, left out when a composing path (internode) marked first."""
        if self.trace is not None and not (first and self.trace):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream if stream is None else stream)
            self.trace.append((name, ev))

    def marks(self, names, first: bool = False) -> Optional[list]:
        """Benchmarks: events for the phases `names` (None: a phase not marked) that a one-crossing
        call records at each phase's end on the communication stream, or None when not tracing.
        `first`: the first name is the path's opening mark (see mark())."""
        if self.trace is None:
            return None
        out = []
        for i, name in enumerate(names):
            if name is None or (first and i == 0 and self.trace):
                out.append(None)
                continue
            ev = torch.cuda.Event(enable_timing=True)
            self.trace.append((name, ev))
            out.append(ev)
        return out
