"""The call ledger of a region's calls: the publication of a failure on this rank at the
handshake its peers wait on next (so they abort the same call instead of waiting; the call's
sequence number and signature travel with it: megatron_ep/core/protocol.py), and the kernels' error
record decoded into named exceptions. Recoverable aborts (mismatch, peer failure) leave the
buffer usable, timeouts break it (the failure state and wording every cuda path shares:
megatron_ep/backends/cuda/failure_state.py).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ...core import protocol
from ...core.errors import CommTimeoutError, MegatronEPError
from . import sharing
from .failure_state import FailureState
from .region import Region

log = logging.getLogger("megatron_ep")

_NO_ERROR = protocol.ERROR["none"]  # HostInfo::error while the kernels reported nothing


class CallLedger(FailureState):
    """The failure publication and error decoding of the calls over `region`; `kind` names the
    path in messages (the intranode path, or internode's intranode stage)."""

    def __init__(self, kind: str, region: Region, ranks_per_device: int):
        FailureState.__init__(self, kind)
        self.region, self.rank, self.timeout_s = region, region.rank, region.timeout_s
        self.ranks_per_device = ranks_per_device

    def publish(self, call: protocol.Call, exc: BaseException) -> None:
        """`call` failed on this rank with `exc`: if peers may be waiting for it (`call.pending`),
        a failed record at the handshake they wait on next."""
        region = self.region
        if not call.owes or self.broken or region.closed:
            return
        try:
            if region.ready:
                slot = call.pending.slot
                with torch.cuda.stream(region.stream):
                    region.runtime.fail_call(call.sig, protocol.failure_message(exc), slot)
            elif call.pending is protocol.Pending.FIRST:  # the peers are sizing the buffer in this call
                region.first_use(failure=exc)
        except Exception:  # noqa: BLE001 - the original error matters more
            log.exception("megatron_ep: could not publish a failure to the peers")

    def check(self, call: Optional[protocol.Call] = None) -> None:
        """Raise what the kernels reported since the last check: a fatal error breaks the buffer;
        an aborted call (an earlier asynchronous one) is reported once."""
        region = self.region
        if region.closed:
            raise RuntimeError("this Buffer was destroyed")
        if self.broken:  # (the test inline: every call makes this check)
            self.raise_if_broken()
        if region.runtime is None or region.error_word.value == _NO_ERROR:
            return
        err = region.runtime.take_error(clear=False)
        if err is None:
            return
        raise self.error(err, call)

    def error(self, err: dict, call: Optional[protocol.Call]) -> MegatronEPError:
        """The named exception of the kernels' error record `err` (a fatal one breaks the path)."""
        code = err["code"]
        if protocol.is_fatal(code):
            return self.break_with(CommTimeoutError, self._describe_fatal(err))
        self.region.runtime.take_error(clear=True)
        failed = protocol.Call(err["ops"][self.rank] if err["ops"] else 0, err["seq"])
        if code == protocol.ERROR["mismatch"]:
            e = protocol.mismatch_error(failed, err["field"], err["values"], err["ops"])
        else:
            e = protocol.peer_failed_error(failed, err["peer"], err["message"].decode("utf-8", "replace"))
        if call is not None and call.seq != err["seq"]:
            e = type(e)(f"{e} [reported at call #{call.seq}]")
        if err["num_aborted"] > 1:
            e = type(e)(f"{e} ({err['num_aborted']} calls aborted so far)")
        return e

    def _describe_fatal(self, err: dict) -> str:
        what = protocol.SLOT_NAMES.get(err["slot"], f"slot {err['slot']}")
        if err["code"] == protocol.ERROR["timeout"]:
            if err["peer"] == err["rank"] and err["slot"] >= len(protocol.SLOT_NAMES) - 1:
                text = (f"rank {err['rank']} timed out after {self.timeout_s:.0f}s at '{what}' in call #{err['seq']}: "
                        f"its kernel's blocks were not all resident (lower num_sms)")
            else:
                text = (f"rank {err['rank']} timed out after {self.timeout_s:.0f}s waiting for rank {err['peer']} at "
                        f"'{what}' in call #{err['seq']} (counter {err['observed']}, expected {err['expected']})")
        else:
            text = (f"rank {err['rank']} stopped waiting at '{what}' in call #{err['seq']} because rank {err['peer']} "
                    f"had timed out")
        return self.with_hazard(text)

    @property
    def lazy_hazard(self) -> Optional[str]:
        """Why ranks sharing this GPU may stop each other (lazy module loading), or None."""
        return sharing.lazy_loading_hazard(self.ranks_per_device)

    def with_hazard(self, text: str) -> str:
        """A timeout's message, with what may have caused it where ranks share a GPU."""
        hazard = self.lazy_hazard
        return f"{text} ({hazard})" if hazard else text

    @property
    def host_wait_s(self) -> float:
        """How long the host waits for notify's sizes: the kernels' own timeout, and a margin."""
        return self.timeout_s + 5

    def host_sizes(self, call: protocol.Call, waited: int, info: Optional[dict]) -> dict:
        """What a wait for notify's sizes returned (Runtime::wait_counts: 0 and the sizes, 1 a
        fatal error first, 2 the timeout): the sizes, or the call's error."""
        runtime = self.region.runtime
        if waited == 1:  # a fatal error came first
            raise self.error(runtime.take_error(clear=False), call)
        if waited == 2:
            raise self.break_with(CommTimeoutError, self.with_hazard(
                f"rank {self.rank}: no receive count from the notify kernel of call #{call.seq} within "
                f"{self.host_wait_s:.0f}s"))
        if info["num_rows"] < 0:  # this call was aborted at its exchange, on every rank
            err = runtime.take_error(clear=False)
            if err is not None:
                raise self.error(err, call)
            raise MegatronEPError(f"{call.describe()} was aborted on every rank (the reason was reported earlier)")
        return info
