"""The call protocol, read from the C++ definition (csrc/common/protocol.h, csrc/ipc/region_layout.h through
the small `megatron_ep._protocol` module, which needs neither CUDA nor torch).

Every collective call on a Buffer carries a signature -- the Buffer, op, call sequence number, the routing
it reuses, dtype, hidden size, row bytes, top-k, experts, layout, alignment, worst-case rows,
weights, kernel variant -- in its first exchange (the torch backend's first collective, the cuda
backend's first handshake). Ranks that disagree on any field abort the call together and each
raises `CallMismatchError`, naming the field and every rank's value; a rank that fails on its
own during a call publishes its message there, and its peers raise `PeerFailedError` with it.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

from .errors import CallMismatchError, PeerFailedError, WorstCaseOverflowError

if TYPE_CHECKING:
    import torch

try:
    from .. import _protocol
except ImportError as exc:  # pragma: no cover - built by setup.py on every install
    raise ImportError(
        "megatron_ep._protocol is not built (it holds the protocol and region layout shared with the "
        "kernels): run `pip install --no-build-isolation -e .` or `python setup.py build_ext --inplace`"
    ) from exc

SIG_FIELDS: List[str] = list(_protocol.SIG_FIELDS)
FIELD = {name: i for i, name in enumerate(SIG_FIELDS)}
OP = dict(_protocol.OP)
OP_NAMES = {v: k for k, v in OP.items()}
SLOT = dict(_protocol.SLOT)
SLOT_NAMES = dict(_protocol.SLOTS)
ERROR = dict(_protocol.ERROR)
RECV_INFO = dict(_protocol.RECV_INFO)
CALL_FAILED = _protocol.CALL_FAILED
MSG_BYTES = _protocol.MSG_BYTES
MAX_RANKS, MAX_TOPK, MAX_EXPERTS, MAX_ALIGNMENT = _protocol.MAX_RANKS, _protocol.MAX_TOPK, _protocol.MAX_EXPERTS, _protocol.MAX_ALIGNMENT
MAX_TOKEN_GROUPS = _protocol.MAX_TOKEN_GROUPS  # notify's token groups (DispatchRequest.token_groups)
FP8_BLOCK = _protocol.FP8_BLOCK
plan_region = _protocol.plan_region  # -> RegionLayout (typed, read-only attributes)
RegionLayout = _protocol.RegionLayout
REGION_LAYOUT_FIELDS: List[str] = list(_protocol.REGION_LAYOUT_FIELDS)
REGION_HINTS: dict = dict(_protocol.REGION_HINTS)  # every sizing hint's name and default (RegionHints, region_layout.h)
is_fatal = _protocol.error_is_fatal
worst_expert_major_rows = _protocol.worst_expert_major_rows
notify_plan = _protocol.notify_plan  # (num_tokens, groups) -> notify's chunk plan as a dict
# the low-latency combine's signature `variant`: what its wire and flags look like (each rank's
# sender writes what the others' receivers read, so every rank must use the same)
LL_COMBINE_LOGFMT = 1  # rows sent as LogFMT-10 where a block allows (megatron_ep.core.logfmt)
LL_COMBINE_MERGED = 2  # one row per (token, rank), weighted by the sender, one flag per rank
# a normal combine's `variant`: how its rows are summed (the ranks must agree: their kernels pair)
COMBINE_STAGED, COMBINE_PARTIALS, COMBINE_SINGLE = _protocol.COMBINE_VARIANTS  # (protocol.h CombineVariant)
_VARIANT = FIELD["variant"]
_ROUTING, _DTYPE, _HIDDEN, _ROW_BYTES, _TOPK, _NUM_EXPERTS, _PERMUTE, _ALIGNMENT, _WORST, _WEIGHTS = (
    FIELD[name] for name in ("routing", "dtype", "hidden", "row_bytes", "topk", "num_experts", "permute",
                             "expert_alignment", "worst_case_sized", "weights"))
_MAX_TOKENS = FIELD["max_tokens_per_rank"]
_OP, _SEQ = FIELD["op"], FIELD["seq"]

@functools.lru_cache(maxsize=None)
def _dtype_codes() -> dict:
    # torch loaded at the first call, not at import: the analytic model (megatron_ep.tools.model) reads
    # this module's constants and runs without torch
    import torch

    return {getattr(torch, name): code for name, code in _protocol.DTYPE.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return _dtype_codes().get(dtype, 0)


def _dtype_name(code: int) -> str:
    for dt, c in _dtype_codes().items():
        if c == code:
            return str(dt).replace("torch.", "")
    return "none"


def op_name(op: int, default: str = "call") -> str:
    """An op code as messages write it ("low latency dispatch")."""
    return OP_NAMES.get(op, default).replace("_", " ")


class Pending(enum.Enum):
    """Where this rank's peers wait for it in a call, so where a failure of its host side must be
    published for them to abort the call instead of waiting."""

    FIRST = "first"  # the call's first exchange (the cuda runtime's call slot, the torch backend's first collective)
    COMMIT = "commit"  # torch backend: the readiness exchange before the data collective
    STAGED = "staged"  # cuda intranode, after notify: the staging handshake
    OUT_LOC = "out_loc"  # cuda intranode, after notify: the push's output-location handshake
    RDMA = "rdma"  # internode: this rank's RDMA send (its same-index peers wait for it)
    LAUNCH = "launch"  # low-latency: this rank's kernel launch (the peers' kernels wait for its signals)
    NOTHING = "nothing"  # every peer learns the call's outcome itself: nothing is owed

    @property
    def slot(self) -> int:
        """The runtime handshake a failed call record is written at (FIRST, STAGED, OUT_LOC)."""
        return SLOT["call"] if self is Pending.FIRST else SLOT[self.value]


@dataclass
class Call:
    """One collective call: its sequence number, its signature, and where this rank must publish
    a failure so its peers abort the same call instead of waiting (`pending`): FIRST until the
    first exchange, then the handshake the peers wait on next, NOTHING once nothing is owed."""

    op: int
    seq: int
    sig: Optional[List[int]] = None  # given: a replayed call's signature (megatron_ep/core/replay.py), copied
    pending: Pending = Pending.FIRST

    def __post_init__(self):
        sig = [0] * len(SIG_FIELDS) if self.sig is None else self.sig.copy()
        sig[_OP], sig[_SEQ] = self.op, self.seq
        self.sig = sig

    def set(self, **fields) -> "Call":
        for name, value in fields.items():
            self.sig[FIELD[name]] = int(value)
        return self

    def set_normal(self, routing: int, dtype: int, hidden: int, row_bytes: int, topk: int, num_experts: int,
                   permute: bool, expert_alignment: int, worst_case_sized: bool, weights: int) -> "Call":
        """set() of a normal dispatch's or combine's ten data fields, positionally (every such call
        sets them: a keyword loop costs more host time than the stores)."""
        sig = self.sig
        (sig[_ROUTING], sig[_DTYPE], sig[_HIDDEN], sig[_ROW_BYTES], sig[_TOPK], sig[_NUM_EXPERTS], sig[_PERMUTE],
         sig[_ALIGNMENT], sig[_WORST], sig[_WEIGHTS]) = (routing, dtype, hidden, row_bytes, topk, num_experts, int(permute),
                                                         expert_alignment, int(worst_case_sized), weights)
        return self

    def set_low_latency(self, routing: int, dtype: int, hidden: int, row_bytes: int, topk: int, num_experts: int,
                        max_tokens_per_rank: int, variant: int) -> "Call":
        """set() of a low-latency call's data fields, positionally (as set_normal)."""
        sig = self.sig
        (sig[_ROUTING], sig[_DTYPE], sig[_HIDDEN], sig[_ROW_BYTES], sig[_TOPK], sig[_NUM_EXPERTS], sig[_MAX_TOKENS],
         sig[_VARIANT]) = (routing, dtype, hidden, row_bytes, topk, num_experts, max_tokens_per_rank, variant)
        return self

    def set_variant(self, variant: int) -> "Call":
        """set(variant=...) without the keyword loop (every normal call sets it)."""
        self.sig[_VARIANT] = variant
        return self

    def set_routing(self, routing: int) -> "Call":
        """set(routing=...) without the keyword loop (a replayed low-latency combine's dispatch)."""
        self.sig[_ROUTING] = routing
        return self

    def get(self, name: str) -> int:
        return self.sig[FIELD[name]]

    def owe(self, where: Pending) -> None:
        """From here the peers wait for this rank at `where`."""
        self.pending = where

    def settle(self) -> None:
        """From here every peer learns the call's outcome itself (this rank signalled, or the
        exchange reports a failure to every rank): a later failure owes them nothing."""
        self.pending = Pending.NOTHING

    def sends(self, launch: Callable[..., Any], *args, **kwargs) -> Any:
        """Queue `launch(*args, **kwargs)`, a kernel in which this rank signals its peers for this
        call (a handshake, or an exchange that reports a failed rank to every rank): once it is
        queued the peers learn the call's outcome from it, so the publication is settled here,
        by the launch itself, instead of by a call placed beside it."""
        out = launch(*args, **kwargs)
        self.settle()
        return out

    @property
    def owes(self) -> bool:
        """Whether peers may be waiting for this rank (a failure must be published)."""
        return self.pending is not Pending.NOTHING

    @property
    def name(self) -> str:
        return op_name(self.op)

    def describe(self) -> str:
        return f"megatron_ep {self.name} (call #{self.seq})"


class guarded:
    """A call's host side under `owner` (a backend or a kernel path), as a context: its entry check
    (`owner.begin`), and on a failure, the entry check's too, its publication to the peers
    (`owner.failed`) before it propagates. A class, not a generator: every call enters one, and a
    generator-based context costs several times the host time of these steps."""

    __slots__ = ("owner", "call")

    def __init__(self, owner, call: Call):
        self.owner, self.call = owner, call

    def __enter__(self) -> Call:
        try:
            self.owner.begin(self.call)
        except BaseException as exc:
            self.owner.failed(self.call, exc)
            raise
        return self.call

    def __exit__(self, typ, exc, tb) -> bool:
        if exc is not None:
            self.owner.failed(self.call, exc)
        return False


def failure_message(exc: BaseException) -> str:
    """What a failing rank tells its peers (truncated to the record's size)."""
    text = f"{type(exc).__name__}: {exc}"
    raw = text.encode("utf-8", "replace")[:MSG_BYTES]
    return raw.decode("utf-8", "ignore")


def _value(field_name: str, v: int, op: Optional[int] = None) -> str:
    if field_name == "op":
        return OP_NAMES.get(v, str(v))
    if field_name in ("dtype", "weights"):
        return _dtype_name(v)
    if field_name == "permute":
        return str(bool(v))
    if field_name == "variant" and op == OP["low_latency_combine"]:
        return ("use_logfmt" if v & LL_COMBINE_LOGFMT else "bf16 rows") + (
            ", weights given at dispatch (merged)" if v & LL_COMBINE_MERGED else "")
    if field_name == "variant" and op == OP["combine"]:
        return {COMBINE_STAGED: "staged rows", COMBINE_PARTIALS: "partials",
                COMBINE_SINGLE: "single_reduction"}.get(v, str(v))
    if field_name == "variant":
        return {0: "stage+pull", 1: "push"}.get(v, str(v))
    return str(v)


def mismatch_error(call: Call, field_index: int, values: Sequence[int], ops: Optional[Sequence[int]] = None,
                   resync: Optional[int] = None) -> CallMismatchError:
    """The error every rank raises for a call its ranks disagree on. `resync`: the call number this
    rank continues from (Buffer sets it), where the disagreement is about call numbers themselves
    -- calls of different Buffers, or a rank a call behind -- and the backend can realign them;
    without it a disagreement on call numbers stays (the Buffer must be re-created)."""
    name = SIG_FIELDS[field_index]
    per_rank = ", ".join(f"rank {r} = {_value(name, v, call.op)}" for r, v in enumerate(values))
    what = {"buffer": "called different Buffers (numbered in the order each rank created them on the group)",
            "op": "called different operations",
            "seq": "are at different calls of this buffer (a rank skipped or repeated a call)",
            "routing": "passed handles from different dispatches"}.get(name, f"disagree on {name}")
    ops_text = ""
    if ops is not None and name != "op" and len(set(ops)) > 1:
        ops_text = " (ops: " + ", ".join(f"rank {r} {OP_NAMES.get(o, o)}" for r, o in enumerate(ops)) + ")"
    if name in ("buffer", "seq") and resync is None:
        after = "the ranks' call numbers stay apart: re-create the Buffer on every rank"
    elif name == "buffer":
        after = "the aborted call does not count on any Buffer, so each stays usable"
    elif name == "seq":
        after = f"every rank continues from call #{resync}, so the buffer stays usable"
    else:
        after = "the buffer stays usable"
    if name == "variant" and call.op == OP["combine"]:  # the one variant a caller's choice decides
        per_rank += (" (an expert-major combine sums its rows into partials unless its input lies in the buffer: "
                     "pass a get_combine_input view on every rank or on none, get_combine_input(0, H) on a rank "
                     "that received no rows)")
    err = CallMismatchError(f"{call.describe()}: the ranks {what}: {per_rank}{ops_text}; the call was aborted on "
                            f"every rank before anything was sent; {after}")
    err.field, err.values, err.resync = name, list(values), resync
    return err


def worst_overflow_error(call: Call, received: Sequence[int], limits: Sequence[int]) -> WorstCaseOverflowError:
    """The error every rank raises for a worst-case sized dispatch that would deliver more rows to
    a rank than its num_worst_tokens, where the call asked to fail rather than drop them."""
    over = ", ".join(f"rank {r} receives {n} rows, its num_worst_tokens={w}"
                     for r, (n, w) in enumerate(zip(received, limits)) if w and n > w)
    every = ", ".join(f"rank {r} = {n}" for r, n in enumerate(received))
    err = WorstCaseOverflowError(
        f"{call.describe()}: num_worst_tokens is below the rows a rank receives ({over}; rows each rank receives: "
        f"{every}); a worst-case sized dispatch sizes its outputs to num_worst_tokens rows, so pass at least "
        f"{max(received)} on every rank. The call was aborted on every rank before any row moved; the buffer "
        f"stays usable")
    err.received, err.limits = list(received), list(limits)
    return err


def first_mismatch(sigs: Sequence[Sequence[int]]) -> Optional[int]:
    """Index of the first signature field that differs between ranks, or None."""
    for f in range(len(SIG_FIELDS)):
        if len({int(s[f]) for s in sigs}) > 1:
            return f
    return None


def peer_failed_error(call: Call, rank: int, message: str) -> PeerFailedError:
    return PeerFailedError(f"{call.describe()} aborted on every rank: rank {rank} failed: {message}")
