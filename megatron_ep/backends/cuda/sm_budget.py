"""The SM budget of one rank's cuda kernels: how many blocks every launch of every path gets,
decided here alone (`SmBudget.blocks(kind)`).

A copy kernel is limited by the slower of the link that carries the rows and the rate at which
its SMs can move them; the default gives it enough SMs that their copy rate covers the link with
COPY_HEADROOM (the rates: megatron_ep/core/rates.py). Virtual ranks (several processes on one
GPU) share that GPU's HBM. Kernels that wait on peers need all their blocks resident, so the
ranks sharing a GPU split its SMs: no kind ever gets more than this rank's share.

The push kernel (a warp per token, its row to every destination) is faster at 16 SMs than at 24
at EP 2 with one rank per GPU (4096 tokens, H 7168, bf16; docs/records/performance-history.md): past what
the link needs, more blocks only contend. Capped there at EP 2 with one rank per GPU; other
shapes are unmeasured and uncapped. MEGATRON_EP_PUSH_MAX_SMS overrides (benchmarks compare).
"""

from __future__ import annotations

from typing import Optional

from ...core import envs
from ...core.rates import COPY_HEADROOM, HBM_COPY_GBPS, NVLINK_GBPS, PER_SM_COPY_GBPS, sms_for

PUSH_MAX_SMS_EP2 = 16

# The kinds of launch (SmBudget.blocks):
#   "copy"     the normal paths' kernels that move rows between ranks: Buffer(num_sms=), else the default
#   "push"     the intranode push (rows into the peers' pooled outputs): "copy", capped as above
#   "local"    kernels that wait on nobody (the expert-major fan-out and pre-reduction): this
#              rank's share of the GPU, as the permute they replace would take
#   "latency"  the latency-bound low-latency kernels: this rank's share too, whatever num_sms says
#              (as DeepEP's low-latency kernels ignore its num_sms: a decode step has no GEMM
#              beside it to leave SMs to)
KINDS = ("copy", "push", "local", "latency")


def default_num_sms(ranks_per_device: int, sm_count: int) -> int:
    """SMs per rank for the copy kernels (see above); even, at least 4, and small enough that
    every rank sharing the GPU keeps all its blocks resident at once."""
    link = HBM_COPY_GBPS / ranks_per_device if ranks_per_device > 1 else NVLINK_GBPS
    n = sms_for(COPY_HEADROOM * link, PER_SM_COPY_GBPS)
    n += n % 2
    return max(4, min(n, max_num_sms(ranks_per_device, sm_count)))


def max_num_sms(ranks_per_device: int, sm_count: int) -> int:
    """Kernels that wait on peers need all their blocks resident; under MPS the ranks sharing a
    GPU must fit together, one block per SM each."""
    return max(1, sm_count // ranks_per_device)


class SmBudget:
    """One rank's SMs: set once (Buffer(num_sms=)) or again (set_num_sms), read at every launch."""

    def __init__(self, num_ranks: int, ranks_per_device: int, sm_count: int, num_sms: Optional[int] = None):
        self.num_ranks, self.ranks_per_device, self.sm_count = num_ranks, ranks_per_device, sm_count
        self.local_sms = max_num_sms(ranks_per_device, sm_count)  # also bounds num_sms
        self.set(num_sms)

    def set(self, num_sms: Optional[int]) -> None:
        """The normal paths' budget from the next launch on: num_sms, or the default rule (None).
        A rank's count never has to match its peers' (every kernel strides over its rows with
        the blocks it has)."""
        limit = self.local_sms
        if num_sms is not None and not (isinstance(num_sms, int) and 1 <= num_sms <= limit):
            raise ValueError(f"num_sms={num_sms}: with {self.ranks_per_device} rank(s) on this GPU ({self.sm_count} SMs) "
                             f"each rank may use 1..{limit} SMs, or blocks that wait on each other would not all be "
                             f"resident")
        self.num_sms = num_sms or default_num_sms(self.ranks_per_device, self.sm_count)
        cap = PUSH_MAX_SMS_EP2 if self.num_ranks == 2 and self.ranks_per_device == 1 else self.num_sms
        self.push_sms = min(self.num_sms, envs.integer("MEGATRON_EP_PUSH_MAX_SMS", cap, minimum=1))
        self._of = {"copy": self.num_sms, "push": self.push_sms, "local": self.local_sms, "latency": self.local_sms}
        # the intranode entries take three counts per call: read as one attribute (host time)
        self.normal = (self.num_sms, self.push_sms, self.local_sms)

    def blocks(self, kind: str, path_max: Optional[int] = None) -> int:
        """Blocks of a launch of `kind` (KINDS), at most `path_max` (what the path's kernel takes)."""
        n = self._of[kind]
        return n if path_max is None else max(1, min(n, path_max))
