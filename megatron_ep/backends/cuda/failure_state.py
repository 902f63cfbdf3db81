"""The failure state every cuda path keeps, and the one wording of its fatal errors.

A path is healthy, or broken by a fatal error (a timeout, a peer's published failure): `broken`
holds the reason, every later call raises BufferBrokenError naming it, and the path must be
re-created. `published` says that this rank told its peers of a failure that breaks *them* (the
NVSHMEM paths' publications): a collective free would then wait for peers that skip it. The
runtime's in-step publications (a failed call record at a handshake) leave the peers usable and
do not set it.
"""

from __future__ import annotations

from typing import Optional, Type

from ...core.errors import BufferBrokenError, MegatronEPError


class FailureState:
    def __init__(self, kind: str):
        self.kind = kind  # the path, as messages name it: "intranode", "internode", "low-latency"
        self.broken: Optional[str] = None
        self.published = False

    def raise_if_broken(self) -> None:
        if self.broken:
            raise BufferBrokenError(f"megatron_ep: {self.kind} communication failed earlier and this buffer must be "
                                    f"re-created: {self.broken}")

    def break_with(self, error: Type[MegatronEPError], reason: str) -> MegatronEPError:
        """Mark the path broken by `reason`; returns the fatal error to raise."""
        self.broken = reason
        return error(f"megatron_ep: {reason}; this buffer must be re-created")

    @property
    def may_free(self) -> bool:
        """Whether a collective free can expect every peer: not when this path is broken (a peer
        that timed out or died would never join) nor when it published a failure (the peers it
        stopped are broken and skip the free)."""
        return not self.broken and not self.published
