"""What the cuda backend (megatron_ep/backends/cuda/backend.py) calls on its kernel paths, so that it picks the
normal path once, from the group's shape, and never branches on the topology afterwards.

`Path`: every path (intranode, internode, low-latency) guards a call's host side, reports what
its kernels reported, waits for them, and frees its memory. `NormalPath`: a path of the normal
dispatch / combine (intranode or internode), built with its runtime by `open`; the low-latency
path is a `Path` with calls of its own (megatron_ep/backends/cuda/paths/low_latency.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ContextManager, Optional

from ....core import protocol
from ....core.requests import CombineRequest, DispatchRequest


class Path(ABC):
    @abstractmethod
    def begin(self, call: protocol.Call) -> None:
        """A call's entry check (errors reported since the last call)."""

    @abstractmethod
    def failed(self, call: protocol.Call, exc: BaseException) -> None:
        """The call's host side raised `exc`: if peers may wait for this rank (`call.owes`),
        publish the failure to them (the caller re-raises)."""

    def guard(self, call: protocol.Call) -> ContextManager[protocol.Call]:
        """Around a call's whole host side: begin, and on a failure (the entry check's too) its
        publication before it propagates (protocol.guarded)."""
        return protocol.guarded(self, call)

    @abstractmethod
    def check(self, call: Optional[protocol.Call] = None) -> None:
        """Raise what the kernels reported since the last check (a fatal error breaks the path)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for this path's kernels, then check."""

    @abstractmethod
    def close(self) -> None:
        """Collective: free this path's communication memory (a broken path keeps it)."""


class NormalPath(Path):
    """The normal dispatch / combine on its runtime (`rt`, which the backend's sizing, zero-copy
    inputs and layout use); `world` is what the low-latency path needs of a runtime, over the
    whole group. `close` frees the runtime too."""

    @classmethod
    @abstractmethod
    def open(cls, group, rank: int, num_ranks: int, ranks_per_node: int, hints: dict, num_sms: Optional[int],
             timeout_s: float) -> "NormalPath":
        """Collective: the path and its runtime for this group (`hints`: the Buffer's sizing)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for logs and repr(Buffer)."""

    @abstractmethod
    def dispatch(self, call: protocol.Call, req: DispatchRequest):
        """A dispatch (Buffer checked the contract); returns a DispatchOutput with its handle."""

    @abstractmethod
    def combine(self, call: protocol.Call, req: CombineRequest):
        """A combine along `req.handle`; returns a CombineOutput."""
