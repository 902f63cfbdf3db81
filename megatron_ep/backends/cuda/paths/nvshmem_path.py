"""What the two NVSHMEM paths of the cuda backend share (low-latency, and internode's RDMA
domain): one symmetric buffer per rank, sized by the largest of every rank's needs (agreed over
the group, collectively: up front, or at the first call) and checked against every later call;
freed collectively unless the path is broken; the kernels' error record decoded into the
package's errors; and a failure of this rank published into its peers' buffers.

These paths have no host handshake: the call's signature travels as a hash (`signature_hash`)
with the data, a receiver that gets another one reports a mismatch, and a rank that fails before
it sends its part of a call writes (rank, call) into a word of every peer's buffer, so their
waits for that call stop at once (PeerFailedFatalError) instead of timing out. A subclass holds
its own layout, kernels and wording of what its kernels waited for.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from abc import abstractmethod
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import extension as _ext
from .. import nvshmem
from ....core import protocol
from ....core.checks import fail
from ....core.errors import CallMismatchError, CommTimeoutError, PeerFailedFatalError
from ..failure_state import FailureState
from ..collectives import bounded_barrier, gather
from .interface import Path


_SIG = struct.Struct(f"<{len(protocol.SIG_FIELDS)}q")  # (compiled once: every call hashes its signature)


def signature_hash(call: protocol.Call) -> int:
    """31 bits of the call's signature, carried by every count signal and flag."""
    return zlib.crc32(_SIG.pack(*call.sig)) & 0x7FFFFFFF


class NvshmemPath(FailureState, Path):
    """One rank's NVSHMEM path over `group`. Class attributes word its messages."""

    KIND = ""  # "internode", "low-latency"
    SIZE_UP_FRONT = ""  # how to size the buffer before the first call
    FIT_REMEDY = ""  # how to size it large enough
    SENDS = ""  # what a peer had not done when it failed: "its RDMA send in", "its launch of"
    SIGNATURE = ""  # what the signature hash covers, for a mismatch
    PENDING = protocol.Pending.FIRST  # where the peers wait for this rank from the call's entry on

    def __init__(self, group, rank: int, num_ranks: int, device: torch.device, timeout_s: float):
        FailureState.__init__(self, self.KIND)
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.device, self.timeout_s = device, timeout_s
        self.ext = _ext.load_nvshmem()
        self.buf = None
        self.error_word = None  # the kernels' error record's code, in mapped host memory (check())
        self.cap: Optional[dict] = None  # what the buffer was sized for (agreed over the group)
        self.plan: Optional[dict] = None  # the extension's layout of it
        self._fitted: set = set()  # needs (their values) that fit `cap`: checked once each

    # ------------------------------------------------------------------------------ buffer
    def _agree(self, need: dict) -> dict:
        """Collective: what fits every rank's `need`."""
        return self._merge(gather(need, self.group))

    def _create(self, cap: dict) -> None:
        """Collective over every rank: NVSHMEM (once per process) and the symmetric buffer."""
        plan = self._plan(cap)
        pes = nvshmem.pes_for(self.group, self.rank, self.num_ranks, self.device, plan["total"], self.ext,
                              f"the {self.KIND} buffer", owner=self)
        self.buf = self._open(cap, plan, pes)
        self.error_word = ctypes.c_int.from_address(self.buf.error_address())
        dist.barrier(group=self.group)
        self._opened()
        # only now: a buffer that fails its checks above fits no call
        self.cap, self.plan = cap, plan
        self._fitted = set()
        self._created(cap)

    def _fit(self, need: dict) -> None:
        """Create the buffer at the first call (collective, agreed over the group), or check the call fits."""
        if self.buf is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"the first {self.KIND} call sizes the buffer (a collective): make one call "
                                   f"before CUDA-graph capture, or {self.SIZE_UP_FRONT}")
            self._create(self._agree(need))
        key = tuple(need.values())  # (the low-latency path tests the same key before calling here)
        if key in self._fitted:  # (every decode step makes the same call)
            return
        short = self._short(need, self.cap)
        if short:
            raise ValueError(f"the {self.KIND} buffer was sized for {self._sized_for(self.cap)}; this call does not fit "
                             f"({', '.join(short)}): {self.FIT_REMEDY}")
        if len(self._fitted) < 1024:
            self._fitted.add(key)

    def close(self) -> None:
        """Collective (nvshmem_free), skipped unless `may_free`: a peer that timed out, died, or
        was stopped by this rank's publication would never join the free, and waiting for it
        would turn an error into a hang."""
        self.error_word = None  # before the memory behind it goes
        if self.buf is not None and self.may_free:
            torch.cuda.synchronize(self.device)
            bounded_barrier(self.group, self.timeout_s, "destroy")
            self.buf.close()
            nvshmem.release(self)
        self.buf = None

    @abstractmethod
    def _merge(self, every: List[dict]) -> dict:
        """The buffer's capacity from every rank's need."""

    @abstractmethod
    def _plan(self, cap: dict) -> dict:
        """Checks of `cap`, then the extension's layout (with its "total" bytes)."""

    @abstractmethod
    def _open(self, cap: dict, plan: dict, pes: list):
        """The extension's buffer, given every rank's PE."""

    def _opened(self) -> None:
        """Checks of the buffer just opened (every rank has), before it takes calls."""

    def _created(self, cap: dict) -> None:
        """What the path sizes along with the buffer."""

    @abstractmethod
    def _short(self, need: dict, cap: dict) -> List[str]:
        """What of `need` exceeds `cap` ("name value > capacity"), empty when the call fits."""

    @abstractmethod
    def _sized_for(self, cap: dict) -> str:
        """`cap`, as the error says what the buffer was sized for."""

    # ------------------------------------------------------------------------------ calls
    def begin(self, call: protocol.Call) -> None:
        self.check(call)
        call.owe(self.PENDING)

    def failed(self, call: protocol.Call, exc: BaseException) -> None:
        if call.owes:  # the peers' kernels wait for this rank's signals
            self.publish(call, exc)

    def synchronize(self) -> None:
        # the kernels run on the caller's stream (or are ordered with it)
        torch.cuda.current_stream(self.device).synchronize()
        self.check()

    # ------------------------------------------------------------------------------ errors
    def check(self, call: Optional[protocol.Call] = None) -> None:
        """Raise what the kernels reported since the last check: a peer's published failure or a
        timeout breaks the path; a mismatch is reported once (the record is cleared)."""
        self.raise_if_broken()
        # (the word first: every call checks, and reading it is no crossing into C++)
        word = self.error_word
        if self.buf is None or (word is not None and word.value == 0):
            return
        err = self.buf.error()
        if err is None:
            return
        op = self._op(err["op"])
        if err["code"] == protocol.ERROR["peer_failed"]:
            raise self.break_with(PeerFailedFatalError,
                                  f"rank {err['peer']} failed before {self.SENDS} the {op} and told its peers; rank "
                                  f"{self.rank} stopped waiting for it{self._where(err)}")
        if err["code"] == protocol.ERROR["mismatch"]:
            self.buf.clear_error()
            raise CallMismatchError(
                f"megatron_ep {op}: {self._peer(err)} made a different call than rank {self.rank} (signature hash "
                f"{err['sig_got']:#x} vs {err['sig_expected']:#x}{self.SIGNATURE}); its rows were discarded"
                + (f" [reported at call #{call.seq}]" if call else ""))
        raise self.break_with(CommTimeoutError, f"rank {self.rank} timed out after {self.timeout_s:.0f}s in the {op}, "
                                                f"{self._waited(err)}")

    def publish(self, call: protocol.Call, exc: BaseException) -> None:
        """This rank raised before sending its part of `call`: the kernel writes (rank, seq) into
        every peer's peer_failed word, and their waits for that call stop (PeerFailedFatalError).
        Nothing of the call left this rank, so it stays usable here (when every rank failed the
        same call, an argument error, nobody waited and nothing breaks); `published` makes it skip
        the collective free later."""
        if self.buf is None or self.broken:
            return
        self.published = True
        try:
            self.buf.publish_failure(call.seq)
        except Exception:  # noqa: BLE001 - the original error is what the caller must see
            pass

    def _op(self, op: int) -> str:
        """The reported call's op, as messages name it."""
        return protocol.op_name(op)

    def _peer(self, err: dict) -> str:
        return f"rank {err['peer']}"

    def _where(self, err: dict) -> str:
        """Where a peer's published failure was seen (appended to the message)."""
        return ""

    @abstractmethod
    def _waited(self, err: dict) -> str:
        """What a timed-out kernel waited for ("waiting for rank ...")."""
