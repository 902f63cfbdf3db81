"""Errors of collective calls. Every one names the call, the ranks and what they disagreed on or
waited for; `fatal` says whether the buffer must be re-created (docs/failure-modes.md)."""

from __future__ import annotations


class MegatronEPError(RuntimeError):
    """A collective call of a megatron_ep Buffer failed."""

    fatal = False


class CallMismatchError(MegatronEPError):
    """The ranks called different operations, or the same one with different arguments. The call
    was aborted on every rank before anything moved; the buffer stays usable, except where the
    message says that the ranks' call numbers stay apart. `field` names the signature field,
    `values` every rank's value, `resync` the call number this rank continues from (if the
    backend realigned them)."""

    field = None
    values = None
    resync = None


class PeerFailedError(MegatronEPError):
    """Another rank failed during this call (its message is included) and published it; the call
    was aborted on every rank; the buffer stays usable."""


class PeerFailedFatalError(PeerFailedError):
    """Another rank failed before it joined this call on a path without host handshakes (the
    NVSHMEM paths: low-latency, internode's RDMA domain) and published it: the waits on it
    stopped at once instead of timing out, but the path's buffers are out of step, so the buffer
    must be re-created."""

    fatal = True


class WorstCaseOverflowError(MegatronEPError, ValueError):
    """A worst-case sized dispatch (`num_worst_tokens`) that asked to fail rather than drop rows
    (`on_overflow="raise"`, as megatron_ep.deep_ep does: DeepEP's num_worst_tokens is a
    precondition) would deliver more rows to a rank than its num_worst_tokens. Every rank raises
    it alike, naming each such rank and its count, before any row moves; the buffer stays
    usable. `received` holds every rank's row count, `limits` every rank's num_worst_tokens."""

    received = None
    limits = None


class CommTimeoutError(MegatronEPError):
    """A wait exceeded its timeout (a rank died, hung, or never made the call). The handshakes
    are out of step: the buffer must be re-created."""

    fatal = True


class BufferBusyError(MegatronEPError):
    """A call on a Buffer while another thread of the same process is inside a call on it. One
    rank's calls on a Buffer are one sequence, matched call by call with its peers' sequences:
    they must come from one thread at a time. Raised at once, before anything is sent (the peers
    see nothing of it); the call in progress goes on and the buffer stays usable."""


class BufferBrokenError(MegatronEPError):
    """An earlier fatal error left this buffer unusable; re-create it."""

    fatal = True
