"""The cuda backend's runtime, shared by the kernel paths in megatron_ep/cuda/paths/ (intranode, and
the in-node stage of internode; low-latency uses its group-wide helpers):

* the communication region of each rank (control block, handshake counters, staging, combine
  area, output pool) shared by CUDA IPC, planned by the C++ `plan_region` (megatron_ep._protocol);
* its size: from the Buffer's hints, or -- without hints -- from the first call, agreed over the
  group; then grown collectively whenever a synchronous dispatch finds (from notify's group-wide
  counts, identical on every rank) that any rank needs more. Growing never frees memory a live
  tensor points into: pooled outputs and zero-copy views keep their old region alive;
* call bookkeeping: sequence numbers, the signature every call publishes at its first exchange,
  and the publication of a failure on this rank, so peers abort the same call instead of
  waiting (see megatron_ep/protocol.py);
* errors: the mapped host block's error record, decoded into named exceptions; recoverable
  aborts (mismatch, peer failure) leave the buffer usable, timeouts break it (the failure state
  and wording every cuda path shares: megatron_ep/cuda/failure_state.py);
* the SM budget (what the ranks sharing a GPU can keep resident), the communication stream,
  events, and a host wait that backs off instead of spinning a core.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import time
import weakref
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .. import envs
from . import extension as _ext
from . import sharing
from .. import protocol as P
from ..checks import fail
from ..model.rates import COPY_HEADROOM, HBM_COPY_GBPS, NVLINK_GBPS, PER_SM_COPY_GBPS, sms_for
from ..errors import CommTimeoutError, MegatronEPError, PeerFailedError
from .failure_state import FailureState
from ..hooks import new_outputs

log = logging.getLogger("megatron_ep")

DEFAULT_TIMEOUT_S = envs.number("MEP_TIMEOUT_S", 60.0, above=0)

# The SM budget rule. A copy kernel is limited by the slower of the link that carries the rows
# and the rate at which its SMs can move them; give it enough SMs that their copy rate covers
# the link with COPY_HEADROOM (the rates: megatron_ep/model/rates.py). Virtual ranks (several
# processes on one GPU) share that GPU's HBM.
# The push kernel (a warp per token, its row to every destination) is faster at 16 SMs than at 24
# at EP 2 with one rank per GPU (4096 tokens, H 7168, bf16; docs/performance-history.md): past what
# the link needs, more blocks only contend. Capped there at EP 2 with one rank per GPU; other
# shapes are unmeasured and uncapped. MEP_PUSH_MAX_SMS overrides (benchmarks compare).
PUSH_MAX_SMS_EP2 = 16

COMM_STREAM_PRIORITY = -1  # torch: lower is higher; the default (compute) streams have 0

_NO_ERROR = P.ERROR["none"]  # HostInfo::error while the kernels reported nothing


def default_num_sms(ranks_per_device: int, sm_count: int) -> int:
    """SMs per rank for the copy kernels (see the rule above); even, at least 4, and small
    enough that every rank sharing the GPU keeps all its blocks resident at once."""
    link = HBM_COPY_GBPS / ranks_per_device if ranks_per_device > 1 else NVLINK_GBPS
    n = sms_for(COPY_HEADROOM * link, PER_SM_COPY_GBPS)
    n += n % 2
    return max(4, min(n, max_num_sms(ranks_per_device, sm_count)))


def max_num_sms(ranks_per_device: int, sm_count: int) -> int:
    """Kernels that wait on peers need all their blocks resident; under MPS the ranks sharing a
    GPU must fit together, one block per SM each."""
    return max(1, sm_count // ranks_per_device)


class CudaRuntime(FailureState):
    """Region, calls and errors of one Buffer's cuda backend (one per rank). `kind` names the
    path it serves in messages (the intranode path, or internode's in-node stage)."""

    def __init__(self, group, rank: int, num_ranks: int, *, hints: Dict[str, Optional[int]], num_sms: Optional[int],
                 timeout_s: float = DEFAULT_TIMEOUT_S, device_group=None, kind: str = "intranode"):
        FailureState.__init__(self, kind)
        self.ext = _ext.load()
        fail(torch.cuda.is_available(), "backend='cuda' needs a CUDA device", RuntimeError)
        if num_ranks > P.MAX_RANKS:
            raise ValueError(f"the intranode cuda path supports up to {P.MAX_RANKS} ranks, got {num_ranks}")
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
        # MEP_DEVICE_SHARERS: processes on this GPU outside the group too (virtual ranks of several
        # groups, e.g. Megatron's EP groups of a test on one GPU): every one of them needs its
        # blocks resident at once, so the SM budget is split over all of them
        self.ranks_per_device = max(sum(p == me for p in peers), envs.integer("MEP_DEVICE_SHARERS", 0, minimum=1) or 0)
        # ranks sharing a GPU under lazy module loading can stop each other (cuda/sharing.py):
        # said once here, and again in every timeout message
        if self.lazy_hazard and rank == 0:
            log.warning("megatron_ep: %s", self.lazy_hazard)
        self.sm_count = props.multi_processor_count
        # local kernels that wait on nobody (expert-major fan-out and pre-reduction) take this
        # rank's share of the GPU, as the permute they replace would; it also bounds num_sms
        self.local_sms = max_num_sms(self.ranks_per_device, self.sm_count)
        self.set_num_sms(num_sms)
        self.hints = {k: v for k, v in hints.items() if v is not None}
        self.hints["num_ranks"] = num_ranks
        self.rt = None
        self._error_word = None  # HostInfo::error in mapped host memory, once created (check)
        self.plan = None  # the region's RegionLayout (megatron_ep._protocol), once created
        # high priority: when SMs free up, the block scheduler places our kernels' blocks (which wait
        # on peers, and need all of them resident) ahead of those of GEMMs queued beside them
        self.stream = torch.cuda.Stream(device=self.device, priority=COMM_STREAM_PRIORITY)
        self.trace: Optional[list] = None  # benchmarks: (phase, event) pairs on the comm stream
        self._comb_views: list = []  # weak references to zero-copy combine inputs handed out
        self.grown = 0
        self.closed = False
        if "max_tokens" in self.hints and "hidden" in self.hints:
            self._create(self.hints)

    def set_num_sms(self, num_sms: Optional[int]) -> None:
        """The normal paths' SM budget from the next launch on: num_sms, or the default rule
        (None). Each launch reads it (blocks()); a rank's count never has to match its peers'
        (every kernel strides over its rows with the blocks it has)."""
        limit = self.local_sms
        if num_sms is not None and not (isinstance(num_sms, int) and 1 <= num_sms <= limit):
            raise ValueError(f"num_sms={num_sms}: with {self.ranks_per_device} rank(s) on this GPU ({self.sm_count} SMs) "
                             f"each rank may use 1..{limit} SMs, or blocks that wait on each other would not all be "
                             f"resident")
        self.num_sms = num_sms or default_num_sms(self.ranks_per_device, self.sm_count)
        cap = PUSH_MAX_SMS_EP2 if self.num_ranks == 2 and self.ranks_per_device == 1 else self.num_sms
        self.push_sms = min(self.num_sms, envs.integer("MEP_PUSH_MAX_SMS", cap, minimum=1))

    def blocks(self, path_max: int, latency_bound: bool = False) -> int:
        """Blocks of a path's kernels, decided here for every path: the rank's SM budget
        (Buffer(num_sms=), else the default split) for the normal paths' copy kernels; every SM
        this rank may keep resident for the latency-bound low-latency kernels, whatever num_sms
        says (as DeepEP's low-latency kernels ignore its num_sms: a decode step has no GEMM
        beside it to leave SMs to); at most `path_max`, what the path's kernels take."""
        return max(1, min(self.local_sms if latency_bound else self.num_sms, path_max))

    # ------------------------------------------------------------------------------ region
    @property
    def ready(self) -> bool:
        return self.rt is not None

    def _create(self, hints: dict) -> None:
        """Collective: plan, allocate and open every rank's region."""
        plan = P.plan_region(hints)
        if plan.max_experts > P.MAX_EXPERTS:
            raise ValueError(f"num_experts={plan.max_experts} exceeds the cuda backend's {P.MAX_EXPERTS}")
        if not (1 <= plan.max_topk <= P.MAX_TOPK):
            raise ValueError(f"max_topk must be in 1..{P.MAX_TOPK}")
        # the allocation can fail on one rank (memory): every rank still reaches the gather, so
        # the others raise PeerFailedError naming it instead of waiting there
        try:
            rt = self.ext.Runtime(self.device.index, self.rank, self.num_ranks, plan, self.timeout_s)
            mine = bytes(rt.ipc_handle())
        except Exception as exc:
            gather({"failed": P.failure_message(exc)}, self.group)
            raise
        every = gather(mine, self.group)
        failed = [r for r, h in enumerate(every) if isinstance(h, dict)]
        if failed:
            rt.close()
            raise PeerFailedError(f"megatron_ep: allocating the communication region: rank {failed[0]} failed: "
                                  f"{every[failed[0]]['failed']}")
        rt.open_peers(every)
        rt.set_comm_stream(self.stream)
        dist.barrier(group=self.group)
        self.rt, self.plan, self.hints = rt, plan, dict(hints)
        # the kernels' error word, read in place by every call's entry check (no crossing)
        self._error_word = ctypes.c_int.from_address(rt.error_address())
        self._fitted: set = set()  # needs known to fit this region
        self.base = rt.base_ptr()
        log.info("megatron_ep cuda buffer on rank %d: %.1f MiB region (tokens %d, row bytes %d, combine rows %d), %d SMs",
                 self.rank, plan.total / 2**20, plan.max_tokens, plan.x_row_bytes, plan.comb_rows, self.num_sms)

    def first_use(self, needs: Optional[dict] = None, failure: Optional[BaseException] = None) -> None:
        """Without sizing hints, the first call sizes the region: every rank's needs, agreed over
        the group (collective; every rank's first call gets here -- a rank whose first call
        failed before that comes with its failure, and every peer raises it)."""
        if self.ready:
            return
        local = {"failed": P.failure_message(failure)} if failure is not None else merge_hints(self.hints, needs)
        every = gather(local, self.group)
        failed = [r for r, d in enumerate(every) if "failed" in d]
        if failed:
            if failure is not None:
                return  # the caller re-raises its own error
            raise P.peer_failed_error(P.Call(P.OP["dispatch"], 1), failed[0], every[failed[0]]["failed"])
        self._create(merge_hints(*every))

    def first_use_in(self, call: P.Call, needs: dict) -> None:
        """`first_use` inside `call`, before the call's own first exchange: the sizing exchange
        reports a failed rank to every rank itself (nothing is owed while it runs); after it, the
        peers wait for this rank at the call's first exchange again."""
        call.settle()
        self.first_use(needs)
        call.owe(P.Pending.FIRST)

    _CAPACITY = ("max_tokens", "x_row_bytes", "scale_cols", "max_topk", "max_experts", "comb_rows", "comb_row_bytes")

    def fits(self, need: dict) -> Optional[str]:
        """None if a call with these needs (hint keys) fits the region as it is, else what does not
        (needs that fitted are remembered: the steady state plans nothing per call)."""
        # token and combine-row counts change every call: compared directly; the rest (row
        # widths, top-k, experts) is planned once per distinct value
        p = self.plan
        rest = dict(need)
        max_tokens, combine_rows = rest.pop("max_tokens", 0), rest.pop("combine_rows", 0)
        counts_fit = max_tokens <= p.max_tokens and combine_rows <= p.comb_rows
        key = tuple(rest.items())  # (in the order the caller built it: another order is one more plan, not an error)
        if counts_fit and key in self._fitted:
            return None
        new = self._plan_for(need)
        short = [f"{k} {getattr(new, k)} > {getattr(self.plan, k)}" for k in self._CAPACITY
                 if getattr(new, k) > getattr(self.plan, k)]
        if not short and len(self._fitted) < 4096:
            self._fitted.add(key)
        return ", ".join(short) or None

    def _hints_for(self, need: dict) -> dict:
        h = merge_hints(self.hints, {k: int(v) for k, v in need.items() if k in _NEED_KEYS})
        h["combine_rows"] = max(self.plan.comb_rows, int(need.get("combine_rows", 0)))
        return h

    def _plan_for(self, need: dict):
        return P.plan_region(self._hints_for(need))

    def grow_if_needed(self, need: dict) -> bool:
        """At a synchronous point where every rank holds the same `need` (notify's group-wide
        counts and the agreed signature): re-create the region larger if anything does not fit.
        Collective, but every rank takes the same decision from the same numbers."""
        short = self.fits(need)
        if short is None:
            return False
        h = self._hints_for(need)
        new = P.plan_region(h)
        # headroom, so that a slowly growing need does not re-create the region every few calls
        if new.max_tokens > self.plan.max_tokens:
            h["max_tokens"] = _round_up(int(h["max_tokens"] * 1.25), 256)
        if new.comb_rows > self.plan.comb_rows:
            h["combine_rows"] = _round_up(int(h["combine_rows"] * 1.25), 256)
        self._replace(h, short)
        return True

    def reserve(self, need: dict) -> None:
        """Collective: size (or grow) the region for the largest of every rank's `need`."""
        if not self.ready:
            self.first_use(need)  # agrees on the largest needs itself
        else:
            self.grow_if_needed(merge_hints(*gather(dict(need), self.group)))

    def _replace(self, hints: dict, why: str) -> None:
        log.info("megatron_ep: growing the cuda buffer on rank %d (%s)", self.rank, why)
        self.stream.synchronize()
        dist.barrier(group=self.group)  # nobody reads the old regions any more
        old = self.rt
        self._create(hints)
        old.close()  # unmaps the peers; this rank's old memory lives while tensors point into it
        self.grown += 1

    def close(self) -> None:
        """Collective: every rank stops using the regions; memory that live tensors point into
        (pooled outputs, views) is freed when they die."""
        if self.rt is None:
            return
        self.stream.synchronize()
        bounded_barrier(self.group, self.timeout_s, "destroy")
        self._error_word = None  # before the memory behind it goes
        self.rt.close()
        self.rt = None
        self.closed = True

    # ------------------------------------------------------------------------------ calls
    def publish(self, call: P.Call, exc: BaseException) -> None:
        """`call` failed on this rank with `exc`: if peers may be waiting for it (`call.pending`),
        a failed record at the handshake they wait on next."""
        if not call.owes or self.broken or self.closed:
            return
        try:
            if self.ready:
                slot = call.pending.slot
                with torch.cuda.stream(self.stream):
                    self.rt.fail_call(call.sig, P.failure_message(exc), slot)
            elif call.pending is P.Pending.FIRST:  # the peers are sizing the buffer in this call
                self.first_use(failure=exc)
        except Exception:  # noqa: BLE001 - the original error matters more
            log.exception("megatron_ep: could not publish a failure to the peers")

    def check(self, call: Optional[P.Call] = None) -> None:
        """Raise what the kernels reported since the last check: a fatal error breaks the buffer;
        an aborted call (an earlier asynchronous one) is reported once."""
        fail(not self.closed, "this Buffer was destroyed", RuntimeError)
        self.raise_if_broken()
        if self.rt is None or self._error_word.value == _NO_ERROR:
            return
        err = self.rt.take_error(clear=False)
        if err is None:
            return
        raise self._error(err, call)

    def _error(self, err: dict, call: Optional[P.Call]) -> MegatronEPError:
        code = err["code"]
        if P.is_fatal(code):
            return self.break_with(CommTimeoutError, self._describe_fatal(err))
        self.rt.take_error(clear=True)
        failed = P.Call(err["ops"][self.rank] if err["ops"] else 0, err["seq"])
        if code == P.ERROR["mismatch"]:
            e = P.mismatch_error(failed, err["field"], err["values"], err["ops"])
        else:
            e = P.peer_failed_error(failed, err["peer"], err["message"].decode("utf-8", "replace"))
        if call is not None and call.seq != err["seq"]:
            e = type(e)(f"{e} [reported at call #{call.seq}]")
        if err["num_aborted"] > 1:
            e = type(e)(f"{e} ({err['num_aborted']} calls aborted so far)")
        return e

    def _describe_fatal(self, err: dict) -> str:
        what = P.SLOT_NAMES.get(err["slot"], f"slot {err['slot']}")
        if err["code"] == P.ERROR["timeout"]:
            if err["peer"] == err["rank"] and err["slot"] >= len(P.SLOT_NAMES) - 1:
                text = (f"rank {err['rank']} timed out after {self.timeout_s:.0f}s at '{what}' in call #{err['seq']}: "
                        f"its kernel's blocks were not all resident (lower num_sms)")
            else:
                text = (f"rank {err['rank']} timed out after {self.timeout_s:.0f}s waiting for rank {err['peer']} at "
                        f"'{what}' in call #{err['seq']} (counter {err['observed']}, expected {err['expected']})")
        else:
            text = (f"rank {err['rank']} stopped waiting at '{what}' in call #{err['seq']} because rank {err['peer']} "
                    f"had timed out")
        return self._with_hazard(text)

    @property
    def lazy_hazard(self) -> Optional[str]:
        """Why ranks sharing this GPU may stop each other (lazy module loading), or None."""
        return sharing.lazy_loading_hazard(self.ranks_per_device)

    def _with_hazard(self, text: str) -> str:
        """A timeout's message, with what may have caused it where ranks share a GPU."""
        hazard = self.lazy_hazard
        return f"{text} ({hazard})" if hazard else text

    @property
    def host_wait_s(self) -> float:
        """How long the host waits for notify's sizes: the kernels' own timeout, and a margin."""
        return self.timeout_s + 5

    def host_sizes(self, call: P.Call, waited: int, info: Optional[dict]) -> dict:
        """What a wait for notify's sizes returned (Runtime::wait_counts: 0 and the sizes, 1 a
        fatal error first, 2 the timeout): the sizes, or the call's error."""
        if waited == 1:  # a fatal error came first
            raise self._error(self.rt.take_error(clear=False), call)
        if waited == 2:
            raise self.break_with(CommTimeoutError, self._with_hazard(
                f"rank {self.rank}: no receive count from the notify kernel of call #{call.seq} within "
                f"{self.host_wait_s:.0f}s"))
        if info["num_rows"] < 0:  # this call was aborted at its exchange, on every rank
            err = self.rt.take_error(clear=False)
            if err is not None:
                raise self._error(err, call)
            raise MegatronEPError(f"{call.describe()} was aborted on every rank (the reason was reported earlier)")
        return info

    # ----------------------------------------------------------------------- hooks and marks
    def new_outputs(self, tensors) -> bool:
        """Apply the output hook (tests; megatron_ep.hooks); True when it ran (the comm stream
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

    def scratch_free(self) -> bool:
        """Whether the combine area may serve as the expert-major push's rank-major buffer (no
        kernel uses it between calls, and every use is on our stream in call order): not while
        a zero-copy combine input handed out is alive."""
        return not any(r() is not None for r in self._comb_views)

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.rt.view(offset, list(shape), dtype)

    def combine_view(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """A caller's tensor over the combine area (zero-copy combine input); while one is alive
        the area is not lent out as dispatch scratch."""
        t = self.view(self.plan.comb_x, [rows, hidden], dtype)
        self._comb_views = [r for r in self._comb_views if r() is not None] + [weakref.ref(t)]
        return t


def bounded_barrier(group, timeout_s: float, what: str) -> None:
    """A barrier that gives up: a rank that never joins (it called something else, or died)
    raises CommTimeoutError here after `timeout_s` instead of a hang (gloo's own timeout is 30
    minutes). Polling the barrier's work, so it behaves the same on gloo and NCCL groups."""
    work = dist.barrier(group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"megatron_ep: {what} is collective, and not every rank of the group joined it within "
                                   f"{timeout_s:.0f}s; this rank keeps its communication memory")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    work.wait()


def gather(obj, group) -> list:
    """Every rank's `obj` in `group` rank order (collective)."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def largest(needs: list) -> dict:
    """Every key of the ranks' needs, at its largest value."""
    return {k: max(d.get(k, 0) or 0 for d in needs) for k in set().union(*needs)}


# The keys of a call's need that size the region (the hint names of csrc/ipc/region_layout.h).
_NEED_KEYS = ("max_tokens", "hidden", "dtype_bytes", "combine_bytes", "max_topk", "max_experts")


def merge_hints(*hints: dict) -> dict:
    """Region hints that fit every one of `hints` (the owner of that rule): counts at their
    largest, and rows by their width in bytes. Taking the largest hidden size and, separately,
    the largest element size over-asks: a 7168-wide bf16 hint and a 256-wide fp32 call both fit
    14336-byte rows, not 7168 x 4 = 28672 (and a sync-free call would then raise that it does
    not fit). The element sizes become the widest row over the largest hidden size, rounded up."""
    merged = largest(list(hints))
    hidden = merged.get("hidden", 0)
    if hidden:
        for key in ("dtype_bytes", "combine_bytes"):
            widest = max((h.get("hidden", 0) or 0) * (h.get(key) or P.REGION_HINTS[key]) for h in hints)
            merged[key] = max(1, -(-widest // hidden))
    return merged


def _round_up(n: int, a: int) -> int:
    return (max(n, 1) + a - 1) // a * a
